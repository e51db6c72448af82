"""metrics.py: every metric the spec names in the session's shared run
(conftest.train_run), completions.jsonl, the one reduction rule by name, and the importance
ratios with and without the server's candidate sets (the hazard said once, at start); last,
report_to's dashboards offline (tensorboard, wandb, trackio), each run in a subprocess."""
import glob
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import loss
import toy
import train
import metrics
from conftest import ROOT
from rollout_helpers import rank_reward
from tools.plot import load_completions
from train_helpers import SERVER_ARGS, SMALL, lines

SPEC_NAMES = {  # 記録されたメトリクス (Logged metrics): the trainer's side (no MFU on a CPU)
    "sample/forwarded_tokens_mean", "sample/forwarded_tokens_max", "sample/trained_tokens_mean",
    "sample/rollout_queue_size", "sample/time_in_queue_s", "sample/staleness_mean",
    "sample/staleness_max", "sample/dropped_stale_total", "reward_group_std",
    "rewards/sum_reward/mean", "rewards/sum_reward/group_std",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "num_tokens", "sampling/mismatch_kl",
    "sampling/logprob_diff_max", "sampling/mismatch_tokens",
    "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step", "batch/samples_per_step",
    "batch/groups_per_step", "batch/microbatches_per_step", "batch/masked_token_frac",
    "batch/samples_per_row", "batch/row_tokens_mean", "batch/row_tokens_max", "batch/row_fill_frac",
    "batch/row_imbalance", "batch/packing_ratio", "batch/pad_frac", "batch/dropped_oversize_total",
    "perf/step_s", "perf/fwd_bwd_s", "perf/fwd_s", "perf/optimizer_s", "perf/rollout_wait_s",
    "perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s",
    "perf/weight_sync_transfer_s", "perf/forwarded_tok_s_fwd_bwd",
    "perf/forwarded_tok_s_wall_clock",
    "perf/trained_tok_s_wall_clock", "reward", "frac_reward_zero_std", "rollout/concurrency_cap",
    "completions/mean_length"}


