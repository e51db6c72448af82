"""A `gloo` weight-transfer backend for real vLLM, so that full weight sync runs on a CPU (spec:
概要 (Overview: weight_sync_steps)).

vLLM ships no weight-transfer backend that runs without CUDA (nccl, ipc, sparse_nccl and nccl_m2n
need it, sharded_rdt needs Ray). This plugin, pip-installed into vLLM's environment, registers one:

    vllm serve MODEL --weight-transfer-config '{"backend":"gloo"}'     (VLLM_SERVER_DEV_MODE=1)

It speaks the protocol weight_sync.py speaks to local_vllm, so the trainer has one path:

    trainer (rank 0)                      this engine, in each vLLM worker
    POST /init_weight_transfer_engine ──► join TCPStore master_address:master_port, PrefixStore
                                          "weight_transfer", ProcessGroupGloo, rank rank_offset
    POST /start_weight_update ──────────► nothing yet: the model is untouched
    POST /update_weights {names, dtype_names, shapes}
                                      ──► check every name, shape and dtype against the checkpoint
                                          (refused: the buckets are received and dropped, so the
                                          trainer's broadcast ends, and the model keeps serving);
                                          then per bucket: broadcast ◄── uint8 [Σ bytes] →
                                          split; once all arrived: the reload starts and
                                          model.load_weights([(name, t), ...]) per bucket
    POST /finish_weight_update ─────────► finish the reload; re-pack the CPU GEMM's copies

The reload is vLLM's own lifecycle where the server has it (0.34: reload.start_reload /
finish_reload, which follow VLLM_RELOAD_MODE and mark weight_update_active()), else the layerwise
pair it wraps (0.32, 0.33: initialize_layerwise_reload / finalize_layerwise_reload).

Departures from vLLM's nccl engine, one line each:
- The check before the reload: vLLM's engines reload first and fail while loading, which leaves
  the layers on the meta device and kills the engine at its next forward (docs/vllm_cpu.md);
  a refused update is still received (and dropped), so the trainer's send never hangs.
- After an update every embedding-method layer is re-packed: on CPU, the tied lm_head keeps a
  packed copy of the OLD embedding, since it receives no weights (log-prob error 0.43 without).
- Every bucket is received before the reload starts (one host copy of the weights, briefly): a
  trainer killed mid-send would otherwise leave layers on meta and the server unable to generate.
- No `torch.accelerator.synchronize()` after a bucket: gloo is synchronous, and it raises on CPU.
- The fault switch (tests): ASYNC_GRPO_FAULT_NOISE=<HF tensor name>, read in each worker, adds
  noise to that received tensor before it is loaded (as local_vllm's engine does); off unless set.

weight_digests.py, in the same package, is the worker extension that shows what the model holds;
weight_packing.py the bucket plan and checkpoint shapes, which the trainer imports too.

The vLLM internals used, all in this file (written against vllm-cpu 0.32.0, the reload also
against 0.34's lifecycle): WeightTransferEngine and its parse_*_info, WeightTransferEngineFactory.
register_engine, reload's start_reload / finish_reload or initialize_layerwise_reload /
finalize_layerwise_reload, UnquantizedEmbeddingMethod.process_weights_after_loading.
"""
import inspect
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weight_group import weight_group
from weight_packing import buckets, checkpoint_shapes

try:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
except ImportError:      # outside vLLM's environment (our unit tests): the helpers only
    WeightTransferEngine = object

BACKEND = "gloo"
FAULT = "ASYNC_GRPO_FAULT_NOISE"     # the fault switch: a tensor name (local_vllm reads it too)
VLLM_VERSION = "0.32.0"             # the version these internals were read from
DEFAULT_TIMEOUT_S = 300.0           # a join or a bucket that waits longer fails


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every process at start."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


@dataclass
class GlooInitInfo:
    """init_info of POST /init_weight_transfer_engine (weight_sync.WeightSync.connect sends it)."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooUpdateInfo:
    """update_info of POST /update_weights: the tensors, in the order they are broadcast."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def fault_noise(t: torch.Tensor) -> torch.Tensor:
    """`t` corrupted, as the fault switch does (local_vllm.engine.fault_noise, the same noise):
    plus Gaussian noise of its mean magnitude, seed 0."""
    noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
    return t + noise.to(t.device, t.dtype) * t.abs().mean().clamp(min=1e-3)


def sizable(info: GlooUpdateInfo) -> bool:
    """Whether the buckets' sizes follow from `info` (so a refused update can still be received)."""
    return (len(info.names) == len(info.dtype_names) == len(info.shapes)
            and all(isinstance(getattr(torch, d, None), torch.dtype) for d in info.dtype_names))


