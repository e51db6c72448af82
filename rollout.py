"""The rollout process (spec: 概要, 並行性, ロールアウトループのカスタマイズ, 記録されたメトリクス: ロールアウト/補完/ツール/環境,
and the AsyncRolloutLoop / Rollout / TurnRecord / RolloutGroup reference).

A separate process keeps the vLLM server busy while the trainer trains: it sends prompts, runs tools,
reconciles each conversation into training sequences, scores groups, computes advantages and queues
`RolloutSample`s. The trainer starts and watches it through `rollout_worker.RolloutWorker`; tool calling
and environments live in `rollout_tools.py` (they stand alone: parsing a model's tool calls and running
Python callables knows nothing of groups, queues or the server); the servers (one or several replicas,
each with its live concurrency cap, the checks at start and the routing of groups) in `rollout_servers.py`.

    trainer, rank 0                          spawned child (CUDA_VISIBLE_DEVICES="", no torchrun env)
    ───────────────                          ─────────────────────────────────────────────────────────
    RolloutWorker.start() ── pickle check ─► _child_main → AsyncRolloutLoop.run()   (one asyncio loop)
        waits for `ready` (or `failed`)        _connect: every replica checked, its first cap; setup()
                                               _generate_loop   prompt_stream → filter_prompt → admit
    set_model_version(v) ── model_version ─►     (staleness, score queue) → a replica for the group →
                         ── C_v, R ────────►     rollouts under its cap, each under the version it started
                                                 in: generate_one → reconcile → group slot
                                                     │ a complete group
                                                     ▼ score queue (asyncio.Queue, score_queue_maxsize)
    get() ◄── rollout_buffer (mp.Queue) ────── _score_loop   rewards → compute_advantages → samples
      consumed ──────────────────────────────►   (None at the end of the prompts)
    resume_index() ◄── progress (mp.Queue) ──    (prompt index, samples queued) per finished prompt
    drain_metrics() ◄── metrics (mp.Queue) ──── per group, and every metrics_interval_s from _poll_server
    get() checks health ◄── heartbeat, failed + traceback ── _heartbeat, _child_main
    stop() ── stop ──► the loop returns; close(); join → terminate → kill

Reading order: Channels → TurnContext → AsyncRolloutLoop (hooks, then the machinery). This file is what
runs inside the rollout process; the prompts it walks through (epochs, resume, no dataset) come from
rollout_prompts.py, and scoring a finished group (reward sources, advantages, samples, the group's
metrics) is rollout_scoring.py. The records (Rollout, TurnRecord, RolloutGroup, RolloutSample) and
how a rollout's turns become training samples (reconcile and fork, with a worked example) are in
rollout_samples.py; the trainer's side of the boundary (RolloutWorker, the spawn and its checks) is
rollout_worker.py.

Departures from the spec, and why:
- Admission by staleness. TRL generates whenever a slot is free and drops stale samples at the trainer;
  here a group is admitted only if its samples can be consumed before they go stale, so nothing is
  generated only to be dropped. The trainer consumes samples in queue order, R per model version
  (R is measured by the parent from get() calls between set_model_version() calls; before that
  R = per_device_train_batch_size × gradient_accumulation_steps × num_processes × weight_sync_steps).
  Sample number k (counted from the start) is consumed under version v + ⌊(k − C_v)/R⌋, where C_v is
  the count consumed when version v began, so a sample started now stays within max_staleness iff
  k < C_v + (max_staleness + 1)·R. The parent publishes C_v and R with each version; the child admits
  a group iff  queued + yield·(pending rollouts + num_generations) ≤ C_v + (max_staleness + 1)·R,
  where yield is the measured samples per rollout (forks raise it, dropped groups lower it). One
  exception keeps a window smaller than a group from deadlocking: when nothing is pending, every
  queued sample is consumed and the trainer still lacks samples for this version's steps
  (consumed < C_v + R), a group is admitted anyway. Time spent waiting for admission is reported as
  rollout/backpressure_s: it is the rollout queue being full in the staleness sense.
- The inter-process primitives travel as one `Channels` record rather than six constructor arguments,
  and the loop takes `max_concurrent_rollouts` already resolved (the parent knows num_processes).
- max_completion_length counts the generated tokens of all turns (TRL does not enforce it across turns):
  generate_one leaves the budget in the rollout's TurnContext, where generate_one_turn(prompt_ids), the
  spec's signature, reads it (so an override with that signature works with the default generate_one).
- A rollout's requests name the policy version it started under: with `lora_name` (LoRA adapter sync),
  version N > 0 is the adapter `<lora_name>-v<N>`, version 0 the base model (the adapter starts at
  zero); a rollout that spans a sync finishes under its start version. The trainer keeps those loaded.
- A rollout that raises (a 4xx, a malformed reply, 5xx retries exhausted, a tool loop bug) drops its
  group with a logged error; the process stops only once rollouts of FAILED_GROUPS_TO_STOP groups have
  failed in a row (counted by group, so that one bad prompt with num_generations ≥ 8 does not stop the
  run), or at once when a server stops answering (rollout_servers.py).
- Rewards and `compute_advantages` follow the spec; the default advantage is (r − mean)/(std + 1e-4)
  over the scored rollouts (population std, the same as reward_group_std).
- Environments are created one per rollout and `reset(**row)` gets the dataset row (TRL's contract).
  Without a dataset (spec: only with an environment_factory and max_steps > 0, checked at start) each
  prompt is one user message holding what reset() returns; reward_funcs may then be empty.
- Metric kinds: every metric named `*_total` (rollout/vllm_retry_total, rollout/vllm_preemptions_total,
  tools/unknown_name_total, tools/<name>/call_total, tools/<name>/failure_total) is a running total since
  the rollout process started: report the latest value. `rollout/backpressure_s` and
  `rollout/score_block_s` are emitted every metrics_interval_s as the seconds since the last emission
  (sum them over a logging window); every other metric is one observation to average (or max/min as
  named). Per-group metrics are averaged within the group before they are sent.
"""
import asyncio
import contextvars
import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import numpy as np

