"""train.py end to end when the training signal misbehaves, against a local_vllm server of each
test's own (a sync changes its weights): a reward that is not finite, optimizer steps whose loss
is not finite, a run whose every group is dropped (a task too hard), rollouts that fork; and the
input errors AsyncGRPOTrainer refuses before the model loads."""
import json
import logging
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

import rollout_helpers as h
import toy
import train
from rollout import AsyncRolloutLoop
from tools import plot
from tools.plot import load_completions
from train_helpers import ROOT, SERVER_ARGS, SMALL
from weight_sync import free_port


def run(server, toy_dir, out, reward=h.rank_reward, dataset=None, loop_cls=AsyncRolloutLoop,
        tokenizer=None, **config):
    """train() on the toy model against `server`, with SMALL's settings under `config`."""
    config = train.AsyncGRPOConfig(output_dir=str(out), vllm_server_base_url=server.url,
                                   train_sampling_strategy="sequential", **(SMALL | config))
    dataset = toy.make_dataset(16) if dataset is None else dataset
    return train.train(config, dataset, [reward], model=toy_dir, processing_class=tokenizer,
                       loop_cls=loop_cls)


def strict_lines(out) -> list[dict]:
    """metrics.jsonl, refusing NaN and Infinity (not JSON, though json.dumps writes them)."""
    def refuse(constant):
        raise ValueError(f"{constant} in metrics.jsonl")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(directory, "model.safetensors"))


# ── non-finite rewards and steps ────────────────────────────────────────────────────────────


def test_an_infinite_reward_stops_the_run_naming_the_function_and_the_row(start_server, toy_dir,
                                                                          tmp_path):
    server = start_server(*SERVER_ARGS)
    with pytest.raises(RuntimeError, match=r"reward function infinite_reward returned \[inf, 0.0, "
                                           r"0.0, 0.0\] for dataset row 0 \(prompt "):
        run(server, toy_dir, tmp_path / "out", reward=h.infinite_reward, max_steps=2)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_step_whose_loss_is_not_finite_is_skipped_and_the_run_goes_on(start_server, toy_dir,
                                                                        tmp_path, caplog, bf16):
    """The group of row 0 gets infinite advantages: its step (one group a step: rows of 4
    samples) is not applied, logged with a null loss and grad_norm and warned; the others train,
    and the weights stay finite."""
    server = start_server(*SERVER_ARGS)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        run(server, toy_dir, out, loop_cls=h.InfAdvantageLoop, max_steps=3, token_budget=0,
            bf16=bf16)
    records = strict_lines(out)
    skipped = [r for r in records if "loss" in r and r["loss"] is None]
    assert len(skipped) == 1 and skipped[0]["grad_norm"] is None
    assert f"step {skipped[0]['step']}: the loss or gradient norm is not finite" in caplog.text
    fig = plot.figure(str(out))                 # the run plots: a gap at the skipped step
    loss = next(ax for ax in fig.axes if ax.get_title() == "loss")
    for line in loss.lines[:2]:                 # raw and smoothed
        gap = [math.isnan(y) for y in line.get_ydata()]
        assert gap == [r["step"] == skipped[0]["step"] for r in records if "loss" in r]
    fig.savefig(out / "metrics.png")
    assert records[-1]["skipped_steps_total"] == 1 and math.isfinite(records[-1]["loss"])
    trained, base = weights(out / "checkpoint-3"), weights(toy_dir)
    assert all(torch.isfinite(t).all() for t in trained.values())
    assert any(not torch.equal(trained[n].float(), base[n]) for n in base)   # the others trained


@pytest.mark.slow
def test_the_skipped_steps_total_carries_over_a_resume(start_server, toy_dir, tmp_path):
    """A run whose two steps were both skipped saves at step 2; its resume, whose steps are
    finite, goes on counting from 2."""
    server = start_server(*SERVER_ARGS)
    out = tmp_path / "out"
    run(server, toy_dir, out, loop_cls=h.AllInfAdvantageLoop, max_steps=2, token_budget=0,
        save_steps=2)
    run(server, toy_dir, out, max_steps=3, token_budget=0, resume_from_checkpoint=True)
    assert [r["skipped_steps_total"] for r in strict_lines(out)] == [1, 2, 2]


