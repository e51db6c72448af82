"""tools/gpu_check.py: its CPU-safe parts run (CI smoke test); benchmark lines are judged against
the targets."""
import os
import subprocess
import sys

import pytest

from tools import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_cpu_smoke_prints_one_table_and_passes():
    p = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--cpu-smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    table = p.stdout[p.stdout.index("check"):].splitlines()
    assert [line.split()[0] for line in table[1:]] == ["env", "gpu", "packing", "packing", "bf16",
                                                       "fingerprint", "train"]
    assert table[2].split()[2] == "PASS" and "deselected" in table[2]   # gpu tests: all skipped
    for line in table[3:5]:
        assert line.split()[2] == "PASS" and "CPU: timings not judged" in line
        assert float(line.split("gap ")[1].split(";")[0]) <= 1e-5       # tree == padding-free
    assert table[5].split()[:3] == ["bf16", "sdpa", "PASS"]          # a bf16 step, loss finite
    assert "tokens/s of 230, loss " in table[5]                       # the tiny row's figures
    assert table[6].split()[1] == "PASS" and "on cpu" in table[6] and "agree: True" in table[6]
    assert table[7].split()[1] == "SKIP"


def test_benchmark_lines_are_judged_against_the_targets(monkeypatch):
    def bench(efficiency, no_sharing):
        line = (f"packing speedup=2.500 flop_bound=2.770 efficiency={efficiency} "
                f"no_sharing={no_sharing} max_logprob_gap=0.03")

        def run(cmd, limit):
            return 0, "cuda ...\n" + line + "\n", 12.0
        return run

    monkeypatch.setattr(gpu_check, "run", bench(0.96, 0.98))
    assert gpu_check.packing_row([], 90, judged=True)[0] == "PASS"
    monkeypatch.setattr(gpu_check, "run", bench(0.90, 0.98))
    status, detail = gpu_check.packing_row([], 90, judged=True)
    assert status == "MISS" and "efficiency < 0.95" in detail
    monkeypatch.setattr(gpu_check, "run", bench(0.96, 0.95))
    assert "no_sharing < 0.97" in gpu_check.packing_row([], 90, judged=True)[1]
    monkeypatch.setattr(gpu_check, "run", lambda cmd, limit: (None, "", 90.0))
    assert gpu_check.packing_row([], 90, judged=True) == ("FAIL", "timed out after 90 s")


def test_a_bf16_step_row_fails_on_a_non_finite_loss_or_a_crash(monkeypatch):
    line = ("step backend=flex dtype=bf16 device=cuda layers=28 unique_tokens=12288 "
            "first_step_s=41.20 step_s=0.210 tokens_per_s=58514 loss={} finite={}")
    monkeypatch.setattr(gpu_check, "run", lambda cmd, limit: (0, line.format(0.01, True), 50.0))
    status, detail = gpu_check.step_row("flex")
    assert status == "PASS" and detail.startswith("0.210 s a step (first 41.20 s), 58514 tokens/s")
    monkeypatch.setattr(gpu_check, "run", lambda cmd, limit: (0, line.format("nan", False), 50.0))
    assert gpu_check.step_row("flex")[0] == "FAIL"
    monkeypatch.setattr(gpu_check, "run", lambda cmd, limit: (1, "...\nKeyError: None", 9.0))
    assert gpu_check.step_row("flex") == ("FAIL", "KeyError: None")


def test_train_command_runs_train_py_with_the_hook_args(tmp_path):
    cmd = gpu_check.train_command(str(tmp_path))
    assert cmd[1].endswith("train.py")
    assert cmd[2:2 + len(gpu_check.TRAIN_ARGS)] == gpu_check.TRAIN_ARGS
    assert cmd[-2:] == ["--output_dir", str(tmp_path)]
