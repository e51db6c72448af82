"""tools/plot.py: the README's `python -m tools.plot RUN` on the session's shared run
(conftest.train_run), the figure's curves and panels, and the smoothing's worked example."""
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from tools import plot
from train_helpers import lines


def test_python_m_tools_plot_draws_the_run(train_run):
    out = train_run[0]
    done = subprocess.run([sys.executable, "-m", "tools.plot", out], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path = done.stdout.strip()
    assert path == os.path.join(out, "metrics.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_the_plot_is_smoothed_over_faint_raw_curves_and_titled_with_the_runs_name(train_run):
    """Each curve is drawn twice: the raw points faint, the smoothed line (smooth) over them; the
    title is the run directory's name, not its path; reward by prompt index is a panel, each
    point the mean reward of that prompt's trained samples in completions.jsonl."""
    import matplotlib.pyplot as plt
    out = train_run[0]
    fig = plot.figure(out)
    try:
        assert fig._suptitle.get_text() == os.path.basename(out)
        reward = fig.axes[0]
        raw, smoothed = reward.lines[0], reward.lines[1]
        assert raw.get_alpha() < 0.5 and smoothed.get_alpha() is None
        rewards = [r["reward"] for r in lines(out) if "reward" in r]
        assert list(raw.get_ydata()) == rewards
        assert list(smoothed.get_ydata()) == pytest.approx(plot.smooth(rewards))
        by_prompt = next(ax for ax in fig.axes
                         if ax.get_title() == "reward by prompt (completions.jsonl)")
        trained = [json.loads(x) for x in open(os.path.join(out, "completions.jsonl"))]
        prompts = sorted({r["prompt_index"] for r in trained})
        means = [sum(r["reward"] for r in trained if r["prompt_index"] == p)
                 / sum(r["prompt_index"] == p for r in trained) for p in prompts]
        assert list(by_prompt.lines[0].get_xdata()) == prompts
        assert list(by_prompt.lines[0].get_ydata()) == pytest.approx(means)
    finally:
        plt.close(fig)


def test_smooth_replays_its_worked_example():
    assert plot.smooth([1, 3, 3], weight=0.5) == pytest.approx([1.0, 7 / 3, 2.375 / 0.875])


def test_smooth_leaves_a_missing_point_missing_and_goes_on_over_it():
    smoothed = plot.smooth([1, None, 3, float("nan"), 3], weight=0.5)
    assert [math.isnan(v) for v in smoothed] == [False, True, False, True, False]
    assert [v for v in smoothed if not math.isnan(v)] == pytest.approx(
        plot.smooth([1, 3, 3], weight=0.5))


def test_a_run_with_a_skipped_step_plots_with_a_gap_there(tmp_path):
    """A step whose optimizer step was skipped logs "loss": null (metrics.jsonl holds no NaN):
    the run plots, and both loss curves leave that step out, the other panels drawn whole."""
    records = [{"step": s, "reward": 0.1 * s, "loss": None if s == 3 else 0.5 / s}
               for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert os.path.getsize(plot.plot(str(tmp_path))) > 10_000
    fig = plot.figure(str(tmp_path))
    try:
        reward, loss = fig.axes[:2]
        for line in loss.lines:
            assert [math.isnan(y) for y in line.get_ydata()] == [s == 3 for s in range(1, 6)]
        assert not any(math.isnan(y) for line in reward.lines for y in line.get_ydata())
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
