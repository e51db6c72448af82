"""tools/walkthrough.py and WALKTHROUGH.md (概要 (overview), one prompt end to end): the script
runs, and every output block of the document is exactly what it prints now (`--check`)."""
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
    steps = ["model", "prompt", "group", "reconcile", "pack", "loss", "sync", "stale"]
    assert [line[len("<!-- output: "):-len(" -->")] for line in text.splitlines()
            if line.startswith("<!-- output: ")] == steps
    # the document matches this run (--check); a copy with one number changed is rewritten
    bad = tmp_path / "WALKTHROUGH.md"
    bad.write_text(text.replace("answer='2'", "answer='3'", 1))
    run = walkthrough("--check", doc, "--write", str(bad))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "weight_version 'default' → '1'" in run.stdout
    assert bad.read_text() == text                       # --write restored the number
