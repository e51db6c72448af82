"""tree_gated_delta_rule.py: Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) packed equal each sample
alone; the layout of the module docstring's example; the patched functions leave other models be."""
import numpy as np
import pytest
import torch

import tree_attention
import tree_gated_delta_rule as gdn
from test_tree_attention import (VOCAB, alone_logps, assert_packed_equals_alone, pack,
                                 packed_logps, sample, samples, to_cuda)

HYBRID = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=512,
              layer_types=["linear_attention", "full_attention", "linear_attention"])


def hybrid(family: str, seed=0, **cfg):
    import transformers as tf
    torch.manual_seed(seed)
    if family == "qwen3_next":
        m = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{**HYBRID, **cfg}, num_experts=0)).float()
    else:
        m = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**{**HYBRID, **cfg})).float()
    # Random init draws decay rates A up to 16 (a state that forgets in one token), whose in-chunk
    # cumulative decays underflow fp32 differently for each chunk alignment; trained checkpoints
    # decay far slower.
    with torch.no_grad():
        for layer in gdn.gated_deltanet_layers(tree_attention.decoder_layers(m)):
            layer.A_log.uniform_(-4.0, -1.0)                                    # A in [0.02, 0.37]
    return m


def long_samples(seed: int) -> list:
    """Prompts longer than the 64-token chunk of the delta rule, forks inside and across chunks,
    multi-turn."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 90)
    out = []
    for _ in range(3):
        ids = np.concatenate([prompt, rng.integers(0, VOCAB, rng.integers(40, 80))])
        mask = np.r_[np.zeros(90, np.int8), rng.integers(0, 2, len(ids) - 90).astype(np.int8)]
        out.append(sample(ids, mask, float(rng.normal())))
        cut = int(rng.integers(91, len(ids)))           # a later turn re-using part of this one
        turn = np.concatenate([ids[:cut], rng.integers(0, VOCAB, 30)])
        turn_mask = np.r_[np.zeros(cut, np.int8), np.ones(30, np.int8)]
        out.append(sample(turn, turn_mask, float(rng.normal())))
    return out


EDGES = [sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1]),
         sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], -1.0),
         sample([1, 2, 3, 4], [0, 0, 1, 1]), sample([1, 2], [0, 1]), sample([7], [0]),
         sample([7, 8], [0, 1]), sample([1, 2, 3, 4, 5, 6, 9, 9], [0, 0, 0, 1, 0, 1, 1, 1]),
         sample([1, 2, 3, 9], [0, 0, 0, 0]),
         sample([1, 2, 3, 4, 5, 7, 7, 7, 7], [0, 0, 0, 0, 0, 1, 1, 1, 1])]   # shorter than K


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("which", ["groups", "edges", "long"])
def test_hybrid_packed_equals_unpacked_logprobs_and_gradients(family, which):
    """Also: without the tree layout (tree_gdn=None) the recurrence runs across packed positions,
    and the log-probs are wrong."""
    batch = {"groups": samples(1), "edges": EDGES, "long": long_samples(2)}[which]
    row = pack(batch)
    assert row.unique_tokens < row.raw_tokens
    tree, ref = hybrid(family, 3), hybrid(family, 3)
    assert tree_attention.install(tree) == "sdpa"
    lp_ref = assert_packed_equals_alone(tree, ref, batch, row)
    with torch.no_grad():
        lp_flat = packed_logps(tree, row, tree_gdn=None)
        assert (lp_flat - lp_ref).abs().max().item() > 1e-3


def test_layout_parents_and_extended_convolution():
    """The module docstring's example: S1 and S2 hang below S0; each segment reads K-1 = 3 path
    predecessors."""
    row = pack([sample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), sample([1, 2, 3, 6, 7], [0, 0, 0, 1, 1])])
    assert row.cu_seqlens_q.tolist() == [0, 2, 5, 8]
    lay = gdn.layout(row, kernel_size=4, device="cpu")
    assert [(lv.segments, lv.parents) for lv in lay.levels] == [([0], [-1]), ([1, 2], [0, 0])]
    N = 8                                                   # slot N reads zeros
    assert lay.conv_index.tolist() == [N, N, N, 0, 1, N, 0, 1, 2, 3, 4, N, 0, 1, 5, 6, 7]
    assert lay.conv_keep.tolist() == [3, 4, 8, 9, 10, 14, 15, 16]
    assert torch.equal(torch.cat([lv.index for lv in lay.levels])[lay.unlevel], torch.arange(N))


def test_a_tree_kwarg_never_leaks_into_other_models():
    """The modeling file's functions are patched module-wide: without the row's layout they are
    the originals."""
    m = hybrid("qwen3_5")
    tree_attention.install(hybrid("qwen3_5"))
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod
    assert hasattr(mod.torch_chunk_gated_delta_rule, "tree_original")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        a = m(input_ids=ids).logits
        saved = mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule
        mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule = (f.tree_original for f in saved)
        try:
            b = m(input_ids=ids).logits
        finally:
            mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule = saved
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_hybrid_on_cuda_packed_equals_unpacked(family):
    """On CUDA (fla's varlen kernel, one call per level, where installed; else the torch
    reference), fp32."""
    batch = long_samples(4) + samples(5)
    row = to_cuda(pack(batch))
    dims = dict(linear_key_head_dim=32, linear_value_head_dim=32)      # fla's Triton tiles: >= 16
    tree, ref = hybrid(family, 6, **dims).cuda(), hybrid(family, 6, **dims)
    assert tree_attention.install(tree) in ("flash", "flex")          # choose_backend's, on CUDA
    lp_tree = packed_logps(tree, row)
    lp_ref = alone_logps(ref, batch).cuda()                             # the CPU torch reference
    assert (lp_tree - lp_ref).abs().max().item() <= 2e-3
    lp_tree.sum().backward()


def test_vision_language_hybrid_text_only_through_its_decoder():
    """A Qwen3.5 vision-language checkpoint on text: the trainer forwards the text decoder
    (get_decoder()) and the LM head; tree packing finds the language model's layers (not the
    vision tower's, as many) and its Gated DeltaNet layers, and the packed log-probs equal the
    whole model run on each sample alone."""
    import transformers as tf
    text = {**HYBRID, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    models = []
    for _ in range(2):
        torch.manual_seed(8)
        config = tf.Qwen3_5Config(text_config=text, vision_config=vision)
        models.append(tf.Qwen3_5ForConditionalGeneration(config))
    vlm, ref = (m.float() for m in models)
    assert tree_attention.install(vlm) == "sdpa"
    batch = samples(2)
    row = pack(batch)
    decoder = tree_attention.forward_row(vlm, row, vlm.get_decoder())
    hidden = decoder.last_hidden_state[0]                                      # [N, H]
    logits = vlm.get_output_embeddings()(hidden[row.token_index])              # [M, V]
    lp = logits.log_softmax(-1).gather(1, row.targets[:, None])[:, 0]
    assert (lp - alone_logps(ref, batch)).abs().max().item() <= 1e-5
