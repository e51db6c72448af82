"""The trainer tests' fixtures, loaded with `pytest_plugins = ["train_fixtures"]` (a plugin is
loaded once, so a session-scoped fixture runs once however many test files ask for it):
`train_server`, a toy server, and `train_run`, one short training run against it that
test_train.py, test_checkpoint.py, test_metrics.py and test_weight_sync.py all read."""
import json
import os

import pytest

import toy
import train
from local_vllm.launch import LocalServer
from train_helpers import SERVER_ARGS, SMALL


@pytest.fixture(scope="session")
def train_server(toy_dir):
    """A toy server with gloo weight transfer and processed log-probs (SERVER_ARGS)."""
    server = LocalServer(toy_dir, *SERVER_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def train_run(train_server, toy_dir, tmp_path_factory):
    """(output_dir, last metrics) of 4 steps with a sync after each, checkpoints at 2 and 4
    (limit 1 kept), max_staleness 0, a token budget, and log_completions (2 printed per step)."""
    out = str(tmp_path_factory.mktemp("run"))
    config = train.AsyncGRPOConfig(output_dir=out, vllm_server_base_url=train_server.url,
                                   max_steps=4, save_steps=2, save_total_limit=1, max_staleness=0,
                                   log_completions=True, num_completions_to_print=2, **SMALL)
    last = train.train(config, toy.make_dataset(64), [toy.sum_reward], model=toy_dir)
    return out, last


@pytest.fixture
def indexed(tmp_path, toy_dir) -> str:
    """A prompt file with an `index` column, and the toy model beside it (for cli)."""
    os.symlink(toy_dir, tmp_path / "model")
    rows = [dict(r, index=i) for i, r in enumerate(toy.make_dataset(200))]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
