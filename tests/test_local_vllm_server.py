"""local_vllm/server.py, the contract (docs/vllm_api.md), end to end: every route's
documented shape, the flags a client reads (/server_info) and their defaults, the dev routes
only VLLM_SERVER_DEV_MODE=1 has, a bad /pause mode, weight-sync calls out of order (500s in
vLLM's words), the CLI's one-line error for a missing model, and a bounded soak.

The soak (640 requests on loopback, ~10 s here): eight clients send a seeded mix of valid
requests, invalid ones and requests whose client disconnects (mid-body, or mid-generation).
Afterwards: every valid request got exactly one complete reply (none lost, none duplicated: one
reply id each, n choices indexed 0..n-1), the engine holds no sequence, the server's memory is
back near its start, and same-seed requests still give the same tokens.
(The engine's behaviour: test_local_vllm_engine.py; request checks: test_local_vllm_requests.py;
framing and --api-key: test_local_vllm_transport.py.)
"""
import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import ROOT
from local_vllm.launch import LocalServer
from local_vllm_helpers import PROMPT, assert_error, complete, get, metrics, post, request, wait_for


# ── shapes ────────────────────────────────────────────────────────────────────────────────


def test_every_endpoint_has_the_documented_shape(server):
    r = get(server, "/health")
    assert r.status_code == 200 and r.content == b""
    models = get(server, "/v1/models").json()
    assert models["object"] == "list"
    base = models["data"][0]
    assert set(base) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len",
                         "permission"}
    assert base["max_model_len"] == 256 and base["object"] == "model"

    info = get(server, "/server_info?config_format=json").json()
    assert set(info) == {"vllm_config", "vllm_env", "system_env"}
    cfg = info["vllm_config"]
    model_config = cfg["model_config"]
    assert model_config["dtype"] == "torch.float32" and model_config["max_model_len"] == 256
    assert model_config["logprobs_mode"] == "processed_logprobs"
    assert model_config["return_sampling_mask"] is True and model_config["max_logprobs"] == -1
    assert cfg["cache_config"]["kv_cache_size_tokens"] == 16 * 256
    assert cfg["cache_config"]["num_gpu_blocks"] * cfg["cache_config"]["block_size"] == 16 * 256
    assert cfg["parallel_config"] == {"data_parallel_size": 1, "tensor_parallel_size": 1,
                                      "pipeline_parallel_size": 1}
    assert cfg["lora_config"] == {"max_lora_rank": 8, "max_loras": 6}
    assert cfg["weight_transfer_config"] == {"backend": "gloo"} and cfg["enable_scale_out"] is True

    assert get(server, "/get_world_size").json() == {"world_size": 1}
    text = get(server, "/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:cache_config_info"]:
        assert f'{name}{{' in text
    assert 'kv_cache_size_tokens="4096"' in text and 'engine="0"' in text
    assert isinstance(get(server, "/weight_info").json()["weight_version"], str)
    assert get(server, "/is_paused").json() == {"is_paused": False}
    reset = post(server, "/reset_prefix_cache?reset_running_requests=false")
    assert reset.json() == {"success": True}

    c = complete(server, max_tokens=4, logprobs=2, n=2)
    assert set(c) == {"id", "object", "created", "model", "choices", "usage"}
    assert c["object"] == "text_completion"
    assert set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert [ch["index"] for ch in c["choices"]] == [0, 1]
    for ch in c["choices"]:
        assert set(ch) == {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                           "prompt_token_ids"}
        assert set(ch["logprobs"]) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
        assert ch["prompt_token_ids"] == PROMPT and ch["finish_reason"] in ("stop", "length")
        assert (len(ch["logprobs"]["tokens"]) == len(ch["token_ids"])
                == len(ch["logprobs"]["top_logprobs"]))
    strings = {"prompt": ["3+4=", "1+1="], "max_tokens": 2}            # strings: tokenized
    text = post(server, "/v1/completions", strings).json()
    assert [c["index"] for c in text["choices"]] == [0, 1] and text["usage"]["prompt_tokens"] == 8
    assert complete(server, max_tokens=2)["choices"][0]["logprobs"] is None

    g = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "request_id": "r1",
                                                "sampling_params": {"max_tokens": 3, "top_k": 5,
                                                                    "logprobs": 2, "n": 2}}).json()
    assert set(g) == {"request_id", "model", "prompt_token_ids", "choices", "usage"}
    assert g["request_id"] == "r1"
    for ch in g["choices"]:
        assert set(ch) == {"index", "finish_reason", "stop_reason", "token_ids", "logprobs",
                           "sampling_mask"}
        for entry in ch["logprobs"]["content"]:
            assert set(entry) == {"token_id", "logprob", "rank", "top_logprobs"}
            assert len(entry["top_logprobs"]) == 2
            assert all(set(t) == {"token_id", "logprob", "rank"} for t in entry["top_logprobs"])
        assert len(ch["sampling_mask"]) == len(ch["token_ids"])


