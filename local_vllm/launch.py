"""The stand-in's launcher: `python -m local_vllm.server ...` as a subprocess, for the demo
(train.py), the tools and the tests. Standard library and httpx only: importing it loads none of
the server (torch, transformers), so a trainer process never carries the engine.

    server = LocalServer("runs/toy-model", "--max-model-len", "512")   # returns once /health is 200
    server.url        # http://127.0.0.1:<free port>
    server.output()   # its log so far
    server.stop()     # SIGTERM to its process group, SIGKILL after 10 s
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """The stand-in in its own process group; `url` once /health answers. stop() ends it and
    everything it started."""

    def __init__(self, model_dir: str, *args: str, log_path: str | None = None,
                 startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "local_vllm.server", "--model", model_dir,
               "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"local_vllm.server exited with {self.proc.returncode}:\n"
                                   f"{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"local_vllm.server did not become healthy within "
                           f"{startup_timeout:g}s:\n{self.output()}")

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
