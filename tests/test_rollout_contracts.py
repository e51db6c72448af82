"""The spec's contracts on the rollout side: a generate_one_turn override with the spec's signature,
tool calls counted by kind, the tokenizer's own response parsing, training from an environment without
a dataset, and `_total` metrics that are running totals."""
import asyncio
import logging
import queue
import time

import pytest
from transformers import AutoTokenizer

import rollout_helpers as h
import toy
from rollout import AsyncRolloutLoop
from rollout_samples import Rollout, RolloutGroup, TurnRecord, reconcile
from rollout_tools import ToolCall, parse_turn, tool_call_format
from rollout_worker import RolloutWorker
from test_rollout import config_for
from train import AsyncGRPOConfig
from vllm_client import VLLMClient

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
MISTRAL_LIKE = {                      # a response template for a format that is not Qwen's
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {},
               "tool_calls": {"open": "[TOOL_CALLS]", "close": "[/TOOL_CALLS]", "content": "json",
                              "transform_each": True,
                              "transform": {"type": "function",
                                            "function": {"name": "{name}", "arguments": "{arguments}"}}}}}


class SpecTurnLoop(AsyncRolloutLoop):
    """An override with exactly the spec's signature, beside the default generate_one."""

    async def generate_one_turn(self, prompt_ids):
        self.turn_prompts.append(len(prompt_ids))
        return await super().generate_one_turn(prompt_ids)


def loop_with_server_text(tokenizer, text: str, loop_cls=SpecTurnLoop, **config):
    """A loop whose server always answers `text` (at most max_tokens of it, ending the turn when it fits);
    the request bodies it got are in loop.bodies."""
    config = AsyncGRPOConfig(**({"num_generations": 2} | config))
    loop = loop_cls(config, "toy", toy.make_dataset(2), [], tokenizer, [tokenizer.eos_token_id], channels=None,
                    max_concurrent_rollouts=2)
    loop.max_model_len, loop.bodies, loop.turn_prompts = 4096, [], []
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    async def reply(body):
        loop.bodies.append(body)
        out = ids[:body["max_tokens"]]
        return {"model": body["model"], "choices": [{"token_ids": out, "logprobs": {
            "token_logprobs": [-0.5] * len(out), "top_logprobs": [{f"token_id:{t}": -0.5} for t in out]}}]}
    loop.replicas[0].client.acompletions = reply
    return loop


@pytest.fixture
def tokenizer(toy_dir):
    return AutoTokenizer.from_pretrained(toy_dir)


def test_a_spec_signature_override_keeps_the_completion_budget(tokenizer):
    loop = loop_with_server_text(tokenizer, CALL, max_completion_length=100, max_tool_calling_iterations=5)
    rollout = asyncio.run(loop.generate_one([{"role": "user", "content": "1+2="}], [toy.add]))
    per_turn = len(tokenizer.encode(CALL, add_special_tokens=False)) + 1     # the call, then end of turn
    budgets = list(range(100, 0, -per_turn))                    # the last turn is cut at the budget left
    assert [b["max_tokens"] for b in loop.bodies] == budgets and len(budgets) >= 2
    assert len(rollout.completion_ids) == 100 and len(loop.turn_prompts) == len(budgets)
    assert [c.name for c in rollout.tool_calls] == ["add"] * (len(budgets) - 1)


