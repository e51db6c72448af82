"""What the rollout tests share: module-level rewards, environments, configs and loop subclasses
(the rollout process is spawned, so everything it runs must be importable by name), and the
helpers that run a worker, build a loop or a scored group.
"""
import asyncio
import math
import os
import queue
import random
import sys
import time
from dataclasses import dataclass

import numpy as np

import toy
from config import AsyncGRPOConfig
from rollout import AsyncRolloutLoop
from rollout.samples import FinishedRollout, PendingGroup, Rollout, TurnRecord, reconcile
from vllm_client import VLLMError

SERVER_FLAGS = ("--max-model-len", "256", "--logprobs-mode", "processed_logprobs",
                "--max-logprobs", "8")


# ── running the rollout process ─────────────────────────────────────────────────────────────


def config_for(server, **kwargs) -> AsyncGRPOConfig:
    """A small config against `server`; kwargs override."""
    defaults = dict(vllm_server_base_url=server.url, num_generations=2, max_completion_length=8,
                    num_train_epochs=1, per_device_train_batch_size=8, vllm_server_timeout=30.0,
                    train_sampling_strategy="sequential")    # rows in the dataset's order
    return AsyncGRPOConfig(**(defaults | kwargs))


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


def poll_until(worker, done, timeout=60.0):
    """Start, consume samples (publishing versions like a trainer) until a periodic metric dict
    satisfies `done`; the periodic dicts seen. The worker is stopped."""
    polls = []
    deadline = time.monotonic() + timeout
    version = 0
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
        caps = [p["rollout/concurrency_cap"] for p in polls]
        raise AssertionError(f"condition never met; caps {caps}")
    finally:
        worker.stop()


# ── a loop and groups without a process ─────────────────────────────────────────────────────


def make_loop(tokenizer, config=None, loop_cls=AsyncRolloutLoop):
    """A loop built in this process (no channels, not connected): for calling hooks directly."""
    config = config or AsyncGRPOConfig(num_generations=3)
    return loop_cls(config, "toy", toy.make_dataset(2), [], tokenizer, [tokenizer.eos_token_id],
                    channels=None, max_concurrent_rollouts=2)


def group_of(rollout_rewards, env_rewards=None, row=None, tool_calls=None):
    """A finished group of one-turn rollouts answering "7" (ids [9, 2]), built as the loop builds
    it: rollout rewards, environment rewards and each rollout's tool calls as given."""
    n = len(rollout_rewards)
    if row is None:
        row = {"prompt": [{"role": "user", "content": "3+4="}], "solved": True}
    group = PendingGroup(group_id=0, row_index=1, prompt_index=1, row=row, size=n, model_version=5)
    for i, reward in enumerate(rollout_rewards):
        turn = TurnRecord([1], [9, 2], [-0.1, -0.2])
        rollout = Rollout([{"role": "assistant", "content": "7"}], [9, 2], [turn], reward=reward,
                          tool_calls=list((tool_calls or [[]] * n)[i]))
        env_reward = (env_rewards or [None] * n)[i]
        group.slots[i] = FinishedRollout(row.get("prompt"), rollout, reconcile(rollout.turns)[0],
                                         env_reward, {"duration_s": 1.0, "drifts": []})
    return group.build()


# ── module-level rewards, environments and loops ────────────────────────────────────────────


def rank_reward(prompts, completions, **kwargs) -> list[float]:
    """0, 1, 2, ... by position: never all equal, so no group is dropped."""
    return [float(i) for i in range(len(completions))]


def exploding_reward(prompts, completions, **kwargs) -> list[float]:
    raise ValueError("reward exploded")


def solved_reward(prompts, completions, solved, **kwargs) -> list[float]:
    """Positive for rows marked solved, negative otherwise; distinct within a group."""
    return [(1.0 if s else -1.0) + 0.1 * i for i, s in enumerate(solved)]


class FastPollLoop(AsyncRolloutLoop):
    metrics_interval_s = 0.1


