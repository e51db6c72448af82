"""記録されたメトリクス (Logged metrics): the trainer's side of them, and the rollout metrics it
drains from the rollout process. Per optimizer step rank 0 gathers, and every logging_steps steps
writes one line of <output_dir>/metrics.jsonl:

    sample/*  the samples the step took from the queue  forwarded/trained tokens, queue size and
                                                         wait, staleness, dropped_stale_total;
                                                         reward_group_std, rewards/<func>/...
    batch/*   the planned rows                           the planner's row metrics, *_per_step sums,
                                                         dropped_oversize_total
    perf/*    timings (Timer, weight_sync.py)            + tokens/s and MFU on both time bases
    loss.py   loss, sampling/*, clip_ratio/*, entropy    reduced over micro-batches and ranks
    rollout   rollout/*, completions/*, tools/*, env/*, reward, reward_kept, frac_reward_zero_std

num_tokens and the trainer's *_total are the run's TrainState counters (checkpoint.py): a resume
continues them.

A window of several steps (or rollout emissions) reduces by name (reduce_window). Worked: two steps
with sample/staleness_max 1 and 3, sample/dropped_stale_total 4 and 6, and perf/step_s 2.0 and 3.0
log sample/staleness_max 3 (a max), sample/dropped_stale_total 6 (a running total: the last) and
perf/step_s 2.5 (the mean).

report_to's dashboards (train_dashboards.py) get each line as written, and with log_completions
the completions as a table; on_log (the trainer's callbacks) gets each line too. With
log_completions every trained sample also goes to completions.jsonl (train_completions.py).

Departures from the spec, one line each:
- Completions print as plain text, not with rich: one dependency less.
"""
import contextlib
import json
import logging
import math
import os
import time

import numpy as np
import torch

import train_completions
import train_dashboards

log = logging.getLogger(__name__)

# dense peak FLOP/s per device (bf16 tensor cores; fp32 without TF32), from the vendors' datasheets
PEAK_FLOPS = {"bf16": {"B200": 2.25e15, "H200": 989e12, "H100": 989e12, "H800": 989e12,
                       "A100": 312e12, "L40S": 362e12, "MI300X": 1307e12, "MI325X": 1307e12},
              "fp32": {"B200": 80e12, "H200": 67e12, "H100": 67e12, "A100": 19.5e12,
                       "L40S": 91.6e12}}
SUMMED = ("rollout/backpressure_s", "rollout/admission_wait_s", "rollout/score_block_s",
          "rollout/vllm_preemptions_total")     # amounts since the last emission: a window sums


