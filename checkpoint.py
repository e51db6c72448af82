"""Checkpoints and resuming: a checkpoint-N/ every save_steps, the resume from one, and one run per
output_dir (spec: チェックポイントと再開 (Checkpoints and resuming): save_steps, resume_from_checkpoint).

    <output_dir>/checkpoint-20/       written as .checkpoint-20.tmp/, renamed when complete: a crash
      model.safetensors,              leaves the last complete checkpoint as it was
      config.json, tokenizer files    the servable model in the training dtype (bf16 under bf16
                                      mixed precision, not the fp32 master size) → from_pretrained
      (LoRA: adapter_model.safetensors + adapter_config.json → PeftModel.from_pretrained)
      fsdp/                           torch.distributed.checkpoint: the sharded master weights and
                                      optimizer state, what a resume loads
      scheduler.pt, rng_state_<rank>.pth   loaded weights_only: tensors and numbers, no code
      trainer_state.json              {"global_step": 20, "model_version": 20, "num_tokens": ...,
                                      "settings": what the resume checks (settings())}
      rollout_state.json              {"prompt_index": 157, "trained": {"157": 2, "159": 4}}: the
                                      first prompt not wholly trained, and the samples of it and of
                                      later prompts trained already (the resume skips those)

save_only_model=True writes the model files, trainer_state.json and rollout_state.json only (no
fsdp/, scheduler, RNG): a servable model, not a resume point. copy_model() copies a checkpoint's
model files (AsyncGRPOTrainer.save_model); load_model() reads them back.

One run per output_dir: a live run holds <output_dir>/.run.lock (hold: an flock, released by the
kernel however the run dies), and another run into it while it lives is refused, whatever its
flags; a run that does not resume refuses a directory holding another run's checkpoints or
metrics (claim), or with overwrite_output_dir removes them first. open_run does all of this, in
one call, before a run writes anything; due() says which steps save. Every file and directory is
fsynced before the rename, and the rename before older checkpoints are pruned.

Resume (`resume_from_checkpoint=True`: the newest checkpoint in output_dir; or a path) restores
all of it; the rollout process starts at prompt_index, the trainer syncs the saved weights to the
servers before generation starts, and running totals (num_tokens, *_total) continue. It first
checks what it resumes (check_resume): a changed dataset, num_generations or prompt order is
refused (the cursor counts in them), a changed optimisation setting applied and said. A resume
cuts metrics.jsonl and completions.jsonl back to the checkpoint's steps (metrics.py). fsdp/ holds
torch's DCP metadata, a pickle: resume only checkpoints you trust (the model files are
safetensors, safe to share).

Departures from the spec, one line each:
- One torch.distributed.checkpoint folder, not pytorch_model_fsdp.bin + optimizer.bin: it reshards.
- rollout_state.json's "trained" (ours): samples trained past prompt_index are not trained again.
- A resume applies the current learning rate, schedule and AdamW settings (the Trainer keeps the
  checkpoint's).
"""
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger(__name__)
LOCK = ".run.lock"                # held by the run that writes output_dir (hold)
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "metrics.png")   # besides checkpoint-N/
CURSOR = ("num_generations", "train_sampling_strategy")   # + shuffle_seed, the dataset's identity
OPTIMIZATION = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
                "max_steps", "max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2",
                "adam_epsilon", "optim")


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
    skipped_steps_total: int = 0       # steps not applied: not finite (skipped_steps_total)
    prompt_index: int = 0              # first prompt not wholly trained (rollout_state.json)
    trained: dict = field(default_factory=dict)   # prompt index ≥ it → samples trained (same)
    settings: dict = field(default_factory=dict)  # what the run trains under (settings())


