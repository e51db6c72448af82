"""The trainer: a torchrun/FSDP2 loop that trains on the rollout queue while the rollout process
generates (spec: 概要 (Overview), GRPOTrainerとの違い (Differences from GRPOTrainer), バッチ番号の構成
(Batch composition)). train() is the whole loop; AsyncGRPOTrainer is the spec's class over it.

    python train.py                                       # the toy task, end to end, on a CPU
    torchrun --nproc_per_node 4 train.py --model Qwen/Qwen3-4B --dataset trl-lib/DeepMath-103K \\
        --reward my_rewards:accuracy --vllm_server_base_url http://gpu0:8000
    python -m tools.plot runs/toy                         # reward, loss, staleness, speed → PNG

One optimizer step, top-down (each line names the file that does it):

    rank 0  samples ← RolloutWorker.get()       rollout/worker.py ← rollout/loop.py (the child)
            drop the stale (staleness > max_staleness) and oversize ones, feed the Planner
            until gradient_accumulation_steps micro-batches of world_size rows are planned,
            pack every row as a prefix trie (Feed.next_step)                        trie_pack.py
            count the drops and the forwarded tokens on the run's TrainState       checkpoint.py
            scatter each rank its rows                                    (row-slots: GA × world)
    all     per row: hidden = Policy(row), tree attention                 tree_attention.py
                     loss = compute_loss(hidden, LM head, row, n)    loss.py (n: the step's tokens)
                     backward (FSDP2 reduce-scatters the gradients)
            clip, optimizer.step(), scheduler.step()
            every weight_sync_steps: sync.push → new policy version    weight_sync.py, lora_sync.py
    rank 0  RolloutWorker.set_model_version(v); metrics → metrics.jsonl           metrics.py
            every save_steps: checkpoint-N/ (+ rollout_state.json)          checkpoint.py

Other spec sections: AsyncGRPOConfig → config.py; 並行性 (Concurrency) and admission by staleness →
rollout/; チェックポイントと再開 (Checkpoints and resuming) → checkpoint.py; 記録されたメトリクス
(Logged metrics) → metrics.py. Below train(): setup, rank 0's step (Step, Feed), every rank's
train_step, the spec's AsyncGRPOTrainer with its callbacks (Hooks), and the command line (main).

Departures from the spec, one line each:
- torchrun + torch.distributed FSDP2 (fully_shard per decoder layer, then the root): no accelerate.
- Rank 0 plans the whole step before the first backward: the loss divides by the step's token count.
- Stale samples are dropped here too (the spec's promise), though admission rarely lets one by.
- Rollouts request the server's base model card by name: the id a trainer loads need not match it.
- callbacks: eight of TrainerCallback's events on rank 0 (Hooks); optimizers: only (None, None).
- The flags are ours (HfArgumentParser's): the spec's scripts build AsyncGRPOConfig themselves.
- A script that hands the trainer a function or class it defines calls it under the guard
  `if __name__ == "__main__":` (rollout.worker.check_main_guard); others need none.
"""
import argparse
import contextlib
import copy
import importlib
import logging
import math
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from transformers import set_seed

import checkpoint
import lora_sync
import metrics
import tree_attention
import verify_sync
from checkpoint import full_tensor
from config import AsyncGRPOConfig, dtype_name   # the spec imports the first from here
from loss import (MOE_EXPERT_FIELDS, StepTotals, compute_loss, extreme, finalize_metrics,
                  reduce_metrics, router_aux_loss_coef, row_logprobs)
from rollout import (AsyncRolloutLoop, Rollout, RolloutGroup,  # noqa: F401 (the spec's records)
                     RolloutSample, TurnRecord)
from rollout.prompts import check_eval_source, check_prompt_source
from rollout.worker import RolloutWorker, check_main_guard
from trie_pack import Planner, build_row
from vllm_client import VLLMClient, server_urls
from weight_sync import language_parameters

# ── the loop ─────────────────────────────────────────────────────────────────────────────────


