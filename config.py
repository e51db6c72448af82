"""AsyncGRPOConfig: the configuration class (設定クラス). Its groups are the spec's: モデル (model),
生成 (generation), vLLMサーバー (vLLM server), 学習 (training), 非同期ロールアウトパイプライン
(asynchronous rollout pipeline), ログ出力 (logging) を制御するパラメータ (the parameters that
control them). Names and defaults are the spec's; the CLI (train.py) has one flag per field.

A worked example of the derived values (a fraction < 1 is of max_steps):

    config = AsyncGRPOConfig(max_steps=200, save_steps=0.25, warmup_steps=0.1)
    config.every("save_steps")                              → 50   (0.25 × 200)
    config.every("warmup_steps")                            → 20   (0.1 × 200)
    config.default_max_concurrent_rollouts(num_processes=4) → 128  (max(4, 1) × 8 × 1 × 4)
    AsyncGRPOConfig(top_p=0.95)   → ValueError: AsyncGRPOConfig.top_k: top_p < 1 and min_p also ...

Departures from the spec, one line each:
- Only what we implement is declared: an option accepted and ignored would train differently.
- `bf16=None` is True on CUDA only (spec: True): CPU bf16 matmuls are slow, the tests compare fp32.
- `tree_attention_backend` is ours: the spec has one attention kernel.
- `report_to` accepts only "none": every run writes <output_dir>/metrics.jsonl (`train.py plot`).
- `optim` offers the two AdamW variants only: train.py builds torch.optim.AdamW itself.
"""
import json
import warnings
from dataclasses import dataclass

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr",
             "polynomial")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")


