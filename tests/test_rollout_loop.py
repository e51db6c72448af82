"""rollout/loop.py: the AsyncRolloutLoop's hooks called directly (a fake server reply), the
Channels record from the spec's six primitives (spec_channels), then the spawned rollout process
against local_vllm: tools, forks, environments, candidate sets, admission by staleness, filtering,
resume, failed rollouts, retries, the adapter of each policy version; rewards, replies and limits
that misbehave (a proxy fakes what the stand-in cannot), tool rates; last, the spec's arguments
(AsyncRolloutLoop's signature, the six primitives or none)."""
import asyncio
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import re
import threading
import time

import aiohttp
import numpy as np
import pytest
import requests
from aiohttp import web
from datasets import Dataset

import rollout_helpers as h
import toy
from config import AsyncGRPOConfig
from rollout import AsyncRolloutLoop
from rollout.loop import Channels, PromptTooLong, spec_channels
from rollout.scoring import group_metrics
from rollout.staleness import prior_rate
from rollout.worker import RolloutWorker
from test_rollout_tool_calls import MISTRAL_LIKE
from local_vllm_helpers import make_adapter
from metrics import reduce_window
from vllm_client import VLLMClient, VLLMError

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


# ── the hooks, without a process ────────────────────────────────────────────────────────────


class SpecTurnLoop(AsyncRolloutLoop):
    """An override with exactly the spec's signature, beside the default generate_one; it records
    the length of each prompt it is asked for."""

    async def generate_one_turn(self, prompt_ids):
        self.turn_prompts.append(len(prompt_ids))
        return await super().generate_one_turn(prompt_ids)


def loop_with_server_text(tokenizer, text: str, **config):
    """A SpecTurnLoop whose server always answers `text` (at most max_tokens of it, ending the turn
    when it fits); the request bodies it got are in loop.bodies."""
    config = AsyncGRPOConfig(**({"num_generations": 2} | config))
    loop = h.make_loop(tokenizer, config, loop_cls=SpecTurnLoop)
    loop.max_model_len = 4096
    loop.bodies = []
    loop.turn_prompts = []
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    async def reply(body):
        loop.bodies.append(body)
        out = ids[:body["max_tokens"]]
        logprobs = {"token_logprobs": [-0.5] * len(out),
                    "top_logprobs": [{f"token_id:{t}": -0.5} for t in out]}
        return {"model": body["model"], "choices": [{"token_ids": out, "logprobs": logprobs}]}
    loop.replicas[0].client.acompletions = reply
    return loop


def test_malformed_reply_fails_with_a_clear_error(tokenizer):
    loop = h.make_loop(tokenizer)
    loop.max_model_len = 64

    async def reply(body):
        return {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.0]}}]}
    loop.replicas[0].client.acompletions = reply
    with pytest.raises(VLLMError, match="malformed reply"):
        asyncio.run(loop.generate_one_turn([1, 2]))


def test_advantages_are_standardised_and_nan_gets_zero(tokenizer):
    group = h.group_of([None] * 3)
    group.rewards = np.array([1.0, np.nan, 3.0])
    advantages = h.make_loop(tokenizer).compute_advantages(group)
    assert advantages == pytest.approx([-1.0, 0.0, 1.0], abs=1e-3)


def test_a_spec_signature_override_keeps_the_completion_budget(tokenizer):
    loop = loop_with_server_text(tokenizer, CALL, max_completion_length=100,
                                 max_tool_calling_iterations=5)
    rollout = asyncio.run(loop.generate_one([{"role": "user", "content": "1+2="}], [toy.add]))
    per_turn = len(tokenizer.encode(CALL, add_special_tokens=False)) + 1  # the call, end of turn
    budgets = list(range(100, 0, -per_turn))           # the last turn is cut at the budget left
    assert [b["max_tokens"] for b in loop.bodies] == budgets and len(budgets) >= 2
    assert len(rollout.completion_ids) == 100 and len(loop.turn_prompts) == len(budgets)
    assert [c.name for c in rollout.tool_calls] == ["add"] * (len(budgets) - 1)


def test_max_tokens_is_never_sent_at_zero_or_below(tokenizer):
    """A prompt that leaves one token of the context is sent with max_tokens 1; one that leaves
    none is PromptTooLong, sent nowhere, in a plain-text prompt and a first chat turn alike."""
    loop = loop_with_server_text(tokenizer, "7", max_completion_length=8)
    loop.max_model_len = 10
    asyncio.run(loop.generate_one_turn(list(range(9))))
    assert [b["max_tokens"] for b in loop.bodies] == [1]
    for prompt in ("x" * 10, [{"role": "user", "content": "x" * 10}]):
        with pytest.raises(PromptTooLong, match=r"its prompt of \d+ tokens leaves no room in "
                                                 r"max_model_len=10, the servers' context"):
            asyncio.run(loop.generate_one(prompt, []))
    assert len(loop.bodies) == 1


