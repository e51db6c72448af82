"""local_vllm/transport.py: framing and bounding bodies byte by byte, vLLM's JSON error shape
for every refusal (http.server's own included), --api-key, and a client that goes away freeing its
sequences. Requests are raw bytes on a socket, so nothing between us and the server fixes them."""
import http.client
import json
import socket
import time

import pytest
import requests

from local_vllm.launch import LocalServer
from local_vllm_helpers import (PROMPT, assert_error, error_message, metrics, ok, raw, request,
                                wait_for)


# ── malformed requests, byte by byte ──────────────────────────────────────────────────────────

BODY = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
CHUNKED = {"Transfer-Encoding": "chunked"}
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("data, status", [
    (request("POST", COMPLETIONS, b'{"prompt": "\xff\xfe"}'), 400),               # not UTF-8
    (request("POST", COMPLETIONS, b'{"prompt": "a\\ud800b"}'), 400),             # a lone surrogate
    (request("POST", COMPLETIONS, b"[" * 100000 + b"]" * 100000), 400),           # nested deeply
    (request("POST", COMPLETIONS, b'{"prompt": [1, 2'), 400),                     # truncated JSON
    (request("POST", COMPLETIONS, b'"text"'), 400),                               # not an object
    (request("POST", COMPLETIONS, b'{"max_tokens": 1' + b"0" * 5000 + b"}"), 400),  # 5000 digits
    (request("POST", COMPLETIONS, b"", {"Content-Length": "abc"}), 400),
    (request("POST", COMPLETIONS, b"", {"Content-Length": "-5"}), 400),
    (request("POST", COMPLETIONS, b"", {"Content-Length": str(1 << 40)}), 413),
    (request("POST", COMPLETIONS, BODY, {"Content-Length": str(len(BODY)), **CHUNKED}), 400),
    (request("POST", COMPLETIONS, BODY, {"Transfer-Encoding": "gzip"}), 400),
    (request("POST", COMPLETIONS, b"zz\r\n" + BODY + b"\r\n0\r\n\r\n", CHUNKED), 400),  # bad size
    (request("POST", COMPLETIONS, b"5\r\n" + BODY + b"\r\n0\r\n\r\n", CHUNKED), 400),   # overrun
    (request("POST", COMPLETIONS, b"%x\r\n" % (40 << 20) + b"x" * 1000, CHUNKED), 413),
    (request("POST", COMPLETIONS, b"", {}), 400),           # no body: the prompt is missing
    (request("PUT", COMPLETIONS, BODY), 405),
    (request("DELETE", "/health"), 405),
    (request("GET", COMPLETIONS), 405),
    (request("BREW", COMPLETIONS, BODY), 405),              # no handler in http.server
    (request("POST", "/v2/nowhere", BODY), 404),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\n" + b"X: " + b"y" * 70000 + b"\r\n\r\n", 431),
])
def test_malformed_requests_get_a_json_4xx(server, data, status):
    got, reply, _ = raw(server, data)
    assert got == status, reply
    assert error_message(reply)
    ok(server)


def test_a_valid_chunked_body_is_served(server):
    pieces = [BODY[i:i + 7] for i in range(0, len(BODY), 7)]
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    status, reply, _ = raw(server, request("POST", COMPLETIONS, body, CHUNKED))
    assert status == 200 and len(reply["choices"]) == 1


def test_head_gets_headers_only(server):
    status, reply, response = raw(server, request("HEAD", COMPLETIONS))
    assert status == 405 and reply is None
    assert response.getheader("Content-Type") == "application/json"


def test_an_oversized_body_is_refused_and_the_client_reads_why(server):
    r = requests.post(server.url + COMPLETIONS, data=b" " * (33 << 20), timeout=60)
    assert_error(r, 413)


def test_an_idle_keep_alive_connection_is_closed_after_5s(server):
    """As uvicorn does (timeout_keep_alive=5): a kept-alive connection idle for 5 s is closed."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        sock.sendall(request("GET", "/health"))
        response = http.client.HTTPResponse(sock, method="GET")
        response.begin()
        assert response.status == 200 and response.read() == b""
        assert response.getheader("Connection") is None          # kept alive
        start = time.monotonic()
        assert sock.recv(1) == b""                                 # waits for the server's close
        assert 4.5 < time.monotonic() - start < 7.0


def test_a_client_that_stops_sending_does_not_block_others(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request("POST", COMPLETIONS, b"", {"Content-Length": "100"}) + b'{"pro')
        ok(server)                                       # served while that body never arrives


def test_a_client_that_disconnects_frees_its_sequences(server):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "n": 4}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request("POST", COMPLETIONS, body))
        wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 4)
    start = time.monotonic()

    def idle() -> bool:
        m = metrics(server)
        return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0
    wait_for(idle, timeout=5)
    assert time.monotonic() - start < 2                  # aborted, not generated to the end
    ok(server)


# ── --api-key ─────────────────────────────────────────────────────────────────────────────────


def test_api_key_guards_every_route_but_health_and_metrics(toy_dir, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")         # read when --api-key is absent, as vLLM
    s = LocalServer(toy_dir, "--max-model-len", "64")
    try:
        assert requests.get(s.url + "/health").status_code == 200
        assert requests.get(s.url + "/metrics").status_code == 200
        guarded = [("POST", COMPLETIONS), ("GET", "/v1/models"), ("POST", "/inference/v1/generate"),
                   ("GET", "/server_info"), ("POST", "/pause"), ("GET", "/nowhere")]
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = requests.request(method, s.url + path, json={}, headers=headers)
                assert r.status_code == 401, (method, path, r.text)
                assert r.json() == {"error": "Unauthorized"}
        r = requests.post(s.url + COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2},
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert "s3cret" not in s.output()
    finally:
        s.stop()