def test_pause_bad_mode(server):
    r = post(server, "/pause?mode=later")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    assert get(server, "/is_paused").json() == {"is_paused": False}


def test_features_off_by_default(plain_server):
    info = get(plain_server, "/server_info").json()["vllm_config"]
    assert info["lora_config"] is None and info["weight_transfer_config"] is None
    assert info["model_config"]["logprobs_mode"] == "raw_logprobs"
    assert info["model_config"]["max_logprobs"] == 20
    r = post(plain_server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {}})
    assert_error(r, 403)
    assert r.json()["error"]["type"] == "PermissionDeniedError"
    r = post(plain_server, "/init_weight_transfer_engine", {"init_info": {}})
    assert_error(r, 500)                                        # vLLM's worker raises: a 500
    assert "Weight transfer not configured" in r.json()["error"]["message"]
    lora = {"lora_name": "a", "lora_path": "/tmp"}
    assert_error(post(plain_server, "/v1/load_lora_adapter", lora), 404)
    assert_error(post(plain_server, "/v1/completions", {"prompt": PROMPT, "logprobs": 21}), 400)


# vLLM's routes that only VLLM_SERVER_DEV_MODE=1 registers (its dev and RL routers) and we serve
DEV_ROUTES = [("GET", "/server_info"), ("GET", "/get_world_size"), ("POST", "/pause"),
              ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"),
              ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"),
              ("POST", "/update_weights"), ("POST", "/finish_weight_update"),
              ("POST", "/shutdown_weight_transfer_engine"), ("POST", "/update_weight_version"),
              ("GET", "/weight_info"), ("POST", "/weight_checker")]


def test_without_dev_mode_the_dev_routes_answer_404_and_the_rest_serve(toy_dir):
    s = LocalServer(toy_dir, "--max-model-len", "64", "--weight-transfer-config",
                    '{"backend":"gloo"}', env={"VLLM_SERVER_DEV_MODE": "0"})
    try:
        for method, path in DEV_ROUTES:
            r = requests.request(method, s.url + path, json={}, timeout=30)
            assert_error(r, 404)
            assert r.json()["error"]["message"] == f"Not Found: {method} {path}"
        assert get(s, "/health").status_code == 200 and "vllm:" in get(s, "/metrics").text
        assert get(s, "/v1/models").json()["data"][0]["max_model_len"] == 64
        assert len(complete(s, max_tokens=2)["choices"]) == 1
    finally:
        s.stop()


def test_missing_model_path_is_one_clear_line():
    r = subprocess.run([sys.executable, "-m", "local_vllm.server", "--model", "/nonexistent/model"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0
    assert "/nonexistent/model" in r.stderr and "does not exist" in r.stderr


def test_weight_sync_calls_out_of_order_are_500s_in_vllms_words(server):
    """What vLLM's worker refuses is a 500 (its words), and uvicorn closes the connection after
    one: a client must not reuse it. A bad init_info is the worker's refusal too."""
    bad_init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                "world_size": 2, "nccl": True}
    r = post(server, "/init_weight_transfer_engine", {"init_info": bad_init})
    assert_error(r, 500)
    assert "Invalid init_info" in r.json()["error"]["message"] and "nccl" in r.text
    assert r.headers["connection"] == "close"
    r = post(server, "/finish_weight_update", {"weight_version": "x"})
    assert_error(r, 500)
    assert r.json()["error"]["message"] in (
        "finish_weight_update called without a matching start_weight_update.",
        "Weight transfer engine not initialised: POST /init_weight_transfer_engine first")
    assert complete(server, max_tokens=2)["choices"][0]["finish_reason"] in ("stop", "length")


# ── under load ────────────────────────────────────────────────────────────────────────────

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
