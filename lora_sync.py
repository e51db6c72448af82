"""LoRA sync: only the adapter crosses to vLLM, through a shared file system (spec: LoRA; the adapter-sync
note, seeds/003: "アダプタを <output_dir>/.vllm_lora/trl-policy-v{N} に保存し、原子的なリネームで公開").

Chosen once at start, on rank 0, from every server's /server_info:

    every server has runtime LoRA, max_lora_rank >= r, max_loras >= max_staleness + 2,
    and the adapter is plain LoRA (no DoRA, no modules_to_save)   → AdapterSync
    otherwise                                                     → MergedSync, with the reason and the flags

AdapterSync, one sync to version N (max_staleness = 2, so 3 versions stay loaded):

    write  <output_dir>/.vllm_lora/.policy-v5.tmp/ → rename → policy-v5/     (atomic: vLLM never reads half)
    load   POST /v1/load_lora_adapter {"lora_name": "policy-v5", "lora_path": ...}   every replica, in parallel
    unload POST /v1/unload_lora_adapter policy-v2; delete policy-v2/                   loaded: v3 v4 v5
    rollouts started under version N request model="policy-vN" to the end (rollout.py, lora_name), so
    the oldest loaded version is one a rollout may still use: max_loras needs one spare for the switch.

MergedSync sends W + s·B·A (DoRA: rescaled to its magnitude vector) under the base model's names
through weight_sync.py, bucket by bucket, like a full sync; the sharded weights never change.

Departures: vLLM's LoRA routes need VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; the spec's name prefix is
trl-policy, ours is `policy`; several replicas are served without a proxy (every load goes to each).
"""
import os
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from weight_sync import SyncStats, WeightSync

PREFIX = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)    # vLLM's accepted --max-lora-rank values


def adapter_refusal(infos: list[dict], urls: list[str], peft_config, max_staleness: int) -> str | None:
    """Why adapter-only sync cannot run (None: it can): the first problem, with the fix."""
    if getattr(peft_config, "use_dora", False):
        return "DoRA adapters have no runtime-LoRA form in vLLM"
    if getattr(peft_config, "modules_to_save", None):
        return "modules_to_save trains whole modules, which an adapter load cannot carry"
    need_rank = next(r for r in LORA_RANKS if r >= peft_config.r)
    flags = (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora --max-lora-rank {need_rank} "
             f"--max-loras {max_staleness + 2}")
    for url, info in zip(urls, infos):
        lora = info.get("lora_config")
        if not lora:
            return f"{url} serves no LoRA adapters; restart it with {flags}"
        if lora.get("max_lora_rank", 0) < peft_config.r:
            return f"{url} has --max-lora-rank {lora.get('max_lora_rank')} < r={peft_config.r}; restart it with {flags}"
        if lora.get("max_loras", 0) < max_staleness + 2:
            return (f"{url} has --max-loras {lora.get('max_loras')} < max_staleness + 2 = {max_staleness + 2} (one "
                    f"slot per live policy version and one for the switch); restart it with {flags}")
    return None


def choose(policy, clients, config, peft_config, output_dir: str):
    """AdapterSync when every server allows it, else MergedSync; rank 0 decides and says why."""
    why = [None]
    if dist.get_rank() == 0:
        infos = [c.server_info() for c in clients]
        why = [adapter_refusal(infos, [c.base_url for c in clients], peft_config, config.max_staleness)]
        if why[0] is None:
            print(f"LoRA sync: adapter only ({PREFIX}-v<N> under {output_dir}/.vllm_lora/, "
                  f"{len(clients)} server(s))", flush=True)
        else:
            warnings.warn(f"LoRA sync: merged weights (the full model every sync), because {why[0]}", stacklevel=2)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(why, src=0)
    if why[0] is None:
        return AdapterSync(policy, clients, config, output_dir)
    return MergedSync(policy, clients, config)


def adapter_state(policy) -> dict[str, torch.Tensor]:
    """The trainable (adapter) tensors, gathered whole; every rank calls it, rank 0 keeps them."""
    out = {}
    for name, p in policy.model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if dist.get_rank() == 0:
                out[name] = t.detach().cpu()
    return out


