"""rollout.py, rollout_samples.py, rollout_tools.py and rollout_worker.py: unit tests of the pieces, then the spawned process against serve_local.py."""
import asyncio
import functools
import math
import os
import queue
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
from datasets import Dataset, IterableDataset
from transformers import AutoTokenizer

import rollout_helpers as h
import toy
from conftest import LocalServer
from rollout import AsyncRolloutLoop
from rollout_prompts import prompt_stream
from rollout_servers import ConcurrencyCap
from rollout_samples import Rollout, RolloutGroup, TurnRecord, parse_completion, parse_generate, reconcile, to_sample
from rollout_worker import RolloutProcessError, RolloutWorker, check_picklable
from rollout_tools import check_tools, parse_tool_calls, run_tool_calls
from train import AsyncGRPOConfig
from vllm_client import VLLMClient, VLLMError


# ── reconcile / samples ──────────────────────────────────────────────────────────────────────


def test_reconcile_clean_turns_make_one_sequence():
    turns = [TurnRecord([1, 2], [3, 4], [-0.1, -0.2]),
             TurnRecord([1, 2, 3, 4, 9], [5], [-0.3], output_mask=[1])]
    [seq], drifts = reconcile(turns)
    assert seq.input_ids == [1, 2, 3, 4, 9, 5]
    assert seq.completion_mask == [0, 0, 1, 1, 0, 1]
    assert seq.sampler_logprobs == [0, 0, -0.1, -0.2, 0, -0.3]
    assert drifts == [0]


def test_reconcile_forks_when_history_is_rerendered():
    # the docstring's example: y (=5) re-rendered as y' (=6)
    u, a, x, y, y2, E, t, z, w = 1, 2, 4, 5, 6, 7, 8, 9, 10
    turns = [TurnRecord([u, u, a], [x, y, E], [-1.0] * 3),
             TurnRecord([u, u, a, x, y2, E, t, t, a], [z, E], [-1.0] * 2),
             TurnRecord([u, u, a, x, y2, E, t, t, a, z, E, t, a], [w, E], [-1.0] * 2)]
    seqs, drifts = reconcile(turns)
    assert drifts == [2, 0]
    assert [s.input_ids for s in seqs] == [[u, u, a, x, y, E], [u, u, a, x, y2, E, t, t, a, z, E, t, a, w, E]]
    assert seqs[1].completion_mask == [0] * 9 + [1, 1, 0, 0, 1, 1]


def test_reconcile_drops_sequences_without_trained_tokens():
    turns = [TurnRecord([1], [2], [-1.0], output_mask=[0]), TurnRecord([9], [3], [-1.0])]
    seqs, drifts = reconcile(turns)
    assert [s.input_ids for s in seqs] == [[9, 3]] and drifts == [2]


def test_to_sample_aligns_arrays_with_input_ids():
    turn = TurnRecord([1, 2], [3, 4], [-0.1, -0.2], output_sampling_mask=[[3, 7], [4]],
                      output_sampler_logprobs=[{3: -0.1, 7: -2.0, 8: -3.0}, {4: -0.2}])
    [seq], _ = reconcile([turn])
    s = to_sample(seq, 2, advantage=1.0, group_id=0, model_version=3)
    assert s.input_ids.dtype == np.int64 and s.completion_mask.tolist() == [0, 0, 1, 1]
    assert s.top_ids.tolist() == [[-1, -1], [-1, -1], [3, 7], [4, -1]]
    assert s.top_logprobs[3, 1] == -np.inf and s.top_logprobs[2, 1] == pytest.approx(-2.0)
    assert s.candidate_counts.tolist() == [0, 0, 2, 1] and s.candidate_ids.tolist() == [3, 7, 4]
    assert to_sample(seq, None, advantage=1.0, group_id=0, model_version=0).top_ids is None


def test_parse_server_replies_keep_the_k_most_likely():
    reply = {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-4.0], "top_logprobs": [
        {"token_id:5": -4.0, "token_id:1": -0.5, "token_id:2": -1.0}]}}]}
    turn = parse_completion([1], reply, 2)
    assert turn.output_ids == [5] and turn.output_sampler_logprobs == [{1: -0.5, 2: -1.0}]
    reply = {"choices": [{"token_ids": [5], "sampling_mask": [[1, 5]], "logprobs": {"content": [
        {"token_id": 5, "logprob": -0.7, "rank": 2, "top_logprobs": [{"token_id": 1, "logprob": -0.6, "rank": 1}]}]}}]}
    turn = parse_generate([1], reply, 8)
    assert turn.output_log_probs == [-0.7] and turn.output_sampling_mask == [[1, 5]]