def train(config, dataset, reward_funcs=None, *, model, processing_class=None, tools=None,
          environment_factory=None, loop_cls=AsyncRolloutLoop, peft_config=None,
          resume_from_checkpoint=None, hooks=None, eval_dataset=None) -> dict:
    """Train `model` with asynchronous GRPO until the prompts run out (num_train_epochs) or
    max_steps; every rank calls it (torchrun). `hooks`: the callbacks and the TrainerState they
    see (Hooks). Returns the last logged metrics (rank 0; {} on the other ranks)."""
    check_main_guard(config, dataset, reward_funcs, processing_class, tools, environment_factory,
                     loop_cls, eval_dataset)    # what the rollout process will be handed
    check_eval_source(config, dataset, eval_dataset)
    output_dir = config.output_dir
    rank0 = is_rank0()
    with contextlib.ExitStack() as stack:       # each release registered beside its acquisition
        resume, state = stack.enter_context(checkpoint.open_run(  # one live run per output_dir
            output_dir, config, dataset, resume_from_checkpoint, rank0=rank0, say=rank0))
        rank, world, device = setup_distributed(config)
        stack.callback(dist.destroy_process_group)
        hooks = hooks or Hooks([], config)
        set_seed(config.seed)   # random, numpy, torch on every rank: the weights agree to shard
        reference = reference_policy(model, config, processing_class, peft_config, device)
        model, tokenizer = load_model(model, config, processing_class, peft_config, device)
        aux_coef = router_aux_loss_coef(model.config, config.router_aux_loss_coef)
        policy = shard(Policy(model), config, device)
        optimizer, scheduler = build_optimizer(policy, config)
        scaler = ShardedGradScaler(device=device.type) if config.fp16 else None  # loss scaling
        if resume:
            state = replace(checkpoint.load(resume, policy, optimizer, scheduler),
                            settings=state.settings)    # the next checkpoint records this run's
        hooks.state.global_step = state.global_step
        clients = [VLLMClient(url, timeout=config.vllm_server_timeout)
                   for url in server_urls(config)]
        stack.callback(lambda: [c.close() for c in clients])
        verifier = verify_sync.Verifier(policy, config) if config.weight_sync_verify_every else None
        sync = lora_sync.choose(policy, clients, config, tokenizer, peft_config, output_dir,
                                verifier)   # full weights, or LoRA's adapter or merged weights
        stack.callback(sync.close)              # LoRA: the servers unload this run's adapters
        sync.start(state.model_version)         # the servers may hold another run's weights
        if rank == 0:                           # rank 0's end of the rollout queue
            budget = config.token_budget
            budget = clients[0].max_model_len() if budget is None else budget
            planner = Planner(world, budget, config.per_device_train_batch_size)
            worker = RolloutWorker(config, dataset, reward_funcs, tokenizer, tools=tools,
                                   environment_factory=environment_factory, loop_cls=loop_cls,
                                   eos_token_ids=stop_token_ids(model, tokenizer),
                                   num_processes=world, dataset_start_index=state.prompt_index,
                                   trained=state.trained, model_version=state.model_version,
                                   eval_dataset=eval_dataset, **sync.worker_kwargs)
            log = metrics.MetricsLog(config, output_dir, state, policy.model, device,
                                     rollout_metrics=worker.drain_metrics, evaluator=worker,
                                     on_log=lambda line: hooks.event("on_log", logs=line),
                                     on_evaluate=lambda m: hooks.event("on_evaluate", metrics=m))
            stack.callback(log.close, state)    # a run that logged nothing says why
            feed = Feed(worker, planner, config.gradient_accumulation_steps, state,
                        on_wait=lambda: log.waiting(state))
            stack.callback(worker.stop)
            worker.start()
            log.evaluate(state, start=True)     # eval_on_start (or a resume's lost one)
            hooks.event("on_train_begin")
        skipped = 0                             # non-finite steps in a row

        def save(last: bool = False) -> None:   # checkpoint-N/ when checkpoint.due says so
            if checkpoint.due(config, state.global_step, last):
                checkpoint.save(output_dir, state, policy, optimizer, scheduler, tokenizer, config)
                hooks.event("on_save")

        while config.max_steps <= 0 or state.global_step < config.max_steps:
            started = time.perf_counter()
            # a callback's stop (control.should_training_stop): no step, which ends every rank
            plans = rank == 0 and not hooks.control.should_training_stop
            step = plan_step(feed, state.model_version, config.max_staleness) if plans else None
            rows, totals = scatter_rows(step, rank, world)
            if rows is None:                    # the prompts are done
                break
            hooks.event("on_step_begin")
            if verifier is not None:            # the last sync's probe, before the weights change
                verifier.score_probe()
            step_metrics = train_step(policy, optimizer, scheduler, rows, totals, config,
                                      world, aux_coef, scaler, state.model_version, reference)
            state.global_step += 1
            hooks.state.global_step = state.global_step
            skipped = count_skipped(step_metrics, state, skipped)
            every = config.torch_empty_cache_steps
            if every and state.global_step % every == 0 and device.type == "cuda":
                torch.cuda.empty_cache()
            if state.global_step % config.weight_sync_steps == 0:
                step_metrics |= sync.push(state.model_version + 1)
                state.model_version += 1
                if rank == 0:
                    feed.worker.set_model_version(state.model_version)
            if rank == 0:
                step_metrics |= verifier.probe_kl if verifier else {}   # the last sync's probe
                step_metrics["perf/step_s"] = time.perf_counter() - started
                log.step(state, step_metrics, step)
                hooks.event("on_step_end")
            check_skipped(skipped, state.global_step, rank)
            save()                              # every save_steps
        if rank == 0:
            log.end(state)                      # the open window, the last evaluations
        save(last=True)                         # the last step, unless it was saved
        hooks.event("on_train_end")
        return log.last if rank == 0 else {}


# ── setup: processes, model, optimizer, sync ─────────────────────────────────────────────────


