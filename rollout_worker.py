"""The trainer's handle on the rollout process (spec: 概要, the process boundary; チェックポイントと再開).

`rollout.py` is what runs inside the spawned rollout process; this file is what runs in the trainer
(rank 0) to start it, feed it the policy version, take its samples and watch its health:

    RolloutWorker(config, dataset, reward_funcs, tokenizer, tools=..., loop_cls=...)
      .start()   pickle check of reward functions, tools, environment factories and loop_cls (the spec's
                 TypeError names the object and the fix) → spawn _child_main (CUDA_VISIBLE_DEVICES="",
                 torchrun's variables removed) → wait for `ready`, or raise the child's traceback
      .get()     next RolloutSample from the rollout buffer; while waiting, a `failed` child raises
                 RuntimeError chained with its traceback, a silent heartbeat (rollout_worker_timeout) too
      .set_model_version(v)   after each weight sync: the version, and the staleness admission window
                 (C_v = samples consumed when v began, R = samples consumed per version; see rollout.py)
      .resume_index()         first prompt not fully handed out: what rollout_state.json stores
      .drain_metrics(), .qsize(), .stop()   stop: event → join → terminate → kill, nothing left behind

Departure from the spec: the spec's trainer hands the loop six inter-process primitives; here they
travel as one `rollout.Channels` record.
"""
import asyncio
import math
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Callable

from rollout import AsyncRolloutLoop, Channels
from rollout_samples import RolloutSample
from rollout_tools import check_tools

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")


class RolloutProcessError(Exception):
    """The rollout process's traceback text, chained under the RuntimeError the trainer sees."""


def check_picklable(obj, what: str) -> None:
    """The spec's TypeError for anything that cannot cross to the spawned process."""
    try:
        pickle.dumps(obj)
    except Exception as e:
        name = getattr(obj, "__qualname__", None) or type(obj).__name__
        raise TypeError(f"{what} {name} cannot be pickled for the rollout process ({type(e).__name__}: {e}); the "
                        "rollout process is spawned, so use a module-level function, a functools.partial of one, or "
                        "a callable class instance instead of a lambda or a closure") from e


def _child_main(loop_cls: type, kwargs: dict, channels: Channels) -> None:
    """Entry point of the spawned process: a CPU-only, non-distributed environment, then the loop."""
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


