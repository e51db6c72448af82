"""The linear-attention layers of Qwen3.5, Qwen3.6 and Qwen3-Next over a packed trie row (spec:
ツリーパッキング (Tree packing), "Gated DeltaNetハイブリッド" (Gated DeltaNet hybrids)). The convolution
reads each token's own predecessors; the chunked delta rule starts each segment from its parent's
final state. (AMD GPU: nothing of its own here; fla's kernel where installed, else torch.)

Such a layer is a recurrence: its output at a token depends on every earlier token of the sample,
through a short causal convolution (kernel K = 4) and a recurrent state S [H, Dk, Dv]. In a packed
trie the earlier tokens of a sample are its path, not the earlier packed positions. Two rollouts
of one prompt, as trie_pack.py packs them:

    idx          0  1 | 2  3  4 | 5  6  7     segments  S0 [0 1]  S1 [2 3 4]  S2 [5 6 7]
    input_ids   p1 p2 | p3 a1 a2 | p3 b1 b2   parents   S1 <- S0,  S2 <- S0  (from kv_index)

    convolution (layout): each segment after its K-1 path predecessors, one causal convolution
      extended   · · · 0 1 | · 0 1 2 3 4 | · 0 1 5 6 7     · a zero slot; digits: idx read
      kept             0 1 |       2 3 4 |       5 6 7     the outputs at the segment's tokens
    delta rule (_rule_dispatcher), level by level of the segment tree:
      level 0    S0 from zeros
      level 1    S1 and S2, each from S0's final state

    install(modules)                  # dispatchers in the layers' modeling files (idempotent)
    tree_gdn = layout(row, K, device) # passed as a forward kwarg by tree_attention.row_kwargs

Departures from the spec, one line each:
- None in what is computed.
- Without fla on CUDA the torch reference runs segment by segment: slow (CPU and tests).
- The causal convolution kernel is whatever transformers resolved (causal-conv1d or torch).
"""
import importlib.util
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_NAMES = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")


@dataclass
class GDNLevel:
    """The segments at one depth of the segment tree (s of them, n tokens)."""
    index: torch.Tensor          # [n] int64  packed positions of the segments' tokens, end to end
    cu_seqlens: torch.Tensor     # [s+1] int64 segment boundaries in index
    segments: list[int]          # [s] segment ids
    parents: list[int]           # [s] parent segment ids (-1: a root; all roots are level 0)


@dataclass
class GDNLayout:
    """What the dispatchers need for one packed row: N tokens, S segments, E extended slots."""
    conv_index: torch.Tensor     # [E] int64 packed position each extended slot reads; N: zeros
    conv_keep: torch.Tensor      # [N] int64 extended slot of each packed token
    levels: list[GDNLevel]
    unlevel: torch.Tensor        # [N] int64 position of each packed token in the levels, end to end


def gated_deltanet_layers(layers) -> list:
    """The Gated DeltaNet modules (`linear_attn`) among decoder layers."""
    return [layer.linear_attn for layer in layers
            if type(getattr(layer, "linear_attn", None)).__name__.endswith("GatedDeltaNet")]


def unsupported(modules) -> str | None:
    """Why these Gated DeltaNet modules cannot be tree-packed (None: they can)."""
    for m in modules:
        mod = sys.modules[type(m).__module__]
        if not all(callable(getattr(mod, name, None)) for name in _NAMES):
            return (f"{type(m).__name__} does not call module-level {' / '.join(_NAMES)} "
                    "(tree-packed Gated DeltaNet needs transformers >= 5.15)")
    if len({m.conv_kernel_size for m in modules}) > 1:
        return "Gated DeltaNet layers with different convolution kernel sizes"
    return None


def install(modules) -> None:
    """Route the modeling files' conv and delta-rule functions through the tree dispatchers
    (idempotent).

    transformers (>= 5.15) calls the module-level functions `causal_conv1d_fn` and
    `torch_chunk_gated_delta_rule` of the model's modeling file, passing every forward kwarg
    through. Both are replaced by dispatchers that take the tree path when the row's `tree_gdn`
    kwarg (a GDNLayout) is present and call the original otherwise: other models stay as they were.
    """
    for m in modules:
        mod = sys.modules[type(m).__module__]
        if not hasattr(mod.causal_conv1d_fn, "tree_original"):
            mod.causal_conv1d_fn = _conv_dispatcher(mod.causal_conv1d_fn)
        if not hasattr(mod.torch_chunk_gated_delta_rule, "tree_original"):
            mod.torch_chunk_gated_delta_rule = _rule_dispatcher(mod.torch_chunk_gated_delta_rule)