def test_malformed_reply_fails_with_a_clear_error(toy_dir):
    loop = make_loop(toy_dir)
    loop.max_model_len = 64

    async def reply(body):
        return {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.0]}}]}
    loop.replicas[0].client.acompletions = reply
    with pytest.raises(VLLMError, match="malformed reply"):
        asyncio.run(loop.generate_one_turn([1, 2]))


# ── tools ────────────────────────────────────────────────────────────────────────────────────


def test_parse_tool_calls():
    content, calls = parse_tool_calls('Hi<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                                      '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
                                      '<tool_call>{oops}</tool_call>')
    assert content == "Hi<tool_call>{oops}</tool_call>"
    assert calls[:2] == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]
    assert "invalid tool call" in calls[2]["error"]


async def slow_double(x: int) -> int:
    await asyncio.sleep(0.01)
    return 2 * x


def broken(x: int) -> int:
    raise KeyError("no")


def test_run_tool_calls_in_order_with_errors_as_messages():
    from concurrent.futures import ThreadPoolExecutor
    requested = [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "slow_double", "arguments": {"x": 4}},
                 {"name": "nope", "arguments": {}}, {"name": "broken", "arguments": {"x": 1}}, {"error": "bad json"}]
    tools = {"add": toy.add, "slow_double": slow_double, "broken": broken}
    with ThreadPoolExecutor(2) as pool:
        messages, records = asyncio.run(run_tool_calls(requested, tools, pool, turn_index=0))
    assert [m["content"] for m in messages[:2]] == ["3", "8"]
    assert "unknown tool 'nope'" in messages[2]["content"] and "KeyError" in messages[3]["content"]
    assert [(r.failed, r.unknown) for r in records] == [(False, False), (False, False), (False, True), (True, False),
                                                        (True, False)]


def test_environment_factory_dict_picks_by_row_and_exposes_its_tools():
    from concurrent.futures import ThreadPoolExecutor
    from rollout_tools import environment_reward, environment_tools, start_environment
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "1+2="}], "environment": "counter"}
    with ThreadPoolExecutor(1) as pool:
        env, prompt, _ = asyncio.run(start_environment({"counter": h.Counter}, row, pool))
        assert isinstance(env, h.Counter) and prompt[-1]["content"] == "1+2=\nUse the tools."
        assert row["prompt"][-1]["content"] == "1+2="  # the dataset row is not mutated
        assert [t.__name__ for t in environment_tools(env)] == ["add"]
        env.add(1, 2)
        assert asyncio.run(environment_reward(env, pool))[0] == (h.Counter, 1.0)
        with pytest.raises(ValueError, match="'environment' is 'chess'"):
            asyncio.run(start_environment({"counter": h.Counter}, row | {"environment": "chess"}, pool))


# ── picklability (the spec's TypeError, before anything is spawned) ─────────────────────────


class Scorer:
    def __call__(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)


def test_unpicklable_reward_functions_and_tools_raise_type_error(toy_dir):
    def closure(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match=r"reward function .*<lambda> cannot be pickled.*module-level function, a functools.partial"):
        check_picklable(lambda prompts, completions, **kw: [0.0], "reward function")
    with pytest.raises(TypeError, match=r"closure"):
        check_picklable(closure, "reward function")
    check_picklable(functools.partial(h.solved_reward, solved=[True]), "reward function")
    check_picklable(Scorer(), "reward function")
    for bad in (lambda a: a, closure, functools.partial(toy.add, a=1)):
        with pytest.raises(TypeError, match="must be a module-level function"):
            check_tools([bad])
    with pytest.raises(ValueError, match="unique"):
        check_tools([toy.add, toy.add])

    class LocalLoop(AsyncRolloutLoop):
        pass
    for kwargs in ({"reward_funcs": [lambda p, c, **k: [0.0]]}, {"reward_funcs": [toy.sum_reward], "loop_cls": LocalLoop},
                   {"reward_funcs": [toy.sum_reward], "tools": [lambda a: a]}):
        worker = RolloutWorker(AsyncGRPOConfig(), toy.make_dataset(2), kwargs.pop("reward_funcs"),
                               toy.build_tokenizer(), **kwargs)
        with pytest.raises(TypeError):
            worker.start()
        assert worker.process is None  # nothing was spawned