def test_every_trainer_metric_the_spec_names_is_logged(train_run):
    out, last = train_run
    records = lines(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and last == records[-1]
    names = set().union(*records)
    assert SPEC_NAMES <= names, sorted(SPEC_NAMES - names)
    assert not any(name.startswith("perf/mfu") for name in names)   # the spec allows none on a CPU
    for r in records:   # the hierarchy the spec describes: a step is its micro-batches of rows
        assert r["batch/microbatches_per_step"] == 1
        assert r["batch/samples_per_step"] == r["batch/samples_per_row"]  # 1 row-slot: GA 1, 1 rank
    tokens = [r["num_tokens"] for r in records]
    assert tokens == sorted(tokens)
    assert tokens[-1] == sum(r["batch/forwarded_tokens_per_step"] for r in records)


def test_the_served_policy_is_the_trained_one_at_every_step(train_run):
    """max_staleness 0: every trained token was sampled by the weights the trainer holds, so the
    parity figure covers all of them, and in fp32 against the stand-in it is ~0 (k3 <= 1e-6)."""
    records = lines(train_run[0])
    for r in records:
        assert r["sampling/mismatch_tokens"] == r["batch/trained_tokens_per_step"] > 0, r["step"]
        assert 0 <= r["sampling/mismatch_kl"] <= 1e-6, (r["step"], r["sampling/mismatch_kl"])
        assert r["sampling/logprob_diff_max"] <= 1e-3, r["step"]


def test_completions_jsonl_holds_one_line_per_trained_sample(train_run, tmp_path):
    """log_completions: each step's trained samples (batch/samples_per_step of them), the prompt
    text once per prompt_index; a resume's truncation keeps the checkpoint's steps."""
    out = train_run[0]
    trained = load_completions(out)
    per_step = {r["step"]: r["batch/samples_per_step"] for r in lines(out)}
    assert {s: sum(r["step"] == s for r in trained) for s in per_step} == per_step
    for r in trained:
        assert r["staleness"] == 0 and r["model_version"] == r["step"] - 1   # max_staleness 0
        assert r["prompt"] and r["completion_tokens"] > 0 and isinstance(r["completion"], str)
        assert {"reward", "advantage", "prompt_index"} <= set(r)
    raw = [json.loads(x) for x in open(os.path.join(out, metrics.COMPLETIONS))]
    assert len([r for r in raw if "prompt" in r]) == len({r["prompt_index"] for r in raw})
    shutil.copy(os.path.join(out, metrics.COMPLETIONS), tmp_path)
    with open(tmp_path / metrics.COMPLETIONS, "a") as f:
        f.write('{"step": 5, "prompt_in')                       # a kill mid-write
    kept = metrics.cut_back(str(tmp_path), 2)[metrics.COMPLETIONS]
    assert kept == [r for r in raw if r["step"] <= 2]
    assert [r["step"] for r in load_completions(str(tmp_path))] == [
        r["step"] for r in trained if r["step"] <= 2]


def test_a_window_reduces_by_name_as_the_module_docstring_works_it():
    steps = [{"sample/staleness_max": 1, "sample/dropped_stale_total": 4, "perf/step_s": 2.0,
              "batch/row_tokens_min": 7, "rollout/backpressure_s": 0.5, "loss": math.nan,
              "rollout/kv_cache_usage": 0.9},
             {"sample/staleness_max": 3, "sample/dropped_stale_total": 6, "perf/step_s": 3.0,
              "batch/row_tokens_min": 5, "rollout/backpressure_s": 0.25, "loss": None,
              "rollout/kv_cache_usage": 0.2}]
    assert metrics.reduce_window(steps) == {
        "sample/staleness_max": 3.0,          # a max
        "sample/dropped_stale_total": 6,      # a running total: the last value
        "perf/step_s": 2.5,                   # the mean
        "batch/row_tokens_min": 5.0,          # a min
        "rollout/backpressure_s": 0.75,       # a time amount: the sum; NaN and None are skipped
        "rollout/kv_cache_usage": 0.2,        # spec: the value at the last poll
        "loss": None}                         # none finite, one None (a skipped step): null


@pytest.mark.parametrize("name, how", [
    ("sample/staleness_max", "max"), ("completions/max_length", "max"),
    ("sampling/logprob_diff_max", "max"), ("sampling/importance_sampling_ratio/min", "min"),
    ("completions/min_length", "min"),
    ("rollout/admission_wait_s", "sum"),          # "min" inside a word: not a min
    ("rollout/vllm_preemptions_total", "sum"), ("sample/dropped_stale_total", "last"),
    ("rollout/kv_cache_usage", "last"), ("sampling/mismatch_tokens", "mean"),
    ("rewards/max_len/mean", "mean"),             # a reward function's name: not the last part
])
def test_one_rule_reduces_a_metric_by_name_over_windows_rows_and_ranks(name, how):
    """metrics.reduction decides the logging window's reduction, the rows' (loss.reduce_metrics)
    and the ranks' (train.rank_reduce_op): a min or max there too, the rest adds up there (means
    are [sum, count] pairs)."""
    assert metrics.reduction(name) == how
    window = {"sum": 7.0, "last": 5.0, "max": 5.0, "min": 2.0, "mean": 3.5}[how]
    assert metrics.reduce_window([{name: 2.0}, {name: 5.0}]) == {name: window}
    rows = loss.reduce_metrics([{name: torch.tensor(2.0)}, {name: torch.tensor(5.0)}])
    assert float(rows[name]) == {"max": 5.0, "min": 2.0}.get(how, 7.0)
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    assert train.rank_reduce_op(name) == ops.get(how, dist.ReduceOp.SUM)


@pytest.mark.parametrize("sampling", [dict(top_p=0.9, top_k=50), dict(top_k=5)],
                         ids=["top_p 0.9", "top_k 5"])
def test_importance_ratios_of_an_unchanged_policy_are_one_with_candidate_sets(
        start_server, toy_dir, tmp_path, sampling):
    """learning_rate 0: the trainer's policy is the sampler's, so π_θ / π_sampler is 1 on every
    token once log π_θ is renormalised over the candidate set each token was drawn from. (The
    reward ranks the rollouts, so every group trains: the toy's sum_reward, under top-k 5, kept
    no group in a pass of 16 prompts, which stops a max_steps run.)"""
    server = start_server(*SERVER_ARGS, "--return-sampling-mask", "--enable-scale-out")
    config = train.AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=server.url,
                                   max_steps=2, save_strategy="no",
                                   **(SMALL | dict(learning_rate=0.0) | sampling))
    train.train(config, toy.make_dataset(16), [rank_reward], model=toy_dir)
    for r in lines(str(tmp_path)):
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) <= 0.005, r["step"]
        assert r["sampling/masked_mean"] == 0


