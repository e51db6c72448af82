"""Tool calls and environments for the rollout loop (spec: ツール (Tools), 環境 (Environments), and
the tools / environment_factory parameters of AsyncGRPOTrainer).

It knows nothing of groups, queues or the server: it turns a model's text into tool calls, runs
Python callables (sync ones on the loop's thread pool, async ones awaited) and hands back the tool
messages that the next turn renders.

    model output  'Let me add.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    parse         content 'Let me add.'  requested [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    run           [{"role": "tool", "name": "add", "content": "3"}]   ToolCall("add", ...)

Three kinds of call, counted apart as the spec's tool metrics separate them:
    malformed  (its JSON or the template's fields do not parse)  failed: tools/failure_frequency,
               Rollout.tool_failure_count; it has no name, so no tools/<name>/* metric
    unknown    (a well-formed call to no tool of the rollout)     tools/unknown_name_total only: a
               policy error, not a tool that ran and raised
    known      runs; raised → failed                    tools/<name>/call_total, /failure_total

Environments: `environment_factory` is a callable, or a dict of them chosen by the row's
`environment` column. Each rollout has an instance to itself, reused by a later rollout once its
group is scored (EnvironmentPool); `reset(**row)` runs before the first turn and a string it
returns is appended to the last user message (without a dataset it is the prompt); its public
methods (but reset and get_reward) are the rollout's tools; `get_reward()` scores it, and reward
functions get the group's instances as `environments`.

Where the spec is silent, our choices (one line each, with the reason):
- A call format is decided once per tokenizer (`tool_call_format`): its own response template,
  else Qwen's <tool_call> blocks (Qwen2.5/Qwen3's and toy.py's format; the fallback, warned once).
- Every call, also a malformed or unknown one, gets a tool message: the model sees its mistake.
- reset()'s observation joins the last user message after a newline (TRL's trainers append it
  as is): the observation reads as its own line of the turn.
- An instance stays checked out until its group is scored (reward functions read it): an
  OpenEnv server needs sessions for the rollouts in flight and those waiting to be scored.
- No HarnessAsyncGRPOTrainer (TRL's harness training: an agent that owns its loop behind a
  recording proxy, its trace rebuilt into turns): it needs an agent process, the proxy and a
  session type openenv-core does not ship. Instead subclass AsyncRolloutLoop and override
  generate_one: drive the harness, call generate_one_turn per model turn, and return the
  TurnRecords, ToolCalls (the tools/* metrics keep their names) and Rollout.reward.
"""
import asyncio
import functools
import inspect
import json
import pickle
import re
import time
from concurrent.futures import Executor
from typing import Any, Callable

from transformers.utils import get_json_schema

from rollout.samples import ToolCall

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class CallTimeout(RuntimeError):
    """A reward function, tool or environment method ran past reward_tool_timeout (ours)."""


async def call_maybe_async(fn: Callable, executor: Executor | None, limit: float | None, *args,
                           **kwargs) -> Any:
    """Await an async callable; run a sync one on `executor` (None: asyncio's default) without
    blocking the event loop. A sync callable that returns an awaitable (a callable instance with
    async __call__) is awaited too. Past `limit` seconds (None: none), CallTimeout names it (a
    sync one's thread cannot be stopped: it is left to finish)."""
    scope = asyncio.timeout(limit)
    try:
        async with scope:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            call = functools.partial(fn, *args, **kwargs)
            result = await asyncio.get_running_loop().run_in_executor(executor, call)
            return await result if inspect.isawaitable(result) else result
    except TimeoutError:
        if not scope.expired():                       # its own TimeoutError
            raise
        inner = getattr(fn, "func", fn)               # a partial's function
        name = getattr(inner, "__qualname__", None) or type(inner).__name__
        raise CallTimeout(f"{name} did not return within reward_tool_timeout={limit:g}s"
                          ) from None


def tool_call_format(tokenizer) -> str | None:
    """"response_template" if the tokenizer parses its own responses, "qwen" if its chat template
    writes <tool_call> blocks, None if neither (the loop then warns once and tries Qwen's)."""
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template"
    template = getattr(tokenizer, "chat_template", None) or ""
    return "qwen" if "<tool_call>" in str(template) else None