def test_dataset_needs_a_prompt_column():
    with pytest.raises(ValueError, match="'prompt' column"):
        RolloutWorker(AsyncGRPOConfig(), Dataset.from_list([{"question": "1+1="}]), toy.sum_reward, toy.build_tokenizer())


# ── advantages, dropped groups, reward sources ──────────────────────────────────────────────


def make_loop(toy_dir, reward_funcs=(), config=None):
    return AsyncRolloutLoop(config or AsyncGRPOConfig(num_generations=3), "toy", toy.make_dataset(2), list(reward_funcs),
                            AutoTokenizer.from_pretrained(toy_dir), [2], channels=None, max_concurrent_rollouts=2)


def group_of(rollout_rewards, env_rewards=None, solved=(True, True, True)):
    n = len(rollout_rewards)
    rollouts = [Rollout([{"role": "assistant", "content": "7"}], [9, 2], [TurnRecord([1], [9, 2], [-0.1, -0.2])],
                        reward=r) for r in rollout_rewards]
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "3+4="}]] * n, reward_kwargs={"solved": list(solved[:n])},
        completions=[r.completion for r in rollouts], completions_ids=[r.completion_ids for r in rollouts],
        completions_sequences=[reconcile(r.turns)[0] for r in rollouts], tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n, model_version=5, group_id=0, row_index=1,
        env_rewards=env_rewards or [None] * n, rollout_rewards=list(rollout_rewards), rollouts=rollouts,
        stats=[{"duration_s": 1.0, "drifts": []}] * n)


def test_advantages_are_standardised_and_nan_gets_zero(toy_dir):
    loop = make_loop(toy_dir)
    group = group_of([None] * 3)
    group.rewards = np.array([1.0, np.nan, 3.0])
    assert loop.compute_advantages(group) == pytest.approx([-1.0, 0.0, 1.0], abs=1e-3)


def test_score_group_sums_sources_and_drops_flat_groups(toy_dir):
    loop = make_loop(toy_dir, [h.solved_reward])
    group = group_of([0.5, None, 1.0], env_rewards=[(h.Counter, 2.0), None, None])
    samples, metrics = asyncio.run(loop._score_group(group))
    assert group.rewards == pytest.approx([1.0 + 2.0 + 0.5, 1.1, 1.2 + 1.0])
    assert len(samples) == 3 and samples[0].model_version == 5 and samples[0].reward == pytest.approx(3.5)
    assert samples[0].metrics["rewards/Counter/mean"] == 2.0 and math.isnan(samples[1].metrics["rewards/Counter/mean"])
    assert metrics["frac_reward_zero_std"] == 0.0 and metrics["reward_kept"] == pytest.approx(metrics["reward"])
    assert sum(s.advantage for s in samples) == pytest.approx(0.0, abs=1e-6)

    flat = make_loop(toy_dir)  # no reward functions: only Rollout.reward, all equal
    samples, metrics = asyncio.run(flat._score_group(group_of([1.0, 1.0, None])))
    assert samples == [] and metrics["frac_reward_zero_std"] == 1.0 and "reward_kept" not in metrics
    samples, metrics = asyncio.run(flat._score_group(group_of([1.0, None, None])))  # < 2 scored
    assert samples == [] and metrics["reward"] == 1.0


def weighted_rank(prompts, completions, weight, **kwargs) -> list[float]:
    return [weight * i for i in range(len(completions))]


def test_reward_sources_sharing_a_name_are_all_summed(toy_dir):
    """Two partials of one function (and an environment class named like a function) are separate sources."""
    funcs = [functools.partial(weighted_rank, weight=1.0), functools.partial(weighted_rank, weight=10.0)]
    loop = make_loop(toy_dir, funcs)
    group = group_of([None, None, None], env_rewards=[(h.Counter, 100.0), None, None])
    samples, _ = asyncio.run(loop._score_group(group))
    assert group.rewards == pytest.approx([100.0, 11.0, 22.0])
    assert samples[1].metrics["rewards/weighted_rank/mean"] == 1.0
    assert samples[1].metrics["rewards/weighted_rank_2/mean"] == 10.0


# ── concurrency cap ─────────────────────────────────────────────────────────────────────────


