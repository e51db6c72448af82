"""LoRA (LoRA adapters) and the adapter-sync note (seeds/003, アダプタだけを同期する仕組み: how
only the adapter is synced): "アダプタを <output_dir>/.vllm_lora/trl-policy-v{N} に保存し、
原子的なリネームで公開" (save the adapter there, publish it by an atomic rename), then the path goes
to /v1/load_lora_adapter. Chosen once at start, on rank 0, from every server's /server_info:

    every server has runtime LoRA, max_lora_rank >= r, max_loras >= max_staleness + 2,
    and the adapter is plain LoRA (no DoRA, no modules_to_save) → AdapterSync
    otherwise                                                  → MergedSync, with why and the flags

AdapterSync of run 3f9a1c, one sync to version 5 with max_staleness = 2 (3 versions stay loaded):

    write   .vllm_lora/.policy-3f9a1c-v5.tmp/ → rename → policy-3f9a1c-v5/    atomic: vLLM never
                                                                              reads half of one
    load    POST /v1/load_lora_adapter {"lora_name": "policy-3f9a1c-v5", "lora_path": ...}  every
    unload  POST /v1/unload_lora_adapter policy-3f9a1c-v2; delete its dir     replica; loaded: v3-5
    end     unload (and delete) v3 v4 v5: a long-lived server keeps no name of a finished run
    A rollout started under version N requests model="policy-<run>-vN" to its end (rollout/loop.py,
    lora_name), so the oldest loaded version may still be in use: max_loras needs a spare slot.

MergedSync is a weight_sync.FullSync of W + s·B·A (merged()) under the base model's names.

Departures from the spec, one line each:
- Adapters are named policy-<run>-v{N} (spec: trl-policy-v{N}): vLLM keeps a name registered until
  it is unloaded, so a second run (or a crashed one) against the same server never collides.
- Several replicas are served without a proxy: each load and unload goes to each (TRL refuses that).
"""
import os
import secrets
import shutil
import time
import warnings

import torch
import torch.distributed as dist

from weight_sync import FullSync, Members, SyncStats, full_tensor, language_parameters

PREFIX = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)    # vLLM's accepted --max-lora-rank values


