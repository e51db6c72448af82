"""The trainer (spec: 概要 (overview), GRPOTrainerとの違い (what differs from GRPOTrainer), バッチ番号の構成
(batch composition), AsyncGRPOTrainer): a torchrun/FSDP2 loop that trains on the rollout queue.

    python train.py                                        # the toy task, end to end, on a CPU
    torchrun --nproc_per_node 4 train.py --model Qwen/Qwen3-4B --dataset trl-lib/DeepMath-103K \\
        --reward my_rewards:accuracy --vllm_server_base_url http://gpu0:8000
    python train.py plot runs/toy                          # reward, loss, staleness, throughput → PNG

One optimizer step, top-down (each line names the file that does it):

    rank 0  samples ← RolloutWorker.get()          rollout_worker.py ← rollout.py (the spawned process)
            drop the stale ones (staleness > max_staleness), feed the Planner   trie_pack.py
            until gradient_accumulation_steps micro-batches of world_size rows are planned
            pack every row as a prefix trie (TreeRow.pack), scatter each rank its rows
    all     per row: hidden = Policy(row) (tree attention)        tree_attention.py
                     loss = compute_loss(hidden, LM head, row, n)  loss.py (n: the step's trained tokens)
                     backward (FSDP2 reduce-scatters the gradients)
            clip, optimizer.step(), scheduler.step()
            every weight_sync_steps: WeightSync.push → new policy version   weight_sync.py / lora_sync.py
    rank 0  RolloutWorker.set_model_version(v); metrics → metrics.jsonl     train_metrics.py
            every save_steps: checkpoint-N/ (+ rollout_state.json)          checkpoint.py

Spec sections elsewhere: AsyncGRPOConfig → config.py; 並行性 and staleness admission → rollout.py;
チェックポイントと再開 → checkpoint.py; 記録されたメトリクス → train_metrics.py (+ rollout.py, loss.py).

Departures from the spec, one line each:
- torchrun + plain torch.distributed FSDP2 (fully_shard per decoder layer, then the root), no accelerate.
- Rank 0 plans the whole optimizer step before the first backward: the loss divides by its token count.
- Stale samples are dropped here too (the promise), though admission in rollout.py rarely lets one by.
- Rollouts request the server's base model card by name (the model id a trainer loads need not match).
"""
import contextlib
import importlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import tree_attention
from config import AsyncGRPOConfig  # noqa: F401  (the spec imports it from the trainer's module)
from loss import MOE_EXPERT_FIELDS, compute_loss, reduce_metrics, router_aux_loss_coef
from rollout import AsyncRolloutLoop
from rollout_worker import RolloutWorker
from serve_local import LocalServer  # noqa: F401  (the demo's server; the tests use it too)
from trie_pack import Planner

# ── distributed setup ────────────────────────────────────────────────────────────────────────


def setup_distributed(config) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun: nccl on CUDA, gloo on CPU; alone: a group of one, so
    FSDP2 and torch.distributed.checkpoint run the same code."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # rank 0 may wait this long for samples while the other ranks wait in a collective
        timeout = timedelta(seconds=max(1800.0, config.vllm_server_timeout + config.rollout_worker_timeout))
        if "RANK" in os.environ:                     # torchrun: its environment says where to meet
            dist.init_process_group(backend, timeout=timeout)
        else:                                        # alone: nothing written to os.environ
            from weight_sync import free_port
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


# ── the model ────────────────────────────────────────────────────────────────────────────────


def load_model(model, config, processing_class=None, peft_config=None):
    """(model, tokenizer) from a hub id, a local path, "toy" or a model object. Vision-language configs
    load with AutoModelForImageTextToText and everything outside the text decoder and LM head (the
    vision tower, the projector) is frozen: no gradients, no optimizer state, not synced."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    if isinstance(model, str):
        path = model
        if model == "toy":
            import toy
            path = toy.ensure_saved()
        kwargs = {"dtype": config.dtype, "trust_remote_code": config.trust_remote_code}
        kwargs |= config.model_init_kwargs or {}                   # its dtype wins (spec)
        model_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        vision = getattr(model_config, "vision_config", None) is not None
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(path, **kwargs)
    tokenizer = processing_class or AutoTokenizer.from_pretrained(
        model.config._name_or_path, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    language = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in language)
    if peft_config is not None:
        from peft import get_peft_model
        model = get_peft_model(model, peft_config)
    tree_attention.install(model, config.tree_attention_backend)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every EOS id the model's generation config declares, and the tokenizer's: a turn ends on any."""
    declared = getattr(model.generation_config, "eos_token_id", None)
    ids = declared if isinstance(declared, list) else [declared]
    return sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None})


