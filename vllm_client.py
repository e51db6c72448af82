"""The vLLM HTTP contract (reference/vllm_api.md), client side; 概要 (Overview): the server the
trainer and the rollout process talk to. The one place that talks HTTP to a vLLM server
(endpoints, timeouts, retries): every other module calls a method here instead of building a URL.
One `VLLMClient` talks to one server; `server_urls` splits `vllm_server_base_url`
("http://a:8000,http://b:8000") into the replicas' URLs. With VLLM_API_KEY set (the variable
`vllm serve --api-key` reads too), every request carries `Authorization: Bearer <key>`.

    purpose          endpoint                              method(s) here
    ---------------  ------------------------------------  --------------------------------------
    health / info    GET  /health                          wait_for_health
                     GET  /v1/models                       models, max_model_len
                     GET  /server_info?config_format=json  server_info              (dev mode)
                     GET  /get_world_size?include_dp=      world_size               (dev mode)
                     GET  /metrics  (Prometheus text)      ametrics -> parse_prometheus
    generation       POST /v1/completions                  completions, acompletions
                     POST /inference/v1/generate           agenerate  (--enable-scale-out)
    pause            POST /pause?mode=&clear_cache=        pause
                     POST /resume,  GET /is_paused         resume, is_paused, resume_confirmed
    weight transfer  POST /init_weight_transfer_engine     init_weight_transfer_engine (collective)
                     POST /start_weight_update             start_weight_update
                     POST /update_weights                  update_weights              (collective)
                     POST /finish_weight_update            finish_weight_update
                     GET  /weight_info, POST /weight_checker  weight_info, weight_checker
    LoRA             POST /v1/load_lora_adapter            load_lora_adapter    (replies plain text)
                     POST /v1/unload_lora_adapter          unload_lora_adapter  (replies plain text)

Retries (spec: vllm_server_timeout bounds every wait and call): the table is on _next_delay.

Departures from TRL's client (reference/trl_async_grpo_notes.md §2, §6.6), one line each:
- 4xx is never retried: a bad request stays bad, and its message reaches the user at once.
- One library (httpx) and one retry policy for the sync and async paths, no nested retry loops.
- wait_for_health caps each probe at the time left, so a short deadline is met to within a poll.
- A collective call is retried only if refused: the server may already wait inside NCCL for it.
- Connection pools are unbounded: the rollout's adaptive cap bounds concurrency, not the pool.
- Async requests over http:// speak HTTP/1.1 on asyncio streams themselves (_Wire), a stack of
  keep-alive connections: httpx + httpcore cost 0.54 ms of CPU a request, half the rollout
  process's (python -m tools.bench rollout). https:// keeps httpx, one client per connection.
- `timeout` is httpx's per phase; a non-streamed reply sends nothing until done, so it bounds all.
"""
import asyncio
import logging
import os
import random
import re
import time

import httpx
import orjson

log = logging.getLogger(__name__)

HEALTH_PROBE_S = 2.0  # one /health probe never waits longer than this
HEALTH_POLL_S = 0.25  # pause between /health probes
REFUSED_RETRIES = 2   # a refused connection: ~1.5 s of backoff, then the server is down
# Unbounded pools (the caller bounds concurrency); idle connections are dropped before uvicorn's 5 s
# keep-alive closes them under us. An async client holds one connection (see _arequest).
_POOL = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
_ONE = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=2.0)

Samples = dict[str, list[tuple[dict[str, str], float]]]


class _Reply:
    """What _Wire returns: the parts of an httpx.Response the policy and the callers read (an
    httpx.Response and its Request cost ~10% of the rollout process's CPU)."""

    def __init__(self, status_code: int, content: bytes, url: str):
        self.status_code = status_code
        self.content = content
        self.url = url
        self.reason_phrase = f"HTTP {status_code}"

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        return orjson.loads(self.content)       # raises ValueError (JSONDecodeError), as json