@pytest.mark.slow
def test_every_rank_skips_a_step_one_ranks_row_makes_non_finite(tmp_path):
    """The loss is summed over ranks and the gradient norm is global, so a non-finite value in one
    rank's row skips the step on both: the full weights are the initial ones."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TWO_RANK_POISON="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           os.path.join(ROOT, "tests", "two_rank_step.py"),
                           str(tmp_path / "two.pt")], env=env, timeout=300, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    torch.manual_seed(0)
    init = dict(toy.build_model(len(toy.build_tokenizer())).named_parameters())
    after = torch.load(tmp_path / "two.pt", weights_only=True)
    assert all(torch.equal(after[n], init[n]) for n in init)


def test_non_finite_steps_in_a_row_stop_the_run_with_the_weights_untouched(start_server, toy_dir,
                                                                           tmp_path):
    server = start_server(*SERVER_ARGS)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="optimizer steps 1 to 3: the loss or gradient norm "
                                           "was not finite, so none was applied"):
        run(server, toy_dir, out, loop_cls=h.AllInfAdvantageLoop, max_steps=8, token_budget=0,
            save_steps=1)
    saved, base = weights(out / "checkpoint-2"), weights(toy_dir)
    assert all(torch.equal(saved[n], base[n]) for n in base)
    assert [r["skipped_steps_total"] for r in strict_lines(out)] == [1, 2, 3]


# ── nothing to train ────────────────────────────────────────────────────────────────────────


def test_a_max_steps_run_whose_every_group_is_dropped_stops_after_one_pass(start_server, toy_dir,
                                                                           tmp_path, capfd):
    """Equal rewards: every group is dropped (the spec), so no sample ever comes, and with nothing
    trained the policy cannot change. The run stops once a whole pass over the prompts (8) has
    scored with none kept: on that evidence, not after a time (rollout_worker_timeout, the limit
    for a hung process, is far above the test's length). The windows are logged all the same, and
    the rollout process warns naming frac_reward_zero_std."""
    server = start_server(*SERVER_ARGS)
    out = tmp_path / "out"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"max_steps=5 would wait forever: a whole pass over "
                                           r"the prompts \(8\) trained nothing: no group kept "
                                           r"for \d+s: the 8 scored since had equal rewards"):
        run(server, toy_dir, out, reward=h.constant_reward, dataset=toy.make_dataset(8),
            max_steps=5, untrained_warning_s=1, rollout_worker_timeout=3600)
    assert time.monotonic() - start < 600
    warned = capfd.readouterr().err
    assert "frac_reward_zero_std 1" in warned and "partial credit in the reward" in warned
    records = strict_lines(out)
    assert records and all(r["frac_reward_zero_std"] == 1.0 and r["step"] == 0 for r in records)
    assert records[-1]["reward"] == 0.0 and records[-1]["sample/dropped_stale_total"] == 0


def test_a_max_steps_run_whose_every_prompt_is_too_long_stops_with_their_error(
        start_server, toy_dir, tmp_path):
    """A pass over prompts that each fill the server's context (max_model_len 128) is a pass that
    trained nothing: the run stops with the too-long error, naming the row, the length and the
    limit, not with equal rewards."""
    server = start_server(*SERVER_ARGS)
    rows = [{"prompt": [{"role": "user", "content": "1" * 200}]}] * 3
    with pytest.raises(RuntimeError, match=r"max_steps=5 would wait forever: a whole pass over "
                                           r"the prompts \(3\) trained nothing: 3 prompts were "
                                           r"too long, the last dataset row \d: its prompt of 219 "
                                           r"tokens leaves no room in max_model_len=128") as info:
        run(server, toy_dir, tmp_path / "out", dataset=Dataset.from_list(rows), max_steps=5,
            rollout_worker_timeout=3600)
    assert "equal rewards" not in str(info.value)


def test_an_epochs_run_whose_every_group_is_dropped_says_why(start_server, toy_dir, tmp_path):
    server = start_server(*SERVER_ARGS)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="the prompts ran out and nothing was trained: no group "
                                           "kept for"):
        run(server, toy_dir, out, reward=h.constant_reward, dataset=toy.make_dataset(6),
            num_train_epochs=1)
    last = strict_lines(out)[-1]
    assert last["frac_reward_zero_std"] == 1.0 and last["reward"] == 0.0 and last["step"] == 0


# ── forks: admission by staleness ───────────────────────────────────────────────────────────


@pytest.mark.slow
def test_forked_rollouts_train_every_group_of_each_epoch(start_server, toy_dir, tokenizer,
                                                        tmp_path):
    """3 samples a rollout (a template that re-renders earlier answers), 2 epochs of 17 prompts:
    every prompt of each epoch is trained and stale drops stay under 5% of the samples. Before the
    window learned the yield and counted a stale drop as admission's fault, this run dropped 85 of
    its 204 samples as stale and trained 22 of the 34 prompts."""
    server = start_server(*SERVER_ARGS)
    out = tmp_path / "out"
    tokenizer.chat_template = h.RERENDERING_TEMPLATE
    run(server, toy_dir, out, loop_cls=h.ThreeTurnLoop, tokenizer=tokenizer,
        dataset=toy.make_dataset(17), num_generations=2, max_completion_length=4,
        per_device_train_batch_size=8, token_budget=None, max_staleness=1, num_train_epochs=2,
        log_completions=True)
    records = strict_lines(out)
    assert {r.get("rollout/samples_per_rollout", 3.0) for r in records} == {3.0}
    assert {r["prompt_index"] for r in load_completions(str(out))} == set(range(34))
    assert records[-1]["sample/dropped_stale_total"] < 0.05 * 34 * 2 * 3


# ── input errors at construction ────────────────────────────────────────────────────────────


ROWS = [{"prompt": [{"role": "user", "content": "1+1="}], "environment": "counter"}] * 2


@pytest.mark.parametrize("kwargs, error", [
    (dict(train_dataset=None), "`train_dataset` is required"),
    (dict(train_dataset=None, reward_funcs=None, environment_factory=h.PromptEnv),
     "set max_steps > 0"),
    (dict(train_dataset=None, environment_factory={"counter": h.Counter}),
     "requires a `train_dataset`"),
    (dict(train_dataset=Dataset.from_list(ROWS + [dict(ROWS[0], environment="chess")]),
          environment_factory={"counter": h.Counter}),
     r"dataset row 2: environment 'chess' is not among the environments \['counter'\]"),
    (dict(train_dataset=Dataset.from_list([{"prompt": "1+1="}, {"prompt": None}])),
     "dataset row 1: the prompt is None"),
    (dict(train_dataset=Dataset.from_list([{"prompt": "1+1="}, {"prompt": ""}])),
     "dataset row 1: the prompt is ''"),
    (dict(reward_funcs=None, train_dataset=toy.make_dataset(2)), "No reward source provided"),
], ids=["no dataset", "environment data without max_steps", "dict factory without dataset",
        "unknown environment", "None prompt", "empty prompt", "no reward source"])
def test_input_errors_are_refused_at_construction_naming_the_row(kwargs, error):
    """AsyncGRPOTrainer refuses them before any model is loaded (the model here does not exist).
    Where TRL's own constructor tests (AsyncGRPOTrainer's, GRPOTrainer's) match a phrase, the
    error holds it: "`train_dataset` is required", "max_steps", "requires a `train_dataset`",
    "not among the environments", "No reward source provided"."""
    kwargs = dict(reward_funcs=h.rank_reward) | kwargs
    with pytest.raises(ValueError, match=error):
        train.AsyncGRPOTrainer("no/such/model", **kwargs)
