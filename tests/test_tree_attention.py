"""tree_attention.py: one packed forward equals every sample forwarded alone (log-probs and
gradients), on every backend; install() refuses what it cannot compute exactly. flex compiled on a
CPU is test_tree_attention_compiled.py's (the compiler is a child process: not the fast tier)."""
import dataclasses
import logging
import sys
import types

import numpy as np
import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import tree_attention
from rollout.samples import RolloutSample
from trie_pack import build_row

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)

VOCAB = 61
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             tie_word_embeddings=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def model(seed=0, **cfg):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**SMALL, **cfg})).float()


WINDOW = 5                        # shorter than every sample below


def windowed(family: str, seed=0, attn_implementation=None, window=WINDOW):
    """Tiny models whose windows and softcaps change the result: Mistral (one window for every
    layer), Qwen3 and Gemma 3 (sliding_attention layer types), Gemma 2 (types, attention and final
    softcapping)."""
    import transformers as tf
    small = {k: v for k, v in SMALL.items() if k != "tie_word_embeddings"}
    if attn_implementation:
        small["attn_implementation"] = attn_implementation
    two_types = ["sliding_attention", "full_attention"]
    if family == "mistral":
        cfg = tf.MistralConfig(**small, sliding_window=window)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**small, use_sliding_window=True, sliding_window=window,
                             layer_types=two_types)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**small, sliding_window=window, attn_logit_softcapping=0.05,
                              final_logit_softcapping=3.0, query_pre_attn_scalar=16)
    else:
        cfg = tf.Gemma3TextConfig(**small, sliding_window=window, query_pre_attn_scalar=16,
                                  layer_types=two_types)
    cls = {"mistral": tf.MistralForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "gemma2": tf.Gemma2ForCausalLM, "gemma3": tf.Gemma3ForCausalLM}[family]
    torch.manual_seed(seed)
    return cls(cfg).float()


def sample(ids, mask, advantage=1.0, group_id=0) -> RolloutSample:
    """A RolloutSample of these tokens and completion mask (sampler log-probs 0, version 0)."""
    return RolloutSample(np.asarray(ids, np.int64), np.asarray(mask, np.int8),
                         np.zeros(len(ids), np.float32), advantage, group_id, 0)


def samples(seed: int) -> list:
    """Two groups sharing a system prompt: rollouts of one prompt, some with a multi-turn fork."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 6)
    out = []
    for g in range(2):
        prompt = np.concatenate([system, rng.integers(0, VOCAB, rng.integers(3, 12))])
        for _ in range(3):
            ids = np.concatenate([prompt, rng.integers(0, VOCAB, rng.integers(2, 12))])
            forks = [ids]
            if rng.random() < 0.5:           # a later turn that re-uses part of this one
                cut = rng.integers(len(prompt), len(ids))
                forks.append(np.concatenate([ids[:cut], rng.integers(0, VOCAB, 5)]))
            for f in forks:
                mask = np.zeros(len(f), np.int8)
                mask[len(prompt):] = rng.integers(0, 2, len(f) - len(prompt))
                out.append(sample(f, mask, float(rng.normal()), group_id=g))
    return out


def pack(batch):
    return build_row(batch).pack()


def to_cuda(row):
    tensors = {k: v.cuda() for k, v in vars(row).items() if torch.is_tensor(v)}
    return dataclasses.replace(row, **tensors)


def packed_logps(m, row, **kwargs):
    """log π of every loss term of a packed row, from one tree_attention.forward_row.  [M]"""
    logits = tree_attention.forward_row(m, row, **kwargs).logits[0]                # [N, V]
    logp = torch.log_softmax(logits[row.token_index].float(), -1)                  # [M, V]
    return logp.gather(1, row.targets[:, None])[:, 0]


def alone_logps(m, batch):
    """The same terms, each sample forwarded alone by the model's own attention.  [M]"""
    out = []
    for s in batch:
        ids = torch.from_numpy(s.input_ids)
        logits = m(input_ids=ids[None], use_cache=False).logits[0]                 # [L, V]
        t = torch.from_numpy(np.flatnonzero(s.completion_mask[1:]) + 1)            # trained
        logp = torch.log_softmax(logits[t - 1].float(), -1)
        out.append(logp.gather(1, ids[t][:, None])[:, 0])
    return torch.cat(out)


