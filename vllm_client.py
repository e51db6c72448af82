"""The vLLM HTTP contract (docs/vllm_api.md), client side; 概要 (Overview): the server the
trainer and the rollout process talk to. The one place that talks HTTP to a vLLM server
(endpoints, timeouts, retries): every other module calls a method here instead of building a URL.
One `VLLMClient` talks to one server; `server_urls` splits `vllm_server_base_url`
("http://a:8000,http://b:8000") into the replicas' URLs. With VLLM_API_KEY set (the variable
`vllm serve --api-key` reads too), every request carries `Authorization: Bearer <key>` (over
plain http to a host that is not loopback, a warning says so).

    purpose          endpoint                              method(s) here
    ---------------  ------------------------------------  --------------------------------------
    health / info    GET  /health                          wait_for_health, healthy
                     GET  /v1/models                       models, max_model_len
                     GET  /server_info?config_format=json  server_info
                     GET  /get_world_size?include_dp=      world_size
                     GET  /metrics  (Prometheus text)      ametrics -> parse_prometheus
    generation       POST /v1/completions                  completions, acompletions
                     POST /inference/v1/generate           agenerate  (--enable-scale-out)
    pause            POST /pause?mode=&clear_cache=        pause
                     POST /resume,  GET /is_paused         resume, is_paused, resume_confirmed
                     POST /reset_prefix_cache              reset_prefix_cache
    weight transfer  POST /init_weight_transfer_engine     init_weight_transfer_engine (collective)
                     POST /start_weight_update             start_weight_update
                     POST /update_weights                  update_weights              (collective)
                     POST /finish_weight_update            finish_weight_update
                     POST /shutdown_weight_transfer_engine shutdown_weight_transfer_engine
                     GET  /weight_info                     weight_info
                     POST /update_weight_version           update_weight_version
    workers          POST /collective_rpc                  collective_rpc  (a worker extension's)
    LoRA             POST /v1/load_lora_adapter            load_lora_adapter    (plain-text reply)
                     POST /v1/unload_lora_adapter          unload_lora_adapter  (plain-text reply)

What a server must be started with for a route to exist is ENABLED_BY; a 404 from one names it.
Retries (spec: vllm_server_timeout bounds every wait and call): the table is on _next_delay.

Departures from TRL 1.16's client and the retries of its rollout worker, one line each:
- 4xx is never retried: a bad request stays bad, and its message reaches the user at once.
- HTTP through libraries: a requests.Session for the trainer's control calls, an aiohttp session
  per event loop for the rollout's; one retry policy over both (errors mapped by _failure).
- wait_for_health caps each probe at the time left, so a short deadline is met to within a poll.
- A collective call is retried only if refused: the server may already wait inside NCCL for it.
- The async pool holds `max_connections` (the rollout passes its concurrency cap, + 1 for the
  /metrics poll); an idle connection the server closed (uvicorn: after 5 s) is replaced.
- `timeout` bounds a call with its retries, each attempt getting what is left: a generation that
  times out has spent it and fails naming the server (the spec retries it, each time in full).
- https:// is the libraries' TLS, verified: a private CA in REQUESTS_CA_BUNDLE and SSL_CERT_FILE.
"""
import asyncio
import ipaddress
import itertools
import logging
import os
import random
import ssl
import time
import urllib.parse

import aiohttp
import orjson
import requests
import urllib3
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

UNVERIFIED = "unverified-"  # a weight version: the server's last sync failed the trainer's check
HEALTH_PROBE_S = 2.0  # one /health probe never waits longer than this
HEALTH_POLL_S = 0.25  # pause between /health probes
REFUSED_RETRIES = 2   # a refused connection: ~1.5 s of backoff, then the server is down
JSON = {"Content-Type": "application/json"}   # bodies are orjson bytes on both paths

# What a vLLM server needs for a route: (what registers it, else a 404 "Not Found"; what
# configures it, else "... not configured"). vllm serve reads the variables at start.
_DEV_MODE = "VLLM_SERVER_DEV_MODE=1 (vllm serve reads it at start)"
_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora (vllm serve reads both at start)"
_TRANSFER = ("--weight-transfer-config '{\"backend\":\"nccl\"}' (on a CPU, our gloo backend: "
             "vllm_plugin/)")