def is_rank0() -> bool:
    """Global rank 0: the process group's, or before it forms torchrun's RANK (none: alone)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def setup_distributed(config) -> tuple[int, int, torch.device]:
    """(rank, world size, device), with this rank's log level (set_log_level). Under torchrun:
    nccl on CUDA, gloo on CPU; alone: a group of one, so FSDP2 and torch.distributed.checkpoint
    run the same code."""
    cuda = torch.cuda.is_available()
    if cuda and config.tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.tf32
    if not dist.is_initialized():
        backend = config.ddp_backend or ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        wait_s = config.process_group_timeout()    # never below rank 0's wait for samples
        timeout = timedelta(seconds=wait_s)
        if "RANK" in os.environ:                # torchrun: its environment says where to meet
            try:
                dist.init_process_group(backend, timeout=timeout)
            except dist.DistError as e:         # a rank that never joins: named, with the wait
                env = os.environ
                raise RuntimeError(f"rank {env['RANK']} of {env.get('WORLD_SIZE')}: the process "
                                   f"group at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')} "
                                   f"did not form within {wait_s:g}s (ddp_timeout): {e}; start "
                                   "every rank against the same master") from e
        else:                                   # alone: nothing written to os.environ, and
            dist.init_process_group(backend, store=dist.HashStore(), rank=0,   # no store to listen
                                    world_size=1, timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    set_log_level(config, dist.get_rank())
    return dist.get_rank(), dist.get_world_size(), device


def set_log_level(config, rank: int) -> None:
    """log_level on the main process (each node's local rank 0 with log_on_each_node), else
    log_level_replica; "passive" leaves the level as it is."""
    local_main = config.log_on_each_node and os.environ.get("LOCAL_RANK", "0") == "0"
    level = config.log_level if rank == 0 or local_main else config.log_level_replica
    if level != "passive":
        logging.getLogger().setLevel(level.upper())


WHERE_KWARGS = ("revision", "subfolder", "cache_dir", "token", "local_files_only",
                "trust_remote_code")    # model_init_kwargs that say where the files are


def load_model(model, config, processing_class=None, peft_config=None, device=torch.device("cpu")):
    """(model, tokenizer) from a hub id, a local path, "toy" or a model object, with tree
    attention installed for the device that trains (tree_attention.choose_backend; default the
    CPU; said once). model_init_kwargs go to the model, and those that say where its files are
    (WHERE_KWARGS: revision, subfolder, ...) to its config and tokenizer too, so all three come
    from one revision. Vision-language configs load with AutoModelForImageTextToText and
    everything outside the text decoder and LM head (vision tower, projector) is frozen: no
    gradients, no optimizer state, not synced."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                              AutoTokenizer)
    kwargs = {"dtype": config.dtype, "trust_remote_code": config.trust_remote_code}
    kwargs |= config.model_init_kwargs or {}                       # its dtype wins (spec)
    where = {k: v for k, v in kwargs.items() if k in WHERE_KWARGS}   # config, tokenizer too
    path = getattr(getattr(model, "config", None), "_name_or_path", None)   # a model object's
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if path == "toy":
            import toy
            path = toy.ensure_saved()
        vision = getattr(AutoConfig.from_pretrained(path, **where), "vision_config", None)
        auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
        model = auto.from_pretrained(path, **kwargs)
    tokenizer = processing_class or AutoTokenizer.from_pretrained(path, **where)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    language = {id(p) for _, p in language_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in language)
    if peft_config is not None:
        from peft import get_peft_model
        model = get_peft_model(model, peft_config)
    backend, why = tree_attention.choose_backend(model, device, config.tree_attention_backend)
    tree_attention.install(model, backend)
    logging.getLogger(__name__).info("tree attention: %s (%s)", backend, why)
    if config.gradient_checkpointing:
        kwargs = {"use_reentrant": False} | (config.gradient_checkpointing_kwargs or {})
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model, tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every EOS id the generation config declares, and the tokenizer's: a turn ends on any."""
    declared = getattr(model.generation_config, "eos_token_id", None)
    ids = declared if isinstance(declared, list) else [declared]
    return sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None})


class Policy(torch.nn.Module):
    """The FSDP2 root: a packed row in, the text decoder's final hidden states out (the LM head is
    read by loss.py). Going through this root's forward makes FSDP2 gather the embedding and final
    norm (and the LM head, which the root keeps unsharded until backward)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.softcap = getattr(tree_attention.text_config(model), "final_logit_softcapping", None)

    def forward(self, row, **kwargs):
        """The decoder's output for one packed row: .last_hidden_state [1, N, H] (and .router_logits
        with output_router_logits=True)."""
        return tree_attention.forward_row(self.model, row, self.model.get_decoder(), **kwargs)

    def head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    def token_logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """Every rank (FSDP2 gathers in the forward): the [T] log-probs the policy gives the
        tokens of each (prompt, tokens), as the loss computes them, from one no-grad forward of
        all of them packed as one trie row (dropout off); fp32 on the CPU. verify_sync's probe
        scores the servers' tokens with it."""
        samples = [RolloutSample(input_ids=np.array(p + t, np.int64), advantage=0.0, group_id=0,
                                 completion_mask=np.array([0] * len(p) + [1] * len(t), np.int8),
                                 sampler_logprobs=np.zeros(len(p) + len(t), np.float32),
                                 model_version=0) for p, t in sequences]
        row = build_row(samples).pack()
        training = self.training
        self.eval()
        try:
            with torch.no_grad():
                lp = self.logprobs(row)                                               # [M]
        finally:
            self.train(training)
        return list(lp.float().cpu().split([len(t) for _, t in sequences]))  # [T] each

    def logprobs(self, row, temperature: float = 1.0) -> torch.Tensor:
        """[M] log π at a packed row's loss terms (loss.row_logprobs: at `temperature`, over the
        row's candidate sets), from this policy's forward and LM head."""
        head = self.head()
        hidden = self(row).last_hidden_state[0]                                    # [N, H]
        row = to_device(row, head.weight.device)
        return row_logprobs(hidden, head.weight, head.bias, row, temperature, self.softcap).target


