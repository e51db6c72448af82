"""checkpoint.py: what the session's shared run (train_fixtures.train_run) left on disk, a killed
trainer resumed from it, and the choice of checkpoint to resume from."""
import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch

import checkpoint
import toy
import metrics
from train_helpers import SERVER_ARGS, cli, lines, newest_checkpoint

pytest_plugins = ["train_fixtures"]


def test_checkpoints_are_complete_pruned_and_load_with_from_pretrained(train_run, toy_dir):
    from transformers import AutoModelForCausalLM
    out = train_run[0]
    checkpoints = sorted(n for n in os.listdir(out) if n.startswith("checkpoint"))
    assert checkpoints == ["checkpoint-4"]                                    # save_total_limit 1
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    ckpt = os.path.join(out, "checkpoint-4")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    base = AutoModelForCausalLM.from_pretrained(toy_dir)
    assert model.dtype == torch.float32
    embeddings = model.model.embed_tokens.weight
    assert not torch.equal(embeddings, base.model.embed_tokens.weight)       # it trained
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert (state["global_step"], state["model_version"]) == (4, 4)
    assert json.load(open(os.path.join(ckpt, "rollout_state.json")))["prompt_index"] > 0


def test_killed_run_resumes_at_the_saved_prompt_with_its_optimizer_state(start_server, indexed,
                                                                          tmp_path):
    server = start_server(*SERVER_ARGS)
    out = str(tmp_path / "out")
    first = str(tmp_path / "first")
    second = str(tmp_path / "second")
    order = ("--train_sampling_strategy", "sequential")  # the recorded row is the prompt index
    proc = cli(out, server.url, indexed, "--max_steps", "8", "--save_steps", "2", *order,
               record=first)
    deadline = time.monotonic() + 240
    while newest_checkpoint(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)                 # the trainer and its rollout process
    proc.wait()
    k = newest_checkpoint(out)
    assert 2 <= k < 8, proc.stdout.read()
    rollout_state = os.path.join(out, f"checkpoint-{k}", "rollout_state.json")
    saved = json.load(open(rollout_state))["prompt_index"]
    counters = json.load(open(os.path.join(out, f"checkpoint-{k}", "trainer_state.json")))
    proc = cli(out, server.url, indexed, "--max_steps", "8", "--save_steps", "2", *order,
               "--resume_from_checkpoint", "true", record=second)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    resumed = [int(x) for x in open(second).read().split()]
    assert saved in resumed and min(resumed) == saved   # from the first prompt not yet trained
    state = json.load(open(os.path.join(out, "checkpoint-8", "trainer_state.json")))
    assert (state["global_step"], state["model_version"]) == (8, 8)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(os.path.join(out, "checkpoint-8", "fsdp"), tmp_path / "final.pt")
    optim = torch.load(tmp_path / "final.pt", weights_only=False)["optim"]["state"]
    assert {float(s["step"]) for s in optim.values()} == {8.0}     # Adam counted on from step k
    records = lines(out)
    assert [r["step"] for r in records[-(8 - k):]] == list(range(k + 1, 9))
    head, last = records[-(8 - k)], records[-1]         # the resumed run's: its counters continue
    assert head["num_tokens"] == counters["num_tokens"] + head["batch/forwarded_tokens_per_step"]
    assert head["sample/dropped_stale_total"] >= counters["dropped_stale_total"]
    assert head["batch/dropped_oversize_total"] >= counters["dropped_oversize_total"]
    logged = {"num_tokens": "num_tokens", "dropped_stale_total": "sample/dropped_stale_total",
              "dropped_oversize_total": "batch/dropped_oversize_total"}
    assert {k: state[k] for k in logged} == {k: last[m] for k, m in logged.items()}   # as logged


def test_find_picks_the_newest_complete_checkpoint_and_prune_keeps_the_newest(tmp_path):
    assert checkpoint.find(str(tmp_path), None) is None
    assert checkpoint.find(str(tmp_path), "false") is None
    with pytest.raises(ValueError, match="holds no checkpoint-N"):
        checkpoint.find(str(tmp_path), True)
    for step in (2, 10, 4):
        os.makedirs(tmp_path / f"checkpoint-{step}")
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    os.makedirs(tmp_path / ".checkpoint-12.tmp")                         # an unfinished one
    assert checkpoint.find(str(tmp_path), "true") == str(tmp_path / "checkpoint-10")   # 10 > 4 > 2
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.find(str(tmp_path), str(tmp_path / ".checkpoint-12.tmp"))
    checkpoint.prune(str(tmp_path), 2)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint")) == [
        "checkpoint-10", "checkpoint-4"]


