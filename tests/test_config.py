"""config.py: AsyncGRPOConfig's spec defaults, the derived values of the module docstring's worked
example, and bad values refused with the field and the fix. Every field of the spec's signature
(141, in its order, then ours) is declared with its default; a changed value works or is refused
naming the field; nothing is accepted and ignored; refusals say why and the fix."""
import dataclasses
import glob
import os
import re
import warnings

import pytest
import torch

import config
import rollout_helpers as h
from config import AsyncGRPOConfig
from conftest import ROOT

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)


def test_spec_defaults():
    c = AsyncGRPOConfig()
    assert (c.num_generations, c.max_completion_length, c.temperature) == (8, 2048, 1.0)
    assert (c.top_p, c.top_k) == (1.0, 0)
    assert (c.epsilon, c.epsilon_high, c.score_centering) == (0.2, None, True)
    assert c.num_sampler_logprobs == 8
    assert (c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max) == (0.5, 5.0)
    assert (c.max_staleness, c.queue_maxsize, c.weight_sync_steps) == (4, 1024, 1)
    assert c.rollout_worker_timeout == 300.0
    assert (c.vllm_server_base_url, c.vllm_server_timeout) == ("http://localhost:8000", 1800.0)
    assert c.token_budget is None


def test_default_max_concurrent_rollouts_is_the_spec_formula():
    c = AsyncGRPOConfig(max_staleness=3, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2)
    assert c.default_max_concurrent_rollouts(num_processes=2) == 3 * 4 * 2 * 2
    assert AsyncGRPOConfig(max_staleness=0).default_max_concurrent_rollouts(1) == 8   # max(.., 1)
    assert AsyncGRPOConfig(max_concurrent_rollouts=5).default_max_concurrent_rollouts(8) == 5


def test_the_docstrings_worked_example():
    c = AsyncGRPOConfig(max_steps=200, save_steps=0.25, warmup_steps=0.1)
    assert (c.every("save_steps"), c.every("warmup_steps")) == (50, 20)
    assert c.default_max_concurrent_rollouts(num_processes=4) == 128
    assert AsyncGRPOConfig(save_steps=20).every("save_steps") == 20
    assert (c.shuffle_seed(), c.process_group_timeout()) == (42, 2100)


def test_random_sampling_is_seeded_by_data_seed_else_seed():
    """As transformers' Trainer: data_seed when set, else seed; "sequential" does not shuffle."""
    assert AsyncGRPOConfig(seed=7).shuffle_seed() == 7
    assert AsyncGRPOConfig(seed=7, data_seed=3).shuffle_seed() == 3
    assert AsyncGRPOConfig(seed=7, train_sampling_strategy="sequential").shuffle_seed() is None
    with pytest.raises(ValueError, match="AsyncGRPOConfig.train_sampling_strategy: must be"):
        AsyncGRPOConfig(train_sampling_strategy="group_by_length")