def test_a_turn_with_no_room_left_ends_the_rollout_truncated(tokenizer):
    """The server answers a tool call; the next turn's prompt would fill the context: the rollout
    ends after its first turn, marked truncated (completions/clipped_ratio 1, though that turn
    ended on its end-of-turn token), and no request goes out with max_tokens <= 0."""
    loop = loop_with_server_text(tokenizer, CALL, max_completion_length=100)
    messages = [{"role": "user", "content": "1+2="}]
    first = tokenizer.apply_chat_template(messages, tools=[toy.add], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
    loop.max_model_len = len(first) + 60     # room for the call, none for the tool's answer
    rollout = asyncio.run(loop.generate_one(messages, [toy.add]))
    assert rollout.truncated and len(rollout.turns) == 1 and rollout.completion_ids[-1] == 2
    assert [b["max_tokens"] for b in loop.bodies] == [60]
    group = h.group_of([None, None])
    group.rollouts[0] = rollout
    assert group_metrics(group, [2])["completions/clipped_ratio"] == 0.5


def test_the_tokenizers_own_response_format_drives_the_tool_loop(tokenizer):
    tokenizer.response_template = MISTRAL_LIKE
    text = 'Sure[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}][/TOOL_CALLS]'
    loop = loop_with_server_text(tokenizer, text, max_completion_length=300,
                                 max_tool_calling_iterations=1)
    rollout = asyncio.run(loop.generate_one([{"role": "user", "content": "1+2="}], [toy.add]))
    assert [(c.name, c.failed) for c in rollout.tool_calls] == [("add", False)]
    assert rollout.completion[1] == {"role": "tool", "name": "add", "content": "3"}


def test_an_unknown_tool_format_warns_once(tokenizer, caplog):
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    loop = loop_with_server_text(tokenizer, CALL, max_completion_length=20)
    assert loop.tool_format is None
    with caplog.at_level(logging.WARNING, logger="rollout"):
        for _ in range(2):
            asyncio.run(loop.generate_one([{"role": "user", "content": "1+2="}], [toy.add]))
    assert sum("neither defines a response_template" in r.message for r in caplog.records) == 1


def test_a_stop_that_meets_a_wake_ends_the_wait(tokenizer):
    """The generate loop waits on `wake`; cancelled (the run stops) just as a rollout sets it, the
    wait must end: asyncio.wait_for on Python 3.11 swallowed such a cancel, and the child hung in
    its shutdown until the trainer called it silent."""
    loop = h.make_loop(tokenizer)

    async def main():
        waiting = asyncio.create_task(loop._wait_until(lambda: False))
        await asyncio.sleep(0.01)
        loop.wake.set()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 2)
    asyncio.run(main())


@pytest.mark.parametrize("factory, max_steps, fix", [
    (None, 10, "environment_factory"), ({"a": h.PromptEnv}, 10, "requires a `train_dataset`"),
    (h.PromptEnv, -1, "max_steps > 0")])
def test_no_dataset_is_refused_at_start_naming_the_fix(tokenizer, factory, max_steps, fix):
    with pytest.raises(ValueError, match=fix):
        AsyncRolloutLoop(AsyncGRPOConfig(max_steps=max_steps), "toy", None, [], tokenizer, [2],
                         channels=None, max_concurrent_rollouts=2, environment_factory=factory)


SPEC_SIX = ("rollout_buffer", "model_version_value", "heartbeat_value", "failed_event",
            "exception_info_queue", "metrics_queue")


def six():
    ctx = mp.get_context("spawn")
    return dict(rollout_buffer=ctx.Queue(), model_version_value=ctx.Value("q", 3),
                heartbeat_value=ctx.Value("d", 0.0), failed_event=ctx.Event(),
                exception_info_queue=ctx.Queue(1), metrics_queue=ctx.Queue())


def test_the_spec_six_are_the_records_channels_and_ours_are_stand_ins():
    config = AsyncGRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    given = six()
    channels = spec_channels(config, **given)
    assert isinstance(channels, Channels)
    assert channels.rollout_buffer is given["rollout_buffer"]
    assert channels.metrics is given["metrics_queue"]
    assert channels.exception_info is given["exception_info_queue"]
    assert channels.model_version.value == 3 and channels.failed is given["failed_event"]
    assert isinstance(channels.progress, queue.Queue)            # nobody reads resume progress
    assert isinstance(channels.stop, threading.Event) and not channels.stop.is_set()
    assert channels.rate.value == prior_rate(config, 1) == 8     # no trainer publishes a window
    assert (channels.version_start.value, channels.consumed.value) == (0, 0)


@pytest.mark.parametrize("missing", SPEC_SIX)
def test_a_missing_primitive_is_named(missing):
    given = six() | {missing: None}
    with pytest.raises(TypeError, match=rf"AsyncRolloutLoop needs {missing} \(or one `channels`"):
        spec_channels(AsyncGRPOConfig(), **given)


# ── the process against local_vllm ──────────────────────────────────────────────────────


