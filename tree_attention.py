"""Attention over a packed trie row (spec: ツリーパッキング (Tree packing), steps 3-4, "Packed row"
and "Attention"; AMD GPU: the flash kernel of each GPU). Gated DeltaNet layers are
tree_gated_delta_rule.py's; install() and row_kwargs() bring them in, so a caller sees one API.

A packed row (trie_pack.PackedRow) lays out unique tokens in DFS pre-order, so the ancestors of a
token are exactly the earlier tokens whose subtree still contains it:

    idx           0  1 | 2  3  4 | 5  6  7     query i sees kv j  iff  j <= i <= subtree_end[j]
    input_ids    p1 p2 | p3 a1 a2 | p3 b1 b2
    subtree_end   7  7 |  4  4  4 |  7  7  7              kv: 0 1 2 3 4 5 6 7
                                                   q 5 (p3):  ■ ■ · · · ■ · ·   p1 p2, itself
                                                   q 7 (b2):  ■ ■ · · · ■ ■ ■   never a1 a2

Sliding windows count along each token's own path: kv j stays visible to query i only while
position_ids[i] - position_ids[j] < window (depth = position). Attention logit softcapping
(Gemma 2) is softcap·tanh(score / softcap), before the mask. Three backends compute it:

    backend  how                                                    used for
    sdpa     a dense [N, N] boolean mask; softcapped layers eager   the exact reference (CPU)
    flex     flex_attention, a BlockMask of the rule (+ score_mod)  CUDA, where flash cannot
    flash    per segment, K/V gathered along its path; varlen call  the CUDA default (the spec's)

    install(model, device=device)   # choose_backend: flash on CUDA (flex where flash cannot),
                                    # sdpa on CPU; refuses what a backend cannot compute exactly
    out = forward_row(model, row)   # batch size 1 (one row per DP rank), masks from row_kwargs

Mixed precision: FSDP2 casts each layer's kwargs, rebuilding dicts and dataclasses from their
items: the lazily built masks ride in a function, passed as is (a dict would reach each layer as
a new dict of the masks built so far); flash's and tree_gdn's are ints.

Departures from the spec, one line each:
- sdpa (flex has no CPU backward in torch 2.13) and flex (88% of the FLOP bound on an H200) too.
- install() refuses, with every reason, what a backend cannot compute exactly: see _refusals.
- Final logit softcapping (Gemma 2) is loss.py's: the trainer passes final_logit_softcapping.
"""
import functools
import importlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import tree_gated_delta_rule as gdn

BACKENDS = ("sdpa", "flex", "flash")
_MISSING = ("tree attention needs the row's kwargs: "
            "model(..., **tree_attention.row_kwargs(model, row))")


# ── the attention functions transformers calls: q [1, Hq, N, D], k/v [1, Hkv, N, D] ──────────────

# (GQA not expanded), plus every extra forward kwarg (sliding_window and softcap per layer).

def _eager_softcapped(query, key, value, mask, scale, softcap):
    """Attention with scores softcap·tanh(s / softcap) (Gemma 2), which SDPA cannot do.
    [1, Hq, N, D]"""
    rep = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(rep, 1)                                          # [1, Hq, N, D]
    value = value.repeat_interleave(rep, 1)                                      # [1, Hq, N, D]
    scores = (query @ key.transpose(-1, -2)) * scale                             # [1, Hq, N, N]
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(query.dtype) @ value


def _tree_sdpa(module, query, key, value, attention_mask, scaling=None, sliding_window=None,
               softcap=None, tree_masks=None, **_):
    if tree_masks is None:
        raise ValueError(_MISSING)
    mask = tree_masks(sliding_window)                                            # [1, 1, N, N]
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        scale = scaling or query.shape[-1] ** -0.5
        out = _eager_softcapped(query, key, value, mask, scale, softcap)
    return out.transpose(1, 2).contiguous(), None                                # [1, N, Hq, D]


_flex = torch.compile(flex_attention)   # compiled on first call; one recompile makes N dynamic


@functools.cache
def _softcap_mod(softcap: float):
    """A flex score_mod, one function object per value (a new closure per call would recompile)."""
    def score_mod(score, b, h, q, kv):
        return torch.tanh(score / softcap) * softcap
    return score_mod