def test_without_candidate_sets_the_hazard_is_said_once_at_start_with_the_remedy(
        start_server, toy_dir, tmp_path, capfd, caplog, recwarn):
    """The same run against a server that returns no candidate sets: the ratios fall (by the π_θ
    mass outside each top-5 set), and the rollout process says why once, at start, naming the
    server and the remedy; neither the loss nor the metrics say it again, in any channel."""
    server = start_server(*SERVER_ARGS)
    config = train.AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=server.url,
                                   max_steps=2, save_strategy="no",
                                   **(SMALL | dict(learning_rate=0.0, top_k=5)))
    with caplog.at_level(logging.INFO):
        train.train(config, toy.make_dataset(16), [rank_reward], model=toy_dir)
    assert lines(str(tmp_path))[0]["sampling/importance_sampling_ratio/mean"] < 0.9
    said = [line for line in capfd.readouterr().err.splitlines() if "candidate sets" in line]
    assert len(said) == 1, said                                # the rollout process's log
    assert f"the vLLM server at {server.url} returns no candidate sets" in said[0]
    assert "every importance ratio is biased low" in said[0]
    assert "--return-sampling-mask --enable-scale-out" in said[0] and "top_k=0" in said[0]
    assert not [r for r in caplog.records if "candidate sets" in r.getMessage()]
    assert not [w for w in recwarn if "candidate sets" in str(w.message)]


# ── dashboards, offline ──────────────────────────────────────────────────────────────────────

DASHBOARD_SCRIPT = """
import sys
import metrics
from config import AsyncGRPOConfig
config = AsyncGRPOConfig(report_to=[sys.argv[2]], run_name="surface-run", project="surface")
boards = metrics.open_dashboards(config, sys.argv[1])
for step in (1, 2):
    for board in boards:
        board.log({"reward": 0.25 * step, "rollout/backpressure_s": 1.5}, step)
for board in boards:
    board.table(2, [("1+1=", "2", 1.0)])
    board.log({"eval/pass@1": 0.75}, 1)      # an evaluation asked at step 1, done after step 2
    board.close()
"""


def log_offline(tmp_path, name: str) -> None:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true",
               TRACKIO_DIR=str(tmp_path / "trackio"), PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", DASHBOARD_SCRIPT, str(tmp_path), name], check=True,
                   env=env, cwd=ROOT, timeout=240)


def test_tensorboard_gets_the_metrics_names_steps_and_completions(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log_offline(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "runs" / "surface-run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/pass@1")] == [(1, 0.75)]
    assert "rollout/backpressure_s" in events.Tags()["scalars"]
    texts = events.Tags()["tensors"]
    assert any("completions" in t for t in texts) and any("config" in t for t in texts)