def test_default_loop_end_to_end_with_tools(long_server, tokenizer, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    config = h.config_for(long_server, max_completion_length=6, max_tool_calling_iterations=1)
    worker = RolloutWorker(config, toy.make_dataset(2), [h.rank_reward], tokenizer, tools=[toy.add],
                           loop_cls=h.CheckedEnvLoop)
    samples, metrics = h.run_worker(worker)
    assert len(samples) >= 4 and {s.prompt_index for s in samples} == {0, 1}
    for s in samples:
        L = len(s.input_ids)
        trained = s.completion_mask == 1
        assert s.completion_mask.shape == s.sampler_logprobs.shape == (L,)
        assert s.top_ids.shape == (L, 8) and trained.any()
        assert (s.sampler_logprobs[trained] <= 0).all()
        assert (s.sampler_logprobs[~trained] == 0).all()
        assert (s.top_ids[~trained] == -1).all() and (s.top_ids[trained, 0] >= 0).all()
        assert s.candidate_counts is None and s.model_version == 0 and not math.isnan(s.advantage)
        assert np.all(np.diff(s.top_logprobs[trained], axis=1) <= 0)  # most likely first
    assert worker.resume_index() == 2
    names = set().union(*metrics)
    assert {"rollout/duration_s", "rollout/samples_per_rollout", "completions/mean_length",
            "reward", "rollout/concurrency", "rollout/concurrency_cap", "rollout/kv_cache_usage",
            "rollout/vllm_retry_total"} <= names


def test_tool_call_round_trip(long_server, tokenizer):
    worker = RolloutWorker(h.config_for(long_server, max_completion_length=64), toy.make_dataset(2),
                           [h.rank_reward], tokenizer, tools=[toy.add], loop_cls=h.ScriptedToolLoop)
    samples, metrics = h.run_worker(worker)
    assert len(samples) == 4  # 2 prompts × 2 rollouts, one sequence each
    s = samples[0]
    assert [m["role"] for m in s.completion] == ["assistant", "tool", "assistant"]
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert s.completion[0]["tool_calls"][0]["function"] == call
    assert s.completion[1]["content"] == "3" and s.completion[2]["content"] == "3"
    text = tokenizer.decode(s.input_ids[s.completion_mask == 1])
    assert text == f"{CALL}<|im_end|>3<|im_end|>"
    context = tokenizer.decode(s.input_ids[s.completion_mask == 0])
    assert "<tool_response>\n3\n</tool_response>" in context
    group = next(m for m in metrics if "tools/call_frequency" in m)
    assert group["tools/call_frequency"] == 1.0 and group["tools/add/call_total"] == 2
    assert group["tools/failure_frequency"] == 0.0 and group["rollout/fork_frac"] == 0.0
    assert group["rollout/turns_mean"] == 2 and group["rollout/samples_per_rollout"] == 1.0


def test_rerendered_tool_call_forks_the_rollout(long_server, tokenizer):
    worker = RolloutWorker(h.config_for(long_server, max_completion_length=64), toy.make_dataset(1),
                           [h.rank_reward], tokenizer, tools=[toy.add], loop_cls=h.CompactToolLoop)
    samples, metrics = h.run_worker(worker)
    assert len(samples) == 4  # 1 prompt × 2 rollouts × 2 sequences
    first, second = [s for s in samples if s.rollout_id == samples[0].rollout_id]
    trained_text = tokenizer.decode(first.input_ids[first.completion_mask == 1])
    assert trained_text.startswith('<tool_call>{"name":"add"')
    assert tokenizer.decode(second.input_ids[second.completion_mask == 1]) == "3<|im_end|>"
    shared = next(i for i, (a, b) in enumerate(zip(first.input_ids, second.input_ids)) if a != b)
    assert shared > np.argmax(first.completion_mask)  # the fork point lies inside turn 1's output
    group = next(m for m in metrics if "rollout/fork_frac" in m)
    assert group["rollout/fork_frac"] == 1.0 and group["rollout/samples_per_rollout"] == 2.0
    assert group["rollout/drift_tokens_mean"] == len(first.input_ids) - shared > 0
    assert first.advantage == second.advantage  # one advantage per conversation


def test_environment_tools_reset_and_reward(long_server, tokenizer):
    worker = RolloutWorker(h.config_for(long_server, max_completion_length=64), toy.make_dataset(2),
                           [h.rank_reward], tokenizer, environment_factory=h.Counter,
                           loop_cls=h.ScriptedToolLoop)
    samples, metrics = h.run_worker(worker)
    assert len(samples) == 4
    assert all(s.metrics["rewards/Counter/mean"] == 1.0 for s in samples)  # one call to its add
    assert all(s.prompt[-1]["content"].endswith("=\nUse the tools.") for s in samples)
    group = next(m for m in metrics if "env/reset_s" in m)
    assert "env/reward_s" in group and group["tools/add/call_total"] == 2


def test_candidate_sets_from_the_token_endpoint(long_server, tokenizer):
    config = h.config_for(long_server, top_k=5, top_p=0.9, num_sampler_logprobs=4,
                          max_completion_length=8)
    worker = RolloutWorker(config, toy.make_dataset(2), [h.rank_reward], tokenizer)
    samples, _ = h.run_worker(worker)
    for s in samples:
        trained = np.flatnonzero(s.completion_mask)
        assert s.candidate_counts.sum() == len(s.candidate_ids)
        assert (s.candidate_counts[s.completion_mask == 0] == 0).all()
        offsets = np.concatenate([[0], np.cumsum(s.candidate_counts)])
        for t in trained:
            candidates = s.candidate_ids[offsets[t]:offsets[t + 1]]
            assert 1 <= len(candidates) <= 5 and s.input_ids[t] in candidates
            assert set(s.top_ids[t][s.top_ids[t] >= 0]) <= set(candidates)


def test_generation_is_admitted_by_staleness(small_kv_server, tokenizer):
    # R = 2 samples per version, max_staleness 1: at most (1 + 1) × 2 samples ahead of the trainer
    config = h.config_for(small_kv_server, per_device_train_batch_size=2, max_staleness=1)
    worker = RolloutWorker(config, toy.make_dataset(16), [h.rank_reward], tokenizer,
                           loop_cls=h.FastPollLoop)

    def settled_queue(seconds=3.0):
        """Wait for the queue to fill and stop growing (without get(): a get() on an empty queue
        means a starved trainer, which raises the rate), and return its size."""
        size = -1
        since = time.monotonic()                    # when the size last changed
        deadline = time.monotonic() + 60
        while (time.monotonic() - since < seconds or size <= 0) and time.monotonic() < deadline:
            if worker.qsize() != size:
                size = worker.qsize()
                since = time.monotonic()
            time.sleep(0.05)
        return size
    try:
        worker.start()
        assert settled_queue() == 4      # a fifth sample would be stale when the trainer reached it
        # the block is reported while it lasts, not only once it ends; it is admission, not a
        # full queue (rollout/backpressure_s)
        drained = worker.drain_metrics()
        assert sum(m.get("rollout/admission_wait_s", 0) for m in drained) > 1.0
        assert sum(m.get("rollout/backpressure_s", 0) for m in drained) == 0
        first = [worker.get(timeout=30) for _ in range(4)]
        assert {s.model_version for s in first} == {0}
        worker.set_model_version(1)      # 4 consumed in version 0: R = 4, window = 4 + 2 × 4
        assert settled_queue() == 8
        assert {worker.get(timeout=30).model_version for _ in range(8)} == {1}
    finally:
        worker.stop()


def test_curriculum_example_filters_solved_prompts(small_kv_server, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "solved": i % 2 == 0}
            for i in range(4)]
    plain = h.config_for(small_kv_server, num_train_epochs=2, max_concurrent_rollouts=2,
                        num_sampler_logprobs=1, max_completion_length=8)
    config = h.CurriculumConfig(**vars(plain))
    worker = RolloutWorker(config, Dataset.from_list(rows), [h.solved_reward], tokenizer,
                           loop_cls=h.CurriculumRolloutLoop)
    samples, _ = h.run_worker(worker)
    by_row = {r: sorted({s.prompt_index for s in samples if s.row_index == r}) for r in range(4)}
    assert by_row == {0: [0], 1: [1, 5], 2: [2], 3: [3, 7]}  # solved rows are skipped in epoch 1
    assert worker.resume_index() == 8

    rejecting = h.CurriculumConfig(**(vars(config) | {"pass_rate_cap": 0.0}))
    worker = RolloutWorker(rejecting, Dataset.from_list(rows), [h.solved_reward], tokenizer,
                           loop_cls=h.CurriculumRolloutLoop)
    with pytest.raises(RuntimeError, match="rejected every prompt of epoch 0"):
        h.run_worker(worker)


