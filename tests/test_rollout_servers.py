"""rollout/servers.py: the live concurrency cap, routing groups over replicas, the checks at start,
and several replicas without a proxy against local_vllm (groups stay on one replica, both
serve, a killed replica stops the run naming it, a wrong API key fails at once with a clear 401)."""
import os
import signal
import time
from collections import Counter, defaultdict

import pytest
from datasets import Dataset

import rollout_helpers as h
import toy
from rollout.servers import ConcurrencyCap, Replica, candidates_remedy, pick
from rollout.worker import RolloutWorker

FLAGS = h.SERVER_FLAGS


# ── the cap and routing, without a server ───────────────────────────────────────────────────


def test_cap_starts_from_kv_size_and_stays_at_bound_without_metrics():
    assert ConcurrencyCap.start(bound=64, kv_cache_tokens=4096, max_model_len=1024,
                                has_metrics=True).cap == 4
    assert ConcurrencyCap.start(bound=2, kv_cache_tokens=4096, max_model_len=1024,
                                has_metrics=True).cap == 2
    fixed = ConcurrencyCap.start(bound=64, kv_cache_tokens=4096, max_model_len=1024,
                                 has_metrics=False)
    fixed.observe(kv_usage=0.99, waiting=5, inflight=64)
    assert fixed.cap == 64


def test_cap_rises_per_caps_worth_while_calm_and_cuts_once_until_drained():
    cap = ConcurrencyCap(bound=10, cap=4)
    cap.observe(kv_usage=0.3, waiting=0, inflight=4)
    for _ in range(3):
        cap.rollout_done(inflight=3)
    assert cap.cap == 4
    cap.rollout_done(inflight=3)
    assert cap.cap == 5                      # +25% after 4 completions
    cap.observe(kv_usage=0.3, waiting=1, inflight=5)  # something waits: no raise
    for _ in range(10):
        cap.rollout_done(inflight=4)
    assert cap.cap == 5
    cap.observe(kv_usage=0.9, waiting=0, inflight=5)
    assert cap.cap == 3                      # −30%
    cap.observe(kv_usage=0.95, waiting=0, inflight=5)
    assert cap.cap == 3                      # in-flight (5) is not under the new cap yet
    cap.rollout_done(inflight=2)
    cap.observe(kv_usage=0.95, waiting=0, inflight=2)
    assert cap.cap == 2
    for _ in range(50):
        cap.observe(kv_usage=0.1, waiting=0, inflight=1)
        cap.rollout_done(inflight=1)
    assert cap.cap == 10                     # up to the bound, never beyond


def test_pick_prefers_the_least_loaded_then_takes_turns():
    a, b, c = (Replica(url, None, ConcurrencyCap(8, 8)) for url in "abc")
    assert [pick([a, b, c]).url for _ in range(4)] == ["a", "b", "c", "a"]   # idle: round robin
    a.assigned, a.waiting, a.kv_usage = 8, 2, 0.7                           # 10/8 + 0.7 = 1.95
    b.assigned, b.kv_usage = 8, 0.3                                         # 8/8 + 0.3 = 1.3
    c.assigned, c.kv_usage = 12, 0.0                                        # 12/8 = 1.5
    assert pick([a, b, c]).url == "b"


# ── against local_vllm ──────────────────────────────────────────────────────────────────


def test_the_candidate_sets_remedy_fits_the_servers_hardware():
    """Spec (top-k/top-p): --return-sampling-mask runs on vLLM's Model Runner V2, so a GPU server
    that refuses it is told VLLM_USE_V2_MODEL_RUNNER=1; a CPU server cannot return the sets at
    all, so it is told to sample without truncation."""
    gpu = candidates_remedy({"device_config": {"device": "cuda"}})
    assert "--return-sampling-mask --enable-scale-out" in gpu
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in gpu
    cpu = candidates_remedy({"device_config": {"device": "cpu"}})
    assert "--return-sampling-mask" not in cpu and "top_k=0, top_p=1" in cpu


def test_server_flags_are_checked_at_start(start_server, tokenizer):
    server = start_server("--max-model-len", "128", "--max-logprobs", "4")  # raw, 4 at most
    worker = RolloutWorker(h.config_for(server), toy.make_dataset(2), [h.rank_reward], tokenizer)
    with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs --max-logprobs 8"):
        worker.start()
    assert worker.process is None