def test_every_prompt_is_trained_exactly_once_across_kills_mid_generation_step_and_save(
        start_server, toy_dir, tmp_path):
    """48 prompts × 4 generations, one epoch of steps of 3 samples (groups split across steps,
    and across checkpoints), killed with SIGKILL three times: while a checkpoint is being written,
    at a random moment of a step, and while the rollout process generates the first groups after
    a resume; each time resumed through the CLI. The lines of completions.jsonl that survive (the
    final model's record) hold each prompt exactly num_generations times, and the run ends.
    Each run gets a fresh server: one whose trainer was killed mid weight sync can stop answering
    for up to vllm_server_timeout (seen here: a resumed run's rollouts timed out)."""
    os.symlink(toy_dir, tmp_path / "model")
    rows = [dict(r, index=i) for i, r in enumerate(toy.make_dataset(48))]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    flags = ("--num_train_epochs", "1", "--per_device_train_batch_size", "3",
             "--token_budget", "0", "--save_steps", "2",
             "--max_staleness", "100", "--log_completions", "true",
             "--num_completions_to_print", "1")
    rng = random.Random()
    seen = []                      # per kill: its moment, the newest checkpoint, the step reached

    def run_until(moment, resume):
        proc = cli(out, start_server(*SERVER_ARGS).url, str(dataset), *flags, *(
            ("--resume_from_checkpoint", "true") if resume else ()))
        start = newest_checkpoint(out)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not moment(proc, start):
            time.sleep(0.005)
        assert proc.poll() is None, proc.stdout.read()
        os.killpg(proc.pid, signal.SIGKILL)    # the trainer and its rollout process
        proc.wait()
        steps = [r["step"] for r in metrics.load_completions(out)]
        seen.append((moment.__name__, newest_checkpoint(out), max(steps, default=0)))

    def mid_save(proc, start):                 # a checkpoint half written after a complete one
        return newest_checkpoint(out) > 0 and any(n.endswith(".tmp") for n in os.listdir(out))

    def mid_step(proc, start, delay=rng.uniform(0.0, 1.0)):
        if newest_checkpoint(out) > start:
            time.sleep(delay)
            return True
        return False

    def mid_generation(proc, start, delay=rng.uniform(1.0, 2.5)):
        if subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True).stdout:
            time.sleep(delay)                  # the resumed run's rollout process has started
            return True
        return False

    run_until(mid_save, resume=False)
    run_until(mid_step, resume=True)
    run_until(mid_generation, resume=True)
    assert not any(n.startswith("checkpoint-") and not os.path.exists(
        os.path.join(out, n, "trainer_state.json")) for n in os.listdir(out)), seen
    proc = cli(out, start_server(*SERVER_ARGS).url, str(dataset), *flags,
               "--resume_from_checkpoint", "true")
    try:
        log, _ = proc.communicate(timeout=120)  # it ends: no wait for a lost end marker
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
    assert proc.returncode == 0, (seen, log[-5000:])
    printed = [x for x in log.splitlines() if x.startswith("  reward ")]
    assert len(printed) == 64 - seen[-1][1], log[-3000:]     # num_completions_to_print a step
    trained = metrics.load_completions(out)
    counts = {p: 0 for p in range(48)}
    for r in trained:
        counts[r["prompt_index"]] += 1
    assert set(counts.values()) == {4}, (seen, {p: n for p, n in counts.items() if n != 4})
    steps = sorted({r["step"] for r in trained})
    assert steps == list(range(1, 65)), (seen, steps)         # 192 samples: 64 steps of 3
    assert all(r["staleness"] >= 0 and r["prompt"] for r in trained)
    state = json.load(open(os.path.join(out, "checkpoint-64", "trainer_state.json")))
    assert state["global_step"] == 64, seen