def test_resume_starts_at_the_saved_prompt_index(small_kv_server, tokenizer):
    config = h.config_for(small_kv_server, num_train_epochs=2, top_k=5)  # no --enable-scale-out
    worker = RolloutWorker(config, toy.make_dataset(3), [h.rank_reward], tokenizer,
                           dataset_start_index=4)
    samples, _ = h.run_worker(worker)
    assert sorted({(s.prompt_index, s.row_index) for s in samples}) == [(4, 1), (5, 2)]
    assert worker.resume_index() == 6
    assert all(s.candidate_counts is None for s in samples)  # no candidate sets: the vocabulary


def test_a_failed_rollout_drops_only_its_group(small_kv_server, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "boom", "2+2=")]
    worker = RolloutWorker(h.config_for(small_kv_server), Dataset.from_list(rows),
                           [h.rank_reward], tokenizer, loop_cls=h.FlakyLoop)
    samples, _ = h.run_worker(worker)
    assert sorted({s.row_index for s in samples}) == [0, 2] and worker.resume_index() == 3


def test_one_failing_prompt_of_a_large_group_does_not_stop_the_process(small_kv_server, tokenizer):
    """num_generations 8 (the default): the 8 rollouts of one bad prompt fail back to back; only
    its group goes."""
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "boom", "2+2=")]
    worker = RolloutWorker(h.config_for(small_kv_server, num_generations=8),
                           Dataset.from_list(rows),
                           [h.rank_reward], tokenizer, loop_cls=h.FlakyLoop)
    samples, _ = h.run_worker(worker)
    assert sorted({s.row_index for s in samples}) == [0, 2] and worker.resume_index() == 3


