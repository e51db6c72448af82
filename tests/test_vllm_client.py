"""vllm_client.py against tiny scripted stdlib HTTP servers (retries, timeouts, error messages,
parsing, cancellation, TLS), and against the stand-in (idle keep-alive, routes it was not started
with).

Each scripted server answers its n-th request with `replies[n]` (the last reply repeats), serves a
bounded number of requests and stops by itself; "stall" holds the request without answering until
the test ends.
"""
import asyncio
import json
import math
import re
import socket
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from local_vllm.launch import LocalServer
from vllm_client import VLLMClient, VLLMError, parse_prometheus, server_urls

FAST = dict(backoff=0.001, max_backoff=0.01)  # keep retries quick


class Scripted(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, replies, max_requests: int, tls: ssl.SSLContext | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.replies = replies
        self.max_requests = max_requests
        self.requests: list[tuple[str, str, object]] = []  # (method, path + query, JSON or None)
        self.authorizations: list[str | None] = []        # each request's Authorization header
        self.released = threading.Event()
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://127.0.0.1:{self.server_address[1]}"
        self.timeout = 0.05
        threading.Thread(target=self.serve_requests, daemon=True).start()

    def serve_requests(self):
        deadline = time.monotonic() + 20
        while (len(self.requests) < self.max_requests and not self.released.is_set()
               and time.monotonic() < deadline):
            self.handle_request()
        self.server_close()

    def reply_for(self, method, path, body):
        self.requests.append((method, path, body))
        if callable(self.replies):
            return self.replies(method, path, body)
        return self.replies[min(len(self.requests), len(self.replies)) - 1]


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.authorizations.append(self.headers.get("Authorization"))
        reply = self.server.reply_for(self.command, self.path, json.loads(raw) if raw else None)
        if reply == "stall":
            self.server.released.wait(10)
            return
        status, body = reply
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        ctype = "text/plain" if isinstance(body, str) else "application/json"
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture
def serve():
    """serve(replies, max_requests=20, tls=None) -> a started Scripted server; all are released
    after the test."""
    servers = []

    def start(replies, max_requests: int = 20, tls: ssl.SSLContext | None = None) -> Scripted:
        servers.append(Scripted(replies, max_requests, tls))
        return servers[-1]

    yield start
    for s in servers:
        s.released.set()


def run_async(client: VLLMClient, call):
    """await call(client) in an event loop of its own, then close the client's session there."""
    async def main():
        try:
            return await call(client)
        finally:
            await client.aclose()
    return asyncio.run(main())


COMPLETION = {"choices": [{"text": "7", "token_ids": [7], "logprobs": {"token_logprobs": [-0.1]}}]}


def test_retries_5xx_then_succeeds(serve):
    s = serve([(503, {"error": {"message": "paused"}}), (500, "boom"), (200, COMPLETION)])
    client = VLLMClient(s.url, **FAST)
    assert client.completions({"prompt": [1, 2]}) == COMPLETION
    assert client.retry_total == 2 and len(s.requests) == 3
    assert s.requests[0] == ("POST", "/v1/completions", {"prompt": [1, 2]})


def test_control_call_retries_503(serve):
    s = serve([(503, {"error": "paused"}), (200, {"is_paused": True})])
    client = VLLMClient(s.url, **FAST)
    assert client.is_paused() is True and client.retry_total == 1


@pytest.mark.parametrize("body, message", [
    ({"error": {"message": "max_tokens is too large", "type": "BadRequestError"}},
     "max_tokens is too large"),
    ({"error": "Invalid pause mode"}, "Invalid pause mode"),
    ({"message": "The model `x` does not exist."}, "The model `x` does not exist."),
    ({"detail": "Not Found"}, "Not Found"),
    ("plain words", "plain words"),
])
def test_4xx_raises_at_once_with_the_servers_message(serve, body, message):
    s = serve([(400, body), (200, COMPLETION)])
    client = VLLMClient(s.url, **FAST)
    with pytest.raises(VLLMError) as info:
        client.completions({"prompt": [1]})
    assert info.value.status == 400 and info.value.message == message
    assert message in str(info.value)
    assert info.value.url == s.url + "/v1/completions"
    assert len(s.requests) == 1 and client.retry_total == 0


def test_control_call_timeout_raises_naming_the_endpoint(serve):
    s = serve(["stall", (200, {"message": "ok"})])
    client = VLLMClient(s.url, timeout=0.2, **FAST)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="/start_weight_update"):
        client.start_weight_update()
    assert time.monotonic() - start < 1.0 and len(s.requests) == 1 and client.retry_total == 0


