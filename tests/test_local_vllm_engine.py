"""local_vllm/engine.py, mostly through the server's routes (one test drives an Engine
directly): sampling (log-probs against an independent recomputation,
local_vllm_helpers.reference_logprobs; seeds; stop ids and EOS; any valid parameter stays
finite), continuous batching (requests share engine steps), KV capacity (admission waits,
preemption when running sequences grow, a step never seen half ended), receiving weights (the
test plays trainer rank 0), LoRA adapters (load, use, unload, the least recently used forgotten),
a poisoned request that fails alone, pause and resume in their three modes, an unknown model.
"""
import hashlib
import math
import threading
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import requests
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import toy
from local_vllm.engine import Engine, SamplingParams
from local_vllm_helpers import (PROMPT, TARGETS, assert_error, complete, get, make_adapter,
                                metrics, post, reference_logprobs, wait_for)
from weight_sync import free_port


@pytest.fixture(scope="module")
def ref_model(toy_dir):
    return AutoModelForCausalLM.from_pretrained(toy_dir).eval()


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


# ── continuous batching and KV capacity ───────────────────────────────────────────────────


def test_concurrent_requests_share_engine_steps(server):
    """8 requests of 10 tokens queued together take 10 engine steps, not 80."""
    steps = metrics(server)["serve_local:engine_steps_total"]
    assert post(server, "/pause?mode=keep&clear_cache=false").json() == {"status": "paused"}
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, server, max_tokens=10, ignore_eos=True, seed=i)
                   for i in range(8)]
        wait_for(lambda: metrics(server)["vllm:num_requests_waiting"] == 8)
        assert post(server, "/resume").json() == {"status": "resumed"}
        assert all(len(f.result()["choices"][0]["token_ids"]) == 10 for f in futures)
    m = metrics(server)
    assert m["serve_local:engine_steps_total"] - steps == 10
    assert m["serve_local:max_batch_size"] >= 8


def test_kv_capacity_limits_admission_and_preempts(start_server):
    """Budget 128 tokens; 6 sequences of 16 + 80 tokens cannot all run: some wait, some are
    preempted."""
    plain_server = start_server("--max-model-len", "128", "--kv-cache-tokens", "128")
    seen = []
    with ThreadPoolExecutor(6) as pool:
        post(plain_server, "/pause?mode=keep")
        futures = [pool.submit(post, plain_server, "/v1/completions", {
            "prompt": PROMPT + [i] * 9, "max_tokens": 80, "ignore_eos": True,
            "return_token_ids": True}) for i in range(6)]
        wait_for(lambda: metrics(plain_server)["vllm:num_requests_waiting"] == 6)
        post(plain_server, "/resume")
        while not all(f.done() for f in futures):
            seen.append(metrics(plain_server))
            time.sleep(0.01)
        replies = [f.result().json() for f in futures]
    assert all(len(r["choices"][0]["token_ids"]) == 80 for r in replies)
    assert any(m["vllm:num_requests_running"] > 0 and m["vllm:num_requests_waiting"] > 0
               for m in seen)
    assert all(m["vllm:kv_cache_usage_perc"] <= 1.0 for m in seen)
    assert max(m["vllm:kv_cache_usage_perc"] for m in seen) >= 0.75
    assert metrics(plain_server)["vllm:num_preemptions_total"] > 0


class WatchedEngine(Engine):
    """An Engine whose lock records every moment the engine thread lets other threads (/metrics,
    /pause) take it while `running` holds a finished sequence or more tokens than the KV
    capacity."""

    def __init__(self, model, tokenizer, kv_tokens):
        self.seen: list[str] = []
        args = Namespace(model="toy", seed=0, kv_cache_tokens=kv_tokens,
                         logprobs_mode="processed_logprobs", return_sampling_mask=False,
                         max_model_len=128)
        super().__init__(model, tokenizer, args)

    @property
    def cond(self):
        return self.watched_cond

    @cond.setter
    def cond(self, value):
        engine = self

        class Cond(type(value)):
            def __exit__(self, *exc):
                if threading.current_thread().name == "engine":
                    engine.check()
                return super().__exit__(*exc)
        self.watched_cond = Cond()

    def check(self) -> None:
        finished = [s for s in self.running if s.finish_reason]
        overfull = self.held() > self.args.kv_cache_tokens and len(self.running) > 1
        if finished or overfull:
            self.seen.append(f"{len(finished)} finished of {len(self.running)} running, "
                             f"{self.held()} tokens held")


def test_metrics_never_see_a_step_half_ended(toy_dir):
    """Between sampling and the end of a step the lock must not be released: a /metrics reader
    would count finished requests as running and KV usage above 1.0."""
    model = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    engine = WatchedEngine(model, AutoTokenizer.from_pretrained(toy_dir), kv_tokens=40)
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=4, seed=1)
    [r] = engine.generate([PROMPT], params, None)
    assert [len(s.token_ids) for s in r.seqs] == [6] * 4 and engine.preemptions > 0
    assert engine.seen == []


def test_any_valid_sampling_parameter_gives_a_reply_never_a_server_error(server):
    """A tiny repetition_penalty (> 0, so valid) or temperature pushes logits past fp32's range;
    the stand-in keeps them finite and answers 200, where it answered 500 ("probability tensor
    contains inf, nan or element < 0")."""
    for params in (dict(repetition_penalty=1e-40), dict(repetition_penalty=1e-40,
                                                        temperature=1e-6),
                   dict(repetition_penalty=1e40, top_p=0.5), dict(temperature=1e-30)):
        reply = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                 "return_token_ids": True, "logprobs": 1,
                                                 **params})
        assert reply.status_code == 200, (params, reply.text)
        assert len(reply.json()["choices"][0]["token_ids"]) >= 1, params


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


# ── one request never hurts another ───────────────────────────────────────────────────────────


def nan_adapter(toy_dir, path):
    """A peft LoRA adapter with NaN weights, as a diverged run would push: valid files, poisoned
    output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(toy_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(math.nan)
    model.save_pretrained(path)


def test_a_poisoned_request_fails_alone(srv, toy_dir, tmp_path):
    nan_adapter(toy_dir, str(tmp_path / "nan"))
    r = post(srv, "/v1/load_lora_adapter", {"lora_name": "nan", "lora_path": str(tmp_path / "nan")})
    assert r.status_code == 200
    long = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": 2, "seed": 3,
            "return_token_ids": True, "logprobs": 0}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, srv, "/v1/completions", long)
        wait_for(lambda: metrics(srv)["vllm:num_requests_running"] == 2)
        poisoned = post(srv, "/v1/completions", {"prompt": PROMPT, "model": "nan",
                                                 "max_tokens": 5})
        assert not running.done()                      # failed while the long one still runs
        result = running.result()
    assert_error(poisoned, 500)
    assert "NaN" in poisoned.json()["error"]["message"]
    assert result.status_code == 200
    choices = result.json()["choices"]
    assert [len(c["token_ids"]) for c in choices] == [200, 200]
    alone = post(srv, "/v1/completions", long).json()["choices"]   # now without a neighbour
    assert [c["token_ids"] for c in alone] == [c["token_ids"] for c in choices]
    assert ([c["logprobs"]["token_logprobs"] for c in alone]
            == [c["logprobs"]["token_logprobs"] for c in choices])
    post(srv, "/v1/unload_lora_adapter", {"lora_name": "nan"})


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


def test_unknown_model_is_404(server):
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "model": "nope"}), 404)
