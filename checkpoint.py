"""チェックポイントと再開 (Checkpoints and resuming): save every save_steps; resume_from_checkpoint.

    <output_dir>/checkpoint-20/       written as .checkpoint-20.tmp/, renamed when complete: a crash
      model.safetensors,              leaves the last complete checkpoint as it was
      config.json, tokenizer files    the servable model in the training dtype (bf16 under bf16
                                      mixed precision, not the fp32 master size) → from_pretrained
      (LoRA: adapter_model.safetensors + adapter_config.json → PeftModel.from_pretrained)
      fsdp/                           torch.distributed.checkpoint: the sharded master weights and
                                      optimizer state, what a resume loads
      scheduler.pt, rng_state_<rank>.pth
      trainer_state.json              {"global_step": 20, "model_version": 20, "num_tokens": ...}
      rollout_state.json              {"prompt_index": 157, "trained": {"157": 2, "159": 4}}: the
                                      first prompt not wholly trained, and the samples of it and of
                                      later prompts trained already (the resume skips those)

save_only_model=True writes the model files, trainer_state.json and rollout_state.json only (no
fsdp/, scheduler, RNG): a servable model, not a resume point. copy_model() copies a checkpoint's
model files (AsyncGRPOTrainer.save_model); load_model() reads them back.

Resume (`resume_from_checkpoint=True`: the newest checkpoint in output_dir; or a path) restores
all of it; the rollout process starts at prompt_index, the trainer syncs the saved weights to the
servers before generation starts, and running totals (num_tokens, *_total) continue. A resume
truncates completions.jsonl to the checkpoint's steps (metrics.py).

Departures from the spec, one line each:
- One torch.distributed.checkpoint folder, not pytorch_model_fsdp.bin + optimizer.bin: it reshards.
- rollout_state.json's "trained" (ours): samples trained past prompt_index are not trained again.
"""
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from weight_sync import full_tensor


@dataclass
class TrainState:
    """What a resume needs besides the tensors (trainer_state.json, rollout_state.json). The one
    owner of the run's counters: train() advances the step and version, rank 0's Feed (train.py)
    counts the tokens and drops on it, the metrics read them here, and a resume loads them."""
    global_step: int = 0               # optimizer steps so far
    model_version: int = 0             # weight syncs so far
    num_tokens: int = 0                # forwarded tokens since the start (num_tokens metric)
    dropped_stale_total: int = 0       # samples dropped as stale (sample/dropped_stale_total)
    dropped_oversize_total: int = 0    # over token_budget (batch/dropped_oversize_total)
    prompt_index: int = 0              # first prompt not wholly trained (rollout_state.json)
    trained: dict = field(default_factory=dict)   # prompt index ≥ it → samples trained (same)