ENABLED_BY = {
    # vLLM's dev and RL routers
    **dict.fromkeys(["/server_info", "/get_world_size", "/pause", "/resume", "/is_paused",
                     "/weight_info", "/reset_prefix_cache", "/weight_checker",
                     "/update_weight_version", "/collective_rpc"], (_DEV_MODE, None)),
    # the same routers, and a weight transfer engine behind them
    **dict.fromkeys(["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update", "/shutdown_weight_transfer_engine"],
                    (_DEV_MODE, _TRANSFER)),
    # runtime LoRA updating
    **dict.fromkeys(["/v1/load_lora_adapter", "/v1/unload_lora_adapter"], (_LORA, None)),
}

Samples = dict[str, list[tuple[dict[str, str], float]]]
Reply = tuple[int, bytes]   # (HTTP status, body)


class VLLMError(RuntimeError):
    """A vLLM server refused or failed a call. `message` is the server's message (with the fix,
    where it is known); `status` the HTTP code."""

    def __init__(self, message: str, url: str, status: int | None = None):
        where = url if status is None else f"{url} -> HTTP {status}"
        super().__init__(f"{where}: {message}")
        self.message = message
        self.url = url
        self.status = status


def server_urls(config_or_url) -> list[str]:
    """The server URLs of `vllm_server_base_url` (a config or the string): comma-separated, one
    per replica.

    >>> server_urls("http://a:8000/, http://b:8000")
    ['http://a:8000', 'http://b:8000']
    """
    text = config_or_url if isinstance(config_or_url, str) else config_or_url.vllm_server_base_url
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls or len(set(urls)) < len(urls):
        raise ValueError(f"vllm_server_base_url={text!r}: give one or more distinct server URLs, "
                         "comma-separated")
    return urls


def _server_message(status: int, body: bytes) -> str:
    """The error text out of vLLM's (or FastAPI's, or a proxy's) error body."""
    try:
        parsed = orjson.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:1000] or f"HTTP {status}"
    if isinstance(parsed, dict):
        for key in ("error", "message", "detail"):
            if key in parsed:
                inner = parsed[key]
                return str(inner.get("message", inner) if isinstance(inner, dict) else inner)
    return str(parsed)


def _field(url: str, reply: Reply, *keys: str):
    """`json(body)[keys[0]][keys[1]]...`, or a VLLMError that shows what came instead."""
    status, body = reply
    try:
        value = orjson.loads(body)
    except ValueError:
        value = None
    shown = body[:200].decode("utf-8", "replace")
    if not isinstance(value, dict):
        raise VLLMError(f"expected a JSON object, got {shown!r}", url, status)
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise VLLMError(f"reply has no {'.'.join(keys)!r}: {shown!r}", url, status)
        value = value[key]
    return value


def _cause(error: Exception) -> Exception:
    """The exception that says what happened: requests wraps urllib3's (in a MaxRetryError)."""
    inner = error.args[0] if isinstance(error, requests.RequestException) and error.args else None
    inner = getattr(inner, "reason", inner)
    return inner if isinstance(inner, Exception) else error


def _failure(error: Exception) -> str:
    """A failed request in the retry policy's words, whichever library raised it: "refused" (no
    connection, so nothing was sent: a refused or failed connect, a TLS handshake), "timeout",
    "dropped" (the connection broke, or the reply was cut or malformed), else "other"."""
    cause = _cause(error)
    if isinstance(error, (aiohttp.ClientConnectorError, requests.exceptions.SSLError)) or (
            isinstance(cause, urllib3.exceptions.NewConnectionError)):
        return "refused"
    if isinstance(error, (TimeoutError, requests.Timeout)) or (     # aiohttp's: TimeoutErrors
            isinstance(cause, urllib3.exceptions.TimeoutError)):
        return "timeout"
    if isinstance(error, (requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
                          aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                          aiohttp.ClientResponseError)):
        return "dropped"
    return "other"