def test_a_stalled_generation_spends_the_budget_and_names_the_server(serve):
    """vllm_server_timeout bounds the request with its retries: a stall spends it, once."""
    s = serve(["stall", (200, COMPLETION)])
    client = VLLMClient(s.url, timeout=0.5, **FAST)
    start = time.monotonic()
    with pytest.raises(VLLMError, match=f"{s.url}/v1/completions.*gave up after 1 attempts in "
                                        "vllm_server_timeout=0.5s.*timeout"):
        client.completions({"prompt": [1]})
    assert time.monotonic() - start < 1.5 and client.retry_total == 0 and len(s.requests) == 1


def test_retries_stop_when_the_budget_is_spent(serve):
    s = serve([(503, {"error": {"message": "paused"}})], max_requests=100)
    client = VLLMClient(s.url, timeout=1.0, max_retries=100, backoff=0.1, max_backoff=0.2)
    start = time.monotonic()
    with pytest.raises(VLLMError, match="in vllm_server_timeout=1s; last error: HTTP 503: paused"):
        client.completions({"prompt": [1]})
    assert time.monotonic() - start < 1.5 and 3 <= len(s.requests) < 100


def test_collective_call_is_not_retried_after_it_reached_the_server(serve):
    s = serve([(500, {"error": {"message": "Weight transfer not configured"}}), (200, {})])
    client = VLLMClient(s.url, **FAST)
    with pytest.raises(VLLMError, match="Weight transfer not configured"):
        client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    assert len(s.requests) == 1


REFUSED = "gave up after 3 attempts; last error: refused: "   # then requests' or aiohttp's error


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_connection_refused_is_retried_then_raised():
    client = VLLMClient(f"http://127.0.0.1:{_closed_port()}", max_retries=2, **FAST)
    with pytest.raises(VLLMError, match=REFUSED + "NewConnectionError") as info:
        client.world_size()
    assert info.value.status is None and info.value.url.endswith("/get_world_size?include_dp=true")
    assert client.retry_total == 2


def test_backoff_doubles_up_to_its_cap(serve, monkeypatch):
    import vllm_client
    sleeps = []
    monkeypatch.setattr(vllm_client.time, "sleep", sleeps.append)
    monkeypatch.setattr(vllm_client.random, "uniform", lambda a, b: 1.0)
    s = serve([(503, {"error": {"message": "paused"}})] * 6)
    client = VLLMClient(s.url, max_retries=5, backoff=0.5, max_backoff=2.0)
    with pytest.raises(VLLMError, match="gave up after 6 attempts"):
        client.completions({"prompt": [1]})
    assert sleeps == [0.5, 1.0, 2.0, 2.0, 2.0]


def test_a_refused_connection_is_retried_twice_at_most(monkeypatch):
    """Nothing listens: the server died (or the URL is wrong); retrying for a minute would only
    delay the error that names it."""
    import vllm_client
    sleeps = []
    monkeypatch.setattr(vllm_client.time, "sleep", sleeps.append)
    monkeypatch.setattr(vllm_client.random, "uniform", lambda a, b: 1.0)
    client = VLLMClient(f"http://127.0.0.1:{_closed_port()}", max_retries=8, backoff=0.5)
    with pytest.raises(VLLMError, match=REFUSED + "NewConnectionError"):
        client.completions({"prompt": [1]})
    assert sleeps == [0.5, 1.0] and client.retry_total == 2


def test_a_refused_connection_on_the_async_path_is_retried_twice_at_most():
    client = VLLMClient(f"http://127.0.0.1:{_closed_port()}", max_retries=8, **FAST)
    with pytest.raises(VLLMError, match=REFUSED + "ClientConnectorError"):
        run_async(client, lambda c: c.acompletions({"prompt": [1]}))
    assert client.retry_total == 2