def test_a_paused_server_is_retried_and_counted(start_server, tokenizer):
    server = start_server(*h.SERVER_FLAGS)
    client = VLLMClient(server.url, timeout=10)
    client.pause(mode="abort")          # generation requests now get 503 until /resume
    worker = RolloutWorker(h.config_for(server), toy.make_dataset(2), [h.rank_reward], tokenizer,
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


def test_an_environment_supplies_prompts_and_rewards_without_a_dataset(long_server, tokenizer):
    config = h.config_for(long_server, max_steps=3, max_completion_length=6)
    worker = RolloutWorker(config, None, None, tokenizer, environment_factory=h.PromptEnv)
    try:
        worker.start()
        samples = [worker.get(timeout=60) for _ in range(4)]
    finally:
        worker.stop()
    assert [m["content"] for m in samples[0].prompt] == ["2+3="]
    group_of = {}                       # groups finish in any order: one group per prompt index
    for s in samples:
        group_of.setdefault(s.prompt_index, set()).add(s.group_id)
    assert all(len(ids) == 1 for ids in group_of.values()), group_of
    assert len(set().union(*group_of.values())) == len(group_of)
    assert all(0 <= s.reward < 1 for s in samples)
    assert len({s.prompt_index for s in samples}) >= 2


def test_environment_prompts_resume_from_the_saved_index(long_server, tokenizer):
    """Without a dataset, prompts are numbered from dataset_start_index, and so is
    resume_index()."""
    config = h.config_for(long_server, max_steps=3, max_completion_length=6)
    worker = RolloutWorker(config, None, None, tokenizer, environment_factory=h.PromptEnv,
                           dataset_start_index=5)
    try:
        worker.start()
        samples = [worker.get(timeout=60) for _ in range(6)]
        index = worker.resume_index()
    finally:
        worker.stop()
    assert min(s.prompt_index for s in samples) >= 5     # a group whose rewards tie is dropped
    assert 5 <= index <= max(s.prompt_index for s in samples) + 1   # 0 before the fix


def test_retry_totals_run_and_preemptions_count_per_poll(start_server, tokenizer):
    """After a paused server's preemptions (pause keep + clear_cache) and retried 503s (pause
    abort): rollout/vllm_retry_total is a total since the process started, and
    rollout/vllm_preemptions_total counts those since the last poll, so a window's sum is the
    spec's count during the logging window."""
    server = start_server(*h.SERVER_FLAGS)
    config = h.config_for(server, max_completion_length=200, max_steps=50, num_generations=4)
    worker = RolloutWorker(config,
                           toy.make_dataset(8), [h.rank_reward], tokenizer, loop_cls=h.FastPollLoop)
    client = VLLMClient(server.url, timeout=10)
    polls = []

    def collect(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                worker.set_model_version(worker.get(timeout=0.1).model_version + 1)
            except queue.Empty:
                pass
            polls.extend(m for m in worker.drain_metrics() if "rollout/vllm_preemptions_total" in m)
    try:
        worker.start()
        collect(1.0)
        client.pause(mode="keep", clear_cache=True)             # preempts the running requests
        client.resume()
        client.pause(mode="abort")                              # generation gets 503s, retried
        collect(1.0)                   # consuming keeps admission open: new rollouts meet the 503s
        client.resume()
        collect(2.0)
    finally:
        worker.stop()
        client.close()
    retries = [p["rollout/vllm_retry_total"] for p in polls]
    assert retries == sorted(retries) and retries[-1] > 0, retries
    preemptions = [p["rollout/vllm_preemptions_total"] for p in polls]
    assert sum(preemptions) > 0 and preemptions[-1] == 0, preemptions   # none since, at the end
    assert reduce_window(polls)["rollout/vllm_preemptions_total"] == sum(preemptions)


def test_rollouts_name_the_adapter_of_the_version_they_started_under(start_server, toy_dir,
                                                                     tokenizer, tmp_path):
    server = start_server(*h.SERVER_FLAGS, "--enable-lora", "--max-lora-rank", "8",
                          "--max-loras", "3")
    base = requests.get(server.url + "/v1/models").json()["data"][0]["id"]
    make_adapter(toy_dir, str(tmp_path / "v2"))
    config = h.config_for(server, max_concurrent_rollouts=2, max_completion_length=6,
                          per_device_train_batch_size=64)
    worker = RolloutWorker(config, toy.make_dataset(3), [h.rank_reward], tokenizer,
                           loop_cls=h.SpanningLoop, lora_name="policy")
    samples = []
    try:
        worker.start()                                   # version 0: no adapter exists yet
        with pytest.raises(queue.Empty):
            worker.get(timeout=1.0)                      # group 0 waits between turns for version 2
        adapter = {"lora_name": "policy-v2", "lora_path": str(tmp_path / "v2")}
        r = requests.post(server.url + "/v1/load_lora_adapter", json=adapter)
        assert r.status_code == 200
        worker.set_model_version(2)
        while (sample := worker.get(timeout=60)) is not None:
            samples.append(sample)
    finally:
        worker.stop()
    models = {s.group_id: {model for _, model in h.served(s)} for s in samples}
    assert models[0] == {base}                           # both turns under version 0, across a sync
    assert {g: m for g, m in models.items() if g > 0} == {1: {"policy-v2"}, 2: {"policy-v2"}}
    assert all(len(h.served(s)) == 2 for s in samples)


def test_a_rollout_whose_adapter_was_unloaded_goes_on_under_the_newest(start_server, toy_dir,
                                                                      tokenizer, tmp_path):
    """Group 0 starts under policy-v1, waits between its turns until version 2; meanwhile the
    trainer loads v2 and unloads v1 (a 404 for the second turn): the rollout finishes under v2,
    and no group is dropped."""
    server = start_server(*h.SERVER_FLAGS, "--enable-lora", "--max-lora-rank", "8",
                          "--max-loras", "3")
    for v in (1, 2):
        make_adapter(toy_dir, str(tmp_path / f"v{v}"))
    adapter = {"lora_name": "policy-v1", "lora_path": str(tmp_path / "v1")}
    assert requests.post(server.url + "/v1/load_lora_adapter", json=adapter).status_code == 200
    config = h.config_for(server, max_concurrent_rollouts=2, max_completion_length=6,
                          per_device_train_batch_size=64)
    worker = RolloutWorker(config, toy.make_dataset(2), [h.rank_reward], tokenizer,
                           loop_cls=h.SpanningLoop, lora_name="policy", model_version=1)
    samples = []
    try:
        worker.start()
        with pytest.raises(queue.Empty):
            worker.get(timeout=1.0)                      # group 0 waits between turns
        adapter = {"lora_name": "policy-v2", "lora_path": str(tmp_path / "v2")}
        assert requests.post(server.url + "/v1/load_lora_adapter", json=adapter).status_code == 200
        r = requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "policy-v1"})
        assert r.status_code == 200
        worker.set_model_version(2)
        while (sample := worker.get(timeout=60)) is not None:
            samples.append(sample)
    finally:
        worker.stop()
    models = {s.group_id: [model for _, model in h.served(s)] for s in samples}
    assert sorted(models) == [0, 1]                       # no group dropped
    assert models[0] == ["policy-v1", "policy-v2"]
    assert {s.model_version for s in samples if s.group_id == 0} == {1}


# ── the training signal under real data: rewards, replies, limits, tool rates ───────────────


@pytest.fixture
def proxy():
    """proxy(upstream, tamper) -> the URL of an aiohttp server in front of `upstream`: requests
    pass through, a /v1/completions reply through tamper(reply) first; tamper None: a completion
    never gets an answer (a stalled server). The stand-in cannot fake either."""
    loops = []

    def start(upstream: str, tamper) -> str:
        async def handle(request):
            if request.path == "/v1/completions" and tamper is None:
                await asyncio.sleep(3600)
            async with aiohttp.ClientSession() as session:
                async with session.request(request.method, upstream + request.path_qs,
                                           data=await request.read(),
                                           headers={"Content-Type": request.content_type}) as r:
                    status, body, kind = r.status, await r.read(), r.content_type
            if request.path == "/v1/completions" and status == 200:
                body = json.dumps(tamper(json.loads(body))).encode()
            return web.Response(status=status, body=body, content_type=kind)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        threading.Thread(target=loop.run_forever, daemon=True).start()
        loops.append(loop)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for loop in loops:
        loop.call_soon_threadsafe(loop.stop)


def out_of_vocabulary(reply):
    reply["choices"][0]["token_ids"][0] = 10 ** 6
    return reply


def positive_logprob(reply):
    reply["choices"][0]["logprobs"]["token_logprobs"][0] = 0.5
    return reply


def past_stop(reply):
    """The end-of-turn token first, then the rest of what the server sampled: a reply that goes
    on past its stop token (a proxy that glued two replies)."""
    reply["choices"][0]["token_ids"][0] = toy.SPECIAL.index("<|im_end|>")
    return reply


