"""report_to (spec: AsyncGRPOConfig, ログ出力 (logging) and the TrainingArguments fields it lists:
report_to, run_name, project): the metrics of <output_dir>/metrics.jsonl, under the same names and
at the same steps, on tensorboard, wandb or trackio, each through its own library, imported only
when report_to names it. Each also gets the run name, the config, and with log_completions a
table of (step, prompt, completion, reward).

    config = AsyncGRPOConfig(report_to=["tensorboard", "wandb"], run_name="toy-1")
    boards = open_dashboards(config, "runs/toy")  # tensorboard: runs/toy/runs/toy-1 (logging_dir)
    log_line(boards, {"step": 3, "time": ..., "reward": 0.4, "loss": 0.1})   # step 3: reward, loss
    log_table(boards, 3, [("2+2=", "4", 1.0)])
    close_dashboards(boards)

"all" means each of the three that is installed (`pip install -r requirements-dashboards.txt`).
Offline use is the libraries' own: WANDB_MODE=offline, trackio's local store (TRACKIO_DIR).

Departures from the spec, one line each:
- tensorboard has no table type: the completions are a markdown table under the text tab.
- project names the wandb project too (transformers reads WANDB_PROJECT); that variable still wins.
"""
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from typing import Callable

from config import DASHBOARDS

COLUMNS = ["step", "prompt", "completion", "reward"]


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
    boards = []
    for name in config.dashboards(installed):
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"AsyncGRPOConfig.report_to={config.report_to!r} names {name}, which "
                              "is not installed: pip install -r requirements-dashboards.txt")
        run_name = config.run_name or os.path.basename(os.path.abspath(output_dir))
        boards.append(OPENERS[name](config, output_dir, run_name))
    return boards


def log_line(boards: list[Dashboard], line: dict) -> None:
    """One metrics.jsonl line (its "step" and "time" are not metrics) on every dashboard."""
    metrics = {k: v for k, v in line.items() if k not in ("step", "time")}
    for board in boards:
        board.log(metrics, line["step"])


def log_table(boards: list[Dashboard], step: int, rows: list[tuple]) -> None:
    for board in boards:
        board.table(step, rows)


def close_dashboards(boards: list[Dashboard]) -> None:
    for board in boards:
        board.close()


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
    """A wandb run in <output_dir> (WANDB_MODE=offline: its files only, `wandb sync` later)."""
    import wandb
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", config.project), name=run_name,
                     config=config_dict(config), dir=output_dir)

    def table(step: int, rows: list[tuple]) -> None:
        data = [[step, p, c, r] for p, c, r in rows]
        run.log({"completions": wandb.Table(columns=COLUMNS, data=data)}, step=step)

    return Dashboard("wandb", lambda metrics, step: run.log(metrics, step=step), table,
                     run.finish)


def open_trackio(config, output_dir: str, run_name: str) -> Dashboard:
    """A trackio run in its local store (TRACKIO_DIR; `trackio show` opens the dashboard)."""
    import trackio
    trackio.init(project=config.project, name=run_name, config=config_dict(config),
                 auto_log_gpu=False, auto_log_cpu=False)

    def table(step: int, rows: list[tuple]) -> None:
        data = [[step, p, c, r] for p, c, r in rows]
        trackio.log({"completions": trackio.Table(columns=COLUMNS, data=data)}, step=step)

    return Dashboard("trackio", lambda metrics, step: trackio.log(metrics, step=step), table,
                     trackio.finish)


OPENERS = {"tensorboard": open_tensorboard, "wandb": open_wandb, "trackio": open_trackio}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