def _tree_flex(module, query, key, value, attention_mask, scaling=None, sliding_window=None,
               softcap=None, tree_block_masks=None, **_):
    if tree_block_masks is None:
        raise ValueError(_MISSING)
    out = _flex(query, key, value, block_mask=tree_block_masks(sliding_window), scale=scaling,
                score_mod=None if softcap is None else _softcap_mod(softcap),
                enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None                                # [1, N, Hq, D]


# ── flash: a varlen kernel from the `kernels` hub library, else an installed flash-attn ──────────

@dataclass
class FlashKernel:
    name: str               # hub repo or package it came from
    varlen: object          # flash_attn_varlen_func
    params: frozenset       # its keyword names (FA4's differ from FA2/FA3's)
    window: bool            # honours window_size
    softcap: bool           # honours softcap

    @classmethod
    def of(cls, name: str, varlen) -> "FlashKernel":
        """What a varlen function from `name` honours, read from its signature."""
        params = frozenset(inspect.signature(varlen).parameters)
        softcap = "softcap" in params and name not in _NO_SOFTCAP
        return cls(name, varlen, params, "window_size" in params, softcap)


_HUB_VERSIONS = {"kernels-community/flash-attn3": 1, "kernels-community/flash-attn4": 0,
                 "kernels-community/aiter-flash-attn": 2}
# the spec (AMD GPU): no softcapping on these
_NO_SOFTCAP = ("kernels-community/flash-attn4", "kernels-community/aiter-flash-attn")


def hub_kernel_repo(rocm: bool, capability: tuple[int, int]) -> str:
    """The spec's kernel for a device: aiter on ROCm, flash-attn4 on Blackwell (10.x), else
    flash-attn3."""
    if rocm:
        return "kernels-community/aiter-flash-attn"
    if capability[0] == 10:
        return "kernels-community/flash-attn4"
    return "kernels-community/flash-attn3"


@functools.cache
def flash_kernel() -> FlashKernel:
    """The spec's hub kernel through `kernels`, else flash_attn_interface (FA3) or flash_attn (FA2);
    a RuntimeError naming what was tried when none loads."""
    tried = []
    if not torch.cuda.is_available():
        tried.append("hub kernels: no CUDA/ROCm device")
    else:
        repo = hub_kernel_repo(torch.version.hip is not None, torch.cuda.get_device_capability())
        try:
            kernels = importlib.import_module("kernels")
            hub = kernels.get_kernel(repo, version=_HUB_VERSIONS[repo])
            return FlashKernel.of(repo, hub.flash_attn_varlen_func)
        except ImportError:
            tried.append(f"{repo}: the `kernels` library is not installed "
                         "(pip install -r requirements-gpu.txt)")
        except Exception as e:  # noqa: BLE001  no hub access, no build for this GPU/torch, ...
            tried.append(f"{repo} through `kernels`: {type(e).__name__}: {e}")
    for package in ("flash_attn_interface", "flash_attn"):
        try:
            return FlashKernel.of(package, importlib.import_module(package).flash_attn_varlen_func)
        except (ImportError, AttributeError) as e:
            tried.append(f"{package}: {e}")
    raise RuntimeError("backend 'flash' needs a flash-attention varlen kernel and none loads: "
                       + "; ".join(tried) + ". Use backend 'flex' instead.")


def _tree_flash(module, query, key, value, attention_mask, scaling=None, sliding_window=None,
                softcap=None, tree_kv_index=None, tree_cu_seqlens_q=None, tree_cu_seqlens_k=None,
                tree_max_seqlen_q=None, tree_max_seqlen_k=None, **_):
    """The spec's path: per segment, K/V gathered along its root-to-segment path (kv_index), one
    varlen flash-attention call with causal=True.

    Flash aligns the causal mask bottom-right when a segment has fewer queries than keys, so
    segment S2 = [p3 b1 b2] with keys [p1 p2 | p3 b1 b2] sees its ancestors and its own causal
    past; a path index is a depth, so window_size=(window-1, 0) is the path window. The kernel is
    flash_kernel()'s: the spec's hub kernel (flash-attn3; flash-attn4 on Blackwell;
    aiter-flash-attn on ROCm), else an installed flash_attn_interface (FA3) or flash_attn (FA2).
    """
    if tree_kv_index is None:
        raise ValueError(_MISSING)
    kernel = flash_kernel()
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))               # [N, H, D]
    k = k.index_select(0, tree_kv_index)                                        # [K, Hkv, D] paths
    v = v.index_select(0, tree_kv_index)                                        # [K, Hkv, D]
    kw = dict(cu_seqlens_q=tree_cu_seqlens_q, cu_seqlens_k=tree_cu_seqlens_k,
              max_seqlen_q=tree_max_seqlen_q, max_seqlen_k=tree_max_seqlen_k,
              softmax_scale=scaling, causal=True)
    if sliding_window is not None:      # a path index is a depth: the window counts along the path
        kw["window_size"] = (sliding_window - 1, 0)
    if softcap is not None:
        kw["softcap"] = softcap
    out = kernel.varlen(q, k, v, **{n: x for n, x in kw.items() if n in kernel.params})
    out = out[0] if isinstance(out, tuple) else out                # FA3 may also return the LSE
    return out.unsqueeze(0), None                                  # [1, N, Hq, D]


