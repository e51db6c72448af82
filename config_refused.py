"""The AsyncGRPOConfig fields (spec: AsyncGRPOConfig; most are TrainingArguments') that do not apply
to this trainer: each is accepted at its default and refused at construction, in one line saying
why and what to do instead, when set to anything else. Never accepted and ignored.

    AsyncGRPOConfig(push_to_hub=True)
    → ValueError: AsyncGRPOConfig.push_to_hub=True: no hub upload here: every checkpoint-N/ ...

config.py declares the fields (one a line, with the spec's meaning); this table says why not.
Departures from the spec: this table is the list of them.
"""
from dataclasses import MISSING, fields

_HUB = ("no hub upload here: every checkpoint-N/ is a from_pretrained directory, so upload it "
        "with the hub's own CLI (`hf upload <repo> <output_dir>/checkpoint-N`)")
_EVAL = ("there is no evaluation loop: evaluate a checkpoint-N/ directory (from_pretrained) with "
         "your own script, or serve it with vLLM")
_LOADER = ("there is no DataLoader: the rollout process reads the prompts one at a time; set "
           "max_concurrent_rollouts or queue_maxsize to change how far it reads ahead")
_DDP = ("the model is sharded with FSDP2 (fully_shard per decoder layer, then the root), not "
        "wrapped in DDP; fork train.py's shard() to change it")
_COMPILE = ("packed rows change shape every step, so torch.compile would recompile each step; "
            "fork train.py's Policy to try it")
_TRACKIO_HUB = ("trackio logs to its local store here (report_to='trackio'); a hub Space or "
                "bucket needs a hub connection: sync the local store with trackio's own CLI")

WHY = {
    "optim_args": "only torch.optim.AdamW is built (optim); set adam_beta1/adam_beta2/"
                  "adam_epsilon/weight_decay, or fork train.py's build_optimizer",
    "optim_target_modules": "only torch.optim.AdamW over every trainable parameter is built; "
                            "fork train.py's build_optimizer for GaLore-style optimizers",
    "average_tokens_across_devices": "the loss is always a token mean over the whole optimizer "
                                     "step, every micro-batch and rank (loss.py)",
    "label_smoothing_factor": "the GRPO loss has no labels to smooth",
    "bf16_full_eval": _EVAL,
    "fp16_full_eval": _EVAL,
    "torch_compile": _COMPILE,
    "torch_compile_backend": _COMPILE,
    "torch_compile_mode": _COMPILE,
    "use_liger_kernel": "loss.py computes the log-probs from the LM head in chunks itself, the "
                        "memory saving Liger's fused loss gives",
    "liger_kernel_config": "loss.py computes the log-probs from the LM head in chunks itself, the "
                           "memory saving Liger's fused loss gives",
    "use_cache": "training forwards packed rows and never reads a KV cache; generation runs on "
                 "the vLLM server",
    "neftune_noise_alpha": "noise on the embeddings would make the trainer's log-probs differ "
                           "from the sampler's, biasing every importance ratio",
    "auto_find_batch_size": "a row's memory is bounded by token_budget (unique tokens a row): "
                            "lower it instead",
    "logging_nan_inf_filter": "a NaN is left out of a logging window's mean already; "
                              "metrics.jsonl never holds one",
    "include_num_input_tokens_seen": "num_tokens (forwarded tokens since the start) is always "
                                     "logged",
    "trackio_space_id": _TRACKIO_HUB,
    "trackio_bucket_id": _TRACKIO_HUB,
    "trackio_static_space_id": _TRACKIO_HUB,
    "eval_strategy": _EVAL,
    "eval_steps": _EVAL,
    "eval_delay": _EVAL,
    "per_device_eval_batch_size": _EVAL,
    "prediction_loss_only": _EVAL,
    "eval_on_start": _EVAL,
    "eval_do_concat_batches": _EVAL,
    "eval_use_gather_object": _EVAL,
    "eval_accumulation_steps": _EVAL,
    "include_for_metrics": _EVAL,
    "batch_eval_metrics": _EVAL,
    "save_on_each_node": "rank 0 writes the model files and every rank its own shard of fsdp/; "
                         "put output_dir on a filesystem every node sees",
    "enable_jit_checkpoint": "checkpoints are written every save_steps and at the end; lower "
                             "save_steps to lose less on a preemption",
    "push_to_hub": _HUB,
    "hub_token": _HUB,
    "hub_private_repo": _HUB,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "load_best_model_at_end": _EVAL,
    "metric_for_best_model": _EVAL,
    "greater_is_better": _EVAL,
    "ignore_data_skip": "there is no skip-and-replay: a resume restarts the rollout process at "
                        "the first prompt not yet trained (rollout_state.json)",
    "restore_callback_states_from_checkpoint": "callbacks keep no state in a checkpoint here",
    "full_determinism": "the rollout process's timing decides which samples form a step, so no "
                        "run is reproducible bit for bit; seed and data_seed fix what can be",
    "use_cpu": "the trainer uses CUDA when it is visible: launch with CUDA_VISIBLE_DEVICES= to "
               "train on the CPU",
    "accelerator_config": "there is no accelerate: torchrun and FSDP2 (train.py)",
    "parallelism_config": "data parallelism over torchrun ranks is the only parallelism "
                          "(FSDP2 shards the model over them)",
    "dataloader_drop_last": _LOADER,
    "dataloader_num_workers": _LOADER,
    "dataloader_pin_memory": _LOADER,
    "dataloader_persistent_workers": _LOADER,
    "dataloader_prefetch_factor": _LOADER,
    "dataloader_multiprocessing_context": _LOADER,
    "dataloader_in_order": _LOADER,
    "remove_unused_columns": "every dataset column reaches the reward functions as a keyword "
                             "argument (the spec's reward_kwargs); none is removed",
    "label_names": "the GRPO loss has no labels",
    "length_column_name": "there is no length-grouped sampler: the planner packs rows by token "
                          "count (token_budget)",
    "ddp_find_unused_parameters": _DDP,
    "ddp_bucket_cap_mb": _DDP,
    "ddp_broadcast_buffers": _DDP,
    "ddp_static_graph": _DDP,
    "fsdp": "FSDP2 is always on (fully_shard per decoder layer, then the root); fork train.py's "
            "shard() for another wrapping",
    "fsdp_config": "FSDP2 is always on (fully_shard per decoder layer, then the root); fork "
                   "train.py's shard() for another wrapping",
    "deepspeed": "DeepSpeed ZeRO is not supported (the spec: FSDP2 only)",
    "debug": "no debug modes: run one rank on a CPU (CUDA_VISIBLE_DEVICES=) to debug the loop",
    "skip_memory_metrics": "no memory metrics are collected; torch.cuda.max_memory_allocated() "
                           "in a callback gives them",
    "do_eval": _EVAL,
    "do_predict": _EVAL,
    "local_rank": "torchrun sets LOCAL_RANK in the environment, which the trainer reads; launch "
                  "with torchrun rather than passing --local_rank",
}


def refuse_inapplicable(config) -> None:
    """ValueError for the first WHY field set to anything but its default."""
    for f in fields(config):
        if f.name not in WHY:
            continue
        default = f.default_factory() if f.default is MISSING else f.default
        value = getattr(config, f.name)
        if value != default:
            raise ValueError(f"AsyncGRPOConfig.{f.name}={value!r}: {WHY[f.name]}")