def test_a_ddp_timeout_under_the_rollout_wait_warns_naming_the_timeout_in_force():
    """Rank 0 may wait vllm_server_timeout + rollout_worker_timeout for samples while the other
    ranks wait in a collective, so the process group's timeout is never below that sum."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AsyncGRPOConfig().process_group_timeout() == 1800 + 300   # the default: unasked
        assert AsyncGRPOConfig(ddp_timeout=3600).process_group_timeout() == 3600
        short = AsyncGRPOConfig(ddp_timeout=100, vllm_server_timeout=60, rollout_worker_timeout=30)
        assert short.process_group_timeout() == 100
    with pytest.warns(UserWarning, match=r"ddp_timeout=600 has no effect: .* timeout is 2100s, "
                      r"vllm_server_timeout \+ rollout_worker_timeout, as rank 0 may wait"):
        assert AsyncGRPOConfig(ddp_timeout=600).process_group_timeout() == 2100


def test_remove_unused_columns_either_way_every_column_reaches_the_rewards():
    """A GRPO script's remove_unused_columns=False is what the code does, and so is the default
    True: the trainer has no model-input columns to prune."""
    for value in (True, False):
        assert AsyncGRPOConfig(remove_unused_columns=value).remove_unused_columns is value
    row = {"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}
    assert h.group_of([1.0, 0.0], row=row).reward_kwargs == {"answer": ["7", "7"]}


def test_values_transformers_reads_as_the_default_are_accepted():
    """include_num_input_tokens_seen=False is "no", and debug None or [] is "": none is
    refused."""
    for kwargs in ({"include_num_input_tokens_seen": False}, {"debug": []}, {"debug": None}):
        AsyncGRPOConfig(**kwargs)
    with pytest.raises(ValueError, match="AsyncGRPOConfig.include_num_input_tokens_seen=True"):
        AsyncGRPOConfig(include_num_input_tokens_seen=True)


def test_bf16_none_means_on_cuda_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert AsyncGRPOConfig().compute_dtype(cuda) == torch.bfloat16
    assert AsyncGRPOConfig().compute_dtype(cpu) == torch.float32
    assert AsyncGRPOConfig(bf16=True).compute_dtype(cpu) == torch.bfloat16
    assert AsyncGRPOConfig(bf16=False).compute_dtype(cuda) == torch.float32
    assert AsyncGRPOConfig(fp16=True).compute_dtype(cuda) == torch.float16


@pytest.mark.parametrize("field, kwargs", [
    ("top_k", {"top_p": 0.9}),                # top-p needs a top-k bound on the candidate set
    ("top_k", {"min_p": 0.1}),
    ("top_k", {"top_k": -1}),
    ("top_p", {"top_p": 0.0}),
    ("num_generations", {"num_generations": 1}),
    ("temperature", {"temperature": 0.0}),
    ("epsilon", {"epsilon": 0.0}),
    ("epsilon_high", {"epsilon_high": -0.1}),
    ("vllm_importance_sampling_clip_min/max", {"vllm_importance_sampling_clip_min": 1.5}),
    ("weight_sync_steps", {"weight_sync_steps": 0}),
    ("weight_sync_verify_every", {"weight_sync_verify_every": -1}),
    ("warmup_steps", {"warmup_steps": 0.5}),  # a fraction of max_steps, which is not set
    ("warmup_steps", {"warmup_steps": -1, "max_steps": 10}),
    ("max_completion_length", {"max_completion_length": 0}),
    ("num_train_epochs", {"num_train_epochs": 0}),
    ("queue_maxsize", {"queue_maxsize": 0}),  # an unbounded mp.Queue
    ("vllm_server_timeout", {"vllm_server_timeout": -1}),
    ("rollout_worker_timeout", {"rollout_worker_timeout": 0}),
    ("reward_tool_timeout", {"reward_tool_timeout": 0}),
    ("untrained_warning_s", {"untrained_warning_s": -5}),
])
def test_bad_values_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"AsyncGRPOConfig.{field}"):
        AsyncGRPOConfig(**kwargs)


def test_repetition_penalty_warns_that_ratios_are_biased():
    with pytest.warns(UserWarning, match="repetition_penalty"):
        AsyncGRPOConfig(repetition_penalty=1.1)


def test_a_subclass_adds_its_own_field():
    @dataclasses.dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

    assert CurriculumConfig(top_k=10, top_p=0.95).pass_rate_cap == 0.9


def test_the_refusal_table_lists_each_field_under_one_reason():
    """REFUSED is keyed by reason: a field listed under two reasons would keep the last silently,
    so each is listed once, and each is a declared field whose refusal gives its reason."""
    listed = [name for names in config.REFUSED.values() for name in names.split()]
    assert len(listed) == len(set(listed)) == len(config.WHY) == 59
    declared = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert set(listed) <= declared, set(listed) - declared
    for why, names in config.REFUSED.items():
        name = names.split()[-1]
        with pytest.raises(ValueError) as refused:
            AsyncGRPOConfig(**{name: "other"})
        assert str(refused.value) == f"AsyncGRPOConfig.{name}='other': {why}"


def test_one_predicate_says_whether_sampling_is_truncated_and_one_helper_names_a_dtype():
    assert not AsyncGRPOConfig().truncated_sampling
    for kwargs in ({"top_k": 5}, {"top_k": 5, "top_p": 0.9}, {"top_k": 5, "min_p": 0.1}):
        assert AsyncGRPOConfig(**kwargs).truncated_sampling, kwargs
    assert [config.dtype_name(d) for d in (torch.bfloat16, "torch.float16", "float32")] == [
        "bfloat16", "float16", "float32"]


# ── every field of the spec's signature has an answer ─────────────────────────────────────

# the spec's AsyncGRPOConfig signature (設定クラス, "AsyncGRPOConfig", S:471), in its order: 141
# fields and their defaults
SPEC_DEFAULTS = {
    "output_dir": None, "per_device_train_batch_size": 8, "num_train_epochs": 3.0,
    "max_steps": -1, "learning_rate": 1e-06, "lr_scheduler_type": "constant",
    "lr_scheduler_kwargs": None, "warmup_steps": 0, "optim": "adamw_torch_fused",
    "optim_args": None, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "adam_epsilon": 1e-08, "optim_target_modules": None, "gradient_accumulation_steps": 1,
    "average_tokens_across_devices": True, "max_grad_norm": 1.0, "label_smoothing_factor": 0.0,
    "bf16": None, "fp16": False, "bf16_full_eval": False, "fp16_full_eval": False, "tf32": None,
    "gradient_checkpointing": True, "gradient_checkpointing_kwargs": None, "torch_compile": False,
    "torch_compile_backend": None, "torch_compile_mode": None, "use_liger_kernel": False,
    "liger_kernel_config": None, "use_cache": False, "neftune_noise_alpha": None,
    "torch_empty_cache_steps": None, "auto_find_batch_size": False, "logging_strategy": "steps",
    "logging_steps": 1, "logging_first_step": False, "log_on_each_node": True,
    "logging_nan_inf_filter": True, "include_num_input_tokens_seen": "no", "log_level": "passive",
    "log_level_replica": "warning", "disable_tqdm": None, "report_to": "none", "run_name": None,
    "project": "huggingface", "trackio_space_id": None, "trackio_bucket_id": None,
    "trackio_static_space_id": None, "eval_strategy": "no", "eval_steps": None, "eval_delay": 0,
    "per_device_eval_batch_size": 8, "prediction_loss_only": False, "eval_on_start": False,
    "eval_do_concat_batches": True, "eval_use_gather_object": False,
    "eval_accumulation_steps": None, "include_for_metrics": [], "batch_eval_metrics": False,
    "save_only_model": False, "save_strategy": "steps", "save_steps": 500,
    "save_on_each_node": False, "save_total_limit": None, "enable_jit_checkpoint": False,
    "push_to_hub": False, "hub_token": None, "hub_private_repo": None, "hub_model_id": None,
    "hub_strategy": "every_save", "hub_always_push": False, "hub_revision": None,
    "load_best_model_at_end": False, "metric_for_best_model": None, "greater_is_better": None,
    "ignore_data_skip": True, "restore_callback_states_from_checkpoint": False,
    "full_determinism": False, "seed": 42, "data_seed": None, "use_cpu": False,
    "accelerator_config": None, "parallelism_config": None, "dataloader_drop_last": False,
    "dataloader_num_workers": 0, "dataloader_pin_memory": True,
    "dataloader_persistent_workers": False, "dataloader_prefetch_factor": None,
    "dataloader_multiprocessing_context": None, "dataloader_in_order": True,
    "remove_unused_columns": True, "label_names": None, "train_sampling_strategy": "random",
    "length_column_name": "length", "ddp_find_unused_parameters": None, "ddp_bucket_cap_mb": None,
    "ddp_broadcast_buffers": None, "ddp_static_graph": None, "ddp_backend": None,
    "ddp_timeout": 1800, "fsdp": None, "fsdp_config": None, "deepspeed": None, "debug": "",
    "skip_memory_metrics": True, "do_train": False, "do_eval": False, "do_predict": False,
    "resume_from_checkpoint": None, "local_rank": -1, "model_init_kwargs": None,
    "dtype": "float32", "trust_remote_code": False, "router_aux_loss_coef": None,
    "num_generations": 8, "max_completion_length": 2048, "temperature": 1.0, "top_p": 1.0,
    "top_k": 0, "min_p": None, "repetition_penalty": 1.0, "chat_template_kwargs": None,
    "max_tool_calling_iterations": None, "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 1800.0, "epsilon": 0.2, "epsilon_high": None, "score_centering": True,
    "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 5.0,
    "num_sampler_logprobs": 8, "token_budget": None, "max_concurrent_rollouts": None,
    "max_staleness": 4, "queue_maxsize": 1024, "weight_sync_steps": 1,
    "rollout_worker_timeout": 300.0, "log_completions": False, "num_completions_to_print": None,}


def changed(name: str, default):
    """A value other than the default, of the field's kind."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return "other"
    if isinstance(default, list):
        return ["other"]
    return 1


