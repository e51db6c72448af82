"""README.md against the code (train.parse_cli, tools.bench's cases, the files): its commands
work as written: every `python train.py` / `torchrun ... train.py` line parses with the
trainer's own CLI (a flag renamed or removed fails here), every `python -m X` names a module
that exists (and a bench case that exists), every script it runs is there, and every path of the
file table exists."""
import importlib.util
import os
import re
import shlex
import sys

import pytest

import train
from conftest import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def commands() -> list[list[str]]:
    """The README's shell commands: its bash blocks, continuation lines joined, comments and
    environment assignments dropped, `&&` chains split."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line or line.startswith("#"):
                continue
            for part in line.split("&&"):
                words = shlex.split(part)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    words.pop(0)
                if words:
                    out.append(words)
    return out


def trainer_args() -> list[list[str]]:
    """The arguments of every command that runs train.py (python or torchrun)."""
    found = []
    for words in commands():
        if "train.py" in words and words[0] in ("python", "torchrun"):
            found.append(words[words.index("train.py") + 1:])
    return found


def test_the_readme_has_the_commands_this_test_reads():
    assert len(trainer_args()) >= 5
    assert any(w[:3] == ["python", "-m", "tools.bench"] for w in commands())


@pytest.mark.parametrize("args", trainer_args(), ids=lambda a: " ".join(a)[:60] or "no args")
def test_every_train_py_command_parses_with_the_trainers_cli(args):
    if args == ["..."]:                         # "...": the flags of the line above
        return
    script, config = train.parse_cli(args)      # unknown flags and bad values raise SystemExit
    assert config is not None and script is not None


def test_every_python_m_module_and_script_exists():
    sys.path.insert(0, ROOT)
    from tools import bench
    for words in commands():
        if words[:2] == ["python", "-m"] and words[2] not in ("pytest", "venv"):
            assert importlib.util.find_spec(words[2]) is not None, words
            if words[2] == "tools.bench":
                assert words[3] in bench.CASES, words
        if words[0] == "bash":
            assert os.path.isfile(os.path.join(ROOT, words[1])), words


def test_every_file_of_the_table_exists():
    table = README.split("## Files and the spec sections they implement")[1].split("\n## ")[0]
    paths = re.findall(r"^\| `([\w/.]+)`", table, re.M)
    assert len(paths) >= 20
    for path in paths:
        assert os.path.exists(os.path.join(ROOT, path)), path
    top = {f for f in os.listdir(ROOT) if f.endswith(".py")}
    rollout = {f"rollout/{f}" for f in os.listdir(os.path.join(ROOT, "rollout"))
               if f.endswith(".py") and f != "__init__.py"}
    assert top | rollout <= set(paths), sorted(top | rollout - set(paths))


def test_the_first_screen_is_the_learners_map():
    """What this is, the two commands with the fast tier named, the file map and one step
    top-down come before any other section; results are stated without run logs."""
    sections = re.findall(r"^## (.+)$", README, re.M)
    assert sections[:2] == ["Files and the spec sections they implement", "One step, top-down"]
    opening = README.split("\n## ", 1)[0]
    assert "python train.py" in opening and "python -m pytest -n 2" in opening
    assert "pytest -m fast" in opening
    assert not re.search(r"`[0-9a-f]{7,40}`", README) and "this round" not in README


def test_every_relative_link_of_the_documents_resolves():
    docs = ["README.md", "WALKTHROUGH.md"] + [os.path.join("docs", f) for f in
                                              os.listdir(os.path.join(ROOT, "docs"))]
    links = 0
    for doc in docs:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" in target:
                continue
            links += 1
            path = os.path.join(ROOT, os.path.dirname(doc), target)
            assert os.path.exists(path), f"{doc} links to {target}, which is not in the repository"
    assert links >= 10
