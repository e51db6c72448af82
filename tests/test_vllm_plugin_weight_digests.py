"""vllm_plugin/weight_digests.py, the worker extension, without vLLM installed: the fingerprint
both ends use (the worked example, exact integer sums on any implementation, CUDA equal to the
CPU, what it tells apart), and which rows of vLLM's fused layers hold an HF tensor (locate), with
and without the model's name mapper. The syncs it verifies: test_verify_sync.py."""
import os
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "vllm_plugin"))
import weight_digests  # noqa: E402
from weight_digests import _mixing, fingerprint  # noqa: E402


# ── the fingerprint ───────────────────────────────────────────────────────────────────────


def test_the_fingerprints_worked_example():
    """torch.ones(2) in fp32: bytes 00 00 80 3f twice, signed -128 at 2 and 6, 63 at 3 and 7."""
    m = _mixing("cpu").long()
    sums = (-128 * m[2] + 63 * m[3] - 128 * m[6] + 63 * m[7]).tolist()
    import hashlib
    assert fingerprint(torch.ones(2)) == hashlib.sha256(f"8:{sums}".encode()).hexdigest()


def reference(t: torch.Tensor) -> list[int]:
    """The fingerprint's sums F_j by its formula, in Python integers."""
    data = t.contiguous().view(-1).view(torch.int8).long()
    rows = torch.nn.functional.pad(data, (0, -len(data) % 1024)).view(-1, 1024)
    weight = torch.arange(len(rows)) % 4093 + 1
    return ((rows @ _mixing("cpu").long()) * weight[:, None]).sum(0).tolist()


@pytest.mark.parametrize("shape,dtype", [((3,), torch.float32), ((17, 1024), torch.int8),
                                         ((40, 1000), torch.bfloat16), ((5000, 7), torch.float16),
                                         ((33, 1024), torch.float32)])
def test_the_fingerprint_is_its_formula_exactly(shape, dtype):
    """Whole rows as views, a padded tail, a small tensor padded to 17 rows: the int8 GEMM's sums
    equal the formula's in exact integers (bytes at both extremes included)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8) if dtype == torch.int8 \
        else torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.int8:
        t.view(-1)[:2] = torch.tensor([-128, 127], dtype=torch.int8)
    import hashlib
    n = t.numel() * t.element_size()
    assert fingerprint(t) == hashlib.sha256(f"{n}:{reference(t)}".encode()).hexdigest()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fingerprint_on_cuda_equals_the_cpus():
    """The int8 GEMM on CUDA (cuBLASLt) and on the CPU: the same integer sums, bit for bit."""
    g = torch.Generator().manual_seed(1)
    for shape, dtype in [((4096, 2560), torch.bfloat16), ((3, 1001), torch.float32),
                         ((2560,), torch.bfloat16), ((17, 1024), torch.float16)]:
        t = torch.randn(shape, generator=g).to(dtype)
        assert fingerprint(t.cuda()) == fingerprint(t)


def test_the_fingerprint_tells_a_flipped_bit_a_swap_and_a_stale_tensor():
    t = torch.randn(64, 300)
    flipped = t.clone()
    flipped.view(torch.int32)[7, 9] ^= 1
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    assert len({fingerprint(x) for x in (t, flipped, swapped, t + 1e-3, t.bfloat16())}) == 5
    assert fingerprint(t) == fingerprint(t.clone().t().contiguous().t().contiguous())   # bytes


# ── locate: an HF name in vLLM's layers ───────────────────────────────────────────────────


class Layer(torch.nn.Module):
    """A vLLM linear layer as locate sees it: its fused output sizes (q, k, v or gate, up)."""

    def __init__(self, output_sizes=None):
        super().__init__()
        self.output_sizes = output_sizes


class Wrapped(torch.nn.Module):
    """vLLM's LoRA wrapper around a layer (--enable-lora): the layer is its base_layer."""

    def __init__(self, layer):
        super().__init__()
        self.base_layer = layer


class Mapper:
    """vLLM's WeightsMapper of Qwen2/3 (hf_to_vllm_mapper): ".k_proj" → (".qkv_proj", "k")."""
    stacked = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"),
               ".v_proj": (".qkv_proj", "v"), ".gate_proj": (".gate_up_proj", 0),
               ".up_proj": (".gate_up_proj", 1)}

    def apply(self, weights):
        for name, t in weights:
            for old, (new, shard) in self.stacked.items():
                if old in name:
                    name, t.shard_id = name.replace(old, new), shard
            yield name, t


def vllm_model(mapper: bool) -> torch.nn.Module:
    """The module tree of vLLM's Qwen3 (toy sizes), with or without the name mapper."""
    model = torch.nn.Module()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                    "gate_up_proj": ["gate_proj", "up_proj"]}
    if mapper:
        model.hf_to_vllm_mapper = Mapper()
    attn, mlp = torch.nn.Module(), torch.nn.Module()
    attn.qkv_proj, attn.o_proj = Wrapped(Layer([128, 64, 64])), Wrapped(Layer())
    mlp.gate_up_proj = Layer([256, 256])
    model.self_attn, model.mlp = attn, mlp
    return model


@pytest.mark.parametrize("mapper", [True, False])
def test_an_hf_name_is_found_in_the_rows_of_vllms_fused_layer(mapper):
    model = vllm_model(mapper)
    modules = dict(model.named_modules())

    def found(name):
        where = weight_digests.locate(model, modules, name)
        return where if isinstance(where, str) else (where[0], where[1], where[2])
    qkv, gate_up = model.self_attn.qkv_proj.base_layer, model.mlp.gate_up_proj
    assert found("self_attn.q_proj.weight") == (qkv, "weight", slice(0, 128))
    assert found("self_attn.k_proj.bias") == (qkv, "bias", slice(128, 192))
    assert found("self_attn.v_proj.weight") == (qkv, "weight", slice(192, 256))
    assert found("mlp.up_proj.weight") == (gate_up, "weight", slice(256, 512))
    assert found("self_attn.o_proj.weight") == (model.self_attn.o_proj.base_layer, "weight", None)
    assert found("self_attn.no_such.weight") == "no layer of vLLM's model holds it"