def shard(policy: Policy, config, device: torch.device) -> Policy:
    """FSDP2: each decoder layer, then the root. The trainable master weights (and so the
    optimizer state) are fp32 whatever dtype they loaded in (spec: dtype); bf16 or fp16 compute
    with fp32 reductions when bf16 or fp16 is on. Frozen weights keep their dtype."""
    for p in policy.parameters():
        if p.requires_grad and p.is_floating_point():
            p.data = p.data.float()
    compute = config.compute_dtype(device)
    if compute != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for layer in tree_attention.decoder_layers(policy.model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    return policy.to(device)


def reference_policy(model, config, processing_class, peft_config, device):
    """The reference of beta > 0's KL: a function (policy, packed row) → log π_ref at the row's
    loss terms [M] (Policy.logprobs), run without gradients; None when beta is 0 (no reference
    forward, no reference weights). Under LoRA the reference is the policy with its adapter
    disabled, the base: no second copy. Otherwise it is a frozen copy of the starting `model`,
    loaded (or copied) before training changes it, in the compute dtype and sharded with FSDP2 like
    the policy: 2 bytes a parameter in bf16 (4 in fp32) spread over the ranks, one decoder layer
    gathered at a time during its forward."""
    if not config.beta:
        return None
    if peft_config is not None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        @torch.no_grad()
        def base(policy, row):
            # peft's disable_adapter() also turns the adapter's requires_grad off and on, which
            # FSDP2's sharded bf16 training does not survive; the layers' own switch suffices
            tuners = [m for m in policy.modules() if isinstance(m, BaseTunerLayer)]
            for layer in tuners:
                layer._disable_adapters = True
            try:
                return policy.logprobs(row, config.temperature)
            finally:
                for layer in tuners:
                    layer._disable_adapters = False
        return base
    if not isinstance(model, (str, os.PathLike)):
        model = copy.deepcopy(model)                    # before the policy's load changes it
    frozen_dtype = replace(config, dtype=dtype_name(config.compute_dtype(device)))
    frozen, _ = load_model(model, frozen_dtype, processing_class, None, device)
    frozen.requires_grad_(False)
    reference = shard(Policy(frozen), config, device)

    @torch.no_grad()
    def start(policy, row):
        logprobs = reference.logprobs(row, config.temperature)
        reference.reshard()                 # the root keeps its gathered weights after a forward
        return logprobs
    return start


def build_optimizer(policy: Policy, config):
    """AdamW over the trainable parameters, weight_decay on the matrices only (as the Trainer:
    biases and norm weights are not decayed), and the config's schedule (get_scheduler)."""
    from transformers import get_scheduler
    params = [p for p in policy.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    fused = config.optim == "adamw_torch_fused" and params[0].device.type == "cuda"
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.learning_rate,
                                  betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_epsilon, fused=fused or None)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer,
                              num_warmup_steps=config.every("warmup_steps"),
                              num_training_steps=max(config.max_steps, 1),
                              scheduler_specific_kwargs=config.lr_scheduler_kwargs or {})
    return optimizer, scheduler


# ── rank 0: one optimizer step of samples ────────────────────────────────────────────────────


@dataclass
class Step:
    """What one optimizer step took from the queue and planned (Feed.next_step returns it; the
    metrics read it, metrics.MetricsLog.step)."""
    version: int                    # the policy version it trains
    rows: list                      # [GA][world] TreeRow
    packed: list                    # [GA][world] PackedRow
    totals: StepTotals              # what the loss divides by: tokens (trained), samples, rows
    row_metrics: list[dict]         # the planner's batch/* metrics, one dict per micro-batch
    samples: list                   # the samples accepted from the queue this step
    queue_s: list[float]            # their seconds in the queue
    waited_s: float                 # perf/rollout_wait_s: seconds get() blocked
    queue_size: int                 # sample/rollout_queue_size at its start


WAIT_POLL_S = 1.0           # while no sample comes, Feed.on_wait is called this often


@dataclass
class Feed:
    """Rank 0's end of the rollout queue: the worker, the planner, and the run's TrainState (its
    counters: samples dropped, tokens forwarded)."""
    worker: RolloutWorker
    planner: Planner
    microbatches: int                                  # gradient_accumulation_steps
    state: checkpoint.TrainState                       # counts dropped_*_total and num_tokens
    on_wait: Callable[[], None] = lambda: None         # called while no sample comes
    finished: bool = False                             # the worker has no more samples

    def take(self):
        """The worker's next sample (None: the prompts are done); on_wait() every WAIT_POLL_S while
        none comes (MetricsLog.waiting: a window whose every group was dropped is logged)."""
        while True:
            try:
                return self.worker.get(timeout=WAIT_POLL_S)
            except queue.Empty:
                self.on_wait()

    def next_step(self, version: int, max_staleness: int) -> Step | None:
        """The next step: up to `microbatches` micro-batches of world_size PackedRows (fewer only
        at the end of the prompts); None when the prompts are done. A sample older than
        max_staleness versions is dropped, also one held in an open row since an earlier step
        (spec: SAMPLE ... dropped if staleness > max_staleness), and so is one over the token
        budget; the state counts both drops and the forwarded tokens, and holds the resume
        cursor (prompt_index, trained)."""
        samples, queue_s, rows, waited_s = [], [], [], 0.0
        queue_size = self.worker.qsize()
        stale = self.planner.drop(lambda s: version - s.model_version > max_staleness)
        self.state.dropped_stale_total += stale
        while len(rows) < self.microbatches and not self.finished:
            start = time.perf_counter()
            sample = self.take()
            waited_s += time.perf_counter() - start
            if sample is None:
                self.finished = True
                micro = self.planner.flush()
            elif version - sample.model_version > max_staleness:
                self.state.dropped_stale_total += 1
                self.worker.dropped_stale()         # admission's fault, not consumption
                continue
            elif self.planner.oversize(sample):
                self.state.dropped_oversize_total += 1
                logging.getLogger(__name__).warning(
                    "dropping a sample of %d tokens (%d trained): over token_budget=%d",
                    len(sample.input_ids), sample.completion_mask.sum(), self.planner.token_budget)
                continue
            else:
                samples.append(sample)
                queue_s.append(time.time() - sample.enqueued_at)
                micro = self.planner.add(sample)
            if micro:
                rows.append(micro)
        # the resume cursor once this step is trained (the open rows' samples are not): what a
        # checkpoint after it saves; taken every step, it keeps rank 0's per-prompt state to the
        # prompts in flight however long the run, and drains the rollout's progress queue
        saved = self.worker.resume_state([s.prompt_index for s in self.planner.held()])
        self.state.prompt_index, self.state.trained = saved["prompt_index"], saved["trained"]
        if not rows:
            return None
        packed = [[row.pack() for row in micro] for micro in rows]
        self.state.num_tokens += sum(p.unique_tokens for micro in packed for p in micro)
        totals = StepTotals.of([p for micro in packed for p in micro])
        return Step(version, rows, packed, totals=totals,
                    row_metrics=[self.planner.metrics(micro) for micro in packed],
                    samples=samples, queue_s=queue_s, waited_s=waited_s, queue_size=queue_size)


