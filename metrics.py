"""The logged metrics: the trainer's side of them, and the rollout metrics it drains from the
rollout process (spec: 記録されたメトリクス (Logged metrics)). Per optimizer step rank 0 gathers,
and every logging_steps steps writes one line of <output_dir>/metrics.jsonl:

    sample/*  the samples the step took from the queue  forwarded/trained tokens, queue size and
                                                         wait, staleness, dropped_stale_total;
                                                         reward_group_std, rewards/<func>/...
    batch/*   the planned rows                           the planner's row metrics, *_per_step sums,
                                                         dropped_oversize_total
    perf/*    timings (Timer, weight_sync.py)            + tokens/s and MFU on both time bases
    loss.py   loss, sampling/*, clip_ratio/*, entropy    reduced over micro-batches and ranks
    train.py  skipped_steps_total (ours)                 steps not applied (loss, grad_norm: null)
    rollout   rollout/*, completions/*, tools/*, env/*, reward, reward_kept, frac_reward_zero_std
              (also on a line of their own while the trainer waits and every group is dropped)

num_tokens and the trainer's *_total are the run's TrainState counters (checkpoint.py): a resume
continues them.

A window of several steps (or rollout emissions) reduces by name (reduction). Worked: two steps
with sample/staleness_max 1 and 3, sample/dropped_stale_total 4 and 6, and perf/step_s 2.0 and 3.0
log sample/staleness_max 3 (a max), sample/dropped_stale_total 6 (a running total: the last) and
perf/step_s 2.5 (the mean).

Sections below: the reduction by name and the step's figures; MetricsLog (the JSONL line, the
progress bar, on_log); completions.jsonl (log_completions: what was trained); report_to's
dashboards (tensorboard, wandb, trackio: the same line at the same step). The figure of a run
(a PNG) is drawn outside the trainer: `python -m tools.plot RUN_DIR`.

    completions.jsonl, one line per trained sample (a resume cuts it back to its checkpoint, and
    metrics.jsonl too: cut_back):
    {"step": 12, "prompt_index": 37, "model_version": 10, "staleness": 1, "reward": 0.8,
     "advantage": 0.5, "completion_tokens": 6, "completion": "3 + 4 = 7", "prompt": "3 + 4 ="}

Departures from the spec, one line each:
- Completions print as plain text, not with rich: one dependency less.
- Every trained sample is written to completions.jsonl; the console prints num_completions_to_print.
- tensorboard has no table type: the completions are a markdown table under the text tab.
- project names the wandb project too (transformers reads WANDB_PROJECT); that variable still wins.
"""
import contextlib
import importlib.util
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

import tree_attention
from config import DASHBOARDS
from loss import extreme

COMPLETIONS = "completions.jsonl"                     # log_completions: every trained sample
COLUMNS = ["step", "prompt", "completion", "reward"]  # the completions table on a dashboard

# dense peak FLOP/s per device (bf16 tensor cores; fp32 without TF32), from the vendors' datasheets
PEAK_FLOPS = {"bf16": {"B200": 2.25e15, "H200": 989e12, "H100": 989e12, "H800": 989e12,
                       "A100": 312e12, "L40S": 362e12, "MI300X": 1307e12, "MI325X": 1307e12},
              "fp32": {"B200": 80e12, "H200": 67e12, "H100": 67e12, "A100": 19.5e12,
                       "L40S": 91.6e12}}
SUMMED = ("rollout/backpressure_s", "rollout/admission_wait_s", "rollout/score_block_s",
          "rollout/vllm_preemptions_total")     # amounts since the last emission: a window sums
LATEST = ("rollout/kv_cache_usage",)            # spec: the value at the last poll
WAITING_LINE_S = 60.0   # while every group is dropped and the trainer waits: a line this often
EVAL_MARK = "eval/prompts"  # what every evaluation's line has (rollout.scoring.eval_metrics)