@pytest.mark.parametrize("tamper, wrong", [
    (out_of_vocabulary, r"token ids \[1000000\] lie outside the tokenizer's vocabulary"),
    (positive_logprob, r"log-probs \[0.5\] are not finite and <= 0"),
    (lambda reply: reply | {"model": "another"}, "the reply is from model 'another', not"),
    (past_stop, r"the reply goes on past stop token 2 at 0"),
], ids=["token id", "log-prob", "model", "past its stop token"])
def test_replies_that_cannot_be_trained_on_fail_their_rollouts_naming_the_server(
        small_kv_server, tokenizer, proxy, tamper, wrong):
    url = proxy(small_kv_server.url, tamper)
    config = h.config_for(small_kv_server, vllm_server_base_url=url, num_train_epochs=10)
    worker = RolloutWorker(config, toy.make_dataset(8), [h.rank_reward], tokenizer)
    with pytest.raises(RuntimeError, match="rollouts failed in a row") as info:
        h.run_worker(worker)
    assert f"{url}/v1/completions" in str(info.value) and re.search(wrong, str(info.value))


def test_a_stalled_server_is_named_within_vllm_server_timeout(small_kv_server, tokenizer, proxy):
    """/health answers, completions never do: each request gives up after vllm_server_timeout
    in all (not max_retries + 1 times it), naming the server; persisting, it stops the run."""
    url = proxy(small_kv_server.url, None)
    config = h.config_for(small_kv_server, vllm_server_base_url=url, vllm_server_timeout=2.0,
                          num_train_epochs=10)
    worker = RolloutWorker(config, toy.make_dataset(8), [h.rank_reward], tokenizer)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rollouts failed in a row") as info:
        h.run_worker(worker)
    assert (f"{url}/v1/completions: POST gave up after 1 attempts in vllm_server_timeout=2s"
            in str(info.value))
    assert time.monotonic() - start < 60


def test_a_reward_list_of_the_wrong_length_stops_the_run_naming_the_function(small_kv_server,
                                                                             tokenizer):
    worker = RolloutWorker(h.config_for(small_kv_server), toy.make_dataset(2),
                           [h.one_too_many_reward], tokenizer)
    with pytest.raises(RuntimeError, match=r"reward function one_too_many_reward returned \[0.0, "
                                           r"1.0, 2.0\] for dataset row 0 .* a list of 2 numbers"):
        h.run_worker(worker)


def test_a_stalled_reward_function_fails_its_group_and_the_run_goes_on(small_kv_server, tokenizer,
                                                                       capfd):
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "2+2=", "3+3=")]
    worker = RolloutWorker(h.config_for(small_kv_server, reward_tool_timeout=1.0),
                           Dataset.from_list(rows), [h.slow_reward], tokenizer)
    samples, _ = h.run_worker(worker)
    assert sorted({s.row_index for s in samples}) == [0, 2] and worker.resume_index() == 3
    assert ("scoring of group 1 (dataset row 1) failed; the group is dropped: CallTimeout: "
            "slow_reward did not return within reward_tool_timeout=1s") in capfd.readouterr().err


@pytest.mark.parametrize("stuck", [h.stuck_reward, h.spinning_reward], ids=["waits", "spins"])
def test_a_stuck_reward_function_is_named_and_its_process_ends_at_once(small_kv_server,
                                                                      tokenizer, stuck):
    """A reward function that never returns (waiting, or spinning in Python): each group's call
    gives up after reward_tool_timeout, naming it, and FAILED_GROUPS_TO_STOP such groups end the
    run with its name, long before rollout_worker_timeout. Its threads do not hold the process:
    it ends within seconds of stop(). (In asyncio's own executor they did: asyncio.run joins it on
    the way out, so the error never left the child, and the trainer called it hung, naming
    nothing.)"""
    config = h.config_for(small_kv_server, reward_tool_timeout=1.0, rollout_worker_timeout=300,
                          num_train_epochs=10)
    worker = RolloutWorker(config, toy.make_dataset(8), [stuck], tokenizer)
    start = time.monotonic()
    worker.start()
    pid = worker.process.pid
    try:
        with pytest.raises(RuntimeError, match="rollouts failed in a row.*CallTimeout: "
                                               f"{stuck.__name__} did not return within "
                                               "reward_tool_timeout=1s"):
            while worker.get(timeout=300) is not None:
                pass
        assert time.monotonic() - start < 60
    finally:
        stopping = time.monotonic()
        worker.stop()
    assert time.monotonic() - stopping < 5 and not os.path.exists(f"/proc/{pid}")


def test_a_prompt_too_long_for_the_servers_is_skipped_named_and_counted(small_kv_server,
                                                                       tokenizer, capfd):
    """Row 1's chat prompt (319 tokens) has no room in the server's max_model_len of 256: its group
    is skipped, logged naming the row, its length and the limit, and counted in
    rollout/prompts_too_long_total. Nothing of it is scored (it was an empty completion, scored
    and dropped without a word); the other rows train, and the resume index passes it."""
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "1" * 300, "3+3=")]
    worker = RolloutWorker(h.config_for(small_kv_server), Dataset.from_list(rows),
                           [h.rank_reward], tokenizer)
    samples, metrics = h.run_worker(worker)
    assert sorted({s.row_index for s in samples}) == [0, 2] and worker.resume_index() == 3
    assert sum("frac_reward_zero_std" in m for m in metrics) == 2          # two groups scored
    assert [m["rollout/prompts_too_long_total"] for m in metrics
            if "rollout/prompts_too_long_total" in m] == [1]
    assert ("dataset row 1: its prompt of 319 tokens leaves no room in max_model_len=256, the "
            "servers' context; the prompt is skipped") in capfd.readouterr().err