def plan_step(feed: Feed, version: int, max_staleness: int) -> Step | None:
    """Rank 0: the next step (Feed.next_step). A failure is sent to the other ranks before it is
    raised here: they must not wait for rows forever."""
    try:
        return feed.next_step(version, max_staleness)
    except BaseException as e:
        scatter_rows(None, 0, feed.planner.world_size, error=f"{type(e).__name__}: {e}")
        raise


def scatter_rows(step: Step | None, rank: int, world: int, error: str | None = None):
    """Rank 0 sends rank r its row of each micro-batch and the step's counts (`step`:
    Feed.next_step's). Returns this rank's ([GA] PackedRow, StepTotals), or (None, None) when the
    prompts are done (`step` None). Every rank leaves together: a failure on rank 0 (`error`)
    raises on the others."""
    if rank == 0:
        if step is None:
            payload = [{"error": error}] * world
        else:
            payload = [{"rows": [micro[r] for micro in step.packed], "totals": step.totals}
                       for r in range(world)]
    box = [payload[0] if rank == 0 else None]
    if world > 1:
        dist.scatter_object_list(box, payload if rank == 0 else None, src=0)
    mine = box[0]
    if "rows" not in mine:
        if mine["error"] is not None and rank != 0:
            raise RuntimeError(f"rank 0 stopped: {mine['error']}")
        return None, None
    return mine["rows"], mine["totals"]


# ── all ranks: forward, backward, optimizer ──────────────────────────────────────────────────


def train_step(policy: Policy, optimizer, scheduler, rows: list, totals: StepTotals, config,
               world: int, aux_coef: float, scaler=None, version: int | None = None,
               reference=None) -> dict:
    """One optimizer step over this rank's rows; returns the loss metrics reduced over micro-batches
    and ranks, and the timings. A row's loss divides by the whole step's counts (totals: its
    trained tokens for the default loss_type), so the step's loss is the sum over rows and ranks;
    FSDP2 averages gradients over ranks, hence the backward of loss × world. A step whose loss or
    gradient norm is not finite is not applied (nor is the schedule stepped, as transformers'
    Trainer): its loss and grad_norm are None. `reference` (beta > 0): reference_policy's, the
    log-probs of the KL term's reference.
    `scaler` (fp16): the loss is scaled, the gradients unscaled before clipping, and a step with
    inf/NaN gradients skipped; None: a disabled GradScaler, through which every call passes
    unchanged (torch's AMP recipe: one code path with or without scaling). `version`: the policy
    version the weights are at, whose samples measure the train/inference mismatch
    (sampling/mismatch_*)."""
    device = policy.head().weight.device
    scaler = scaler if scaler is not None else torch.amp.GradScaler(enabled=False)
    timer = metrics.Timer(device)
    parts = []                                          # loss.py's metrics, one dict per row
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    aux_sum = 0.0
    for row in rows:
        with timer("fwd_s"):
            ref = reference(policy, row) if reference is not None else None     # [M]
            out = policy(row, output_router_logits=True) if aux_coef else policy(row)
            head = policy.head()
            hidden = out.last_hidden_state[0]                                   # [N, H]
            loss, terms = compute_loss(hidden, head.weight, head.bias, to_device(row, device),
                                       config, totals, final_logit_softcapping=policy.softcap,
                                       version=version, ref_logprobs=ref)
            if aux_coef:                  # this rank's share of the step's mean router loss
                aux = moe_aux_loss(policy.model, out.router_logits)
                loss = loss + aux_coef * aux / (len(rows) * world)
                aux_sum += float(aux) / len(rows)
        with timer("bwd_s"):
            scaler.scale(loss * world).backward()
        loss_sum += loss.detach().to(torch.float64)
        parts.append(terms)
    reduced = reduce_metrics(parts) | {"loss": loss_sum}
    if aux_coef:
        reduced["aux_loss"] = torch.tensor(aux_sum / world, dtype=torch.float64, device=device)
    for name in sorted(reduced):                        # across ranks: SUM, or MIN / MAX by name
        if world > 1:
            dist.all_reduce(reduced[name], op=rank_reduce_op(name))
    out = finalize_metrics(reduced)
    with timer("optimizer_s"):
        limit = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
        trainable = [p for p in policy.parameters() if p.requires_grad]
        scaler.unscale_(optimizer)
        out["grad_norm"] = float(full_tensor(torch.nn.utils.clip_grad_norm_(trainable, limit)))
        # the loss and the norm are global: every rank takes the same decision (fp16: the scaler
        # skips an overflowing step itself)
        if math.isfinite(out["loss"]) and (scaler.is_enabled() or math.isfinite(out["grad_norm"])):
            scaler.step(optimizer)
            scheduler.step()
        else:
            out["loss"] = out["grad_norm"] = None        # skipped: logged null, counted by train()
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    out["learning_rate"] = scheduler.get_last_lr()[0]
    return out | timer.metrics()


SKIPS_TO_STOP = 3           # non-finite optimizer steps in a row that stop the run


def count_skipped(step_metrics: dict, state: checkpoint.TrainState, in_a_row: int) -> int:
    """Count a step train_step did not apply (loss None: its loss or gradient norm was not
    finite) on the state and in its metrics (skipped_steps_total). Returns the steps not applied
    in a row, ending with this one (0: it was applied)."""
    in_a_row = in_a_row + 1 if step_metrics["loss"] is None else 0
    state.skipped_steps_total += in_a_row > 0
    step_metrics["skipped_steps_total"] = state.skipped_steps_total
    return in_a_row


