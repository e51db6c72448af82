"""tools/walkthrough.py and WALKTHROUGH.md (概要 (overview), one prompt end to end, both
processes): the script runs, every output block of the document is exactly what it prints now
(`--check`), and the asynchronous half shows what the protocol promises: admission stops once the
window is full, the trainer's step takes the queue in order, and the version it publishes lets the
waiting group start under that version."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def walkthrough(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.walkthrough", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_the_document_shows_what_the_script_prints(tmp_path):
    doc = os.path.join(ROOT, "WALKTHROUGH.md")
    with open(doc) as f:
        text = f.read()
    steps = ["model", "admit", "prompt", "group", "reconcile", "feed", "pack", "loss", "sync",
             "publish", "stale"]
    assert [line[len("<!-- output: "):-len(" -->")] for line in text.splitlines()
            if line.startswith("<!-- output: ")] == steps
    # the document matches this run (--check); a copy with one number changed is rewritten
    bad = tmp_path / "WALKTHROUGH.md"
    assert "answer='6'" in text
    bad.write_text(text.replace("answer='6'", "answer='7'", 1))
    run = walkthrough("--check", doc, "--write", str(bad))
    assert run.returncode == 0, run.stderr[-3000:]
    assert bad.read_text() == text                       # --write restored the number
    blocks = dict(part.split("\n", 1) for part in run.stdout.split("=== ")[1:])
    # admission: the first group by the exception, then until the window is full, then a wait
    admit = blocks["admit"].splitlines()
    assert admit[3].startswith("  admission for group 0: no rollout done yet")
    assert admit[-2].endswith("→ wait") and "> C_v + 2·R = 16" in admit[-2]
    # the step: the first kept group's samples in queue order, nothing stale, one sample held
    assert "0 stale, 0 oversize" in blocks["feed"] and "1 in planner.held()" in blocks["feed"]
    # the sync lands, the version is published, and the waiting group starts under it
    assert "weight_version 'default' → '1'" in blocks["sync"]
    publish = blocks["publish"]
    assert "the rollout process reads model_version 1" in publish
    assert "≤ C_v + 2·R = 27 → start" in publish and "started under version 1" in publish
    assert "its samples' model_version: [1]" in publish
