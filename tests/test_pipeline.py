"""rollout/, trie_pack.py, tree_attention.py and loss.py end to end, the four pieces together on
CPU: samples from the real rollout process against local_vllm are planned into rows, packed as
tries, forwarded with tree attention and scored by the loss.

The server and the trainer hold the same weights in fp32, so every importance ratio must be 1 up to
float error. That one number checks that the server's processed log-probs, the sample layout (entry
t describes token t), the trie packing, the tree attention mask, temperature and the candidate-set
renormalisation all agree: a slip in any of them shows as a ratio far from 1.
"""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import rollout_helpers as h
import toy
import tree_attention
from loss import StepTotals, compute_loss, finalize_metrics, reduce_metrics
from rollout.worker import RolloutWorker
from trie_pack import Planner


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9}],
                         ids=["plain", "top-k-top-p"])
def test_sampler_and_trainer_logprobs_agree_through_packing(long_server, toy_dir, tokenizer,
                                                            sampling):
    config = h.config_for(long_server, num_generations=4, max_completion_length=12,
                          per_device_train_batch_size=4, **sampling)
    worker = RolloutWorker(config, toy.make_dataset(6), [h.rank_reward], tokenizer)
    samples = []
    try:
        worker.start()
        while (sample := worker.get(timeout=60)) is not None:
            samples.append(sample)
            if len(samples) % config.per_device_train_batch_size == 0:  # as a trainer would
                worker.set_model_version(len(samples) // config.per_device_train_batch_size)
    finally:
        worker.stop()
    assert len(samples) == 6 * 4
    assert all((s.candidate_counts is not None) == bool(sampling) for s in samples)

    planner = Planner(world_size=2, token_budget=256, per_device_train_batch_size=4)
    batches = [rows for s in samples if (rows := planner.add(s))] + [planner.flush()]
    rows = [row.pack() for batch in batches if batch for row in batch]
    assert all(row.input_ids.numel() > 0 for row in rows)
    trained = sum(int(s.completion_mask.sum()) for s in samples)
    assert sum(row.token_index.numel() for row in rows) == trained   # a loss term per trained token
    packed = sum(row.input_ids.numel() for row in rows)
    assert packed < sum(len(s.input_ids) for s in samples)           # prompts are shared

    model = AutoModelForCausalLM.from_pretrained(toy_dir, dtype=torch.float32)
    tree_attention.install(model, "sdpa")
    parts = []
    for row in rows:
        hidden = tree_attention.forward_row(model, row, model.model).last_hidden_state[0]   # [N, H]
        loss, metrics = compute_loss(hidden, model.lm_head.weight, None, row, config,
                                     StepTotals.of(rows))
        loss.backward()
        parts.append(metrics)
    m = finalize_metrics(reduce_metrics(parts))
    assert m["sampling/sampling_logp_difference/max"] < 1e-5, m
    assert abs(m["sampling/importance_sampling_ratio/mean"] - 1) < 1e-5
    assert m["sampling/masked_mean"] == 0
    assert m["clip_ratio/low_mean"] == 0 and m["clip_ratio/high_mean"] == 0
    assert 0.01 < m["sampling/sampler_mass"] <= 1 + 1e-5  # the top num_sampler_logprobs' share
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters() if p.requires_grad)
    np.testing.assert_array_less(0, [m["entropy"]])