class RolloutWorker:
    """The trainer's handle on the rollout process (rank 0 only).

        worker = RolloutWorker(config, dataset, [toy.sum_reward], tokenizer, tools=[toy.add])
        worker.start()                      # TypeError before spawning if anything is unpicklable
        sample = worker.get(timeout=5.0)    # RolloutSample; None once every prompt is done
        worker.set_model_version(1)         # after each weight sync
        worker.drain_metrics()              # [{metric: value}, ...] since the last drain
        worker.resume_index()               # first prompt index not yet handed out (rollout_state.json)
        worker.stop()
    """

    def __init__(self, config, dataset, reward_funcs: Callable | list[Callable], processing_class, *,
                 tools: list[Callable] | None = None, environment_factory=None, loop_cls: type = AsyncRolloutLoop,
                 model_name: str | None = None, eos_token_ids: list[int] | None = None, num_processes: int = 1,
                 dataset_start_index: int = 0, model_version: int = 0, lora_name: str | None = None):
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(f"the training dataset needs a 'prompt' column (it has {columns}); rename the column "
                             "that holds the prompts")
        self.config, self.loop_cls = config, loop_cls
        reward_funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        eos = eos_token_ids if eos_token_ids is not None else [processing_class.eos_token_id]
        self.bound = config.default_max_concurrent_rollouts(num_processes)
        self.kwargs = dict(config=config, model_name=model_name, dataset=dataset, reward_funcs=reward_funcs,
                           processing_class=processing_class, eos_token_ids=eos, tools=tools,
                           environment_factory=environment_factory, max_concurrent_rollouts=self.bound,
                           dataset_start_index=dataset_start_index, lora_name=lora_name)
        # samples the trainer takes per model version, before it has been measured
        self.prior_rate = (config.per_device_train_batch_size * config.gradient_accumulation_steps * num_processes
                           * config.weight_sync_steps)
        self.anchor = (model_version, 0)  # (version, consumed) where the rate measurement starts
        self.initial_version = model_version
        self.consumed = 0
        self.left: dict[int, int] = {}    # prompt index → samples announced but not yet handed out
        self.announced: set[int] = set()
        self.next_unconsumed = dataset_start_index if hasattr(dataset, "__len__") else 0
        self.finished = False
        self.received: list[dict[str, float]] = []  # metrics read while waiting for the end marker
        self.process = None
        self.channels: Channels | None = None

    def start(self, ready_timeout: float = 300.0) -> None:
        """Check picklability, spawn the process, and wait until it is connected and set up."""
        for f in self.kwargs["reward_funcs"]:
            check_picklable(f, "reward function")
        check_tools(self.kwargs["tools"] or [])
        factories = self.kwargs["environment_factory"]
        for f in (factories.values() if isinstance(factories, dict) else [factories] if factories else []):
            check_picklable(f, "environment_factory")
        check_picklable(self.loop_cls, "loop_cls")
        check_picklable(self.kwargs, "rollout argument")  # the dataset, the tokenizer, the config
        ctx = mp.get_context("spawn")
        self.channels = Channels(
            rollout_buffer=ctx.Queue(self.config.queue_maxsize), metrics=ctx.Queue(4096), progress=ctx.Queue(),
            exception_info=ctx.Queue(1), model_version=ctx.Value("q", self.initial_version, lock=True),
            version_start=ctx.Value("q", 0, lock=False), rate=ctx.Value("d", self.prior_rate, lock=False),
            consumed=ctx.Value("q", 0, lock=False), heartbeat=ctx.Value("d", time.time(), lock=False),
            stop=ctx.Event(), ready=ctx.Event(), failed=ctx.Event())
        self.process = ctx.Process(target=_child_main, args=(self.loop_cls, self.kwargs, self.channels),
                                   name="rollout", daemon=True)
        self.process.start()
        deadline = time.monotonic() + ready_timeout
        try:
            while not self.channels.ready.wait(0.1):
                self._raise_if_dead()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the rollout process was not ready within {ready_timeout:g}s")
        except BaseException:
            self.stop()
            raise

    def get(self, timeout: float | None = None) -> RolloutSample | None:
        """The next sample (queue order); None once every prompt is done. queue.Empty after `timeout` s.
        While waiting, a failed or hung rollout process raises RuntimeError."""
        if self.finished:
            return None
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        if self.channels.rollout_buffer.empty():
            self._starved()
        while True:
            try:
                sample = self.channels.rollout_buffer.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                self.check_health()
                if time.monotonic() >= deadline:
                    raise
        if sample is None:
            self._receive_metrics_until_end()
            self.finished = True
            return None
        self.consumed += 1
        self.channels.consumed.value = self.consumed
        self.left[sample.prompt_index] = self.left.get(sample.prompt_index, 0) - 1
        return sample

    def _starved(self) -> None:
        """The trainer waits on an empty queue, so this version consumes more samples than the rate R
        assumed (token-budget rows take as many as fit): R > consumed − C_v. Raising R to that bound
        lets the rollout process admit the groups the trainer is waiting for.

        Worked example: G = 8, max_staleness = 4, prior R = 8, C_v = 0. Admission stops at 40 samples
        (5 × 8); the planner needs ~64 to close one micro-batch, so the trainer starves at consumed =
        40; R becomes 41, the window 5 × 41 = 205, and generation resumes."""
        version_start = self.channels.version_start.value
        self.channels.rate.value = max(self.channels.rate.value, self.consumed - version_start + 1)

    def qsize(self) -> int:
        """Samples waiting in the rollout queue (sample/rollout_queue_size)."""
        return self.channels.rollout_buffer.qsize()

    def set_model_version(self, version: int) -> None:
        """Publish the policy version after a weight sync, and move the staleness admission window."""
        if self.consumed == self.anchor[1]:
            self.anchor = (version, self.consumed)  # nothing consumed yet: measure from here
        anchor_version, anchor_consumed = self.anchor
        if version > anchor_version and self.consumed > anchor_consumed:
            self.channels.rate.value = (self.consumed - anchor_consumed) / (version - anchor_version)
        self.channels.version_start.value = self.consumed
        self.channels.model_version.value = version

    def drain_metrics(self) -> list[dict[str, float]]:
        """Metric dicts from the rollout process since the last drain (all of them once get() returned None)."""
        out, self.received = self.received, []
        while True:
            try:
                metrics = self.channels.metrics.get_nowait()
            except queue.Empty:
                return out
            if metrics is not None:
                out.append(metrics)

    def _receive_metrics_until_end(self) -> None:
        """The child ends the metrics queue with None before it ends the samples, but two queues keep no order
        between them: wait for that marker, so that a run's last group metrics are never missed."""
        while True:
            try:
                metrics = self.channels.metrics.get(timeout=1.0)
            except queue.Empty:
                self.check_health()
                continue
            if metrics is None:
                return
            self.received.append(metrics)

    def resume_index(self) -> int:
        """The first prompt index whose samples have not all been handed out (dropped or filtered
        prompts count as handed out): what rollout_state.json saves for a resume."""
        while True:
            try:
                index, samples = self.channels.progress.get_nowait()
            except queue.Empty:
                break
            self.announced.add(index)
            self.left[index] = self.left.get(index, 0) + samples
        while self.next_unconsumed in self.announced and self.left.get(self.next_unconsumed) == 0:
            self.announced.discard(self.next_unconsumed)
            self.left.pop(self.next_unconsumed)
            self.next_unconsumed += 1
        return self.next_unconsumed

    def check_health(self) -> None:
        """RuntimeError if the process failed (chained with its traceback), exited, or stopped beating."""
        self._raise_if_dead()
        silent = time.time() - self.channels.heartbeat.value
        if silent > self.config.rollout_worker_timeout:
            raise RuntimeError(f"the rollout process sent no heartbeat for {silent:.0f}s (rollout_worker_timeout="
                               f"{self.config.rollout_worker_timeout:g}); it is hung")

    def _raise_if_dead(self) -> None:
        if self.channels.failed.is_set():
            name, message, text = self.channels.exception_info.get(timeout=5.0)
            raise RuntimeError(f"the rollout process failed: {name}: {message}") from RolloutProcessError(text)
        if not self.process.is_alive():
            raise RuntimeError(f"the rollout process exited unexpectedly (exit code {self.process.exitcode})")

    def stop(self) -> None:
        """Ask the process to stop, then join → terminate → kill: nothing is left behind."""
        if self.process is None:
            return
        self.channels.stop.set()
        self.process.join(15)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process = None

    def __enter__(self) -> "RolloutWorker":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