@pytest.mark.parametrize("reply", [(503, ""), "stall"])
def test_wait_for_health_meets_a_short_deadline(serve, reply):
    s = serve([reply], max_requests=100)
    client = VLLMClient(s.url)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"{s.url}/health"):
        client.wait_for_health(timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 1.0


def test_wait_for_health_returns_once_healthy(serve):
    s = serve([(503, ""), (503, ""), (200, "")])
    client = VLLMClient(s.url)
    client.wait_for_health(timeout=5)
    assert len(s.requests) == 3


def test_lora_replies_are_plain_text(serve):
    s = serve([(200, "Success: LoRA adapter 'policy-v1' added successfully."),
               (200, "Success: LoRA adapter 'policy-v0' removed successfully.")])
    client = VLLMClient(s.url, **FAST)
    added = client.load_lora_adapter("policy-v1", "/tmp/a")
    assert added == "Success: LoRA adapter 'policy-v1' added successfully."
    assert client.unload_lora_adapter("policy-v0").startswith("Success")
    load = {"lora_name": "policy-v1", "lora_path": "/tmp/a", "load_inplace": False}
    assert s.requests == [("POST", "/v1/load_lora_adapter", load),
                          ("POST", "/v1/unload_lora_adapter", {"lora_name": "policy-v0"})]


def test_malformed_replies_raise_vllm_error(serve):
    s = serve([(200, "<html>proxy error</html>"), (200, [1, 2]), (200, {"version": "v3"})])
    client = VLLMClient(s.url, **FAST)
    with pytest.raises(VLLMError, match="expected a JSON object.*proxy error"):
        client.completions({"prompt": [1]})
    with pytest.raises(VLLMError, match="expected a JSON object"):
        client.models()
    with pytest.raises(VLLMError, match="weight_version"):
        client.weight_info()


def test_endpoints_paths_and_bodies(serve):
    replies = {
        "/v1/models": {"object": "list", "data": [
            {"id": "policy-v1", "parent": "toy", "max_model_len": None},
            {"id": "toy", "parent": None, "max_model_len": 256}]},
        "/server_info?config_format=json": {"vllm_config": {
            "model_config": {"dtype": "torch.float32"}}},
        "/get_world_size?include_dp=false": {"world_size": 2},
        "/pause?mode=abort&clear_cache=false": {"status": "paused"},
        "/resume": {"status": "resumed"},
        "/init_weight_transfer_engine": {"message": "Weight transfer initialized"},
        "/finish_weight_update": {"message": "Weight update finished"},
        "/weight_info": {"weight_version": "v2"},
        "/weight_checker": {"match": True, "mismatches": []},
        "/inference/v1/generate": COMPLETION,
    }
    def reply(method, path, body):
        return (200, replies[path]) if path in replies else (404, {"detail": "Not Found"})

    s = serve(reply)
    client = VLLMClient(s.url, **FAST)
    assert client.max_model_len() == 256
    assert client.server_info() == {"model_config": {"dtype": "torch.float32"}}
    assert client.world_size(include_dp=False) == 2
    client.pause("abort", clear_cache=False)
    client.resume()
    client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1,
                                        "rank_offset": 1, "world_size": 2})
    client.finish_weight_update("v2")
    assert client.weight_info() == "v2"
    assert client.weight_checker("compare", {"w": "ab"}) == {"match": True, "mismatches": []}
    assert run_async(client, lambda c: c.agenerate({"token_ids": [1]})) == COMPLETION
    assert run_async(client, lambda c: c.ametrics()) is None  # no /metrics: 404; a second loop
    bodies = {path: body for _, path, body in s.requests}
    assert bodies["/init_weight_transfer_engine"]["init_info"]["rank_offset"] == 1
    assert bodies["/finish_weight_update"] == {"weight_version": "v2"}
    assert bodies["/weight_checker"] == {"action": "compare", "baseline": {"w": "ab"}}
    assert client.retry_total == 0
    client.close()


PROMETHEUS = r'''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} NaN
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:num_preemptions_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7e+09
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 12.0
vllm:cache_config_info{block_size="16",engine="0",note="a \"quoted\", comma, {brace}",num_gpu_blocks="4096"} 1.0
process_open_fds 17 1712345678000
python_gc_objects_collected_total{generation="0"} -Inf
'''


