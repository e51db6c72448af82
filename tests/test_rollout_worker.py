"""rollout_worker.py: the trainer's handle on the rollout process: the spec's TypeError before
anything is spawned, failures and hangs of the child reaching the trainer, nothing left behind."""
import functools
import os
import signal

import pytest
from datasets import Dataset

import rollout_helpers as h
import toy
from config import AsyncGRPOConfig
from rollout import AsyncRolloutLoop
from rollout_worker import RolloutProcessError, RolloutWorker, check_picklable


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