def test_tool_calls_are_counted_by_kind_and_totals_run(tokenizer):
    loop = loop_with_server_text(tokenizer, "")
    calls = [ToolCall("add", 0.1, False, False, 0), ToolCall("add", 0.1, True, False, 0),   # ran; ran and raised
             ToolCall("nope", 0.0, False, True, 0), ToolCall(None, 0.0, True, False, 1)]     # unknown; malformed
    turn = TurnRecord([1], [9, 2], [-0.1, -0.2])

    def group(i):
        rollouts = [Rollout([], [9, 2], [turn], tool_calls=calls if j == 0 else [], reward=float(j)) for j in range(2)]
        return RolloutGroup(prompts=[[]] * 2, reward_kwargs={}, completions=[[]] * 2, completions_ids=[[9, 2]] * 2,
                            completions_sequences=[reconcile([turn])[0]] * 2, tool_call_counts=[4, 0],
                            tool_failure_counts=[2, 0], model_version=0, group_id=i, row_index=i,
                            env_rewards=[None] * 2, rollout_rewards=[0.0, 1.0], rollouts=rollouts,
                            stats=[{"duration_s": 1.0, "drifts": []}] * 2)
    first = asyncio.run(loop._score_group(group(0)))[1]
    second = asyncio.run(loop._score_group(group(1)))[1]
    assert not any("None" in name for name in first)
    assert first["tools/failure_frequency"] == 0.5                # the raise and the malformed call, not the unknown
    names = ["tools/unknown_name_total", "tools/add/call_total", "tools/add/failure_total"]
    assert [first[n] for n in names] == [1, 2, 1] and [second[n] for n in names] == [2, 4, 2]


def test_the_tokenizers_own_response_parsing_finds_the_calls(tokenizer):
    assert tool_call_format(tokenizer) == "qwen"
    tokenizer.response_template = MISTRAL_LIKE
    assert tool_call_format(tokenizer) == "response_template"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    text = 'Sure[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": 5, "arguments": {}}][/TOOL_CALLS]'
    content, calls = parse_turn(tokenizer, "response_template", text, prompt, [toy.add])
    assert content == "Sure" and calls[0] == {"name": "add", "arguments": {"a": 1, "b": 2}} and "error" in calls[1]
    content, calls = parse_turn(tokenizer, "response_template", "x[TOOL_CALLS][{oops[/TOOL_CALLS]", prompt, [toy.add])
    assert len(calls) == 1 and "does not parse" in calls[0]["error"]

    loop = loop_with_server_text(tokenizer, text.replace(', {"name": 5, "arguments": {}}', ""),
                                 max_completion_length=300, max_tool_calling_iterations=1)
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


@pytest.mark.parametrize("factory, max_steps, fix", [(None, 10, "environment_factory"),
                                                     ({"a": h.PromptEnv}, 10, "not a dict"),
                                                     (h.PromptEnv, -1, "max_steps > 0")])
def test_no_dataset_is_refused_at_start_naming_the_fix(tokenizer, factory, max_steps, fix):
    with pytest.raises(ValueError, match=fix):
        AsyncRolloutLoop(AsyncGRPOConfig(max_steps=max_steps), "toy", None, [], tokenizer, [2], channels=None,
                         max_concurrent_rollouts=2, environment_factory=factory)


def test_an_environment_supplies_prompts_and_rewards_without_a_dataset(long_server, tokenizer):
    worker = RolloutWorker(config_for(long_server, max_steps=3, max_completion_length=6), None, None, tokenizer,
                           environment_factory=h.PromptEnv)
    try:
        worker.start()
        samples = [worker.get(timeout=60) for _ in range(4)]
    finally:
        worker.stop()
    assert [m["content"] for m in samples[0].prompt] == ["2+3="]
    assert {s.prompt_index for s in samples} <= {0, 1, 2, 3} and all(0 <= s.reward < 1 for s in samples)
    assert len({s.prompt_index for s in samples}) >= 2


def test_retry_and_preemption_totals_are_running_totals(start_server, tokenizer):
    """After a paused server's preemptions (pause keep + clear_cache) and retried 503s (pause abort), later
    polls keep reporting them: rollout/vllm_*_total are totals since the process started, not deltas."""
    server = start_server("--max-model-len", "256", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "8")
    worker = RolloutWorker(config_for(server, max_completion_length=200, max_steps=50, num_generations=4),
                           toy.make_dataset(8), [h.rank_reward], tokenizer, loop_cls=h.FastPollLoop)
    client, polls = VLLMClient(server.url, timeout=10), []

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
        time.sleep(1.0)
        client.resume()
        collect(2.0)
    finally:
        worker.stop()
        client.close()
    for name in ("rollout/vllm_preemptions_total", "rollout/vllm_retry_total"):
        values = [p[name] for p in polls]
        assert values == sorted(values) and values[-1] > 0, (name, values)