@dataclass
class AsyncGRPOConfig:
    # ── run ──
    output_dir: str | None = None           # checkpoints and metrics.jsonl; None: trainer_output
    seed: int = 42                          # torch seed on every rank (the same initial weights)
    per_device_train_batch_size: int = 8    # samples per rank per micro-batch (token_budget <= 0)
    gradient_accumulation_steps: int = 1    # micro-batches per optimizer step
    num_train_epochs: float = 3.0           # passes over the prompts; stops unless max_steps
    max_steps: int = -1                     # > 0: stop after this many optimizer steps instead
    # ── optimizer and schedule ──
    learning_rate: float = 1e-6             # AdamW's peak learning rate
    lr_scheduler_type: str = "constant"     # one of SCHEDULES; decaying ones need max_steps > 0
    lr_scheduler_kwargs: dict | str | None = None  # the schedule's extra arguments (JSON)
    warmup_steps: float = 0                 # >= 1: steps; < 1: a fraction of max_steps
    optim: str = "adamw_torch_fused"        # one of OPTIMIZERS (fused only where torch has it)
    weight_decay: float = 0.0               # AdamW's decoupled weight decay
    adam_beta1: float = 0.9                 # AdamW's first-moment decay
    adam_beta2: float = 0.999               # AdamW's second-moment decay
    adam_epsilon: float = 1e-8              # AdamW's denominator floor
    max_grad_norm: float = 1.0              # clip the global gradient norm to this; <= 0: no clip
    # ── precision and memory ──
    bf16: bool | None = None                # bf16 compute; None: on CUDA only (spec: always)
    dtype: str = "float32"                  # weights load in: auto|bfloat16|float16|float32
    gradient_checkpointing: bool = True     # recompute each decoder layer in backward
    tree_attention_backend: str | None = None  # ours: sdpa|flex|flash; None: CUDA flex, else sdpa
    # ── model ──
    model_init_kwargs: dict | str | None = None  # from_pretrained kwargs (JSON); its dtype wins
    trust_remote_code: bool = False         # let from_pretrained run a hub model's own code
    router_aux_loss_coef: float | None = None  # MoE load-balancing weight; None: the model's value
    # ── generation ──
    num_generations: int = 8                # rollouts per prompt: one group, one advantage baseline
    max_completion_length: int = 2048       # tokens a completion may have (all its turns together)
    temperature: float = 1.0                # sampling temperature
    top_p: float = 1.0                      # nucleus sampling; < 1 needs top_k > 0
    top_k: int = 0                          # 0: off; > 0: the candidate set loss.py renormalises
    min_p: float | None = None              # min probability relative to the top's; needs top_k
    repetition_penalty: float = 1.0         # != 1 warns: the trainer's log-probs do not include it
    chat_template_kwargs: dict | str | None = None  # apply_chat_template's extra arguments (JSON)
    max_tool_calling_iterations: int | None = None  # tool-calling turns per rollout; None: no limit
    # ── vLLM server ──
    vllm_server_base_url: str = "http://localhost:8000"  # several replicas: comma-separated URLs
    vllm_server_timeout: float = 1800.0     # seconds for startup, each request, each weight sync
    # ── objective ──
    epsilon: float = 0.2                    # lower clip of the surrogate's ratio: 1 - epsilon
    epsilon_high: float | None = None       # upper clip 1 + epsilon_high; None: epsilon
    score_centering: bool = True            # subtract the sampler's expected score (loss.py)
    vllm_importance_sampling_clip_min: float = 0.5  # ratio below: the token is masked from the loss
    vllm_importance_sampling_clip_max: float = 5.0  # ratio above: the token is masked from the loss
    num_sampler_logprobs: int = 8           # sampler top log-probs per token (score centering)
    # ── packing ──
    token_budget: int | None = None         # unique tokens a row; None: max_model_len; <= 0: count
    # ── asynchronous rollout pipeline ──
    max_concurrent_rollouts: int | None = None  # in-flight rollouts; None: the spec's formula
    max_staleness: int = 4                  # versions a sample may lag before it is dropped
    queue_maxsize: int = 1024               # samples buffered between the processes
    weight_sync_steps: int = 1              # optimizer steps between weight syncs
    rollout_worker_timeout: float = 300.0   # seconds without a heartbeat before the trainer stops
    # ── logging and checkpoints ──
    logging_steps: float = 1                # >= 1: steps; < 1: a fraction of max_steps
    log_completions: bool = False           # print (prompt, completion) pairs every logging step
    num_completions_to_print: int | None = None  # how many of them; None: all
    disable_tqdm: bool | None = None        # None: the progress bar shows on a terminal
    report_to: str = "none"                 # metrics always go to <output_dir>/metrics.jsonl
    save_strategy: str = "steps"            # steps | no
    save_steps: float = 500                 # >= 1: steps; < 1: a fraction of max_steps
    save_total_limit: int | None = None     # keep the newest N checkpoints; None: all
    resume_from_checkpoint: str | None = None  # a checkpoint directory, or "true": the newest

    def __post_init__(self):
        for name in ("lr_scheduler_kwargs", "model_init_kwargs", "chat_template_kwargs"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, json.loads(getattr(self, name)))
        # generation and the objective
        need(self.num_generations >= 2, "num_generations",
             "must be >= 2: advantages are standardised within a group")
        need(self.temperature > 0, "temperature", "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.top_k >= 0, "top_k", "must be >= 0 (0 disables top-k)")
        truncated = self.top_p < 1 or self.min_p is not None
        need(not truncated or self.top_k > 0, "top_k", "top_p < 1 and min_p also need top_k > 0: "
             "vLLM bounds the returned candidate set by top_k")
        need(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        if self.repetition_penalty != 1.0:
            warnings.warn("AsyncGRPOConfig.repetition_penalty != 1: the server's processed "
                          "log-probs include the penalty and the trainer's log-probs do not, so "
                          "every importance ratio is biased", stacklevel=2)
        need(self.epsilon > 0 and (self.epsilon_high is None or self.epsilon_high > 0), "epsilon",
             "must be > 0")
        clip_min = self.vllm_importance_sampling_clip_min
        clip_max = self.vllm_importance_sampling_clip_max
        need(0 <= clip_min < 1 < clip_max, "vllm_importance_sampling_clip_min/max",
             "need clip_min < 1 < clip_max")
        need(self.num_sampler_logprobs >= 1 or not self.score_centering, "num_sampler_logprobs",
             "score centering needs >= 1 sampler log-probs per token")
        # the asynchronous pipeline
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        need(self.weight_sync_steps >= 1, "weight_sync_steps", "must be >= 1")
        need(self.max_concurrent_rollouts is None or self.max_concurrent_rollouts >= 1,
             "max_concurrent_rollouts", "must be >= 1 (or None for the default)")
        # training
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size",
             "must be >= 1")
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1")
        need(self.learning_rate >= 0, "learning_rate", "must be >= 0")
        need(self.lr_scheduler_type in SCHEDULES, "lr_scheduler_type",
             f"must be one of {SCHEDULES}")
        need(self.lr_scheduler_type.startswith("constant") or self.max_steps > 0,
             "lr_scheduler_type",
             f"{self.lr_scheduler_type!r} decays over max_steps, which is not set: the number of "
             "optimizer steps is not known in advance (forks vary it), so set max_steps > 0 or "
             "use 'constant'")
        fraction = 0 < self.warmup_steps < 1
        need(self.warmup_steps >= 0 and (not fraction or self.max_steps > 0), "warmup_steps",
             "a fraction (< 1) of max_steps needs max_steps > 0")
        need(self.optim in OPTIMIZERS, "optim", f"must be one of {OPTIMIZERS}")
        need(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype",
             "must be auto, bfloat16, float16 or float32")
        need(self.tree_attention_backend in (None, "sdpa", "flex", "flash"),
             "tree_attention_backend",
             "must be sdpa, flex or flash (or None for the device's default)")
        # logging and checkpoints
        need(self.report_to in ("none", None), "report_to",
             "only 'none' is implemented: every run writes <output_dir>/metrics.jsonl (plot it "
             "with `python train.py plot <output_dir>`)")
        need(self.save_strategy in ("steps", "no"), "save_strategy", "must be 'steps' or 'no'")
        for name in ("logging_steps", "save_steps"):
            value = getattr(self, name)
            need(value >= 1 or (0 < value < 1 and self.max_steps > 0), name,
                 "must be >= 1 (steps), or a fraction in (0, 1) of max_steps when max_steps > 0")
        need(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit",
             "must be >= 1")

    def default_max_concurrent_rollouts(self, num_processes: int) -> int:
        """Spec: max(max_staleness, 1) × per_device_train_batch_size × gradient_accumulation_steps
        × num_processes, the most samples the trainer consumes before they go stale."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return (max(self.max_staleness, 1) * self.per_device_train_batch_size
                * self.gradient_accumulation_steps * num_processes)

    def bf16_on(self, device) -> bool:
        """Whether forward and backward run in bf16 on `device` (bf16=None: on CUDA only)."""
        return self.bf16 if self.bf16 is not None else device.type == "cuda"

    def export_dtype(self, master):
        """The dtype a saved or synced model has, from one master parameter: bf16 under bf16 mixed
        precision over fp32 master weights (the spec: a checkpoint is the served model's size, not
        twice it), else the master dtype."""
        import torch
        bf16 = self.bf16_on(master.device) and master.dtype == torch.float32
        return torch.bfloat16 if bf16 else master.dtype

    def every(self, name: str) -> int:
        """logging_steps / save_steps / warmup_steps in optimizer steps (a fraction < 1 is of
        max_steps)."""
        value = getattr(self, name)
        return int(value) if value >= 1 or value == 0 else max(1, round(value * self.max_steps))


def need(ok: bool, field: str, fix: str) -> None:
    """Refuse a bad value, naming the field and the fix."""
    if not ok:
        raise ValueError(f"AsyncGRPOConfig.{field}: {fix}")