class Policy(torch.nn.Module):
    """The FSDP2 root: a packed row in, the text decoder's final hidden states out (the LM head is read
    by loss.py). Going through this root's forward makes FSDP2 gather the embedding and final norm (and
    the LM head, which the root keeps unsharded until backward)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, row, **kwargs):
        """The decoder's output for one packed row: .last_hidden_state [1, N, H] (and .router_logits
        with output_router_logits=True)."""
        return tree_attention.forward_row(self.model, row, self.model.get_decoder(), **kwargs)

    def head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()


def shard(policy: Policy, config, device: torch.device) -> Policy:
    """FSDP2: each decoder layer, then the root. bf16 compute with fp32 reductions when config.bf16;
    the master weights (and so the optimizer state) keep the dtype the weights loaded in."""
    bf16 = config.bf16 if config.bf16 is not None else device.type == "cuda"
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    for layer in tree_attention.decoder_layers(policy.model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    return policy.to(device)


def build_optimizer(policy: Policy, config):
    """AdamW over the trainable parameters, and the config's schedule (transformers' get_scheduler)."""
    from transformers import get_scheduler
    params = [p for p in policy.parameters() if p.requires_grad]
    device = params[0].device
    fused = config.optim == "adamw_torch_fused" and device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_epsilon, weight_decay=config.weight_decay, fused=fused or None)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=config.every("warmup_steps"),
                              num_training_steps=max(config.max_steps, 1),
                              scheduler_specific_kwargs=config.lr_scheduler_kwargs or {})
    return optimizer, scheduler


# ── rank 0: one optimizer step of samples ────────────────────────────────────────────────────


@dataclass
class Feed:
    """Rank 0's end of the rollout queue: the worker, the planner, and what one step took from them."""
    worker: RolloutWorker
    planner: Planner
    microbatches: int                        # gradient_accumulation_steps
    dropped_stale_total: int = 0
    samples: list = field(default_factory=list)      # this step's accepted samples (for sample/* metrics)
    stale_seen: list = field(default_factory=list)   # their staleness
    queue_s: list = field(default_factory=list)      # their time in the queue
    waited_s: float = 0.0                    # perf/rollout_wait_s
    queue_size: int = 0                      # sample/rollout_queue_size at the step's start
    finished: bool = False

    def next_step(self, version: int, max_staleness: int) -> list[list]:
        """Up to `microbatches` micro-batches (each world_size TreeRows); fewer only at the end of the prompts.
        A sample older than max_staleness versions is dropped, also one held in an open row since an
        earlier step (spec: SAMPLE ... dropped if staleness > max_staleness)."""
        self.samples, self.stale_seen, self.queue_s, self.waited_s = [], [], [], 0.0
        self.queue_size = self.worker.qsize()
        self.dropped_stale_total += self.planner.drop(lambda s: version - s.model_version > max_staleness)
        step = []
        while len(step) < self.microbatches and not self.finished:
            start = time.perf_counter()
            sample = self.worker.get()
            self.waited_s += time.perf_counter() - start
            if sample is None:
                self.finished = True
                rows = self.planner.flush()
            elif version - sample.model_version > max_staleness:
                self.dropped_stale_total += 1
                continue
            else:
                self.samples.append(sample)
                self.stale_seen.append(version - sample.model_version)
                self.queue_s.append(time.time() - sample.enqueued_at)
                rows = self.planner.add(sample)
            if rows:
                step.append(rows)
        return step

    def trained_position(self) -> int:
        """First prompt index not yet trained: samples the planner still holds count as untrained
        (spec: rollout_state.json stores the trained position, not the generator's)."""
        held = [s.prompt_index for s in self.planner.held()]
        return min([self.worker.resume_index(), *held])


