"""rollout/worker.py: the trainer's handle on the rollout process: the spec's TypeError before
anything is spawned, a child that imports nothing of the trainer, the main script run again only
when the child needs it (the spec's quickstart unguarded; a script's own reward refused without the
guard), failures and hangs of the child reaching the trainer, nothing left behind (also when the
trainer is SIGKILLed), rank 0's state bounded however long the run."""
import functools
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM

import checkpoint
import metrics
import rollout_helpers as h
import toy
import train
from config import AsyncGRPOConfig
from rollout import AsyncRolloutLoop
from rollout.worker import RolloutProcessError, RolloutWorker, check_picklable
from tools.plot import load_completions
from train_helpers import ROOT, SERVER_ARGS, SMALL, lines, recorded_reward
from trie_pack import Planner


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
    leaked = {"train", "checkpoint", "weight_sync", "lora_sync", "metrics", "rollout.worker",
              "peft", "torch.distributed.fsdp", "local_vllm.engine"} & modules
    assert not leaked, leaked


def test_a_reward_defined_in_the_main_script_still_reaches_the_child(monkeypatch):
    """The pickles name __main__: the child runs the script again, so the reward unpickles."""
    main = fake_main(monkeypatch, "tests/train_helpers.py")        # it defines recorded_reward
    main.recorded_reward = types.FunctionType(recorded_reward.__code__, vars(main),
                                              "recorded_reward")
    assert "rollout_helpers" in child_modules(main.recorded_reward)   # the loop was built


def test_what_names_main_is_found_precisely():
    """The child runs the main script only for what is looked up in __main__: a function, a
    class, an instance's class, inside any container; never for the text "__main__" in data."""
    main = types.ModuleType("__main__")
    exec("def reward(p, c, **k): return [0.0]\nclass Scorer:\n    def __call__(self): pass",
         vars(main))
    for obj, found in [(main.reward, "reward"), ({"rewards": [main.Scorer()]}, "Scorer"),
                       (functools.partial(main.reward), "reward"), (toy.sum_reward, None),
                       (Dataset.from_list([{"prompt": 'if __name__ == "__main__":'}]), None)]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "__main__", main)
            assert check_picklable(obj, "rollout argument") == found


QUICKSTART = """\
print("the script runs")
from toy import make_dataset, sum_reward
from train import AsyncGRPOConfig, AsyncGRPOTrainer      # trl.experimental.async_grpo in the spec
{defines}
dataset = make_dataset(64)

trainer = AsyncGRPOTrainer(
    model={model!r},
    reward_funcs={reward},
    train_dataset=dataset,
    args=AsyncGRPOConfig(**{config!r}),
)
{call}
"""
SCRIPT_REWARD = ("def script_reward(prompts, completions, **kwargs):\n"
                 "    return sum_reward(prompts, completions, **kwargs)\n")


def run_script(tmp_path, server, toy_dir, reward: str, guarded: bool):
    """The spec's quickstart as a script (its import line ours, a small config against `server`),
    run by `python quickstart.py`: its output, output_dir and text."""
    out = str(tmp_path / "run")
    config = dict(vllm_server_base_url=server.url, output_dir=out, max_steps=2,
                  save_strategy="no", **SMALL)
    call = 'if __name__ == "__main__":\n    trainer.train()' if guarded else "trainer.train()"
    text = QUICKSTART.format(defines=SCRIPT_REWARD if reward == "script_reward" else "",
                             model=toy_dir, reward=reward, config=config, call=call)
    script = tmp_path / "quickstart.py"
    script.write_text(text)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    return run, out, text


@pytest.mark.parametrize("reward, guarded, runs", [
    ("sum_reward", False, 1), pytest.param("script_reward", True, 2, marks=pytest.mark.slow)])
def test_a_script_trains_unguarded_unless_it_hands_over_what_it_defines(
        tmp_path, start_server, toy_dir, reward, guarded, runs):
    """The spec's quickstart (a reward imported from a module, no guard) trains, and the child
    never runs the script (it prints once); a script's own reward under the guard trains too, the
    child running the script again (as __mp_main__) to find it."""
    server = start_server(*SERVER_ARGS)     # its own: training changes the served weights
    run, out, _ = run_script(tmp_path, server, toy_dir, reward, guarded)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line["step"] for line in lines(out)] == [1, 2]
    assert run.stdout.count("the script runs") == runs, run.stdout


def test_a_script_that_hands_over_its_own_reward_unguarded_is_refused_at_once(
        tmp_path, server, toy_dir):
    """Without the guard, the child would start a second trainer: refused before any trainer
    work (no output_dir), naming the script's line, the reward and the guard."""
    run, out, text = run_script(tmp_path, server, toy_dir, "script_reward", guarded=False)
    line = text.splitlines().index("trainer.train()") + 1
    assert run.returncode != 0
    assert (f"quickstart.py:{line} starts the trainer at the script's top level and hands the "
            "rollout process script_reward, defined in the script") in run.stderr, run.stderr
    assert 'if __name__ == "__main__":\n        trainer.train()' in run.stderr
    assert not os.path.exists(out) and run.stdout.count("the script runs") == 1


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