def test_cap_starts_from_kv_size_and_stays_at_bound_without_metrics():
    assert ConcurrencyCap.start(bound=64, kv_cache_tokens=4096, max_model_len=1024, has_metrics=True).cap == 4
    assert ConcurrencyCap.start(bound=2, kv_cache_tokens=4096, max_model_len=1024, has_metrics=True).cap == 2
    fixed = ConcurrencyCap.start(bound=64, kv_cache_tokens=4096, max_model_len=1024, has_metrics=False)
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


# ── prompt stream, resume bookkeeping, staleness window ─────────────────────────────────────


def test_prompt_stream_epochs_resume_and_streaming():
    ds = toy.make_dataset(4)
    assert [(i, e, r) for i, e, r, _ in prompt_stream(ds, 0, 1.5, -1)] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 1, 0), (5, 1, 1)]
    assert [(i, e, r) for i, e, r, _ in prompt_stream(ds, 6, 2, -1)] == [(6, 1, 2), (7, 1, 3)]
    endless = prompt_stream(ds, 0, 1, max_steps=10)
    assert len([next(endless) for _ in range(9)]) == 9
    stream = IterableDataset.from_generator(lambda: ({"prompt": str(i)} for i in range(3)))
    assert [(i, e, r) for i, e, r, _ in prompt_stream(stream, 2, 2, -1)] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    with pytest.raises(ValueError, match="empty"):  # not an endless busy loop that starves the heartbeat
        next(prompt_stream(EmptyStream(), 0, 1, max_steps=10))


class EmptyStream:
    """A streaming dataset (no len) without rows; a third pass over it means the stream spins."""
    passes = 0

    def __iter__(self):
        self.passes += 1
        assert self.passes < 3, "prompt_stream keeps re-reading an empty stream"
        return iter([])


def test_a_resumed_epoch_is_not_rejected_for_its_missing_part(toy_dir):
    """Resuming after an epoch's last accepted prompt: the rest rejected is not 'every prompt rejected'."""
    def run(start_index):
        loop = AsyncRolloutLoop(AsyncGRPOConfig(num_generations=2, num_train_epochs=1), "toy", toy.make_dataset(4), [],
                                AutoTokenizer.from_pretrained(toy_dir), [2], channels=SimpleNamespace(
                                    progress=queue.Queue()), max_concurrent_rollouts=2, dataset_start_index=start_index)
        loop.filter_prompt = lambda row_index, row, epoch: row_index < 2
        asyncio.run(loop._generate_loop())
        return loop
    loop = run(2)
    assert [loop.channels.progress.get_nowait() for _ in range(2)] == [(2, 0), (3, 0)]
    assert loop.score_queue.get_nowait() is None
    with pytest.raises(RuntimeError, match="rejected every prompt of epoch 0"):
        loop = AsyncRolloutLoop(AsyncGRPOConfig(num_generations=2, num_train_epochs=1), "toy", toy.make_dataset(4), [],
                                AutoTokenizer.from_pretrained(toy_dir), [2], channels=SimpleNamespace(
                                    progress=queue.Queue()), max_concurrent_rollouts=2)
        loop.filter_prompt = lambda row_index, row, epoch: False
        asyncio.run(loop._generate_loop())


def sample_for(prompt_index):
    return SimpleNamespace(prompt_index=prompt_index)


def test_resume_index_counts_handed_out_dropped_and_filtered_prompts():
    worker = RolloutWorker(AsyncGRPOConfig(), toy.make_dataset(8), toy.sum_reward, toy.build_tokenizer(),
                           dataset_start_index=3)
    buffer, progress = queue.Queue(), queue.Queue()
    worker.channels = SimpleNamespace(rollout_buffer=buffer, progress=progress, consumed=SimpleNamespace(value=0))
    for index, samples in ((3, 2), (4, 0), (5, 1)):
        progress.put((index, samples))
    for index in (3, 3, 5):
        buffer.put(sample_for(index))
    assert worker.resume_index() == 3
    worker.get()
    assert worker.resume_index() == 3        # prompt 3 still has a sample in the queue
    worker.get()
    assert worker.resume_index() == 5        # 4 was dropped or filtered: it counts as done
    worker.get()
    assert worker.resume_index() == 6


