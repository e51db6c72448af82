"""rollout_worker.py: the trainer's handle on the rollout process: the spec's TypeError before
anything is spawned, a child that imports nothing of the trainer, failures and hangs of the child
reaching the trainer, nothing left behind."""
import functools
import os
import signal
import sys
import threading
import time
import types

import pytest
from datasets import Dataset

import rollout_helpers as h
import toy
from config import AsyncGRPOConfig
from rollout import AsyncRolloutLoop
from rollout_worker import RolloutProcessError, RolloutWorker, check_picklable
from train_helpers import ROOT, recorded_reward


class Scorer:
    def __call__(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)


def closure_reward():
    def closure(prompts, completions, **kwargs):
        return [0.0] * len(completions)
    return closure


def test_unpicklable_reward_functions_raise_the_specs_type_error():
    with pytest.raises(TypeError, match=r"reward function .*<lambda> cannot be pickled.*"
                                        r"module-level function, a functools.partial"):
        check_picklable(lambda prompts, completions, **kw: [0.0], "reward function")
    with pytest.raises(TypeError, match=r"closure"):
        check_picklable(closure_reward(), "reward function")
    check_picklable(functools.partial(h.solved_reward, solved=[True]), "reward function")
    check_picklable(Scorer(), "reward function")


def test_nothing_is_spawned_when_anything_is_unpicklable():
    class LocalLoop(AsyncRolloutLoop):
        pass

    for kwargs in ({"reward_funcs": [lambda p, c, **k: [0.0]]},
                   {"reward_funcs": [toy.sum_reward], "loop_cls": LocalLoop},
                   {"reward_funcs": [toy.sum_reward], "tools": [lambda a: a]}):
        worker = RolloutWorker(AsyncGRPOConfig(), toy.make_dataset(2), kwargs.pop("reward_funcs"),
                               toy.build_tokenizer(), **kwargs)
        with pytest.raises(TypeError):
            worker.start()
        assert worker.process is None


def fake_main(monkeypatch, script: str) -> types.ModuleType:
    """A main module for `script` in place of pytest's, as under `python <script>`."""
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(ROOT, script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def child_modules(reward) -> set[str]:
    """The modules the rollout process has imported by the time it builds its loop."""
    worker = RolloutWorker(AsyncGRPOConfig(), toy.make_dataset(2), [reward], toy.build_tokenizer(),
                           loop_cls=h.ModulesLoop)
    with pytest.raises(RuntimeError, match="the rollout process failed") as info:
        worker.start()
    return set(str(info.value).rpartition(": ")[2].split(","))


@pytest.mark.parametrize("script", ["train.py", "tests/two_rank_step.py"])
def test_the_rollout_process_imports_nothing_of_the_trainer(monkeypatch, script):
    """Issue 20: spawned from `python train.py` or a script that imports train, the child skips
    the script (spawn would run it again): no FSDP trainer, checkpoints, peft or local engine."""
    fake_main(monkeypatch, script)
    modules = child_modules(toy.exact_reward)
    assert {"rollout.loop", "toy", "transformers"} <= modules     # the loop, the reward, tokenizer
    leaked = {"train", "checkpoint", "weight_sync", "lora_sync", "metrics", "rollout_worker",
              "peft", "torch.distributed.fsdp", "local_vllm.engine"} & modules
    assert not leaked, leaked


def test_a_reward_defined_in_the_main_script_still_reaches_the_child(monkeypatch):
    """The pickles name __main__: the child runs the script again, so the reward unpickles."""
    main = fake_main(monkeypatch, "tests/train_helpers.py")        # it defines recorded_reward
    main.recorded_reward = types.FunctionType(recorded_reward.__code__, vars(main),
                                              "recorded_reward")
    assert "rollout_helpers" in child_modules(main.recorded_reward)   # the loop was built


def test_a_process_that_cannot_start_raises_its_own_error(monkeypatch):
    """spawn() failing (the OS refuses a process: a boundary we do not own) raises that error, and
    stop() afterwards, as train()'s finally calls it, does not replace it with another."""
    import multiprocessing.process

    def refuse(self):
        raise OSError(11, "Resource temporarily unavailable (fork refused)")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    worker = RolloutWorker(AsyncGRPOConfig(), toy.make_dataset(2), [toy.sum_reward],
                           toy.build_tokenizer())
    with pytest.raises(OSError, match="fork refused"):
        worker.start()
    worker.stop()                       # before the fix: AssertionError (join of an unstarted one)
    assert worker.process is None


def test_dataset_needs_a_prompt_column():
    with pytest.raises(ValueError, match="'prompt' column"):
        RolloutWorker(AsyncGRPOConfig(), Dataset.from_list([{"question": "1+1="}]), toy.sum_reward,
                      toy.build_tokenizer())


# ── failures of the child ────────────────────────────────────────────────────────────────────


def test_persistent_4xx_stops_the_process_with_its_traceback(small_kv_server, tokenizer):
    worker = RolloutWorker(h.config_for(small_kv_server, num_train_epochs=10), toy.make_dataset(8),
                           [h.rank_reward], tokenizer, model_name="no-such-model")
    with pytest.raises(RuntimeError, match="rollouts failed in a row") as info:
        h.run_worker(worker)
    assert isinstance(info.value.__cause__, RolloutProcessError)
    assert "HTTP 404" in str(info.value.__cause__) and "VLLMError" in str(info.value.__cause__)


def test_a_crashing_reward_function_reaches_the_trainer(small_kv_server, tokenizer):
    worker = RolloutWorker(h.config_for(small_kv_server), toy.make_dataset(2),
                           [h.exploding_reward], tokenizer)
    with pytest.raises(RuntimeError, match="reward exploded") as info:
        h.run_worker(worker)
    assert "exploding_reward" in str(info.value.__cause__)
    assert worker.process is None


def test_a_hung_process_is_detected_by_its_heartbeat(small_kv_server, tokenizer):
    worker = RolloutWorker(h.config_for(small_kv_server, rollout_worker_timeout=1.0),
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
    worker = RolloutWorker(h.config_for(small_kv_server, num_train_epochs=50), toy.make_dataset(4),
                           [h.rank_reward], tokenizer)
    try:
        worker.start()
        os.kill(worker.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            for _ in range(10_000):      # samples queued before the kill may still arrive first
                worker.get(timeout=10)
    finally:
        worker.stop()
    assert worker.process is None


def test_the_end_of_the_prompts_is_seen_after_a_drain_read_the_metrics_end_marker(
        small_kv_server, tokenizer):
    """A logging step's drain_metrics() between the child's two end markers takes the metrics one;
    get() must still return None (it waited for that marker forever: the hang after the last
    step)."""
    worker = RolloutWorker(h.config_for(small_kv_server), toy.make_dataset(2), [h.rank_reward],
                           tokenizer)
    try:
        worker.start()
        samples = [worker.get(timeout=60) for _ in range(4)]           # 2 prompts × 2 generations
        deadline = time.monotonic() + 30
        while not worker.metrics_ended and time.monotonic() < deadline:
            worker.drain_metrics()                                     # takes the end marker
            time.sleep(0.05)
        assert worker.metrics_ended
        ended = []
        waiting = threading.Thread(target=lambda: ended.append(worker.get(timeout=30)),
                                   daemon=True)
        waiting.start()
        waiting.join(30)
        assert ended == [None] and all(s is not None for s in samples)
    finally:
        worker.stop()