from rollout_prompts import check_prompt_source, prompt_stream
from rollout_samples import (Rollout, RolloutGroup, RolloutSample, TurnRecord, parse_completion, parse_generate,
                             reconcile)
from rollout_scoring import score_group
from rollout_servers import Replica, connect, make_replicas, pick
from rollout_tools import (ToolCall, environment_reward, environment_tools, parse_turn, run_tool_calls,
                           start_environment, tool_call_format)
from vllm_client import VLLMError, server_urls

log = logging.getLogger(__name__)

FAILED_GROUPS_TO_STOP = 4          # failed rollouts in a row from this many groups stop the process
WAKE_S = 0.05                      # the generate loop re-checks shared values at least this often


# ── inter-process channels ───────────────────────────────────────────────────────────────────


@dataclass
class Channels:
    """Everything the parent and the child share (all from one spawn context)."""
    rollout_buffer: Any     # Queue: RolloutSample child → parent; None once the prompts run out
    metrics: Any            # Queue: metric dicts child → parent (dropped when full); None after the last
    progress: Any           # Queue: (prompt_index, samples queued) for every finished prompt
    exception_info: Any     # Queue: (type name, message, traceback) of the child's failure
    model_version: Any      # Value('q'), written by the parent after each weight sync
    version_start: Any      # Value('q'), samples consumed when the current version began (C_v)
    rate: Any               # Value('d'), samples the trainer consumes per version (R)
    consumed: Any           # Value('q'), samples the parent has handed to the trainer
    heartbeat: Any          # Value('d'), time.time() of the child's last beat
    stop: Any               # Event parent → child
    ready: Any              # Event child → parent: connected and set up
    failed: Any             # Event child → parent: exception_info holds the reason


@dataclass
class TurnContext:
    """Where the current rollout's requests go (its task's context, so an override of generate_one_turn
    with the spec's signature needs no extra argument): the group's replica, the adapter of the policy
    version the rollout started under, and the generated-token budget left (None = max_completion_length)."""
    replica: Replica
    model: str
    budget: int | None = None


_TURN: contextvars.ContextVar[TurnContext] = contextvars.ContextVar("rollout_turn")


# ── the loop ─────────────────────────────────────────────────────────────────────────────────