def scatter_rows(step: list[list] | None, rank: int, world: int, error: str | None = None):
    """Rank 0 packs every row and sends rank r its row of each micro-batch. Returns this rank's
    (packed rows, the step's trained-token count, rank 0: all packed rows), or None when the prompts are
    done. Every rank leaves together: a failure on rank 0 (`error`) raises on the others."""
    if rank == 0:
        if error is not None or not step:
            payload = [{"error": error}] * world
        else:
            packed = [[row.pack() for row in micro] for micro in step]      # [GA][world] PackedRow
            n = sum(p.trained_tokens for micro in packed for p in micro)
            payload = [{"rows": [micro[r] for micro in packed], "num_tokens": n} for r in range(world)]
    box = [payload[0] if rank == 0 else None]
    if world > 1:
        dist.scatter_object_list(box, payload if rank == 0 else None, src=0)
    mine = box[0]
    if "rows" not in mine:
        if mine["error"] is not None and rank != 0:
            raise RuntimeError(f"rank 0 stopped: {mine['error']}")
        return None
    return mine["rows"], mine["num_tokens"], packed if rank == 0 else None


# ── all ranks: forward, backward, optimizer ──────────────────────────────────────────────────


def train_step(policy: Policy, optimizer, scheduler, rows: list, num_tokens: int, config, world: int,
               aux_coef: float) -> dict:
    """One optimizer step over this rank's rows; returns the loss metrics reduced over micro-batches
    and ranks, and the timings. The loss of a row is its share of the step's token mean, so the sum
    over ranks is wanted: FSDP2 averages gradients over ranks, hence × world."""
    device = policy.head().weight.device
    softcap = getattr(tree_attention.text_config(policy.model), "final_logit_softcapping", None)
    timer = Timer(device)
    parts, loss_sum, aux_sum = [], torch.zeros((), device=device, dtype=torch.float64), 0.0
    for row in rows:
        with timer("fwd_s"):
            out = policy(row, output_router_logits=True) if aux_coef else policy(row)
            head = policy.head()
            loss, metrics = compute_loss(out.last_hidden_state[0], head.weight, head.bias,   # [N, H]
                                         to_device(row, device), config, num_tokens,
                                         final_logit_softcapping=softcap)
            if aux_coef:                  # this rank's share of the step's mean router loss
                aux = moe_aux_loss(policy.model, out.router_logits)
                loss = loss + aux_coef * aux / (len(rows) * world)
                aux_sum += float(aux) / len(rows)
        with timer("bwd_s"):
            (loss * world).backward()
        loss_sum += loss.detach().to(torch.float64)
        parts.append(metrics)
    with timer("optimizer_s"):
        limit = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], limit)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    metrics = reduce_metrics(parts) | {"loss": loss_sum}
    if aux_coef:
        metrics["aux_loss"] = torch.tensor(aux_sum / world, dtype=torch.float64, device=device)
    for name in sorted(metrics):                          # across ranks: SUM, or MIN / MAX by name
        op = (dist.ReduceOp.MIN if name.endswith("/min") else dist.ReduceOp.MAX if name.endswith("/max")
              else dist.ReduceOp.SUM)
        if world > 1:
            dist.all_reduce(metrics[name], op=op)
    out = {name: (v[0] / v[1]).item() if v.dim() else v.item() for name, v in metrics.items()}
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    out |= {"grad_norm": float(grad_norm), "learning_rate": scheduler.get_last_lr()[0]}
    out |= {"perf/fwd_s": timer.total["fwd_s"], "perf/fwd_bwd_s": timer.total["fwd_s"] + timer.total["bwd_s"],
            "perf/optimizer_s": timer.total["optimizer_s"]}
    return out


