"""Attention over a packed trie row (spec: ツリーパッキング, steps 3-4 "Packed row" and "Attention").

A packed row (trie_pack.PackedRow) lays out unique tokens in DFS pre-order, so the ancestors of a
token are exactly the earlier tokens whose subtree still contains it:

    idx           0  1 | 2  3  4 | 5  6  7        kv j is visible to query i  iff  j <= i <= subtree_end[j]
    input_ids    p1 p2 | p3 a1 a2 | p3 b1 b2
    subtree_end   7  7 |  4  4  4 |  7  7  7            kv: 0 1 2 3 4 5 6 7
                                                   q 5 (p3):  ■ ■ · · · ■ · ·   p1 p2, then itself
                                                   q 7 (b2):  ■ ■ · · · ■ ■ ■   never a1 a2 (other branch)

Three backends compute that same attention, chosen by `install(model, backend)`:

    sdpa   a dense [N, N] boolean mask from subtree_end: the exact reference (CPU, tests). O(N²) memory.
    flex   torch flex_attention (compiled) with a BlockMask whose mask_mod is the rule above; the
           CUDA default. The BlockMask is built once per row by row_kwargs and reused by every layer.
    flash  the spec's path: per segment, K/V gathered along its root-to-segment path (kv_index) and
           one varlen flash-attention call with causal=True. Flash aligns the causal mask bottom-right
           when a segment has fewer queries than keys, so segment S2 = [p3 b1 b2] with keys
           [p1 p2 | p3 b1 b2] sees its ancestors and its own causal past. Needs `flash_attn_interface`
           (FA3) or `flash_attn` (FA2) importable; selecting it otherwise is an error.

    install(model)                           # "flex" on CUDA, "sdpa" on CPU; refuses unsupported models
    out = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False,
                **row_kwargs(model, row))    # batch size 1: one row per DP rank

(The flash backend registers as "tree_varlen": transformers treats any implementation name containing
"flash" as one of its own flash-attention kernels.) Transformers hands our function q [1, Hq, N, D] and k/v [1, Hkv, N, D] (GQA not expanded) plus every
extra forward kwarg; AttentionMaskInterface returns None for our names so it builds no dense mask.

Departures from the spec: the spec's only kernel is FA3 varlen; we add sdpa (flex has no CPU
backward in torch 2.13) and flex (what we could measure on an H200: 88% of the FLOP bound). Models
are refused at install, not at the first forward: non-attention layers (a recurrence would run
across samples), sliding windows and softcapping (no backend honours them), attention sinks,
attention dropout, and logits that are not lm_head(h) (final softcapping, Granite's logits_scaling,
Cohere's logit_scale: loss.py takes the hidden states and the LM head, so its ratios would be
biased). The spec supports Gated DeltaNet hybrids; we do not.
"""
import functools
import importlib

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

BACKENDS = ("sdpa", "flex", "flash")
_MISSING = "tree attention needs the row's kwargs: model(..., **tree_attention.row_kwargs(model, row))"


def _tree_sdpa(module, query, key, value, attention_mask, scaling=None, tree_mask=None, **_):
    if tree_mask is None:
        raise ValueError(_MISSING)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=tree_mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])   # [1, Hq, N, D]
    return out.transpose(1, 2).contiguous(), None                                      # [1, N, Hq, D]


_flex = torch.compile(flex_attention)   # compiled on first call; one recompile makes row length dynamic


def _tree_flex(module, query, key, value, attention_mask, scaling=None, tree_block_mask=None, **_):
    if tree_block_mask is None:
        raise ValueError(_MISSING)
    out = _flex(query, key, value, block_mask=tree_block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _flash_varlen():
    """flash_attn_varlen_func of FA3, else FA2, else None."""
    for name in ("flash_attn_interface", "flash_attn"):
        try:
            return importlib.import_module(name).flash_attn_varlen_func
        except ImportError:
            continue
    return None


def _tree_flash(module, query, key, value, attention_mask, scaling=None, tree_kv_index=None, tree_cu_seqlens_q=None,
                tree_cu_seqlens_k=None, tree_max_seqlen_q=None, tree_max_seqlen_k=None, **_):
    if tree_kv_index is None:
        raise ValueError(_MISSING)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))   # [N, H, D]
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)   # [K, Hkv, D]: paths
    out = _flash_varlen()(q, k, v, tree_cu_seqlens_q, tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k,
                          softmax_scale=scaling, causal=True)
    out = out[0] if isinstance(out, tuple) else out                # FA3 may also return the LSE
    return out.unsqueeze(0), None                                  # [1, N, Hq, D]