class _Wire:
    """One keep-alive HTTP/1.1 connection to an http:// server on asyncio streams, for the async
    path: a request is written in one go and its reply read by Content-Length (or chunked, or to
    the close); failures raise httpx's transport errors, so the retry policy is the same. A reused
    connection the server closed while idle (uvicorn: after 5 s) is reopened once, before any
    byte of the reply came: the request never reached the server."""

    def __init__(self, host: str, port: int, headers: dict[str, str]):
        self.host, self.port = host, port
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        name = f"[{host}]" if ":" in host else host            # an IPv6 literal
        self.head = f"Host: {name}:{port}\r\nUser-Agent: async-grpo\r\n{extra}"
        self.streams = None                      # (reader, writer) while open ...
        self.loop = None                         # ... on this event loop

    async def request(self, method: str, url: str, target: str, body: bytes | None,
                      timeout: float) -> _Reply:
        data = body or b""
        head = (f"{method} {target} HTTP/1.1\r\n{self.head}Content-Length: {len(data)}\r\n"
                + ("Content-Type: application/json\r\n" if body is not None else "") + "\r\n")
        message = head.encode() + data
        if self.loop is not asyncio.get_running_loop():
            self.streams = None                  # opened on an earlier loop (asyncio.run again)
        try:
            async with asyncio.timeout(timeout):
                for fresh in ((False, True) if self.streams else (True,)):
                    if fresh:
                        await self._open()
                    got = await self._exchange(message, url, retry_on_close=not fresh)
                    if got is not None:
                        return got
        except TimeoutError as e:
            self.close()
            raise httpx.ReadTimeout(f"no reply within {timeout:g}s") from e
        except asyncio.IncompleteReadError as e:
            self.close()
            raise httpx.RemoteProtocolError("Server disconnected mid-reply.") from e
        except OSError as e:
            self.close()
            raise httpx.ReadError(f"{type(e).__name__}: {e}") from e
        raise AssertionError("unreachable")

    async def _open(self) -> None:
        self.close()
        try:
            self.streams = await asyncio.open_connection(self.host, self.port)
            self.loop = asyncio.get_running_loop()
        except OSError as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}") from e

    async def _exchange(self, message: bytes, url: str,
                        retry_on_close: bool) -> _Reply | None:
        reader, writer = self.streams
        writer.write(message)
        status_line = await reader.readline()
        if not status_line:                      # closed before any byte of the reply
            self.close()
            if retry_on_close:
                return None
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        try:
            status = int(status_line.split(None, 2)[1])
        except (IndexError, ValueError) as e:
            raise httpx.RemoteProtocolError(f"malformed status line {status_line[:80]!r}") from e
        if "content-length" in headers:
            content = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int((await reader.readline()).split(b";")[0], 16):
                parts.append(await reader.readexactly(size))
                await reader.readline()
            await reader.readline()
            content = b"".join(parts)
        else:
            content = await reader.read()
            headers["connection"] = "close"
        if headers.get("connection", "").lower() == "close":
            self.close()
        return _Reply(status, content, url)

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


class VLLMError(RuntimeError):
    """A vLLM server refused or failed a call. `message` is the server's message; `status` the
    HTTP code."""

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
    text = config_or_url
    if not isinstance(config_or_url, str):
        text = config_or_url.vllm_server_base_url
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls or len(set(urls)) < len(urls):
        raise ValueError(f"vllm_server_base_url={text!r}: give one or more distinct server URLs, "
                         "comma-separated")
    return urls


def _server_message(response: httpx.Response) -> str:
    """The error text out of vLLM's (or FastAPI's, or a proxy's) error body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:1000] or response.reason_phrase
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            if key in body:
                inner = body[key]
                return str(inner.get("message", inner) if isinstance(inner, dict) else inner)
    return str(body)


def _field(response: httpx.Response, *keys: str):
    """`response.json()[keys[0]][keys[1]]...`, or a VLLMError that shows what came instead."""
    try:
        value = response.json()
    except ValueError:
        value = None
    where = str(response.url)
    status = response.status_code
    if not isinstance(value, dict):
        raise VLLMError(f"expected a JSON object, got {response.text[:200]!r}", where, status)
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise VLLMError(f"reply has no {'.'.join(keys)!r}: {response.text[:200]!r}", where,
                            status)
        value = value[key]
    return value


_SAMPLE = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_]\w*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def _unescape(m: re.Match) -> str:
    """A label value's escape: \\n is a newline, \\x is x."""
    return "\n" if m[1] == "n" else m[1]