def test_concurrency_cap_falls_when_kv_usage_is_high(start_server, tokenizer):
    # its own server: the requests still running when the worker stops must not load the next test's
    server = start_server("--max-model-len", "256", "--kv-cache-tokens", "1024", "--logprobs-mode",
                          "processed_logprobs")
    long_prompts = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"{i}+1=" + "x" * 190}]} for i in range(40)])
    config = h.config_for(server, max_completion_length=40, max_concurrent_rollouts=8,
                          num_sampler_logprobs=1)
    worker = RolloutWorker(config, long_prompts, [h.rank_reward], tokenizer,
                           loop_cls=h.FastPollLoop)
    polls = h.poll_until(worker, lambda p: p["rollout/concurrency_cap"] < 4)
    assert max(p["rollout/concurrency_cap"] for p in polls) <= 4  # 1024 KV tokens / 256 per request
    assert max(p["rollout/kv_cache_usage"] for p in polls) > 0.8
    assert polls[-1]["rollout/concurrency_cap"] == 2  # int(4 × 0.7)


def test_concurrency_cap_rises_while_the_server_is_idle(small_kv_server, tokenizer):
    config = h.config_for(small_kv_server, max_completion_length=4, max_concurrent_rollouts=12,
                          num_train_epochs=20, num_sampler_logprobs=1)
    worker = RolloutWorker(config, toy.make_dataset(8), [h.rank_reward], tokenizer,
                           loop_cls=h.FastPollLoop)
    polls = h.poll_until(worker, lambda p: p["rollout/concurrency_cap"] >= 7)
    caps = [p["rollout/concurrency_cap"] for p in polls]
    assert caps[0] == 4 and caps == sorted(caps)
    assert all(p["rollout/kv_cache_usage"] < 0.6 for p in polls)


def two_replicas(start_server, tokenizer, loop_cls, prompts, separator=",", **config):
    """Two servers a and b, and a worker whose vllm_server_base_url lists both."""
    a = start_server(*FLAGS)
    b = start_server(*FLAGS)
    config = h.config_for(a, vllm_server_base_url=f"{a.url}{separator}{b.url}", **config)
    worker = RolloutWorker(config, toy.make_dataset(prompts), [h.rank_reward], tokenizer,
                           loop_cls=loop_cls)
    return a, b, worker


@pytest.mark.slow
def test_groups_stay_on_one_replica_and_both_replicas_serve(start_server, tokenizer):
    a, b, worker = two_replicas(start_server, tokenizer, h.ModelRecordingLoop, prompts=6,
                                separator=", ", num_generations=3, max_concurrent_rollouts=6)
    samples, metrics = h.run_worker(worker)
    by_group = defaultdict(set)
    for s in samples:
        by_group[s.group_id] |= {url for url, _ in h.served(s)}
    assert len(by_group) >= 4 and all(len(urls) == 1 for urls in by_group.values())  # prefix cache
    assert set().union(*by_group.values()) == {a.url, b.url}                       # spread by load
    caps = [m["rollout/concurrency_cap"] for m in metrics if "rollout/concurrency_cap" in m]
    assert caps and max(caps) <= 6                                                   # split in two


def samples_until(worker, stop, timeout=60.0) -> list:
    """Consume samples, publishing a version per sample as a trainer would, until stop(samples)
    holds or the prompts run out."""
    samples = []
    while not stop(samples) and (sample := worker.get(timeout=timeout)) is not None:
        samples.append(sample)
        worker.set_model_version(sample.model_version + 1)
    return samples


@pytest.mark.slow
def test_a_killed_replica_is_routed_around_and_its_rollouts_run_again(start_server, tokenizer):
    """b is killed while both serve: the run ends normally on a, and every prompt is in exactly
    num_generations samples (the rollouts in flight on b ran again on a: none lost, none twice)."""
    a, b, worker = two_replicas(start_server, tokenizer, h.FailFastLoop, prompts=120,
                                max_completion_length=32)
    try:
        worker.start()
        before = samples_until(worker, lambda got: {u for s in got for u, _ in h.served(s)}
                               == {a.url, b.url})
        os.killpg(b.proc.pid, signal.SIGKILL)          # at once: generation goes on meanwhile
        after = samples_until(worker, lambda got: False)
    finally:
        worker.stop()
    counts = Counter(s.prompt_index for s in before + after)
    assert counts == {i: 2 for i in range(120)}
    assert {u for s in after[-8:] for u, _ in h.served(s)} == {a.url}