def test_staleness_window_is_measured_from_consumption():
    config = AsyncGRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_staleness=1)
    worker = RolloutWorker(config, toy.make_dataset(8), toy.sum_reward, toy.build_tokenizer(), num_processes=2)
    value = lambda v: SimpleNamespace(value=v)  # noqa: E731
    worker.channels = SimpleNamespace(model_version=value(0), version_start=value(0), rate=value(worker.prior_rate),
                                      consumed=value(0))
    assert worker.prior_rate == 8
    worker.set_model_version(1)              # the cold sync: nothing consumed, the prior stays
    assert worker.channels.rate.value == 8
    worker.consumed = 6
    worker.set_model_version(2)
    assert (worker.channels.rate.value, worker.channels.version_start.value) == (6, 6)
    worker.consumed = 16
    worker.set_model_version(4)
    assert worker.channels.rate.value == pytest.approx(16 / 3)


# ── the process against serve_local.py ──────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def small_kv_server(toy_dir):
    """KV capacity for 4 full-length sequences: the cap starts at 4 and usage is easy to drive high."""
    s = LocalServer(toy_dir, "--max-model-len", "256", "--kv-cache-tokens", "1024", "--logprobs-mode",
                    "processed_logprobs", "--max-logprobs", "8")
    yield s
    s.stop()


@pytest.fixture
def tokenizer(toy_dir):
    return AutoTokenizer.from_pretrained(toy_dir)


def run_worker(worker, timeout=60.0):
    """All samples until the prompts run out, then the metrics; the worker is stopped."""
    samples = []
    try:
        worker.start()
        while (sample := worker.get(timeout=timeout)) is not None:
            samples.append(sample)
        return samples, worker.drain_metrics()
    finally:
        worker.stop()


def config_for(server, **kwargs):
    defaults = dict(vllm_server_base_url=server.url, num_generations=2, max_completion_length=8, num_train_epochs=1,
                    per_device_train_batch_size=8, vllm_server_timeout=30.0)
    return AsyncGRPOConfig(**(defaults | kwargs))