# The flash backend registers as "tree_varlen": transformers treats any implementation name that
# contains "flash" as one of its own kernels. AttentionMaskInterface returns None for our names,
# so transformers builds no dense mask of its own.
_IMPLS = {"sdpa": ("tree_sdpa", _tree_sdpa), "flex": ("tree_flex", _tree_flex),
          "flash": ("tree_varlen", _tree_flash)}
for _name, _fn in _IMPLS.values():
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, lambda *args, **kwargs: None)


# ── the model: its language model's layers and config, and what it asks of tree packing ──────────

def text_config(model):
    """The language model's config (a vision-language config's text_config; else the config)."""
    return model.config.get_text_config()


def decoder_layers(model) -> torch.nn.ModuleList:
    """The language model's decoder layers, found by structure: the text decoder (transformers'
    get_decoder(): `model.model` of a causal LM, the language model of a vision-language model),
    then its `layers` list, else its one direct ModuleList child. A vision tower's blocks are
    never under it.

        Qwen3ForCausalLM                 -> model.model.layers
        Qwen3_5ForConditionalGeneration  -> model.model.language_model.layers
                                            (not model.model.visual.blocks)
    """
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList)]
        if len(lists) != 1:
            raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: its text "
                             f"decoder {type(decoder).__name__} has no `layers` and {len(lists)} "
                             "ModuleList children")
        layers = lists[0]
    return layers


def _windows(cfg) -> bool:
    """Whether any attention layer slides a window: per layer (sliding_attention types, Gemma 2/3,
    Qwen) or model-wide (Mistral's config.sliding_window, passed by every layer)."""
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return "sliding_attention" in types and getattr(cfg, "sliding_window", None) is not None
    if getattr(cfg, "use_sliding_window", True) is False:
        return False
    return bool(getattr(cfg, "sliding_window", None))


def _refusals(model, backend: str, kernel=None) -> list[str]:
    """Every reason this backend cannot compute the model exactly (empty: it can): attention
    outside AttentionInterface; layer types other than full, sliding and linear attention (e.g.
    chunked); non-attention layers other than Gated DeltaNet; attention sinks; attention dropout;
    logits that are not lm_head(h) (Granite's logits_scaling, Cohere's logit_scale); and, on
    flash, a window or softcap its kernel lacks (softcapping on flash-attn4 and aiter, the spec;
    `kernel`: a FlashKernel, default flash_kernel())."""
    cfg = text_config(model)
    why = []
    if not model._can_set_attn_implementation():
        why.append("its attention does not go through transformers' AttentionInterface")
    other = sorted(set(getattr(cfg, "layer_types", None) or [])
                   - {"full_attention", "sliding_attention", "linear_attention"})
    if other:
        why.append(f"layer types {other}: only full, sliding-window and Gated DeltaNet layers are "
                   "tree-packed")
    try:
        layers = decoder_layers(model)
    except ValueError as e:
        layers = []
        why.append(str(e))
    mixers = [x for x in layers if not hasattr(x, "self_attn")]
    deltanets = gdn.gated_deltanet_layers(layers)
    if len(mixers) != len(deltanets):
        why.append("non-attention decoder layers other than Gated DeltaNet "
                   "(they would run across samples)")
    elif deltanets and (reason := gdn.unsupported(deltanets)):
        why.append(reason)
    if backend == "flash":
        kernel = kernel or flash_kernel()
        if _windows(cfg) and not kernel.window:
            why.append(f"sliding-window attention: the flash kernel {kernel.name} has no "
                       "window_size; use 'flex'")
        if getattr(cfg, "attn_logit_softcapping", None) is not None and not kernel.softcap:
            why.append(f"attention logit softcapping: the flash kernel {kernel.name} does not "
                       "support it (the spec: not on AMD or Blackwell GPUs); use 'flex'")
    if any(n.endswith("sinks") for n, _ in model.named_parameters()):
        why.append("attention sinks")
    if getattr(cfg, "attention_dropout", 0.0):
        why.append("attention_dropout > 0")
    for name, neutral in (("logits_scaling", 1.0), ("logit_scale", 1.0)):
        if getattr(cfg, name, neutral) not in (neutral, None):
            why.append(f"{name}={getattr(cfg, name)} "
                       "(loss.py computes log-probs from lm_head(h) / temperature)")
    return why


# ── the API: install once, then forward rows ─────────────────────────────────────────────────────