def max_lora_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that serves an adapter of rank r (r=4 → 8)."""
    return next(rank for rank in LORA_RANKS if rank >= r)


def adapter_dp_refusal(url: str, info: dict) -> str | None:
    """Why adapter-only sync cannot run against this server's data parallelism (None: it can):
    a runtime adapter load reaches one data-parallel engine, and the others would keep sampling
    from an older policy."""
    dp = (info.get("parallel_config") or {}).get("data_parallel_size") or 1
    if dp <= 1:
        return None
    return (f"{url} runs --data-parallel-size {dp}, and a runtime adapter load does not reach "
            "every data-parallel engine; restart it with --data-parallel-size 1 and list each "
            "replica's URL in vllm_server_base_url instead")


def adapter_refusal(infos: list[dict], urls: list[str], peft_config,
                    max_staleness: int) -> str | None:
    """Why adapter-only sync cannot run (None: it can): the first problem, with the fix."""
    if getattr(peft_config, "use_dora", False):
        return "DoRA adapters have no runtime-LoRA form in vLLM"
    if getattr(peft_config, "modules_to_save", None):
        return "modules_to_save trains whole modules, which an adapter load cannot carry"
    slots = max_staleness + 2              # one per live policy version, and one for the switch
    flags = (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora "
             f"--max-lora-rank {max_lora_rank(peft_config.r)} --max-loras {slots}")
    for url, info in zip(urls, infos):
        if why := adapter_dp_refusal(url, info):
            return why
        lora = info.get("lora_config")
        if not lora:
            return f"{url} serves no LoRA adapters; restart it with {flags}"
        if lora.get("max_lora_rank", 0) < peft_config.r:
            return (f"{url} has --max-lora-rank {lora.get('max_lora_rank')} < r={peft_config.r}; "
                    f"restart it with {flags}")
        if lora.get("max_loras", 0) < slots:
            return (f"{url} has --max-loras {lora.get('max_loras')} < max_staleness + 2 = {slots} "
                    f"(one slot per live policy version and one for the switch); "
                    f"restart it with {flags}")
    return None


def choose(policy, clients, config, peft_config, output_dir: str):
    """AdapterSync when every server allows it, else MergedSync; rank 0 decides and says why."""
    why = [None]
    if dist.get_rank() == 0:
        infos = [c.server_info() for c in clients]
        urls = [c.base_url for c in clients]
        why = [adapter_refusal(infos, urls, peft_config, config.max_staleness)]
        if why[0] is None:
            print(f"LoRA sync: adapter only ({PREFIX}-<run>-v<N> under {output_dir}/.vllm_lora/, "
                  f"{len(clients)} server(s))", flush=True)
        else:
            warnings.warn(f"LoRA sync: merged weights (the full model every sync), "
                          f"because {why[0]}", stacklevel=2)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(why, src=0)
    if why[0] is None:
        return AdapterSync(policy, clients, config, output_dir)
    return MergedSync(policy, clients, config)


# ── adapter only ────────────────────────────────────────────────────────────────────────────


def adapter_state(policy) -> dict[str, torch.Tensor]:
    """The trainable (adapter) tensors, gathered whole; every rank calls it, rank 0 keeps them."""
    out = {}
    for name, p in policy.model.named_parameters():
        if p.requires_grad:
            whole = full_tensor(p)
            if dist.get_rank() == 0:
                out[name] = whole.cpu()
    return out


class AdapterSync:
    """Adapter-only sync over disk and /v1/load_lora_adapter (state is real: the loaded window)."""

    def __init__(self, policy, clients, config, output_dir: str):
        self.policy = policy
        self.clients = clients
        self.members = Members(clients, config.vllm_server_timeout, "LoRA sync")
        self.config = config
        self.root = os.path.join(os.path.abspath(output_dir), ".vllm_lora")
        self.prefix = f"{PREFIX}-{secrets.token_hex(3)}"    # this run's names: policy-<run>-v<N>
        self.dtype = config.export_dtype(next(policy.parameters()))   # the checkpoint's dtype
        self.loaded: list[int] = []                    # versions loaded on every server, oldest 1st

    def connect(self) -> None:
        if dist.get_rank() == 0:
            os.makedirs(self.root, exist_ok=True)

    def worker_kwargs(self) -> dict:
        """RolloutWorker arguments: rollouts request model="policy-<run>-v<their version>"."""
        return {"lora_name": self.prefix}

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        state = adapter_state(self.policy)
        stats = SyncStats()
        if dist.get_rank() == 0:
            name = f"{self.prefix}-v{version}"
            final = os.path.join(self.root, name)
            tmp = os.path.join(self.root, f".{name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            state = {k: v.to(self.dtype) for k, v in state.items()}
            self.policy.model.save_pretrained(tmp, state_dict=state)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            stats.bytes = os.path.getsize(os.path.join(final, "adapter_model.safetensors"))
            t = time.perf_counter()
            self.members.returning()           # back since the last sync: it gets this adapter
            self._each(lambda c: c.load_lora_adapter(name, final), f"loading {name}")
            self.loaded.append(version)
            while len(self.loaded) > self.config.max_staleness + 1:    # the new one is in: unload
                self._unload(self.loaded.pop(0))
            stats.transfer_s = time.perf_counter() - t
        if dist.get_world_size() > 1:
            dist.barrier()
        stats.total_s = time.perf_counter() - start
        return stats.metrics()

    def start(self, version: int) -> None:
        """Every rank, before generation starts: a resumed run loads its saved adapter; a fresh one
        generates from the base model, so rank 0 warns when a server's base weights were replaced
        by an earlier full sync (its weight_version is no longer "default")."""
        if version > 0:
            self.push(version)
        elif dist.get_rank() == 0:
            for c in self.clients:
                if (held := c.weight_info()) != "default":
                    warnings.warn(f"LoRA sync: {c.base_url} serves base weights of an earlier "
                                  f"full sync (weight_version {held!r}), not its checkpoint: "
                                  f"adapters apply to those; restart it to train on the "
                                  f"checkpoint", stacklevel=2)

    def _unload(self, version: int) -> None:
        old = f"{self.prefix}-v{version}"
        self._each(lambda c: c.unload_lora_adapter(old), f"unloading {old}")
        shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def close(self) -> None:
        """Rank 0, at the end of the run (also after a failure): unload this run's adapters from
        every server that still answers; a server that does not is warned about, not waited for."""
        if dist.get_rank() != 0:
            return
        for version in self.loaded:
            try:
                self._unload(version)
            except RuntimeError as e:
                warnings.warn(str(e), stacklevel=2)
        self.loaded = []

    def _each(self, call, what: str) -> None:
        """Every live replica, in parallel; one that stopped answering is taken out (Members), one
        that answers and fails stops the run, named (no silent divergence)."""
        try:
            self.members.call(call)
        except RuntimeError as e:
            raise RuntimeError(f"{what}: {e}") from e


# ── merged ──────────────────────────────────────────────────────────────────────────────────


class MergedSync(FullSync):
    """A full sync of the merged weights W + s·B·A under the base names; the shards never change."""

    def __init__(self, policy, clients, config):
        super().__init__(policy, clients, config)
        self.plan = merge_plan(policy.model)

    def specs(self) -> list[tuple[str, torch.Size]]:
        return [(name, base.shape) for name, base, _ in self.plan]

    def push(self, version: int) -> dict[str, float]:
        stats = self.weights.push(
            self.specs(), lambda: (merged(base, lora) for _, base, lora in self.plan), version)
        return stats.metrics()


def merge_plan(peft_model) -> list[tuple[str, torch.Tensor, tuple | None]]:
    """(base model name, base weight, LoRA parts or None) for every language-model tensor to send.
    Names lose PEFT's wrapping: base_model.model.x.base_layer.weight → x.weight."""
    from peft.tuners.lora import LoraLayer
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
            magnitudes = getattr(layer, "lora_magnitude_vector", {})
            magnitude = magnitudes[adapter].weight if adapter in magnitudes else None
            lora = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                    layer.scaling[adapter], magnitude)
        clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        clean = clean.replace(f".modules_to_save.{adapter}.", ".")
        plan.append((clean, p, lora))
    return plan


def merged(base: torch.Tensor, lora: tuple | None) -> torch.Tensor:
    """W + s·B·A, or for DoRA m ⊙ (W + s·B·A) / ‖W + s·B·A‖ (the norm of each output row); gathered
    whole."""
    w = full_tensor(base)
    if lora is None:
        return w
    a, b, scale, magnitude = lora
    w = w.float() + scale * (full_tensor(b).float() @ full_tensor(a).float())        # [out, in]
    if magnitude is not None:
        w = w * (full_tensor(magnitude).float() / w.norm(dim=1))[:, None]
    return w.to(base.dtype)


def adapter_bytes(model, peft_config, dtype=torch.bfloat16) -> tuple[int, int]:
    """(full weight bytes, adapter bytes) of `model` (meta device is fine) with `peft_config`'s
    targets."""
    from peft import get_peft_model
    full = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    adapted = get_peft_model(model, peft_config)
    lora = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) * dtype.itemsize
    return full, lora