def test_default_loop_end_to_end_with_tools(long_server, tokenizer, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    worker = RolloutWorker(config_for(long_server, max_completion_length=6, max_tool_calling_iterations=1),
                           toy.make_dataset(2), [h.rank_reward], tokenizer, tools=[toy.add], loop_cls=h.CheckedEnvLoop)
    samples, metrics = run_worker(worker)
    assert len(samples) >= 4 and {s.prompt_index for s in samples} == {0, 1}
    for s in samples:
        L = len(s.input_ids)
        trained = s.completion_mask == 1
        assert s.completion_mask.shape == s.sampler_logprobs.shape == (L,) and s.top_ids.shape == (L, 8)
        assert trained.any() and (s.sampler_logprobs[trained] <= 0).all() and (s.sampler_logprobs[~trained] == 0).all()
        assert (s.top_ids[~trained] == -1).all() and (s.top_ids[trained, 0] >= 0).all()
        assert s.candidate_counts is None and s.model_version == 0 and not math.isnan(s.advantage)
        assert np.all(np.diff(s.top_logprobs[trained], axis=1) <= 0)  # most likely first
    assert worker.resume_index() == 2
    names = set().union(*metrics)
    assert {"rollout/duration_s", "rollout/samples_per_rollout", "completions/mean_length", "reward", "rollout/concurrency",
            "rollout/concurrency_cap", "rollout/kv_cache_usage", "rollout/vllm_retry_total"} <= names


def test_tool_call_round_trip(long_server, tokenizer):
    worker = RolloutWorker(config_for(long_server, max_completion_length=64), toy.make_dataset(2), [h.rank_reward],
                           tokenizer, tools=[toy.add], loop_cls=h.ScriptedToolLoop)
    samples, metrics = run_worker(worker)
    assert len(samples) == 4  # 2 prompts × 2 rollouts, one sequence each
    s = samples[0]
    assert [m["role"] for m in s.completion] == ["assistant", "tool", "assistant"]
    assert s.completion[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert s.completion[1]["content"] == "3" and s.completion[2]["content"] == "3"
    text = tokenizer.decode(s.input_ids[s.completion_mask == 1])
    assert text == '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>3<|im_end|>'
    assert "<tool_response>\n3\n</tool_response>" in tokenizer.decode(s.input_ids[s.completion_mask == 0])
    group = next(m for m in metrics if "tools/call_frequency" in m)
    assert group["tools/call_frequency"] == 1.0 and group["tools/add/call_total"] == 2
    assert group["tools/failure_frequency"] == 0.0 and group["rollout/fork_frac"] == 0.0
    assert group["rollout/turns_mean"] == 2 and group["rollout/samples_per_rollout"] == 1.0


def test_rerendered_tool_call_forks_the_rollout(long_server, tokenizer):
    worker = RolloutWorker(config_for(long_server, max_completion_length=64), toy.make_dataset(1), [h.rank_reward],
                           tokenizer, tools=[toy.add], loop_cls=h.CompactToolLoop)
    samples, metrics = run_worker(worker)
    assert len(samples) == 4  # 1 prompt × 2 rollouts × 2 sequences
    first, second = [s for s in samples if s.rollout_id == samples[0].rollout_id]
    assert tokenizer.decode(first.input_ids[first.completion_mask == 1]).startswith('<tool_call>{"name":"add"')
    assert tokenizer.decode(second.input_ids[second.completion_mask == 1]) == "3<|im_end|>"
    shared = next(i for i, (a, b) in enumerate(zip(first.input_ids, second.input_ids)) if a != b)
    assert shared > np.argmax(first.completion_mask)  # the fork point lies inside turn 1's output
    group = next(m for m in metrics if "rollout/fork_frac" in m)
    assert group["rollout/fork_frac"] == 1.0 and group["rollout/samples_per_rollout"] == 2.0
    assert group["rollout/drift_tokens_mean"] == len(first.input_ids) - shared > 0
    assert first.advantage == second.advantage  # one advantage per conversation


def test_environment_tools_reset_and_reward(long_server, tokenizer):
    worker = RolloutWorker(config_for(long_server, max_completion_length=64), toy.make_dataset(2), [h.rank_reward],
                           tokenizer, environment_factory=h.Counter, loop_cls=h.ScriptedToolLoop)
    samples, metrics = run_worker(worker)
    assert len(samples) == 4
    assert all(s.metrics["rewards/Counter/mean"] == 1.0 for s in samples)  # one call to the env's add
    assert all(s.prompt[-1]["content"].endswith("=\nUse the tools.") for s in samples)
    group = next(m for m in metrics if "env/reset_s" in m)
    assert "env/reward_s" in group and group["tools/add/call_total"] == 2


def test_candidate_sets_from_the_token_endpoint(long_server, tokenizer):
    worker = RolloutWorker(config_for(long_server, top_k=5, top_p=0.9, num_sampler_logprobs=4, max_completion_length=8),
                           toy.make_dataset(2),
                           [h.rank_reward], tokenizer)
    samples, _ = run_worker(worker)
    for s in samples:
        trained = np.flatnonzero(s.completion_mask)
        assert s.candidate_counts.sum() == len(s.candidate_ids) and (s.candidate_counts[s.completion_mask == 0] == 0).all()
        offsets = np.concatenate([[0], np.cumsum(s.candidate_counts)])
        for t in trained:
            candidates = s.candidate_ids[offsets[t]:offsets[t + 1]]
            assert 1 <= len(candidates) <= 5 and s.input_ids[t] in candidates
            assert set(s.top_ids[t][s.top_ids[t] >= 0]) <= set(candidates)


def test_concurrency_cap_falls_when_kv_usage_is_high(start_server, tokenizer):
    # its own server: the requests still running when the worker stops must not load the next test's server
    server = start_server("--max-model-len", "256", "--kv-cache-tokens", "1024", "--logprobs-mode", "processed_logprobs")
    long_prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+1=" + "x" * 190}]} for i in range(40)])
    worker = RolloutWorker(config_for(server, max_completion_length=40, max_concurrent_rollouts=8, num_sampler_logprobs=1),
                           long_prompts, [h.rank_reward], tokenizer, loop_cls=h.FastPollLoop)
    polls = poll_until(worker, lambda p: p["rollout/concurrency_cap"] < 4)
    assert max(p["rollout/concurrency_cap"] for p in polls) <= 4  # 1024 KV tokens / max_model_len 256
    assert max(p["rollout/kv_cache_usage"] for p in polls) > 0.8
    assert polls[-1]["rollout/concurrency_cap"] == 2  # int(4 × 0.7)


def test_concurrency_cap_rises_while_the_server_is_idle(small_kv_server, tokenizer):
    worker = RolloutWorker(config_for(small_kv_server, max_completion_length=4, max_concurrent_rollouts=12,
                                      num_train_epochs=20, num_sampler_logprobs=1), toy.make_dataset(8),
                           [h.rank_reward], tokenizer, loop_cls=h.FastPollLoop)
    polls = poll_until(worker, lambda p: p["rollout/concurrency_cap"] >= 7)
    caps = [p["rollout/concurrency_cap"] for p in polls]
    assert caps[0] == 4 and caps == sorted(caps) and all(p["rollout/kv_cache_usage"] < 0.6 for p in polls)


def poll_until(worker, done, timeout=60.0):
    """Start, consume samples (publishing versions like a trainer) until a periodic metric dict satisfies `done`."""
    polls, deadline, version = [], time.monotonic() + timeout, 0
    try:
        worker.start()
        while time.monotonic() < deadline:
            try:
                worker.get(timeout=0.2)
                version += 1
                worker.set_model_version(version)
            except queue.Empty:
                pass
            polls += [m for m in worker.drain_metrics() if "rollout/concurrency_cap" in m]
            if polls and done(polls[-1]):
                return polls
        raise AssertionError(f"condition never met; caps {[p['rollout/concurrency_cap'] for p in polls]}")
    finally:
        worker.stop()


def test_generation_is_admitted_by_staleness(small_kv_server, tokenizer):
    # R = 2 samples per version, max_staleness 1: at most (1 + 1) × 2 samples ahead of the trainer
    config = config_for(small_kv_server, per_device_train_batch_size=2, max_staleness=1)
    worker = RolloutWorker(config, toy.make_dataset(16), [h.rank_reward], tokenizer, loop_cls=h.FastPollLoop)

    def settled_queue(seconds=3.0):
        """Wait for the queue to fill and stop growing (without get(): a get() on an empty queue means a
        starved trainer, which raises the rate), and return its size."""
        size, since, deadline = -1, time.monotonic(), time.monotonic() + 60
        while (time.monotonic() - since < seconds or size <= 0) and time.monotonic() < deadline:
            if worker.qsize() != size:
                size, since = worker.qsize(), time.monotonic()
            time.sleep(0.05)
        return size
    try:
        worker.start()
        assert settled_queue() == 4      # a fifth sample would be stale when the trainer reached it
        # the block is reported while it lasts, not only once it ends
        assert sum(m.get("rollout/backpressure_s", 0) for m in worker.drain_metrics()) > 1.0
        first = [worker.get(timeout=30) for _ in range(4)]
        assert {s.model_version for s in first} == {0}
        worker.set_model_version(1)      # 4 consumed in version 0: R = 4, window = 4 + 2 × 4
        assert settled_queue() == 8
        assert {worker.get(timeout=30).model_version for _ in range(8)} == {1}
    finally:
        worker.stop()


def test_curriculum_example_filters_solved_prompts(small_kv_server, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "solved": i % 2 == 0} for i in range(4)]
    config = h.CurriculumConfig(**vars(config_for(small_kv_server, num_train_epochs=2, max_concurrent_rollouts=2,
                                                  num_sampler_logprobs=1, max_completion_length=8)))
    worker = RolloutWorker(config, Dataset.from_list(rows), [h.solved_reward], tokenizer,
                           loop_cls=h.CurriculumRolloutLoop)
    samples, _ = run_worker(worker)
    by_row = {r: sorted({s.prompt_index for s in samples if s.row_index == r}) for r in range(4)}
    assert by_row == {0: [0], 1: [1, 5], 2: [2], 3: [3, 7]}  # solved rows are skipped in epoch 1
    assert worker.resume_index() == 8

    rejecting = h.CurriculumConfig(**(vars(config) | {"pass_rate_cap": 0.0}))
    worker = RolloutWorker(rejecting, Dataset.from_list(rows), [h.solved_reward], tokenizer,
                           loop_cls=h.CurriculumRolloutLoop)
    with pytest.raises(RuntimeError, match="rejected every prompt of epoch 0"):
        run_worker(worker)


def test_resume_starts_at_the_saved_prompt_index(small_kv_server, tokenizer):
    config = config_for(small_kv_server, num_train_epochs=2, top_k=5)  # no --enable-scale-out
    worker = RolloutWorker(config, toy.make_dataset(3), [h.rank_reward], tokenizer, dataset_start_index=4)
    samples, _ = run_worker(worker)
    assert sorted({(s.prompt_index, s.row_index) for s in samples}) == [(4, 1), (5, 2)]
    assert worker.resume_index() == 6
    assert all(s.candidate_counts is None for s in samples)  # the server has no candidate sets: vocabulary kept


def test_a_failed_rollout_drops_only_its_group(small_kv_server, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "boom", "2+2=")]
    worker = RolloutWorker(config_for(small_kv_server), Dataset.from_list(rows),
                           [h.rank_reward], tokenizer, loop_cls=h.FlakyLoop)
    samples, _ = run_worker(worker)
    assert sorted({s.row_index for s in samples}) == [0, 2] and worker.resume_index() == 3


