"""train.py's mixed precision with tree_attention.py and tree_gated_delta_rule.py, end to end
below train(): FSDP2's MixedPrecisionPolicy with every tree-attention backend, on a CPU in a
process group of one: each decoder layer's forward kwargs go through FSDP2's input cast, and the
row's masks (sdpa, flex), flash's segment tensors and the Gated DeltaNet layout must come out as
they went in (tree_attention's docstring). Runs through train() are test_train.py's."""
import math

import pytest
import torch
import torch.distributed as dist

import train
import tree_attention
from config import AsyncGRPOConfig
from loss import StepTotals
from test_tree_attention import model, pack, reference_varlen, samples, windowed
from test_tree_gated_delta_rule import hybrid
from weight_sync import full_tensor

# what train_step needs of rows without sampler top log-probs (test_tree_attention's samples)
PLAIN = dict(gradient_checkpointing=False, score_centering=False,
             vllm_importance_sampling_clip_min=0.0, vllm_importance_sampling_clip_max=1e9)


@pytest.fixture
def device():
    """A gloo process group of one, as train() starts it alone."""
    device = train.setup_distributed(AsyncGRPOConfig())[2]
    yield device
    dist.destroy_process_group()


@pytest.mark.parametrize("backend, family", [("sdpa", "qwen3"), ("flex", "qwen3"),
                                             ("flash", "qwen3"), ("sdpa", "qwen3_5")])
def test_a_bf16_sharded_forward_equals_the_fp32_one(backend, family, device, monkeypatch,
                                                    request):
    """Sliding and full layers (two masks a row) or a Gated DeltaNet hybrid (qwen3_5: tree_gdn),
    sharded in bf16: the decoder's hidden states match the unsharded fp32 model's within bf16's
    precision. flash: a pure-torch stand-in for the kernel (test_tree_attention); flex: the
    forward only (no CPU backward in torch 2.13)."""
    monkeypatch.setattr(tree_attention, "flash_kernel",
                        lambda: tree_attention.FlashKernel.of("stand-in", reference_varlen))
    if backend == "flex":   # torch 2.13's CPU flex kernel fails to build in bf16 once earlier
        torch.compiler.reset()      # rows have made N dynamic, and fp32 fails to build after a
        request.addfinalizer(torch.compiler.reset)      # bf16 build: compile afresh, both ways
    build = (lambda: windowed("qwen3", 3)) if family == "qwen3" else (lambda: hybrid(family, 3))
    mixed, reference = build(), build()
    tree_attention.install(mixed, backend)
    tree_attention.install(reference, "sdpa")
    policy = train.shard(train.Policy(mixed), AsyncGRPOConfig(bf16=True), device)
    row = pack(samples(3))
    with torch.no_grad():
        got = policy(row).last_hidden_state[0]                                    # [N, H]
        want = train.Policy(reference)(row).last_hidden_state[0]                  # [N, H]
    assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
    assert (got.float() - want).norm() <= 0.02 * want.norm()


def test_fp16_steps_are_loss_scaled_and_an_overflow_never_reaches_the_weights(device):
    """fp16 as train() runs it, with ShardedGradScaler on the trainer's device (config.py refuses
    fp16 without CUDA, so fp16 is set after the check): a scale that overflows fp16's gradients
    skips the optimizer step and halves the scale; at the default scale the step trains."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    config = AsyncGRPOConfig(learning_rate=1e-2, **PLAIN)
    config.fp16 = True
    m = model(0)
    tree_attention.install(m, "sdpa")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    policy = train.shard(train.Policy(m), config, device)
    optimizer, scheduler = train.build_optimizer(policy, config)
    row = pack(samples(0))

    def step(scaler) -> tuple[dict, dict]:
        out = train.train_step(policy, optimizer, scheduler, [row], StepTotals.of([row]), config,
                               1, 0.0, scaler)
        return out, {n: full_tensor(p) for n, p in policy.model.named_parameters()}

    overflow = ShardedGradScaler(device=device.type, init_scale=2.0 ** 40)   # fp16 max: 65504
    out, weights = step(overflow)
    assert overflow.get_scale() == 2.0 ** 39 and not math.isfinite(out["grad_norm"])
    assert all(torch.equal(weights[n], before[n]) for n in before)
    scaler = ShardedGradScaler(device=device.type)
    out, weights = step(scaler)
    assert scaler.get_scale() == 2.0 ** 16 and math.isfinite(out["loss"])
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert max((weights[n] - before[n]).abs().max() for n in before) > 1e-3


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_reference_is_the_starting_model_while_the_policy_trains(lora, bf16, device):
    """beta > 0: reference_policy's log-probs are the untrained model's, before and after steps
    that move the policy away (full fine-tuning: a frozen FSDP2 copy in the compute dtype; LoRA:
    the policy with its adapter disabled); the step's kl is 0 while they agree, then > 0, and
    beta 0 builds no reference."""
    from peft import LoraConfig
    config = AsyncGRPOConfig(learning_rate=1e-1 if lora else 1e-2, beta=0.5, bf16=bf16, **PLAIN)
    start = model(0)
    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    reference = train.reference_policy(start, config, toy_tokenizer(), peft, device)
    assert train.reference_policy(start, AsyncGRPOConfig(**PLAIN), None, peft, device) is None
    policy_model, _ = train.load_model(start, config, toy_tokenizer(), peft, device)
    policy = train.shard(train.Policy(policy_model), config, device)
    optimizer, scheduler = train.build_optimizer(policy, config)
    untrained = model(0)                                  # the same seed: the starting weights
    tree_attention.install(untrained, "sdpa")
    row = pack(samples(4))
    want = train.Policy(untrained).logprobs(row, config.temperature)                      # [M]
    tolerance = 3e-2 if bf16 else 1e-5
    kls = []
    for _ in range(3):
        got = reference(policy, row)
        assert got.dtype == torch.float32 and not got.requires_grad
        assert (got - want).abs().max() <= tolerance
        out = train.train_step(policy, optimizer, scheduler, [row], StepTotals.of([row]),
                               config, 1, 0.0, reference=reference)
        kls.append(out["kl"])
    with torch.no_grad():
        moved = policy.logprobs(row, config.temperature)
    assert (moved - want).abs().max() > 10 * tolerance   # the policy did move
    assert kls[0] <= 1e-3 and kls[-1] > 1e-3 and all(math.isfinite(k) for k in kls)


def toy_tokenizer():
    import toy
    return toy.build_tokenizer()