class AsyncRolloutLoop:
    """Generates and scores rollouts inside the spawned rollout process (spec: AsyncRolloutLoop).

    Subclass it and override a hook; set the subclass as the trainer's `loop_cls` (it must be defined
    at module level: the child imports it). Hooks read `self.config` and `self.tokenizer`:

        filter_prompt(row_index, row, epoch)   once per prompt          accept every prompt
        generate_one(prompt, tools, group_id)  once per rollout         the multi-turn tool loop
        generate_one_turn(prompt_ids)          once per sampling request one request with the config's sampling
        compute_advantages(group)              once per scored group    rewards standardised in the group
        setup(), close()                       when the loop starts/stops  nothing
    """
    metrics_interval_s = 2.0  # seconds between /metrics polls and periodic metric emissions
    vllm_max_retries = 8      # retries of a failed request before it fails (vllm_client's policy)

    def __init__(self, config, model_name: str | None, dataset, reward_funcs: list[Callable] | None, processing_class,
                 eos_token_ids: list[int], channels: Channels, max_concurrent_rollouts: int,
                 tools: list[Callable] | None = None,
                 environment_factory: Callable | dict[str, Callable] | None = None,
                 score_queue_maxsize: int = 16, lora_name: str | None = None, dataset_start_index: int = 0):
        check_prompt_source(dataset, environment_factory, config.max_steps)
        self.config, self.model_name, self.dataset, self.lora_name = config, model_name, dataset, lora_name
        self.reward_funcs = list(reward_funcs or [])  # none: an environment or Rollout.reward scores
        self.tokenizer = processing_class
        self.eos_token_ids = list(eos_token_ids)
        self.channels, self.tools, self.environment_factory = channels, list(tools or []), environment_factory
        self.dataset_start_index = dataset_start_index
        self.replicas = make_replicas(server_urls(config), max_concurrent_rollouts, config.vllm_server_timeout,
                                      self.vllm_max_retries)
        self.num_top = config.num_sampler_logprobs if config.score_centering else None
        self.tool_pool = ThreadPoolExecutor(max_concurrent_rollouts, thread_name_prefix="rollout-tool")
        self.tool_format = tool_call_format(processing_class)
        self.score_queue: asyncio.Queue = asyncio.Queue(score_queue_maxsize)
        self.max_model_len = 0      # the smallest over the replicas
        self.pending_rollouts = 0   # rollouts of admitted groups not yet scored
        self.queued = 0             # samples put on rollout_buffer
        self.rollouts_scored = 0
        self.failures_in_a_row = 0  # rollouts failed since the last success
        self.failed_groups_in_a_row = 0  # the groups they belong to
        self.fatal: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        self.wake = asyncio.Event()
        self.since_emit = {"rollout/backpressure_s": 0.0, "rollout/score_block_s": 0.0, "generated_tokens": 0}
        self.totals: dict[str, float] = {}  # the tools/*_total counters since the process started
        self.warned_tool_format = False

    # ── hooks ──

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """True to generate num_generations rollouts for the prompt, False to skip it this epoch."""
        return True

    async def generate_one(self, prompt, tools: list[Callable], group_id: int = 0) -> Rollout:
        """One rollout: render → sample → run the tool calls → repeat until no call, the iteration limit,
        the generated-token budget (max_completion_length across turns) or the context is used up."""
        config, context = self.config, self._turn_context()
        if isinstance(prompt, str):  # a standard (plain text) prompt: one turn, no chat template
            if tools:
                raise ValueError("tools and environments need conversational prompts (lists of messages)")
            turn = await self.generate_one_turn(self.tokenizer(prompt)["input_ids"])
            return Rollout(self.tokenizer.decode(turn.output_ids, skip_special_tokens=True), turn.output_ids, [turn])
        by_name = {tool.__name__: tool for tool in tools}
        if by_name and self.tool_format is None and not self.warned_tool_format:
            self.warned_tool_format = True
            log.warning("tools are given but the tokenizer neither defines a response_template nor writes "
                        "<tool_call> blocks in its chat template: tool calls are parsed as Qwen <tool_call> "
                        "blocks, which this model may never write")
        messages, completion, completion_ids, turns = list(prompt), [], [], []
        calls: list[ToolCall] = []
        exhausted = False
        while (budget := config.max_completion_length - len(completion_ids)) > 0:
            prompt_ids = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=True,
                **(config.chat_template_kwargs or {}))["input_ids"]
            if len(prompt_ids) >= self.max_model_len:
                break
            context.budget = budget  # generate_one_turn reads it from the rollout's context
            turn = await self.generate_one_turn(prompt_ids)
            turns.append(turn)
            completion_ids += turn.output_ids
            text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
            content, requested = (parse_turn(self.tokenizer, self.tool_format, text, prompt_ids, tools) if by_name
                                  else (text, []))
            message = {"role": "assistant", "content": content}
            if requested:
                message["tool_calls"] = [{"type": "function", "function": c} for c in requested if "error" not in c]
            messages.append(message)
            completion.append(message)
            ended = bool(turn.output_ids) and turn.output_ids[-1] in self.eos_token_ids
            if not requested or not ended:
                break
            iteration = len(turns) - 1
            if config.max_tool_calling_iterations is not None and iteration >= config.max_tool_calling_iterations:
                exhausted = True
                break
            results, records = await run_tool_calls(requested, by_name, self.tool_pool, turn_index=iteration)
            calls += records
            messages += results
            completion += results
        return Rollout(completion, completion_ids, turns, tool_call_count=len(calls),
                       tool_failure_count=sum(c.failed for c in calls), tool_calls=calls, loop_exhausted=exhausted)

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's sampling settings, to the rollout's replica and adapter
        (TurnContext); max_tokens is the rollout's budget left (max_completion_length across turns), capped
        by the context left (max_model_len − prompt)."""
        config, context = self.config, self._turn_context()
        client, model, use_generate = context.replica.client, context.model, context.replica.use_generate
        max_tokens = min(context.budget or config.max_completion_length, self.max_model_len - len(prompt_ids))
        params = {"max_tokens": max_tokens, "temperature": config.temperature, "top_p": config.top_p,
                  "repetition_penalty": config.repetition_penalty, "stop_token_ids": self.eos_token_ids,
                  "logprobs": self.num_top or 0}
        if config.top_k > 0:
            params["top_k"] = config.top_k
        if config.min_p is not None:
            params["min_p"] = config.min_p
        if use_generate:
            endpoint = "/inference/v1/generate"
            reply = await client.agenerate({"model": model, "token_ids": list(prompt_ids), "sampling_params": params})
        else:
            endpoint = "/v1/completions"
            reply = await client.acompletions({"model": model, "prompt": list(prompt_ids), **params,
                                               "return_token_ids": True, "return_tokens_as_token_ids": True})
        try:
            turn = (parse_generate if use_generate else parse_completion)(prompt_ids, reply, self.num_top)
            if len(turn.output_log_probs) != len(turn.output_ids) or len(turn.output_ids) > max_tokens:
                raise ValueError(f"{len(turn.output_ids)} tokens, {len(turn.output_log_probs)} log-probs, "
                                 f"max_tokens {max_tokens}")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise VLLMError(f"malformed reply ({type(e).__name__}: {e}): {str(reply)[:300]}",
                            client.base_url + endpoint) from e
        return turn

    def _turn_context(self) -> TurnContext:
        """The running rollout's TurnContext; outside one (a hook called directly), the first replica and
        the base model, set for the caller's context."""
        context = _TURN.get(None)
        if context is None:
            context = TurnContext(self.replicas[0], self.model_name)
            _TURN.set(context)
        return context

    def adapter_name(self, version: int) -> str:
        """The model a rollout started under policy `version` requests: the trainer's LoRA adapter of that
        version (`<lora_name>-v<version>`), or the base model before the first sync and without LoRA."""
        return self.model_name if self.lora_name is None or version == 0 else f"{self.lora_name}-v{version}"

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards standardised within the group; NaN rewards get 0 and are
        left out of the mean and std."""
        rewards = group.rewards
        scored = ~np.isnan(rewards)
        advantages = np.zeros(len(rewards))
        if scored.any():
            r = rewards[scored]
            advantages[scored] = (r - r.mean()) / (r.std() + 1e-4)
        return advantages

    async def setup(self) -> None:
        """Create what the other hooks need (runs on the loop's event loop before the first prompt)."""

    async def close(self) -> None:
        """Release what setup() created (runs when the loop stops, also after a failure)."""

    # ── running ──

    @property
    def model_version(self) -> int:
        return self.channels.model_version.value

    async def run(self) -> None:
        """Connect, set up, then generate and score until the parent says stop (or something fails)."""
        beat = asyncio.create_task(self._heartbeat())
        workers: list[asyncio.Task] = []
        try:
            await self._connect()
            await self.setup()
            self.channels.ready.set()
            workers = [asyncio.create_task(c) for c in (self._generate_loop(), self._score_loop(), self._poll_server())]
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
            await asyncio.gather(*running, return_exceptions=True)  # none still uses a client we close below
            self.channels.rollout_buffer.cancel_join_thread()  # stopping: unread samples may be lost
            self.channels.metrics.cancel_join_thread()
            try:
                await self.close()
            finally:
                for replica in self.replicas:
                    await replica.client.aclose()
                self.tool_pool.shutdown(wait=False, cancel_futures=True)

    async def _connect(self) -> None:
        """Check every replica (flags the config needs, one model) and start each cap from its KV size."""
        served = [await connect(r, self.config, self.num_top, self.eos_token_ids[0]) for r in self.replicas]
        if len(set(served)) > 1:
            raise ValueError(f"the vLLM replicas serve different models {dict(zip(server_urls(self.config), served))}"
                             ": every URL in vllm_server_base_url must serve the same model")
        self.model_name = self.model_name or served[0]
        self.max_model_len = min(r.max_model_len for r in self.replicas)

    async def _heartbeat(self) -> None:
        while True:
            self.channels.heartbeat.value = time.time()
            await asyncio.sleep(0.5)

    async def _wait_for_stop(self) -> None:
        while not self.channels.stop.is_set():
            await asyncio.sleep(0.1)

    async def _wait_until(self, ready: Callable[[], bool], metric: str | None = None) -> None:
        """Sleep until ready() holds. The time waited is added to since_emit[metric] as it passes, so a long
        block shows in every emission, not only once it ends. Raises a rollout task's fatal error."""
        last = time.monotonic()
        while True:
            if self.fatal is not None:
                raise self.fatal
            if ready():
                return
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), WAKE_S)
            except asyncio.TimeoutError:
                pass
            if metric is not None:
                now = time.monotonic()
                self.since_emit[metric] += now - last
                last = now

    def _admissible(self) -> bool:
        """Staleness admission (module docstring): may a new group start now?"""
        G, ch = self.config.num_generations, self.channels
        start, rate, consumed = ch.version_start.value, ch.rate.value, ch.consumed.value
        expected_yield = (self.queued + G) / (self.rollouts_scored + G)  # prior: one sample per rollout
        if self.queued + expected_yield * (self.pending_rollouts + G) <= start + (self.config.max_staleness + 1) * rate:
            return True
        # else the trainer would wait forever
        return self.pending_rollouts == 0 and self.queued <= consumed < start + rate

    async def _generate_loop(self) -> None:
        config, G = self.config, self.config.num_generations
        group_id, epoch, accepted, whole = 0, None, 0, False
        for prompt_index, row_epoch, row_index, row in prompt_stream(
                self.dataset, self.dataset_start_index, config.num_train_epochs, config.max_steps):
            if row_epoch != epoch:
                self._check_epoch(epoch, accepted, whole)
                epoch, accepted, whole = row_epoch, 0, row_index == 0  # a resume may start mid-epoch
            if not self.filter_prompt(row_index, row, row_epoch):
                self.channels.progress.put((prompt_index, 0))
                continue
            accepted += 1
            await self._wait_until(lambda: not self.score_queue.full(), "rollout/score_block_s")
            await self._wait_until(self._admissible, "rollout/backpressure_s")
            replica = pick(self.replicas)  # every rollout of the group: its prompt stays in one prefix cache
            group = _PendingGroup(group_id, row_index, prompt_index, row, G, replica)
            group_id += 1
            self.pending_rollouts += G
            replica.assigned += G
            for i in range(G):
                await self._wait_until(lambda: replica.inflight < replica.cap.cap)
                if i == 0:
                    group.model_version = self.model_version  # the version when the group's first rollout starts
                replica.inflight += 1
                task = asyncio.create_task(self._rollout(group, i))
                self.tasks.add(task)
                task.add_done_callback(self._rollout_ended)
        self._check_epoch(epoch, accepted, whole)
        await self._wait_until(lambda: not self.tasks)
        await self.score_queue.put(None)

    def _check_epoch(self, epoch: int | None, accepted: int, whole: bool) -> None:
        """Spec: an epoch whose prompts filter_prompt all rejected raises. An epoch the stream entered
        mid-way (a resume) is not judged: its accepted prompts may lie before the resume point."""
        if epoch is not None and whole and accepted == 0:
            raise RuntimeError(f"filter_prompt rejected every prompt of epoch {epoch}, so no batch can reach the "
                               "trainer; loosen the filter")

    def _rollout_ended(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fatal = task.exception()
        self.wake.set()

    async def _rollout(self, group: "_PendingGroup", i: int) -> None:
        """Run one rollout of a group (in its own task); hand the group to scoring when it is complete."""
        start, generating, replica = time.monotonic(), True, group.replica
        _TURN.set(TurnContext(replica, self.adapter_name(self.model_version)))  # all its turns: this version
        try:
            prompt, env, stats, tools = group.row.get("prompt"), None, {}, list(self.tools)
            if self.environment_factory is not None:
                env, prompt, stats["env/reset_s"] = await start_environment(self.environment_factory, group.row,
                                                                            self.tool_pool)
                tools += environment_tools(env)
            rollout = await self.generate_one(prompt, tools, group.group_id)
            generating = False
            replica.inflight -= 1
            replica.assigned -= 1
            replica.cap.rollout_done(replica.inflight)
            env_reward = None
            if env is not None:
                env_reward, stats["env/reward_s"] = await environment_reward(env, self.tool_pool)
            sequences, drifts = reconcile(rollout.turns)
            stats |= {"duration_s": time.monotonic() - start, "drifts": drifts}
            group.slots[i] = (prompt, rollout, sequences, env_reward, stats)
            self.since_emit["generated_tokens"] += len(rollout.completion_ids)
            self.failures_in_a_row = self.failed_groups_in_a_row = 0
        except Exception as e:
            if generating:
                replica.inflight -= 1
                replica.assigned -= 1
            if isinstance(e, VLLMError) and isinstance(e.__cause__, httpx.TransportError):
                raise RuntimeError(f"the vLLM server at {replica.url} stopped answering ({e}); is it running? "
                                   "Restart it, or remove it from vllm_server_base_url") from e
            self.failed_groups_in_a_row += not group.failed
            group.failed = True
            self.failures_in_a_row += 1
            log.error("rollout %d of group %d (dataset row %d) failed; the group is dropped: %s: %s",
                      i, group.group_id, group.row_index, type(e).__name__, e, exc_info=True)
            if self.failed_groups_in_a_row >= FAILED_GROUPS_TO_STOP:
                raise RuntimeError(f"{self.failures_in_a_row} rollouts failed in a row, in "
                                   f"{self.failed_groups_in_a_row} groups; the last one: "
                                   f"{type(e).__name__}: {e}") from e
        finally:
            group.done.add(i)
            self.wake.set()
        if len(group.done) == group.size:
            if group.failed:
                self._finish_prompt(group.prompt_index, group.size, 0)
            else:
                await self.score_queue.put(group.build())

    def _finish_prompt(self, prompt_index: int, rollouts: int, samples: int) -> None:
        self.pending_rollouts -= rollouts
        self.rollouts_scored += rollouts
        self.queued += samples
        self.channels.progress.put((prompt_index, samples))
        self.wake.set()

    async def _score_loop(self) -> None:
        while (group := await self.score_queue.get()) is not None:
            waited = time.monotonic() - group.queued_at
            start = time.monotonic()
            samples, metrics = await self._score_group(group)
            metrics |= {"rollout/score_s": time.monotonic() - start, "rollout/score_wait_s": waited}
            for sample in samples:
                sample.enqueued_at = time.time()
                await self._put(sample)
            self._finish_prompt(group.prompt_index, len(group.rollouts), len(samples))
            self._emit(metrics)
        await self._put(None, self.channels.metrics)  # end markers: metrics first, so the parent can wait for it
        await self._put(None)

    async def _put(self, item: RolloutSample | None, channel=None) -> None:
        """Put on the rollout queue (or `channel`) without blocking the event loop; a full queue is backpressure."""
        channel = channel or self.channels.rollout_buffer
        start = time.monotonic()
        while True:
            try:
                return channel.put_nowait(item)
            except queue.Full:
                await asyncio.sleep(WAKE_S)
                self.since_emit["rollout/backpressure_s"] += time.monotonic() - start
                start = time.monotonic()

    async def _score_group(self, group: RolloutGroup) -> tuple[list[RolloutSample], dict[str, float]]:
        """score_group (rollout_scoring.py), then the group's tools/*_total counts become running totals."""
        samples, metrics = await score_group(group, self.reward_funcs, self.compute_advantages, self.eos_token_ids,
                                             self.num_top)
        for name in [n for n in metrics if n.endswith("_total")]:
            self.totals[name] = metrics[name] = self.totals.get(name, 0) + metrics[name]
        return samples, metrics

    async def _poll_server(self) -> None:
        """Every metrics_interval_s: read each replica's /metrics, move its cap, emit the periodic metrics
        (KV usage: the max over replicas; requests, caps and counters: summed)."""
        last_time = time.monotonic()
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            polled = [r for r in self.replicas if r.cap.adaptive]
            await asyncio.gather(*(r.poll() for r in polled))
            metrics: dict[str, float] = {}
            if polled:
                metrics |= {"rollout/kv_cache_usage": max(r.kv_usage for r in polled),
                            "rollout/vllm_queued_requests": sum(r.waiting for r in polled),
                            "rollout/vllm_running_requests": sum(r.running for r in polled),
                            "rollout/vllm_preemptions_total": sum(r.preemptions for r in polled)}
            now = time.monotonic()
            metrics |= {"rollout/concurrency": sum(r.inflight for r in self.replicas),
                        "rollout/concurrency_cap": sum(r.cap.cap for r in self.replicas),
                        "rollout/score_queue_size": self.score_queue.qsize(),
                        "rollout/vllm_retry_total": sum(r.client.retry_total for r in self.replicas),
                        "rollout/generated_tok_s": self.since_emit["generated_tokens"] / (now - last_time),
                        "rollout/backpressure_s": self.since_emit["rollout/backpressure_s"],
                        "rollout/score_block_s": self.since_emit["rollout/score_block_s"]}
            last_time = now
            self.since_emit = dict.fromkeys(self.since_emit, 0)
            self._emit(metrics)
            self.wake.set()

    def _emit(self, metrics: dict[str, float]) -> None:
        try:
            self.channels.metrics.put_nowait(metrics)
        except queue.Full:
            pass  # the trainer is not draining metrics: losing some beats blocking generation


@dataclass(eq=False)
class _PendingGroup:
    """A group while its rollouts run: slots filled in any order, built into a RolloutGroup when done."""
    group_id: int
    row_index: int
    prompt_index: int
    row: dict
    size: int
    replica: Replica
    model_version: int = 0
    done: set[int] = field(default_factory=set)
    failed: bool = False
    slots: list[tuple | None] = field(init=False)  # per rollout: (prompt, rollout, sequences, env reward, stats)

    def __post_init__(self):
        self.slots = [None] * self.size

    def build(self) -> RolloutGroup:
        prompts, rollouts, sequences, env_rewards, stats = (list(column) for column in zip(*self.slots))
        reward_kwargs = {k: [v] * self.size for k, v in self.row.items() if k != "prompt"}
        return RolloutGroup(
            prompts=prompts, reward_kwargs=reward_kwargs, completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts], completions_sequences=sequences,
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts], model_version=self.model_version,
            group_id=self.group_id, row_index=self.row_index, env_rewards=env_rewards,
            rollout_rewards=[r.reward for r in rollouts], queued_at=time.monotonic(), prompt_index=self.prompt_index,
            rollouts=rollouts, stats=stats)
