"""AsyncGRPOConfig: the configuration class (設定クラス). The fields are declared in the order of
the spec's signature, so a positional argument means what it means there (AsyncGRPOConfig("out",
16) sets per_device_train_batch_size): TrainingArguments' fields, then the spec's groups, モデル
(model), 生成 (generation), vLLMサーバー (vLLM server), 学習 (training), 非同期ロールアウト
パイプライン (asynchronous rollout pipeline), ログ出力 (logging) を制御するパラメータ (the
parameters that control them), then ours. Names and defaults are the spec's; the CLI (train.py)
has one flag per field.

A worked example of the derived values (a fraction < 1 is of max_steps):

    config = AsyncGRPOConfig(max_steps=200, save_steps=0.25, warmup_steps=0.1)
    config.every("save_steps")                              → 50   (0.25 × 200)
    config.every("warmup_steps")                            → 20   (0.1 × 200)
    config.default_max_concurrent_rollouts(num_processes=4) → 128  (max(4, 1) × 8 × 1 × 4)
    config.shuffle_seed()                                   → 42   (seed: data_seed is None)
    config.process_group_timeout()                          → 2100 (1800 + 300 > ddp_timeout)
    AsyncGRPOConfig(top_p=0.95)   → ValueError: AsyncGRPOConfig.top_k: top_p < 1 and min_p also ...
    AsyncGRPOConfig(push_to_hub=True) → ValueError: AsyncGRPOConfig.push_to_hub=True: no hub ...

Departures from the spec, one line each:
- TrainingArguments fields that do not apply are refused when set, with why (REFUSED, at the end).
- `bf16=None` is True on CUDA only (spec: True): CPU bf16 matmuls are slow, the tests compare fp32.
- `tree_attention_backend` and `logging_dir` are ours: the spec has one attention kernel.
- `weight_sync_verify_every` is ours: the spec does not check that a sync landed (verify_sync.py).
- `reward_tool_timeout`, `untrained_warning_s` are ours: the spec bounds no reward or tool call,
  and says nothing of a run whose every group is dropped.
- `optim` offers the two AdamW variants only: train.py builds torch.optim.AdamW itself.
- `ddp_timeout` is at least vllm_server_timeout + rollout_worker_timeout (set lower: a warning).
"""
import json
import warnings
from dataclasses import MISSING, dataclass, field, fields

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr",
             "polynomial")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