def assert_same_gradients(a, b, rel=1e-5, floor=1e-12):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad.float() - q.grad.float()).norm() <= rel * q.grad.float().norm() + floor, name


def assert_packed_equals_alone(tree, ref, batch, row):
    """Log-probs of the packed row (tree) equal each sample alone (ref), and so do the gradients
    of Σ advantage × log π; returns the reference log-probs (detached)."""
    lp_tree, lp_ref = packed_logps(tree, row), alone_logps(ref, batch)
    assert (lp_tree - lp_ref).abs().max().item() <= 1e-5
    (row.advantages * lp_tree).sum().backward()
    adv = torch.tensor([s.advantage for s in batch])
    counts = torch.tensor([int(np.count_nonzero(s.completion_mask[1:])) for s in batch])
    (adv.repeat_interleave(counts) * lp_ref).sum().backward()
    assert_same_gradients(tree, ref)
    return lp_ref.detach()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_equals_unpacked_logprobs_and_gradients(seed):
    batch = samples(seed)
    row = pack(batch)
    assert row.unique_tokens < row.raw_tokens
    tree, ref = model(seed), model(seed)                  # ref keeps transformers' own sdpa
    assert tree_attention.install(tree) == "sdpa"
    assert_packed_equals_alone(tree, ref, batch, row)


