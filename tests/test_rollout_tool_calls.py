"""rollout/tool_calls.py: parsing a model's tool calls, running them, checking tools,
environments."""
import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import pytest

import rollout_helpers as h
import toy
from rollout.tool_calls import (CallTimeout, EnvironmentPool, check_tools, environment_reward,
                                environment_tools, parse_tool_calls, parse_turn, run_tool_calls,
                                start_environment, tool_call_format)

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)

MISTRAL_LIKE = {                      # a response template for a format that is not Qwen's
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {},
               "tool_calls": {"open": "[TOOL_CALLS]", "close": "[/TOOL_CALLS]", "content": "json",
                              "transform_each": True,
                              "transform": {"type": "function",
                                            "function": {"name": "{name}",
                                                         "arguments": "{arguments}"}}}}}


def test_parse_tool_calls():
    content, calls = parse_tool_calls(
        'Hi<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        '<tool_call>{oops}</tool_call>')
    assert content == "Hi<tool_call>{oops}</tool_call>"
    assert calls[:2] == [{"name": "add", "arguments": {"a": 1, "b": 2}},
                         {"name": "add", "arguments": {"a": 3, "b": 4}}]
    assert "invalid tool call" in calls[2]["error"]


async def slow_double(x: int) -> int:
    await asyncio.sleep(0.01)
    return 2 * x


def broken(x: int) -> int:
    raise KeyError("no")


def test_run_tool_calls_in_order_with_errors_as_messages():
    requested = [{"name": "add", "arguments": {"a": 1, "b": 2}},
                 {"name": "slow_double", "arguments": {"x": 4}}, {"name": "nope", "arguments": {}},
                 {"name": "broken", "arguments": {"x": 1}}, {"error": "bad json"}]
    tools = {"add": toy.add, "slow_double": slow_double, "broken": broken}
    with ThreadPoolExecutor(2) as pool:
        messages, records = asyncio.run(run_tool_calls(requested, tools, pool, turn_index=0))
    assert [m["content"] for m in messages[:2]] == ["3", "8"]
    assert "unknown tool 'nope'" in messages[2]["content"] and "KeyError" in messages[3]["content"]
    assert [(r.failed, r.unknown) for r in records] == [(False, False), (False, False),
                                                        (False, True), (True, False), (True, False)]


def test_environment_factory_dict_picks_by_row_and_exposes_its_tools():
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "1+2="}],
           "environment": "counter"}
    with ThreadPoolExecutor(1) as pool:
        environments = EnvironmentPool({"counter": h.Counter})
        env, prompt, _ = asyncio.run(start_environment(environments, row, pool))
        assert isinstance(env, h.Counter) and prompt[-1]["content"] == "1+2=\nUse the tools."
        assert row["prompt"][-1]["content"] == "1+2="  # the dataset row is not mutated
        assert [t.__name__ for t in environment_tools(env)] == ["add"]
        env.add(1, 2)
        assert asyncio.run(environment_reward(env, pool))[0] == (h.Counter, 1.0)
        with pytest.raises(ValueError, match="environment 'chess' is not among the environments"):
            chess = row | {"environment": "chess"}
            asyncio.run(start_environment(environments, chess, pool))


def test_tools_must_be_unique_module_level_functions():
    def closure(a):
        return a

    for bad in (lambda a: a, closure, functools.partial(toy.add, a=1)):
        with pytest.raises(TypeError, match="must be a module-level function"):
            check_tools([bad])
    with pytest.raises(ValueError, match="unique"):
        check_tools([toy.add, toy.add])
    check_tools([toy.add, slow_double])


def test_the_tokenizers_own_response_parsing_finds_the_calls(tokenizer):
    assert tool_call_format(tokenizer) == "qwen"
    tokenizer.response_template = MISTRAL_LIKE
    assert tool_call_format(tokenizer) == "response_template"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    text = ('Sure[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
            '{"name": 5, "arguments": {}}][/TOOL_CALLS]')
    content, calls = parse_turn(tokenizer, "response_template", text, prompt, [toy.add])
    assert content == "Sure" and calls[0] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert "error" in calls[1]
    content, calls = parse_turn(tokenizer, "response_template", "x[TOOL_CALLS][{oops[/TOOL_CALLS]",
                                prompt, [toy.add])
    assert len(calls) == 1 and "does not parse" in calls[0]["error"]


def test_a_call_nested_too_deep_is_an_invalid_call():
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 1000 + "]" * 1000 + ', "b": 2}}'
    content, calls = parse_tool_calls(f"<tool_call>{deep}</tool_call>")
    assert "invalid tool call" in calls[0]["error"] and "recursion" in calls[0]["error"]


def test_a_tool_past_its_limit_fails_the_rollout_naming_it():
    """A stalled tool raises CallTimeout (the rollout fails), not a tool message; a tool that
    raises TimeoutError itself is an ordinary failed call."""
    async def stalled(x: int) -> int:
        await asyncio.sleep(10)

    def times_out(x: int) -> int:
        raise TimeoutError("its own")
    tools = {"stalled": stalled, "times_out": times_out}
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(CallTimeout, match="stalled did not return within "
                                              "reward_tool_timeout=0.1s"):
            asyncio.run(run_tool_calls([{"name": "stalled", "arguments": {"x": 1}}], tools, pool,
                                       0, limit=0.1))
        messages, records = asyncio.run(run_tool_calls(
            [{"name": "times_out", "arguments": {"x": 1}}], tools, pool, 0, limit=5))
    assert "TimeoutError: its own" in messages[0]["content"] and records[0].failed
