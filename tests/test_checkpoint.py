"""checkpoint.py: what the session's shared run (conftest.train_run) left on disk, a killed
trainer resumed from it, and the choice of checkpoint to resume from; one run per output_dir, what
a resume checks, loads and cuts back, and the order in which a checkpoint reaches the disk (this
module's own run, saved_run)."""
import glob
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import checkpoint
import toy
import metrics
import train
from tools import plot
from local_vllm.launch import LocalServer
from train_helpers import SERVER_ARGS, SMALL, cli, lines, newest_checkpoint


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


@pytest.mark.slow
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
    checkpoint.prune(str(tmp_path), 2, written=10)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint")) == [
        "checkpoint-10", "checkpoint-4"]
    os.makedirs(tmp_path / "checkpoint-6")      # written by a run resumed from checkpoint-4
    checkpoint.prune(str(tmp_path), 1, written=6)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint")) == [
        "checkpoint-6"]                         # kept; 10 was the abandoned history's


@pytest.mark.slow
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
        steps = [r["step"] for r in plot.load_completions(out)]
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
    trained = plot.load_completions(out)
    counts = {p: 0 for p in range(48)}
    for r in trained:
        counts[r["prompt_index"]] += 1
    assert set(counts.values()) == {4}, (seen, {p: n for p, n in counts.items() if n != 4})
    steps = sorted({r["step"] for r in trained})
    assert steps == list(range(1, 65)), (seen, steps)         # 192 samples: 64 steps of 3
    assert all(r["staleness"] >= 0 and r["prompt"] for r in trained)
    state = json.load(open(os.path.join(out, "checkpoint-64", "trainer_state.json")))
    assert state["global_step"] == 64, seen


# ── one run per output_dir, what a resume checks and loads, durable checkpoints (issue 34) ──


@pytest.fixture(scope="module")
def saved_run(toy_dir, tmp_path_factory):
    """(server, output_dir, events): a server of this module's and one in-process run of 4 steps
    saved at 2 and 4 with save_total_limit 1 (so checkpoint-2 is pruned after 4 is written) and
    log_completions; `events` is every os.fsync (the file's path) and os.rename it made, in
    order. The tests copy output_dir before they resume from it."""
    server = LocalServer(toy_dir, *SERVER_ARGS)
    out = str(tmp_path_factory.mktemp("saved"))
    events = []
    fsync, rename = os.fsync, os.rename

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_rename(src, dst):
        events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        rename(src, dst)

    config = train.AsyncGRPOConfig(output_dir=out, vllm_server_base_url=server.url, max_steps=4,
                                   save_steps=2, save_total_limit=1, log_completions=True, **SMALL)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "fsync", recorded_fsync)
            patch.setattr(os, "rename", recorded_rename)
            train.train(config, toy.make_dataset(64), [toy.sum_reward], model=toy_dir)
        yield server, out, events
    finally:
        server.stop()


def resume_config(server, out: str, **changes) -> train.AsyncGRPOConfig:
    """saved_run's configuration, resumed from the newest checkpoint in `out`, to step 6."""
    fields = SMALL | dict(output_dir=out, vllm_server_base_url=server.url, max_steps=6,
                          save_steps=2, save_total_limit=1, log_completions=True,
                          resume_from_checkpoint="true")
    return train.AsyncGRPOConfig(**fields | changes)


def test_a_checkpoint_is_on_disk_before_its_rename_and_the_rename_before_a_prune(saved_run):
    """Every file and directory of checkpoint-4 is fsynced under its .tmp name before the rename
    that publishes it, and output_dir (the rename) before checkpoint-2 is moved away to be
    deleted."""
    _, out, events = saved_run
    out = os.path.realpath(out)
    tmp, final = os.path.join(out, ".checkpoint-4.tmp"), os.path.join(out, "checkpoint-4")
    published = events.index(("rename", tmp, final))
    pruned = events.index(("rename", os.path.join(out, "checkpoint-2"),
                           os.path.join(out, ".checkpoint-2.deleting")))
    synced = {path for kind, path, *_ in events[:published] if kind == "fsync"}
    walked = list(os.walk(final))
    written = {root for root, _, _ in walked} | {
        os.path.join(root, name) for root, _, files in walked for name in files}
    assert len(written) > 10
    assert {path.replace(final, tmp, 1) for path in written} <= synced
    assert ("fsync", out) in events[published:pruned]
    assert sorted(os.listdir(out)) == [".run.lock", "checkpoint-4", "completions.jsonl",
                                       "metrics.jsonl"]