def reduction(name: str) -> str:
    """How metric `name` combines, over a logging window (reduce_window) and over a step's rows and
    ranks (loss.reduce_metrics): "sum" for SUMMED (rollout/vllm_preemptions_total: the spec's
    count during the window), "last" for the other `*_total` and LATEST, "max" or "min" when its
    last part has that word (loss.extreme: sample/staleness_max, completions/min_length), else
    "mean" (loss.py's means are [sum, count] pairs: rows and ranks add them up)."""
    if name in SUMMED:
        return "sum"
    if name.endswith("_total") or name in LATEST:
        return "last"
    return extreme(name) or "mean"


REDUCE = {"sum": sum, "last": lambda values: values[-1], "max": max, "min": min, "mean": np.mean}


def reduce_window(records: list[dict]) -> dict[str, float]:
    """Many metric dicts → one, each name by its reduction. None and non-finite values are
    skipped; a name left with none logs None (JSON null) if one was None, as a skipped step's
    loss and grad_norm, else nothing (module docstring: a worked example)."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(k for r in records for k in r):
        present = [r[name] for r in records if name in r]
        values = [v for v in present if v is not None and math.isfinite(v)]
        if values:
            out[name] = float(REDUCE[reduction(name)](values))
        elif None in present:
            out[name] = None
    return out


def sample_metrics(step, state) -> dict[str, float]:
    """sample/* and the per-sample reward metrics of the samples one step took from the queue
    (`step`: train.py's Step); the running total from the run's TrainState."""
    s = step.samples
    out = {"sample/rollout_queue_size": float(step.queue_size),
           "sample/dropped_stale_total": float(state.dropped_stale_total)}
    if s:
        lengths = [len(x.input_ids) for x in s]
        trained = [int(x.completion_mask.sum()) for x in s]
        staleness = [step.version - x.model_version for x in s]
        out |= {"sample/forwarded_tokens_mean": float(np.mean(lengths)),
                "sample/forwarded_tokens_max": max(lengths),
                "sample/trained_tokens_mean": float(np.mean(trained)),
                "sample/time_in_queue_s": float(np.mean(step.queue_s)),
                "sample/staleness_mean": float(np.mean(staleness)),
                "sample/staleness_max": max(staleness)}
        out |= reduce_window([x.metrics for x in s])   # reward_group_std, rewards/<func>/...
    return out


def batch_metrics(step, state) -> dict[str, float]:
    """batch/*: the planner's row metrics per micro-batch of the step (reduced over the step),
    the step's sums, and the running total from the run's TrainState."""
    rows = [p for micro in step.packed for p in micro]              # [GA × world] PackedRow
    groups = set().union(*(row.group_ids for micro in step.rows for row in micro))
    return reduce_window(step.row_metrics) | {
        "batch/dropped_oversize_total": float(state.dropped_oversize_total),
        "batch/forwarded_tokens_per_step": sum(p.unique_tokens for p in rows),
        "batch/trained_tokens_per_step": step.totals.tokens,
        "batch/samples_per_step": step.totals.samples,
        "batch/groups_per_step": len(groups),
        "batch/microbatches_per_step": len(step.packed)}


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
        text = tree_attention.text_config(model)
        self.p = sum(p.numel() for p in tree_attention.decoder_layers(model).parameters())
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.attn = 4 * text.num_hidden_layers * text.num_attention_heads * head_dim
        self.head = 2 * text.vocab_size * text.hidden_size

    def __call__(self, rows) -> float:
        return 3.0 * sum(2 * self.p * r.unique_tokens + self.attn * r.attention_cost
                         + self.head * r.trained_tokens for r in rows)


class MetricsLog:
    """Rank 0's metrics: per-step records, one JSONL line per logging window (logging_steps; also
    after step 1 with logging_first_step; none with logging_strategy="no"), the same line on each
    report_to dashboard and to on_log, a progress bar, and the completions when log_completions is
    set."""

    def __init__(self, config, output_dir: str, state, model, device,
                 rollout_metrics: Callable[[], list[dict]], evaluator=None,
                 on_log=lambda line: None, on_evaluate=lambda metrics: None):
        from tqdm import tqdm
        self.config = config
        self.rollout_metrics = rollout_metrics   # the rollout process's since the last call
        self.window: list[dict] = []         # this logging window's per-step records
        self.last: dict = {}                 # the last line written
        kept = cut_back(output_dir, state.global_step)     # a resume's steps come again
        self.prompted = {r["prompt_index"] for r in kept.get(COMPLETIONS, []) if "prompt" in r}
        self.evaluator = evaluator           # RolloutWorker: evaluate(step), evaluations(wait)
        self.on_evaluate = on_evaluate
        self.evaluated = {r["step"] for r in kept.get("metrics.jsonl", []) if EVAL_MARK in r}
        self.epochs = state.prompt_index // (getattr(evaluator, "prompts_per_epoch", None) or 1)
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.flops = FlopCounter(model)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""   # no peak
        precision = "fp32" if config.compute_dtype(device) == torch.float32 else "bf16"
        self.peak = next((v for k, v in PEAK_FLOPS[precision].items() if k in gpu), None)
        self.world = torch.distributed.get_world_size()
        self.every = config.every("logging_steps") if config.logging_strategy == "steps" else None
        self.on_log = on_log
        self.completions: list = []          # the samples trained in this logging window
        self.completions_file = (open(os.path.join(output_dir, COMPLETIONS), "a")
                                 if config.log_completions else None)
        self.dashboards = open_dashboards(config, output_dir)
        self.bar = tqdm(total=config.max_steps if config.max_steps > 0 else None,
                        initial=state.global_step, unit="step", dynamic_ncols=True,
                        disable=config.disable_tqdm)           # None: on a tty only
        self.pending: list[dict] = []        # rollout metrics drained, not on a line yet
        self.line_at = time.monotonic()      # when the last line was written

    def step(self, state, metrics: dict, step) -> None:
        """Record one optimizer step: its loss and timings (`metrics`), and what it took from the
        queue and planned (`step`: train.py's Step)."""
        record = dict(metrics) | sample_metrics(step, state) | batch_metrics(step, state)
        forwarded = record["batch/forwarded_tokens_per_step"]
        record |= {"num_tokens": float(state.num_tokens),
                   "perf/rollout_wait_s": step.waited_s,
                   "perf/forwarded_tok_s_fwd_bwd": forwarded / max(record["perf/fwd_bwd_s"], 1e-9),
                   "perf/forwarded_tok_s_wall_clock": forwarded / record["perf/step_s"],
                   "perf/trained_tok_s_wall_clock": step.totals.tokens / record["perf/step_s"]}
        if self.peak is not None:
            flops = self.flops([p for micro in step.packed for p in micro])
            flops /= self.peak * self.world
            record |= {"perf/mfu_fwd_bwd": flops / record["perf/fwd_bwd_s"],
                       "perf/mfu_wall_clock": flops / record["perf/step_s"]}
        self.window.append(record)
        samples = [s for micro in step.rows for row in micro for s in row.samples]  # trained now
        if self.completions_file is not None:
            lines = completion_records(state.global_step, step.version, samples, self.prompted)
            self.completions_file.writelines(json.dumps(r) + "\n" for r in lines)
            self.completions_file.flush()
            self.prompted = {p for p in self.prompted if p >= state.prompt_index}   # done before
            if self.every is not None:                  # kept for the window's printout
                self.completions += samples
        self.bar.update(1)
        first = self.config.logging_first_step and state.global_step == 1
        if self.every is not None and (state.global_step % self.every == 0 or first):
            self.flush(state.global_step)
        self.evaluate(state)

    def evaluate(self, state, start: bool = False, end: bool = False) -> None:
        """eval_strategy's evaluations, which the rollout process runs beside training
        (`evaluator`): ask for one when it is due after step state.global_step, never twice for a
        step (a resume does not repeat one logged: `evaluated`), then write each one done on a line
        of its own at the step that asked (it may follow later steps' lines) and call on_evaluate.
        Due: "steps" every eval_steps once eval_delay steps have passed; "epoch" when a pass over
        the prompts ended (the resume cursor crossed it) once eval_delay passes have; `start`
        eval_on_start, or a resumed step whose evaluation was due and never logged; `end` the
        prompts' last pass, part of one included, and then the wait for every evaluation asked."""
        config, step = self.config, state.global_step
        if config.eval_strategy == "no":
            return
        if config.eval_strategy == "steps":
            due = step > 0 and step % config.every("eval_steps") == 0 and step >= config.eval_delay
        else:                                   # "epoch": passes over the prompts
            epochs = state.prompt_index / self.evaluator.prompts_per_epoch
            ended = int(epochs) > self.epochs or (end and epochs > self.epochs)
            due = ended and epochs >= config.eval_delay
            self.epochs = max(self.epochs, int(epochs))
        if (due or start and config.eval_on_start) and step not in self.evaluated:
            self.evaluated.add(step)
            self.evaluator.evaluate(step)
        for line in self.evaluator.evaluations(wait=end):
            self.write(line.pop("step"), line, rollout=False)
            self.on_evaluate(line)

    def end(self, state) -> None:
        """The run's end: the open window's line, and its last evaluations (evaluate, end)."""
        if self.window and self.every is not None:
            self.flush(state.global_step)
        self.evaluate(state, end=True)

    def flush(self, global_step: int) -> None:
        """Write the window's line (with the rollout metrics drained since the last) everywhere."""
        self.pending += self.rollout_metrics()
        self.last = self.write(global_step, reduce_window(self.window))
        self.window = []
        shown = {k: f"{self.last[k]:.3g}" for k in ("reward", "loss", "perf/step_s")
                 if self.last.get(k) is not None}
        self.bar.set_postfix(shown, refresh=False)
        if self.config.log_completions:
            rows = self.completion_rows()
            for prompt, completion, reward in rows:
                self.bar.write(f"  reward {reward:+.2f}  {prompt!r} → {completion!r}")
            for board in self.dashboards:
                board.table(global_step, rows)
        self.completions = []

    def write(self, global_step: int, metrics: dict, rollout: bool = True) -> dict:
        """One line: the rollout metrics drained since the last line (not on an evaluation's:
        `rollout` False), then `metrics`, in metrics.jsonl (valid JSON: reduce_window and
        eval_metrics leave out what is not finite), on the dashboards and to on_log."""
        line = {"step": global_step, "time": time.time()}
        if rollout:
            line |= reduce_window(self.pending)
            self.pending = []
            self.line_at = time.monotonic()
        line |= metrics
        self.file.write(json.dumps(line, allow_nan=False) + "\n")
        self.file.flush()
        values = {k: v for k, v in line.items() if k not in ("step", "time") and v is not None}
        for board in self.dashboards:                  # "step" and "time" are not metrics
            board.log(values, global_step)
        self.on_log(line)
        return line

    def waiting(self, state, final: bool = False) -> None:
        """While the trainer waits for samples: a window whose groups were all dropped gets its
        line (reward, frac_reward_zero_std, the drop counts) every WAITING_LINE_S, and when
        `final` (the run's end) if it wrote none, so a run that trains nothing shows why."""
        if final and self.last:
            return
        self.pending += self.rollout_metrics()
        dropped = [m["frac_reward_zero_std"] for m in self.pending if "frac_reward_zero_std" in m]
        due = final or time.monotonic() - self.line_at >= WAITING_LINE_S
        if dropped and all(dropped) and due and self.every is not None:
            self.write(state.global_step,
                       {"sample/dropped_stale_total": float(state.dropped_stale_total),
                        "batch/dropped_oversize_total": float(state.dropped_oversize_total)})

    def completion_rows(self) -> list[tuple[str, str, float]]:
        """(prompt, completion, reward) of num_completions_to_print samples (None: all)."""
        n = self.config.num_completions_to_print
        rows = []
        for s in self.completions[:n]:                  # n None: all
            prompt = s.prompt[-1]["content"] if isinstance(s.prompt, list) else s.prompt
            rows.append((prompt, completion_text(s.completion), float(s.reward)))
        return rows

    def close(self, state=None) -> None:
        """The run's end (its TrainState): a run that logged no line says why (waiting)."""
        if state is not None:
            self.waiting(state, final=True)
        self.bar.close()
        self.file.close()
        if self.completions_file is not None:
            self.completions_file.close()
        for board in self.dashboards:
            board.close()


# ── completions.jsonl (log_completions) ──────────────────────────────────────────────────────
# One line per trained sample, written by rank 0 after each optimizer step. `step` is the step that
# trained it (a sample may wait in an open row for the next); `staleness` that step's policy version
# minus model_version; completion_tokens the tokens the loss covers (tool results excluded);
# `prompt` on the first line of each prompt_index only. A resume cuts the file back to its
# checkpoint's steps (atomically), so with rollout_state.json's exactly-once resume each
# prompt_index of an epoch has num_generations lines however often the run was killed.


def completion_text(messages) -> str:
    """A prompt or completion as text: a string as is, a conversation's contents joined."""
    if isinstance(messages, list):
        return " ".join(m.get("content") or "" for m in messages)
    return "" if messages is None else str(messages)


def cut_back(output_dir: str, step: int) -> dict[str, list[dict]]:
    """metrics.jsonl and completions.jsonl cut back to the lines of steps <= `step` (a resume's;
    0: a fresh run), a line cut by a kill dropped, each file replaced atomically (a kill leaves
    the old file or the new one). Returns each file's records kept, by its name."""
    kept = {}
    for name in ("metrics.jsonl", COMPLETIONS):
        path = os.path.join(output_dir, name)
        if os.path.exists(path):
            kept[name] = [(text, r) for text, r in whole_lines(path) if r["step"] <= step]
            with open(path + ".tmp", "w") as f:
                f.writelines(text for text, _ in kept[name])     # as written
            os.replace(path + ".tmp", path)
    return {name: [r for _, r in lines] for name, lines in kept.items()}


def completion_records(step: int, version: int, samples: list, prompted: set[int]) -> list[dict]:
    """The lines of the samples one optimizer step trained under policy `version`; `prompted`
    (updated) holds the prompt indices whose prompt text was written."""
    out = []
    for s in samples:
        line = {"step": step, "prompt_index": s.prompt_index, "model_version": s.model_version,
                "staleness": version - s.model_version, "reward": float(s.reward),
                "advantage": float(s.advantage),
                "completion_tokens": int(s.completion_mask.sum()),
                "completion": completion_text(s.completion)}
        if s.prompt_index not in prompted:
            prompted.add(s.prompt_index)
            line["prompt"] = completion_text(s.prompt)
        out.append(line)
    return out


def whole_lines(path: str) -> list[tuple[str, dict]]:
    """(text, record) of each whole line: one a kill cut (no newline, or glued to the start of
    the next line by a later append) is left out."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                out.append((line, record))
    return out


# ── report_to: tensorboard, wandb, trackio ───────────────────────────────────────────────────
# Each library is imported only when report_to names it ("all": each installed one), and gets the
# run name, the config, every metrics.jsonl line at its step, and with log_completions a table of
# (step, prompt, completion, reward). Offline: WANDB_MODE=offline, trackio's local store.


@dataclass
class Dashboard:
    """One open dashboard: what logging a line, a table and closing mean for its library."""
    name: str
    log: Callable[[dict, int], None]              # (metrics, step)
    table: Callable[[int, list[tuple]], None]     # (step, [(prompt, completion, reward)])
    close: Callable[[], None]


def open_dashboards(config, output_dir: str) -> list[Dashboard]:
    """The dashboards report_to names, each started with the run name and the config."""
    installed = [n for n in DASHBOARDS if importlib.util.find_spec(n) is not None]
    run_name = config.run_name or os.path.basename(os.path.abspath(output_dir))
    boards = []
    for name in config.dashboards(installed):
        if name not in installed:
            raise ImportError(f"AsyncGRPOConfig.report_to={config.report_to!r} names {name}, which "
                              "is not installed: pip install -r requirements-dashboards.txt")
        boards.append(OPENERS[name](config, output_dir, run_name))
    return boards


def config_dict(config) -> dict:
    return json.loads(json.dumps(asdict(config), default=str))


# ── one opener per library ───────────────────────────────────────────────────────────────────


def open_tensorboard(config, output_dir: str, run_name: str) -> Dashboard:
    """Event files in logging_dir (None: <output_dir>/runs/<run_name>); the config as text."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(config.logging_dir or os.path.join(output_dir, "runs", run_name))
    writer.add_text("config", "```\n" + json.dumps(config_dict(config), indent=1) + "\n```")

    def log(metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
        writer.flush()

    def table(step: int, rows: list[tuple]) -> None:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += [f"| {step} | {_cell(p)} | {_cell(c)} | {r:+.3f} |" for p, c, r in rows]
        writer.add_text("completions", "\n".join(lines), step)
        writer.flush()

    return Dashboard("tensorboard", log, table, writer.close)


def open_wandb(config, output_dir: str, run_name: str) -> Dashboard:
    """A wandb run in <output_dir> (WANDB_MODE=offline: its files only, `wandb sync` later). Its
    x-axis is train/global_step, as transformers' WandbCallback's: wandb drops a line logged at a
    step below its last, and an evaluation's line comes at the step that asked for it, after the
    lines of the steps trained meanwhile."""
    import wandb
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", config.project), name=run_name,
                     config=config_dict(config), dir=output_dir)
    run.define_metric("train/global_step")
    run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(metrics: dict, step: int) -> None:
        run.log(metrics | {"train/global_step": step})
    return _wandb_like("wandb", log, wandb.Table, run.finish)


def open_trackio(config, output_dir: str, run_name: str) -> Dashboard:
    """A trackio run: in its local store (TRACKIO_DIR; `trackio show` opens the dashboard), or
    on the hub Space trackio_space_id with its data in the bucket trackio_bucket_id, as
    transformers' TrackioCallback passes them; at the end, as the callback does, a run on a Space
    is frozen into the static Space trackio_static_space_id (None: trackio's name for it, False:
    none; it snapshots the Space, so without one there is none)."""
    import trackio
    trackio.init(project=config.project, name=run_name, config=config_dict(config),
                 space_id=config.trackio_space_id, bucket_id=config.trackio_bucket_id,
                 auto_log_gpu=False, auto_log_cpu=False)

    def finish() -> None:
        trackio.finish()
        if config.trackio_space_id and config.trackio_static_space_id is not False:
            trackio.freeze(space_id=config.trackio_space_id, project=config.project,
                           new_space_id=config.trackio_static_space_id)
    return _wandb_like("trackio", trackio.log, trackio.Table, finish)


def _wandb_like(name: str, log, table_type, finish) -> Dashboard:
    """The Dashboard of wandb's API, which trackio follows: log(metrics, step=step), a
    table_type(columns=..., data=...) logged as "completions", finish()."""
    def table(step: int, rows: list[tuple]) -> None:
        data = [[step, p, c, r] for p, c, r in rows]
        log({"completions": table_type(columns=COLUMNS, data=data)}, step=step)

    return Dashboard(name, lambda metrics, step: log(metrics, step=step), table, finish)


OPENERS = {"tensorboard": open_tensorboard, "wandb": open_wandb, "trackio": open_trackio}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