def choose_backend(model, device: torch.device, requested: str | None = None,
                   kernel=None) -> tuple[str, str]:
    """(backend, why) for training `model` on `device`: the one requested (tree_attention_backend);
    on a CPU sdpa, the exact reference (flex has no CPU backward in torch 2.13); on CUDA or ROCm
    the spec's flash kernel (`kernel`, default flash_kernel: flash-attn3, flash-attn4 on
    Blackwell, aiter on AMD, through `kernels`), or flex where none loads or the kernel refuses
    the model. Worked, on an
    H100 for Gemma 2 (attention softcapping): flash-attn3 supports it → "flash"; on a B200,
    flash-attn4 does not (the spec) → ("flex", "kernels-community/flash-attn4 cannot: ...")."""
    if requested is not None:
        return requested, "tree_attention_backend"
    if device.type != "cuda":
        return "sdpa", f"{device.type}: the exact dense-mask reference"
    try:
        loaded = (kernel or flash_kernel)()
    except RuntimeError as e:
        return "flex", str(e)
    flash_only = [w for w in _refusals(model, "flash", loaded) if w not in _refusals(model, "flex")]
    if flash_only:
        return "flex", f"{loaded.name} cannot: " + "; ".join(flash_only)
    return "flash", f"the spec's kernel, {loaded.name}"


def install(model, backend: str | None = None, device: torch.device | None = None) -> str:
    """Switch `model` to tree attention (and its Gated DeltaNet layers to the tree rule); returns
    the backend (None: choose_backend's for `device`, default the weights' device). Refuses, with
    every reason, what the backend cannot compute exactly."""
    device = device or next(model.parameters()).device
    backend = backend or choose_backend(model, device)[0]
    if backend not in _IMPLS:
        raise ValueError(f"unknown tree attention backend {backend!r}; choose one of {BACKENDS}")
    why = _refusals(model, backend)
    if why:
        raise ValueError(f"tree packing ({backend}) cannot train "
                         f"model_type={model.config.model_type!r}: " + "; ".join(why))
    gdn.install(gdn.gated_deltanet_layers(decoder_layers(model)))
    model.set_attn_implementation(_IMPLS[backend][0])
    model.config.use_cache = False           # a KV cache would hold every layer's K/V for nothing
    return backend


def forward_row(model, row, module=None, **kwargs):
    """One packed row through `module` (default: the whole model; the trainer passes the decoder,
    so the LM head is left to loss.py) with the row's tree masks: batch size 1, positions are trie
    depths. kwargs go to the forward and take precedence over row_kwargs' (e.g. tree_gdn=None)."""
    device = model.get_input_embeddings().weight.device
    return (module or model)(input_ids=row.input_ids[None].to(device),           # [1, N]
                             position_ids=row.position_ids[None].to(device),     # [1, N]
                             use_cache=False, **{**row_kwargs(model, row), **kwargs})


def row_kwargs(model, row) -> dict:
    """Extra forward kwargs for one packed row, on the model's device, for the installed backend
    (and the Gated DeltaNet layout when the model has such layers)."""
    implementation = model.config._attn_implementation
    backend = next((b for b, (name, _) in _IMPLS.items() if name == implementation), None)
    if backend is None:
        raise ValueError("call tree_attention.install(model) first")
    device = next(model.parameters()).device
    end = row.subtree_end.to(device)                                            # [N]
    pos = row.position_ids.to(device)                                           # [N] depth
    out = {}
    deltanets = gdn.gated_deltanet_layers(decoder_layers(model))
    if deltanets:
        out["tree_gdn"] = gdn.layout(row, deltanets[0].conv_kernel_size, device)
    if backend == "sdpa":
        i = torch.arange(len(end), device=device)
        tree = (i[None, :] <= i[:, None]) & (i[:, None] <= end[None, :])        # [N, N] i sees j

        def dense_mask(window):                                                 # [1, 1, N, N]
            if window is None:
                return tree[None, None]
            near = pos[:, None] - pos[None, :] < window                         # [N, N] on the path
            return (tree & near)[None, None]
        out["tree_masks"] = functools.cache(dense_mask)    # window -> mask, built once per row
    elif backend == "flex":
        def block_mask(window):
            def visible(b, h, q, kv):
                seen = (kv <= q) & (q <= end[kv])
                return seen if window is None else seen & (pos[q] - pos[kv] < window)
            # compiled on CUDA (as transformers does): uncompiled it materialises all N² values
            return create_block_mask(visible, None, None, len(end), len(end), device=device,
                                     _compile=device.type == "cuda")
        out["tree_block_masks"] = functools.cache(block_mask)
    else:
        out.update(tree_kv_index=row.kv_index.to(device),
                   tree_cu_seqlens_q=row.cu_seqlens_q.to(device),
                   tree_cu_seqlens_k=row.cu_seqlens_k.to(device),
                   tree_max_seqlen_q=row.max_seqlen_q, tree_max_seqlen_k=row.max_seqlen_k)
    return out