def test_parse_prometheus_realistic_text():
    m = parse_prometheus(PROMETHEUS)
    qwen = "Qwen/Qwen3-0.6B"
    assert m["vllm:num_requests_running"] == [({"engine": "0", "model_name": qwen}, 3.0),
                                              ({"engine": "1", "model_name": qwen}, 5.0)]
    usage = dict((labels["engine"], v) for labels, v in m["vllm:kv_cache_usage_perc"])
    assert usage["0"] == 0.42 and math.isnan(usage["1"])
    assert m["vllm:num_preemptions_total"][0][1] == 7.0
    assert m["vllm:e2e_request_latency_seconds_bucket"][0][0]["le"] == "+Inf"
    labels, value = m["vllm:cache_config_info"][0]
    assert labels == {"block_size": "16", "engine": "0", "note": 'a "quoted", comma, {brace}',
                      "num_gpu_blocks": "4096"}
    assert m["process_open_fds"] == [({}, 17.0)]
    assert m["python_gc_objects_collected_total"][0][1] == -math.inf
    assert "vllm:num_preemptions" not in m  # comment lines are not samples


def test_metrics_that_are_not_prometheus_text_fail_naming_the_server(serve):
    """A proxy's HTML page at /metrics is not read as zero load: a VLLMError names the server
    (rollout/servers.py then says the cap stays where it is)."""
    server = serve([(200, "<html><body>Login</body></html>")])
    client = VLLMClient(server.url, max_retries=0)
    with pytest.raises(VLLMError, match=f"{server.url}: /metrics is not Prometheus text"):
        run_async(client, lambda c: c.ametrics())


def test_async_methods_share_the_policy(serve):
    retried = serve([(503, {"error": {"message": "paused"}}), (200, COMPLETION),
                     (200, PROMETHEUS)])
    refused = serve([(400, {"error": {"message": "bad logprobs"}}), (200, COMPLETION)])
    stalled = serve(["stall", (200, COMPLETION)])
    a, b = VLLMClient(retried.url, **FAST), VLLMClient(refused.url, **FAST)
    c = VLLMClient(stalled.url, timeout=0.2, **FAST)

    async def run():
        assert await a.acompletions({"prompt": [1]}) == COMPLETION
        assert (await a.ametrics())["vllm:num_requests_running"][1][1] == 5.0
        with pytest.raises(VLLMError, match="bad logprobs"):
            await b.agenerate({"token_ids": [1]})
        with pytest.raises(VLLMError, match=f"{stalled.url}.*vllm_server_timeout=0.2s"):
            await c.agenerate({"token_ids": [1]})
        for client in (a, b, c):
            await client.aclose()

    asyncio.run(run())
    assert (a.retry_total, b.retry_total, c.retry_total) == (1, 0, 0)
    assert len(refused.requests) == 1 and len(stalled.requests) == 1   # a stall spends the budget


def test_server_urls_split_the_replicas():
    assert server_urls("http://a:8000/") == ["http://a:8000"]
    assert server_urls(" http://a:8000 ,http://b:9000/, ") == ["http://a:8000", "http://b:9000"]
    for bad in ("", " , ", "http://a:8000,http://a:8000/"):
        with pytest.raises(ValueError, match="vllm_server_base_url"):
            server_urls(bad)


@pytest.mark.parametrize("key, hint", [(None, "set VLLM_API_KEY to that key"),
                                       ("wrong", "refused the key in VLLM_API_KEY")])
def test_401_raises_at_once_naming_the_api_key_variable(serve, monkeypatch, key, hint):
    if key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", key)
    s = serve([(401, {"error": "Unauthorized"}), (200, COMPLETION)])
    client = VLLMClient(s.url, **FAST)
    with pytest.raises(VLLMError) as info:
        client.completions({"prompt": [1]})
    assert info.value.status == 401 and hint in str(info.value)
    assert key is None or key not in str(info.value)
    assert len(s.requests) == 1 and client.retry_total == 0
    assert s.authorizations == [None if key is None else f"Bearer {key}"]


