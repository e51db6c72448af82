"""checkpoint.py: what the session's shared run (train_fixtures.train_run) left on disk, a killed
trainer resumed from it, and the choice of checkpoint to resume from."""
import json
import os
import signal
import time

import pytest
import torch

import checkpoint
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
    proc = cli(out, server.url, indexed, "--max_steps", "8", "--save_steps", "2", record=first)
    deadline = time.monotonic() + 240
    while newest_checkpoint(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)                 # the trainer and its rollout process
    proc.wait()
    k = newest_checkpoint(out)
    assert 2 <= k < 8, proc.stdout.read()
    rollout_state = os.path.join(out, f"checkpoint-{k}", "rollout_state.json")
    saved = json.load(open(rollout_state))["prompt_index"]
    proc = cli(out, server.url, indexed, "--max_steps", "8", "--save_steps", "2",
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
    steps = [r["step"] for r in lines(out)]
    assert steps[-(8 - k):] == list(range(k + 1, 9))


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