def test_when_every_replica_is_killed_the_run_stops_naming_them(start_server, tokenizer):
    a, b, worker = two_replicas(start_server, tokenizer, h.FailFastLoop, prompts=400,
                                max_completion_length=32)
    try:
        worker.start()
        samples_until(worker, lambda got: len(got) >= 4)
        a.stop()
        b.stop()
        with pytest.raises(RuntimeError) as failure:
            samples_until(worker, lambda got: False, timeout=120)
    finally:
        worker.stop()
    message = str(failure.value)
    assert "no vLLM server is left" in message and a.url in message and b.url in message


def test_a_wrong_api_key_fails_at_once_with_a_clear_401(start_server, tokenizer, monkeypatch):
    server = start_server(*FLAGS, "--api-key", "right-key")
    monkeypatch.setenv("VLLM_API_KEY", "wrong-key")       # the spawned rollout process inherits it
    worker = RolloutWorker(h.config_for(server), toy.make_dataset(2), [h.rank_reward], tokenizer)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="HTTP 401") as failure:
        worker.start()
    assert time.monotonic() - start < 30 and "refused the key in VLLM_API_KEY" in str(failure.value)
    assert "wrong-key" not in str(failure.value) and "right-key" not in str(failure.value)


def test_a_replica_whose_sync_failed_verification_leaves_routing_until_a_later_one_lands(
        start_server):
    """The trainer labels a server whose weights failed its verification "unverified-N"
    (FullSync.push, take_out_unverified); the rollout process takes it out of routing before a group
    starts at that version (drop_unverified), and readmit brings it back once a later sync gives
    it a numbered version again."""
    import asyncio

    import requests

    from rollout.servers import drop_unverified, make_replicas, readmit
    from vllm_client import UNVERIFIED, VLLMClient
    server = start_server(*h.SERVER_FLAGS)
    replicas = make_replicas([server.url], bound=4, timeout=10, max_retries=0)
    asyncio.run(drop_unverified(replicas, "toy", adapter=False))
    assert replicas[0].down is None                        # "default": never synced, not refused
    VLLMClient(server.url, timeout=10).update_weight_version(f"{UNVERIFIED}3")
    asyncio.run(drop_unverified(replicas, "toy", adapter=False))
    assert "unverified-3" in replicas[0].down
    assert not asyncio.run(readmit(replicas, "toy", 3, adapter=False))
    requests.post(server.url + "/update_weight_version", json={"new_version": "4"})
    assert asyncio.run(readmit(replicas, "toy", 4, adapter=False))
    assert replicas[0].down is None


def test_a_replica_whose_adapter_failed_its_probe_leaves_routing_until_a_later_one_lands(
        start_server, toy_dir, tmp_path):
    """Adapter sync: the trainer unloads an adapter whose probe failed on a replica
    (lora_sync: take_out_unverified, unload); that replica lists no card for the
    current adapter, so the rollout process takes it out of routing before a group starts under
    it, and readmit brings it back once a later adapter loads there. Unloading an adapter a
    server never held is not an error (a replica back since it was loaded)."""
    import asyncio

    import lora_sync
    from rollout.servers import drop_unverified, make_replicas, readmit
    from local_vllm_helpers import make_adapter
    from vllm_client import VLLMClient
    server = start_server(*h.SERVER_FLAGS, "--enable-lora", "--max-lora-rank", "8",
                          "--max-loras", "3")
    client = VLLMClient(server.url, timeout=10)
    for v in (1, 2):
        make_adapter(toy_dir, str(tmp_path / f"v{v}"))
    client.load_lora_adapter("policy-v1", str(tmp_path / "v1"))
    replicas = make_replicas([server.url], bound=4, timeout=10, max_retries=0)
    asyncio.run(drop_unverified(replicas, "policy-v1", adapter=True))
    assert replicas[0].down is None
    lora_sync.unload(client, "policy-v1")                   # its probe failed
    lora_sync.unload(client, "policy-v1")                   # not held: no error
    asyncio.run(drop_unverified(replicas, "policy-v1", adapter=True))
    assert "no adapter policy-v1" in replicas[0].down
    assert not asyncio.run(readmit(replicas, "policy-v1", 1, adapter=True))
    client.load_lora_adapter("policy-v2", str(tmp_path / "v2"))
    assert asyncio.run(readmit(replicas, "policy-v2", 2, adapter=True))
    assert replicas[0].down is None
