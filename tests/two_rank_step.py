"""One optimizer step of train.train_step on fixed rows, under torchrun (2 gloo ranks) or alone.

    torchrun --nproc_per_node 2 tests/two_rank_step.py OUT.pt   # rank r: row r of each micro-batch
    python tests/two_rank_step.py OUT.pt                        # one process: every row
    ... two_rank_step.py OUT.pt bf16                            # either, in bf16 (FSDP2's policy)

Both plan the same samples into the same 2-row micro-batches; rank 0 saves the full weights after
the step to OUT.pt, so the test can compare them (test_train.py). With TWO_RANK_POISON=1 the first
sample's advantage is infinite (one rank's row): every rank must skip the step
(test_train_signal.py).
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import toy  # noqa: E402
import train  # noqa: E402
from loss import StepTotals  # noqa: E402
import tree_attention  # noqa: E402
from rollout.samples import RolloutSample  # noqa: E402
from trie_pack import Planner  # noqa: E402
from weight_sync import full_tensor  # noqa: E402


def samples(n: int, seed: int = 0) -> list[RolloutSample]:
    """Groups of 4 rollouts sharing a prompt, with random completions, advantages and sampler
    log-probs."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(4, 100, 12 + i // 4 % 3)
        completion = rng.integers(4, 100, 3 + i % 5)
        ids = np.concatenate([prompt, completion])
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(completion))].astype(np.int8)
        top = np.stack([ids, (ids + 1) % 100], axis=1)             # [L, 2] the sampler's top-2
        # [L, 2] log-probs as a random init gives them: near uniform
        near_uniform = np.log(1 / 105) + 0.2 * rng.standard_normal((len(ids), 2))
        out.append(RolloutSample(input_ids=ids, completion_mask=mask,
                                 sampler_logprobs=(near_uniform[:, 0] * mask).astype(np.float32),
                                 advantage=float(rng.normal()), group_id=i // 4, model_version=0,
                                 top_ids=top, top_logprobs=near_uniform.astype(np.float32)))
    return out


def main(out_path: str, precision: str = "fp32") -> None:
    # adam_epsilon 1: Adam's update is smooth in g, no sign(g) of a tiny g
    config = train.AsyncGRPOConfig(learning_rate=1.0, adam_epsilon=1.0, max_grad_norm=0.5,
                                   gradient_checkpointing=False, bf16=precision == "bf16")
    rank, world, device = train.setup_distributed(config)
    torch.manual_seed(0)
    model = toy.build_model(len(toy.build_tokenizer()))
    tree_attention.install(model, "sdpa")
    policy = train.shard(train.Policy(model), config, device)
    optimizer, scheduler = train.build_optimizer(policy, config)
    planner = Planner(world_size=2, token_budget=64, per_device_train_batch_size=1)
    rollout = samples(24)
    if os.environ.get("TWO_RANK_POISON"):
        rollout[0].advantage = float("inf")
    micro = [rows for s in rollout if (rows := planner.add(s))]
    packed = [[row.pack() for row in m] for m in micro]                  # [GA][2]
    totals = StepTotals.of([p for m in packed for p in m])
    mine = [m[rank] for m in packed] if world == 2 else [p for m in packed for p in m]
    out = train.train_step(policy, optimizer, scheduler, mine, totals, config, world,
                           aux_coef=0.0)
    if os.environ.get("TWO_RANK_POISON"):
        assert out["loss"] is None and out["grad_norm"] is None, (rank, out)
    weights = {n: full_tensor(p).clone() for n, p in policy.model.named_parameters()}
    if rank == 0:
        torch.save(weights, out_path)
    torch.distributed.barrier()     # no rank tears its gloo pairs down while rank 0 still saves
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