def test_an_epoch_of_prompts_too_long_stops_with_their_error(small_kv_server, tokenizer):
    """Plain-text prompts, each too long: the run stops with their error, naming the row, the
    length and the limit (it was an HTTP 400 "Invalid max_tokens=-44"; as chat prompts, "equal
    rewards" after rollout_worker_timeout)."""
    rows = [{"prompt": "1" * 300}, {"prompt": "1" * 300}]
    worker = RolloutWorker(h.config_for(small_kv_server), Dataset.from_list(rows),
                           [h.rank_reward], tokenizer)
    with pytest.raises(RuntimeError, match=r"the prompts ran out and nothing was trained: 2 "
                                           r"prompts were too long, the last dataset row \d: its "
                                           r"prompt of 300 tokens leaves no room in "
                                           r"max_model_len=256") as info:
        h.run_worker(worker)
    assert "equal rewards" not in str(info.value)


def test_a_rollout_whose_next_turn_has_no_room_ends_truncated(start_server, tokenizer):
    """A server whose context holds the first turn and its tool call, not the tool's answer: each
    rollout ends after its first turn, trained, and counted as clipped."""
    messages = [{"role": "user", "content": "1+1="}]
    first = tokenizer.apply_chat_template(messages, tools=[toy.add], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
    call = tokenizer.encode(f"<tool_call>{h.ScriptedToolLoop.call_json}</tool_call>",
                            add_special_tokens=False)
    server = start_server("--max-model-len", str(len(first) + len(call) + 1),
                          *h.SERVER_FLAGS[2:])
    worker = RolloutWorker(h.config_for(server, max_completion_length=64),
                           Dataset.from_list([{"prompt": messages}] * 2), [h.rank_reward],
                           tokenizer, tools=[toy.add], loop_cls=h.ScriptedToolLoop)
    samples, metrics = h.run_worker(worker)
    groups = [m for m in metrics if "completions/clipped_ratio" in m]
    assert len(groups) == 2 and len(samples) == 4
    assert all(m["completions/clipped_ratio"] == 1.0 and m["rollout/turns_max"] == 1
               for m in groups)


def test_a_stalled_tool_fails_its_rollout_naming_it(long_server, tokenizer):
    config = h.config_for(long_server, max_completion_length=64, reward_tool_timeout=1.0,
                          num_train_epochs=10)
    worker = RolloutWorker(config, toy.make_dataset(4), [h.rank_reward], tokenizer,
                           tools=[h.slow_add], loop_cls=h.SlowToolLoop)
    with pytest.raises(RuntimeError, match="rollouts failed in a row.*CallTimeout: slow_add did "
                                           "not return within reward_tool_timeout=1s"):
        h.run_worker(worker)


def test_a_tool_call_nested_too_deep_is_an_invalid_call(long_server, tokenizer):
    worker = RolloutWorker(h.config_for(long_server, max_completion_length=64),
                           toy.make_dataset(1), [h.rank_reward], tokenizer, tools=[toy.add],
                           loop_cls=h.DeepCallLoop)
    samples, metrics = h.run_worker(worker)
    group = next(m for m in metrics if "tools/failure_frequency" in m)
    assert group["tools/failure_frequency"] == 1.0 and len(samples) == 2


def test_tool_rates_are_over_every_group(long_server, tokenizer):
    """One prompt of four calls add once a rollout: tools/call_frequency is 0.25 over the run's
    groups (it was 1.0, the groups without a call left out)."""
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "2+2=", "3+3=", "4+4=")]
    worker = RolloutWorker(h.config_for(long_server, max_completion_length=64),
                           Dataset.from_list(rows), [h.rank_reward], tokenizer, tools=[toy.add],
                           loop_cls=h.FirstRowToolLoop)
    _, metrics = h.run_worker(worker)
    groups = [m for m in metrics if "frac_reward_zero_std" in m]
    window = reduce_window(groups)
    assert len(groups) == 4 and window["tools/call_frequency"] == 0.25
    assert window["tools/loop_exhausted_frac"] == 0.0


# ── the spec's arguments ──────────────────────────────────────────────────────────────────


def test_the_loop_takes_the_spec_arguments():
    from rollout import AsyncRolloutLoop
    ctx = mp.get_context("spawn")
    config = AsyncGRPOConfig(max_steps=1)
    loop = AsyncRolloutLoop(config=config, model_name=None, dataset=toy.make_dataset(4),
                            reward_funcs=[toy.sum_reward], processing_class=toy.build_tokenizer(),
                            eos_token_ids=[0], rollout_buffer=ctx.Queue(),
                            model_version_value=ctx.Value("q", 0), heartbeat_value=ctx.Value("d"),
                            failed_event=ctx.Event(), exception_info_queue=ctx.Queue(),
                            metrics_queue=ctx.Queue(), score_queue_maxsize=4)
    assert loop.channels.model_version.value == 0 and loop.score_queue.maxsize == 4
    with pytest.raises(TypeError, match="needs model_version_value, heartbeat_value"):
        AsyncRolloutLoop(config, None, toy.make_dataset(4), [toy.sum_reward],
                         toy.build_tokenizer(), [0], rollout_buffer=ctx.Queue())
    hooks_only = AsyncRolloutLoop(config, None, toy.make_dataset(4), [toy.sum_reward],
                                  toy.build_tokenizer(), [0])           # none: for its hooks
    assert hooks_only.channels is None