def check_skipped(in_a_row: int, step: int, rank: int) -> None:
    """After a step's metrics are logged: a step not applied (count_skipped) is warned about on
    rank 0, and SKIPS_TO_STOP in a row stop every rank (each counts the same global values)."""
    if in_a_row >= SKIPS_TO_STOP:
        raise RuntimeError(f"optimizer steps {step - in_a_row + 1} to {step}: the loss or "
                           "gradient norm was not finite, so none was applied (the weights are "
                           f"those of step {step - in_a_row}); look for non-finite advantages "
                           "(compute_advantages) or log-probs, or lower learning_rate")
    if in_a_row and rank == 0:
        logging.getLogger(__name__).warning(
            "step %d: the loss or gradient norm is not finite; the optimizer step is skipped (%d "
            "in a row, %d stop the run)", step, in_a_row, SKIPS_TO_STOP)


def rank_reduce_op(name: str) -> dist.ReduceOp:
    """How a loss metric combines across ranks: a min or max by name (loss.extreme) by MIN or
    MAX, the rest (sums, counts and [sum, count] pairs) by SUM."""
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    return ops.get(extreme(name), dist.ReduceOp.SUM)


def moe_aux_loss(model, router_logits) -> torch.Tensor:
    """The router load-balancing loss of a MoE model, from the model family's own function."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = base.config.get_text_config()
    experts = next(getattr(text, f) for f in MOE_EXPERT_FIELDS if getattr(text, f, None))
    family = sys.modules[type(base).__module__]
    return family.load_balancing_loss_func(router_logits, experts, text.num_experts_per_tok)


def to_device(row, device):
    """The loss terms of a PackedRow on the model's device (the layout tensors move in
    Policy.forward)."""
    moved = {k: v.to(device, non_blocking=True) for k, v in vars(row).items()
             if isinstance(v, torch.Tensor)}      # a tensor already there is itself
    return replace(row, **moved)


# ── the spec's trainer class and its callbacks ────────────────────────────────────────────────────


class AsyncGRPOTrainer:
    """The spec's trainer class over `train()`, with the spec's arguments in the spec's order:
    construct, then .train(). Subclass it and set `loop_cls` to customise the rollout loop (spec:
    ロールアウトループのカスタマイズ, Customising the rollout loop).

        trainer = AsyncGRPOTrainer(model="toy", reward_funcs=toy.sum_reward,
                                   train_dataset=toy.make_dataset())
        trainer.train()                  # under `if __name__ == "__main__":` in a script
        trainer.state.global_step, trainer.state.log_history[-1]["reward"]
        trainer.save_model("my_model")   # a from_pretrained directory

    callbacks: TrainerCallback objects, in Hooks' minimal form. optimizers: only
    (None, None); the optimizer is AdamW built after FSDP2 sharding (optim, learning_rate, adam_*).
    """
    loop_cls = AsyncRolloutLoop

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 tools=None, environment_factory=None, eval_dataset=None):
        if reward_funcs is None and environment_factory is None:
            raise ValueError("No reward source provided: pass reward_funcs, or an "
                             "environment_factory whose environment scores itself (get_reward)")
        if args is not None and not isinstance(args, AsyncGRPOConfig):
            raise TypeError(f"args is a {type(args).__name__}, not an AsyncGRPOConfig: the "
                            "spec's order is (model, reward_funcs, args, train_dataset, ...); "
                            "pass train_dataset= by name")
        if tuple(optimizers) != (None, None):
            raise ValueError("AsyncGRPOTrainer.optimizers: only (None, None). The model is "
                             "sharded with FSDP2 inside train(), so an optimizer built on its "
                             "parameters beforehand would update tensors the model no longer "
                             "uses; set optim, learning_rate, adam_beta1/2, adam_epsilon, "
                             "weight_decay and lr_scheduler_type/lr_scheduler_kwargs instead, or "
                             "fork train.py's build_optimizer")
        self.model = model               # after train(): the trained model, read back lazily
        self.reward_funcs = reward_funcs
        self.args = args if args is not None else AsyncGRPOConfig()
        check_prompt_source(train_dataset, environment_factory, self.args.max_steps)  # early
        check_eval_source(self.args, train_dataset, eval_dataset)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset        # TRL GRPOTrainer's: eval_strategy's prompts
        self.processing_class = processing_class
        self.peft_config = peft_config
        self.tools = tools
        self.environment_factory = environment_factory
        self.hooks = Hooks(callbacks or [], self.args)
        self.hooks.event("on_init_end")

    @property
    def state(self):
        """transformers' TrainerState: global_step, and log_history (rank 0) after train()."""
        return self.hooks.state

    def add_callback(self, callback) -> None:
        """Add a callback (an instance, or a class to instantiate)."""
        self.hooks.add(callback)

    def remove_callback(self, callback) -> None:
        """Remove a callback: an instance, or every instance of a class."""
        self.hooks.callbacks = [c for c in self.hooks.callbacks if not (
            c is callback or isinstance(callback, type) and isinstance(c, callback))]

    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict:
        """Train (train()); then .model is the trained model from the last checkpoint (the
        sharded training copy is gone with the process group)."""
        result = train(self.args, self.train_dataset, self.reward_funcs, model=self._model,
                        processing_class=self.processing_class, tools=self.tools,
                        environment_factory=self.environment_factory, loop_cls=self.loop_cls,
                        peft_config=self.peft_config, eval_dataset=self.eval_dataset,
                        resume_from_checkpoint=resume_from_checkpoint, hooks=self.hooks)
        found = checkpoint.checkpoints(self.args.output_dir)
        self._unread = max(found)[1] if found else None    # the last checkpoint-N, until .model
        return result

    @property
    def model(self):
        """The model argument; after train(), the trained model read from the last checkpoint
        (on first use, on the CPU)."""
        if self._unread is not None:
            self._model = checkpoint.load_model(self._unread)
            self._unread = None
        return self._model

    @model.setter
    def model(self, value) -> None:
        self._model = value
        self._unread = None             # a model set is the model, whatever was trained

    def save_model(self, output_dir: str | None = None) -> str:
        """Copy the trained model (the last checkpoint's model and tokenizer files: a
        from_pretrained directory; LoRA: the adapter) to output_dir (None: args.output_dir).
        Call it after train(); rank 0 copies. Returns output_dir."""
        found = checkpoint.checkpoints(self.args.output_dir)
        if not found:
            raise ValueError(f"save_model: {self.args.output_dir!r} holds no checkpoint-N "
                             "(train() writes one at its end unless save_strategy='no'): train "
                             "first, with save_strategy='steps'")
        output_dir = output_dir or self.args.output_dir
        if is_rank0():
            checkpoint.copy_model(max(found)[1], output_dir)
        return output_dir