class CheckedEnvLoop(FastPollLoop):
    """Fails at setup unless the child runs without a GPU and without torchrun's variables."""

    async def setup(self):
        leaked = [k for k in os.environ
                  if k in ("RANK", "WORLD_SIZE", "MASTER_PORT") or k.startswith("TORCHELASTIC_")]
        if os.environ.get("CUDA_VISIBLE_DEVICES") != "" or leaked:
            raise RuntimeError(f"child environment not scrubbed: {leaked}")


class ScriptedToolLoop(AsyncRolloutLoop):
    """Turn 1 asks for add(1, 2); once a tool response is in the prompt, the model answers "3"."""
    call_json = '{"name": "add", "arguments": {"a": 1, "b": 2}}'  # as the template re-renders it

    async def generate_one_turn(self, prompt_ids):
        answered = self.tokenizer.convert_tokens_to_ids("<tool_response>") in prompt_ids
        text = "3" if answered else f"<tool_call>{self.call_json}</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(list(prompt_ids), ids, [-0.5] * len(ids),
                          output_sampler_logprobs=[{t: -0.5, 0: -2.0} for t in ids])


class CompactToolLoop(ScriptedToolLoop):
    """The same call without spaces: the template re-renders it with spaces, so turn 2 forks."""
    call_json = '{"name":"add","arguments":{"a":1,"b":2}}'


class FlakyLoop(AsyncRolloutLoop):
    """Rollouts of the prompt "boom" fail like a malformed server reply would."""

    async def generate_one(self, prompt, tools, group_id=0):
        if prompt[-1]["content"] == "boom":
            raise VLLMError("malformed reply", self.config.vllm_server_base_url)
        return await super().generate_one(prompt, tools, group_id)


class ModulesLoop(AsyncRolloutLoop):
    """Fails as the child builds it, its message the child's imported modules (comma-separated):
    what the rollout process imports, with no server needed."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(",".join(sorted(sys.modules)))


class StallingLoop(AsyncRolloutLoop):
    """Blocks its event loop for 4 s at the first prompt: the heartbeat stops."""

    def filter_prompt(self, row_index, row, epoch):
        if row_index == 0 and epoch == 0:
            time.sleep(4)
        return True


class Counter:
    """An environment: `add` is its tool, the reward is the number of calls."""

    def reset(self, **row):
        self.calls = 0
        return "Use the tools."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


# The spec's curriculum example, as written.

@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


class PromptEnv(Counter):
    """An environment that owns the data (no train_dataset): reset() writes the prompt; it scores
    itself."""

    def reset(self, **row):
        self.calls = 0
        return "2+3="

    def get_reward(self) -> float:
        return random.random()  # distinct within a group, so groups are kept


class ModelRecordingLoop(FastPollLoop):
    """Records which server answered each turn of a rollout and the model it says it served (the
    reply's `model`), as "url|model,url|model" in the rollout's rollout_id, so the parent can read
    it off samples."""

    async def setup(self):
        self.answered = {}
        for replica in self.replicas:
            replica.client.acompletions = self.recording(replica.client.acompletions, replica.url)

    def recording(self, call, url):
        async def completions(body):
            reply = await call(body)
            self.answered.setdefault(asyncio.current_task(), []).append(f"{url}|{reply['model']}")
            return reply
        return completions

    def tag(self, rollout: Rollout) -> Rollout:
        rollout.rollout_id = ",".join(self.answered.pop(asyncio.current_task(), []))
        return rollout

    async def generate_one(self, prompt, tools, group_id=0):
        return self.tag(await super().generate_one(prompt, tools, group_id))


def served(sample) -> list[tuple[str, str]]:
    """(server URL, model it served) per turn of the sample's rollout (ModelRecordingLoop's tag)."""
    return [tuple(turn.split("|")) for turn in sample.rollout_id.split(",")]


class FailFastLoop(ModelRecordingLoop):
    vllm_max_retries = 1


class SpanningLoop(ModelRecordingLoop):
    """Two turns per rollout; group 0's rollouts wait between their turns until the trainer has
    published version 2, so they span a sync."""

    async def generate_one(self, prompt, tools, group_id=0):
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        first = await self.generate_one_turn(ids)
        while group_id == 0 and self.model_version < 2:
            await asyncio.sleep(0.02)
        second = await self.generate_one_turn(ids + first.output_ids)
        output_ids = first.output_ids + second.output_ids
        completion = [{"role": "assistant", "content": self.tokenizer.decode(output_ids)}]
        return self.tag(Rollout(completion, output_ids, [first, second]))


# ── the training signal under real data (test_train_signal.py, test_rollout_*.py) ────────────

# Earlier answers render as "(said)" (as Qwen3's template drops past thinking): a later turn's
# prompt no longer extends what the server sampled, so every turn forks a new sample.
RERENDERING_TEMPLATE = toy.CHAT_TEMPLATE.replace("{{ message.content or '' }}", "(said)")


class ThreeTurnLoop(AsyncRolloutLoop):
    """Three sampled turns a rollout, a user turn "again" between them: under RERENDERING_TEMPLATE
    3 samples a rollout."""

    async def generate_one(self, prompt, tools, group_id=0):
        messages, ids, turns = list(prompt), [], []
        for _ in range(3):
            prompt_ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            turn = await self.generate_one_turn(prompt_ids)
            turns.append(turn)
            ids += turn.output_ids
            text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "again"}]
        return Rollout(messages[len(prompt):], ids, turns)


class InfAdvantageLoop(AsyncRolloutLoop):
    """compute_advantages gives the group of dataset row 0 (rows None: every group) infinite
    advantages, as a buggy override would: its step's loss is not finite."""
    rows = (0,)

    def compute_advantages(self, group):
        advantages = super().compute_advantages(group)
        if self.rows is None or group.row_index in self.rows:
            advantages[:] = np.inf
        return advantages