def test_scale_rewards_divides_by_the_group_the_batch_or_nothing(tokenizer):
    """scale_rewards: "group" the group's population std, "none" only the mean (Dr. GRPO),
    "batch" the std of about one step of recent rewards (here the prior R = 8 samples a step,
    so two groups of 4): a group of equal rewards gets advantages 0 whatever the batch."""
    def advantages(loop, rewards):
        group = h.group_of([None] * len(rewards))
        group.rewards = np.array(rewards, dtype=float)
        return loop.compute_advantages(group)

    config = dict(num_generations=4, per_device_train_batch_size=8)
    group = h.make_loop(tokenizer, AsyncGRPOConfig(**config))
    none = h.make_loop(tokenizer, AsyncGRPOConfig(scale_rewards="none", **config))
    batch = h.make_loop(tokenizer, AsyncGRPOConfig(scale_rewards="batch", **config))
    r = [0.0, 1.0, 1.0, 2.0]                                       # mean 1, std sqrt(0.5)
    assert advantages(group, r) == pytest.approx(np.array([-1, 0, 0, 1]) / (0.5 ** 0.5 + 1e-4))
    assert advantages(none, r) == pytest.approx([-1.0, 0.0, 0.0, 1.0])
    assert advantages(batch, [5.0] * 4) == pytest.approx([0.0] * 4)  # the window: 5 5 5 5
    window = np.array([5.0] * 4 + r)                                 # 8 rewards: one step's
    assert advantages(batch, r) == pytest.approx(np.array([-1, 0, 0, 1]) / (window.std() + 1e-4))
    later = [3.0, 3.0, 4.0, 4.0]                                     # the 5s leave the window
    window = np.array(r + later)
    assert advantages(batch, later) == pytest.approx(np.array([-.5, -.5, .5, .5])
                                                     / (window.std() + 1e-4))
    assert AsyncGRPOConfig(scale_rewards=False).scale_rewards == "none"   # TRL's bools
    assert AsyncGRPOConfig(scale_rewards=True).scale_rewards == "group"


# ── evaluation: eval prompts through the same rollout code, never trained ──────────────────


def evaluated(worker, steps=(0,)):
    """Start, ask for an evaluation at each step, take every training sample until the prompts
    run out, then wait for the evaluations: (samples, eval lines). The worker is stopped."""
    samples = []
    try:
        worker.start()
        for step in steps:
            worker.evaluate(step)
        while (sample := worker.get(timeout=60)) is not None:
            samples.append(sample)
        return samples, worker.evaluations(wait=True)
    finally:
        worker.stop()


def test_an_evaluation_generates_and_scores_eval_prompts_and_trains_none(long_server, tokenizer):
    """Two evaluations beside training: every eval prompt gets num_generations_eval rollouts from
    the server, scored by the run's reward function; the lines come back in order, at their
    steps; no eval rollout reaches the training queue and the resume index counts training prompts
    only."""
    config = h.config_for(long_server, num_generations_eval=3, per_device_eval_batch_size=3,
                          eval_strategy="steps", eval_pass_reward=1.0)
    worker = RolloutWorker(config, toy.make_dataset(2), [h.rank_reward], tokenizer,
                           eval_dataset=toy.make_dataset(4, seed=9))
    samples, lines = evaluated(worker, steps=(0, 5))
    assert len(samples) == 4 and {s.prompt_index for s in samples} == {0, 1}
    assert all(s.group_id >= 0 for s in samples)                 # eval groups are numbered < 0
    assert worker.resume_index() == 2
    assert [line["step"] for line in lines] == [0, 5]
    for line in lines:
        assert line["eval/prompts"] == 4 and line["eval/failed_prompts"] == 0
        # rank_reward scores the 3 rollouts 0, 1, 2: two of three pass at 1.0
        assert line["eval/reward"] == line["eval/rewards/rank_reward/mean"] == pytest.approx(1.0)
        assert line["eval/pass@1"] == pytest.approx(2 / 3) and line["eval/pass@3"] == 1.0
        assert line["eval/model_version_min"] == line["eval/model_version_max"] == 0
        assert 1 <= line["eval/completions/mean_length"] <= config.max_completion_length


def test_eval_prompts_run_tools_and_environments_and_a_failed_one_is_counted(long_server,
                                                                             tokenizer):
    """The tool loop and environment_factory work alike in an evaluation: the environment's reward
    and a tool's answer reach the eval line; an eval prompt whose rollouts fail (a plain-text
    prompt cannot carry tools) is counted in eval/failed_prompts and training goes on."""
    config = h.config_for(long_server, max_completion_length=64, num_generations_eval=2)
    eval_rows = [{"prompt": [{"role": "user", "content": "1+2="}]},
                 {"prompt": "1+2="},                                  # no tools on plain text
                 {"prompt": [{"role": "user", "content": "2+2="}]}]
    worker = RolloutWorker(config, toy.make_dataset(2), [h.tool_used_reward, h.rank_reward],
                           tokenizer,
                           environment_factory=h.Counter, loop_cls=h.ScriptedToolLoop,
                           eval_dataset=eval_rows)
    samples, (line,) = evaluated(worker)
    assert len(samples) == 4
    assert line["eval/prompts"] == 2 and line["eval/failed_prompts"] == 1
    assert line["eval/rewards/tool_used_reward/mean"] == 1.0       # add ran in every rollout
    assert line["eval/rewards/Counter/mean"] == 1.0                # the environment counted it
    assert line["eval/reward"] == 2.5 and line["eval/pass@1"] == 1.0   # 1 + 1 + (0 or 1)


def test_an_eval_prompt_too_long_is_a_failed_eval_prompt_not_a_skipped_training_one(
        small_kv_server, tokenizer):
    """Eval prompts pass the same check (generate_one_turn): one too long for max_model_len is
    sent nowhere and counted in eval/failed_prompts; training's count of skipped prompts and its
    untrained rule never see it."""
    eval_rows = [{"prompt": [{"role": "user", "content": "1+1="}]},
                 {"prompt": [{"role": "user", "content": "1" * 300}]}]
    worker = RolloutWorker(h.config_for(small_kv_server), toy.make_dataset(2), [h.rank_reward],
                           tokenizer, eval_dataset=eval_rows)
    samples, (line,) = evaluated(worker)
    assert len(samples) == 4 and line["eval/prompts"] == 1 and line["eval/failed_prompts"] == 1
    metrics = worker.drain_metrics()
    assert metrics and not any("rollout/prompts_too_long_total" in m for m in metrics)
