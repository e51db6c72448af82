"""train_metrics.py: every metric the spec names in the session's shared run
(train_fixtures.train_run), the plot of that run, and the window reduction by name."""
import math
import os

import train_metrics
from train_helpers import lines

pytest_plugins = ["train_fixtures"]

SPEC_NAMES = {  # 記録されたメトリクス (Logged metrics): the trainer's side (no MFU on a CPU)
    "sample/forwarded_tokens_mean", "sample/forwarded_tokens_max", "sample/trained_tokens_mean",
    "sample/rollout_queue_size", "sample/time_in_queue_s", "sample/staleness_mean",
    "sample/staleness_max", "sample/dropped_stale_total", "reward_group_std",
    "rewards/sum_reward/mean", "rewards/sum_reward/group_std",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "num_tokens",
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


def test_plot_draws_the_run(train_run):
    path = train_metrics.plot(train_run[0])
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_a_window_reduces_by_name_as_the_module_docstring_works_it():
    steps = [{"sample/staleness_max": 1, "sample/dropped_stale_total": 4, "perf/step_s": 2.0,
              "batch/row_tokens_min": 7, "rollout/backpressure_s": 0.5, "loss": math.nan},
             {"sample/staleness_max": 3, "sample/dropped_stale_total": 6, "perf/step_s": 3.0,
              "batch/row_tokens_min": 5, "rollout/backpressure_s": 0.25, "loss": None}]
    assert train_metrics.reduce_window(steps) == {
        "sample/staleness_max": 3.0,          # a max
        "sample/dropped_stale_total": 6,      # a running total: the last value
        "perf/step_s": 2.5,                   # the mean
        "batch/row_tokens_min": 5.0,          # a min
        "rollout/backpressure_s": 0.75}       # a time amount: the sum; NaN and None are skipped
