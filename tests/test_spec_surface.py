"""The surface a TRL AsyncGRPO user touches first (issue 22): every spec config field has an
answer, report_to's dashboards, the trainer's signature, callbacks and state, save_model, the
spec's records and loop arguments, and the server checks (the __main__ guard:
test_rollout_worker.py)."""
import dataclasses
import glob
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys

import pytest
from peft import LoraConfig

import config
import lora_sync
import toy
import train
import verify_sync
from config import AsyncGRPOConfig
from vllm_client import VLLMError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest_plugins = ["train_fixtures"]

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
    assert names[len(SPEC_DEFAULTS):] == ["tree_attention_backend", "logging_dir",
                                         "weight_sync_verify_every", "overwrite_output_dir",
                                         "reward_tool_timeout",
                                         "untrained_warning_s"]
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
    unread = ("do_train",                 # a flag for scripts
              "remove_unused_columns",    # either value: every column reaches the rewards
              "dataloader_pin_memory")    # either value: nothing is pinned (no DataLoader)
    for name in SPEC_DEFAULTS:
        if name not in config.WHY and name not in unread:
            assert re.search(rf"[.\"']{name}\b", source), name


def test_refusals_say_why_and_the_fix():
    with pytest.raises(ValueError, match="hf upload"):
        AsyncGRPOConfig(push_to_hub=True)
    with pytest.raises(ValueError, match="no evaluation loop"):
        AsyncGRPOConfig(eval_strategy="steps")
    with pytest.raises(ValueError, match="AsyncGRPOConfig.fp16: fp16 and bf16 are both set"):
        AsyncGRPOConfig(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="report_to"):
        AsyncGRPOConfig(report_to="mlflow")
    assert AsyncGRPOConfig(report_to="wandb,tensorboard").dashboards() == ["wandb", "tensorboard"]
    assert AsyncGRPOConfig(report_to=["none"]).dashboards() == []
    assert AsyncGRPOConfig(report_to="all").dashboards(["trackio"]) == ["trackio"]


# ── dashboards, offline ──────────────────────────────────────────────────────────────────────

DASHBOARD_SCRIPT = """
import sys
import metrics
from config import AsyncGRPOConfig
config = AsyncGRPOConfig(report_to=[sys.argv[2]], run_name="surface-run", project="surface")
boards = metrics.open_dashboards(config, sys.argv[1])
for step in (1, 2):
    metrics.log_line(boards, {"step": step, "time": 0.0, "reward": 0.25 * step,
                                       "rollout/backpressure_s": 1.5})
metrics.log_table(boards, 2, [("1+1=", "2", 1.0)])
metrics.close_dashboards(boards)
"""


def log_offline(tmp_path, name: str) -> None:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true",
               TRACKIO_DIR=str(tmp_path / "trackio"), PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", DASHBOARD_SCRIPT, str(tmp_path), name], check=True,
                   env=env, cwd=ROOT, timeout=240)