CALLBACK_EVENTS = ("on_init_end", "on_train_begin", "on_step_begin", "on_step_end", "on_log",
                   "on_evaluate", "on_save", "on_train_end")    # what Hooks calls


class Hooks:
    """The spec's `callbacks` (a list of transformers TrainerCallback) in a minimal form: rank 0
    calls these events of each callback with transformers' own TrainerState and TrainerControl:

        on_init_end(args, state, control)             AsyncGRPOTrainer is constructed
        on_train_begin(args, state, control)          the rollout process is up
        on_step_begin(args, state, control)           a step's rows are ready, before its forward
        on_step_end(args, state, control)             after each optimizer step (and weight sync)
        on_log(args, state, control, logs=line)       each metrics.jsonl line
        on_evaluate(args, state, control, metrics=m)  an evaluation's eval/* line, when it is
                                                      done (it may come steps after it was asked)
        on_save(args, state, control)                 after each checkpoint-N/
        on_train_end(args, state, control)            after the last step

    control.should_training_stop (say, set in on_log when logs["reward"] > 0.9) stops every rank
    after that step. state.global_step (every rank; train() is its one writer) and
    state.log_history (rank 0) are kept whether or not callbacks are given. A callback that
    overrides another event (on_epoch_end, on_optimizer_step, ...) is warned about as it is added:
    nothing calls it."""

    def __init__(self, callbacks: list, config):
        from transformers import TrainerControl, TrainerState
        self.callbacks = []
        for callback in callbacks:
            self.add(callback)
        self.config = config
        self.state = TrainerState(max_steps=config.max_steps,
                                  num_train_epochs=config.num_train_epochs,
                                  logging_steps=config.logging_steps, save_steps=config.save_steps)
        self.control = TrainerControl()

    def add(self, callback) -> None:
        """Add a callback (an instance, or a class to instantiate); warn of the events it
        overrides that are never called."""
        from transformers import TrainerCallback
        callback = callback() if isinstance(callback, type) else callback
        base = vars(TrainerCallback)
        uncalled = [name for name in base if name.startswith("on_") and name not in CALLBACK_EVENTS
                    and getattr(type(callback), name, base[name]) is not base[name]]
        if uncalled:
            logging.getLogger(__name__).warning(
                "callback %s overrides %s, which AsyncGRPOTrainer never calls (it calls %s)",
                type(callback).__name__, ", ".join(uncalled), ", ".join(CALLBACK_EVENTS))
        self.callbacks.append(callback)

    def event(self, name: str, **kwargs) -> None:
        """Rank 0: call `name` on every callback that has it (on_log also records the line);
        nothing on the other ranks."""
        if not is_rank0():
            return
        if name == "on_log":
            self.state.log_history.append(dict(kwargs["logs"]))
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                method(self.config, self.state, self.control, **kwargs)



# ── the command line: every AsyncGRPOConfig field a flag ─────────────────────────────────────
# Beside the config's fields, the script's own (ScriptArguments: model, dataset, reward, LoRA, a
# local server). The toy defaults (toy.TRAIN_DEFAULTS) and the local server depend on the parsed
# model, never on argv's spelling (parse_cli).


def local_server_args(config, peft_config=None) -> list[str]:
    """local_vllm flags for a run of `config`: gloo weight transfer, processed log-probs, enough
    top log-probs, candidate sets when top-k/top-p are on, the trainer's compute dtype, LoRA
    slots for adapter sync."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = ["--weight-transfer-config", '{"backend":"gloo"}',
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
            "--return-sampling-mask", "--enable-scale-out",
            "--dtype", dtype_name(config.compute_dtype(device))]
    if peft_config is not None:
        rank = lora_sync.max_lora_rank(lora_sync.adapter_rank(peft_config))
        args += ["--enable-lora", "--max-lora-rank", str(rank),
                 "--max-loras", str(config.max_staleness + 2)]
    return args


@dataclass
class ScriptArguments:
    """The CLI's arguments beside AsyncGRPOConfig's fields."""
    model: str = "toy"                   # a hub id, a local directory, or "toy" (toy.py's model)
    dataset: str = "toy"                 # a `datasets` name, a .json/.jsonl/.csv/.parquet file with
                                         # a `prompt` column, or "toy"
    dataset_split: str = "train"         # the split of a `datasets` name
    eval_dataset: str | None = None      # as --dataset, eval_strategy's prompts; None: for toy,
                                         # its held-out sums when eval_strategy is set
    eval_dataset_split: str = "test"     # the split of an eval `datasets` name
    reward: str | None = None            # module:function[,...]; "toy" → toy:exact_reward
    serve_local: bool | None = None      # start local_vllm; None: for toy without a server URL
    lora_r: int = 0                      # > 0: train a LoRA adapter of this rank (peft)
    lora_alpha: int = 32                 # the adapter's scale is lora_alpha / lora_r
    lora_target_modules: str = "all-linear"   # comma-separated module names, or all-linear


def import_callable(spec: str):
    """module:function → the function, from the current directory too (searched after this
    repository's, so a file of the user's never shadows a module of the trainer; the spawned
    rollout process inherits the path)."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--reward {spec!r}: expected module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(1, os.getcwd())
    return getattr(importlib.import_module(module), name)