def parse_prometheus(text: str) -> Samples:
    """Prometheus text exposition -> {metric name: [(labels, value), ...]}; comments and odd
    lines skipped.

    >>> parse_prometheus('# TYPE vllm:num_requests_running gauge\\n'
    ...                  'vllm:num_requests_running{engine="0",model_name="toy"} 3.0\\n')
    {'vllm:num_requests_running': [({'engine': '0', 'model_name': 'toy'}, 3.0)]}
    """
    samples: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        match = None if line.startswith("#") else _SAMPLE.match(line)  # a timestamp may follow
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)  # accepts NaN, +Inf, -Inf
        except ValueError:
            continue
        parsed = {k: _ESCAPE.sub(_unescape, v) for k, v in _LABEL.findall(labels or "")}
        samples.setdefault(name, []).append((parsed, number))
    return samples


class VLLMClient:
    """HTTP client for one vLLM server: a base URL, a sync and an async connection pool, a retry
    counter."""

    def __init__(self, base_url: str, timeout: float = 1800.0, max_retries: int = 8,
                 backoff: float = 0.5, max_backoff: float = 16.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.retry_total = 0  # retries so far, sync and async (rollout/vllm_retry_total)
        key = os.environ.get("VLLM_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(timeout=timeout, limits=_POOL, headers=self._headers)
        self._idle: list[httpx.AsyncClient] = []   # async clients free for a request (a stack) ...
        self._asyncs: list[httpx.AsyncClient] = []  # ... and all of them, tied to one event loop
        self._ssl = None                            # one TLS context shared by the async clients
        parts = httpx.URL(self.base_url)
        self._wire = ((parts.host, parts.port or 80) if parts.scheme == "http" else None)
        self._prefix = parts.raw_path.decode().rstrip("/")   # a base URL's own path, if any
        self._wires: list[_Wire] = []               # http://: free connections (a stack)

    # ---- the retry policy, shared by the sync and async paths ----

    def _next_delay(self, method: str, url: str, kind: str, attempt: int, retries: int,
                    response: httpx.Response | None,
                    error: httpx.TransportError | None) -> float | None:
        """None if `response` is the answer; else the seconds to sleep before retrying; else raise.

        kind: "generation" | "control" | "weights" | "collective". The policy (spec:
        `vllm_server_timeout` bounds waiting for the server, each generation request and each
        weight-sync call; waiting and weight sync raise on timeout, generation retries):

            answer / error                   generation     control        weights, collective
            2xx                              return         return         return
            4xx                              VLLMError now  VLLMError now  VLLMError now
            5xx (503 = paused server)        retry          retry          VLLMError now
            connection refused (never sent)  retry (REFUSED_RETRIES at most: nothing listens)
            connection dropped mid-request   retry          retry          weights: retry;
                                                                           collective: VLLMError
            timeout (`timeout` s)            retry (async:  TimeoutError   TimeoutError now
                                             VLLMError now
                                             if /health
                                             fails too)

        Retry k (k = 0, 1, ...) sleeps min(max_backoff, backoff * 2**k) * U(0.9, 1.1); after
        `retries` retries (max_retries unless the call sets its own) the last error is raised as
        VLLMError naming the URL, the attempts and the cause. A collective call
        (init_weight_transfer_engine, update_weights) blocks inside NCCL on the server, paired with
        the trainer's own send: once it may have reached the server, a retry would wait for a send
        that already happened. vLLM answers a refused weight-sync call with a 500 (its worker
        raised): the same call would be refused again. A 401 names the fix.
        """
        if response is not None:
            if response.status_code < 400:
                return None
            status, message = response.status_code, _server_message(response)
            if status == 401:
                if self._headers:
                    message += (": it refused the key in VLLM_API_KEY; set the key it was "
                                "started with")
                else:
                    message += (": the server was started with --api-key; set VLLM_API_KEY to "
                                "that key")
            if status < 500 or kind in ("weights", "collective"):
                raise VLLMError(message, url, status)
            last = f"HTTP {status}: {message}"
        elif isinstance(error, httpx.TimeoutException) and kind != "generation":
            raise TimeoutError(f"{method} {url} timed out after {self.timeout:g}s "
                               f"(vllm_server_timeout); {kind} calls are not retried") from error
        elif isinstance(error, httpx.ConnectError) or (kind != "collective" and isinstance(
                error, (httpx.NetworkError, httpx.RemoteProtocolError, httpx.TimeoutException))):
            status = None
            last = f"{type(error).__name__}: {error}"
            if isinstance(error, httpx.ConnectError):     # a server that died: say so in seconds
                retries = min(retries, REFUSED_RETRIES)
        else:
            raise VLLMError(f"{method} failed: {type(error).__name__}: {error}", url) from error
        if attempt >= retries:
            message = f"{method} gave up after {attempt + 1} attempts; last error: {last}"
            raise VLLMError(message, url, status) from error
        self.retry_total += 1
        delay = min(self.max_backoff, self.backoff * 2 ** attempt) * random.uniform(0.9, 1.1)
        log.warning("%s %s failed (%s); retry %d/%d in %.2fs", method, url, last, attempt + 1,
                    retries, delay)
        return delay

    def _request(self, method: str, path: str, kind: str = "control", retries: int | None = None,
                 **kwargs) -> httpx.Response:
        url = self.base_url + path
        retries = self.max_retries if retries is None else retries
        attempt = 0
        while True:
            try:
                response, error = self._client.request(method, url, **kwargs), None
            except httpx.TransportError as e:
                response, error = None, e
            delay = self._next_delay(method, url, kind, attempt, retries, response, error)
            if delay is None:
                return response
            time.sleep(delay)
            attempt += 1

    async def _arequest(self, method: str, path: str, kind: str = "control",
                        json=None) -> httpx.Response:
        """One request on a connection of its own: the newest free one, or a new one (at most as
        many as requests were ever in flight at once). http://: a _Wire; https://: an httpx
        client with one connection (httpcore's pool checks every connection it holds each time
        a request starts or ends: over one shared pool of the rollout's ~64 connections that was
        half of the rollout process's CPU, python -m tools.bench rollout --profile)."""
        url = self.base_url + path
        if self._wire is not None:
            conn = self._wires.pop() if self._wires else _Wire(*self._wire, self._headers)
            free = self._wires
            body = None if json is None else orjson.dumps(json)
            target = self._prefix + path

            def send():
                return conn.request(method, url, target, body, self.timeout)
        else:
            if self._idle:
                conn = self._idle.pop()
            else:
                if self._ssl is None:
                    self._ssl = httpx.create_ssl_context()   # 20 ms, so made once
                conn = httpx.AsyncClient(timeout=self.timeout, limits=_ONE,
                                         headers=self._headers, verify=self._ssl)
                self._asyncs.append(conn)
            free = self._idle

            def send():
                return conn.request(method, url, json=json)
        attempt = 0
        try:
            while True:
                try:
                    response, error = await send(), None
                except httpx.TransportError as e:
                    response, error = None, e
                if (kind == "generation" and isinstance(error, httpx.TimeoutException)
                        and not await asyncio.to_thread(self.healthy)):
                    raise VLLMError(f"{method} got no answer within {self.timeout:g}s "
                                    f"(vllm_server_timeout), nor GET /health within "
                                    f"{HEALTH_PROBE_S:g}s: the server is hung", url) from error
                delay = self._next_delay(method, url, kind, attempt, self.max_retries, response,
                                         error)
                if delay is None:
                    return response
                await asyncio.sleep(delay)
                attempt += 1
        finally:
            free.append(conn)

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
                status = self._client.get(url, timeout=min(HEALTH_PROBE_S, left)).status_code
                if status == 200:
                    return
                last = f"HTTP {status}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(max(0.0, min(HEALTH_POLL_S, deadline - time.monotonic())))
        raise TimeoutError(f"vLLM server at {url} was not healthy within {limit:g}s (last probe: "
                           f"{last}); is it running, and is vllm_server_base_url right?")

    def healthy(self) -> bool:
        """One GET /health probe (HEALTH_PROBE_S at most, no retry): does the server answer 200?"""
        try:
            return self._client.get(self.base_url + "/health",
                                    timeout=HEALTH_PROBE_S).status_code == 200
        except httpx.TransportError:
            return False

    def models(self) -> dict:
        return _field(self._request("GET", "/v1/models"))

    def max_model_len(self) -> int:
        """The base model card's max_model_len (adapter cards have a `parent` and no length)."""
        for card in self.models().get("data", []):
            if card.get("parent") is None and card.get("max_model_len"):
                return int(card["max_model_len"])
        raise VLLMError("no base model card with max_model_len in /v1/models",
                        self.base_url + "/v1/models")

    def server_info(self) -> dict:
        return _field(self._request("GET", "/server_info?config_format=json"), "vllm_config")

    def world_size(self, include_dp: bool = True) -> int:
        path = f"/get_world_size?include_dp={str(include_dp).lower()}"
        return int(_field(self._request("GET", path), "world_size"))

    # ---- generation ----

    def completions(self, body: dict) -> dict:
        return _field(self._request("POST", "/v1/completions", "generation", json=body))

    # ---- pause / resume / cache ----

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """mode: abort | wait | keep. Note: clear_cache=True preempts running requests even with
        keep."""
        self._request("POST", f"/pause?mode={mode}&clear_cache={str(clear_cache).lower()}")

    def resume(self, retries: int | None = None) -> None:
        self._request("POST", "/resume", retries=retries)

    def resume_confirmed(self, retries: int = 0) -> str | None:
        """After a failure: resume over a fresh connection (uvicorn closes one after a 500, so a
        pooled one may be dead), once by default (the run is ending; a dead server would only be
        retried for a minute), and confirm with GET /is_paused. None if the server runs again,
        else why it may still be paused, with the command that resumes it."""
        self._client.close()
        self._client = httpx.Client(timeout=self.timeout, limits=_POOL, headers=self._headers)
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
        return bool(_field(self._request("GET", "/is_paused"), "is_paused"))

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

    def weight_info(self) -> str:
        return str(_field(self._request("GET", "/weight_info"), "weight_version"))

    def weight_checker(self, action: str, baseline: dict | None = None) -> dict:
        """action: checksum | reset | compare (compare needs `baseline`, a checksum reply's
        `checksums`)."""
        body = {"action": action} if baseline is None else {"action": action, "baseline": baseline}
        return _field(self._request("POST", "/weight_checker", json=body))

    # ---- LoRA (success replies are plain text) ----

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> str:
        body = {"lora_name": name, "lora_path": path, "load_inplace": load_inplace}
        return self._request("POST", "/v1/load_lora_adapter", json=body).text

    def unload_lora_adapter(self, name: str) -> str:
        return self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name}).text

    def close(self) -> None:
        self._client.close()

    # ---- async, for the rollout process's event loop ----

    async def acompletions(self, body: dict) -> dict:
        return _field(await self._arequest("POST", "/v1/completions", "generation", json=body))

    async def agenerate(self, body: dict) -> dict:
        reply = await self._arequest("POST", "/inference/v1/generate", "generation", json=body)
        return _field(reply)

    async def ametrics(self) -> Samples | None:
        """Parsed GET /metrics, or None when the server has none (404)."""
        try:
            return parse_prometheus((await self._arequest("GET", "/metrics")).text)
        except VLLMError as e:
            if e.status == 404:
                return None
            raise

    async def aclose(self) -> None:
        for client in self._asyncs:
            await client.aclose()
        for wire in self._wires:
            wire.close()
        self._asyncs = []
        self._idle = []
        self._wires = []