class AllInfAdvantageLoop(InfAdvantageLoop):
    rows = None


def constant_reward(prompts, completions, **kwargs) -> list[float]:
    """Equal rewards: every group is dropped (frac_reward_zero_std 1), as on a task too hard."""
    return [0.0] * len(completions)


def infinite_reward(prompts, completions, **kwargs) -> list[float]:
    return [math.inf] + [0.0] * (len(completions) - 1)


def one_too_many_reward(prompts, completions, **kwargs) -> list[float]:
    return [float(i) for i in range(len(completions) + 1)]


def nan_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL's spelling of None: the first rollout unscorable, the rest ranked."""
    return [math.nan] + [float(i) for i in range(1, len(completions))]


def slow_reward(prompts, completions, **kwargs) -> list[float]:
    """Hangs (10 s) on the prompt "2+2=", ranks the rollouts of every other prompt."""
    if prompts[0][-1]["content"] == "2+2=":
        time.sleep(10)
    return rank_reward(prompts, completions)


def stuck_reward(prompts, completions, **kwargs) -> list[float]:
    """Never returns (an hour's sleep in its thread), as a reward waiting on a service that died."""
    time.sleep(3600)
    return rank_reward(prompts, completions)


def spinning_reward(prompts, completions, **kwargs) -> list[float]:
    """Never returns, spinning in Python: its thread takes the GIL back at every switch."""
    while True:
        pass


def slow_add(a: int, b: int) -> int:
    """Add two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    time.sleep(10)
    return a + b


class SlowToolLoop(ScriptedToolLoop):
    """ScriptedToolLoop calling slow_add."""
    call_json = '{"name": "slow_add", "arguments": {"a": 1, "b": 2}}'


class DeepCallLoop(ScriptedToolLoop):
    """Asks for a call whose arguments nest 1,000 deep, then answers "3"."""
    call_json = '{"name": "add", "arguments": {"a": ' + "[" * 1000 + "]" * 1000 + ', "b": 2}}'


class FirstRowToolLoop(ScriptedToolLoop):
    """Calls add(1, 2) only for the prompt "1+1="; every other prompt is answered at once."""

    async def generate_one(self, prompt, tools, group_id=0):
        if prompt[-1]["content"].startswith("1+1="):
            return await super().generate_one(prompt, tools, group_id)
        return await AsyncRolloutLoop.generate_one(self, prompt, [], group_id)


def tool_used_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 for a completion with a tool's answer in it (a tool ran), else 0.0."""
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]