_IMPLS = {"sdpa": ("tree_sdpa", _tree_sdpa), "flex": ("tree_flex", _tree_flex), "flash": ("tree_varlen", _tree_flash)}
for _name, _fn in _IMPLS.values():
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, lambda *args, **kwargs: None)


def text_config(model):
    """The language model's config (a vision-language config's text_config; the config itself otherwise)."""
    return model.config.get_text_config()


def decoder_layers(model) -> torch.nn.ModuleList:
    """The language model's decoder layers, found by structure: the text decoder (transformers'
    get_decoder(): `model.model` of a causal LM, the language model of a vision-language model), then its
    `layers` list, else its one direct ModuleList child. A vision tower's blocks are never under it.

        Qwen3ForCausalLM                 -> model.model.layers
        Qwen3_5ForConditionalGeneration  -> model.model.language_model.layers   (not model.model.visual.blocks)
    """
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList)]
        if len(lists) != 1:
            raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: its text decoder "
                             f"{type(decoder).__name__} has no `layers` and {len(lists)} ModuleList children")
        layers = lists[0]
    return layers


def _refusals(model) -> list[str]:
    cfg = text_config(model)
    why = []
    if not model._can_set_attn_implementation():
        why.append("its attention does not go through transformers' AttentionInterface")
    other = sorted(set(getattr(cfg, "layer_types", None) or []) - {"full_attention"})
    if other:
        why.append(f"layer types {other}: only full_attention layers see exactly their own path in a trie")
    try:
        layers = decoder_layers(model)
    except ValueError:
        layers = None
    if layers is None or any(not hasattr(layer, "self_attn") for layer in layers):
        why.append("decoder layers without self_attn (non-attention layers would run across samples)")
    if any(getattr(m, "sliding_window", None) for m in model.modules()):
        why.append("sliding-window attention (no backend honours the window)")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        why.append("attention logit softcapping")
    if any(n.endswith("sinks") for n, _ in model.named_parameters()):
        why.append("attention sinks")
    if getattr(cfg, "attention_dropout", 0.0):
        why.append("attention_dropout > 0")
    for name, neutral in (("final_logit_softcapping", None), ("logits_scaling", 1.0), ("logit_scale", 1.0)):
        if getattr(cfg, name, neutral) not in (neutral, None):
            why.append(f"{name}={getattr(cfg, name)} (loss.py computes log-probs from lm_head(h) / temperature)")
    return why


def install(model, backend: str | None = None) -> str:
    """Switch `model` to tree attention; returns the backend (None: flex on CUDA, sdpa on CPU)."""
    why = _refusals(model)
    if why:
        raise ValueError(f"tree packing cannot train model_type={model.config.model_type!r}: " + "; ".join(why))
    device = next(model.parameters()).device
    backend = backend or ("flex" if device.type == "cuda" else "sdpa")
    if backend not in _IMPLS:
        raise ValueError(f"unknown tree attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "flash" and _flash_varlen() is None:
        raise RuntimeError("backend 'flash' needs a flash-attention kernel: neither flash_attn_interface (FA3) nor "
                           "flash_attn (FA2) can be imported; use backend 'flex' instead")
    model.set_attn_implementation(_IMPLS[backend][0])
    model.config.use_cache = False           # a KV cache would only hold every layer's K/V for nothing
    return backend


def row_kwargs(model, row) -> dict:
    """Extra forward kwargs for one packed row, on the model's device, for the installed backend."""
    backend = next((b for b, (name, _) in _IMPLS.items() if name == model.config._attn_implementation), None)
    if backend is None:
        raise ValueError("call tree_attention.install(model) first")
    device = next(model.parameters()).device
    end = row.subtree_end.to(device)                                # [N]
    if backend == "sdpa":
        i = torch.arange(len(end), device=device)
        return {"tree_mask": ((i[None, :] <= i[:, None]) & (i[:, None] <= end[None, :]))[None, None]}  # [1,1,N,N]
    if backend == "flex":
        def visible(b, h, q, kv):
            return (kv <= q) & (q <= end[kv])
        # compiled on CUDA (as transformers does): uncompiled it materialises all N² mask values at once
        return {"tree_block_mask": create_block_mask(visible, None, None, len(end), len(end), device=device,
                                                     _compile=device.type == "cuda")}
    return {"tree_kv_index": row.kv_index.to(device), "tree_cu_seqlens_q": row.cu_seqlens_q.to(device),
            "tree_cu_seqlens_k": row.cu_seqlens_k.to(device), "tree_max_seqlen_q": row.max_seqlen_q,
            "tree_max_seqlen_k": row.max_seqlen_k}
