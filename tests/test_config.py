"""AsyncGRPOConfig: the spec's defaults, the derived values of the module docstring's worked
example, and bad values refused with the field and the fix."""
import dataclasses
import warnings

import pytest
import torch

import config
import rollout_helpers as h
from config import AsyncGRPOConfig


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
    """include_num_input_tokens_seen=False is "no", debug None or [] is "", and
    trackio_static_space_id=False asks for no static Space: none is refused."""
    for kwargs in ({"include_num_input_tokens_seen": False}, {"debug": []}, {"debug": None},
                   {"trackio_static_space_id": False}):
        AsyncGRPOConfig(**kwargs)
    with pytest.raises(ValueError, match="AsyncGRPOConfig.include_num_input_tokens_seen=True"):
        AsyncGRPOConfig(include_num_input_tokens_seen=True)


def test_bf16_none_means_on_cuda_only():
    assert AsyncGRPOConfig().bf16_on(torch.device("cuda")) is True
    assert AsyncGRPOConfig().bf16_on(torch.device("cpu")) is False
    assert AsyncGRPOConfig(bf16=True).bf16_on(torch.device("cpu")) is True
    assert AsyncGRPOConfig(bf16=False).bf16_on(torch.device("cuda")) is False


@pytest.mark.parametrize("field, kwargs", [
    ("top_k", {"top_p": 0.9}),                # top-p needs a top-k bound on the candidate set
    ("top_k", {"min_p": 0.1}),
    ("top_p", {"top_p": 0.0}),
    ("num_generations", {"num_generations": 1}),
    ("temperature", {"temperature": 0.0}),
    ("vllm_importance_sampling_clip_min/max", {"vllm_importance_sampling_clip_min": 1.5}),
    ("weight_sync_steps", {"weight_sync_steps": 0}),
    ("weight_sync_verify_every", {"weight_sync_verify_every": -1}),
    ("warmup_steps", {"warmup_steps": 0.5}),  # a fraction of max_steps, which is not set
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
    assert len(listed) == len(set(listed)) == len(config.WHY) == 68
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
