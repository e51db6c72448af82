"""The layout's boundaries (README, "Files and the spec sections they implement"): the algorithm
at the top never imports the stand-in's server (it runs as a process; only its launcher, the
standard library and httpx, is imported), the stand-in imports nothing of the trainer side, and
the scripts live in tools/."""
import ast
import glob
import os
import subprocess
import sys

from conftest import ROOT

CORE = sorted(glob.glob(os.path.join(ROOT, "*.py")))
STAND_IN = sorted(glob.glob(os.path.join(ROOT, "local_vllm", "*.py")))


def imports(path: str) -> set[str]:
    """Every module a file imports, at any depth of its code."""
    tree = ast.parse(open(path).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_core_imports_only_the_stand_ins_launcher():
    for path in CORE:
        stand_in = {m for m in imports(path) if m.split(".")[0] == "local_vllm"}
        assert stand_in <= {"local_vllm.launch"}, (os.path.basename(path), stand_in)


def test_the_stand_in_imports_nothing_of_the_trainer_side():
    trainer_side = {os.path.basename(p)[:-3] for p in CORE} - {"toy"}    # toy: `--model toy`
    for path in STAND_IN:
        assert not {m.split(".")[0] for m in imports(path)} & trainer_side, path


def test_the_launcher_loads_none_of_the_server():
    code = ("import sys, local_vllm.launch, train; print(sorted(m for m in sys.modules "
            "if m.startswith('local_vllm')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=120)
    assert out.stdout.split() == ["['local_vllm',", "'local_vllm.launch']"], out.stderr[-2000:]


def test_the_scripts_and_the_stand_in_are_not_at_the_top():
    top = {os.path.basename(p) for p in CORE}
    assert not top & {"bench.py", "walkthrough.py", "gpu_check.py", "serve_local.py",
                      "serve_http.py", "serve_local_engine.py"}
    assert {"bench.py", "walkthrough.py", "gpu_check.py", "vllm_cpu_venv.sh"} <= set(
        os.listdir(os.path.join(ROOT, "tools")))