def find(output_dir: str, resume) -> str | None:
    """The checkpoint to resume from: None/False → none; True/"true" → the newest in output_dir."""
    if resume in (None, False, "", "false", "False"):
        return None
    if resume in (True, "true", "True"):
        found = checkpoints(output_dir)
        if not found:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir!r} holds no "
                             "checkpoint-N directory")
        return max(found)[1]
    if not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise ValueError(f"resume_from_checkpoint={resume!r} is not a complete checkpoint "
                         "(no trainer_state.json)")
    return resume


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in output_dir."""
    if not os.path.isdir(output_dir):
        return []
    return [(int(m[1]), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
            if (m := re.fullmatch(r"checkpoint-(\d+)", name))]


def save(output_dir: str, state: TrainState, policy, optimizer, scheduler, tokenizer,
         config) -> str:
    """Write checkpoint-<global_step> (every rank calls it); prune to save_total_limit. Returns its
    path."""
    rank = dist.get_rank()
    final = os.path.join(output_dir, f"checkpoint-{state.global_step}")
    tmp = os.path.join(output_dir, f".checkpoint-{state.global_step}.tmp")
    if rank == 0:
        for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
            if re.fullmatch(r"\.checkpoint-\d+\.(tmp|deleting)", name):   # a crash's leftovers
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model = policy.model
    dtype = config.export_dtype(next(policy.parameters()))
    peft = hasattr(model, "peft_config")
    exported = {}
    for name, value in model.state_dict().items():      # gathered one at a time; rank 0 keeps them
        if peft and "lora_" not in name:
            continue
        tensor = full_tensor(value)
        if rank == 0:
            exported[name] = tensor.to("cpu", dtype if tensor.is_floating_point() else tensor.dtype)
    if rank == 0:
        model.save_pretrained(tmp, state_dict=exported)
        tokenizer.save_pretrained(tmp)
    if not config.save_only_model:
        model_state, optim_state = get_state_dict(policy, optimizer)
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=os.path.join(tmp, "fsdp"))
        rng = {"python": random.getstate(),
               "numpy": np.random.get_state(),
               "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        torch.save(rng, os.path.join(tmp, f"rng_state_{rank}.pth"))
    if rank == 0:
        if not config.save_only_model:
            torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        rollout_state = {"prompt_index": state.prompt_index, "trained": state.trained}
        trainer_state = {k: v for k, v in asdict(state).items() if k not in rollout_state}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f, indent=2)
        with open(os.path.join(tmp, "rollout_state.json"), "w") as f:
            json.dump(rollout_state, f)
    dist.barrier()
    if rank == 0:
        if os.path.exists(final):    # the same step saved again (a resume from an older one)
            discard(output_dir, state.global_step)
        os.rename(tmp, final)        # atomic: the checkpoint appears complete or not at all
        prune(output_dir, config.save_total_limit)
    dist.barrier()
    return final


RESUME_FILES = ("fsdp", "scheduler.pt", "trainer_state.json", "rollout_state.json")


def copy_model(path: str, output_dir: str) -> None:
    """The model and tokenizer files of checkpoint `path` into output_dir (made if missing)."""
    shutil.copytree(path, output_dir, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(*RESUME_FILES, "rng_state_*"))


def load_model(path: str):
    """The model of checkpoint `path`, on the CPU: a causal LM, or with LoRA the adapter over its
    base model (peft)."""
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM
        return AutoPeftModelForCausalLM.from_pretrained(path)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path)


def prune(output_dir: str, limit: int | None) -> None:
    """Delete all but the newest `limit` checkpoints."""
    if limit is None:
        return
    for step, _ in sorted(checkpoints(output_dir))[:-limit]:
        discard(output_dir, step)


def discard(output_dir: str, step: int) -> None:
    """Delete checkpoint-<step>, renamed out of sight first (a crash mid-delete leaves no part of
    it that find() could take for complete)."""
    doomed = os.path.join(output_dir, f".checkpoint-{step}.deleting")
    os.rename(os.path.join(output_dir, f"checkpoint-{step}"), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def load(path: str, policy, optimizer, scheduler) -> TrainState:
    """Restore a checkpoint written by save() into the sharded model, optimizer, scheduler and
    RNGs."""
    if not os.path.isdir(os.path.join(path, "fsdp")):
        raise ValueError(f"{path} was saved with save_only_model=True: it holds no optimizer or "
                         "master-weight state to resume from; resume from a checkpoint saved "
                         "without it, or load the model with from_pretrained")
    model_state, optim_state = get_state_dict(policy, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(path, "fsdp"))
    set_state_dict(policy, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
    rng_file = os.path.join(path, f"rng_state_{dist.get_rank()}.pth")
    if os.path.exists(rng_file):          # a resume on more ranks than saved starts fresh RNGs
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)
    with open(os.path.join(path, "rollout_state.json")) as f:
        saved |= json.load(f)
    saved["trained"] = {int(p): n for p, n in saved.get("trained", {}).items()}
    return TrainState(**saved)