def test_tensorboard_gets_the_metrics_names_steps_and_completions(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log_offline(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "runs" / "surface-run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5)]
    assert "rollout/backpressure_s" in events.Tags()["scalars"]
    texts = events.Tags()["tensors"]
    assert any("completions" in t for t in texts) and any("config" in t for t in texts)


def test_wandb_offline_run_holds_the_metrics_config_and_table(tmp_path):
    """The offline run's record log (run-*.wandb, protobuf records) holds the metric names, the run
    name and the config; the completions table is written as its media file."""
    pytest.importorskip("wandb", reason="wandb is not installed")
    log_offline(tmp_path, "wandb")
    run_dir, = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    record, = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(record, "rb").read()
    for text in (b"reward", b"rollout/backpressure_s", b"surface-run", b"max_staleness"):
        assert text in data, text
    table, = glob.glob(os.path.join(run_dir, "files", "media", "table", "completions_2_*.json"))
    with open(table) as f:
        assert json.load(f)["data"] == [[2, "1+1=", "2", 1.0]]


def test_trackio_local_store_holds_the_metrics(tmp_path):
    pytest.importorskip("trackio", reason="trackio is not installed")
    log_offline(tmp_path, "trackio")
    script = ("from trackio.sqlite_storage import SQLiteStorage; import json; "
              "print(json.dumps(SQLiteStorage.get_logs('surface', 'surface-run'), default=str))")
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"))
    out = subprocess.run([sys.executable, "-c", script], check=True, env=env,
                         capture_output=True, text=True, timeout=120).stdout
    logs = json.loads(out.strip().splitlines()[-1])
    assert [row["reward"] for row in logs if "reward" in row] == [0.25, 0.5]
    assert any("completions" in row for row in logs)


# ── the trainer's surface ────────────────────────────────────────────────────────────────────


def test_the_spec_positional_order_and_refusals():
    config = AsyncGRPOConfig(max_steps=1)
    dataset = toy.make_dataset(4)
    trainer = train.AsyncGRPOTrainer("toy", toy.sum_reward, config, dataset)
    assert trainer.args is config and trainer.train_dataset is dataset
    with pytest.raises(TypeError, match="spec's order"):
        train.AsyncGRPOTrainer("toy", toy.sum_reward, dataset, config)
    with pytest.raises(ValueError, match="optimizers: only"):
        train.AsyncGRPOTrainer("toy", toy.sum_reward, config, dataset, optimizers=(object(), None))
    from train import Rollout, RolloutGroup, TurnRecord                # the spec's records
    from rollout import Rollout as R, RolloutGroup as G, TurnRecord as T
    assert (Rollout, RolloutGroup, TurnRecord) == (R, G, T)


class StopAfterTwo:
    """A TrainerCallback in its minimal form: the events it sees, and a stop."""

    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("begin", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", logs["step"]))
        if logs["step"] >= 2:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("end", state.global_step))


def test_callbacks_state_dashboard_and_save_model(start_server, toy_dir, tmp_path):
    """One short run: logging_first_step with logging_steps 2, a callback that stops after step
    2, tensorboard with completions, save_only_model, then trainer.state, save_model, model. Its
    own server: the session's train_server must keep the shared run's weights."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from train_helpers import SERVER_ARGS, SMALL
    server = start_server(*SERVER_ARGS)
    out = str(tmp_path / "run")
    config = AsyncGRPOConfig(output_dir=out, vllm_server_base_url=server.url, max_steps=10,
                             logging_steps=2, logging_first_step=True, report_to="tensorboard",
                             run_name="cb", log_completions=True, num_completions_to_print=2,
                             save_only_model=True, save_steps=100, data_seed=3,
                             gradient_checkpointing_kwargs={"use_reentrant": False},
                             **SMALL)
    callback = StopAfterTwo()
    trainer = train.AsyncGRPOTrainer(toy_dir, toy.sum_reward, config, toy.make_dataset(64),
                                     callbacks=[callback])
    trainer.train()
    assert callback.events == [("begin", 0), ("log", 1), ("log", 2), ("save", 2), ("end", 2)]
    assert trainer.state.global_step == 2
    assert [line["step"] for line in trainer.state.log_history] == [1, 2]
    events = EventAccumulator(os.path.join(out, "runs", "cb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    # reward comes from groups scored in the window: one the rollout process scored ahead may
    # leave the second line without it; the dashboard has it exactly where the log has it
    rewarded = [line["step"] for line in trainer.state.log_history if "reward" in line]
    assert rewarded and [e.step for e in events.Scalars("reward")] == rewarded
    assert any("completions" in t for t in events.Tags()["tensors"])
    assert not os.path.exists(os.path.join(out, "checkpoint-2", "fsdp"))    # save_only_model
    with pytest.raises(ValueError, match="save_only_model=True"):
        AsyncGRPOConfig(output_dir=out, resume_from_checkpoint="true", **SMALL)
        train.checkpoint.load(os.path.join(out, "checkpoint-2"), None, None, None)
    saved = trainer.save_model(str(tmp_path / "final"))
    assert os.path.isfile(os.path.join(saved, "config.json"))
    assert not os.path.exists(os.path.join(saved, "trainer_state.json"))
    assert trainer.model.config.vocab_size == len(toy.build_tokenizer())


def test_the_loop_takes_the_spec_arguments():
    from rollout import AsyncRolloutLoop
    ctx = mp.get_context("spawn")
    config = AsyncGRPOConfig(max_steps=1)
    loop = AsyncRolloutLoop(config=config, model_name=None, dataset=toy.make_dataset(4),
                            reward_funcs=[toy.sum_reward], processing_class=toy.build_tokenizer(),
                            eos_token_ids=[0], rollout_buffer=ctx.Queue(),
                            model_version_value=ctx.Value("q", 0), heartbeat_value=ctx.Value("d"),
                            failed_event=ctx.Event(), exception_info_queue=ctx.Queue(),
                            metrics_queue=ctx.Queue(), score_queue_maxsize=4)
    assert loop.channels.model_version.value == 0 and loop.score_queue.maxsize == 4
    with pytest.raises(TypeError, match="needs model_version_value, heartbeat_value"):
        AsyncRolloutLoop(config, None, toy.make_dataset(4), [toy.sum_reward],
                         toy.build_tokenizer(), [0], rollout_buffer=ctx.Queue())
    hooks_only = AsyncRolloutLoop(config, None, toy.make_dataset(4), [toy.sum_reward],
                                  toy.build_tokenizer(), [0])           # none: for its hooks
    assert hooks_only.channels is None


# ── server checks ────────────────────────────────────────────────────────────────────────────


def test_dtype_mismatch_warns_and_data_parallel_refuses_adapter_sync():
    import torch
    info = {"model_config": {"dtype": "torch.bfloat16"},
            "parallel_config": {"data_parallel_size": 2}}
    assert verify_sync.dtype_warning("http://a", info, torch.bfloat16) is None
    assert "vllm serve --dtype float32" in verify_sync.dtype_warning("http://a", info,
                                                                         torch.float32)
    lora = {"lora_config": {"max_lora_rank": 8, "max_loras": 3}}
    peft = LoraConfig(r=4)
    assert "--data-parallel-size 2" in lora_sync.adapter_refusal([info | lora], ["http://a"],
                                                                 peft, 1)
    assert lora_sync.adapter_refusal([{"parallel_config": {}} | lora], ["http://a"], peft,
                                     1) is None


class SmallVocabServer:
    base_url = "http://small"

    def models(self):
        return {"data": [{"id": "other", "parent": None}]}

    def completions(self, body):
        raise VLLMError("token id out of vocabulary", self.base_url, status=400)


def test_a_server_with_a_smaller_vocabulary_is_refused(train_server):
    from vllm_client import VLLMClient
    tokenizer = toy.build_tokenizer()
    with pytest.raises(ValueError, match="serves another model"):
        verify_sync.check_vocab(SmallVocabServer(), tokenizer)
    client = VLLMClient(train_server.url, timeout=60)
    try:
        verify_sync.check_vocab(client, tokenizer)          # the toy server: the same model
    finally:
        client.close()