def test_one_failing_prompt_of_a_large_group_does_not_stop_the_process(small_kv_server, tokenizer):
    """num_generations 8 (the default): the 8 rollouts of one bad prompt fail back to back; only its group goes."""
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "boom", "2+2=")]
    worker = RolloutWorker(config_for(small_kv_server, num_generations=8), Dataset.from_list(rows),
                           [h.rank_reward], tokenizer, loop_cls=h.FlakyLoop)
    samples, _ = run_worker(worker)
    assert sorted({s.row_index for s in samples}) == [0, 2] and worker.resume_index() == 3


def test_persistent_4xx_stops_the_process_with_its_traceback(small_kv_server, tokenizer):
    worker = RolloutWorker(config_for(small_kv_server, num_train_epochs=10),
                           toy.make_dataset(8), [h.rank_reward], tokenizer, model_name="no-such-model")
    with pytest.raises(RuntimeError, match="rollouts failed in a row") as info:
        run_worker(worker)
    assert isinstance(info.value.__cause__, RolloutProcessError)
    assert "HTTP 404" in str(info.value.__cause__) and "VLLMError" in str(info.value.__cause__)


def test_a_crashing_reward_function_reaches_the_trainer(small_kv_server, tokenizer):
    worker = RolloutWorker(config_for(small_kv_server), toy.make_dataset(2),
                           [h.exploding_reward], tokenizer)
    with pytest.raises(RuntimeError, match="reward exploded") as info:
        run_worker(worker)
    assert "exploding_reward" in str(info.value.__cause__)
    assert worker.process is None