def test_the_spec_lists_141_fields_and_each_is_declared_with_its_default():
    declared = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    assert len(SPEC_DEFAULTS) == 141
    for name, default in SPEC_DEFAULTS.items():
        assert name in declared, name
        f = declared[name]
        ours = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert ours == default, (name, ours, default)
        AsyncGRPOConfig(**{name: default})                # accepted at its default


def test_positional_arguments_follow_the_spec_signature():
    """The fields are declared in the signature's order, then ours: AsyncGRPOConfig("out", 16) is
    per_device_train_batch_size=16, as in TRL, not seed=16."""
    names = [f.name for f in dataclasses.fields(AsyncGRPOConfig)]
    assert names[:len(SPEC_DEFAULTS)] == list(SPEC_DEFAULTS)
    assert names[len(SPEC_DEFAULTS):] == ["loss_type", "importance_sampling_level", "beta",
                                         "scale_rewards", "mask_truncated_completions",
                                         "num_generations_eval",     # TRL GRPOConfig's, then ours
                                         "tree_attention_backend", "logging_dir",
                                         "weight_sync_verify_every", "overwrite_output_dir",
                                         "reward_tool_timeout",
                                         "untrained_warning_s", "eval_pass_reward"]
    config = AsyncGRPOConfig("out", 16, 2.0, 5)
    assert (config.output_dir, config.per_device_train_batch_size) == ("out", 16)
    assert (config.num_train_epochs, config.max_steps, config.seed) == (2.0, 5, 42)