@pytest.mark.slow
def test_a_second_run_into_a_used_output_dir_is_refused_or_replaces_the_first(
        start_server, indexed, tmp_path):
    """`python train.py` twice into one directory: the second is refused before it trains, with
    the two ways on, and leaves the first run as it was; with --overwrite_output_dir true the
    first run's checkpoints and metrics go, and the new run keeps its own checkpoints (the first
    run's higher steps made save_total_limit prune them as they were written)."""
    server = start_server(*SERVER_ARGS)
    out = str(tmp_path / "out")
    flags = ("--save_steps", "1", "--save_total_limit", "2")
    proc = cli(out, server.url, indexed, "--max_steps", "4", *flags)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    first = (sorted(os.listdir(out)), open(os.path.join(out, "metrics.jsonl")).read())
    proc = cli(out, server.url, indexed, "--max_steps", "2", *flags)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "holds another run" in log, log
    assert "--resume_from_checkpoint true" in log and "--overwrite_output_dir true" in log
    assert (sorted(os.listdir(out)), open(os.path.join(out, "metrics.jsonl")).read()) == first
    proc = cli(out, server.url, indexed, "--max_steps", "2", *flags, "--overwrite_output_dir",
               "true")
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    assert [r["step"] for r in lines(out)] == [1, 2]
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == [
        "checkpoint-1", "checkpoint-2"]
    state = json.load(open(os.path.join(out, "checkpoint-2", "trainer_state.json")))
    assert state["global_step"] == 2


def contents(directory: str) -> dict[str, bytes]:
    """Every file under `directory` (its path there) and its bytes."""
    return {os.path.relpath(os.path.join(root, name), directory):
            open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(directory) for name in names}


def demo(out: str, *flags: str) -> subprocess.CompletedProcess:
    """`python train.py --output_dir out [flags]`: the toy demo, which starts its local server."""
    return subprocess.run([sys.executable, "train.py", "--output_dir", out, *flags], text=True,
                          capture_output=True, cwd=os.path.dirname(train.__file__), timeout=120)


def test_a_live_run_holds_its_output_dir_until_it_ends_however_it_ends(saved_run, tmp_path):
    """A run that is still going (here another process holding checkpoint.hold, as train() does)
    keeps every other run out of its output_dir before anything is read or removed there: a
    resume, a fresh run, and a fresh run with overwrite_output_dir are refused, naming the
    directory, and leave it as it was; `python train.py` is refused before its local server starts
    (every file, the live run's serve_local.log too, is as it was, byte for byte). SIGKILLed, the
    holder's lock goes with it. A run that fails in this process releases the lock at once, though
    its traceback is kept."""
    server, saved, _ = saved_run
    out = str(tmp_path / "run")
    shutil.copytree(saved, out)
    before = sorted(os.listdir(out))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import checkpoint, sys, time; h = checkpoint.hold(sys.argv[1]); "
         "print('held', flush=True); time.sleep(120)", out],
        stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert holder.stdout.readline() == "held\n"
        for changes in ({}, {"resume_from_checkpoint": None},
                        {"resume_from_checkpoint": None, "overwrite_output_dir": True}):
            with pytest.raises(ValueError, match=f"output_dir '{out}' is in use by a run that "
                                                 "is still going"):
                train.train(resume_config(server, out, **changes), toy.make_dataset(64),
                            [toy.sum_reward], model="toy")
        assert sorted(os.listdir(out)) == before
        with open(os.path.join(out, "serve_local.log"), "w") as f:
            f.write("the live run's server\n")
        files = contents(out)
        toy_run = demo(out)
        assert toy_run.returncode != 0 and "is in use by a run that is still going" in (
            toy_run.stderr), toy_run.stderr[-2000:]
        assert "local_vllm on" not in toy_run.stdout and contents(out) == files
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(ValueError, match="holds another run") as failed:
        train.train(resume_config(server, out, resume_from_checkpoint=None),
                    toy.make_dataset(64), [toy.sum_reward], model="toy")
    checkpoint.hold(out).close()     # free: the killed holder's, and the failed run's though
    del failed                       # its traceback (train()'s frame, `held` in it) lived to here


@pytest.mark.parametrize("flags, refusal", [
    ([], "holds another run"),
    (["--resume_from_checkpoint", "true"], "would drop or repeat samples")],
    ids=["fresh", "resume with another dataset"])