def test_a_hung_process_is_detected_by_its_heartbeat(small_kv_server, tokenizer):
    worker = RolloutWorker(config_for(small_kv_server, rollout_worker_timeout=1.0),
                           toy.make_dataset(2), [h.rank_reward], tokenizer, loop_cls=h.StallingLoop)
    try:
        worker.start()
        pid = worker.process.pid
        with pytest.raises(RuntimeError, match="no heartbeat"):
            worker.get(timeout=10)
    finally:
        worker.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped: nothing left behind


def test_a_killed_rollout_process_stops_the_trainer(small_kv_server, tokenizer):
    worker = RolloutWorker(config_for(small_kv_server, num_train_epochs=50), toy.make_dataset(4), [h.rank_reward],
                           tokenizer)
    try:
        worker.start()
        os.kill(worker.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            for _ in range(10_000):      # samples queued before the kill may still arrive first
                worker.get(timeout=10)
    finally:
        worker.stop()
    assert worker.process is None


def test_a_paused_server_is_retried_and_counted(start_server, tokenizer):
    server = start_server("--max-model-len", "256", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "8")
    client = VLLMClient(server.url, timeout=10)
    client.pause(mode="abort")          # generation requests now get 503 until /resume
    worker = RolloutWorker(config_for(server), toy.make_dataset(2), [h.rank_reward], tokenizer,
                           loop_cls=h.FastPollLoop)
    try:
        worker.start()
        with pytest.raises(queue.Empty):
            worker.get(timeout=1.5)      # nothing while paused, and the process stays healthy
        client.resume()
        samples = []
        while (sample := worker.get(timeout=60)) is not None:
            samples.append(sample)
        metrics = worker.drain_metrics()
    finally:
        worker.stop()
        client.close()
    assert samples
    assert sum(m.get("rollout/vllm_retry_total", 0) for m in metrics) >= 1


def test_server_flags_are_checked_at_start(start_server, tokenizer):
    server = start_server("--max-model-len", "128", "--max-logprobs", "4")  # raw log-probs, 4 at most
    worker = RolloutWorker(config_for(server), toy.make_dataset(2), [h.rank_reward], tokenizer)
    with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs --max-logprobs 8"):
        worker.start()
    assert worker.process is None