def tool_schemas(tools: list[Callable]) -> list | None:
    """The tools as the chat template renders them, for every turn of a rollout: a function's or
    method's JSON schema, as apply_chat_template makes it (a module-level function's once per
    process: it parses the docstring); anything else as given, for the tokenizer to accept or
    refuse. None for no tools."""
    return [_function_schema(t) if inspect.isfunction(t) else
            get_json_schema(t) if inspect.ismethod(t) else t for t in tools] or None


_function_schema = functools.lru_cache(maxsize=256)(get_json_schema)   # a function's, cached


def parse_turn(tokenizer, fmt: str | None, text: str, prompt_ids: list[int],
               tools: list[Callable]) -> tuple[str, list[dict]]:
    """A sampled turn's text → (message content, requested calls), in the tokenizer's own format
    when it has one (the prompt, special tokens kept, shows the template where the turn starts)."""
    if fmt != "response_template":
        return parse_tool_calls(text)
    try:
        message = tokenizer.parse_response(text, prefix=tokenizer.decode(prompt_ids), tools=tools)
    except Exception as e:            # the output does not fit the template: one malformed call
        reason = f"the response does not parse ({type(e).__name__}: {e})"
        return text, [{"error": f"invalid tool call: {reason}"}]
    # each {"type": "function", "function": {...}}, or the function's fields alone
    requested = [checked_call(call.get("function", call) if isinstance(call, dict) else call)
                 for call in message.get("tool_calls") or []]
    content = message.get("content")
    return content if isinstance(content, str) else "", requested


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split an assistant message into its text and its requested calls, in order.

    A well-formed call is {"name": str, "arguments": dict} and leaves the text; a malformed one is
    {"error": reason} and stays in the text, so re-rendering reproduces what the model wrote.
    """
    requested = []
    content = []
    last = 0
    for match in TOOL_CALL.finditer(text):
        requested.append(checked_call(match[1].strip()))
        if "error" in requested[-1]:
            continue
        content.append(text[last:match.start()])
        last = match.end()
    content.append(text[last:])
    return "".join(content), requested


def checked_call(call: dict | str) -> dict:
    """A call, parsed or its JSON text, as {"name": str, "arguments": dict} (arguments may come as
    a JSON string, or be left out: none); else {"error": why}, a malformed call (not JSON, not
    an object, nested too deep for the parser, or other fields)."""
    try:
        parsed = json.loads(call) if isinstance(call, str) else call
        arguments = parsed.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not (isinstance(parsed.get("name"), str) and isinstance(arguments, dict)):
            raise ValueError('expected {"name": <string>, "arguments": <object>}')
    except (ValueError, AttributeError, RecursionError) as e:
        return {"error": f"invalid tool call {str(call)[:200]!r}: {e}"}
    return {"name": parsed["name"], "arguments": arguments}


async def run_tool_calls(requested: list[dict], tools: dict[str, Callable], executor: Executor,
                         turn_index: int, limit: float | None = None,
                         ) -> tuple[list[dict], list[ToolCall]]:
    """Run one message's calls in order; every call (also a failed or refused one) gets a tool
    message. A call past `limit` seconds fails the rollout (CallTimeout), not only the call."""
    messages = []
    records = []
    for call in requested:
        name = call.get("name")
        start = time.monotonic()
        unknown = name is not None and name not in tools
        failed = "error" in call                # malformed; or, below, a known tool that raised
        if failed:
            content = f"Error: {call['error']}"
        elif unknown:
            content = f"Error: unknown tool {name!r}; the tools are {sorted(tools)}"
        else:
            try:
                result = await call_maybe_async(tools[name], executor, limit, **call["arguments"])
                content = str(result)
            except CallTimeout:
                raise
            except Exception as e:
                content = f"Error: {type(e).__name__}: {e}"
                failed = True
        messages.append({"role": "tool", "name": name or "invalid", "content": content})
        records.append(ToolCall(name, time.monotonic() - start, failed, unknown, turn_index))
    return messages, records


def check_tools(tools: list[Callable]) -> None:
    """Tools are called by name, so each must be a module-level function with a unique __name__."""
    names = set()
    for tool in tools:
        qualname = getattr(tool, "__qualname__", None) or type(tool).__name__
        if not inspect.isfunction(tool) or qualname != tool.__name__:
            raise TypeError(f"tool {qualname} must be a module-level function: the model calls "
                            "tools by name, so each tool is registered by its __name__ and "
                            "imported by the spawned rollout process (lambdas, closures, methods, "
                            "partials and callable instances are not allowed)")
        try:
            pickle.dumps(tool)
        except Exception as e:
            raise TypeError(f"tool {qualname} cannot be pickled for the rollout process ({e}); "
                            "define it at module level in an importable module") from e
        if tool.__name__ in names:
            raise ValueError(f"two tools are named {tool.__name__!r}; tool names must be unique")
        names.add(tool.__name__)


def environment_tools(env: object) -> list[Callable]:
    """The environment's public methods, except reset and get_reward, bound to the instance."""
    methods = inspect.getmembers(type(env), inspect.isfunction)
    return [getattr(env, name) for name, _ in methods
            if not name.startswith("_") and name not in ("reset", "get_reward")]