def layout(row, kernel_size: int, device) -> GDNLayout:
    """The GDNLayout of a trie_pack.PackedRow (the module docstring's example).

    Segments are leveled by depth in the segment tree (parents come first in DFS order). For the
    convolution each segment is laid out after its K-1 path predecessors (zeros above the root),
    so one ordinary causal convolution over the extended sequence never crosses into another
    segment: a segment's outputs read only its own slots.
    """
    cu_q = row.cu_seqlens_q.cpu().numpy().astype(np.int64)     # [S+1] (a row may be on the GPU)
    cu_k = row.cu_seqlens_k.cpu().numpy().astype(np.int64)     # [S+1]
    kv = row.kv_index.cpu().numpy()                             # [K]
    S = len(cu_q) - 1                                           # segments
    N = int(cu_q[-1])                                           # packed tokens
    pad = kernel_size - 1                                       # predecessor slots per segment
    n = np.diff(cu_q)                                           # [S] segment lengths
    depth0 = np.diff(cu_k) - n                                  # [S] depth of a first token
    parent = np.full(S, -1, np.int64)
    has = depth0 > 0
    last = kv[cu_k[:-1][has] + depth0[has] - 1]                 # the token just above each non-root
    parent[has] = np.searchsorted(cu_q, last, side="right") - 1
    if not np.array_equal(cu_q[parent[has] + 1] - 1, last):
        raise ValueError("packed row: a segment hangs below a token that does not end its segment")
    level = np.zeros(S, np.int64)
    for s in np.flatnonzero(has):                               # parents come first in DFS order
        level[s] = level[parent[s]] + 1

    j = np.arange(pad)                                          # [K-1] predecessor slots
    above = depth0[:, None] - pad + j[None, :]                  # [S, K-1] path depth of each slot
    ext_pre = np.where(above >= 0, kv[np.clip(cu_k[:-1, None] + above, 0, len(kv) - 1)], N)
    seg_of = np.repeat(np.arange(S), n)                         # [N]
    keep = np.arange(N) + (seg_of + 1) * pad                    # [N] slot of each packed token
    conv_index = np.full(N + S * pad, N, np.int64)
    conv_index[keep] = np.arange(N)
    conv_index[(cu_q[:-1] + np.arange(S) * pad)[:, None] + j[None, :]] = ext_pre

    def as_index(a):                                            # numpy -> int64 tensor
        return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)

    token_level = level[seg_of]                                 # [N]
    levels = []
    for lv in range(int(level.max()) + 1):
        segs = np.flatnonzero(level == lv)
        index = np.flatnonzero(token_level == lv)               # its segments' tokens, in order
        cu_seqlens = np.r_[0, np.cumsum(n[segs])]
        levels.append(GDNLevel(as_index(index), as_index(cu_seqlens), segs.tolist(),
                               parent[segs].tolist()))
    unlevel = np.empty(N, np.int64)         # the inverse of the levels' indices laid end to end
    unlevel[np.argsort(token_level, kind="stable")] = np.arange(N)
    return GDNLayout(as_index(conv_index), as_index(keep), levels, as_index(unlevel))


def _conv_dispatcher(original):
    """causal_conv1d_fn that, given tree_gdn, convolves the extended sequence (GDNLayout.conv_index)
    and keeps each packed token's output (conv_keep)."""
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, tree_gdn=None,
                         **kwargs):
        if tree_gdn is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        x = F.pad(hidden_states, (0, 1))                            # [1, C, N+1] slot N is zero
        extended = x.index_select(2, tree_gdn.conv_index)           # [1, C, E]
        out = original(extended, weight, bias, activation=activation, **kwargs)   # [1, C, E]
        return out.index_select(2, tree_gdn.conv_keep)              # [1, C, N]
    causal_conv1d_fn.tree_original = original
    return causal_conv1d_fn


def _rule_dispatcher(original):
    """torch_chunk_gated_delta_rule that, given tree_gdn, runs the segments level by level: every
    segment of a level starts from its parent's final state S, the roots from zeros. With fla on
    CUDA a level is one varlen call (cu_seqlens, one initial state per segment); otherwise
    transformers' torch reference runs segment by segment."""
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, tree_gdn=None, **kwargs):
        if tree_gdn is None:
            return original(query, key, value, g=g, beta=beta, **kwargs)
        initial_state = kwargs.pop("initial_state", None)
        output_final_state = kwargs.pop("output_final_state", False)
        cu_seqlens = kwargs.pop("cu_seqlens", None)
        if initial_state is not None or output_final_state or cu_seqlens is not None:
            raise ValueError("a tree-packed row runs without a cache and without cu_seqlens")
        varlen = query.device.type == "cuda" and importlib.util.find_spec("fla") is not None
        outs = []
        final = {}                                              # segment -> [H, Dk, Dv] state
        for lv in tree_gdn.levels:
            # [1, n, H, .] each
            q, k, v, gl, bl = (x.index_select(1, lv.index) for x in (query, key, value, g, beta))
            # [s, H, Dk, Dv] initial states: the parents' final states (a root level has none)
            h0 = torch.stack([final[p] for p in lv.parents]) if lv.parents[0] >= 0 else None
            if varlen:                                          # fla, through transformers
                o, ht = original(q, k, v, g=gl, beta=bl, initial_state=h0, output_final_state=True,
                                 cu_seqlens=lv.cu_seqlens, **kwargs)
                final.update(zip(lv.segments, ht))
            else:                                               # the torch reference, by segment
                o = []
                for i, (s, a, b) in enumerate(zip(lv.segments, lv.cu_seqlens[:-1].tolist(),
                                                  lv.cu_seqlens[1:].tolist())):
                    oi, ht = original(q[:, a:b], k[:, a:b], v[:, a:b], g=gl[:, a:b],
                                      beta=bl[:, a:b],
                                      initial_state=None if h0 is None else h0[i:i + 1],
                                      output_final_state=True, **kwargs)
                    o.append(oi)
                    final[s] = ht[0]
                o = torch.cat(o, 1)
            outs.append(o)                                      # [1, n, H, Dv]
        return torch.cat(outs, 1).index_select(1, tree_gdn.unlevel), None     # [1, N, H, Dv]
    torch_chunk_gated_delta_rule.tree_original = original
    return torch_chunk_gated_delta_rule
