"""The rollout process (spec: ロールアウトループのカスタマイズ (Customising the rollout loop) and the
AsyncRolloutLoop reference; 並行性 (Concurrency); 記録されたメトリクス (Recorded metrics): the
rollout/, completions/, tools/ and env/ rows).

`AsyncRolloutLoop` shows the spec's hooks, then its two loops: `_generate_loop` starts rollouts,
`_score_loop` turns finished groups into samples; `child_main` is the spawned process's entry
point. The pieces it calls live beside it in rollout/ (the package docstring maps them, and the
process line). `Channels`, the record both processes share, is the loop's: it is the loop's
arguments (the spec's six primitives, with ours beside them), and the child, which never imports
worker.py (the trainer's side), builds its loop from it; worker.py only fills one.

Departures from the spec, one line each (the why is on the code named):
- A group starts only if its samples are consumed before they go stale (staleness.admits).
- RolloutWorker passes the six inter-process primitives as one `Channels` record, not six.
- max_completion_length counts the generated tokens of all turns (generate_one); tool results
  count only against max_model_len (TRL's GRPOTrainer counts them too; its AsyncGRPO caps each
  turn).
- A rollout's requests name the policy version it started under, as a LoRA adapter (adapter_name).
- A failed rollout drops its group; FAILED_GROUPS_TO_STOP groups in a row stop the run (_rollout);
  one whose replica stopped answering runs again on another (_reroute). A reward function, tool
  or environment past reward_tool_timeout (ours) fails its rollout, named (CallTimeout).
- A prompt with no room in max_model_len skips its group, named and counted (_too_long): never an
  empty rollout scored. A max_steps run whose whole pass over the prompts kept no group stops
  (_untrained): the spec drops such groups and says nothing of a run that keeps none.
- rollout/prompts_too_long_total (ours): the prompts skipped so.
- *_total metrics are running totals; backpressure_s, score_block_s: seconds since the last one.
- rollout/admission_wait_s (ours): seconds generation waited for staleness admission, not a full
  queue (the spec's rollout/backpressure_s, which counts only that).
"""
import asyncio
import contextvars
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from rollout.prompts import check_prompt_source, filtered_stream, prompt_stream
from rollout.samples import (FinishedRollout, PendingGroup, Rollout, RolloutGroup, RolloutSample,
                             ToolCall, TurnRecord, check_turn, parse_completion, parse_generate,
                             reconcile)
from rollout.scoring import add_totals, eval_metrics, eval_result, score_group, score_rewards
from rollout.servers import (NoReplicaLeft, Replica, connect_all, drop_unverified, make_replicas,
                             move, pick, poll_all, readmit, take_out)
from rollout.staleness import admits, prior_rate
from rollout.tool_calls import (CallTimeout, EnvironmentPool, environment_reward,
                                environment_tools, parse_turn, run_tool_calls, start_environment,
                                tool_call_format, tool_schemas)
from vllm_client import VLLMError, server_urls

log = logging.getLogger(__name__)

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK",
                "ROLE_WORLD_SIZE")

FAILED_GROUPS_TO_STOP = 4          # failed rollouts in a row from this many groups stop the process
WAKE_S = 0.05                      # the loops re-check shared values at least this often


# ── records ──────────────────────────────────────────────────────────────────────────────────


@dataclass
class TurnContext:
    """Where the current rollout's requests go (its task's context, so an override of
    generate_one_turn with the spec's signature needs no extra argument)."""
    replica: Replica        # the group's replica
    model: str              # the adapter of the policy version the rollout started under
    budget: int | None = None  # generated tokens left (None: max_completion_length)


_TURN: contextvars.ContextVar[TurnContext] = contextvars.ContextVar("rollout_turn")


class PromptTooLong(ValueError):
    """A rollout's first prompt leaves no room to generate in the servers' context (the smallest
    max_model_len over the replicas): its group is skipped (AsyncRolloutLoop._too_long)."""


@dataclass
class Counts:
    """The loop's progress: what admission (staleness.admits), the failure rule (_failed) and the
    untrained rule (_untrained) read."""
    pending_rollouts: int = 0       # rollouts of admitted groups not yet scored
    queued: int = 0                 # samples put on rollout_buffer
    rollouts_done: int = 0          # rollouts finished (reconciled) ...
    samples_done: int = 0           # ... and their training sequences: samples per rollout
    failures_in_a_row: int = 0      # rollouts failed since a group was last scored
    failed_groups_in_a_row: int = 0  # the groups they belong to
    dropped_in_a_row: int = 0       # groups scored and dropped (or skipped) since one was kept
    too_long_in_a_row: int = 0      # ... of them skipped: their prompt was too long ...
    too_long: str = ""              # ... the last one's row, length and the limit
    kept_at: float = field(default_factory=time.monotonic)  # when that one was kept ...
    warned: bool = False            # ... and untrained_warning_s said so