# ── a long run, a SIGKILLed trainer, its listeners (issue 34) ──


def test_rank_0_keeps_the_state_of_the_prompts_in_flight_only_and_stops_at_once(
        server, toy_dir, tokenizer, tmp_path):
    """Rank 0's side of train() without the model, over 2,000 prompts and no checkpoint: each
    step taken through train.Feed (the planner, the drops, the resume cursor), a version
    published and the step logged with its completions, as train() does. What rank 0 keeps
    per prompt (the resume index's counts, the prompts whose text completions.jsonl holds) and
    per completion never exceeds the prompts in flight, and stop() returns within 2 s."""
    config = h.config_for(server, max_completion_length=1, max_steps=10**6, queue_maxsize=64,
                          per_device_train_batch_size=16, token_budget=0, log_completions=True,
                          num_completions_to_print=0, disable_tqdm=True)
    worker = RolloutWorker(config, toy.make_dataset(64), [h.rank_reward], tokenizer)
    state = checkpoint.TrainState()
    feed = train.Feed(worker, Planner(1, 0, 16), 1, state)
    train.setup_distributed(config)
    log = metrics.MetricsLog(config, str(tmp_path), state, AutoModelForCausalLM.from_pretrained(
        toy_dir), torch.device("cpu"), worker.drain_metrics)
    kept = []
    try:
        worker.start()
        while state.prompt_index < 2000:
            step = feed.next_step(state.model_version, config.max_staleness)
            state.global_step += 1
            state.model_version += 1
            worker.set_model_version(state.model_version)
            log.step(state, {"perf/fwd_bwd_s": 0.01, "perf/step_s": 0.01}, step)
            index = worker.resume
            kept.append((len(index.trained), len(index.left), len(index.announced),
                         len(index.skip), len(log.prompted), len(log.completions)))
        start = time.monotonic()
        worker.stop()
        stopped = time.monotonic() - start
    finally:
        worker.stop()
        log.close()
        dist.destroy_process_group()
    # the prompts in flight, and two steps' slack: under load (pytest -n 2) the progress channel
    # is drained a step late (96 against 80 with one step's slack, in 2,000 prompts)
    in_flight = (config.queue_maxsize + worker.bound) // config.num_generations + 32
    held = dict(zip(("trained", "left", "announced", "skip", "prompted", "completions"),
                    map(max, zip(*kept))))
    assert len(kept) > 200 and max(held.values()) <= in_flight, (held, in_flight)
    assert stopped < 2.0
    assert len(load_completions(str(tmp_path))) == 16 * len(kept)


def stat(pid) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    found = stat(pid)
    return found is not None and found[0] != "Z"            # a zombie has exited


def family(pid: int) -> set[int]:
    """The live processes descended from `pid`."""
    parents = {int(p): found[1] for p in os.listdir("/proc") if p.isdigit()
               if (found := stat(p)) is not None and found[0] != "Z"}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def listening(pid: int) -> list[str]:
    """The addresses `pid`'s listening TCP sockets are bound to (/proc/net/tcp, tcp6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd") if alive(pid) else []:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, kind in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:        # 0A: LISTEN
                    raw = bytes.fromhex(cols[1].split(":")[0])
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    out.append(socket.inet_ntop(kind, words))
    return out


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


@pytest.mark.slow
def test_the_demo_listens_on_loopback_only_and_a_sigkilled_trainer_leaves_no_child(tmp_path):
    """`python train.py` (the demo: its own local server, full sync every step) after its first
    step: every socket the trainer, the server and the rollout process listen on is bound to
    127.0.0.1 (the weight transfer's store and gloo, the server's HTTP port; a run of one
    process has no store). Then the trainer's pid alone is SIGKILLed, as the OOM killer does:
    within 15 s no process it started is left."""
    out = tmp_path / "toy"
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train.py"), "--output_dir", str(out),
         "--max_steps", "1000", "--save_strategy", "no", "--disable_tqdm", "true"],
        env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT, start_new_session=True)
    children = set()
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "no first step"
            time.sleep(0.2)
        children = family(proc.pid)
        assert len(children) >= 2                          # the server, the rollout process
        bound = {pid: listening(pid) for pid in children | {proc.pid}}
        assert bound[proc.pid] and sum(map(len, bound.values())) >= 3, bound
        assert all(loopback(a) for addresses in bound.values() for a in addresses), bound
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while any(map(alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if alive(pid)]
    finally:
        for pid in [proc.pid, *children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