def test_a_refused_python_train_py_leaves_a_finished_run_as_it_was(saved_run, tmp_path, flags,
                                                                   refusal):
    """`python train.py` (the demo, which starts a local server writing serve_local.log) into a
    finished run's output_dir, fresh without --overwrite_output_dir, or resuming with another
    dataset (the demo's prompts, not the saved run's): refused by train()'s own opening checks
    (checkpoint.open_run) before the server starts, so every file of the first run, its
    serve_local.log included, is as it was, byte for byte."""
    _, saved, _ = saved_run
    out = str(tmp_path / "run")
    shutil.copytree(saved, out)
    with open(os.path.join(out, "serve_local.log"), "w") as f:
        f.write("the first run's server\n")
    files = contents(out)
    refused = demo(out, *flags)
    assert refused.returncode != 0 and refusal in refused.stderr, refused.stderr[-2000:]
    assert "local_vllm on" not in refused.stdout and contents(out) == files


def test_a_resume_refuses_a_changed_data_cursor_and_applies_a_changed_learning_rate(
        saved_run, toy_dir, tmp_path, caplog):
    """A resume with another dataset (other rows, fewer rows), num_generations or prompt order is
    refused before any work, naming the field, old and new; one with learning_rate 0 says so
    and trains at 0: the weights stay the checkpoint's (the saved rate of 1e-3 would move them)."""
    server, saved, _ = saved_run
    out = str(tmp_path / "run")
    shutil.copytree(saved, out)
    refused = [({}, toy.make_dataset(64, seed=1), r"dataset_prompts '\w+' → '\w+'"),
               ({}, toy.make_dataset(32), "dataset_rows 64 → 32"),
               ({"num_generations": 2}, toy.make_dataset(64), "num_generations 4 → 2"),
               ({"data_seed": 7}, toy.make_dataset(64), "shuffle_seed 42 → 7")]
    for changes, dataset, named in refused:
        with pytest.raises(ValueError, match=named + ".*would drop or repeat samples"):
            train.train(resume_config(server, out, **changes), dataset, [toy.sum_reward],
                        model=toy_dir)
    assert sorted(os.listdir(out)) == sorted(os.listdir(saved))
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        train.train(resume_config(server, out, learning_rate=0.0), toy.make_dataset(64),
                    [toy.sum_reward], model=toy_dir)
    assert "applying the changed learning_rate 0.001 → 0.0" in caplog.text
    resumed = lines(out)[4:]
    assert [r["step"] for r in resumed] == [5, 6]
    assert all(r["learning_rate"] == 0.0 and r["grad_norm"] > 0 for r in resumed)
    before = load_file(os.path.join(saved, "checkpoint-4", "model.safetensors"))
    after = load_file(os.path.join(out, "checkpoint-6", "model.safetensors"))
    assert all(torch.equal(before[name], after[name]) for name in before)


class Planted:
    """Pickles as a call of open(path, "w"): loading it without weights_only writes the file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_state_0.pth"])
def test_a_planted_pickle_in_a_checkpoint_does_not_run(saved_run, toy_dir, tmp_path, name):
    """A resume from a checkpoint whose `name` holds code is refused naming the file, and the
    code did not run (its marker file is absent); the same file loaded without weights_only
    writes the marker (the plant is live)."""
    server, saved, _ = saved_run
    out = str(tmp_path / "run")
    shutil.copytree(saved, out)
    marker = tmp_path / "ran"
    planted = os.path.join(out, "checkpoint-4", name)
    torch.save({"last_epoch": 4, "payload": Planted(str(marker))}, planted)
    try:
        with pytest.raises(ValueError, match=f"{name} holds more than tensors and numbers"):
            train.train(resume_config(server, out), toy.make_dataset(64), [toy.sum_reward],
                        model=toy_dir)
    finally:
        if dist.is_initialized():               # the load failed before train()'s cleanup
            dist.destroy_process_group()
    assert not marker.exists()
    torch.load(planted, weights_only=False)
    assert marker.exists()


def cut(path: str) -> None:
    """The file cut at half its length, as a copy that did not finish leaves it."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("pattern, damage", [
    ("fsdp/*.distcp", cut), ("scheduler.pt", cut),
    ("trainer_state.json", lambda path: open(path, "w").close()), ("rollout_state.json", cut)],
    ids=["DCP shard cut", "scheduler cut", "trainer state empty", "rollout state cut"])
