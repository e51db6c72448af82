"""log_completions, num_completions_to_print (AsyncGRPOConfig; 記録されたメトリクス (Logged
metrics)): the record of what was trained, <output_dir>/completions.jsonl, one line per trained
sample, written by rank 0 after each optimizer step:

    {"step": 12, "prompt_index": 37, "model_version": 10, "staleness": 1, "reward": 0.8,
     "advantage": 0.5, "completion_tokens": 6, "completion": "3 + 4 = 7", "prompt": "3 + 4 ="}

    step               the optimizer step that trained the sample (not the one that took it from
                       the queue: a sample may wait in an open row for the next step)
    staleness          the trainer's policy version at that step minus model_version
    completion_tokens  the tokens the loss covers (completion_mask: tool results excluded)
    prompt             on the first line of each prompt_index only; load() fills in the others

A resume truncates the file to the steps of its checkpoint (truncate(), atomic), so the file
describes the trained model: with rollout_state.json's exactly-once resume, each prompt_index of
an epoch has num_generations lines however often the run was killed. A fresh run (step 0) starts
it empty. `python train.py plot RUN` draws reward by prompt_index from it (train_metrics.plot).

Departures from the spec, one line each:
- Every trained sample is written to the file; the console prints num_completions_to_print.
"""
import json
import os

import numpy as np

FILE = "completions.jsonl"


def text(messages) -> str:
    """A prompt or completion as text: a string as is, a conversation's contents joined."""
    if isinstance(messages, list):
        return " ".join(m.get("content") or "" for m in messages)
    return "" if messages is None else str(messages)


def truncate(output_dir: str, step: int) -> set[int]:
    """Keep the lines of steps <= `step` (atomically: a kill leaves the old file or the new one).
    Returns the prompt indices whose prompt text is written already."""
    path = os.path.join(output_dir, FILE)
    if not os.path.exists(path):
        return set()
    kept = [r for r in _read(path) if r["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(path + ".tmp", path)
    return {r["prompt_index"] for r in kept if "prompt" in r}


def records(step: int, version: int, samples: list, prompted: set[int]) -> list[dict]:
    """The lines of the samples one optimizer step trained under policy `version`; `prompted`
    (updated) holds the prompt indices whose prompt text was written."""
    out = []
    for s in samples:
        line = {"step": step, "prompt_index": s.prompt_index, "model_version": s.model_version,
                "staleness": version - s.model_version, "reward": float(s.reward),
                "advantage": float(s.advantage),
                "completion_tokens": int(s.completion_mask.sum()),
                "completion": text(s.completion)}
        if s.prompt_index not in prompted:
            prompted.add(s.prompt_index)
            line["prompt"] = text(s.prompt)
        out.append(line)
    return out


def load(run_dir: str) -> list[dict]:
    """The lines of <run_dir>/completions.jsonl, each with its prompt text filled in."""
    lines = _read(os.path.join(run_dir, FILE))
    prompts = {r["prompt_index"]: r["prompt"] for r in lines if "prompt" in r}
    return [r | {"prompt": prompts.get(r["prompt_index"], "")} for r in lines]


def reward_by_prompt(lines: list[dict]) -> dict[int, float]:
    """prompt_index → the mean reward of its trained samples."""
    rewards: dict[int, list[float]] = {}
    for r in lines:
        rewards.setdefault(r["prompt_index"], []).append(r["reward"])
    return {p: float(np.mean(v)) for p, v in sorted(rewards.items())}


def _read(path: str) -> list[dict]:
    """The complete lines (a kill mid-write may leave a last one without its newline)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
