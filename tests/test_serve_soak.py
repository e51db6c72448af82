"""serve_local.py keeps serving under load: a bounded soak on loopback (640 requests, ~10 s here).

Eight clients send a seeded mix of valid requests, invalid ones and requests whose client
disconnects (mid-body, or mid-generation). Afterwards: every valid request got exactly one complete
reply (none lost, none duplicated: one reply id each, n choices indexed 0..n-1), the engine holds
no sequence, the server's memory is back near its start, and same-seed requests still give the
same tokens.
"""
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from local_vllm.launch import LocalServer
from test_serve_http import request
from test_serve_local import metrics, wait_for

CLIENTS = 8
REQUESTS_PER_CLIENT = 80
WARM_UP = 20                         # requests per client before the memory baseline
INVALID = [{"prompt": [1, 2], "temperature": float("inf")}, {"prompt": [1, 2], "n": 0},
           {"prompt": []}, {"prompt": [1, 2], "model": ["x"]}, {"prompt": [1, 2], "seed": 2**64},
           {"prompt": [1, 999]}, {"prompt": [1, 2], "max_tokens": 500},
           {"prompt": [1, 2], "tempreature": 1.0}]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def valid_body(rng: random.Random) -> dict:
    return {"prompt": [rng.randrange(105) for _ in range(rng.randint(1, 20))],
            "max_tokens": rng.randint(1, 16), "n": rng.randint(1, 3),
            "seed": rng.randrange(2**63), "temperature": rng.choice([0.5, 1.0]),
            "return_token_ids": True, "logprobs": rng.choice([None, 0, 3])}


def idle(server) -> bool:
    """No sequence running or waiting in the server's engine."""
    m = metrics(server)
    return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0


def client(url: str, port: int, seed: int, count: int = REQUESTS_PER_CLIENT) -> dict:
    rng = random.Random(seed)
    out = {"valid": [], "invalid": 0, "dropped": 0}
    with requests.Session() as http:
        for _ in range(count):
            kinds = ["valid", "invalid", "drop_body", "drop_generation"]
            kind = rng.choices(kinds, [5, 2, 1, 1])[0]
            if kind == "valid":
                body = valid_body(rng)
                r = http.post(url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                out["valid"].append((body, r.json()))
            elif kind == "invalid":
                r = http.post(url + "/v1/completions", timeout=60,
                              data=json.dumps(rng.choice(INVALID)).encode())
                assert r.status_code == 400 and r.json()["error"]["message"], r.text
                out["invalid"] += 1
            else:
                long = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "n": 2}
                body = json.dumps(long).encode()
                data = request("POST", "/v1/completions", body)
                with socket.create_connection(("127.0.0.1", port)) as sock:
                    sock.sendall(data[:len(data) - 10] if kind == "drop_body" else data)
                    time.sleep(rng.uniform(0, 0.2))
                out["dropped"] += 1
    return out


@pytest.fixture
def soak_server(toy_dir):
    s = LocalServer(toy_dir, "--max-model-len", "128", "--max-logprobs", "5")
    yield s
    s.stop()


def test_soak_mixed_clients_lose_nothing_and_leak_nothing(soak_server):
    s = soak_server
    with ThreadPoolExecutor(CLIENTS) as pool:              # warm up: threads, allocator, caches
        list(pool.map(lambda i: client(s.url, s.port, 1000 + i, WARM_UP), range(CLIENTS)))
    wait_for(lambda: idle(s))
    before = rss_mb(s.proc.pid)

    start = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda i: client(s.url, s.port, i), range(CLIENTS)))
    elapsed = time.monotonic() - start
    assert elapsed < 40, f"the soak took {elapsed:.0f}s"

    replies = [reply for r in results for _, reply in r["valid"]]
    others = sum(r["invalid"] + r["dropped"] for r in results)
    assert len(replies) + others == CLIENTS * REQUESTS_PER_CLIENT
    assert len({reply["id"] for reply in replies}) == len(replies)         # one reply per request
    for body, reply in (pair for r in results for pair in r["valid"]):
        assert [c["index"] for c in reply["choices"]] == list(range(body["n"]))
        assert all(1 <= len(c["token_ids"]) <= body["max_tokens"] for c in reply["choices"])
    wait_for(lambda: idle(s), timeout=10)                  # dropped clients left nothing behind
    after = rss_mb(s.proc.pid)
    assert after < before * 1.15 + 10, f"server RSS grew from {before:.0f} MB to {after:.0f} MB"

    for body, reply in [pair for r in results for pair in r["valid"]][:12]:   # still deterministic
        again = requests.post(s.url + "/v1/completions", json=body, timeout=60).json()
        assert ([c["token_ids"] for c in again["choices"]]
                == [c["token_ids"] for c in reply["choices"]])