@pytest.mark.parametrize("name", list(SPEC_DEFAULTS))
def test_a_changed_field_works_or_is_refused_naming_it(name):
    value = changed(name, SPEC_DEFAULTS[name])
    if name in config.WHY:
        with pytest.raises(ValueError, match=rf"^AsyncGRPOConfig\.{name}="):
            AsyncGRPOConfig(**{name: value})
        return
    try:
        AsyncGRPOConfig(**{name: value})
    except ValueError as e:                               # a bad value: the message names it
        assert name in str(e), (name, str(e))


def test_every_accepted_field_is_read_by_the_code():
    """Nothing accepted and ignored: a field that is not refused is read outside its declaration."""
    source = ""
    core = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "rollout", "*.py"))
    for path in core:
        with open(path) as f:
            text = f.read().split("# ── the refused fields")[0]     # config.py's WHY table
        source += "".join(line for line in text.splitlines(True)
                          if not re.match(r"    \w+: .+ = ", line))
    unread = ("do_train", "do_eval",      # flags for scripts
              "remove_unused_columns",    # either value: every column reaches the rewards
              "dataloader_pin_memory")    # either value: nothing is pinned (no DataLoader)
    for name in SPEC_DEFAULTS:
        if name not in config.WHY and name not in unread:
            assert re.search(rf"[.\"']{name}\b", source), name


def test_refusals_say_why_and_the_fix():
    with pytest.raises(ValueError, match="hf upload"):
        AsyncGRPOConfig(push_to_hub=True)
    with pytest.raises(ValueError, match="not ranked by an evaluation metric"):
        AsyncGRPOConfig(load_best_model_at_end=True)
    with pytest.raises(ValueError, match="AsyncGRPOConfig.fp16: fp16 and bf16 are both set"):
        AsyncGRPOConfig(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="report_to"):
        AsyncGRPOConfig(report_to="mlflow")
    assert AsyncGRPOConfig(report_to="wandb,tensorboard").dashboards() == ["wandb", "tensorboard"]
    assert AsyncGRPOConfig(report_to=["none"]).dashboards() == []
    assert AsyncGRPOConfig(report_to="all").dashboards(["trackio"]) == ["trackio"]