def moe_aux_loss(model, router_logits) -> torch.Tensor:
    """The router load-balancing loss of a MoE model, from the model family's own function."""
    base = getattr(model, "get_base_model", lambda: model)()
    text = base.config.get_text_config()
    experts = next(getattr(text, f) for f in MOE_EXPERT_FIELDS if getattr(text, f, None))
    family = sys.modules[type(base).__module__]
    return family.load_balancing_loss_func(router_logits, experts, text.num_experts_per_tok)


def to_device(row, device):
    """The loss terms of a PackedRow on the model's device (the layout tensors move in Policy.forward)."""
    if device.type == "cpu":
        return row
    moved = {k: v.to(device, non_blocking=True) for k, v in vars(row).items() if isinstance(v, torch.Tensor)}
    return type(row)(**(vars(row) | moved))


class Timer:
    """Seconds per name, summed; synchronised with the device so asynchronous kernels are counted."""

    def __init__(self, device):
        self.device, self.total = device, {"fwd_s": 0.0, "bwd_s": 0.0, "optimizer_s": 0.0}

    @contextlib.contextmanager
    def __call__(self, name):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.total[name] += time.perf_counter() - start


# ── weight sync ──────────────────────────────────────────────────────────────────────────────


def language_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) of the text decoder and LM head, in model order: what a sync sends (a
    vision tower stays as the server loaded it). Tied weights appear once."""
    ids = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (an all-gather: every rank must call it, in the same order)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def push_full_weights(policy: Policy, sync, version: int) -> dict:
    params = language_parameters(policy.model)
    stats = sync.push([(n, p.shape) for n, p in params], lambda: (full(p.detach()) for _, p in params), version)
    return stats.metrics()


# ── the loop ─────────────────────────────────────────────────────────────────────────────────


def train(config, dataset, reward_funcs=None, *, model, processing_class=None, tools=None,
          environment_factory=None, loop_cls=AsyncRolloutLoop, peft_config=None,
          resume_from_checkpoint=None) -> dict:
    """Train `model` with asynchronous GRPO until the prompts run out (num_train_epochs) or max_steps;
    every rank calls it (torchrun). Returns the last logged metrics (rank 0; {} elsewhere)."""
    import checkpoint
    import train_metrics
    from vllm_client import VLLMClient, server_urls
    rank, world, device = setup_distributed(config)
    torch.manual_seed(config.seed)                   # the same on every rank: weights agree before sharding
    output_dir = config.output_dir or "trainer_output"
    model, tokenizer = load_model(model, config, processing_class, peft_config)
    aux_coef = router_aux_loss_coef(model.config, config.router_aux_loss_coef)
    policy = shard(Policy(model), config, device)
    optimizer, scheduler = build_optimizer(policy, config)
    state = checkpoint.TrainState()
    resume = checkpoint.find(output_dir, resume_from_checkpoint or config.resume_from_checkpoint)
    if resume:
        state = checkpoint.load(resume, policy, optimizer, scheduler)
    clients = [VLLMClient(url, timeout=config.vllm_server_timeout) for url in server_urls(config)]
    sync = make_sync(policy, clients, config, peft_config, output_dir)
    feed = log = None
    try:
        if rank == 0:
            for c in clients:
                c.wait_for_health()
        sync.connect()
        if state.model_version > 0:                   # a resumed run: the servers still hold older weights
            sync.push(state.model_version)
        if rank == 0:
            budget = config.token_budget if config.token_budget is not None else clients[0].max_model_len()
            planner = Planner(world, budget, config.per_device_train_batch_size)
            planner.dropped_oversize_total = state.dropped_oversize_total
            worker = RolloutWorker(config, dataset, reward_funcs, tokenizer, tools=tools,
                                   environment_factory=environment_factory, loop_cls=loop_cls,
                                   eos_token_ids=stop_token_ids(model, tokenizer), num_processes=world,
                                   dataset_start_index=state.prompt_index, model_version=state.model_version,
                                   **sync.worker_kwargs())
            feed = Feed(worker, planner, config.gradient_accumulation_steps,
                        dropped_stale_total=state.dropped_stale_total)
            log = train_metrics.MetricsLog(config, output_dir, state, policy.model, device, tokenizer)
            worker.start()
        while config.max_steps <= 0 or state.global_step < config.max_steps:
            started = time.perf_counter()
            step = None
            if rank == 0:
                try:
                    step = feed.next_step(state.model_version, config.max_staleness)
                except BaseException as e:            # the other ranks must not wait for rows forever
                    scatter_rows(None, rank, world, error=f"{type(e).__name__}: {e}")
                    raise
            mine = scatter_rows(step, rank, world)
            if mine is None:
                break
            rows, num_tokens, packed = mine
            metrics = train_step(policy, optimizer, scheduler, rows, num_tokens, config, world, aux_coef)
            state.global_step += 1
            if state.global_step % config.weight_sync_steps == 0:
                metrics |= sync.push(state.model_version + 1)
                state.model_version += 1
                if rank == 0:
                    feed.worker.set_model_version(state.model_version)
            if rank == 0:
                state.num_tokens += sum(p.unique_tokens for micro in packed for p in micro)
                state.dropped_stale_total = feed.dropped_stale_total
                state.dropped_oversize_total = feed.planner.dropped_oversize_total
                metrics["perf/step_s"] = time.perf_counter() - started
                log.step(state, metrics, feed, step, packed)
            if config.save_strategy == "steps" and state.global_step % config.every("save_steps") == 0:
                state.prompt_index = feed.trained_position() if rank == 0 else 0
                checkpoint.save(output_dir, state, policy, optimizer, scheduler, tokenizer, config)
        if log is not None and log.window:
            log.flush(state.global_step, feed.worker)
        if config.save_strategy == "steps" and state.global_step % config.every("save_steps") != 0:
            state.prompt_index = feed.trained_position() if rank == 0 else 0
            checkpoint.save(output_dir, state, policy, optimizer, scheduler, tokenizer, config)
        return log.last if log is not None else {}
    finally:
        if feed is not None:
            feed.worker.stop()
        if log is not None:
            log.close()
        for c in clients:
            c.close()
        dist.destroy_process_group()


def make_sync(policy: Policy, clients, config, peft_config, output_dir: str):
    """Full-weight sync, or (LoRA) adapter-only or merged sync, chosen once at start."""
    if peft_config is not None:
        import lora_sync
        return lora_sync.choose(policy, clients, config, peft_config, output_dir)
    return FullSync(policy, clients, config)


class FullSync:
    """Every sync sends the language model's full weights (weight_sync.py)."""

    def __init__(self, policy: Policy, clients, config):
        from weight_sync import WeightSync
        self.policy, self.weights = policy, WeightSync(clients, config.vllm_server_timeout)

    def connect(self) -> None:
        self.weights.connect()

    def push(self, version: int) -> dict:
        return push_full_weights(self.policy, self.weights, version)

    def worker_kwargs(self) -> dict:
        return {}


