"""The trainer's side of the process line: its handle on the rollout process (spec: 概要
(Overview): the rollout worker, a separate process; チェックポイントと再開 (Checkpoints and
resuming): rollout_state.json).

The rest of rollout/ is what runs inside the spawned process; this file runs in the trainer (rank
0) to start it, feed it the policy version, take its samples and watch its health. The child never
imports it.

    RolloutWorker(config, dataset, reward_funcs, tokenizer, tools=..., loop_cls=...)
      .start()   pickle checks (the spec's TypeError names the object and the fix) → spawn
                 loop.child_main (CUDA_VISIBLE_DEVICES="", torchrun's variables removed, the main
                 script run again only if what the child is handed needs it: check_main_guard) →
                 wait for `ready`, or raise the child's traceback
      .get()     the next RolloutSample; while waiting, a `failed` child raises RuntimeError chained
                 with its traceback, a silent heartbeat (rollout_worker_timeout) too; an empty
                 queue means a starved trainer (staleness.Window.starved)
      .set_model_version(v)   after each weight sync: the version and the staleness window
                 (staleness.Window.new_version publishes C_v and R); .dropped_stale(): Window.stale
      .evaluate(step)         evaluate the served policy on eval_dataset (loop._evaluate), beside
                 training's generation; .evaluations() the eval/* lines done since the last
                 call (wait=True: all asked for, at the end of a run)
      .resume_index()         first prompt not fully handed out (prompts.ResumeIndex)
      .resume_state(held)     rollout_state.json: that index, less the held samples, and the
                 samples of later prompts trained already; resumed with it (trained=), get()
                 drops what the checkpoint trained, so every sample is trained exactly once
      .drain_metrics(), .qsize(), .stop()   stop: event → join (STOP_GRACE_S) → terminate → kill
    The child exits when the trainer dies without a stop (loop.py, _wait_for_stop).

Departures from the spec:
- The six inter-process primitives travel as one `loop.Channels` record, not six.
- The trainer also publishes C_v and R (staleness.py): the child admits groups by staleness.
- A prompt partly or wholly trained past the resume index is generated again after a resume, and
  get() drops the samples of it the checkpoint already trained (ResumeIndex.handed_out).
"""
import ast
import logging
import math
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
import types
from typing import Callable

from rollout.loop import AsyncRolloutLoop, Channels, child_main
from rollout.prompts import ResumeIndex, check_eval_source, first_prompt_index
from rollout.samples import RolloutSample
from rollout.tool_calls import check_tools
from rollout.staleness import Window, prior_rate

STOP_GRACE_S = 1.0   # stop(): the wait for a clean exit (~0.5-2 s here); then SIGTERM


class RolloutProcessError(Exception):
    """The rollout process's traceback text, chained under the RuntimeError the trainer sees."""


class _FindMain(pickle.Pickler):
    """Pickles, noting the first object the pickle names in __main__ (a function or class, an
    instance's class): one that unpickles only where the main script has run."""
    found: str | None = None

    def reducer_override(self, obj):
        if self.found is None and getattr(obj, "__module__", None) == "__main__":
            self.found = getattr(obj, "__qualname__", None) or type(obj).__qualname__
        return NotImplemented                   # pickled as usual


def check_picklable(obj, what: str) -> str | None:
    """The first object `obj` names in __main__ (None if none: check_main_guard), or the spec's
    TypeError for anything that cannot cross to the spawned process."""
    with open(os.devnull, "wb") as sink:
        pickler = _FindMain(sink)
        try:
            pickler.dump(obj)
        except Exception as e:
            name = getattr(obj, "__qualname__", None) or type(obj).__name__
            raise TypeError(f"{what} {name} cannot be pickled for the rollout process "
                            f"({type(e).__name__}: {e}); the rollout process is spawned, so use a "
                            "module-level function, a functools.partial of one, or a callable "
                            "class instance instead of a lambda or a closure") from e
    return pickler.found