class EnvironmentPool:
    """environment_factory's instances, reused across rollouts ("construct once, reset often", as
    TRL's trainers do): an environment that opens a server session in __init__ (each OpenEnv
    wrapper of TRL's guide does) then holds as many sessions as rollouts alive at once, not one
    per rollout until the process ends. A dict factory keeps one pool per environment name."""

    def __init__(self, factory: Callable | dict[str, Callable], limit: float | None = None):
        self.factory = factory
        self.limit = limit                         # seconds each of its calls may take
        self.free: dict[str | None, list] = {}
        self.name_of: dict[int, str | None] = {}   # id(instance) → its pool

    def name(self, row: dict) -> str | None:
        if not isinstance(self.factory, dict):
            return None
        name = row.get("environment")
        if name not in self.factory:
            raise ValueError(f"the row's environment {name!r} is not among the environments of "
                             f"environment_factory, {sorted(self.factory)}")
        return name

    async def take(self, name: str | None, executor: Executor):
        """A free instance of environment `name`, or a new one."""
        if free := self.free.get(name):
            return free.pop()
        factory = self.factory if name is None else self.factory[name]
        env = await call_maybe_async(factory, executor, self.limit)
        self.name_of[id(env)] = name
        return env

    def give_back(self, env) -> None:
        """Free for the next rollout's reset() (after its group is scored: reward functions read
        it). An instance whose rollout failed is never given back: its state is unknown."""
        self.free.setdefault(self.name_of[id(env)], []).append(env)

    async def probe(self, executor: Executor) -> None:
        """One instance of each environment at start, kept free: a missing reset() is an error
        before the first rollout, not in every rollout."""
        for name in [None] if not isinstance(self.factory, dict) else list(self.factory):
            env = await self.take(name, executor)
            if not callable(getattr(env, "reset", None)):
                raise TypeError(f"{type(env).__name__}, made by environment_factory, has no "
                                "reset() method: each rollout starts with reset(**row)")
            self.give_back(env)


async def start_environment(pool: EnvironmentPool, row: dict, executor: Executor):
    """Take and reset one rollout's environment: (instance, prompt with the observation, seconds
    reset() took). reset() gets the row's columns, all but a dict factory's `environment`."""
    name = pool.name(row)
    env = await pool.take(name, executor)
    columns = row if name is None else {k: v for k, v in row.items() if k != "environment"}
    start = time.monotonic()
    observation = await call_maybe_async(env.reset, executor, pool.limit, **columns)
    reset_s = time.monotonic() - start
    prompt = row.get("prompt")
    if prompt is None:                                 # no dataset: reset() writes the prompt
        if not isinstance(observation, str):
            raise ValueError(f"{type(env).__name__}.reset() returned {observation!r:.80}: "
                             "without a train_dataset it must return the prompt (a string)")
        return env, [{"role": "user", "content": observation}], reset_s
    if isinstance(observation, str):
        prompt = [dict(m) for m in prompt]
        last_user = max(i for i, m in enumerate(prompt) if m["role"] == "user")
        prompt[last_user]["content"] = prompt[last_user]["content"] + "\n" + observation
    return env, prompt, reset_s


async def environment_reward(env: object, executor: Executor, limit: float | None = None,
                             ) -> tuple[tuple[type, float] | None, float]:
    """(environment class, get_reward()) when the environment owns a reward, and its seconds."""
    if not callable(getattr(env, "get_reward", None)):
        return None, 0.0
    start = time.monotonic()
    reward = await call_maybe_async(env.get_reward, executor, limit)
    return (type(env), float(reward)), time.monotonic() - start