@dataclass
class SinceLastEmit:
    """What accumulated since the last periodic emission (every metrics_interval_s): seconds
    the loops waited, by cause, and the tokens generated. take() reports and zeroes them."""
    backpressure_s: float = 0.0     # rollout/backpressure_s: the rollout queue was full
    admission_wait_s: float = 0.0   # rollout/admission_wait_s (ours): staleness admission
    score_block_s: float = 0.0      # rollout/score_block_s: the score queue was full
    generated_tokens: int = 0       # over the seconds since: rollout/generated_tok_s

    def take(self, seconds: float) -> dict[str, float]:
        out = {f"rollout/{name}": getattr(self, name)
               for name in ("backpressure_s", "admission_wait_s", "score_block_s")}
        out["rollout/generated_tok_s"] = self.generated_tokens / max(seconds, 1e-9)
        self.__init__()
        return out


@dataclass
class Channels:
    """Everything the trainer (worker.py) and the child share, all from one spawn context. The
    spec's loop takes six of them as arguments (marked spec, with its name where it differs); the
    rest are ours: resume progress, the staleness window (staleness.py), stop and ready."""
    rollout_buffer: Any     # spec. Queue: RolloutSample child → parent; None once prompts run out
    metrics: Any            # spec metrics_queue. Queue: metric dicts child → parent; None ends
    progress: Any           # ours. Queue: (prompt_index, samples queued) per finished prompt
    exception_info: Any     # spec exception_info_queue. Queue: (type, message, traceback)
    model_version: Any      # spec model_version_value. Value('q'), set after each weight sync
    version_start: Any      # ours. Value('q'): C_v, samples consumed when the version began
    rate: Any               # ours. Value('d'): R, samples the trainer consumes per version
    consumed: Any           # ours. Value('q'): samples the parent has handed to the trainer
    heartbeat: Any          # spec heartbeat_value. Value('d'): time.time() of the child's beat
    stop: Any               # ours. Event parent → child
    ready: Any              # ours. Event child → parent: connected and set up
    failed: Any             # spec failed_event. Event child → parent: see exception_info
    eval_requests: Any      # ours. Queue parent → child: the step whose weights to evaluate
    evals: Any              # ours. Queue child → parent: each evaluation's eval/* figures


def spec_channels(config, rollout_buffer, model_version_value, heartbeat_value, failed_event,
                  exception_info_queue, metrics_queue) -> Channels:
    """Channels from the spec's six primitives; ours are in-process stand-ins (no trainer
    publishes a staleness window: the prior rate of one process holds)."""
    missing = [name for name, v in [("rollout_buffer", rollout_buffer),
                                    ("model_version_value", model_version_value),
                                    ("heartbeat_value", heartbeat_value),
                                    ("failed_event", failed_event),
                                    ("exception_info_queue", exception_info_queue),
                                    ("metrics_queue", metrics_queue)] if v is None]
    if missing:
        raise TypeError(f"AsyncRolloutLoop needs {', '.join(missing)} (or one `channels` record)")
    return Channels(rollout_buffer=rollout_buffer, metrics=metrics_queue, progress=queue.Queue(),
                    exception_info=exception_info_queue, model_version=model_version_value,
                    version_start=SimpleNamespace(value=0),
                    rate=SimpleNamespace(value=prior_rate(config, 1)),
                    consumed=SimpleNamespace(value=0), heartbeat=heartbeat_value,
                    stop=threading.Event(), ready=threading.Event(), failed=failed_event,
                    eval_requests=queue.Queue(), evals=queue.Queue())


# ── the loop ─────────────────────────────────────────────────────────────────────────────────