def spawn(process, needs_main: bool) -> None:
    """Start `process`, from a blank main module unless what it is handed `needs_main`
    (check_main_guard: spawn prepares the child from sys.modules["__main__"])."""
    main = sys.modules["__main__"]
    if not needs_main:
        sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        process.start()
    finally:
        sys.modules["__main__"] = main


class RolloutWorker:
    """The trainer's handle on the rollout process (rank 0 only; its calls: the module
    docstring)."""

    def __init__(self, config, dataset, reward_funcs: Callable | list[Callable] | None,
                 processing_class, *, tools: list[Callable] | None = None, environment_factory=None,
                 loop_cls: type = AsyncRolloutLoop, model_name: str | None = None,
                 eos_token_ids: list[int] | None = None, num_processes: int = 1,
                 dataset_start_index: int = 0, model_version: int = 0,
                 lora_name: str | None = None, trained: dict[int, int] | None = None,
                 eval_dataset=None):
        check_eval_source(config, dataset, eval_dataset)
        for which, data in (("training", dataset), ("eval", eval_dataset)):
            columns = getattr(data, "column_names", None)
            if columns is not None and "prompt" not in columns:
                raise ValueError(f"the {which} dataset needs a 'prompt' column (it has "
                                 f"{columns}); rename the column that holds the prompts")
        if reward_funcs is None:
            reward_funcs = []
        elif not isinstance(reward_funcs, list):
            reward_funcs = [reward_funcs]
        if eos_token_ids is None:
            eos_token_ids = [processing_class.eos_token_id]
        self.config = config
        self.loop_cls = loop_cls
        self.bound = config.default_max_concurrent_rollouts(num_processes)
        self.kwargs = dict(config=config, model_name=model_name, dataset=dataset,
                           reward_funcs=reward_funcs, processing_class=processing_class,
                           eos_token_ids=eos_token_ids, tools=tools,
                           environment_factory=environment_factory,
                           max_concurrent_rollouts=self.bound,
                           dataset_start_index=dataset_start_index, lora_name=lora_name,
                           eval_dataset=eval_dataset,
                           max_eval_rollouts=config.per_device_eval_batch_size * num_processes)
        self.initial_version = model_version
        self.window = Window(prior_rate(config, num_processes), anchor_version=model_version)
        self.consumed = 0                 # samples handed to the trainer
        start = first_prompt_index(dataset, dataset_start_index)
        trained = trained if start == dataset_start_index else None   # a stream starts afresh
        self.resume = ResumeIndex(start, trained=dict(trained or {}))
        self.finished = False
        self.metrics_ended = False        # the child's end-of-metrics marker was read
        self.received: list[dict[str, float]] = []  # metrics read while waiting for the end marker
        self.evals_asked = self.evals_done = 0   # evaluations asked for, and their lines read
        self.process = None
        self.channels: Channels | None = None
        self.prompts_per_epoch = len(dataset) if hasattr(dataset, "__len__") else None

    def start(self, ready_timeout: float = 300.0) -> None:
        """Check picklability, spawn the process, and wait until it is connected and set up; say
        the rule for prompts too long for the servers (AsyncRolloutLoop._too_long)."""
        for f in self.kwargs["reward_funcs"]:
            check_picklable(f, "reward function")
        check_tools(self.kwargs["tools"] or [])
        factories = self.kwargs["environment_factory"]
        if not isinstance(factories, dict):
            factories = {"": factories} if factories else {}
        for f in factories.values():
            check_picklable(f, "environment_factory")
        in_main = [check_picklable(self.loop_cls, "loop_cls"),
                   check_picklable(self.kwargs, "rollout argument")]  # dataset, tokenizer, config
        ctx = mp.get_context("spawn")
        self.channels = Channels(
            rollout_buffer=ctx.Queue(self.config.queue_maxsize),
            metrics=ctx.Queue(4096),
            progress=ctx.Queue(),
            exception_info=ctx.Queue(1),
            model_version=ctx.Value("q", self.initial_version, lock=True),
            version_start=ctx.Value("q", self.window.version_start, lock=False),
            rate=ctx.Value("d", self.window.rate, lock=False),
            consumed=ctx.Value("q", self.consumed, lock=False),
            heartbeat=ctx.Value("d", time.time(), lock=False),
            stop=ctx.Event(), ready=ctx.Event(), failed=ctx.Event(),
            eval_requests=ctx.Queue(), evals=ctx.Queue())
        process = ctx.Process(target=child_main, name="rollout", daemon=True,
                              args=(self.loop_cls, self.kwargs, self.channels))
        spawn(process, any(in_main))
        self.process = process          # started (a failed start leaves stop() nothing to join)
        deadline = time.monotonic() + ready_timeout
        try:
            while not self.channels.ready.wait(0.1):
                self._raise_if_dead()
                if time.monotonic() > deadline:
                    raise TimeoutError("the rollout process was not ready within "
                                       f"{ready_timeout:g}s")
        except BaseException:
            self.stop()
            raise
        logging.getLogger(__name__).info(
            "a prompt too long for max_model_len (the servers' context) is skipped, logged with "
            "its dataset row and counted in rollout/prompts_too_long_total")

    def get(self, timeout: float | None = None) -> RolloutSample | None:
        """The next sample (queue order); None once every prompt is done; queue.Empty after
        `timeout` s. While waiting, a failed or hung rollout process raises RuntimeError. After a
        resume, a sample the checkpoint already trained (resume_state) is skipped."""
        if self.finished:
            return None
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while True:
            sample = self._next(deadline)
            if sample is None:
                self._receive_metrics_until_end()
                self.finished = True
                return None
            self.consumed += 1
            self.channels.consumed.value = self.consumed
            if self.resume.handed_out(sample.prompt_index):
                return sample

    def _next(self, deadline: float) -> RolloutSample | None:
        if self.channels.rollout_buffer.empty():
            self.window.starved(self.consumed)
            self.channels.rate.value = self.window.rate
        while True:
            wait_s = max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                return self.channels.rollout_buffer.get(timeout=wait_s)
            except queue.Empty:
                self.check_health()
                if time.monotonic() >= deadline:
                    raise

    def qsize(self) -> int:
        """Samples waiting in the rollout queue (sample/rollout_queue_size)."""
        return self.channels.rollout_buffer.qsize()

    def set_model_version(self, version: int) -> None:
        """Publish the policy version after a weight sync, and move the staleness window."""
        self.window.new_version(version, self.consumed)
        self.channels.rate.value = self.window.rate
        self.channels.version_start.value = self.window.version_start
        self.channels.model_version.value = version

    def dropped_stale(self) -> None:
        """The trainer dropped a sample it was handed as stale: admission's fault, not
        consumption (staleness.Window.stale)."""
        self.window.stale()
        self.channels.version_start.value = self.window.version_start

    def evaluate(self, step: int) -> None:
        """Ask the rollout process to evaluate the policy it serves now (after step `step`'s
        sync); its eval/* line comes back through evaluations()."""
        self.channels.eval_requests.put(step)
        self.evals_asked += 1

    def evaluations(self, wait: bool = False) -> list[dict[str, float]]:
        """The eval/* lines of the evaluations done since the last call (scoring.eval_metrics);
        `wait`: until every one asked for is done, the process's health checked meanwhile."""
        out = []
        while self.evals_done < self.evals_asked:
            try:
                out.append(self.channels.evals.get(timeout=1.0 if wait else 0))
                self.evals_done += 1
            except queue.Empty:
                if not wait:
                    break
                self.check_health()
        return out

    def drain_metrics(self) -> list[dict[str, float]]:
        """Metric dicts from the rollout process since the last drain (all of them once get()
        returned None)."""
        while True:
            try:
                self._keep(self.channels.metrics.get_nowait())
            except queue.Empty:
                out, self.received = self.received, []
                return out

    def _receive_metrics_until_end(self) -> None:
        """The child ends the metrics queue with None before it ends the samples, but two queues
        keep no order between them: wait for that marker, so a run's last group metrics are kept.
        A drain_metrics() may have read it already (then the wait would never end)."""
        while not self.metrics_ended:
            try:
                self._keep(self.channels.metrics.get(timeout=1.0))
            except queue.Empty:
                self.check_health()

    def _keep(self, metrics: dict[str, float] | None) -> None:
        """A metrics item read: a dict is kept for the next drain; None is the end marker."""
        if metrics is None:
            self.metrics_ended = True
        else:
            self.received.append(metrics)

    def resume_index(self) -> int:
        """The first prompt index whose samples have not all been handed out (dropped or filtered
        prompts count as handed out): what rollout_state.json saves for a resume."""
        while True:
            try:
                self.resume.announce(*self.channels.progress.get_nowait())
            except queue.Empty:
                return self.resume.value()

    def resume_state(self, held: list[int]) -> dict:
        """rollout_state.json's {"prompt_index", "trained"} (ResumeIndex.state); `held`: the prompt
        index of each sample handed out but not trained yet (the planner's open rows)."""
        self.resume_index()
        return self.resume.state(held)

    def check_health(self) -> None:
        """RuntimeError if the process failed (chained with its traceback), exited, or went
        silent."""
        self._raise_if_dead()
        silent = time.time() - self.channels.heartbeat.value
        if silent > self.config.rollout_worker_timeout:
            raise RuntimeError(f"the rollout process sent no heartbeat for {silent:.0f}s "
                               f"(rollout_worker_timeout={self.config.rollout_worker_timeout:g}); "
                               "it is hung")

    def _raise_if_dead(self) -> None:
        if self.channels.failed.is_set():
            name, message, text = self.channels.exception_info.get(timeout=5.0)
            raise RuntimeError(f"the rollout process failed: {name}: {message}"
                               ) from RolloutProcessError(text)
        if not self.process.is_alive():
            raise RuntimeError("the rollout process exited unexpectedly "
                               f"(exit code {self.process.exitcode})")

    def stop(self) -> None:
        """Ask the process to stop (the progress queue drained meanwhile: a child exits only once
        its queues are flushed); one still running after STOP_GRACE_S is terminated, then killed.
        It returns within ~2 s however long the run was, and nothing is left behind."""
        if self.process is None:
            return
        self.channels.stop.set()
        deadline = time.monotonic() + STOP_GRACE_S
        while self.process.is_alive() and time.monotonic() < deadline:
            self.resume_index()
            self.process.join(0.05)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(0.5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process = None


def check_main_guard(*handed) -> None:
    """The main-script hazard, and the one mechanism for it. A spawned process runs the parent's
    main script again (as __mp_main__) before it unpickles its arguments, so that what the script
    defines is found there. A script that calls the trainer outside `if __name__ == "__main__":`
    would then start a second trainer inside the rollout process; and under `python train.py` the
    child would import the whole trainer side (FSDP, checkpoints, the syncs) for nothing.

    The child needs the script only if what it is handed names __main__ (a reward function, tool,
    environment or loop_cls defined in the script: check_picklable finds it). Otherwise spawn()
    starts it from a blank main module, and the script is not run again, guarded or not: the
    spec's quickstart runs as written. train() calls this first, before any work, with everything
    it hands the rollout process: RuntimeError when that names __main__ and the trainer is called
    from the script's top level, at a line no such `if` holds (found on the call stack)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    for call in traceback.extract_stack():
        if (main_file and call.name == "<module>"
                and os.path.abspath(call.filename) == os.path.abspath(main_file)
                and not _under_main_guard(call.filename, call.lineno)):
            name = check_picklable(handed, "rollout argument")
            if name is not None:
                raise RuntimeError(
                    f"{call.filename}:{call.lineno} starts the trainer at the script's top "
                    f"level and hands the rollout process {name}, defined in the script. The "
                    "rollout process is spawned and imports this script again to find it, which "
                    "would start another trainer: put the training code under the guard\n\n"
                    "    if __name__ == \"__main__\":\n        trainer.train()\n\n"
                    f"or define {name} in a module the script imports.")
            return


def _under_main_guard(path: str, line: int) -> bool:
    """Whether `line` of the script lies in an `if __name__ == "__main__":` body."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return True                             # no source to read: nothing to say
    return any(isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
               and node.body[0].lineno <= line <= node.body[-1].end_lineno
               for node in ast.walk(tree))