def refusal(info: GlooUpdateInfo, expected: dict[str, list[int]] | None,
            dtype: torch.dtype) -> str | None:
    """Why an update must be refused before the model is touched (None: it is fine)."""
    if not len(info.names) == len(info.dtype_names) == len(info.shapes):
        return "names, dtype_names and shapes differ in length"
    wire = {getattr(torch, d, None) for d in info.dtype_names}
    if wire != {dtype}:
        return f"dtype_names {sorted(set(info.dtype_names))} are not the served dtype {dtype}"
    if expected is None:
        return None
    unknown = [n for n in info.names if n not in expected]
    wrong = [f"{n} {s} (served {expected[n]})" for n, s in zip(info.names, info.shapes)
             if n in expected and list(s) != expected[n]]
    if unknown or wrong:
        return f"unknown names {unknown[:10]}, wrong shapes {wrong[:10]}"
    return None


class GlooWeightTransferEngine(WeightTransferEngine):
    """The worker's end of the trainer's gloo group (state is real: the group, the session)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.info: GlooInitInfo | None = None
        self.reloading = False          # this session's layerwise reload has started
        self.expected = checkpoint_shapes(self.model_config.model)
        self.fault = os.environ.get(FAULT)      # the fault switch: None (off) or a tensor name

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = weight_group(init_info.master_address, init_info.master_port,
                                  init_info.world_size, rank, BACKEND, init_info.timeout_s)
        self.info = init_info

    def start_weight_update(self) -> None:
        self.reloading = False          # the reload starts once the first update is checked

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: "
                               "POST /init_weight_transfer_engine first")
        why = refusal(info, self.expected, self.model_config.dtype)
        if why is not None:
            if sizable(info):
                for _ in self._buckets(info):          # drop them: the trainer's send completes
                    pass
            raise ValueError(f"Weight update refused (received and dropped, the model is "
                             f"unchanged): {why}")
        received = list(self._buckets(info))      # all of it first: a trainer that dies
        if not self.reloading:                     # mid-send leaves the model as it was
            start_reload(self.model)
            self.reloading = True
        for pieces in received:
            self.model.load_weights([(n, fault_noise(t) if n == self.fault else t)
                                     for n, t in pieces])

    def _buckets(self, info: GlooUpdateInfo):
        """Each bucket the trainer broadcasts, as [(name, tensor), ...] in the declared order."""
        dtypes = [getattr(torch, d) for d in info.dtype_names]
        sizes = [math.prod(s) * d.itemsize for d, s in zip(dtypes, info.shapes)]
        plan = (buckets(sizes, self.info.packed_buffer_size_bytes) if self.info.packed
                else [range(i, i + 1) for i in range(len(sizes))])
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for chunk in plan:
            flat = torch.empty(sum(sizes[i] for i in chunk), dtype=torch.uint8)   # [Σ bytes]
            self.group.broadcast([flat], opts).wait()
            pieces, offset = [], 0
            for i in chunk:
                raw = flat[offset:offset + sizes[i]].clone()          # clone: aligned for view
                pieces.append((info.names[i], raw.view(dtypes[i]).reshape(info.shapes[i])))
                offset += sizes[i]
            yield pieces

    def finish_weight_update(self) -> None:
        if not self.reloading:
            return
        finish_reload(self.model, self.model_config, self.device)
        self.reloading = False
        _repack_embeddings(self.model)

    def shutdown(self) -> None:
        self.group = None


def start_reload(model: torch.nn.Module) -> None:
    """vLLM's reload of `model` begins: 0.34's lifecycle call where this vLLM has it, else the
    layerwise one of 0.32 and 0.33 (which 0.34's wraps)."""
    from vllm.model_executor.model_loader import reload
    if hasattr(reload, "start_reload"):
        reload.start_reload(model)
    else:
        reload.initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config, device) -> None:
    """vLLM's reload of `model` ends (its post-load processing runs): 0.34's lifecycle call where
    this vLLM has it (given the device where its signature asks for one), else 0.32 and 0.33's
    layerwise one."""
    from vllm.model_executor.model_loader import reload
    if not hasattr(reload, "finish_reload"):
        reload.finalize_layerwise_reload(model, model_config)
    elif "device" in inspect.signature(reload.finish_reload).parameters:
        reload.finish_reload(model, model_config, device)
    else:
        reload.finish_reload(model, model_config)


def _repack_embeddings(model: torch.nn.Module) -> None:
    """Re-run the embedding method's post-load step on every embedding and LM head: on CPU it
    re-packs the GEMM's copy from the current weight (a tied head shares the embedding's
    storage, which the reload updated in place)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and module.weight.numel():
            method.process_weights_after_loading(module)