def reduce_window(records: list[dict]) -> dict[str, float]:
    """Many metric dicts → one, by name: SUMMED the sum (rollout/vllm_preemptions_total: the
    spec's count during the window), other `*_total` are running totals (the last value), a name
    whose last part holds "max" the max, "min" the min, everything else the mean. None and NaN
    values are skipped (module docstring: a worked example)."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(k for r in records for k in r):
        values = [r[name] for r in records
                  if name in r and r[name] is not None and not _nan(r[name])]
        if not values:
            continue
        if name in SUMMED:
            out[name] = float(sum(values))
        elif name.endswith("_total"):
            out[name] = values[-1]
        elif "max" in name.rsplit("/", 1)[-1]:
            out[name] = float(max(values))
        elif "min" in name.rsplit("/", 1)[-1]:
            out[name] = float(min(values))
        else:
            out[name] = float(np.mean(values))
    return out


def _nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def sample_metrics(feed) -> dict[str, float]:
    """sample/* and the per-sample reward metrics of the samples one step took from the queue
    (train.py's Feed); the running total from the run's TrainState."""
    s = feed.samples
    out = {"sample/rollout_queue_size": float(feed.queue_size),
           "sample/dropped_stale_total": float(feed.state.dropped_stale_total)}
    if s:
        lengths = [len(x.input_ids) for x in s]
        trained = [int(x.completion_mask.sum()) for x in s]
        out |= {"sample/forwarded_tokens_mean": float(np.mean(lengths)),
                "sample/forwarded_tokens_max": max(lengths),
                "sample/trained_tokens_mean": float(np.mean(trained)),
                "sample/time_in_queue_s": float(np.mean(feed.queue_s)),
                "sample/staleness_mean": float(np.mean(feed.stale_seen)),
                "sample/staleness_max": max(feed.stale_seen)}
        out |= reduce_window([x.metrics for x in s])   # reward_group_std, rewards/<func>/...
    return out


def batch_metrics(feed) -> dict[str, float]:
    """batch/*: the planner's row metrics per micro-batch of the step Feed planned (reduced over
    the step), the step's sums, and the running total from the run's TrainState."""
    packed = feed.packed                                # [GA][world] PackedRow
    rows = [p for micro in packed for p in micro]
    groups = set().union(*(row.group_ids for micro in feed.rows for row in micro))
    out = reduce_window([feed.planner.metrics(micro) for micro in packed])
    out |= {"batch/dropped_oversize_total": float(feed.state.dropped_oversize_total),
            "batch/forwarded_tokens_per_step": sum(p.unique_tokens for p in rows),
            "batch/trained_tokens_per_step": sum(p.trained_tokens for p in rows),
            "batch/samples_per_step": sum(p.num_samples for p in rows),
            "batch/groups_per_step": len(groups),
            "batch/microbatches_per_step": len(packed)}
    return out


class Timer:
    """perf/fwd_s, perf/fwd_bwd_s, perf/optimizer_s: seconds per phase, summed over a step's rows;
    synchronised with the device so asynchronous kernels are counted.

        timer = Timer(device)
        with timer("fwd_s"): ...        # also "bwd_s", "optimizer_s"
        timer.metrics()                 # {"perf/fwd_s": ..., "perf/fwd_bwd_s": ..., ...}
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.total = {"fwd_s": 0.0, "bwd_s": 0.0, "optimizer_s": 0.0}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.total[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {"perf/fwd_s": self.total["fwd_s"],
                "perf/fwd_bwd_s": self.total["fwd_s"] + self.total["bwd_s"],
                "perf/optimizer_s": self.total["optimizer_s"]}


class FlopCounter:
    """Model FLOPs of packed rows, for MFU: 2·P·N (matmuls) + 4·L·Hq·D·pairs (attention) + 2·V·H·M
    (the LM head at the loss terms), ×3 for forward + backward. P: decoder-layer parameters, N:
    forwarded tokens, pairs: the row's attention_cost (its trie's score pairs, not the raw
    samples'), M: trained tokens. MFU divides by the local device's dense peak (PEAK_FLOPS) at the
    compute precision, times the world size."""

    def __init__(self, model):
        import tree_attention
        text = tree_attention.text_config(model)
        self.p = sum(p.numel() for p in tree_attention.decoder_layers(model).parameters())
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.attn = 4 * text.num_hidden_layers * text.num_attention_heads * head_dim
        self.head = 2 * text.vocab_size * text.hidden_size

    def __call__(self, rows) -> float:
        return 3.0 * sum(2 * self.p * r.unique_tokens + self.attn * r.attention_cost
                         + self.head * r.trained_tokens for r in rows)


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = PEAK_FLOPS["bf16" if bf16 else "fp32"]
    return next((v for k, v in table.items() if k in name), None)


class MetricsLog:
    """Rank 0's metrics: per-step records, one JSONL line per logging window (logging_steps; also
    after step 1 with logging_first_step; none with logging_strategy="no"), the same line on each
    report_to dashboard and to on_log, a progress bar, and the completions when log_completions is
    set."""

    def __init__(self, config, output_dir: str, state, model, device, tokenizer, on_log=None):
        from tqdm import tqdm
        os.makedirs(output_dir, exist_ok=True)
        self.config = config
        self.tokenizer = tokenizer
        self.window: list[dict] = []         # this logging window's per-step records
        self.last: dict = {}                 # the last line written
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.flops = FlopCounter(model)
        self.peak = peak_flops(device, config.compute_dtype(device) != torch.float32)
        self.world = torch.distributed.get_world_size()
        self.every = config.every("logging_steps") if config.logging_strategy == "steps" else None
        self.on_log = on_log
        self.completions: list = []          # the samples trained in this logging window
        truncated = config.top_k > 0 or config.top_p < 1 or config.min_p is not None
        self.warn_bias = truncated           # once, if samples come without candidate sets
        self.prompted = train_completions.truncate(output_dir, state.global_step)
        self.completions_file = (open(os.path.join(output_dir, train_completions.FILE), "a")
                                 if config.log_completions else None)
        self.dashboards = train_dashboards.open_dashboards(config, output_dir)
        self.bar = tqdm(total=config.max_steps if config.max_steps > 0 else None,
                        initial=state.global_step, unit="step", dynamic_ncols=True,
                        disable=config.disable_tqdm)           # None: on a tty only

    def step(self, state, metrics: dict, feed) -> None:
        """Record one optimizer step: its loss and timings (`metrics`), and what `feed` (train.py's
        Feed) took and planned for it."""
        record = dict(metrics) | sample_metrics(feed) | batch_metrics(feed)
        rows = [p for micro in feed.packed for p in micro]
        forwarded = record["batch/forwarded_tokens_per_step"]
        trained = record["batch/trained_tokens_per_step"]
        record |= {"num_tokens": float(state.num_tokens),
                   "perf/rollout_wait_s": feed.waited_s,
                   "perf/forwarded_tok_s_fwd_bwd": forwarded / max(record["perf/fwd_bwd_s"], 1e-9),
                   "perf/forwarded_tok_s_wall_clock": forwarded / record["perf/step_s"],
                   "perf/trained_tok_s_wall_clock": trained / record["perf/step_s"]}
        if self.peak is not None:
            flops = self.flops(rows) / (self.peak * self.world)
            record |= {"perf/mfu_fwd_bwd": flops / record["perf/fwd_bwd_s"],
                       "perf/mfu_wall_clock": flops / record["perf/step_s"]}
        self.window.append(record)
        samples = [s for micro in feed.rows for row in micro for s in row.samples]  # trained now
        if self.completions_file is not None:
            lines = train_completions.records(state.global_step, feed.version, samples,
                                              self.prompted)
            self.completions_file.writelines(json.dumps(r) + "\n" for r in lines)
            self.completions_file.flush()
        if self.config.log_completions:
            self.completions += samples
        if self.warn_bias and all(s.candidate_counts is None for s in samples):
            self.warn_bias = False
            warn_biased_ratios(record, state.global_step)
        self.bar.update(1)
        first = self.config.logging_first_step and state.global_step == 1
        if self.every is not None and (state.global_step % self.every == 0 or first):
            self.flush(state.global_step, feed.worker)

    def flush(self, step: int, worker) -> None:
        rollout = reduce_window(worker.drain_metrics())
        line = {"step": step, "time": time.time()} | rollout | reduce_window(self.window)
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        self.last = line
        self.window = []
        shown = {k: f"{line[k]:.3g}" for k in ("reward", "loss", "perf/step_s") if k in line}
        self.bar.set_postfix(shown, refresh=False)
        train_dashboards.log_line(self.dashboards, line)
        if self.config.log_completions:
            rows = self.completion_rows()
            for prompt, completion, reward in rows:
                self.bar.write(f"  reward {reward:+.2f}  {prompt!r} → {completion!r}")
            train_dashboards.log_table(self.dashboards, step, rows)
        self.completions = []
        if self.on_log is not None:
            self.on_log(line)

    def completion_rows(self) -> list[tuple[str, str, float]]:
        """(prompt, completion, reward) of num_completions_to_print samples (None: all)."""
        n = self.config.num_completions_to_print
        rows = []
        for s in self.completions[:n] if n is not None else self.completions:
            prompt = s.prompt[-1]["content"] if isinstance(s.prompt, list) else s.prompt
            rows.append((prompt, train_completions.text(s.completion), float(s.reward)))
        return rows

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.completions_file is not None:
            self.completions_file.close()
        train_dashboards.close_dashboards(self.dashboards)


def warn_biased_ratios(record: dict, step: int) -> None:
    """Say how biased the importance ratios are when top_k/top_p/min_p sampled the samples but
    they carry no candidate sets: log π_θ is then normalised over the vocabulary, and each
    token's ratio is low by the π_θ mass of its candidate set, which the mean ratio shows."""
    ratio = record.get("sampling/importance_sampling_ratio/mean", float("nan"))
    masked = record.get("sampling/masked_mean", float("nan"))
    log.warning("top_k/top_p/min_p sampled step %d's samples, but they carry no candidate sets "
                "(the server returns none): sampling/importance_sampling_ratio/mean is %.3f, "
                "biased low by %.1f%% (an unchanged policy gives 1), and sampling/masked_mean "
                "%.3f of the tokens fall outside the IS bounds. Serve with "
                "--return-sampling-mask --enable-scale-out, or sample with top_k=0, top_p=1",
                step, ratio, 100 * (1 - ratio), masked)


def plot(run_dir: str) -> str:
    """<run_dir>/metrics.png: reward, loss, staleness and throughput by step, from metrics.jsonl;
    with a completions.jsonl (log_completions) also the mean reward of each prompt_index and the
    completion length by step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    panels = [("reward", ["reward", "reward_kept"]), ("loss", ["loss"]),
              ("staleness (versions)", ["sample/staleness_mean", "sample/staleness_max"]),
              ("throughput (tokens/s)",
               ["perf/forwarded_tok_s_wall_clock", "perf/trained_tok_s_wall_clock"])]
    trained = (train_completions.load(run_dir)
               if os.path.exists(os.path.join(run_dir, train_completions.FILE)) else [])
    fig, axes = plt.subplots(3 if trained else 2, 2, figsize=(11, 10 if trained else 7))
    for ax, (title, names) in zip(axes.flat, panels):
        for name in names:
            points = [(r["step"], r[name]) for r in lines if name in r]
            if points:
                ax.plot(*zip(*points), label=name)
        ax.set_title(title)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    if trained:
        by_prompt = train_completions.reward_by_prompt(trained)
        axes[2, 0].plot(list(by_prompt), list(by_prompt.values()), ".", label="mean reward")
        axes[2, 0].set(title="reward by prompt (completions.jsonl)", xlabel="prompt_index")
        tokens: dict[int, list[int]] = {}
        for r in trained:
            tokens.setdefault(r["step"], []).append(r["completion_tokens"])
        axes[2, 1].plot(list(tokens), [np.mean(v) for v in tokens.values()],
                        label="completion_tokens")
        axes[2, 1].set(title="completion length (tokens)", xlabel="optimizer step")
        for ax in axes[2]:
            ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.abspath(run_dir))
    fig.tight_layout()
    path = os.path.join(run_dir, "metrics.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
