"""Every module's imports, read from the source: the layout's boundaries (README, "Files and the
spec sections they implement"). The algorithm at the top never imports the stand-in's server (it
runs as a process; only its launcher is imported), the stand-in imports nothing of the trainer
side, rollout/ (the spawned child's code) imports nothing of the top but vllm_client.py, no
module imports itself back through others, and the scripts live in tools/. Every module opens in
English, saying what it is, before the spec's section title; the fast tier's guard holds."""
import ast
import glob
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import types

import pytest

from conftest import ROOT

CORE = sorted(glob.glob(os.path.join(ROOT, "*.py")))
ROLLOUT = sorted(glob.glob(os.path.join(ROOT, "rollout", "*.py")))
STAND_IN = sorted(glob.glob(os.path.join(ROOT, "local_vllm", "*.py")))
FOLDERS = ("rollout", "local_vllm", "vllm_plugin", "tools")


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


def module_name(path: str) -> str:
    """tools/bench.py → tools.bench; rollout/__init__.py → rollout."""
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module → the project's modules it imports (each file a node; `from pkg import mod` names
    the submodule when it is one)."""
    paths = CORE + [p for d in FOLDERS for p in glob.glob(os.path.join(ROOT, d, "*.py"))]
    known = {module_name(p) for p in paths}
    graph = {}
    for path in paths:
        tree, edges = ast.parse(open(path).read()), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & known
                edges |= subs or ({node.module} & known)
        graph[module_name(path)] = edges - {module_name(path)}
    return graph


def test_no_import_cycles():
    """Depth-first over every module's imports: no path leads back to a module on it (a package
    importing its own submodules, rollout → rollout.loop, is the one edge allowed inward)."""
    graph = import_graph()
    graph = {m: {t for t in edges if not t.startswith(m + ".")} for m, edges in graph.items()}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            assert state.get(target) != "open", " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert "train" in graph and "rollout.loop" in graph and "tools.bench" in graph


def test_rollout_imports_nothing_of_the_top_but_vllm_client():
    top = {os.path.basename(p)[:-3] for p in CORE}
    for path in ROLLOUT:
        assert {m.split(".")[0] for m in imports(path)} & top <= {"vllm_client"}, path


def test_train_py_runs_once_under_python_train_py():
    """No module imports train.py back, so `python train.py` executes it once, as __main__ (the
    CLI cycle made it run a second time as `train`)."""
    code = ("import runpy, sys\nsys.argv = ['train.py', '--help']\ntry:\n"
            "    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('imported as train:', 'train' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert "--max_staleness" in out.stdout, out.stderr[-2000:]        # the CLI ran
    assert out.stdout.strip().endswith("imported as train: False"), out.stdout[-500:]


def test_the_core_imports_only_the_stand_ins_launcher():
    for path in CORE + ROLLOUT:
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


def test_every_module_opens_with_an_english_sentence_saying_what_it_is():
    """Each module docstring begins in English, saying what the module is (at least three words
    before the first Japanese character); the spec's section title, Japanese beside English,
    comes after."""
    paths = CORE + [p for d in FOLDERS for p in glob.glob(os.path.join(ROOT, d, "*.py"))]
    japanese = re.compile(r"[\u3040-\u30ff\u3400-\u9fff]")
    late = []
    for path in paths:
        doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read()), clean=False) or ""
        opening = japanese.split(doc, maxsplit=1)[0]
        if not (re.match(r"[A-Za-z`(]", opening) and len(opening.split()) >= 3):
            late.append(f"{os.path.relpath(path, ROOT)}: {doc[:40]!r}")
    assert not late, late


def test_the_fast_tier_fails_a_test_that_starts_a_process_or_reaches_a_server():
    """conftest's guard over a test marked `fast` (pytest -m fast): a subprocess, a
    multiprocessing child and a TCP connection raise, naming what was tried; after the test,
    all three work again."""
    import conftest
    marked = types.SimpleNamespace(get_closest_marker=lambda name: name == "fast")
    guard = conftest.pytest_runtest_protocol(marked, None)
    next(guard)                                  # the test runs here
    try:
        with pytest.raises(RuntimeError, match="subprocess.Popen under the fast tier"):
            subprocess.run(["true"])
        with pytest.raises(RuntimeError, match="Process.start under the fast tier"):
            multiprocessing.get_context("spawn").Process(target=int).start()
        with pytest.raises(RuntimeError, match=r"a connection to \('127.0.0.1', 9\) under"):
            socket.create_connection(("127.0.0.1", 9), timeout=1)
    finally:
        guard.close()
    assert subprocess.run(["true"]).returncode == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", 9), timeout=1)


def test_every_document_the_code_cites_is_in_the_repository():
    """A fork has the repository only: every docs/*.md that a module, test, tool or document names
    exists, and nothing cites the notes the project was built from (reference/..., seeds/...)."""
    kinds = (".py", ".sh", ".md", ".ini", ".txt", ".toml")
    paths = [p for folder in ("",) + FOLDERS + ("tests", "docs", ".ci")
             for p in glob.glob(os.path.join(ROOT, folder, "*")) if p.endswith(kinds)
             or os.path.basename(p) == "run"]
    cited = 0
    for path in paths:
        text = open(path, encoding="utf-8").read()
        name = os.path.relpath(path, ROOT)
        assert not re.search(r"\breference/\w+\.md|\bseeds?/\d|\bseed \d{3}\b", text), name
        for doc in re.findall(r"\bdocs/(\w+\.md)", text):
            cited += 1
            assert os.path.isfile(os.path.join(ROOT, "docs", doc)), f"{name} cites docs/{doc}"
    assert cited >= 10


def test_the_import_graph_is_at_most_six_deep():
    """Over the nodes a reader sees (each top-level file, each top-level folder as one), the longest
    chain of imports is at most 6 modules: a reader climbs no further to reach the bottom."""
    nodes = {module_name(p): module_name(p).split(".")[0] for p in
             CORE + [p for d in FOLDERS for p in glob.glob(os.path.join(ROOT, d, "*.py"))]}
    graph: dict[str, set[str]] = {}
    for module, edges in import_graph().items():
        graph.setdefault(nodes[module], set()).update(nodes[t] for t in edges)
    graph = {node: edges - {node} for node, edges in graph.items()}
    memo: dict[str, int] = {}

    def depth(node: str) -> int:
        if node not in memo:
            memo[node] = 1 + max((depth(t) for t in graph[node]), default=0)
        return memo[node]

    assert max(map(depth, graph)) <= 6, {n: depth(n) for n in graph}


def test_train_reads_in_at_most_a_hundred_lines():
    """train(), the spine a reader follows first, is at most 100 lines, docstring included."""
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    (spine,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert spine.end_lineno - spine.lineno + 1 <= 100