def test_packed_equals_unpacked_for_duplicates_prefixes_and_tiny_samples():
    """Edge cases of the trie through attention: identical samples, a strict prefix of another
    sample, samples of one and two tokens, several separate trained spans (multi-turn), and an
    all-context sample."""
    batch = [sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1]),
             sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], -1.0),
             sample([1, 2, 3, 4], [0, 0, 1, 1]), sample([1, 2], [0, 1]), sample([7], [0]),
             sample([7, 8], [0, 1]), sample([1, 2, 3, 4, 5, 6, 9, 9], [0, 0, 0, 1, 0, 1, 1, 1]),
             sample([1, 2, 3, 9], [0, 0, 0, 0])]
    row = pack(batch)
    assert row.unique_tokens == 16 and row.trained_tokens == 14      # nodes fork one token early
    tree, ref = model(6), model(6)
    tree_attention.install(tree)
    assert_packed_equals_alone(tree, ref, batch, row)


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "gemma3"])
def test_windowed_and_softcapped_models_packed_equal_unpacked(family):
    """The window counts positions along each token's own path; attention softcapping (Gemma 2)
    runs eagerly (transformers' sdpa path ignores it, so the reference is its eager path).
    Mistral's model-wide sliding_window is honoured, never silently dropped: a model with a window
    100x longer differs."""
    batch = samples(7)
    row = pack(batch)
    assert max(len(s.input_ids) for s in batch) > 3 * WINDOW
    ref_impl = "eager" if family == "gemma2" else "sdpa"
    tree, ref = windowed(family, 7), windowed(family, 7, attn_implementation=ref_impl)
    assert tree_attention.install(tree) == "sdpa"
    lp_ref = assert_packed_equals_alone(tree, ref, batch, row)
    wide = windowed(family, 7, attn_implementation=ref_impl, window=100 * WINDOW)
    with torch.no_grad():
        assert (alone_logps(wide, batch) - lp_ref).abs().max().item() > 1e-3   # the window matters
        if family == "gemma2":                                                  # and the softcap
            assert (alone_logps(windowed(family, 7), batch) - lp_ref).abs().max().item() > 1e-3


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """What flash_attn_varlen_func computes, per segment, with the causal mask aligned
    bottom-right, a left window of window_size[0] keys and tanh softcapping of the scores."""
    assert causal and window_size[1] in (-1, 0)
    out = []
    for s in range(len(cu_seqlens_q) - 1):
        a, b = cu_seqlens_q[s:s + 2].tolist()
        c, d = cu_seqlens_k[s:s + 2].tolist()
        qs = q[a:b].transpose(0, 1)                                                  # [H, n, D]
        ks, vs = k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)                      # [Hkv, m, D]
        n, m = qs.shape[1], ks.shape[1]
        assert n <= max_seqlen_q and m <= max_seqlen_k
        ks, vs = (x.repeat_interleave(qs.shape[0] // x.shape[0], 0) for x in (ks, vs))  # [H, m, D]
        i, j = torch.arange(n)[:, None] + (m - n), torch.arange(m)[None, :]
        mask = (j <= i) & ((j >= i - window_size[0]) if window_size[0] >= 0 else True)
        scores = qs @ ks.transpose(1, 2) * (softmax_scale or qs.shape[-1] ** -0.5)   # [H, n, m]
        scores = torch.tanh(scores / softcap) * softcap if softcap else scores
        out.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_flash_path_gathers_segment_paths(monkeypatch, family):
    """The flash backend's gather, cu_seqlens, window and softcap, with a pure-torch stand-in for
    the kernel."""
    stand_in = tree_attention.FlashKernel.of("stand-in", reference_varlen)
    monkeypatch.setattr(tree_attention, "flash_kernel", lambda: stand_in)
    batch = samples(3)
    row = pack(batch)
    flash, sdpa = (model(3) if family == "qwen3" else windowed("gemma2", 3) for _ in range(2))
    assert tree_attention.install(flash, "flash") == "flash"
    tree_attention.install(sdpa, "sdpa")
    a, b = packed_logps(flash, row), packed_logps(sdpa, row)
    assert (a - b).abs().max().item() <= 1e-5
    a.sum().backward()
    b.sum().backward()
    assert_same_gradients(flash, sdpa)


def test_flash_without_a_kernel_names_what_it_tried_and_suggests_flex(monkeypatch):
    monkeypatch.setitem(sys.modules, "kernels", None)             # `import kernels` raises
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    tree_attention.flash_kernel.cache_clear()
    try:
        tried = (r"flash-attn3: the `kernels` library is not installed.*"
                 r"flash_attn_interface.*flash_attn.*Use backend 'flex'")
        with pytest.raises(RuntimeError, match=tried):
            tree_attention.install(model(), "flash")
    finally:
        tree_attention.flash_kernel.cache_clear()


def fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    raise AssertionError("the decision never calls the kernel")


@pytest.mark.parametrize("device, repo, family, chosen", [
    ("cpu", None, "qwen3", "sdpa"),
    ("cuda", "kernels-community/flash-attn3", "qwen3", "flash"),          # Hopper
    ("cuda", "kernels-community/flash-attn3", "gemma2", "flash"),         # softcap: FA3 has it
    ("cuda", "kernels-community/flash-attn4", "qwen3", "flash"),          # Blackwell
    ("cuda", "kernels-community/flash-attn4", "gemma2", "flex"),          # the spec: no softcap
    ("cuda", "kernels-community/aiter-flash-attn", "gemma2", "flex"),     # AMD: no softcap
    ("cuda", "missing", "qwen3", "flex"),                                 # no flash kernel loads
])
def test_the_backend_is_chosen_for_the_training_device(device, repo, family, chosen):
    """choose_backend, with each device kind and model feature, without a GPU: the kernel that
    would load is the boundary (a FlashKernel from the repo's name and a varlen signature)."""
    def kernel():
        if repo == "missing":
            raise RuntimeError("backend 'flash' needs a flash-attention varlen kernel and none "
                               "loads: flash-attn3: the `kernels` library is not installed")
        return tree_attention.FlashKernel.of(repo, fake_varlen)

    net = model(3) if family == "qwen3" else windowed("gemma2", 3)
    backend, why = tree_attention.choose_backend(net, torch.device(device), kernel=kernel)
    assert backend == chosen, why
    if chosen == "flex":
        assert ("softcapping" if repo != "missing" else "kernels") in why
    assert tree_attention.choose_backend(net, torch.device(device), "sdpa", kernel)[0] == "sdpa"


def test_the_trainer_says_its_backend_once(caplog, tmp_path):
    """load_model decides for the training device and logs the choice once (CPU: sdpa)."""
    import train
    from config import AsyncGRPOConfig
    with caplog.at_level(logging.INFO, logger="train"):
        train.load_model("toy", AsyncGRPOConfig(), device=torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records if r.name == "train"]
    assert said == ["tree attention: sdpa (cpu: the exact dense-mask reference)"], said


def test_flash_kernel_comes_from_the_hub_repo_of_the_device(monkeypatch):
    """kernels.get_kernel(repo) for the device (a fake `kernels` module: the hub is a boundary we
    do not own), and the flash-attn package when the hub fails."""
    repo = tree_attention.hub_kernel_repo
    assert repo(rocm=True, capability=(9, 4)) == "kernels-community/aiter-flash-attn"
    assert repo(rocm=False, capability=(10, 0)) == "kernels-community/flash-attn4"
    assert repo(rocm=False, capability=(9, 0)) == "kernels-community/flash-attn3"
    assert repo(rocm=False, capability=(8, 0)) == "kernels-community/flash-attn3"
    asked = []

    def get_kernel(repo, version=None):
        asked.append((repo, version))
        if repo.endswith("flash-attn4"):
            raise OSError("no build for this torch")
        return types.SimpleNamespace(flash_attn_varlen_func=reference_varlen)

    monkeypatch.setitem(sys.modules, "kernels", types.SimpleNamespace(get_kernel=get_kernel))
    monkeypatch.setitem(sys.modules, "flash_attn",
                        types.SimpleNamespace(flash_attn_varlen_func=reference_varlen))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        expected = (((9, 0), "kernels-community/flash-attn3"), ((10, 0), "flash_attn"))
        for capability, name in expected:
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
            tree_attention.flash_kernel.cache_clear()
            kernel = tree_attention.flash_kernel()
            assert kernel.name == name and kernel.varlen is reference_varlen
            assert kernel.window and kernel.softcap
        assert asked == [("kernels-community/flash-attn3", 1), ("kernels-community/flash-attn4", 0)]
    finally:
        tree_attention.flash_kernel.cache_clear()


def test_flash_refuses_what_its_kernel_cannot_do(monkeypatch):
    """Softcapping on flash-attn4/aiter (the spec: not on Blackwell or AMD) and windows on a kernel
    without window_size are refused at install with the reason; flex takes them."""
    def no_window(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale=None, causal=False, softcap=0.0):
        raise AssertionError("never called")

    fa4 = tree_attention.FlashKernel.of("kernels-community/flash-attn4", reference_varlen)
    monkeypatch.setattr(tree_attention, "flash_kernel", lambda: fa4)
    refused = "softcapping: the flash kernel kernels-community/flash-attn4"
    with pytest.raises(ValueError, match=refused):
        tree_attention.install(windowed("gemma2"), "flash")
    assert tree_attention.install(windowed("mistral"), "flash") == "flash"
    old = tree_attention.FlashKernel.of("old", no_window)
    monkeypatch.setattr(tree_attention, "flash_kernel", lambda: old)
    with pytest.raises(ValueError, match="mistral.*sliding-window attention: the flash kernel old"):
        tree_attention.install(windowed("mistral"), "flash")
    assert tree_attention.install(windowed("mistral"), "flex") == "flex"


def test_install_refuses_models_it_cannot_pack():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    small = {k: v for k, v in SMALL.items() if k not in ("tie_word_embeddings",)}
    llama4 = Llama4TextConfig(**small, intermediate_size_mlp=128, num_local_experts=2,
                              attention_chunk_size=4)
    with pytest.raises(ValueError, match=r"llama4_text.*layer types \['chunked_attention'\]"):
        tree_attention.install(Llama4ForCausalLM(llama4))
    mamba = MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4)
    with pytest.raises(ValueError, match="mamba.*non-attention"):
        tree_attention.install(MambaForCausalLM(mamba))
    with pytest.raises(ValueError, match="attention_dropout"):
        tree_attention.install(model(attention_dropout=0.1))
    with pytest.raises(ValueError, match="unknown"):
        tree_attention.install(model(), "eager")


def test_install_refuses_models_whose_logits_are_not_the_lm_head():
    """loss.py computes log π from lm_head(h) / T (and final softcapping): a model that scales its
    logits after the head would get biased ratios on every token (all masked), silently. Granite
    divides by logits_scaling, Cohere multiplies by logit_scale; both have plain full attention, so
    only this check stops them."""
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM
    small = {k: v for k, v in SMALL.items() if k not in ("head_dim", "tie_word_embeddings")}
    with pytest.raises(ValueError, match="granite.*logits_scaling"):
        tree_attention.install(GraniteForCausalLM(GraniteConfig(**small, logits_scaling=8.0)))
    with pytest.raises(ValueError, match="cohere.*logit_scale"):
        tree_attention.install(CohereForCausalLM(CohereConfig(**small, logit_scale=0.0625)))
    plain = GraniteForCausalLM(GraniteConfig(**small, logits_scaling=1.0))
    assert tree_attention.install(plain) == "sdpa"


def test_missing_row_kwargs_is_a_clear_error():
    m = model()
    with pytest.raises(ValueError, match="install"):
        tree_attention.row_kwargs(m, pack(samples(0)))
    tree_attention.install(m)
    with pytest.raises(ValueError, match="row_kwargs"):
        m(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_decoder_layers_are_the_language_models_even_beside_a_vision_tower_of_equal_depth():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    m = model()
    assert tree_attention.decoder_layers(m) is m.model.layers
    assert tree_attention.text_config(m) is m.config
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                layer_types=["linear_attention", "full_attention"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    assert len(vlm.model.visual.blocks) == 2                              # as deep as the text
    assert tree_attention.decoder_layers(vlm) is vlm.model.language_model.layers
    assert tree_attention.text_config(vlm) is vlm.config.text_config


# ---- CUDA: flex in bf16 against sdpa ----------------------------------------------------------

def assert_flex_matches_sdpa_bf16(flex, sdpa, row):
    assert tree_attention.install(flex, "flex") == "flex"
    tree_attention.install(sdpa, "sdpa")
    a, b = packed_logps(flex, row), packed_logps(sdpa, row)
    assert (a - b).abs().max().item() <= 0.05
    a.sum().backward()
    b.sum().backward()
    assert_same_gradients(flex, sdpa, rel=0.05, floor=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_flex_forward_backward_on_cuda_matches_sdpa_bf16():
    flex, sdpa = (model(5).cuda().bfloat16() for _ in range(2))
    assert_flex_matches_sdpa_bf16(flex, sdpa, to_cuda(pack(samples(5))))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windowed_and_softcapped_flex_on_cuda_matches_sdpa_bf16(family):
    flex, sdpa = (windowed(family, 8).cuda().bfloat16() for _ in range(2))
    assert_flex_matches_sdpa_bf16(flex, sdpa, to_cuda(pack(samples(8))))


@pytest.mark.gpu
@needs_cuda
def test_flex_rows_of_varying_length_under_compile():
    """Rows of 5 different lengths through compiled flex: every one matches sdpa, and compiling
    stops after the first dynamic recompile (transformers-style dynamic shapes), so later lengths
    cost no compile."""
    from torch._dynamo.utils import counters
    flex, sdpa = (model(9).cuda().bfloat16() for _ in range(2))
    tree_attention.install(flex, "flex")
    tree_attention.install(sdpa, "sdpa")
    rows = [to_cuda(pack(samples(seed)[: 3 + seed % 4])) for seed in range(10, 15)]
    assert len({r.unique_tokens for r in rows}) == 5
    frames = []
    for row in rows:
        with torch.no_grad():
            assert (packed_logps(flex, row) - packed_logps(sdpa, row)).abs().max().item() <= 0.05
        frames.append(counters["stats"]["unique_graphs"])
    assert frames[-1] == frames[2], frames          # no compile after the third length


@pytest.mark.gpu
@needs_cuda
def test_the_backend_chosen_on_this_gpu_is_the_specs_and_matches_sdpa():
    """On the real device: flash when the spec's kernel (or an installed flash-attn) loads, else
    flex; either way the packed log-probs match sdpa's in bf16."""
    try:
        tree_attention.flash_kernel()
        expected = "flash"
    except RuntimeError:
        expected = "flex"
    chosen, sdpa = (model(6).cuda().bfloat16() for _ in range(2))
    backend, why = tree_attention.choose_backend(chosen, torch.device("cuda"))
    print(f"chosen backend: {backend} ({why})")
    assert backend == expected, why
    tree_attention.install(chosen, backend)
    tree_attention.install(sdpa, "sdpa")
    row = to_cuda(pack(samples(6)))
    with torch.no_grad():
        assert (packed_logps(chosen, row) - packed_logps(sdpa, row)).abs().max().item() <= 0.05