def test_a_damaged_checkpoint_file_is_named_with_its_checkpoint(saved_run, toy_dir, tmp_path,
                                                               pattern, damage):
    """A resume from a checkpoint with one file damaged stops naming that file (its path, so its
    checkpoint-N too) and why, not with the reader's words alone ("failed finding central
    directory", "Expecting value"): with several checkpoints the user sees which file to copy
    again. A cut DCP shard is found by the tensor ends its index records."""
    server, saved, _ = saved_run
    out = str(tmp_path / "run")
    shutil.copytree(saved, out)
    path, = glob.glob(os.path.join(out, "checkpoint-4", pattern))
    damage(path)
    try:
        with pytest.raises(ValueError, match=f"^resume_from_checkpoint: {re.escape(path)} cannot "
                                             r"be read \(.+\): copy it again"):
            train.train(resume_config(server, out), toy.make_dataset(64), [toy.sum_reward],
                        model=toy_dir)
    finally:
        if dist.is_initialized():               # the load failed before train()'s cleanup
            dist.destroy_process_group()


def test_a_resume_after_a_cut_metrics_line_cuts_both_files_back_and_plots(saved_run, toy_dir,
                                                                          tmp_path):
    """A run killed after its checkpoint at step 4 logged step 5 and died writing step 6, in both
    files: the plot reads them as they are, and the resume (to step 6) cuts them back to step 4
    before it appends, so each step is logged once and every line is whole."""
    server, saved, _ = saved_run
    out = str(tmp_path / "run")
    shutil.copytree(saved, out)
    for name in ("metrics.jsonl", metrics.COMPLETIONS):
        with open(os.path.join(out, name)) as f:
            last = json.loads(f.readlines()[-1])
        with open(os.path.join(out, name), "a") as f:       # step 5 whole, step 6 cut
            f.write(json.dumps(last | {"step": 5, "lost": True}) + "\n")
            f.write(json.dumps(last | {"step": 6})[:20])
    logged = plot.read_lines(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in logged][-2:] == [4, 5]
    assert os.path.isfile(plot.plot(out))              # `python -m tools.plot` on the cut files
    train.train(resume_config(server, out), toy.make_dataset(64), [toy.sum_reward],
                model=toy_dir)
    assert [r["step"] for r in lines(out)] == [1, 2, 3, 4, 5, 6]     # every line whole JSON
    with open(os.path.join(out, metrics.COMPLETIONS)) as f:
        trained = [json.loads(line) for line in f]
    assert sorted({r["step"] for r in trained}) == [1, 2, 3, 4, 5, 6]
    assert not any("lost" in r for r in lines(out) + trained)
    assert os.path.isfile(plot.plot(out))


def test_the_reader_skips_a_cut_line_glued_to_the_next(tmp_path):
    """A cut line that a later append glued to a whole one: both are left out, the rest read."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo{"step": 3}\n{"step": 4}\n{"step": 5')
    assert [r["step"] for _, r in metrics.whole_lines(str(path))] == [1, 4]


def test_a_peft_export_holds_every_trained_tensor_in_the_export_dtype(tmp_path):
    """checkpoint.exported, what a checkpoint and an adapter sync write, of a peft model with
    modules_to_save: LoRA's tensors and the trained copy of the saved module (a rule by name,
    'lora_', lost that copy), none of the frozen base, in bf16 under bf16 over fp32 masters; the
    directory save_pretrained writes from it loads back with those values."""
    from peft import LoraConfig, PeftModel, get_peft_model
    train.setup_distributed(train.AsyncGRPOConfig())
    try:
        model = get_peft_model(toy.build_model(64), LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["norm"]))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.rand_like(p))         # trained: neither zeros nor ones
        config = train.AsyncGRPOConfig(bf16=True)
        weights = checkpoint.exported(train.Policy(model), config)
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert set(weights) == trained
        assert any(".modules_to_save." in n for n in weights)
        assert any("lora_B" in n for n in weights)
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}
        model.save_pretrained(tmp_path, state_dict=weights)
        loaded = PeftModel.from_pretrained(toy.build_model(64), tmp_path)
        for name, p in loaded.named_parameters():
            if name in weights:
                torch.testing.assert_close(p.detach().to(torch.bfloat16), weights[name],
                                           msg=name)
    finally:
        dist.destroy_process_group()