DASHBOARDS = ("tensorboard", "wandb", "trackio")          # report_to's libraries; "all": each
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")   # loss.py's table
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class AsyncGRPOConfig:
    # ── run ──
    output_dir: str | None = None           # checkpoints and metrics.jsonl; None: trainer_output
    per_device_train_batch_size: int = 8    # samples per rank per micro-batch (token_budget <= 0)
    num_train_epochs: float = 3.0           # passes over the prompts; stops unless max_steps
    max_steps: int = -1                     # > 0: stop after this many optimizer steps instead
    # ── optimizer and schedule ──
    learning_rate: float = 1e-6             # AdamW's peak learning rate
    lr_scheduler_type: str = "constant"     # one of SCHEDULES; decaying ones need max_steps > 0
    lr_scheduler_kwargs: dict | str | None = None  # the schedule's extra arguments (JSON)
    warmup_steps: float = 0                 # >= 1: steps; < 1: a fraction of max_steps
    optim: str = "adamw_torch_fused"        # one of OPTIMIZERS (fused only where torch has it)
    optim_args: str | None = None           # the optimizer's extra arguments (refused)
    weight_decay: float = 0.0               # AdamW's decoupled weight decay, on the matrices
                                            # (as transformers: biases and norms exempt)
    adam_beta1: float = 0.9                 # AdamW's first-moment decay
    adam_beta2: float = 0.999               # AdamW's second-moment decay
    adam_epsilon: float = 1e-8              # AdamW's denominator floor
    optim_target_modules: None | str | list[str] = None  # modules of GaLore-style optim (refused)
    gradient_accumulation_steps: int = 1    # micro-batches per optimizer step
    average_tokens_across_devices: bool = True  # the loss's token mean spans every rank (always)
    max_grad_norm: float = 1.0              # clip the global gradient norm to this; <= 0: no clip
    label_smoothing_factor: float = 0.0     # label smoothing (refused: no labels)
    # ── precision and memory ──
    bf16: bool | None = None                # bf16 compute; None: on CUDA unless fp16 (spec: True)
    fp16: bool = False                      # fp16 compute with loss scaling
    bf16_full_eval: bool = False            # bf16 evaluation (refused: the servers generate)
    fp16_full_eval: bool = False            # fp16 evaluation (refused: the servers generate)
    tf32: bool | None = None                # TF32 matmuls on Ampere+ CUDA; None: torch's setting
    gradient_checkpointing: bool = True     # recompute each decoder layer in backward
    gradient_checkpointing_kwargs: dict | str | None = None  # its kwargs (JSON); default
                                            # {"use_reentrant": False}
    torch_compile: bool = False             # torch.compile the model (refused)
    torch_compile_backend: str | None = None  # its backend (refused)
    torch_compile_mode: str | None = None   # its mode (refused)
    use_liger_kernel: bool = False          # Liger kernels (refused: loss.py chunks the head)
    liger_kernel_config: dict | str | None = None  # their config (refused)
    use_cache: bool = False                 # the model's KV cache in training (refused)
    neftune_noise_alpha: float | None = None  # NEFTune embedding noise (refused)
    torch_empty_cache_steps: int | None = None  # torch.cuda.empty_cache() every N steps
    auto_find_batch_size: bool = False      # halve the batch on OOM (refused: token_budget)
    # ── logging ──
    logging_strategy: str = "steps"         # steps: every logging_steps; no: no metric lines
    logging_steps: float = 1                # >= 1: steps; < 1: a fraction of max_steps
    logging_first_step: bool = False        # also log after the first optimizer step
    log_on_each_node: bool = True           # log_level on each node's local rank 0, else rank 0
    logging_nan_inf_filter: bool = True     # leave NaN out of logged means (always)
    include_num_input_tokens_seen: str = "no"  # count input tokens (refused: num_tokens is);
                                            # False means "no", as in transformers
    log_level: str = "passive"              # the trainer's logging level on the main process:
                                            # debug|info|warning|error|critical|passive (as is)
    log_level_replica: str = "warning"      # the same on the other ranks
    disable_tqdm: bool | None = None        # None: the progress bar shows on a terminal
    report_to: None | str | list[str] = "none"  # tensorboard|wandb|trackio|all|none, or a list;
                                            # metrics.jsonl is written whatever it is
    run_name: str | None = None             # the dashboards' run name; None: output_dir's name
    project: str = "huggingface"            # the wandb/trackio project
    trackio_space_id: str | None = None     # trackio's hub Space; None: its local store
    trackio_bucket_id: str | None = None    # trackio's hub bucket for the Space's data
    trackio_static_space_id: str | None = None  # the static snapshot of that Space made at
                                            # the end; None: trackio's name; False: none
    # ── evaluation: eval_dataset's prompts generated and scored in the rollout process ──
    eval_strategy: str = "no"               # no | steps (every eval_steps) | epoch (each pass)
    eval_steps: float | None = None         # >= 1: steps; < 1: of max_steps; None: logging_steps
    eval_delay: float = 0                   # steps (or epochs) before the first evaluation
    per_device_eval_batch_size: int = 8     # eval rollouts in flight per rank (at least a group)
    prediction_loss_only: bool = False      # evaluation returns the loss only (refused)
    eval_on_start: bool = False             # also evaluate the starting weights
    eval_do_concat_batches: bool = True     # concatenate evaluation batches
    eval_use_gather_object: bool = False    # gather evaluation objects across ranks
    eval_accumulation_steps: int | None = None  # evaluation steps before moving to CPU
    include_for_metrics: list[str] = field(default_factory=list)  # extra inputs to metrics
    batch_eval_metrics: bool = False        # compute metrics per evaluation batch
    # ── checkpoints ──
    save_only_model: bool = False           # model files only: no fsdp/ state, cannot resume
    save_strategy: str = "steps"            # steps | no
    save_steps: float = 500                 # >= 1: steps; < 1: a fraction of max_steps
    save_on_each_node: bool = False         # every node writes (refused: a shared output_dir)
    save_total_limit: int | None = None     # keep the newest N checkpoints; None: all
    enable_jit_checkpoint: bool = False     # checkpoint on SIGTERM (refused: save_steps)
    push_to_hub: bool = False               # upload checkpoints (refused: `hf upload`)
    hub_token: str | None = None            # the hub token (refused)
    hub_private_repo: bool | None = None    # a private hub repo (refused)
    hub_model_id: str | None = None         # the hub repo (refused)
    hub_strategy: str = "every_save"        # when to upload (refused)
    hub_always_push: bool = False           # upload even while one is running (refused)
    hub_revision: str | None = None         # the hub branch (refused)
    # ── the best model (refused: checkpoints are not ranked) ──
    load_best_model_at_end: bool = False    # keep the best checkpoint by an evaluation metric
    metric_for_best_model: str | None = None  # that metric
    greater_is_better: bool | None = None   # its direction
    # ── resuming and seeds ──
    ignore_data_skip: bool = True           # True: no skip-and-replay, rollout_state.json resumes
    restore_callback_states_from_checkpoint: bool = False  # (refused: callbacks keep no state)
    full_determinism: bool = False          # deterministic algorithms (refused: async timing)
    seed: int = 42                          # torch seed on every rank (the same initial weights);
                                            # the prompt order's too when data_seed is None
    data_seed: int | None = None            # the prompt order's seed (train_sampling_strategy)
    # ── devices ──
    use_cpu: bool = False                   # force the CPU (refused: CUDA_VISIBLE_DEVICES=)
    accelerator_config: dict | str | None = None  # accelerate's config (refused: torchrun)
    parallelism_config: dict | str | None = None  # accelerate's parallelism (refused: DP only)
    # ── data (dataloader_* but pin_memory, label_names, length_column_name refused: no loader) ──
    dataloader_drop_last: bool = False      # drop the last incomplete batch
    dataloader_num_workers: int = 0         # loader worker processes
    dataloader_pin_memory: bool = True      # either way rows reach the device from unpinned
                                            # memory: there is no DataLoader to pin
    dataloader_persistent_workers: bool = False  # keep loader workers alive
    dataloader_prefetch_factor: int | None = None  # batches prefetched per worker
    dataloader_multiprocessing_context: str | None = None  # the workers' start method
    dataloader_in_order: bool = True        # batches in order
    remove_unused_columns: bool = True      # either way every column reaches the reward functions
                                            # (reward_kwargs): no model-input columns to prune
    label_names: list[str] | None = None    # the label keys of a batch
    train_sampling_strategy: str = "random"  # random: each epoch shuffled, seeded by data_seed
                                            # (None: seed); sequential: the dataset's order
    length_column_name: str = "length"      # the column of group_by_length
    # ── distributed ──
    ddp_find_unused_parameters: bool | None = None  # DDP's option (refused: FSDP2)
    ddp_bucket_cap_mb: int | None = None    # DDP's option (refused: FSDP2)
    ddp_broadcast_buffers: bool | None = None  # DDP's option (refused: FSDP2)
    ddp_static_graph: bool | None = None    # DDP's option (refused: FSDP2)
    ddp_backend: str | None = None          # nccl|gloo; None: nccl on CUDA, else gloo
    ddp_timeout: int = 1800                 # collective timeout (s), raised to at least
                                            # vllm_server_timeout + rollout_worker_timeout
                                            # (process_group_timeout; set below it, it warns)
    fsdp: str | None = None                 # FSDP1 options (refused: FSDP2 always)
    fsdp_config: dict | str | None = None   # FSDP1 config (refused: FSDP2 always)
    deepspeed: dict | str | None = None     # DeepSpeed config (refused: the spec, FSDP2 only)
    # ── debugging and the script's flags ──
    debug: str = ""                         # transformers' debug modes (refused); None and []
                                            # mean "", as in transformers
    skip_memory_metrics: bool = True        # memory metrics (refused: none collected)
    do_train: bool = False                  # a flag for your own script (transformers reads it
                                            # neither): train() trains whatever its value
    do_eval: bool = False                   # a flag for your own script, as do_train:
                                            # eval_strategy decides
    do_predict: bool = False                # run prediction (refused: no prediction loop)
    resume_from_checkpoint: str | None = None  # a checkpoint directory, or "true": the newest
    local_rank: int = -1                    # a launcher's --local_rank (refused: torchrun's env)
    # ── model ──
    model_init_kwargs: dict | str | None = None  # from_pretrained kwargs (JSON); its dtype wins
    dtype: str = "float32"                  # weights load in: auto|bfloat16|float16|float32;
                                            # the master weights are fp32 whatever it is
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
    vllm_server_timeout: float = 1800.0     # seconds for startup, each request (its retries
                                            # included), each weight sync
    # ── training ──
    epsilon: float = 0.2                    # lower clip of the surrogate's ratio: 1 - epsilon
    epsilon_high: float | None = None       # upper clip 1 + epsilon_high; None: epsilon
    score_centering: bool = True            # subtract the sampler's expected score (loss.py)
    vllm_importance_sampling_clip_min: float = 0.5  # ratio below: the token is masked from the loss
    vllm_importance_sampling_clip_max: float = 5.0  # ratio above: the token is masked from the loss
    num_sampler_logprobs: int = 8           # sampler top log-probs per token (score centering)
    token_budget: int | None = None         # unique tokens a row; None: max_model_len; <= 0: count
    # ── asynchronous rollout pipeline ──
    max_concurrent_rollouts: int | None = None  # in-flight rollouts; None: the spec's formula
    max_staleness: int = 4                  # versions a sample may lag before it is dropped
    queue_maxsize: int = 1024               # samples buffered between the processes
    weight_sync_steps: int = 1              # optimizer steps between weight syncs
    rollout_worker_timeout: float = 300.0   # seconds without a heartbeat before the trainer stops
    # ── logging completions ──
    log_completions: bool = False           # log (prompt, completion) pairs every logging step
    num_completions_to_print: int | None = None  # how many of them; None: all
    # ── TRL GRPOConfig's, not in the spec: the objective by name, evaluation's pass@k ──
    loss_type: str = "dapo"                 # dapo (the spec's) | grpo | bnpo | dr_grpo | cispo
                                            # (loss.py's table)
    importance_sampling_level: str = "token"  # token | sequence (GSPO: a sample's mean ratio)
    beta: float = 0.0                       # KL(π ‖ π_ref) weight; 0: no reference model
    scale_rewards: str = "group"            # advantages' divisor: group | batch (a step's worth
                                            # of recent rollouts) | none (Dr. GRPO)
    mask_truncated_completions: bool = False  # a completion cut at max_completion_length trains
                                            # nothing (its reward still counts in its group)
    num_generations_eval: int | None = None  # rollouts per eval prompt (pass@k: k of them);
                                            # None: num_generations
    # ── ours (not in the spec) ──
    tree_attention_backend: str | None = None  # ours: sdpa|flex|flash; None: CUDA flash, else sdpa
    logging_dir: str | None = None          # ours: tensorboard's dir; None: output_dir/runs/run
    weight_sync_verify_every: int = 16      # ours: each tensor verified within N syncs
                                            # (verify_sync.py's arithmetic); 0: none, nor probes
    overwrite_output_dir: bool = False      # ours (transformers' scripts'): replace another run
                                            # in output_dir (checkpoint.claim); False: refused
    reward_tool_timeout: float = 300.0      # ours: seconds a reward function, tool or environment
                                            # call may take; past it its rollout fails, named
    untrained_warning_s: float = 180.0      # ours: seconds of dropped groups and none kept before
                                            # a warning naming frac_reward_zero_std
    eval_pass_reward: float = 1.0           # ours: an eval rollout passes (eval/pass@k) when its
                                            # reward is at least this: an accuracy reward's 1

    def __post_init__(self):
        refuse_inapplicable(self)
        self.output_dir = self.output_dir or "trainer_output"      # as TrainingArguments
        for name in ("lr_scheduler_kwargs", "model_init_kwargs", "chat_template_kwargs",
                     "gradient_checkpointing_kwargs"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, json.loads(getattr(self, name)))
        # the rules that several fields share, each written once
        for name in ("temperature", "max_completion_length", "queue_maxsize",
                     "vllm_server_timeout", "rollout_worker_timeout", "reward_tool_timeout",
                     "untrained_warning_s", "ddp_timeout", "epsilon"):
            need(getattr(self, name) > 0, name, "must be > 0")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps",
                     "weight_sync_steps", "per_device_eval_batch_size"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("num_generations_eval", "max_concurrent_rollouts", "torch_empty_cache_steps",
                     "save_total_limit"):
            need(getattr(self, name) is None or getattr(self, name) >= 1, name,
                 "must be >= 1 (or None)")
        for name in ("learning_rate", "max_staleness", "weight_sync_verify_every", "beta",
                     "eval_delay", "warmup_steps", "top_k"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards,
                                                                self.scale_rewards)  # TRL's bools
        for name, allowed in (("optim", OPTIMIZERS), ("lr_scheduler_type", SCHEDULES),
                              ("log_level", LOG_LEVELS), ("log_level_replica", LOG_LEVELS),
                              ("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                              ("importance_sampling_level", ("token", "sequence")),
                              ("eval_strategy", ("no", "steps", "epoch")),
                              ("dtype", ("auto", "bfloat16", "float16", "float32")),
                              ("tree_attention_backend", (None, "sdpa", "flex", "flash")),
                              ("ddp_backend", (None, "nccl", "gloo")),
                              ("save_strategy", ("steps", "no"))):
            need(getattr(self, name) in allowed, name, f"must be one of {allowed}")
        # generation and the objective
        need(self.num_generations >= 2, "num_generations",
             "must be >= 2: advantages are standardised within a group")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(not self.truncated_sampling or self.top_k > 0, "top_k", "top_p < 1 and min_p also "
             "need top_k > 0: vLLM bounds the returned candidate set by top_k")
        need(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        if self.repetition_penalty != 1.0:
            warnings.warn("AsyncGRPOConfig.repetition_penalty != 1: the server's processed "
                          "log-probs include the penalty and the trainer's log-probs do not, so "
                          "every importance ratio is biased", stacklevel=3)
        need(self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high", "must be > 0")
        clip_min = self.vllm_importance_sampling_clip_min
        clip_max = self.vllm_importance_sampling_clip_max
        need(0 <= clip_min < 1 < clip_max, "vllm_importance_sampling_clip_min/max",
             "need clip_min < 1 < clip_max")
        need(self.num_sampler_logprobs >= 1 or not self.score_centering, "num_sampler_logprobs",
             "score centering needs >= 1 sampler log-probs per token")
        need(not self.score_centering or (self.loss_type != "cispo"
                                          and self.importance_sampling_level == "token"),
             "score_centering", "is derived for the token-level clipped surrogate (loss.py's "
             "centering_term): set score_centering=False with loss_type='cispo' or "
             "importance_sampling_level='sequence'")
        if self.loss_type == "cispo" and self.epsilon_high is None:
            warnings.warn("AsyncGRPOConfig(loss_type='cispo'): the importance weight is capped at "
                          f"epsilon_high, unset, so at epsilon={self.epsilon}; CISPO's ε_max is "
                          "usually 5.0 (set epsilon_high)", stacklevel=3)
        # the asynchronous pipeline
        need(self.num_train_epochs > 0 or self.max_steps > 0, "num_train_epochs",
             "must be > 0 (or set max_steps > 0)")
        # training
        need(self.lr_scheduler_type.startswith("constant") or self.max_steps > 0,
             "lr_scheduler_type",
             f"{self.lr_scheduler_type!r} decays over max_steps, which is not set: the number of "
             "optimizer steps is not known in advance (forks vary it), so set max_steps > 0 or "
             "use 'constant'")
        need(not 0 < self.warmup_steps < 1 or self.max_steps > 0, "warmup_steps",
             "a fraction (< 1) of max_steps needs max_steps > 0")
        need(not (self.fp16 and self.bf16), "fp16", "fp16 and bf16 are both set: pick one")
        if self.tf32:
            import torch
            need(torch.cuda.is_available(), "tf32", "needs a CUDA device, and none is visible: on "
                 "a CPU leave it unset")
        need(self.train_sampling_strategy in ("random", "sequential"), "train_sampling_strategy",
             "must be 'random' or 'sequential': rows are packed by tokens, not grouped by length")
        in_force = self.process_group_timeout()
        if self.ddp_timeout != type(self).ddp_timeout and self.ddp_timeout < in_force:
            warnings.warn(f"AsyncGRPOConfig.ddp_timeout={self.ddp_timeout} has no effect: the "
                          f"process group's timeout is {in_force:g}s, vllm_server_timeout + "
                          "rollout_worker_timeout, as rank 0 may wait that long for samples while "
                          "the other ranks wait in a collective; lower those two for a shorter "
                          "one", stacklevel=3)
        # logging and checkpoints
        unknown = [n for n in self.dashboards(installed=DASHBOARDS) if n not in DASHBOARDS]
        need(not unknown, "report_to", f"{unknown} unknown: use {', '.join(DASHBOARDS)}, 'all' "
             "or 'none' (metrics.jsonl is written whatever it is)")
        need(self.logging_strategy in ("steps", "no"), "logging_strategy",
             "must be 'steps' or 'no': an epoch's number of steps is not known in advance")
        for name in ("logging_steps", "save_steps", "eval_steps"):
            value = getattr(self, name)           # eval_steps None: logging_steps
            need(value is None or value >= 1 or (0 < value < 1 and self.max_steps > 0), name,
                 "must be >= 1 (steps), or a fraction in (0, 1) of max_steps when max_steps > 0")

    @property
    def truncated_sampling(self) -> bool:
        """Whether top_k, top_p or min_p cut the sampler's distribution to a candidate set, which
        log π_θ must then be normalised over (loss.py): without the server's candidate sets every
        importance ratio is biased low (rollout/servers.py says so at start, with the remedy)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p is not None

    def default_max_concurrent_rollouts(self, num_processes: int) -> int:
        """Spec: max(max_staleness, 1) × per_device_train_batch_size × gradient_accumulation_steps
        × num_processes, the most samples the trainer consumes before they go stale."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return (max(self.max_staleness, 1) * self.per_device_train_batch_size
                * self.gradient_accumulation_steps * num_processes)

    def shuffle_seed(self) -> int | None:
        """The seed of the prompt order (rollout/prompts.py): train_sampling_strategy "random"
        shuffles each epoch with data_seed, or with seed when data_seed is None (as transformers'
        Trainer does); "sequential" keeps the dataset's order (None)."""
        if self.train_sampling_strategy == "sequential":
            return None
        return self.seed if self.data_seed is None else self.data_seed

    def process_group_timeout(self) -> float:
        """The process group's timeout in seconds: ddp_timeout, raised to vllm_server_timeout +
        rollout_worker_timeout, since rank 0 may wait that long for samples while the other ranks
        wait in a collective (the defaults: max(1800, 1800 + 300) = 2100)."""
        return max(self.ddp_timeout, self.vllm_server_timeout + self.rollout_worker_timeout)

    def compute_dtype(self, device):
        """The dtype forward and backward run in on `device`: bf16 or fp16 under mixed precision,
        else fp32 (the master weights' dtype). bf16=None: bf16 on CUDA unless fp16."""
        import torch
        if self.fp16:
            return torch.float16
        bf16 = self.bf16 if self.bf16 is not None else device.type == "cuda"
        return torch.bfloat16 if bf16 else torch.float32

    def export_dtype(self, master):
        """The dtype a saved or synced model has, from one master parameter: the compute dtype
        under bf16 or fp16 mixed precision over fp32 master weights (the spec: a checkpoint is the
        served model's size, not twice it), else the master dtype."""
        import torch
        mixed = self.compute_dtype(master.device)
        return mixed if master.dtype == torch.float32 and mixed != torch.float32 else master.dtype

    def dashboards(self, installed=()) -> list[str]:
        """report_to as a list of names: "none"/None → []; "all" → `installed`; "a,b" → both."""
        names = self.report_to if isinstance(self.report_to, list) else [self.report_to]
        names = [n.strip() for name in names if name for n in name.split(",") if n.strip()]
        if "all" in names:
            return list(installed)
        return [n for n in names if n != "none"]

    def every(self, name: str) -> int:
        """logging_steps / save_steps / eval_steps / warmup_steps in optimizer steps (a fraction < 1
        is of max_steps); eval_steps None is logging_steps, as in transformers."""
        value = getattr(self, name)
        value = self.logging_steps if value is None else value
        return int(value) if value >= 1 or value == 0 else max(1, round(value * self.max_steps))


def dtype_name(dtype) -> str:
    """A torch dtype, or vLLM's spelling of one in server_info ("torch.bfloat16"), as the dtype
    field, vLLM's --dtype and its update_weights dtype_names spell it: "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def need(ok: bool, field: str, fix: str) -> None:
    """Refuse a bad value, naming the field and the fix."""
    if not ok:
        raise ValueError(f"AsyncGRPOConfig.{field}: {fix}")


# ── the refused fields ───────────────────────────────────────────────────────────────────────
# The fields (most are TrainingArguments') that do not apply to this trainer: each is accepted at
# its default and refused at construction, in one line saying why and what to do instead, when set
# to anything else. Never accepted and ignored. This table is the list of those departures.

REFUSED = {   # why (and what to do instead): the fields refused for it, in the spec's order
    "only torch.optim.AdamW is built (optim); set adam_beta1/adam_beta2/adam_epsilon/weight_decay, "
    "or fork train.py's build_optimizer": "optim_args",
    "only torch.optim.AdamW over every trainable parameter is built; fork train.py's "
    "build_optimizer for GaLore-style optimizers": "optim_target_modules",
    "every loss_type's means span the whole optimizer step, every micro-batch and rank "
    "(loss.py)": "average_tokens_across_devices",
    "the GRPO loss has no labels to smooth": "label_smoothing_factor",
    "an evaluation generates on the vLLM servers and scores with the reward functions (eval/*): "
    "it computes no loss, predictions or logits here; score checkpoint-N/ with your own script for "
    "those": "bf16_full_eval fp16_full_eval prediction_loss_only eval_do_concat_batches "
        "eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics "
        "do_predict",
    "checkpoints are not ranked by an evaluation metric: eval/* is in metrics.jsonl, beside the "
    "step of each checkpoint-N/": "load_best_model_at_end metric_for_best_model greater_is_better",
    "packed rows change shape every step, so torch.compile would recompile each step; fork "
    "train.py's Policy to try it": "torch_compile torch_compile_backend torch_compile_mode",
    "loss.py computes the log-probs from the LM head in chunks itself, the memory saving Liger's "
    "fused loss gives": "use_liger_kernel liger_kernel_config",
    "training forwards packed rows and never reads a KV cache; generation runs on the vLLM server":
        "use_cache",
    "noise on the embeddings would make the trainer's log-probs differ from the sampler's, biasing "
    "every importance ratio": "neftune_noise_alpha",
    "a row's memory is bounded by token_budget (unique tokens a row): lower it instead":
        "auto_find_batch_size",
    "a NaN is left out of a logging window's mean already; metrics.jsonl never holds one":
        "logging_nan_inf_filter",
    "num_tokens (forwarded tokens since the start) is always logged":
        "include_num_input_tokens_seen",
    "rank 0 writes the model files and every rank its own shard of fsdp/; put output_dir on a "
    "filesystem every node sees": "save_on_each_node",
    "checkpoints are written every save_steps and at the end; lower save_steps to lose less on a "
    "preemption": "enable_jit_checkpoint",
    "no hub upload here: every checkpoint-N/ is a from_pretrained directory, so upload it with the "
    "hub's own CLI (`hf upload <repo> <output_dir>/checkpoint-N`)":
        "push_to_hub hub_token hub_private_repo hub_model_id hub_strategy hub_always_push "
        "hub_revision",
    "there is no skip-and-replay: a resume restarts the rollout process at the first prompt not "
    "yet trained (rollout_state.json)": "ignore_data_skip",
    "callbacks keep no state in a checkpoint here": "restore_callback_states_from_checkpoint",
    "the rollout process's timing decides which samples form a step, so no run is reproducible bit "
    "for bit; seed and data_seed fix what can be": "full_determinism",
    "the trainer uses CUDA when it is visible: launch with CUDA_VISIBLE_DEVICES= to train on the "
    "CPU": "use_cpu",
    "there is no accelerate: torchrun and FSDP2 (train.py)": "accelerator_config",
    "data parallelism over torchrun ranks is the only parallelism (FSDP2 shards the model over "
    "them)": "parallelism_config",
    "there is no DataLoader: the rollout process reads the prompts one at a time; set "
    "max_concurrent_rollouts or queue_maxsize to change how far it reads ahead":
        "dataloader_drop_last dataloader_num_workers dataloader_persistent_workers "
        "dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order",
    "the GRPO loss has no labels": "label_names",
    "there is no length-grouped sampler: the planner packs rows by token count (token_budget)":
        "length_column_name",
    "the model is sharded with FSDP2 (fully_shard per decoder layer, then the root), not wrapped "
    "in DDP; fork train.py's shard() to change it":
        "ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph",
    "FSDP2 is always on (fully_shard per decoder layer, then the root); fork train.py's shard() "
    "for another wrapping": "fsdp fsdp_config",
    "DeepSpeed ZeRO is not supported (the spec: FSDP2 only)": "deepspeed",
    "no debug modes: run one rank on a CPU (CUDA_VISIBLE_DEVICES=) to debug the loop": "debug",
    "no memory metrics are collected; torch.cuda.max_memory_allocated() in a callback gives them":
        "skip_memory_metrics",
    "torchrun sets LOCAL_RANK in the environment, which the trainer reads; launch with torchrun "
    "rather than passing --local_rank": "local_rank",
}
WHY = {name: why for why, names in REFUSED.items() for name in names.split()}   # field → why


# Values that mean the default: transformers reads include_num_input_tokens_seen=False as "no"
# and debug None or [] as "".
SAME_AS_DEFAULT = {"include_num_input_tokens_seen": (False,), "debug": (None, [])}


def refuse_inapplicable(config) -> None:
    """ValueError for the first WHY field set to anything but its default (or SAME_AS_DEFAULT)."""
    for f in fields(config):
        default = f.default_factory() if f.default is MISSING else f.default
        value = getattr(config, f.name)
        if f.name in WHY and value != default and value not in SAME_AS_DEFAULT.get(f.name, ()):
            raise ValueError(f"AsyncGRPOConfig.{f.name}={value!r}: {WHY[f.name]}")