def test_wandb_offline_run_holds_the_metrics_config_and_table(tmp_path):
    """The offline run's record log (run-*.wandb, protobuf records) holds the metric names, the run
    name and the config, and the evaluation's line logged at a step below the last (wandb drops
    such a line at its own step: the x-axis is train/global_step); the completions table is
    written as its media file."""
    pytest.importorskip("wandb", reason="wandb is not installed")
    log_offline(tmp_path, "wandb")
    run_dir, = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    record, = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(record, "rb").read()
    for text in (b"reward", b"rollout/backpressure_s", b"surface-run", b"max_staleness",
                 b"eval/pass@1", b"train/global_step"):
        assert text in data, text
    table, = glob.glob(os.path.join(run_dir, "files", "media", "table", "completions_2_*.json"))
    with open(table) as f:
        assert json.load(f)["data"] == [[2, "1+1=", "2", 1.0]]


def test_trackio_local_store_holds_the_metrics(tmp_path):
    pytest.importorskip("trackio", reason="trackio is not installed")
    log_offline(tmp_path, "trackio")
    script = ("from trackio.sqlite_storage import SQLiteStorage; import json; "
              "print(json.dumps(SQLiteStorage.get_logs('surface', 'surface-run'), default=str))")
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"))
    out = subprocess.run([sys.executable, "-c", script], check=True, env=env,
                         capture_output=True, text=True, timeout=120).stdout
    logs = json.loads(out.strip().splitlines()[-1])
    assert [row["reward"] for row in logs if "reward" in row] == [0.25, 0.5]
    assert [row["eval/pass@1"] for row in logs if "eval/pass@1" in row] == [0.75]
    assert any("completions" in row for row in logs)


@pytest.mark.parametrize("static, frozen", [("me/run-static", "me/run-static"), (None, None),
                                            (False, "none")])
def test_trackio_gets_its_space_bucket_and_static_space_as_transformers_passes_them(
        tmp_path, monkeypatch, static, frozen):
    """trackio_space_id and trackio_bucket_id reach trackio.init (TRL's gsm8k example sets the
    first: it was refused); at the end the Space is frozen into trackio_static_space_id (None:
    trackio names it; False: no freeze), as transformers' TrackioCallback does. trackio's own
    init, log, finish and freeze are patched: no test reaches a hub."""
    trackio = pytest.importorskip("trackio", reason="trackio is not installed")
    calls = []
    for name in ("init", "log", "finish", "freeze"):
        monkeypatch.setattr(trackio, name,
                            lambda *args, _name=name, **kwargs: calls.append((_name, kwargs)))
    config = train.AsyncGRPOConfig(report_to="trackio", project="surface", run_name="run",
                                   trackio_space_id="me/live", trackio_bucket_id="me/bucket",
                                   trackio_static_space_id=static)
    board, = metrics.open_dashboards(config, str(tmp_path))
    board.log({"reward": 0.5}, 1)
    board.close()
    (_, init), log, finish, *freeze = calls
    assert (init["project"], init["name"], init["space_id"], init["bucket_id"]) == (
        "surface", "run", "me/live", "me/bucket")
    assert log == ("log", {"step": 1}) and finish[0] == "finish"
    assert freeze == ([] if frozen == "none" else [("freeze", {
        "space_id": "me/live", "project": "surface", "new_space_id": frozen})])


def test_trackio_without_a_space_logs_to_its_local_store_and_freezes_nothing(tmp_path,
                                                                            monkeypatch):
    trackio = pytest.importorskip("trackio", reason="trackio is not installed")
    calls = []
    for name in ("init", "finish", "freeze"):
        monkeypatch.setattr(trackio, name,
                            lambda *args, _name=name, **kwargs: calls.append((_name, kwargs)))
    board, = metrics.open_dashboards(train.AsyncGRPOConfig(report_to="trackio"), str(tmp_path))
    board.close()
    assert [name for name, _ in calls] == ["init", "finish"]
    assert calls[0][1]["space_id"] is None and calls[0][1]["bucket_id"] is None