def load_prompts(name: str, split: str, held_out: bool = False):
    """The prompt dataset of --dataset (or --eval_dataset, `held_out`): the toy prompts (held
    out: the sums training never sees), a local file, or a `datasets` name and split."""
    if name == "toy":
        import toy
        return toy.make_dataset(toy.NUM_PROMPTS if not held_out else len(toy.HELD_OUT),
                                standard=True, balanced=True, held_out=held_out)
    import datasets
    kinds = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    kind = kinds.get(os.path.splitext(name)[1])
    if kind and os.path.isfile(name):
        return datasets.load_dataset(kind, data_files=name, split="train")
    return datasets.load_dataset(name, split=split)


def lora_config(script: ScriptArguments):
    """A peft LoraConfig when --lora_r > 0, else None."""
    if script.lora_r <= 0:
        return None
    from peft import LoraConfig
    targets = script.lora_target_modules
    return LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha,
                      target_modules=targets if targets == "all-linear" else targets.split(","))


def given_args(parser, argv: list[str]) -> dict:
    """The fields `argv` sets, in any form (--name value, --name=value, --name-with-dashes):
    argparse fills in a default only where the namespace lacks the name, so a namespace of
    sentinels keeps the rest."""
    unset = object()
    names = [f.name for kind in (ScriptArguments, AsyncGRPOConfig) for f in fields(kind)]
    namespace = argparse.Namespace(**dict.fromkeys(names, unset))
    parser.parse_known_args(argv, namespace=namespace)
    return {name: value for name, value in vars(namespace).items() if value is not unset}


def parse_cli(argv: list[str]) -> tuple[ScriptArguments, AsyncGRPOConfig]:
    """The CLI's arguments. The toy model (--model toy, the default) puts toy.TRAIN_DEFAULTS under
    the fields argv leaves unset, and resolves serve_local=None to "no --vllm_server_base_url
    given"; any other model gets AsyncGRPOConfig's defaults and no local server unless asked."""
    from transformers import HfArgumentParser
    parser = HfArgumentParser((ScriptArguments, AsyncGRPOConfig),
                              description="Asynchronous GRPO trainer")
    given = given_args(parser, argv)
    toy_run = given.get("model", ScriptArguments.model) == "toy"
    if toy_run:
        import toy
        parser.set_defaults(**toy.TRAIN_DEFAULTS)
    script, config = parser.parse_args_into_dataclasses(argv)
    if script.serve_local is None:
        script.serve_local = toy_run and "vllm_server_base_url" not in given
    return script, config


def main(argv: list[str] | None = None) -> None:
    """`python train.py [flags]` (module docstring). Operator messages (logging) show on the
    console from INFO up; set_log_level then applies log_level and log_level_replica (the other
    ranks: WARNING by default)."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # run the finally
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    script, config = parse_cli(argv)
    peft_config = lora_config(script)
    dataset = load_prompts(script.dataset, script.dataset_split)
    evals = script.eval_dataset or ("toy" if script.dataset == "toy" else None)
    eval_dataset = (load_prompts(evals, script.eval_dataset_split, held_out=True)
                    if evals and config.eval_strategy != "no" else None)
    reward = script.reward or ("toy" if script.dataset == "toy" else None)
    if reward is None:
        raise SystemExit("train.py: error: --reward module:function is required for a dataset "
                         "other than toy")
    rewards = [import_callable("toy:exact_reward" if r == "toy" else r) for r in reward.split(",")]
    server = None
    if script.serve_local and is_rank0():     # rank 0 talks to servers
        # train()'s checks first: a refused run leaves output_dir as it was, serve_local.log too
        with checkpoint.open_run(config.output_dir, config, dataset, say=False):
            import toy
            path = toy.ensure_saved() if script.model == "toy" else script.model
            log_path = os.path.join(config.output_dir, "serve_local.log")
            from local_vllm.launch import LocalServer
            server = LocalServer(path, *local_server_args(config, peft_config), log_path=log_path)
        config.vllm_server_base_url = server.url
        print(f"local_vllm on {server.url} (log: {log_path})", flush=True)
        if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
            # the server (one thread) and the rollout process share these cores: 2 of 2 threads
            # here made each step 1.4x slower (forward+backward 4.5x) than 1 on a 2-core machine
            torch.set_num_threads(max(1, torch.get_num_threads() - 2))
    try:
        result = train(config, dataset, rewards, model=script.model, peft_config=peft_config,
                       eval_dataset=eval_dataset)
    except Exception as e:
        if server is not None and (ended := server.exited()):   # the cause, said first
            raise RuntimeError(ended) from e
        raise
    finally:
        if server is not None:
            server.stop()
    if result:
        shown = {k: round(v, 4) for k, v in result.items()
                 if k in ("step", "reward", "loss", "perf/step_s") and v is not None}
        print(f"done: {shown}; metrics in {config.output_dir}/metrics.jsonl", flush=True)


if __name__ == "__main__":
    main()