class AsyncGRPOTrainer:
    """The spec's trainer class over `train()`: construct, then .train(). Subclass it and set `loop_cls`
    to customise the rollout loop (spec: ロールアウトループのカスタマイズ).

        trainer = AsyncGRPOTrainer(model="toy", reward_funcs=toy.sum_reward, train_dataset=toy.make_dataset())
        trainer.train()
    """
    loop_cls = AsyncRolloutLoop

    def __init__(self, model, reward_funcs=None, train_dataset=None, args=None, processing_class=None,
                 peft_config=None, tools=None, environment_factory=None):
        if reward_funcs is None and environment_factory is None:
            raise ValueError("reward_funcs is required unless environment_factory supplies the reward (get_reward)")
        self.model, self.reward_funcs, self.train_dataset = model, reward_funcs, train_dataset
        self.args = args if args is not None else AsyncGRPOConfig()
        self.processing_class, self.peft_config = processing_class, peft_config
        self.tools, self.environment_factory = tools, environment_factory

    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict:
        return train(self.args, self.train_dataset, self.reward_funcs, model=self.model,
                     processing_class=self.processing_class, tools=self.tools,
                     environment_factory=self.environment_factory, loop_cls=self.loop_cls,
                     peft_config=self.peft_config, resume_from_checkpoint=resume_from_checkpoint)


