"""serve_local.py against the contract in reference/vllm_api.md, and against the model itself.

Log-probs are checked against an independent recomputation: the same model directory loaded with
transformers, prompt + generated tokens forwarded in one go, and the sampler's processing
(repetition penalty, temperature, min-p, top-k, top-p) written again here the way vLLM writes it
(ascending sort for top-p). The weight-update test plays trainer rank 0 itself.
"""
import hashlib
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import requests
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import toy
from conftest import ROOT
from local_vllm.launch import LocalServer
from weight_sync import free_port

PROMPT = [5, 17, 33, 8, 40, 41, 60]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def post(server, path, body=None, **kw) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120, **kw)


def get(server, path) -> requests.Response:
    return requests.get(server.url + path, timeout=30)


def complete(server, **body) -> dict:
    r = post(server, "/v1/completions", {"prompt": PROMPT, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(server) -> dict[str, float]:
    """Prometheus text → {name: value} (labels dropped; one series per name here)."""
    out = {}
    for line in get(server, "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def assert_error(r: requests.Response, status: int) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]


@pytest.fixture(scope="module")
def ref_model(toy_dir):
    return AutoModelForCausalLM.from_pretrained(toy_dir).eval()


@pytest.fixture(scope="module")
def plain_server(toy_dir):
    """No optional features, raw log-probs, and a KV budget of one full-length sequence."""
    s = LocalServer(toy_dir, "--max-model-len", "128", "--kv-cache-tokens", "128")
    yield s
    s.stop()


def reference_logprobs(model, prompt, output, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                       repetition_penalty=1.0, processed=True) -> torch.Tensor:
    """(T, V) log-probs of the distribution each output token was drawn from."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + output]), use_cache=False)
        logits = out.logits[0, len(prompt) - 1:-1].float()                   # (T, V)
    rows = []
    for j, x in enumerate(logits):
        if processed:
            x = x.clone()
            for t in set(prompt + output[:j]):
                x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
            x = x / temperature
            if min_p > 0:
                p = x.softmax(-1)
                x[p < min_p * p.max()] = -math.inf
            if top_k > 0:
                x[x < x.sort(descending=True).values[top_k - 1]] = -math.inf
            if top_p < 1:
                ascending, order = x.sort()
                drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
                drop[-1] = False
                x[order[drop]] = -math.inf
        rows.append(x.log_softmax(-1))
    return torch.stack(rows)


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


# ── log-probs and sampling ────────────────────────────────────────────────────────────────

SETTINGS = [dict(temperature=1.0),
            dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.3)]


@pytest.mark.parametrize("params", SETTINGS, ids=["plain", "processed"])
def test_completion_logprobs_equal_processed_logsoftmax(server, ref_model, params):
    c = complete(server, max_tokens=12, logprobs=5, ignore_eos=True, seed=3,
                 return_tokens_as_token_ids=True, **params)["choices"][0]
    out = c["token_ids"]
    ref = reference_logprobs(ref_model, PROMPT, out, **params)               # (T, V)
    assert len(out) == 12 and c["logprobs"]["tokens"] == [f"token_id:{t}" for t in out]
    for j, t in enumerate(out):
        assert abs(c["logprobs"]["token_logprobs"][j] - ref[j, t]) <= 1e-5
        top = c["logprobs"]["top_logprobs"][j]
        assert next(iter(top)) == f"token_id:{t}"                    # the sampled token first
        k = min(5, int(ref[j].isfinite().sum()))
        assert set(top) == {f"token_id:{i}" for i in [t, *ref[j].topk(k).indices.tolist()]}
        for key, v in top.items():
            assert abs(v - ref[j, int(key.split(":")[1])]) <= 1e-5


def test_generate_logprobs_and_sampling_mask(server, ref_model):
    params = SETTINGS[1]
    g = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 10, "logprobs": 3, "ignore_eos": True, "seed": 7, **params}}).json()
    ch = g["choices"][0]
    ref = reference_logprobs(ref_model, PROMPT, ch["token_ids"], **params)
    for j, (t, entry) in enumerate(zip(ch["token_ids"], ch["logprobs"]["content"])):
        assert entry["token_id"] == t and abs(entry["logprob"] - ref[j, t]) <= 1e-5
        assert entry["rank"] == int((ref[j] > ref[j, t]).sum()) + 1
        assert [e["token_id"] for e in entry["top_logprobs"]] == ref[j].topk(3).indices.tolist()
        assert all(abs(e["logprob"] - ref[j, e["token_id"]]) <= 1e-5 for e in entry["top_logprobs"])
        assert ch["sampling_mask"][j] == ref[j].isfinite().nonzero().flatten().tolist()
        assert 1 < len(ch["sampling_mask"][j]) <= 12


def test_raw_logprobs_mode_returns_the_model_distribution(plain_server, ref_model):
    params = dict(temperature=0.5, top_k=3)
    c = complete(plain_server, max_tokens=6, logprobs=4, ignore_eos=True, seed=1,
                 **params)["choices"][0]
    ref = reference_logprobs(ref_model, PROMPT, c["token_ids"], processed=False)
    for j, t in enumerate(c["token_ids"]):
        assert abs(c["logprobs"]["token_logprobs"][j] - ref[j, t]) <= 1e-5
        assert len(c["logprobs"]["top_logprobs"][j]) >= 4     # raw: nothing is masked out


def test_same_seed_same_tokens(server):
    def ids(**kw):
        choices = complete(server, max_tokens=20, ignore_eos=True, **kw)["choices"]
        return [ch["token_ids"] for ch in choices]
    assert ids(seed=11) == ids(seed=11)
    assert ids(seed=11) != ids(seed=12)
    two = ids(seed=11, n=2)                                    # choice i is seeded with seed + i
    assert two == [ids(seed=11)[0], ids(seed=12)[0]]
    assert ids(temperature=0.0) == ids(temperature=0.0, seed=5)  # greedy ignores the seed


def test_stop_token_ids_and_eos(server, toy_dir):
    free = complete(server, max_tokens=12, seed=21, ignore_eos=True)["choices"][0]["token_ids"]
    j = next(j for j, t in enumerate(free) if t not in free[:j] and j > 0)
    c = complete(server, max_tokens=12, seed=21, ignore_eos=True,
                 stop_token_ids=[free[j]])["choices"][0]
    assert c["token_ids"] == free[:j + 1]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == free[j]
    eos = toy.build_tokenizer().eos_token_id
    stopped = complete(server, max_tokens=200, seed=0, n=8)["choices"]  # EOS comes soon enough
    assert any(c["token_ids"][-1] == eos and c["finish_reason"] == "stop"
               and c["stop_reason"] is None for c in stopped)
    assert all(eos not in c["token_ids"][:-1] for c in stopped)


# ── weight transfer ───────────────────────────────────────────────────────────────────────


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().flatten().view(torch.uint8).numpy()).hexdigest()


def push_weights(server, state: dict[str, torch.Tensor], version: str, packed: bool,
                 buffer_bytes: int) -> int:
    """Trainer rank 0: join the server's group, broadcast `state`, finish. Returns the broadcasts
    made."""
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "packed": packed, "packed_buffer_size_bytes": buffer_bytes}
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(post, server, "/init_weight_transfer_engine", {"init_info": init})
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60))
        prefixed = dist.PrefixStore("weight_transfer", store)
        group = dist.ProcessGroupGloo(prefixed, 0, 2, timedelta(seconds=60))
        assert joined.result().json() == {"message": "Weight transfer initialized"}
        assert post(server, "/start_weight_update").json() == {"message": "Weight update started"}
        info = {"names": list(state),
                "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
                "shapes": [list(t.shape) for t in state.values()]}
        updated = pool.submit(post, server, "/update_weights", {"update_info": info})
        chunks, pending, size = [], [], 0
        for t in state.values():
            if not packed:
                chunks.append(t.contiguous())
                continue
            pending.append(t.contiguous().flatten().view(torch.uint8))
            size += pending[-1].numel()
            if size > buffer_bytes:                    # flush once the total first exceeds it
                chunks.append(torch.cat(pending))
                pending, size = [], 0
        chunks += [torch.cat(pending)] if pending else []
        for c in chunks:
            group.broadcast([c], opts).wait()
        assert updated.result().json() == {"message": "Weights updated"}
    r = post(server, "/finish_weight_update", {"weight_version": version})
    assert r.json() == {"message": "Weight update finished"}
    return len(chunks)


def compare(server, baseline: dict) -> dict:
    """/weight_checker's compare of the server's weights against checksums by name."""
    return post(server, "/weight_checker", {"action": "compare", "baseline": baseline}).json()


def test_weight_update_changes_outputs_and_checksums(server, toy_dir):
    assert get(server, "/weight_info").json() == {"weight_version": "default"}
    before = complete(server, max_tokens=8, temperature=0.0, logprobs=0)["choices"][0]
    original = post(server, "/weight_checker", {"action": "checksum"}).json()["checksums"]
    base = AutoModelForCausalLM.from_pretrained(toy_dir).state_dict()
    assert original == {n: sha256(t) for n, t in base.items()}

    new = {n: t for n, t in toy.build_model(len(toy.build_tokenizer()), seed=1).state_dict().items()
           if n != "lm_head.weight"}                           # tied: the embedding carries it
    assert push_weights(server, new, "v1", packed=False, buffer_bytes=1 << 30) == len(new)
    assert get(server, "/weight_info").json() == {"weight_version": "v1"}
    after = complete(server, max_tokens=8, temperature=0.0, logprobs=0)["choices"][0]
    assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
    changed = post(server, "/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert changed["model.embed_tokens.weight"] != original["model.embed_tokens.weight"]
    expected = {n: sha256(t) for n, t in new.items()}
    expected["lm_head.weight"] = sha256(new["model.embed_tokens.weight"])
    assert compare(server, expected) == {"match": True, "mismatches": []}
    mismatch = compare(server, original)
    assert mismatch["match"] is False and "model.embed_tokens.weight" in mismatch["mismatches"]

    n = push_weights(server, base, "v2", packed=True, buffer_bytes=100_000)  # restore, chunked
    assert 2 < n < len(base)
    assert compare(server, original)["match"] is True
    restored = complete(server, max_tokens=8, temperature=0.0, logprobs=0)["choices"][0]
    assert restored["token_ids"] == before["token_ids"]
    assert restored["logprobs"]["token_logprobs"] == pytest.approx(
        before["logprobs"]["token_logprobs"], abs=1e-6)
    assert get(server, "/weight_info").json() == {"weight_version": "v2"}
    first = next(iter(base.values()))              # a running total that reaches the buffer exactly
    exact = first.numel() * first.element_size()
    n = push_weights(server, base, "v2", packed=True, buffer_bytes=exact)
    assert n < len(base)                           # is not flushed: only exceeding it flushes
    assert compare(server, original)["match"] is True
    renamed = post(server, "/update_weight_version", {"new_version": "v3"}).json()
    assert renamed == {"success": True, "new_version": "v3"}
    assert post(server, "/weight_checker", {"action": "reset"}).json() == {"status": "reset"}
    shutdown = post(server, "/shutdown_weight_transfer_engine")
    assert shutdown.json() == {"message": "Weight transfer shut down"}


# ── LoRA ──────────────────────────────────────────────────────────────────────────────────


def make_adapter(toy_dir, path, r=4):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(toy_dir),
                           LoraConfig(r=r, lora_alpha=8, target_modules=TARGETS,
                                      init_lora_weights=False))
    model.save_pretrained(path)
    return model.eval()


def load(server, name: str, path: str, **fields) -> requests.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **fields})


def test_lora_adapter_load_use_unload(server, toy_dir, tmp_path):
    path = str(tmp_path / "adapter")
    peft_model = make_adapter(toy_dir, path)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": path})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'policy-v1' added successfully."
    cards = {c["id"]: c for c in get(server, "/v1/models").json()["data"]}
    assert cards["policy-v1"]["root"] == path
    assert cards["policy-v1"]["parent"] == server_name(server)

    base = complete(server, max_tokens=10, ignore_eos=True, seed=4, logprobs=0)["choices"][0]
    lora = complete(server, model="policy-v1", max_tokens=10, ignore_eos=True, seed=4, logprobs=0)
    assert lora["model"] == "policy-v1"
    lora = lora["choices"][0]
    assert lora["logprobs"]["token_logprobs"] != base["logprobs"]["token_logprobs"]
    ref = reference_logprobs(peft_model, PROMPT, lora["token_ids"])   # peft applies the adapter
    assert max(abs(v - ref[j, t]) for j, (t, v) in enumerate(zip(lora["token_ids"],
               lora["logprobs"]["token_logprobs"]))) <= 1e-5
    again = complete(server, max_tokens=10, ignore_eos=True, seed=4, logprobs=0)["choices"][0]
    assert again["token_ids"] == base["token_ids"]                     # the base model is untouched

    assert_error(load(server, "policy-v1", path), 400)
    assert load(server, "policy-v1", path, load_inplace=True).status_code == 200
    assert_error(load(server, "x", path + "-missing"), 404)
    assert_error(load(server, server_name(server), path), 400)
    assert_error(post(server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400)
    make_adapter(toy_dir, str(tmp_path / "big"), r=16)                 # the server allows rank 8
    assert_error(load(server, "big", str(tmp_path / "big")), 400)

    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "policy-v1"})
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'policy-v1' removed successfully."
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "model": "policy-v1"}), 404)
    assert_error(post(server, "/v1/unload_lora_adapter", {"lora_name": "policy-v1"}), 404)

    names = [f"lru-{i}" for i in range(7)]                 # --max-loras 6: the oldest goes
    for name in names:
        assert load(server, name, path).status_code == 200
    complete(server, model=names[1], max_tokens=1)         # used, so lru-2 is now the oldest
    load(server, "lru-7", path)
    loaded = [c["id"] for c in get(server, "/v1/models").json()["data"][1:]]
    assert sorted(loaded) == sorted(set(names[1:]) - {"lru-2"} | {"lru-7"})
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "model": "lru-0"}), 404)
    for name in loaded:
        post(server, "/v1/unload_lora_adapter", {"lora_name": name})


def server_name(server) -> str:
    return get(server, "/v1/models").json()["data"][0]["id"]


# ── pause / resume ────────────────────────────────────────────────────────────────────────


def start_long(server, pool, n):
    """n sequences of 240 tokens, returned once they are running (n=8: seconds of work here)."""
    future = pool.submit(complete, server, max_tokens=240, ignore_eos=True, n=n)
    wait_for(lambda: metrics(server)["vllm:num_requests_running"] == n)
    return future


def test_pause_abort_rejects_until_resume(server):
    with ThreadPoolExecutor(1) as pool:
        long = start_long(server, pool, 8)
        assert post(server, "/pause?mode=abort").json() == {"status": "paused"}
        choices = long.result()["choices"]
    assert all(c["finish_reason"] == "abort" and len(c["token_ids"]) < 240 for c in choices)
    assert get(server, "/is_paused").json() == {"is_paused": True}
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT}), 503)
    paused = post(server, "/inference/v1/generate", {"token_ids": PROMPT,
                                                     "sampling_params": {"top_k": 3}})
    assert_error(paused, 503)
    assert post(server, "/resume").json() == {"status": "resumed"}
    assert get(server, "/is_paused").json() == {"is_paused": False}
    assert complete(server, max_tokens=2)["choices"][0]["finish_reason"] in ("stop", "length")


def test_pause_wait_drains_in_flight_requests(server):
    with ThreadPoolExecutor(1) as pool:
        long = start_long(server, pool, 2)
        assert post(server, "/pause?mode=wait").json() == {"status": "paused"}
        m = metrics(server)                                     # drained before /pause answered
        assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
        assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == 240
                   for c in long.result()["choices"])
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT}), 503)
    post(server, "/resume")


def test_pause_wait_after_keep_drains_the_kept_requests(server):
    """keep freezes the engine; a later pause(mode=wait) must restart it to drain, not wait
    forever."""
    with ThreadPoolExecutor(1) as pool:
        long = start_long(server, pool, 2)
        try:
            assert post(server, "/pause?mode=keep&clear_cache=false").json() == {"status": "paused"}
            r = requests.post(server.url + "/pause?mode=wait", timeout=30)
            assert r.json() == {"status": "paused"}
            assert all(len(c["token_ids"]) == 240 for c in long.result(timeout=5)["choices"])
        finally:
            post(server, "/resume")


def test_pause_keep_queues_and_clear_cache_preempts(server):
    preempted = metrics(server)["vllm:num_preemptions_total"]
    with ThreadPoolExecutor(2) as pool:
        long = start_long(server, pool, 8)
        assert post(server, "/pause?mode=keep&clear_cache=true").json() == {"status": "paused"}
        m = metrics(server)
        assert m["vllm:num_preemptions_total"] == preempted + 8
        assert m["vllm:num_requests_running"] == 0
        queued = pool.submit(complete, server, max_tokens=3)
        wait_for(lambda: metrics(server)["vllm:num_requests_waiting"] == 9)
        time.sleep(0.2)
        assert not long.done() and not queued.done()
        post(server, "/resume")
        assert all(len(c["token_ids"]) == 240 for c in long.result()["choices"])
        assert queued.result()["choices"][0]["finish_reason"] in ("stop", "length")


def test_pause_bad_mode(server):
    r = post(server, "/pause?mode=later")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    assert get(server, "/is_paused").json() == {"is_paused": False}


# ── bad input ─────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokns": 4}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 106}),          # the vocab (105) at most
    ("/v1/completions", {"prompt": [1, 2, 105]}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 250}),         # 7 + 250 > 256 positions
    ("/v1/completions", {"prompt": [[1, 2], [3, -1]]}),
    ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"top_k": 0}}),  # top_k > 0
    ("/inference/v1/generate", {"token_ids": PROMPT,
                                "sampling_params": {"top_k": 2, "temperature": 0}}),
    ("/inference/v1/generate", {"token_ids": PROMPT,
                                "sampling_params": {"top_k": 2, "best_of": 2}}),
    ("/weight_checker", {"action": "explode"}),
])
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, path, body):
    assert_error(post(server, path, body), 400)
    assert complete(server, max_tokens=2)["choices"][0]["finish_reason"] in ("stop", "length")


def test_unknown_model_is_404(server):
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "model": "nope"}), 404)


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