def test_the_api_key_goes_on_every_call_sync_and_async(serve, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    s = serve([(200, COMPLETION)])
    client = VLLMClient(s.url, **FAST)
    client.completions({"prompt": [1]})
    client.wait_for_health(timeout=5)
    run_async(client, lambda c: c.acompletions({"prompt": [1]}))
    assert s.authorizations == ["Bearer k3y"] * 3


class RawServer:
    """A loopback socket server that answers each request with the next scripted bytes, and
    closes the connection after it if the entry says so."""

    def __init__(self, script: list[tuple[bytes, bool]]):
        self.script = list(script)
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while self.script:
            conn, _ = self.sock.accept()
            self.connections += 1
            with conn:
                data = b""
                while self.script:
                    while b"\r\n\r\n" not in data:
                        if not (chunk := conn.recv(65536)):
                            break
                        data += chunk
                    head, _, data = data.partition(b"\r\n\r\n")
                    if not head:
                        break
                    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
                    while len(data) < length:
                        data += conn.recv(65536)
                    data = data[length:]
                    reply, close = self.script.pop(0)
                    conn.sendall(reply)
                    if close:
                        break
        self.sock.close()


BODY = json.dumps(COMPLETION).encode()
WHOLE = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


def call_on(path: str, client: VLLMClient) -> dict:
    """One completion over the sync path (requests) or the async one (aiohttp)."""
    if path == "sync":
        return client.completions({"prompt": [1]})
    return run_async(client, lambda c: c.acompletions({"prompt": [1]}))


@pytest.mark.parametrize("path", ["sync", "async"])
def test_a_reply_cut_mid_body_is_retried(path):
    """Headers promise more bytes than come before the close: a transport error, and the policy's
    retry gets the whole reply."""
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY[:5])
    server = RawServer([(cut, True), (WHOLE, False)])
    client = VLLMClient(server.url, **FAST)
    assert call_on(path, client) == COMPLETION
    assert client.retry_total == 1 and server.connections == 2


@pytest.mark.parametrize("path", ["sync", "async"])
def test_a_connection_the_server_closed_while_idle_is_replaced_without_a_retry(path):
    server = RawServer([(WHOLE, True), (WHOLE, False)])
    client = VLLMClient(server.url, **FAST)

    async def twice(c):
        first = await c.acompletions({"prompt": [1]})
        await asyncio.sleep(0.2)                       # the server's close reaches the client
        return first, await c.acompletions({"prompt": [1]})

    if path == "sync":
        replies = client.completions({"prompt": [1]}), None
        time.sleep(0.2)
        replies = replies[0], client.completions({"prompt": [1]})
    else:
        replies = run_async(client, twice)
    assert replies == (COMPLETION, COMPLETION)
    assert client.retry_total == 0 and server.connections == 2


def test_a_request_cancelled_mid_reply_leaves_the_next_its_own_reply(serve):
    """The server answers [111] late; the caller gives up on it first (the connection's reply is
    still on its way) and asks for [222] at once on the same client: it gets [222], never the
    late [111]."""
    def echo(method, path, body):
        if body["prompt"] == [111]:
            time.sleep(0.6)
        return 200, {"choices": [{"text": "", "token_ids": body["prompt"]}]}

    s = serve(echo)
    client = VLLMClient(s.url, **FAST)

    async def run(c):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c.acompletions({"prompt": [111]}), 0.2)
        start = time.monotonic()
        second = await c.acompletions({"prompt": [222]})
        await asyncio.sleep(0.6)                  # the late reply has come and gone meanwhile
        third = await c.acompletions({"prompt": [333]})
        return second, third, time.monotonic() - start

    second, third, elapsed = run_async(client, run)
    assert second["choices"][0]["token_ids"] == [222]
    assert third["choices"][0]["token_ids"] == [333]
    assert elapsed < 1.5 and client.retry_total == 0
    assert [r[2]["prompt"] for r in s.requests] == [[111], [222], [333]]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (openssl): (certificate path, key path)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_https_and_the_api_key_on_both_paths(serve, certificate, monkeypatch):
    """https:// with the certificate verified against the CA bundle the libraries read
    (REQUESTS_CA_BUNDLE: requests; SSL_CERT_FILE: aiohttp, through Python's ssl); the key reaches
    the server on both paths. Without the bundle the certificate is refused."""
    cert, key = certificate
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    s = serve([(200, COMPLETION)], tls=tls)
    assert s.url.startswith("https://")
    for variable in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(variable, raising=False)
    for path in ("sync", "async"):
        with pytest.raises(VLLMError, match="refused: .*(SSL|Certificate)"):
            call_on(path, VLLMClient(s.url, **FAST))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", cert)
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    client = VLLMClient(s.url, **FAST)
    assert call_on("sync", client) == COMPLETION and call_on("async", client) == COMPLETION
    assert s.authorizations == ["Bearer k3y"] * 2 and client.retry_total == 0


@pytest.fixture(scope="module")
def no_dev_mode(toy_dir):
    """The stand-in started as `vllm serve` would be without VLLM_SERVER_DEV_MODE and LoRA."""
    s = LocalServer(toy_dir, "--max-model-len", "64", env={"VLLM_SERVER_DEV_MODE": "0"})
    yield s
    s.stop()


