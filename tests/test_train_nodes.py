"""train.py on two nodes: `torchrun --nnodes 2 --nproc_per_node 1` started twice on this machine
(node_rank 0 and 1, static rendezvous on 127.0.0.1, gloo), against the stand-in server, compared
with `torchrun --nnodes 1 --nproc_per_node 2` of the same config: the same losses, one rollout
process (global rank 0's), one checkpoint, one metrics.jsonl writer, and a resume of that
checkpoint on one process. Last, set_log_level (log_on_each_node) under each rank's variables.
"""
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

import train
from config import AsyncGRPOConfig
from train_helpers import LAUNCHED, ROOT, SERVER_ARGS, SMALL, lines
from weight_sync import free_port

STEPS = 3                  # max_steps of the torchrun runs; the one checkpoint is at STEPS
SEED = 1234                # the stand-in's --seed: the per-request seeds it hands out, in order
# The same samples in the same order in every run (the test's docstring says why each is there)
SAME_SAMPLES = ("--max_concurrent_rollouts", "1", "--weight_sync_steps", str(10 * STEPS))
RUN = ("--max_steps", str(STEPS), "--save_steps", str(STEPS), *SAME_SAMPLES)


class Node:
    """One launched process (a torchrun agent, or a plain `python train.py`), in its own process
    group, its output in a file; `trainers` collects the pids of the trainer ranks it runs."""

    def __init__(self, name: str, launcher: list[str], out: str, url: str, dataset: str,
                 *extra: str, pids: str, log_dir: str):
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"), OMP_NUM_THREADS="1",
                   TRAIN_TEST_PIDS=pids)
        flags = [f"--{k}={v}" for k, v in SMALL.items() if k != "disable_tqdm"]
        cmd = [sys.executable, *launcher, os.path.join(ROOT, "train.py"), "--model",
               os.path.dirname(dataset) + "/model", "--dataset", dataset,
               "--reward", "train_helpers:pid_reward", "--vllm_server_base_url", url,
               "--output_dir", out, "--disable_tqdm", "true", *flags, *extra]
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        LAUNCHED.append(self.proc)      # conftest kills it too if the test dies on the way
        self.agent = bool(launcher)     # torchrun: the trainers are the agent's children
        self.trainers: set[int] = set() if self.agent else {self.proc.pid}

    def poll_trainers(self) -> None:
        if self.agent and self.proc.poll() is None:
            found = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                   text=True).stdout.split()
            self.trainers |= {int(p) for p in found}

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_nodes(nodes: list[Node], timeout: float = 400) -> str:
    """Wait for every node to exit (then kill what is left); assert each exited 0. Returns every
    node's output, for the assertion messages."""
    deadline = time.monotonic() + timeout
    try:
        while any(n.proc.poll() is None for n in nodes) and time.monotonic() < deadline:
            for n in nodes:
                n.poll_trainers()
            time.sleep(0.2)
    finally:
        for n in nodes:
            n.kill()
    shown = "".join(f"\n── {n.name} (exit {n.proc.returncode}) ──\n{n.output()[-4000:]}"
                    for n in nodes)
    for n in nodes:
        assert n.proc.returncode == 0, f"{n.name} failed{shown}"
    return shown


def torchrun(nnodes: int, nproc: int, node_rank: int, port: int) -> list[str]:
    return ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
            "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port",
            str(port)]


def losses(out: str) -> list[tuple[int, float]]:
    return [(line["step"], line["loss"]) for line in lines(out)]