def parse_prometheus(text: str) -> Samples:
    """Prometheus text exposition (prometheus_client's parser, what vLLM serves /metrics with) ->
    {sample name: [(labels, value), ...]}; ValueError on text that is not one.

    >>> parse_prometheus('# TYPE vllm:num_requests_running gauge\\n'
    ...                  'vllm:num_requests_running{engine="0",model_name="toy"} 3.0\\n')
    {'vllm:num_requests_running': [({'engine': '0', 'model_name': 'toy'}, 3.0)]}
    """
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


WARNED: set[str] = set()    # URLs whose plain-http API key was said (once per process)


def plain_http_off_host(url: str) -> bool:
    """An http:// URL whose host is not loopback (names are not resolved: only localhost is)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname == "localhost":
        return False
    try:
        return not ipaddress.ip_address(parts.hostname or "").is_loopback
    except ValueError:
        return True


class VLLMClient:
    """HTTP client for one vLLM server: a base URL, a requests.Session for the sync calls, an
    aiohttp session per event loop for the async ones, a retry counter."""

    def __init__(self, base_url: str, timeout: float = 1800.0, max_retries: int = 8,
                 backoff: float = 0.5, max_backoff: float = 16.0, max_connections: int = 100):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_connections = max_connections   # the async pool's size (aiohttp's default: 100)
        self.retry_total = 0  # retries so far, sync and async (rollout/vllm_retry_total)
        key = os.environ.get("VLLM_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        if key and plain_http_off_host(self.base_url) and self.base_url not in WARNED:
            WARNED.add(self.base_url)
            log.warning("VLLM_API_KEY goes to %s over plain http, readable on the way: use "
                        "https (a TLS proxy in front of vllm serve), an SSH tunnel to "
                        "127.0.0.1, or a network only the trainer and servers share",
                        self.base_url)
        self._session = self._sync_session()
        self._aio: aiohttp.ClientSession | None = None   # made in, and tied to, ...
        self._aio_loop: asyncio.AbstractEventLoop | None = None   # ... this event loop
        self._info: dict | None = None                    # server_info(), once read

    def _sync_session(self) -> requests.Session:
        session = requests.Session()
        session.headers.update(self._headers)
        return session

    def _async_session(self) -> aiohttp.ClientSession:
        """The running loop's aiohttp session, made on its first request (a session belongs to
        one loop: asyncio.run again gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._aio_loop is not loop:
            tls = ssl.create_default_context() if self.base_url.startswith("https:") else True
            self._aio = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, ssl=tls),
                headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._aio_loop = loop
        return self._aio

    # ---- the retry policy, shared by the sync and async paths ----

    def _next_delay(self, method: str, path: str, kind: str, attempt: int, retries: int,
                    reply: Reply | None, error: Exception | None, left: float) -> float | None:
        """None if `reply` is the answer; else the seconds to sleep before retrying; else raise.

        kind: "generation" | "control" | "weights" | "collective"; `error` (requests' or
        aiohttp's) in _failure's words. The policy (spec: `vllm_server_timeout` bounds waiting
        for the server, each generation request and each weight-sync call; here each call with
        its retries):

            answer / error                   generation     control        weights, collective
            2xx                              return         return         return
            4xx                              VLLMError now  VLLMError now  VLLMError now
            5xx (503 = paused server)        retry          retry          VLLMError now
            refused (never sent)             retry (REFUSED_RETRIES at most: nothing listens)
            dropped mid-request or reply     retry          retry          weights: retry;
                                                                           collective: VLLMError
            timeout (what is left of         VLLMError:     TimeoutError   TimeoutError now
            `timeout`)                       budget spent

        Retry k (k = 0, 1, ...) sleeps min(max_backoff, backoff * 2**k) * U(0.9, 1.1); after
        `retries` retries (max_retries unless the call sets its own), or when the sleep would end
        past the request's budget (`left`: seconds of `timeout` left, retries included), the last
        error is raised as VLLMError naming the URL, the attempts and the cause. A collective call
        (init_weight_transfer_engine, update_weights) blocks inside NCCL on the server, paired with
        the trainer's own send: once it may have reached the server, a retry would wait for a send
        that already happened. vLLM answers a refused weight-sync call with a 500 (its worker
        raised): the same call would be refused again. A 401 and a missing route name the fix.
        """
        url = self.base_url + path
        if reply is not None:
            status = reply[0]
            if status < 400:
                return None
            message = self._explain(path, status, _server_message(*reply))
            if status < 500 or kind in ("weights", "collective"):
                raise VLLMError(message, url, status)
            last = f"HTTP {status}: {message}"
        else:
            status, failure = None, _failure(error)
            if failure == "timeout" and kind != "generation":
                raise TimeoutError(f"{method} {url} timed out after {self.timeout:g}s "
                                   f"(vllm_server_timeout); {kind} calls are not retried"
                                   ) from error
            cause = _cause(error)
            last = f"{failure}: {type(cause).__name__}: {cause}"
            if failure == "other" or (failure != "refused" and kind == "collective"):
                raise VLLMError(f"{method} failed: {last}", url) from error
            if failure == "refused":                # a server that died: say so in seconds
                retries = min(retries, REFUSED_RETRIES)
        delay = min(self.max_backoff, self.backoff * 2 ** attempt) * random.uniform(0.9, 1.1)
        if attempt >= retries or delay >= left:
            spent = "" if attempt >= retries else f" in vllm_server_timeout={self.timeout:g}s"
            message = f"{method} gave up after {attempt + 1} attempts{spent}; last error: {last}"
            raise VLLMError(message, url, status) from error
        self.retry_total += 1
        log.warning("%s %s failed (%s); retry %d/%d in %.2fs", method, url, last, attempt + 1,
                    retries, delay)
        return delay

    def _explain(self, path: str, status: int, message: str) -> str:
        """The server's refusal, with the fix where it is known: a 401 (the key), a route the
        server was not started with (a 404 "Not Found", ENABLED_BY), no weight transfer."""
        if status == 401:
            if self._headers:
                return (message + ": it refused the key in VLLM_API_KEY; set the key it was "
                        "started with")
            return (message + ": the server was started with --api-key; set VLLM_API_KEY to "
                    "that key")
        route = path.partition("?")[0]
        registers, configures = ENABLED_BY.get(route, (None, None))
        if registers and status == 404 and message.startswith("Not Found"):
            return (f"the vLLM server at {self.base_url} answers 404 to {route}: start it with "
                    f"{registers}")
        if configures and "not configured" in message:
            return (f"the vLLM server at {self.base_url} has no weight transfer engine "
                    f"({route}: {message}): start it with {configures}")
        return message

    def _request(self, method: str, path: str, kind: str = "control", retries: int | None = None,
                 json=None) -> Reply:
        retries = self.max_retries if retries is None else retries
        data = None if json is None else orjson.dumps(json)
        deadline = time.monotonic() + self.timeout      # the whole call, its retries included
        for attempt in itertools.count():
            try:
                r = self._session.request(method, self.base_url + path, data=data,
                                          headers=JSON if data else None,
                                          timeout=deadline - time.monotonic())
                reply, error = (r.status_code, r.content), None
            except requests.RequestException as e:
                reply, error = None, e
            delay = self._next_delay(method, path, kind, attempt, retries, reply, error,
                                     deadline - time.monotonic())
            if delay is None:
                return reply
            time.sleep(delay)

    async def _arequest(self, method: str, path: str, kind: str = "control", json=None) -> Reply:
        session = self._async_session()
        url = self.base_url + path
        data = None if json is None else orjson.dumps(json)
        deadline = time.monotonic() + self.timeout      # the whole call, its retries included
        for attempt in itertools.count():
            budget = aiohttp.ClientTimeout(total=deadline - time.monotonic())
            try:
                async with session.request(method, url, data=data, timeout=budget,
                                           headers=JSON if data else None) as r:
                    reply, error = (r.status, await r.read()), None
            except (aiohttp.ClientError, TimeoutError) as e:
                reply, error = None, e
            delay = self._next_delay(method, path, kind, attempt, self.max_retries, reply, error,
                                     deadline - time.monotonic())
            if delay is None:
                return reply
            await asyncio.sleep(delay)

    # ---- health and server info ----

    def wait_for_health(self, timeout: float | None = None) -> None:
        """Poll GET /health until it answers 200; TimeoutError after `timeout` s (default: the
        client's)."""
        limit = self.timeout if timeout is None else timeout
        url = self.base_url + "/health"
        deadline = time.monotonic() + limit
        last = "no probe finished"
        while (left := deadline - time.monotonic()) > 0:
            try:
                status = self._session.get(url, timeout=min(HEALTH_PROBE_S, left)).status_code
                if status == 200:
                    return
                last = f"HTTP {status}"
            except requests.RequestException as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(max(0.0, min(HEALTH_POLL_S, deadline - time.monotonic())))
        raise TimeoutError(f"vLLM server at {url} was not healthy within {limit:g}s (last probe: "
                           f"{last}); is it running, and is vllm_server_base_url right?")

    def healthy(self) -> bool:
        """One GET /health probe (HEALTH_PROBE_S at most, no retry) over a connection of its own:
        does the server answer 200? (It follows a failure, after which a pooled connection may
        be one the server closed: uvicorn closes one after a 500.)"""
        try:
            return requests.get(self.base_url + "/health", headers=self._headers,
                                timeout=HEALTH_PROBE_S).status_code == 200
        except requests.RequestException:
            return False

    def _json(self, method: str, path: str, *keys: str, kind: str = "control", json=None):
        """The reply's JSON value at `keys` (_field), of a sync call with the retry policy."""
        return _field(self.base_url + path, self._request(method, path, kind, json=json), *keys)

    def models(self) -> dict:
        return self._json("GET", "/v1/models")

    def max_model_len(self) -> int:
        """The base model card's max_model_len (adapter cards have a `parent` and no length)."""
        for card in self.models().get("data", []):
            if card.get("parent") is None and card.get("max_model_len"):
                return int(card["max_model_len"])
        raise VLLMError("no base model card with max_model_len in /v1/models",
                        self.base_url + "/v1/models")

    def server_info(self) -> dict:
        """/server_info's vllm_config, read once: a server's configuration does not change while
        it runs, and several start checks read it."""
        if self._info is None:
            self._info = self._json("GET", "/server_info?config_format=json", "vllm_config")
        return self._info

    def world_size(self, include_dp: bool = True) -> int:
        return int(self._json("GET", f"/get_world_size?include_dp={str(include_dp).lower()}",
                              "world_size"))

    # ---- generation ----

    def completions(self, body: dict) -> dict:
        return self._json("POST", "/v1/completions", kind="generation", json=body)

    # ---- pause / resume / cache ----

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """mode: abort | wait | keep. clear_cache=True preempts running requests even with keep in
        vLLM <= 0.33's engine, though 0.33 documents it as ignored there: reset_prefix_cache says
        it explicitly."""
        self._request("POST", f"/pause?mode={mode}&clear_cache={str(clear_cache).lower()}")

    def reset_prefix_cache(self) -> None:
        """Drop every cached KV block, preempting the running requests (they recompute theirs
        after /resume): after a weight update no block of the old weights is served."""
        if not self._json("POST", "/reset_prefix_cache?reset_running_requests=true", "success"):
            raise VLLMError("/reset_prefix_cache answered success=false", self.base_url)

    def resume(self, retries: int | None = None) -> None:
        self._request("POST", "/resume", retries=retries)

    def resume_confirmed(self, retries: int = 0) -> str | None:
        """After a failure: resume over a fresh connection (uvicorn closes one after a 500, so a
        pooled one may be dead), once by default (the run is ending; a dead server would only be
        retried for a minute), and confirm with GET /is_paused. None if the server runs again,
        else why it may still be paused, with the command that resumes it."""
        self._session.close()
        self._session = self._sync_session()
        try:
            self.resume(retries)
            if not self.is_paused():
                return None
            why = "it still reports is_paused=true"
        except (VLLMError, TimeoutError) as e:
            why = str(e)
        return (f"{self.base_url} may still be paused ({why}); resume it with "
                f"`curl -X POST {self.base_url}/resume`")

    def is_paused(self) -> bool:
        return bool(self._json("GET", "/is_paused", "is_paused"))

    # ---- weight transfer (the order is: init once; then per sync start, update, finish) ----

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Blocks until the trainer (rank 0) joins the group: call it in a thread next to the
        trainer's init."""
        self._request("POST", "/init_weight_transfer_engine", "collective",
                      json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "/start_weight_update", "weights")

    def update_weights(self, update_info: dict | list[dict]) -> None:
        """Blocks until the workers received and loaded the tensors the trainer broadcasts
        meanwhile."""
        self._request("POST", "/update_weights", "collective", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._request("POST", "/finish_weight_update", "weights", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        """Release the server's end of the weight-transfer group (vLLM refuses it during an
        update): a broadcast it never took ends at once."""
        self._request("POST", "/shutdown_weight_transfer_engine", "weights", retries=0)

    def weight_info(self) -> str:
        return str(self._json("GET", "/weight_info", "weight_version"))

    def update_weight_version(self, version: str) -> None:
        """Relabel the weights the server holds (a sync that failed verification: "unverified-N",
        so the rollout process stops routing to it)."""
        self._request("POST", "/update_weight_version", "weights", json={"new_version": version})

    def weight_checker(self, action: str, baseline: dict | None = None) -> dict:
        """action: checksum | reset | compare (compare needs `baseline`, a checksum reply's
        `checksums`)."""
        body = {"action": action} if baseline is None else {"action": action, "baseline": baseline}
        return self._json("POST", "/weight_checker", json=body)

    def collective_rpc(self, method: str, *args: str) -> list:
        """POST /collective_rpc (vLLM's dev mode): `method` on every worker, e.g. one a
        --worker-extension-cls adds, with string arguments (vLLM passes them as they come: the
        method decodes them); each worker's result, in order. A 5xx (vLLM's answer when a
        worker has no such method, or it raised) is not retried."""
        return self._json("POST", "/collective_rpc", "results", kind="weights",
                          json={"method": method, "args": list(args)})

    # ---- LoRA (success replies are plain text) ----

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> str:
        body = {"lora_name": name, "lora_path": path, "load_inplace": load_inplace}
        return self._request("POST", "/v1/load_lora_adapter", json=body)[1].decode()

    def unload_lora_adapter(self, name: str) -> str:
        reply = self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        return reply[1].decode()

    def close(self) -> None:
        self._session.close()

    # ---- async, for the rollout process's event loop ----

    async def _ajson(self, method: str, path: str, kind: str = "control", json=None):
        """The reply's JSON object (_field), of an async call with the retry policy."""
        return _field(self.base_url + path, await self._arequest(method, path, kind, json=json))

    async def acompletions(self, body: dict) -> dict:
        return await self._ajson("POST", "/v1/completions", "generation", json=body)

    async def agenerate(self, body: dict) -> dict:
        return await self._ajson("POST", "/inference/v1/generate", "generation", json=body)

    async def ametrics(self) -> Samples | None:
        """Parsed GET /metrics, or None when the server has none (404)."""
        try:
            body = (await self._arequest("GET", "/metrics"))[1]
        except VLLMError as e:
            if e.status == 404:
                return None
            raise
        try:
            return parse_prometheus(body.decode("utf-8", "replace"))
        except ValueError as e:
            raise VLLMError(f"/metrics is not Prometheus text: {e}", self.base_url) from e

    async def aclose(self) -> None:
        """Close this loop's session (one left by an earlier, closed loop is dropped)."""
        if self._aio is not None and self._aio_loop is asyncio.get_running_loop():
            await self._aio.close()
        self._aio = self._aio_loop = None