class AsyncRolloutLoop:
    """Generates and scores rollouts inside the spawned rollout process (spec: AsyncRolloutLoop).

    Subclass it and override a hook; set the subclass as the trainer's `loop_cls` (it must be
    defined at module level: the child imports it). Hooks read `self.config` and `self.tokenizer`:

        filter_prompt(row_index, row, epoch)   once per prompt           accept every prompt
        generate_one(prompt, tools, group_id)  once per rollout          the multi-turn tool loop
        generate_one_turn(prompt_ids)          once per request          the config's sampling
        compute_advantages(group)              once per scored group     rewards standardised
        setup(), close()                       as the loop starts/stops  nothing

    It takes the spec's arguments, the six inter-process primitives (rollout_buffer ...
    metrics_queue) among them. RolloutWorker passes those as one `channels` record instead, with
    our own channels beside them, and max_concurrent_rollouts resolved (the parent knows
    num_processes); built from the six, the rest are in-process stand-ins (spec_channels).
    """
    metrics_interval_s = 2.0  # seconds between /metrics polls and periodic metric emissions
    vllm_max_retries = 8      # retries of a failed request before it fails (vllm_client's policy)

    def __init__(self, config, model_name: str | None, dataset, reward_funcs: list[Callable] | None,
                 processing_class, eos_token_ids: list[int], rollout_buffer=None,
                 model_version_value=None, heartbeat_value=None, failed_event=None,
                 exception_info_queue=None, metrics_queue=None,
                 tools: list[Callable] | None = None,
                 environment_factory: Callable | dict[str, Callable] | None = None,
                 score_queue_maxsize: int = 16, lora_name: str | None = None,
                 dataset_start_index: int = 0, *, channels: Channels | None = None,
                 max_concurrent_rollouts: int | None = None, eval_dataset=None,
                 max_eval_rollouts: int | None = None):
        check_prompt_source(dataset, environment_factory, config.max_steps)
        spec_six = (rollout_buffer, model_version_value, heartbeat_value, failed_event,
                    exception_info_queue, metrics_queue)
        if channels is None and any(v is not None for v in spec_six):
            channels = spec_channels(config, *spec_six)   # none at all: a loop for its hooks only
        if max_concurrent_rollouts is None:
            max_concurrent_rollouts = config.default_max_concurrent_rollouts(num_processes=1)
        # the spec's arguments, as the hooks read them
        self.config = config
        self.model_name = model_name                  # None: the servers' model, read at start
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs or [])  # none: environments or Rollout.reward score
        self.tokenizer = processing_class
        self.eos_token_ids = list(eos_token_ids)
        self.channels = channels
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.environments = None if environment_factory is None else EnvironmentPool(
            environment_factory, config.reward_tool_timeout)
        self.lora_name = lora_name
        self.dataset_start_index = dataset_start_index
        self.eval_dataset = eval_dataset              # ours: evaluated when the trainer asks
        self.max_eval_rollouts = max_eval_rollouts or config.per_device_eval_batch_size
        # where and how requests go: the servers, the sampler's top log-probs, tool calls
        self.replicas = make_replicas(server_urls(config), max_concurrent_rollouts,
                                      config.vllm_server_timeout, self.vllm_max_retries)
        self.num_top = config.num_sampler_logprobs if config.score_centering else None
        self.vocab_size = len(processing_class)       # a reply's token ids lie below it
        # the user's code (tools, environments, reward functions) runs in these threads, never in
        # asyncio's own: a call stuck past reward_tool_timeout must not hold the process's exit
        self.tool_pool = ThreadPoolExecutor(max_concurrent_rollouts + len(self.reward_funcs),
                                            thread_name_prefix="rollout-call")
        self.tool_format = tool_call_format(processing_class)
        self.warned_tool_format = False
        # the two loops' state
        self.score_queue: asyncio.Queue = asyncio.Queue(score_queue_maxsize)
        self.max_model_len = 0            # the smallest over the replicas
        self.counts = Counts()
        self.fatal: BaseException | None = None  # a rollout's error: the generate loop raises it
        self.tasks: set[asyncio.Task] = set()    # the running rollouts
        self.wake = asyncio.Event()              # something the generate loop waits on changed
        self.since_emit = SinceLastEmit()
        self.totals: dict[str, float] = {}       # the *_total counters since the start
        self.recent_rewards = np.zeros(0)        # scale_rewards="batch": about a step's rewards
        self.evaluating = 0                      # eval groups started and not yet scored
        # a pass over the prompts (_untrained): the dataset's rows; without a length (a stream,
        # environment-owned data) a run's worth, one prompt a step
        self.pass_prompts = len(dataset) if hasattr(dataset, "__len__") else config.max_steps

    # ── hooks ──

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """True to generate num_generations rollouts for the prompt, False to skip it this epoch."""
        return True

    async def generate_one(self, prompt, tools: list[Callable], group_id: int = 0) -> Rollout:
        """One rollout: render → sample → run the tool calls → repeat until no call, the iteration
        limit, the generated-token budget or the context is used up.

        The budget is max_completion_length across all turns (TRL does not enforce it across
        turns): it is left in the rollout's TurnContext, where generate_one_turn(prompt_ids), the
        spec's signature, reads it, so an override with that signature keeps it. A later turn
        whose prompt fills the context ends the rollout, truncated (completions/clipped_ratio); a
        first one is PromptTooLong (generate_one_turn), as is a plain-text prompt that fills it."""
        config = self.config
        context = self._turn_context()
        if isinstance(prompt, str):  # a standard (plain text) prompt: one turn, no chat template
            if tools:
                raise ValueError("tools and environments need conversational prompts (lists of "
                                 "messages)")
            turn = await self.generate_one_turn(self.tokenizer(prompt)["input_ids"])
            text = self.tokenizer.decode(np.asarray(turn.output_ids), skip_special_tokens=True)
            return Rollout(text, turn.output_ids, [turn])
        by_name = {tool.__name__: tool for tool in tools}
        if by_name and self.tool_format is None and not self.warned_tool_format:
            self.warned_tool_format = True
            log.warning("tools are given but the tokenizer neither defines a response_template nor "
                        "writes <tool_call> blocks in its chat template: tool calls are parsed as "
                        "Qwen <tool_call> blocks, which this model may never write")
        schemas = tool_schemas(tools)
        messages = list(prompt)       # the prompt, then the completion's messages
        completion_ids = []
        turns = []
        calls: list[ToolCall] = []
        exhausted = truncated = False
        while (budget := config.max_completion_length - len(completion_ids)) > 0:
            prompt_ids = self.tokenizer.apply_chat_template(
                messages, tools=schemas, add_generation_prompt=True, tokenize=True,
                return_dict=True, **(config.chat_template_kwargs or {}))["input_ids"]
            if turns and len(prompt_ids) >= self.max_model_len:
                truncated = True
                break
            context.budget = budget
            turn = await self.generate_one_turn(prompt_ids)
            turns.append(turn)
            completion_ids += turn.output_ids
            # an array: transformers' decode skips its per-element check of a list (21 µs of 48)
            text = self.tokenizer.decode(np.asarray(turn.output_ids), skip_special_tokens=True)
            content, requested = text, []           # no tools offered: no calls
            if by_name:
                content, requested = parse_turn(self.tokenizer, self.tool_format, text, prompt_ids,
                                                tools)
            message = {"role": "assistant", "content": content}
            if requested:
                message["tool_calls"] = [{"type": "function", "function": c}
                                         for c in requested if "error" not in c]
            messages.append(message)
            ended = bool(turn.output_ids) and turn.output_ids[-1] in self.eos_token_ids
            if not requested or not ended:
                break
            iteration = len(turns) - 1
            limit = config.max_tool_calling_iterations
            if limit is not None and iteration >= limit:
                exhausted = True
                break
            results, records = await run_tool_calls(requested, by_name, self.tool_pool,
                                                    iteration, config.reward_tool_timeout)
            calls += records
            messages += results
        return Rollout(messages[len(prompt):], completion_ids, turns, tool_call_count=len(calls),
                       tool_failure_count=sum(c.failed for c in calls), tool_calls=calls,
                       loop_exhausted=exhausted, truncated=truncated)

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's sampling settings, to the rollout's replica and
        adapter (TurnContext); max_tokens is the rollout's budget left (max_completion_length
        across turns), capped by the context left (max_model_len − prompt). A prompt that leaves
        no room is PromptTooLong, never a request with max_tokens <= 0 (which vLLM refuses)."""
        config = self.config
        context = self._turn_context()
        client = context.replica.client
        budget = context.budget or config.max_completion_length
        max_tokens = min(budget, self.max_model_len - len(prompt_ids))
        if max_tokens <= 0:
            raise PromptTooLong(f"its prompt of {len(prompt_ids)} tokens leaves no room in "
                                f"max_model_len={self.max_model_len}, the servers' context")
        params = {"max_tokens": max_tokens, "temperature": config.temperature,
                  "top_p": config.top_p, "repetition_penalty": config.repetition_penalty,
                  "stop_token_ids": self.eos_token_ids, "logprobs": self.num_top or 0}
        if config.top_k > 0:
            params["top_k"] = config.top_k
        if config.min_p is not None:
            params["min_p"] = config.min_p
        if context.replica.use_generate:        # candidate sets come only from this route
            endpoint, send, parse = "/inference/v1/generate", client.agenerate, parse_generate
            body = {"token_ids": list(prompt_ids), "sampling_params": params}
        else:
            endpoint, send, parse = "/v1/completions", client.acompletions, parse_completion
            body = {**params, "prompt": list(prompt_ids), "return_token_ids": True,
                    "return_tokens_as_token_ids": True}
        while True:
            try:
                reply = await send({"model": context.model, **body})
                break
            except VLLMError as e:
                newest = self.adapter_name(self.model_version)
                if e.status != 404 or newest == context.model:
                    raise
                context.model = newest          # its adapter was unloaded: see adapter_name
        try:
            turn = parse(prompt_ids, reply, self.num_top)
            check_turn(turn, reply.get("model"), context.model, max_tokens, self.vocab_size,
                       self.eos_token_ids)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise VLLMError(f"malformed reply ({type(e).__name__}: {e}): {str(reply)[:300]}",
                            client.base_url + endpoint) from e
        return turn

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: its reward minus the group's mean, divided by a std + 1e-4
        (scale_rewards): "group" the group's own (population std, as reward_group_std), "batch"
        that of about one optimizer step of rewards (the last R / weight_sync_steps scored, this
        group's included, R the samples the trainer takes per version: an asynchronous batch has
        no fixed members), "none" nothing (Dr. GRPO). A NaN reward gets 0 and is left out."""
        rewards = group.rewards
        scored = ~np.isnan(rewards)
        advantages = np.zeros(len(rewards))
        if scored.any():
            r = rewards[scored]
            std = r.std()                                               # "group"
            if self.config.scale_rewards == "batch":
                rate = (self.channels.rate.value if self.channels is not None
                        else prior_rate(self.config, 1))
                step = max(len(r), round(rate / self.config.weight_sync_steps))
                self.recent_rewards = np.concatenate([self.recent_rewards, r])[-step:]
                std = self.recent_rewards.std()
            scale = std + 1e-4 if self.config.scale_rewards != "none" else 1.0
            advantages[scored] = (r - r.mean()) / scale
        return advantages

    async def setup(self) -> None:
        """Create what the other hooks need (on the loop's event loop, before the first prompt)."""

    async def close(self) -> None:
        """Release what setup() created (runs when the loop stops, also after a failure)."""

    def adapter_name(self, version: int) -> str:
        """The model a rollout started under policy `version` requests: with LoRA adapter sync the
        trainer's adapter `<lora_name>-v<version>`; version 0 (the adapter starts at zero) and runs
        without LoRA use the base model. A rollout that spans a sync finishes under its start
        version; the trainer keeps those adapters loaded. One the trainer has unloaded all the
        same (a rollout that waited for its request longer than max_staleness syncs: seen with
        real vLLM, 404) goes on under the newest adapter; its samples keep their group's older
        version, so their staleness is over-counted, never under-counted."""
        if self.lora_name is None or version == 0:
            return self.model_name
        return f"{self.lora_name}-v{version}"

    @property
    def model_version(self) -> int:
        return self.channels.model_version.value

    # ── the run and its two loops ──

    async def run(self) -> None:
        """Connect, set up, then generate and score until the parent says stop (or a failure)."""
        beat = asyncio.create_task(self._heartbeat())
        workers: list[asyncio.Task] = []
        try:
            await self.connect()
            if self.environments is not None:
                await self.environments.probe(self.tool_pool)
            await self.setup()
            self.channels.ready.set()
            loops = (self._generate_loop(), self._score_loop(), self._metrics_loop(),
                     self._eval_loop())
            workers = [asyncio.create_task(c) for c in loops]
            stop = asyncio.create_task(self._wait_for_stop())
            pending = {stop, *workers}
            while stop in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # a loop's failure ends the run here
        finally:
            running = [beat, *workers, *self.tasks]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)  # ended before the clients close
            self.channels.rollout_buffer.cancel_join_thread()  # stopping: unread samples are lost
            self.channels.metrics.cancel_join_thread()
            try:
                await self.close()
            finally:
                for replica in self.replicas:
                    await replica.client.aclose()
                self.tool_pool.shutdown(wait=False, cancel_futures=True)

    async def _generate_loop(self) -> None:
        """Per prompt: filter_prompt → room in the score queue → admission by staleness → (after a
        sync: the replicas the trainer refused leave routing, drop_unverified) → a replica for the
        whole group (its prompt stays in one prefix cache) → its rollouts, each waiting for a slot
        under the replica's cap and started as its own task."""
        config = self.config
        G = config.num_generations
        group_id = 0
        stream = prompt_stream(self.dataset, self.dataset_start_index, config.num_train_epochs,
                               config.max_steps, config.shuffle_seed())
        prompts = filtered_stream(stream, self.filter_prompt)   # an epoch rejected whole raises
        checked = None                          # the version drop_unverified last looked after
        for prompt_index, _, row_index, row, accepted in prompts:
            if not accepted:
                self.channels.progress.put((prompt_index, 0))
                continue
            await self._wait_until(lambda: not self.score_queue.full(), "score_block_s")
            await self._wait_until(self._admissible, "admission_wait_s")
            if (version := self.model_version) != checked:    # a sync since: refused replicas
                adapter = self.lora_name is not None and version > 0
                await drop_unverified(self.replicas, self.adapter_name(version), adapter)
                checked = version
            replica = pick(self.replicas)
            group = PendingGroup(group_id, row_index, prompt_index, row, G, replica)
            group_id += 1
            self.counts.pending_rollouts += G
            await self._start_group(group)
        await self._wait_until(lambda: not self.tasks)
        await self.score_queue.put(None)

    async def _start_group(self, group: PendingGroup) -> None:
        """Start a group's rollouts on its replica, each as its own task once a slot is free under
        the replica's cap (training's and evaluation's alike); a replica taken out while they wait
        moves the rest to another."""
        replica = group.replica
        replica.assigned += group.size
        for i in range(group.size):
            await self._wait_until(lambda: group.replica.down is not None
                                   or group.replica.inflight < group.replica.cap.cap)
            if group.replica.down is not None:      # out while it waited: move the rest
                replica = move(self.replicas, group, group.size - i)
                await self._wait_until(lambda: replica.inflight < replica.cap.cap)
            if i == 0:
                group.model_version = self.model_version
            replica.inflight += 1
            task = asyncio.create_task(self._rollout(group, i))
            self.tasks.add(task)
            task.add_done_callback(self._rollout_ended)

    async def _eval_loop(self) -> None:
        """Each evaluation the trainer asks for (RolloutWorker.evaluate), one at a time, in order:
        _evaluate, then its eval/* figures on the evals channel."""
        while True:
            try:
                step = self.channels.eval_requests.get_nowait()
            except queue.Empty:
                await asyncio.sleep(WAKE_S)
                continue
            self.channels.evals.put(await self._evaluate(step))

    async def _evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the policy the servers hold: num_generations_eval rollouts of every eval prompt,
        through the training rollouts' own code (generate_one: tools, turns, environments) on the
        same replicas, scored by the reward functions and never trained on; its prompts are not the
        training stream's (the resume index never sees them). Returns the eval/* figures
        (scoring.eval_metrics; `step`: the trainer's step when it asked).

        What it costs: its generation, nothing else. No server is paused and no version is waited
        for: eval groups start beside training's, within the same KV-adaptive caps, at most
        max_eval_rollouts of them in flight (per_device_eval_batch_size × ranks, whole groups), so
        training's generation slows by the share they take and the trainer trains on meanwhile.
        A sync may land during a long evaluation: each group runs under the version its first
        rollout started with, and eval/model_version_min/max say which were evaluated. It samples
        with the run's own settings (temperature, top_p, top_k, min_p, max_completion_length):
        pass@k measures the policy that trains, as it samples."""
        G = self.config.num_generations_eval or self.config.num_generations
        in_flight = max(1, self.max_eval_rollouts // G)        # whole groups
        start = time.monotonic()
        groups = []
        for row_index, row in enumerate(self.eval_dataset):
            await self._wait_until(lambda: self.evaluating < in_flight)
            group = PendingGroup(-1 - row_index, row_index, -1, row, G, pick(self.replicas),
                                 evaluation=step)
            groups.append(group)
            self.evaluating += 1
            await self._start_group(group)
        await self._wait_until(lambda: all(g.result is not None for g in groups))
        return eval_metrics(step, [g.result for g in groups], self.config.eval_pass_reward,
                            seconds=time.monotonic() - start)

    async def _score_eval(self, group: PendingGroup) -> None:
        """An eval group done: its rewards and figures (scoring.eval_result), or None's mark of a
        failed one (counted as eval/failed_prompts); its environments go back to the pool, unless
        its scoring timed out (as a training group's: the stuck reward function may still read
        them)."""
        try:
            if not group.failed:
                built = group.build()
                columns = await score_rewards(self.reward_funcs, built,
                                              self.config.reward_tool_timeout, self.tool_pool)
                group.result = eval_result(built, columns, self.eos_token_ids)
            self._give_back(group.slots)
        except CallTimeout as e:
            log.error("scoring eval prompt %d failed: %s", group.row_index, e)
        finally:
            group.result = group.result or {"failed": True}
            self.evaluating -= 1

    async def _score_loop(self) -> None:
        """Per complete group: score_group (rollout/scoring.py) → its samples on the rollout queue;
        the end markers once the prompts run out."""
        while (group := await self.score_queue.get()) is not None:
            waited = time.monotonic() - group.queued_at
            start = time.monotonic()
            try:
                samples, metrics = await score_group(
                    group, self.reward_funcs, self.compute_advantages, self.eos_token_ids,
                    self.num_top, self.config.reward_tool_timeout,
                    offers_tools=bool(self.tools) or self.environments is not None,
                    mask_truncated=self.config.mask_truncated_completions,
                    executor=self.tool_pool)
            except CallTimeout as e:              # a stalled reward function fails the group
                self._failed(group, "scoring", e, new_group=True)
                self._finish_prompt(group.prompt_index, len(group.rollouts), 0)
                continue
            self.counts.failures_in_a_row = self.counts.failed_groups_in_a_row = 0
            for env in group.environments or []:
                self.environments.give_back(env)
            add_totals(self.totals, metrics)
            metrics |= {"rollout/score_s": time.monotonic() - start, "rollout/score_wait_s": waited}
            for sample in samples:
                sample.enqueued_at = time.time()
                await self._put(sample)
            self._finish_prompt(group.prompt_index, len(group.rollouts), len(samples))
            self._emit(metrics)
            self._untrained(kept=bool(samples))
        self._untrained(kept=False, ended=True)
        await self._put(None, self.channels.metrics)  # metrics end first: the parent waits for it
        await self._put(None)

    # ── the machinery ──

    async def connect(self) -> None:
        """Check every replica at start (servers.connect_all) and start their caps."""
        served, self.max_model_len = await connect_all(self.replicas, self.config, self.num_top,
                                                       self.eos_token_ids[0])
        self.model_name = self.model_name or served

    def _admissible(self) -> bool:
        """May a new group start now? staleness.admits with the trainer's published values."""
        counts = self.counts
        per_rollout = counts.samples_done / counts.rollouts_done if counts.rollouts_done else None
        return admits(queued=counts.queued, pending=counts.pending_rollouts,
                      consumed=self.channels.consumed.value,
                      version_start=self.channels.version_start.value,
                      rate=self.channels.rate.value, num_generations=self.config.num_generations,
                      max_staleness=self.config.max_staleness, per_rollout=per_rollout)

    async def _rollout(self, group: PendingGroup, i: int) -> None:
        """Run rollout i of a group in its own task, under the version current at its start; hand
        the group to scoring when it is complete.

        A rollout that raises (a 4xx, a reply samples.check_turn refuses, vllm_server_timeout
        spent, a tool or environment past reward_tool_timeout, a tool loop bug) drops its group
        with a logged error (_failed). The process stops only once FAILED_GROUPS_TO_STOP groups
        have failed with none scored in between (counted by group, so one bad prompt with
        num_generations ≥ 8 does not stop the run), or when no replica is left. One whose replica
        stopped answering runs again on another (_reroute): nothing is lost or trained twice."""
        start = time.monotonic()
        replica = group.replica
        try:
            while True:
                try:
                    prompt, rollout, env, stats = await self._generate_on(replica, group)
                    break
                except (VLLMError, TimeoutError) as e:
                    if await asyncio.to_thread(replica.client.healthy):
                        raise
                    replica = self._reroute(group, replica, e)
            env_reward = None
            if env is not None:
                env_reward, stats["env/reward_s"] = await environment_reward(
                    env, self.tool_pool, self.config.reward_tool_timeout)
            sequences, drifts = reconcile(rollout.turns)
            stats |= {"duration_s": time.monotonic() - start, "drifts": drifts}
            group.slots[i] = FinishedRollout(prompt, rollout, sequences, env_reward, stats, env)
            self.since_emit.generated_tokens += len(rollout.completion_ids)
            self.counts.rollouts_done += 1
            self.counts.samples_done += len(sequences)
        except Exception as e:
            if isinstance(e, NoReplicaLeft):
                raise
            if not isinstance(e, PromptTooLong) or group.evaluation is not None:
                self._failed(group, f"rollout {i}", e, new_group=not group.failed)
            elif not group.failed:                      # once a group
                self._too_long(group, e)
            group.failed = True
        finally:
            group.done.add(i)
            self.wake.set()
        if len(group.done) == group.size:
            if group.evaluation is not None:
                await self._score_eval(group)
            elif group.failed:
                self._give_back(group.slots)
                self._finish_prompt(group.prompt_index, group.size, 0)
            else:
                await self.score_queue.put(group.build(queued_at=time.monotonic()))

    async def _generate_on(self, replica: Replica, group: PendingGroup):
        """One attempt at a rollout on `replica`, in a slot taken under its cap and freed here:
        (prompt, Rollout, environment or None, stats)."""
        _TURN.set(TurnContext(replica, self.adapter_name(self.model_version)))
        prompt = group.row.get("prompt")
        env = None
        stats = {}
        tools = list(self.tools)
        try:
            if self.environments is not None:
                env, prompt, stats["env/reset_s"] = await start_environment(
                    self.environments, group.row, self.tool_pool)
                tools += environment_tools(env)
            rollout = await self.generate_one(prompt, tools, group.group_id)
        finally:
            replica.inflight -= 1
            replica.assigned -= 1
        replica.cap.rollout_done(replica.inflight)
        return prompt, rollout, env, stats

    def _reroute(self, group: PendingGroup, replica: Replica,
                 error: BaseException) -> Replica:
        """`replica` failed a call and /health: out of routing (take_out), and a slot on the
        group's replica, or, if that one is out too, on the least loaded in routing. The slot is
        taken at once, over its cap if need be: waiting behind new groups would hold this group's
        finished rollouts back (and stale) until the prompts run out."""
        take_out(self.replicas, replica, error)
        new = group.replica if group.replica.down is None else move(self.replicas, group, 0)
        new.assigned += 1
        new.inflight += 1
        return new

    def _failed(self, group, what: str, error: Exception, new_group: bool) -> None:
        """Count and log a failed rollout (or a group's scoring: `what`), whose `group` (pending
        or built) is dropped; raise once rollouts of FAILED_GROUPS_TO_STOP groups have failed in a
        row. An eval group's failure is logged only (eval/failed_prompts counts it)."""
        if getattr(group, "evaluation", None) is not None:
            log.error("%s of eval prompt %d failed: %s: %s", what, group.row_index,
                      type(error).__name__, error)
            return
        self.counts.failed_groups_in_a_row += new_group
        self.counts.failures_in_a_row += 1
        log.error("%s of group %d (dataset row %d) failed; the group is dropped: %s: %s", what,
                  group.group_id, group.row_index, type(error).__name__, error, exc_info=True)
        if self.counts.failed_groups_in_a_row >= FAILED_GROUPS_TO_STOP:
            raise RuntimeError(f"{self.counts.failures_in_a_row} rollouts failed in a row, in "
                               f"{self.counts.failed_groups_in_a_row} groups; the last one: "
                               f"{type(error).__name__}: {error}") from error

    def _too_long(self, group, error: PromptTooLong) -> None:
        """A rollout whose prompt leaves no room to generate: its group is skipped, logged naming
        the dataset row, its length and the limit, counted in rollout/prompts_too_long_total, and
        dropped for the untrained rule (_untrained), so a pass of nothing else stops the run with
        this error. Nothing of it is scored."""
        self.counts.too_long = f"dataset row {group.row_index}: {error}"
        log.error("%s; the prompt is skipped", self.counts.too_long)
        metrics = {"rollout/prompts_too_long_total": 1}
        add_totals(self.totals, metrics)
        self._emit(metrics)
        self._untrained(kept=False, too_long=True)

    def _untrained(self, kept: bool, ended: bool = False, too_long: bool = False) -> None:
        """After each group is scored (kept: it gave samples) or skipped (`too_long`), and when
        the prompts have `ended`: once no group was kept for untrained_warning_s (the spec drops a
        group whose rewards are all equal: a task too hard, or too easy), a warning saying why and
        what to try. A max_steps run stops once a whole pass over the prompts (pass_prompts) gave
        none (with nothing trained the policy cannot change, so the next pass would give none
        either, and the trainer would wait forever), and a run whose prompts ended before any
        sample was queued stops saying why: the last too-long prompt if every one was."""
        counts = self.counts
        if kept:
            counts.kept_at, counts.dropped_in_a_row, counts.warned = time.monotonic(), 0, False
            counts.too_long_in_a_row = 0
            return
        counts.dropped_in_a_row += not ended
        counts.too_long_in_a_row += too_long
        quiet = time.monotonic() - counts.kept_at
        equal = counts.dropped_in_a_row - counts.too_long_in_a_row
        why = (f"no group kept for {quiet:.0f}s: the {equal} scored since had equal rewards "
               "(frac_reward_zero_std 1), so nothing trains; give partial credit in the reward, "
               "raise num_generations or temperature, or filter the prompts")
        if counts.too_long_in_a_row:
            why = (f"{counts.too_long_in_a_row} prompts were too long, the last {counts.too_long}"
                   + (f"; {why}" if equal else ""))
        if self.config.max_steps > 0 and counts.dropped_in_a_row >= self.pass_prompts:
            raise RuntimeError(f"max_steps={self.config.max_steps} would wait forever: a whole "
                               f"pass over the prompts ({self.pass_prompts}) trained nothing: "
                               f"{why}")
        if ended and counts.dropped_in_a_row and not counts.queued:
            raise RuntimeError(f"the prompts ran out and nothing was trained: {why}")
        if quiet > self.config.untrained_warning_s and not counts.warned and not ended:
            counts.warned = True
            log.warning(why)

    def _give_back(self, slots: list) -> None:
        """The environments of a dropped or evaluated group's finished rollouts, to the pool."""
        for slot in slots:
            if slot is not None and slot.environment is not None:
                self.environments.give_back(slot.environment)

    def _rollout_ended(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fatal = self.fatal or task.exception()     # the first: the cause
        self.wake.set()

    def _finish_prompt(self, prompt_index: int, rollouts: int, samples: int) -> None:
        self.counts.pending_rollouts -= rollouts
        self.counts.queued += samples
        self.channels.progress.put((prompt_index, samples))
        self.wake.set()

    def _turn_context(self) -> TurnContext:
        """The running rollout's TurnContext; outside one (a hook called directly), the first
        replica and the base model, set for the caller's context."""
        context = _TURN.get(None)
        if context is None:
            context = TurnContext(self.replicas[0], self.model_name)
            _TURN.set(context)
        return context

    async def _wait_until(self, ready: Callable[[], bool], wait: str | None = None) -> None:
        """Sleep until ready() holds. The time waited is added to since_emit.<wait> as it passes,
        so a long block shows in every emission, not only once it ends. Raises a rollout's fatal
        error."""
        last = time.monotonic()
        while True:
            if self.fatal is not None:
                raise self.fatal
            if ready():
                return
            self.wake.clear()
            try:            # not wait_for: on 3.11 it swallows a cancel that meets a set wake
                async with asyncio.timeout(WAKE_S):
                    await self.wake.wait()
            except TimeoutError:
                pass
            if wait is not None:
                now = time.monotonic()
                setattr(self.since_emit, wait, getattr(self.since_emit, wait) + now - last)
                last = now

    async def _put(self, item: RolloutSample | None, channel=None) -> None:
        """Put on the rollout queue (or `channel`) without blocking the event loop; the time a full
        queue blocks is backpressure. This thread is the queues' only producer, so a queue not
        full stays so until the put."""
        channel = channel or self.channels.rollout_buffer
        await self._wait_until(lambda: not channel.full(), "backpressure_s")
        channel.put_nowait(item)

    async def _metrics_loop(self) -> None:
        """At start and every metrics_interval_s: poll the servers (servers.poll_all, which
        moves their caps) and emit the periodic metrics, so a run shorter than the interval has
        them too. Kinds: *_total are running totals since the process started (report the latest),
        except rollout/vllm_preemptions_total, those since the last poll; rollout/backpressure_s,
        rollout/admission_wait_s and rollout/score_block_s are the seconds since the last emission
        (sum them over a logging window); the rest are samples."""
        last_time = time.monotonic()
        while True:
            version = self.model_version
            if await readmit(self.replicas, self.adapter_name(version), version,
                             self.lora_name is not None):
                self.wake.set()
            metrics = await poll_all(self.replicas)
            now = time.monotonic()
            metrics |= {"rollout/score_queue_size": self.score_queue.qsize()}
            metrics |= self.since_emit.take(seconds=now - last_time)
            last_time = now
            self._emit(metrics)
            self.wake.set()
            await asyncio.sleep(self.metrics_interval_s)

    def _emit(self, metrics: dict[str, float]) -> None:
        try:
            self.channels.metrics.put_nowait(metrics)
        except queue.Full:
            pass  # the trainer is not draining metrics: losing some beats blocking generation

    async def _heartbeat(self) -> None:
        while True:
            self.channels.heartbeat.value = time.time()
            await asyncio.sleep(0.5)

    async def _wait_for_stop(self) -> None:
        """Until the trainer sets stop; a trainer gone without it (SIGKILL, the OOM killer) ends
        this process at once: no one reads its queues, so a clean exit could hang."""
        parent = multiprocessing.parent_process()     # the trainer; None when run in-process
        while not self.channels.stop.is_set():
            if parent is not None and not parent.is_alive():
                os._exit(1)
            await asyncio.sleep(0.1)


def child_main(loop_cls: type, kwargs: dict, channels: Channels) -> None:
    """The spawned process's entry point: a CPU-only, non-distributed environment, then the loop;
    its error reaches the parent as (type, message, traceback) on exception_info."""
    for name in list(os.environ):
        if name in TORCHRUN_ENV or name.startswith("TORCHELASTIC_"):
            del os.environ[name]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        asyncio.run(loop_cls(channels=channels, **kwargs).run())
    except BaseException as e:
        channels.exception_info.put((type(e).__name__, str(e), traceback.format_exc()))
        channels.failed.set()  # after the info, so the parent always finds it
        raise