# ── the CLI ──────────────────────────────────────────────────────────


def local_server_args(config, peft_config=None) -> list[str]:
    """serve_local.py flags for a run of `config`: gloo weight transfer, processed log-probs, enough
    top log-probs, candidate sets when top-k/top-p are on, LoRA slots for adapter sync."""
    args = ["--weight-transfer-config", '{"backend":"gloo"}', "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "-1", "--return-sampling-mask", "--enable-scale-out"]
    if peft_config is not None:
        rank = next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= peft_config.r)
        args += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(config.max_staleness + 2)]
    return args


@dataclass
class ScriptArguments:
    """The CLI's arguments beside AsyncGRPOConfig's fields."""
    model: str = "toy"                   # a hub id, a local directory, or "toy" (toy.py's offline model)
    dataset: str = "toy"                 # a `datasets` name, or a .json/.jsonl/.csv/.parquet file, with a
                                         # `prompt` column; or "toy"
    dataset_split: str = "train"
    reward: str | None = None            # module:function[,module:function...]; "toy" → toy:digit_reward
    serve_local: bool | None = None      # start serve_local.py; None: yes for --model toy without a server URL
    lora_r: int = 0                      # > 0: train a LoRA adapter of this rank (peft)
    lora_alpha: int = 32
    lora_target_modules: str = "all-linear"   # comma-separated module names, or all-linear


def import_callable(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--reward {spec!r}: expected module:function")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # run the finally blocks
    if argv[:1] == ["plot"]:
        import train_metrics
        print(train_metrics.plot(argv[1] if len(argv) > 1 else "runs/toy"))
        return
    from transformers import HfArgumentParser
    parser = HfArgumentParser((ScriptArguments, AsyncGRPOConfig), description="Asynchronous GRPO trainer")
    toy_run = "--model" not in argv or argv[argv.index("--model") + 1] == "toy"
    if toy_run:
        import toy
        parser.set_defaults(**toy.TRAIN_DEFAULTS)
    script, config = parser.parse_args_into_dataclasses(argv)
    peft_config = None
    if script.lora_r > 0:
        from peft import LoraConfig
        targets = script.lora_target_modules
        peft_config = LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha,
                                 target_modules=targets if targets == "all-linear" else targets.split(","))
    if script.dataset == "toy":
        import toy
        dataset = toy.make_dataset(toy.NUM_PROMPTS)
    else:
        import datasets
        kind = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(
            os.path.splitext(script.dataset)[1]) if os.path.isfile(script.dataset) else None
        dataset = (datasets.load_dataset(kind, data_files=script.dataset, split="train") if kind else
                   datasets.load_dataset(script.dataset, split=script.dataset_split))
    reward = script.reward or ("toy" if script.dataset == "toy" else None)
    if reward is None:
        raise SystemExit("train.py: error: --reward module:function is required for a dataset other than toy")
    rewards = [import_callable("toy:digit_reward" if r == "toy" else r) for r in reward.split(",")]
    server = None
    serve = script.serve_local if script.serve_local is not None else (toy_run and "--vllm_server_base_url" not in argv)
    if serve and int(os.environ.get("RANK", "0")) == 0:       # only rank 0 talks to the server
        import toy
        path = toy.ensure_saved() if script.model == "toy" else script.model
        os.makedirs(config.output_dir or "trainer_output", exist_ok=True)
        log_path = os.path.join(config.output_dir or "trainer_output", "serve_local.log")
        server = LocalServer(path, *local_server_args(config, peft_config), log_path=log_path)
        config.vllm_server_base_url = server.url
        print(f"serve_local.py on {server.url} (log: {log_path})", flush=True)
    try:
        metrics = train(config, dataset, rewards, model=script.model, peft_config=peft_config)
    finally:
        if server is not None:
            server.stop()
    if metrics:
        shown = {k: round(v, 4) for k, v in metrics.items() if k in ("step", "reward", "loss", "perf/step_s")}
        print(f"done: {shown}; metrics in {config.output_dir or 'trainer_output'}/metrics.jsonl", flush=True)


if __name__ == "__main__":
    main()
