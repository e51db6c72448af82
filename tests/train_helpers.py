"""What the trainer tests share (test_train.py, test_checkpoint.py, test_metrics.py,
test_weight_sync.py, test_lora_sync.py), besides the fixtures in conftest.py.

- recorded_reward: a module-level reward the rollout process imports by name (--reward
  train_helpers:recorded_reward), so this module imports nothing heavy.
- SERVER_ARGS, SMALL: a toy server with gloo weight transfer, and a run of a few seconds a step.
- cli / newest_checkpoint / lines: a trainer as a separate process, and what it leaves on disk;
  kill_launched: what a test left running of them (conftest, after every test).
"""
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_ARGS = ("--max-model-len", "128", "--weight-transfer-config", '{"backend":"gloo"}',
               "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1")
SMALL = dict(num_generations=4, max_completion_length=6, per_device_train_batch_size=4,
             token_budget=96, gradient_checkpointing=False, learning_rate=1e-3,
             vllm_server_timeout=60.0, disable_tqdm=True)     # a few seconds a step on a CPU


def recorded_reward(prompts, completions, index, **kwargs) -> list[float]:
    """Distinct rewards (never a flat group) and, when TRAIN_TEST_RECORD names a file, the dataset
    row index of every scored group appended to it (the resume test reads which prompts ran)."""
    path = os.environ.get("TRAIN_TEST_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(f"{index[0]}\n")
    return [float(i) + 0.1 * len(str(c)) for i, c in enumerate(completions)]


def lines(output_dir: str) -> list[dict]:
    """The records of <output_dir>/metrics.jsonl."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def newest_checkpoint(out: str) -> int:
    """The step of the newest checkpoint-N in `out` (0: none yet)."""
    if not os.path.isdir(out):
        return 0
    return max((int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-")),
               default=0)


def cli(out: str, url: str, dataset: str, *extra: str,
        record: str | None = None) -> subprocess.Popen:
    """`python train.py` against `url`, in its own process group, with recorded_reward and SMALL;
    the model is the directory `model` beside `dataset`."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"), OMP_NUM_THREADS="1")
    if record:
        env["TRAIN_TEST_RECORD"] = record
    flags = [f"--{k}={v}" for k, v in SMALL.items() if k != "disable_tqdm"]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model",
           os.path.dirname(dataset) + "/model", "--dataset", dataset,
           "--reward", "train_helpers:recorded_reward", "--vllm_server_base_url", url,
           "--output_dir", out, "--disable_tqdm", "true", *flags, *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    LAUNCHED.append(proc)
    return proc


LAUNCHED: list[subprocess.Popen] = []     # every cli() run; conftest kills what a test left


def kill_launched() -> None:
    """SIGKILL the process group of every cli() run still alive (a test that failed or timed out
    waiting on one): nothing it started outlives its test."""
    while LAUNCHED:
        proc = LAUNCHED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pid_reward(prompts, completions, **kwargs) -> list[float]:
    """recorded_reward's rewards and, when TRAIN_TEST_PIDS names a file, one line per scored group:
    the pid of the process that scored it, its parent's pid and its RANK variable (test_train_nodes
    reads which process ran the rollouts)."""
    path = os.environ.get("TRAIN_TEST_PIDS")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {os.getppid()} {os.environ.get('RANK')}\n")
    return recorded_reward(prompts, completions, **kwargs)
