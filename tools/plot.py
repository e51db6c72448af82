"""A run's metrics drawn: its metrics.jsonl (and completions.jsonl, with log_completions) as one
PNG beside them, outside the trainer (metrics.py writes the files; spec: 記録されたメトリクス
(Logged metrics)).

    python -m tools.plot runs/toy          # → runs/toy/metrics.png (the path is printed)

    reward: reward, reward_kept             │ loss
    staleness: sample/staleness_mean, _max  │ throughput: forwarded, trained tokens/s
    reward by prompt_index                  │ completion length by step     (completions.jsonl)

Each curve is its raw points, faint, under the dashboards' smoothing of them (smooth); the title is
the run directory's name. A line a kill cut is left out, as a resume does (metrics.whole_lines). A
step whose optimizer step was skipped (not finite: "loss": null) is a gap in both curves.
"""
import math
import os
import sys

import numpy as np

from metrics import COMPLETIONS, whole_lines


def read_lines(path: str) -> list[dict]:
    """The records of the whole lines of a metrics.jsonl or completions.jsonl."""
    return [record for _, record in whole_lines(path)]


def load_completions(run_dir: str) -> list[dict]:
    """The lines of <run_dir>/completions.jsonl, each with its prompt text filled in."""
    lines = read_lines(os.path.join(run_dir, COMPLETIONS))
    prompts = {r["prompt_index"]: r["prompt"] for r in lines if "prompt" in r}
    return [r | {"prompt": prompts.get(r["prompt_index"], "")} for r in lines]


def mean_by(lines: list[dict], key: str, value: str) -> dict:
    """Each line[key] (sorted) → the mean line[value] of its lines."""
    groups: dict = {}
    for r in lines:
        groups.setdefault(r[key], []).append(r[value])
    return {k: float(np.mean(v)) for k, v in sorted(groups.items())}


def smooth(values: list[float | None], weight: float = 0.6) -> list[float]:
    """The dashboards' smoothing: an exponential moving average, debiased so the first points
    are not pulled to 0. Worked, weight 0.5: [1, 3, 3] → EMAs 0.5, 1.75, 2.375 over debias
    factors 0.5, 0.75, 0.875 → [1.0, 2.333, 2.714]. A missing point (None or NaN) stays missing
    (NaN: a gap in the line) and the average goes on over it: [1, None, 3, 3] → [1.0, nan, 2.333,
    2.714]."""
    out, ema, seen = [], 0.0, 0
    for v in values:
        if v is None or math.isnan(v):
            out.append(math.nan)
            continue
        seen += 1
        ema = weight * ema + (1 - weight) * v
        out.append(ema / (1 - weight ** seen))
    return out


def _curve(ax, x: list, y: list, label: str) -> None:
    """The raw points faint, the smoothed line over them in the same colour (a None: a gap)."""
    y = [math.nan if v is None else v for v in y]
    raw, = ax.plot(x, y, alpha=0.25, linewidth=1)
    ax.plot(x, smooth(y), color=raw.get_color(), linewidth=1.8, label=label)


def figure(run_dir: str):
    """The figure `plot` saves (the module docstring's panels; the last row only with a
    completions.jsonl)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = read_lines(os.path.join(run_dir, "metrics.jsonl"))
    panels = [("reward", ["reward", "reward_kept"]), ("loss", ["loss"]),
              ("staleness (versions)", ["sample/staleness_mean", "sample/staleness_max"]),
              ("throughput (tokens/s)",
               ["perf/forwarded_tok_s_wall_clock", "perf/trained_tok_s_wall_clock"])]
    trained = (load_completions(run_dir)
               if os.path.exists(os.path.join(run_dir, COMPLETIONS)) else [])
    fig, axes = plt.subplots(3 if trained else 2, 2, figsize=(11, 10 if trained else 7))
    for ax, (title, names) in zip(axes.flat, panels):
        for name in names:
            points = [(r["step"], r[name]) for r in lines if name in r]
            if points:
                _curve(ax, *map(list, zip(*points)), name)
        ax.set_title(title)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    if trained:
        by_prompt = mean_by(trained, "prompt_index", "reward")
        _curve(axes[2, 0], list(by_prompt), list(by_prompt.values()), "mean reward")
        axes[2, 0].set(title="reward by prompt (completions.jsonl)", xlabel="prompt_index")
        tokens = mean_by(trained, "step", "completion_tokens")
        _curve(axes[2, 1], list(tokens), list(tokens.values()), "completion_tokens")
        axes[2, 1].set(title="completion length (tokens)", xlabel="optimizer step")
    for ax in axes.flat:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.normpath(os.path.abspath(run_dir))))
    fig.tight_layout()
    return fig


def plot(run_dir: str) -> str:
    """<run_dir>/metrics.png of figure(run_dir); returns its path."""
    import matplotlib.pyplot as plt
    fig = figure(run_dir)
    path = os.path.join(run_dir, "metrics.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(plot(sys.argv[1] if len(sys.argv) > 1 else "runs/toy"))