@pytest.mark.slow
def test_two_ranks_sync_and_score_every_probe_together(start_server, indexed, tmp_path):
    """torchrun with two ranks, a full sync after every step: each sync's parity probe is asked
    by rank 0 alone and scored by both ranks' one forward before the next step (settle), so a
    run of STEPS steps exits 0 and logs sync/probe_kl on every step."""
    server = start_server(*SERVER_ARGS)
    node = Node("two ranks", torchrun(1, 2, 0, free_port()), str(tmp_path / "out"), server.url,
                indexed, "--max_steps", str(STEPS), "--weight_sync_steps", "1",
                pids=str(tmp_path / "pids"), log_dir=str(tmp_path))
    run_nodes([node], timeout=300)
    records = lines(str(tmp_path / "out"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["sync/probe_kl"] >= 0 for r in records[1:])


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_ranks(start_server, indexed, tmp_path):
    """Two torchrun agents of one rank each (node_rank 0 and 1, LOCAL_RANK 0 on both) train
    STEPS steps with the losses of one agent of two ranks, to 1e-6: both are world size 2 and
    see the same samples in the same order, because
    - each run gets a fresh server started with --seed SEED: its generator of per-request seeds
      (a request without a seed gets the next one) starts over at the same state;
    - max_concurrent_rollouts 1: one request in flight, so the requests reach the server one
      after another in prompt order and get the same seeds in every run;
    - weight_sync_steps > max_steps: the served weights never change (the start's sync sends
      the weights the server already holds), so when a sync lands between requests (timing)
      cannot change what is generated.
    Two one-node runs so agree bit for bit; at the defaults their losses differ from step 1.
    Only global rank 0 runs a rollout process (one pid scores every group: a child of node 0's
    trainer, not a trainer, torchrun's RANK stripped), writes metrics.jsonl (one line per step)
    and finishes the one checkpoint (save_steps = max_steps: both ranks' shards and RNG states,
    no temporary left). A plain `python train.py` (world size 1) resumes it: its first step is
    STEPS + 1, its last STEPS + 2."""
    logs = str(tmp_path)
    ref_out, out = str(tmp_path / "one_node"), str(tmp_path / "two_nodes")
    ref_pids, pids = str(tmp_path / "one_node.pids"), str(tmp_path / "two_nodes.pids")

    server = start_server(*SERVER_ARGS, "--seed", str(SEED))
    ref = Node("one node, two ranks", torchrun(1, 2, 0, free_port()), ref_out, server.url,
               indexed, *RUN, pids=ref_pids, log_dir=logs)
    run_nodes([ref])
    server.stop()

    server = start_server(*SERVER_ARGS, "--seed", str(SEED))
    port = free_port()
    nodes = [Node(f"node {r}", torchrun(2, 1, r, port), out, server.url, indexed, *RUN,
                  pids=pids, log_dir=logs) for r in (0, 1)]
    shown = run_nodes(nodes)
    server.stop()

    # (a) the same losses as one node of two ranks
    want, got = losses(ref_out), losses(out)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), shown      # (d) one line a step
    assert [s for s, _ in want] == [s for s, _ in got], shown
    assert all(abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(want, got)), (want, got, shown)
    assert any(abs(loss) > 1e-6 for _, loss in got), got     # a loss that could differ

    # (b) one rollout process: global rank 0's child, not a trainer, torchrun's RANK stripped
    with open(pids) as f:
        scored = [line.split() for line in f]
    assert scored, shown
    assert {(pid, rank) for pid, _, rank in scored} == {(scored[0][0], "None")}, (scored, shown)
    rollout, parent = int(scored[0][0]), int(scored[0][1])
    trainers = [n.trainers for n in nodes]
    assert all(len(t) == 1 for t in trainers), (trainers, shown)
    assert rollout not in trainers[0] | trainers[1], (rollout, trainers, shown)
    assert parent in trainers[0], (parent, trainers, shown)          # spawned by global rank 0

    # (c) one checkpoint, complete, written once
    names = sorted(os.listdir(out))
    assert [n for n in names if "checkpoint" in n] == [f"checkpoint-{STEPS}"], names
    saved = os.path.join(out, f"checkpoint-{STEPS}")
    files = set(os.listdir(saved))
    assert {"trainer_state.json", "rollout_state.json", "fsdp", "scheduler.pt",
            "model.safetensors"} <= files, files
    rng = sorted(f for f in files if f.startswith("rng_state_"))
    assert rng == ["rng_state_0.pth", "rng_state_1.pth"], files
    shards = sorted(f for f in os.listdir(os.path.join(saved, "fsdp")) if f.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    with open(os.path.join(saved, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == STEPS

    # (d) the metrics from global rank 0 only: node 1 (LOCAL_RANK 0 too) logged none, so its
    # train() returned no last line and its main() printed no "done:"
    assert f"done: {{'step': {STEPS}" in nodes[0].output(), shown
    assert "done:" not in nodes[1].output(), shown

    # (e) one process resumes the two nodes' checkpoint and goes on from it
    server = start_server(*SERVER_ARGS, "--seed", str(SEED))
    resumed = Node("resume, one process", [], out, server.url, indexed, *SAME_SAMPLES,
                   "--max_steps", str(STEPS + 2), "--save_steps", str(STEPS),
                   "--resume_from_checkpoint", "true", pids=str(tmp_path / "resume.pids"),
                   log_dir=logs)
    shown = run_nodes([resumed])
    steps = [s for s, _ in losses(out)]
    assert steps == list(range(1, STEPS + 3)), (steps, shown)
    assert os.path.isdir(os.path.join(out, f"checkpoint-{STEPS + 2}")), os.listdir(out)


# ── log_on_each_node: which process logs at log_level ─────────────────────────────────────────


@pytest.fixture
def root_level():
    """The root logger's level, restored after the test."""
    root = logging.getLogger()
    before = root.level
    yield root
    root.setLevel(before)


@pytest.mark.parametrize("each_node, rank, local_rank, level", [
    (True, 0, "0", logging.INFO),      # global rank 0
    (True, 1, "0", logging.INFO),      # node 1's first process: a main process of its node
    (True, 1, "1", logging.ERROR),     # node 0's second process
    (False, 0, "0", logging.INFO),
    (False, 1, "0", logging.ERROR),    # node 1's first process is a replica now
    (False, 1, "1", logging.ERROR),
])
def test_log_level_on_each_node_or_on_rank_0_only(monkeypatch, root_level, each_node, rank,
                                                  local_rank, level):
    """set_log_level: log_level on every node's LOCAL_RANK 0 with log_on_each_node, else on
    global rank 0 only; log_level_replica everywhere else."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    config = AsyncGRPOConfig(log_level="info", log_level_replica="error",
                             log_on_each_node=each_node)
    root_level.setLevel(logging.WARNING)
    train.set_log_level(config, rank)
    assert root_level.level == level


def test_passive_leaves_the_level_as_it_is(monkeypatch, root_level):
    monkeypatch.setenv("LOCAL_RANK", "1")
    root_level.setLevel(logging.CRITICAL)
    train.set_log_level(AsyncGRPOConfig(log_level="info", log_level_replica="passive"), 1)
    assert root_level.level == logging.CRITICAL