def test_a_pooled_connection_the_stand_in_closed_after_5s_idle_is_replaced(no_dev_mode):
    """The stand-in closes a keep-alive connection idle for 5 s, as uvicorn does: the next call on
    either path opens a new one, with no retry."""
    client = VLLMClient(no_dev_mode.url, **FAST)
    body = {"prompt": [1, 2], "max_tokens": 1}

    async def twice(c):
        first = (c.models()["data"][0]["id"], len((await c.acompletions(body))["choices"]))
        await asyncio.sleep(5.5)
        return first, (c.models()["data"][0]["id"], len((await c.acompletions(body))["choices"]))

    first, again = run_async(client, twice)
    assert first == again == (first[0], 1) and client.retry_total == 0


@pytest.mark.parametrize("call, route", [
    (lambda c: c.pause(), "/pause"), (lambda c: c.resume(), "/resume"),
    (lambda c: c.is_paused(), "/is_paused"), (lambda c: c.server_info(), "/server_info"),
    (lambda c: c.world_size(), "/get_world_size"), (lambda c: c.weight_info(), "/weight_info"),
    (lambda c: c.start_weight_update(), "/start_weight_update"),
    (lambda c: c.init_weight_transfer_engine({}), "/init_weight_transfer_engine"),
])
def test_a_dev_mode_route_the_server_lacks_names_the_variable(no_dev_mode, call, route):
    client = VLLMClient(no_dev_mode.url, **FAST)
    with pytest.raises(VLLMError) as info:
        call(client)
    assert info.value.status == 404 and client.retry_total == 0
    assert info.value.message == (f"the vLLM server at {no_dev_mode.url} answers 404 to {route}: "
                                  "start it with VLLM_SERVER_DEV_MODE=1 (vllm serve reads it at "
                                  "start)")


@pytest.mark.parametrize("call, route", [
    (lambda c: c.load_lora_adapter("a", "/tmp/a"), "/v1/load_lora_adapter"),
    (lambda c: c.unload_lora_adapter("a"), "/v1/unload_lora_adapter")])
def test_a_lora_route_the_server_lacks_names_its_variable_and_flag(no_dev_mode, call, route):
    client = VLLMClient(no_dev_mode.url, **FAST)
    with pytest.raises(VLLMError) as info:
        call(client)
    assert info.value.status == 404 and info.value.message.startswith(
        f"the vLLM server at {no_dev_mode.url} answers 404 to {route}: start it with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora")


def test_a_server_without_weight_transfer_names_the_flag(start_server):
    """Dev mode on (the routes exist), no --weight-transfer-config: vLLM's worker refuses."""
    server = start_server("--max-model-len", "64")
    client = VLLMClient(server.url, **FAST)
    for call, route in ((lambda: client.start_weight_update(), "/start_weight_update"),
                        (lambda: client.init_weight_transfer_engine({}),
                         "/init_weight_transfer_engine")):
        with pytest.raises(VLLMError) as info:
            call()
        assert info.value.message.startswith(
            f"the vLLM server at {server.url} has no weight transfer engine ({route}: Weight "
            "transfer not configured")
        assert "start it with --weight-transfer-config" in info.value.message
    assert client.retry_total == 0


def test_an_api_key_over_plain_http_to_another_host_is_warned_about_once(monkeypatch, caplog):
    """Issue 34: a client made for http:// to a host that is not loopback, with VLLM_API_KEY set,
    warns (once per URL) naming it; https, loopback, or no key: nothing said. Nothing is sent:
    making a client makes no request (the host is a .invalid one)."""
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    with caplog.at_level("WARNING", logger="vllm_client"):
        for url in ("http://gpu0.invalid:8000", "http://gpu0.invalid:8000/",
                    "https://gpu1.invalid:8000", "http://127.0.0.1:8000", "http://[::1]:8000",
                    "http://localhost:8000"):
            VLLMClient(url, **FAST)
        monkeypatch.delenv("VLLM_API_KEY")
        VLLMClient("http://gpu2.invalid:8000", **FAST)
    said = [r.getMessage() for r in caplog.records if "VLLM_API_KEY" in r.getMessage()]
    assert len(said) == 1 and "http://gpu0.invalid:8000 over plain http" in said[0], said
