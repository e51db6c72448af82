"""Shared fixtures: the offline toy model directory and local vLLM-compatible servers in subprocesses."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import toy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory) -> str:
    """The toy model and tokenizer saved with save_pretrained, as a hub model would be."""
    return toy.save(str(tmp_path_factory.mktemp("toy")))


class LocalServer:
    """`python serve_local.py ...` in its own process group; `url` once /health answers."""

    def __init__(self, model_dir: str, *args: str, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(model_dir, f"server-{self.port}.log"), "w+")
        cmd = [sys.executable, os.path.join(ROOT, "serve_local.py"), "--model", model_dir, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve_local.py exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"serve_local.py did not become healthy:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture
def start_server(toy_dir):
    """Factory: start_server(*cli_args, model_dir=toy_dir) -> LocalServer; every server is stopped after the test."""
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
    s = LocalServer(toy_dir, "--max-model-len", "256", "--weight-transfer-config", '{"backend":"gloo"}',
                    "--enable-lora", "--max-lora-rank", "8", "--max-loras", "6", "--return-sampling-mask",
                    "--enable-scale-out", "--max-logprobs", "-1", "--logprobs-mode", "processed_logprobs")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def long_server(toy_dir):
    """A module's own server with room for the tool prompt (~520 tokens) and every generation feature
    (processed log-probs, any number of them, sampling masks, the token-in/token-out endpoint)."""
    s = LocalServer(toy_dir, "--max-model-len", "1024", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
                    "--return-sampling-mask", "--enable-scale-out")
    yield s
    s.stop()
