"""Several vLLM replicas without a proxy, API keys, and LoRA adapter names per policy version, against
serve_local.py: groups stay on one replica, both replicas serve, a killed replica stops the run naming
it, a wrong API key fails at once with a clear 401, and a rollout that spans a sync finishes under the
adapter of the version it started under."""
import queue
import time
from collections import defaultdict

import httpx
import pytest
from transformers import AutoTokenizer

import rollout_helpers as h
import toy
from rollout_worker import RolloutWorker
from test_rollout import config_for, run_worker
from test_serve_local import make_adapter

FLAGS = ("--max-model-len", "256", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "8")


@pytest.fixture
def tokenizer(toy_dir):
    return AutoTokenizer.from_pretrained(toy_dir)


def served(sample) -> list[tuple[str, str]]:
    """(server URL, model it served) per turn of the sample's rollout (ModelRecordingLoop's tag)."""
    return [tuple(turn.split("|")) for turn in sample.rollout_id.split(",")]


def test_groups_stay_on_one_replica_and_both_replicas_serve(start_server, tokenizer):
    a, b = start_server(*FLAGS), start_server(*FLAGS)
    config = config_for(a, vllm_server_base_url=f"{a.url}, {b.url}", num_generations=3, max_concurrent_rollouts=6)
    worker = RolloutWorker(config, toy.make_dataset(6), [h.rank_reward], tokenizer, loop_cls=h.ModelRecordingLoop)
    samples, metrics = run_worker(worker)
    by_group = defaultdict(set)
    for s in samples:
        by_group[s.group_id] |= {url for url, _ in served(s)}
    assert len(by_group) >= 4 and all(len(urls) == 1 for urls in by_group.values())   # prefix-cache affinity
    assert set().union(*by_group.values()) == {a.url, b.url}                           # spread by load
    caps = [m["rollout/concurrency_cap"] for m in metrics if "rollout/concurrency_cap" in m]
    assert caps and max(caps) <= 6                                                     # split over the replicas


def test_a_killed_replica_stops_the_run_naming_it(start_server, tokenizer):
    a, b = start_server(*FLAGS), start_server(*FLAGS)
    config = config_for(a, vllm_server_base_url=f"{a.url},{b.url}", max_steps=100, max_completion_length=32)
    worker = RolloutWorker(config, toy.make_dataset(8), [h.rank_reward], tokenizer, loop_cls=h.FailFastLoop)
    try:
        worker.start()
        seen = set()
        for _ in range(40):                                     # both replicas serve before the kill
            seen |= {url for url, _ in served(worker.get(timeout=60))}
            if seen == {a.url, b.url}:
                break
        assert seen == {a.url, b.url}
        b.stop()
        with pytest.raises(RuntimeError) as failure:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    worker.set_model_version(worker.get(timeout=0.5).model_version + 1)
                except queue.Empty:
                    pass
    finally:
        worker.stop()
    message = str(failure.value)
    assert f"the vLLM server at {b.url} stopped answering" in message and a.url not in message


def test_a_wrong_api_key_fails_at_once_with_a_clear_401(start_server, tokenizer, monkeypatch):
    server = start_server(*FLAGS, "--api-key", "right-key")
    monkeypatch.setenv("VLLM_API_KEY", "wrong-key")             # the spawned rollout process inherits it
    worker = RolloutWorker(config_for(server), toy.make_dataset(2), [h.rank_reward], tokenizer)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="HTTP 401") as failure:
        worker.start()
    assert time.monotonic() - start < 30 and "refused the key in VLLM_API_KEY" in str(failure.value)
    assert "wrong-key" not in str(failure.value) and "right-key" not in str(failure.value)


def test_rollouts_name_the_adapter_of_the_version_they_started_under(start_server, toy_dir, tokenizer, tmp_path):
    server = start_server(*FLAGS, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "3")
    base = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    make_adapter(toy_dir, str(tmp_path / "v2"))
    config = config_for(server, max_concurrent_rollouts=2, max_completion_length=6, per_device_train_batch_size=64)
    worker = RolloutWorker(config, toy.make_dataset(3), [h.rank_reward], tokenizer, loop_cls=h.SpanningLoop,
                           lora_name="policy")
    samples = []
    try:
        worker.start()                                          # version 0: no adapter exists yet
        with pytest.raises(queue.Empty):
            worker.get(timeout=1.0)                             # group 0 waits between its turns for version 2
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "policy-v2",
                                                                   "lora_path": str(tmp_path / "v2")})
        assert r.status_code == 200
        worker.set_model_version(2)
        while (sample := worker.get(timeout=60)) is not None:
            samples.append(sample)
    finally:
        worker.stop()
    models = {s.group_id: {model for _, model in served(s)} for s in samples}
    assert models[0] == {base}                                  # both turns under version 0, across the sync
    assert {g: m for g, m in models.items() if g > 0} == {1: {"policy-v2"}, 2: {"policy-v2"}}
    assert all(len(served(s)) == 2 for s in samples)


def test_pick_prefers_the_least_loaded_then_takes_turns():
    from rollout_servers import ConcurrencyCap, Replica, pick
    a, b, c = (Replica(url, None, ConcurrencyCap(8, 8)) for url in "abc")
    assert [pick([a, b, c]).url for _ in range(4)] == ["a", "b", "c", "a"]         # idle: round robin
    a.assigned, a.waiting, a.kv_usage = 8, 2, 0.7                                 # 10/8 + 0.7 = 1.95
    b.assigned, b.kv_usage = 8, 0.3                                               # 8/8 + 0.3 = 1.3
    c.assigned, c.kv_usage = 12, 0.0                                              # 12/8 = 1.5
    assert pick([a, b, c]).url == "b"