class AdapterSync:
    """Adapter-only sync over disk and /v1/load_lora_adapter (state is real: the loaded window)."""

    def __init__(self, policy, clients, config, output_dir: str):
        from checkpoint import export_dtype
        self.policy, self.clients, self.config = policy, clients, config
        self.root = os.path.join(os.path.abspath(output_dir), ".vllm_lora")
        self.dtype = export_dtype(policy, config)
        self.loaded: list[int] = []                  # versions loaded on every server, oldest first

    def connect(self) -> None:
        if dist.get_rank() == 0:
            os.makedirs(self.root, exist_ok=True)

    def worker_kwargs(self) -> dict:
        return {"lora_name": PREFIX}

    def push(self, version: int) -> dict:
        start = time.perf_counter()
        state = adapter_state(self.policy)
        stats = SyncStats()
        if dist.get_rank() == 0:
            name = f"{PREFIX}-v{version}"
            final, tmp = os.path.join(self.root, name), os.path.join(self.root, f".{name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            state = {k: v.to(self.dtype) for k, v in state.items()}
            self.policy.model.save_pretrained(tmp, state_dict=state)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            stats.bytes = os.path.getsize(os.path.join(final, "adapter_model.safetensors"))
            t = time.perf_counter()
            self._each(lambda c: c.load_lora_adapter(name, final), f"loading {name}")
            self.loaded.append(version)
            while len(self.loaded) > self.config.max_staleness + 1:   # load the next before unloading the oldest
                old = f"{PREFIX}-v{self.loaded.pop(0)}"
                self._each(lambda c: c.unload_lora_adapter(old), f"unloading {old}")
                shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)
            stats.transfer_s = time.perf_counter() - t
        if dist.get_world_size() > 1:
            dist.barrier()
        stats.total_s = time.perf_counter() - start
        return stats.metrics()

    def _each(self, call, what: str) -> None:
        """Every replica, in parallel; a replica that fails stops the run, named (no silent divergence)."""
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(call, c) for c in self.clients]
            for c, f in zip(self.clients, futures):
                try:
                    f.result()
                except Exception as e:
                    raise RuntimeError(f"LoRA sync: {what} failed on {c.base_url}: {e}") from e


class MergedSync:
    """Merged-weight sync: W + s·B·A under the base names, through the weight-transfer API."""

    def __init__(self, policy, clients, config):
        self.policy, self.weights = policy, WeightSync(clients, config.vllm_server_timeout)
        self.plan = merge_plan(policy.model)

    def connect(self) -> None:
        self.weights.connect()

    def worker_kwargs(self) -> dict:
        return {}

    def push(self, version: int) -> dict:
        specs = [(name, base.shape) for name, base, _ in self.plan]
        return self.weights.push(specs, lambda: (merged(base, lora) for _, base, lora in self.plan), version).metrics()


def merge_plan(peft_model) -> list[tuple[str, torch.Tensor, tuple | None]]:
    """(base model name, base weight, LoRA parts or None) for every language-model tensor to send."""
    from peft.tuners.lora import LoraLayer
    from train import language_parameters
    adapter = peft_model.active_adapter
    layers = {name: m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    plan = []
    for name, p in language_parameters(peft_model):
        if "lora_" in name or ".original_module." in name:
            continue
        owner = name.rsplit(".", 2)[0] if ".base_layer." in name else None
        layer = layers.get(owner) if owner else None
        lora = None
        if layer is not None and name.endswith("base_layer.weight") and adapter in layer.lora_A:
            magnitude = layer.lora_magnitude_vector[adapter].weight if adapter in getattr(
                layer, "lora_magnitude_vector", {}) else None
            lora = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter], magnitude)
        clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        clean = clean.replace(f".modules_to_save.{adapter}.", ".")
        plan.append((clean, p, lora))
    return plan


def merged(base: torch.Tensor, lora: tuple | None) -> torch.Tensor:
    """W + s·B·A, or for DoRA m ⊙ (W + s·B·A) / ‖W + s·B·A‖ (norm of each output row); gathered whole."""
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
    w = whole(base)
    if lora is None:
        return w
    a, b, scale, magnitude = lora
    w = w.float() + scale * (whole(b).float() @ whole(a).float())        # [out, in]
    if magnitude is not None:
        w = w * (whole(magnitude).float() / w.norm(dim=1))[:, None]
    return w.to(base.dtype)


def adapter_bytes(model, peft_config, dtype=torch.bfloat16) -> tuple[int, int]:
    """(full weight bytes, adapter bytes) of `model` (meta device is fine) with `peft_config`'s targets."""
    from peft import get_peft_model
    full = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    adapted = get_peft_model(model, peft_config)
    lora = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) * dtype.itemsize
    return full, lora