def settings(config, dataset) -> dict:
    """What a resume checks (check_resume). "cursor": what rollout_state.json's counts depend on,
    which prompt sits at which index and how many samples each has: num_generations, the order
    (train_sampling_strategy, shuffle_seed) and the dataset (its rows, and a digest of up to 1,024
    prompts spread over them: another, reordered or filtered dataset changes it, the same rows
    from a copied file do not). The world size is not among them: prompt indices count prompts,
    not ranks. "optimization": the settings a resume applies (OPTIMIZATION)."""
    cursor = {name: getattr(config, name) for name in CURSOR}
    cursor["shuffle_seed"] = config.shuffle_seed()
    if dataset is not None and hasattr(dataset, "__len__"):      # a stream restarts at 0 anyway
        n = len(dataset)
        picked = [dataset[i * n // min(n, 1024)]["prompt"] for i in range(min(n, 1024))]
        text = json.dumps(picked, sort_keys=True, default=str).encode()
        cursor |= {"dataset_rows": n, "dataset_prompts": hashlib.sha256(text).hexdigest()[:16]}
    optimization = {name: getattr(config, name) for name in OPTIMIZATION}
    return json.loads(json.dumps({"cursor": cursor, "optimization": optimization}, default=str))


def check_resume(path: str, now: dict, say: bool = True) -> None:
    """Before a resume from `path` under settings `now` (settings()): ValueError naming each
    cursor setting that changed, old and new (the saved prompt index and trained counts would
    drop or repeat samples); a changed optimisation setting is logged (`say`) and applied
    (load())."""
    saved = read(os.path.join(path, "trainer_state.json"), read_json).get("settings", {})
    changed = {kind: [f"{name} {old!r} → {now[kind].get(name)!r}"
                      for name, old in saved.get(kind, {}).items() if now[kind].get(name) != old]
               for kind in ("cursor", "optimization")}
    if changed["cursor"]:
        raise ValueError(f"resume_from_checkpoint={path}: {'; '.join(changed['cursor'])}. The "
                         "checkpoint's data cursor (rollout_state.json) counts prompts and "
                         "samples under the old values, so this run would drop or repeat "
                         "samples: resume with them as they were, or start a new run (another "
                         "--output_dir, or --overwrite_output_dir true)")
    if changed["optimization"] and say:
        log.warning("resume_from_checkpoint=%s: applying the changed %s", path,
                    ", ".join(changed["optimization"]))


@contextlib.contextmanager
def open_run(output_dir: str, config, dataset, resume=None, rank0: bool = True, say: bool = True):
    """A run into output_dir opens here, before anything else is done or written: find the
    checkpoint to resume (`resume`, else config.resume_from_checkpoint: find), hold the directory
    (rank 0: hold), then check the resume (check_resume; `say`: log what it changes) or claim the
    directory (rank 0: claim). Yields (the checkpoint to resume or None, a TrainState holding
    this run's settings); the directory is held until the block ends, however it ends."""
    path = find(output_dir, resume or config.resume_from_checkpoint)
    state = TrainState(settings=settings(config, dataset))
    with hold(output_dir) if rank0 else contextlib.nullcontext():
        if path:
            check_resume(path, state.settings, say=say)
        elif rank0:
            claim(output_dir, config.overwrite_output_dir)
        yield path, state


def hold(output_dir: str):
    """Rank 0, before anything is written or removed in output_dir: an flock on its .run.lock,
    held while the returned file is open (the run's life; the kernel releases it when the process
    dies, however it dies). ValueError if a live run holds it: the two would write the same
    checkpoints and metrics, and an overwrite or a resume would remove or rewind the live one's."""
    os.makedirs(output_dir, exist_ok=True)
    held = open(os.path.join(output_dir, LOCK), "w")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        raise ValueError(f"output_dir {output_dir!r} is in use by a run that is still going (it "
                         f"holds {LOCK}): wait for it to end or stop it, or choose another "
                         "--output_dir") from None
    return held


def claim(output_dir: str, overwrite: bool) -> None:
    """One run per output_dir, for a run that does not resume: ValueError if output_dir holds
    another run's checkpoints or metrics; with `overwrite` they are removed instead (what else is
    there stays: serve_local.log, and .vllm_lora/, which an adapter sync clears)."""
    found = sorted(n for n in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
                   if n in RUN_FILES or re.fullmatch(r"\.?checkpoint-\d+(\.tmp|\.deleting)?", n))
    if found and not overwrite:
        raise ValueError(f"output_dir {output_dir!r} holds another run ({', '.join(found[:4])}): "
                         "continue it with --resume_from_checkpoint true, replace it with "
                         "--overwrite_output_dir true (its checkpoints and metrics are removed), "
                         "or choose another --output_dir")
    for name in found:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


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
    weights = exported(policy, config)
    if not config.save_only_model:
        model_state, optim_state = get_state_dict(policy, optimizer)
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=os.path.join(tmp, "fsdp"))
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng = {"python": random.getstate(),
               "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
               "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        torch.save(rng, os.path.join(tmp, f"rng_state_{rank}.pth"))
        fsync(os.path.join(tmp, f"rng_state_{rank}.pth"))   # by its writer (dcp fsyncs its own)
    if rank == 0:
        policy.model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
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
        fsync_tree(tmp)              # every file and directory on disk before the rename
        if os.path.exists(final):    # the same step saved again (a resume from an older one)
            discard(output_dir, state.global_step)
        os.rename(tmp, final)        # atomic: the checkpoint appears complete or not at all
        fsync(output_dir)            # the rename on disk before any older checkpoint goes
        prune(output_dir, config.save_total_limit, state.global_step)
    dist.barrier()
    return final


def due(config, step: int, last: bool = False) -> bool:
    """Whether step `step` writes checkpoint-N (save()): every save_steps and, at the end (`last`),
    a last step the schedule did not save; never with save_strategy="no"."""
    on_schedule = step % config.every("save_steps") == 0
    return config.save_strategy == "steps" and (not on_schedule if last else on_schedule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard, detached; a plain tensor as it is. For a shard this is an
    all-gather: every rank must call it, in the same order."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def exported(policy, config) -> dict[str, torch.Tensor]:
    """What save_pretrained writes, in the export dtype (config.export_dtype; integer tensors as
    they are): a peft model's adapter (its trainable tensors: LoRA's, DoRA's magnitudes,
    modules_to_save's copies), else the model's whole state dict. Every rank calls it (each
    tensor is one all-gather); rank 0 keeps them on the CPU, the others get {}. A checkpoint and
    an adapter sync (lora_sync.AdapterSync) write the same tensors."""
    model = policy.model
    dtype = config.export_dtype(next(policy.parameters()))
    if hasattr(model, "peft_config"):
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    else:
        named = model.state_dict().items()
    out = {}
    for name, value in named:                           # gathered one at a time
        tensor = full_tensor(value)
        if dist.get_rank() == 0:
            out[name] = tensor.to("cpu", dtype if tensor.is_floating_point() else tensor.dtype)
    return out


def fsync_tree(path: str) -> None:
    """fsync every file under `path`, then every directory, the deepest first."""
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync(os.path.join(root, name))
        fsync(root)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_model(path: str, output_dir: str) -> None:
    """The model and tokenizer files of checkpoint `path` into output_dir (made if missing), not
    what only a resume reads."""
    shutil.copytree(path, output_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
        "fsdp", "scheduler.pt", "trainer_state.json", "rollout_state.json", "rng_state_*"))


def load_model(path: str):
    """The model of checkpoint `path`, on the CPU: a causal LM, or with LoRA the adapter over its
    base model (peft)."""
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM
        return AutoPeftModelForCausalLM.from_pretrained(path)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path)


def prune(output_dir: str, limit: int | None, written: int) -> None:
    """After checkpoint-<written>: delete the checkpoints past it (a history that a resume from an
    older one abandoned, as metrics.jsonl was cut back to it), then all but the newest `limit`:
    the one just written is never deleted."""
    found = sorted(step for step, _ in checkpoints(output_dir))
    doomed = [step for step in found if step > written]
    if limit is not None:
        doomed += [step for step in found if step <= written][:-limit]
    for step in doomed:
        discard(output_dir, step)


def discard(output_dir: str, step: int) -> None:
    """Delete checkpoint-<step>, renamed out of sight first (a crash mid-delete leaves no part of
    it that find() could take for complete)."""
    doomed = os.path.join(output_dir, f".checkpoint-{step}.deleting")
    os.rename(os.path.join(output_dir, f"checkpoint-{step}"), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def load(path: str, policy, optimizer, scheduler) -> TrainState:
    """Restore a checkpoint written by save() into the sharded model, optimizer, scheduler and
    RNGs, under this run's optimisation settings: the parameter groups keep the hyperparameters
    they were built with (learning rate, betas, eps, weight_decay), and the scheduler continues
    at the saved step from this run's learning rate and schedule (check_resume says what
    changed). torch.load reads tensors and numbers only (weights_only); a file that does not read
    is named (read)."""
    if not os.path.isdir(os.path.join(path, "fsdp")):
        raise ValueError(f"{path} was saved with save_only_model=True: it holds no optimizer or "
                         "master-weight state to resume from; resume from a checkpoint saved "
                         "without it, or load the model with from_pretrained")
    built = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    model_state, optim_state = get_state_dict(policy, optimizer)
    state = {"model": model_state, "optim": optim_state}
    read(os.path.join(path, "fsdp"), lambda fsdp: dcp.load(state, checkpoint_id=fsdp))
    set_state_dict(policy, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for group, hyper in zip(optimizer.param_groups, built):
        group.update(hyper)
    schedule = read(os.path.join(path, "scheduler.pt"), load_tensors)
    scheduler.load_state_dict(schedule | {"base_lrs": scheduler.base_lrs,
                                          "last_epoch": schedule["last_epoch"] - 1})
    scheduler.step()                      # the saved step's learning rate, from this run's
    rng_file = os.path.join(path, f"rng_state_{dist.get_rank()}.pth")
    if os.path.exists(rng_file):          # a resume on more ranks than saved starts fresh RNGs
        rng = read(rng_file, load_tensors)
        random.setstate(rng["python"])
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    saved = read(os.path.join(path, "trainer_state.json"), read_json)
    saved |= read(os.path.join(path, "rollout_state.json"), read_json)
    saved["trained"] = {int(p): n for p, n in saved.get("trained", {}).items()}
    return TrainState(**saved)


def read(path: str, reader):
    """reader(path), for every read of a resume: a file that cannot be read (cut or emptied by a
    copy that did not finish, altered) is named, path and so its checkpoint-N; in the fsdp/
    folder, the file its index finds short (damaged_in)."""
    try:
        return reader(path)
    except (Exception, CheckpointException) as e:       # DCP's own is a BaseException
        where = damaged_in(path) if os.path.isdir(path) else path
        why = (str(e).strip() or type(e).__name__).splitlines()[-1].split(". ")[0]
        raise ValueError(f"resume_from_checkpoint: {where} cannot be read ({why}): copy it "
                         "again from where the run saved it, or resume from another") from e


def damaged_in(fsdp: str) -> str:
    """The damaged file of a DCP folder: .metadata if it does not load, else the first shard
    shorter than the end of a tensor its index records; the folder if none is."""
    try:
        index = dcp.FileSystemReader(fsdp).read_metadata().storage_data.values()
    except Exception:
        return os.path.join(fsdp, ".metadata")
    ends = {(os.path.join(fsdp, item.relative_path), item.offset + item.length) for item in index}
    return min((p for p, end in ends if not os.path.isfile(p) or os.path.getsize(p) < end),
               default=fsdp)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def load_tensors(path: str):
    """torch.load of tensors, numbers and containers only (weights_only): a file that holds
    anything else, code that would run on load, is refused with its name, and nothing in it runs."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds more than tensors and numbers, so it was not loaded "
                         "(nothing in it ran): this trainer did not write it, or it was altered; "
                         "resume only checkpoints you trust") from e
