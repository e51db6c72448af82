"""LoRA (LoRA adapters) and the adapter-sync note (seeds/003, アダプタだけを同期する仕組み: how
only the adapter is synced): "アダプタを <output_dir>/.vllm_lora/trl-policy-v{N} に保存し、
原子的なリネームで公開" (save the adapter there, publish it by an atomic rename), then the path goes
to /v1/load_lora_adapter. Chosen once at start, on rank 0, from every server's /server_info:

    every server has runtime LoRA, max_lora_rank >= r (and rank_pattern's), max_loras >=
    max_staleness + 2, and vLLM loads the adapter (vllm_refusal: no DoRA, lora_bias,
    modules_to_save...)                                     → AdapterSync
    otherwise                                               → MergedSync, with why and the flags

AdapterSync of run 3f9a1c, one sync to version 5 with max_staleness = 2 (3 versions stay loaded):

    write   .vllm_lora/.policy-3f9a1c-v5.tmp/ → rename → policy-3f9a1c-v5/    atomic: vLLM never
                                                                              reads half of one
    load    POST /v1/load_lora_adapter {"lora_name": "policy-3f9a1c-v5", "lora_path": ...}  every
    probe   a completion under policy-3f9a1c-v5 gives the trainer's log-probs  replica; loaded:
            (verify_sync.py; else loaded again, then the replica is taken out) v3-5
    unload  POST /v1/unload_lora_adapter policy-3f9a1c-v2; delete its dir
    end     unload (and delete) v3 v4 v5: a long-lived server keeps no name of a finished run
    A rollout started under version N requests model="policy-<run>-vN" to its end (rollout/loop.py,
    lora_name), so the oldest loaded version may still be in use: max_loras needs a spare slot.

MergedSync is a weight_sync.FullSync of W + s·B·A (merged()) under the base model's names, as
peft's merge_and_unload() merges it: the bias of lora_B too (lora_bias), GPT-2's transposed
Conv1D weights (fan_in_fan_out), DoRA; what it cannot merge is refused at start (merge_plan).

Departures from the spec, one line each:
- Adapters are named policy-<run>-v{N} (spec: trl-policy-v{N}): vLLM keeps a name registered until
  it is unloaded, so a second run (or a crashed one) against the same server never collides.
- Several replicas are served without a proxy: each load and unload goes to each (TRL refuses that).
"""
import dataclasses
import fcntl
import os
import secrets
import shutil
import time
import warnings
from typing import Iterator

import torch
import torch.distributed as dist

from verify_sync import Reference, base_card, probe_refusal, served_dtype, tolerance
from vllm_client import VLLMError
from weight_sync import (FullSync, Members, SyncStats, full_tensor, gathered, language_parameters,
                         on_rank0)

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


VLLM_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")   # init_lora_weights it loads


def adapter_rank(peft_config) -> int:
    """The largest rank of any adapted module, which --max-lora-rank must hold: r, or a larger one
    of rank_pattern (r=8, rank_pattern={"q_proj": 16} → 16; vLLM checks the same maximum)."""
    return max([peft_config.r, *(peft_config.rank_pattern or {}).values()])


def vllm_refusal(peft_config) -> str | None:
    """Why vLLM cannot serve this adapter as a runtime LoRA (None: it can). The features vLLM
    0.32's loader refuses (vllm/lora/peft_helper.py, PEFTHelper._validate_features), checked on
    the LoraConfig before anything is saved, then peft's other variants (fields peft tags
    is_lora_variant), which vLLM does not read and would serve as plain LoRA, wrongly.
    rslora, rank_pattern and alpha_pattern load (PEFTHelper.get_rank_and_scaling), and so does
    fan_in_fan_out: lora_A and lora_B keep nn.Linear's [r, in] and [out, r] layout either way."""
    def given(field: str):
        """The field's value, None where this peft (>= 0.17) predates the field."""
        return getattr(peft_config, field, None)

    init, bias = given("init_lora_weights"), given("bias") or "none"
    refused = [
        (given("use_dora"), "DoRA adapters have no runtime-LoRA form in vLLM"),
        (given("lora_bias"), "vLLM refuses adapters with lora_bias (a bias on lora_B)"),
        (given("modules_to_save"),
         "modules_to_save trains whole modules, which an adapter load cannot carry"),
        (bias != "none", f"vLLM refuses adapters that train base biases (bias={bias!r})"),
        (isinstance(init, str) and init.lower() not in VLLM_INITS,
         f"init_lora_weights={init!r} changes the base weights, which an adapter load cannot "
         "carry"),
        (given("alora_invocation_tokens"),
         "vLLM does not serve activated LoRA (alora_invocation_tokens)"),
        (given("layer_replication"), "vLLM does not serve layer_replication"),
        (given("use_bdlora"), "vLLM does not serve block-diagonal LoRA (use_bdlora)"),
        (given("use_qalora"), "vLLM does not serve QALoRA (use_qalora)"),
    ]
    refused += [(given(f.name), f"vLLM would serve {f.name} as plain LoRA, which it is not")
                for f in dataclasses.fields(peft_config) if f.metadata.get("is_lora_variant")]
    return next((why for bad, why in refused if bad), None)


def adapter_refusal(infos: list[dict], urls: list[str], peft_config,
                    max_staleness: int) -> str | None:
    """Why adapter-only sync cannot run (None: it can): the first problem, with the fix."""
    if why := vllm_refusal(peft_config):
        return why
    rank = adapter_rank(peft_config)
    slots = max_staleness + 2              # one per live policy version, and one for the switch
    flags = (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora "
             f"--max-lora-rank {max_lora_rank(rank)} --max-loras {slots}")
    for url, info in zip(urls, infos):
        if why := adapter_dp_refusal(url, info):
            return why
        lora = info.get("lora_config")
        if not lora:
            return f"{url} serves no LoRA adapters; restart it with {flags}"
        if lora.get("max_lora_rank", 0) < rank:
            return (f"{url} has --max-lora-rank {lora.get('max_lora_rank')} < rank {rank}; "
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
    """Adapter-only sync over disk and /v1/load_lora_adapter (state is real: the loaded window).
    Every load is proven by a probe (verify_sync.py): the trainer's log-probs come from rank 0's
    CPU copy of the policy (verify_sync.Reference: gathered once, the base frozen, each sync's
    adapter swapped in), not from the FSDP2 shards, so only rank 0 takes part and the other ranks
    wait at the sync's end. weight_sync_verify_every=0: no probe, and no copy."""

    def __init__(self, policy, clients, config, output_dir: str):
        self.policy = policy
        self.clients = clients
        self.members = Members(clients, config.vllm_server_timeout, "LoRA sync")
        self.config = config
        self.root = os.path.join(os.path.abspath(output_dir), ".vllm_lora")
        self.prefix = f"{PREFIX}-{secrets.token_hex(3)}"    # this run's names: policy-<run>-v<N>
        self.dtype = config.export_dtype(next(policy.parameters()))   # the checkpoint's dtype
        self.loaded: list[int] = []                    # versions loaded on every server, oldest 1st
        self.dtypes: dict[str, str | None] = {}        # rank 0: base_url → its served dtype
        self.reference: Reference | None = None        # rank 0: the policy on its CPU, once built
        self.built = False                             # every rank: the reference was gathered
        every = config.weight_sync_verify_every
        self.verify = every is None or every > 0       # probes (0: off, and no Reference)

    def connect(self) -> None:
        """Rank 0: the adapters' directory, and each server's dtype (the probe's tolerance)."""
        if dist.get_rank() == 0:
            self.lock = own_adapters(self.root, self.prefix)   # and a killed run's removed
            self.dtypes = {c.base_url: served_dtype(c.server_info()) for c in self.clients}

    def worker_kwargs(self) -> dict:
        """RolloutWorker arguments: rollouts request model="policy-<run>-v<their version>"."""
        return {"lora_name": self.prefix}

    def push(self, version: int) -> dict[str, float]:
        """Every rank: gather the adapter; rank 0 publishes it (_publish); an error there is
        raised on every rank together."""
        start = time.perf_counter()
        self._reference()
        state = adapter_state(self.policy)
        stats = SyncStats()
        on_rank0(lambda: self._publish(version, state, stats))
        stats.total_s = time.perf_counter() - start
        return stats.metrics()

    def _publish(self, version: int, state: dict[str, torch.Tensor], stats: SyncStats) -> None:
        """Rank 0: write the adapter (atomically), load it on every live replica, prove each load
        (_verify), then unload the version that left the staleness window."""
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
        self.members.returning()               # back since the last sync: it gets this adapter
        self._each(lambda c: c.load_lora_adapter(name, final), f"loading {name}")
        verify = time.perf_counter()
        if self.verify:
            self._verify(name, final, state)
        stats.verify_s = time.perf_counter() - verify
        self.loaded.append(version)
        while len(self.loaded) > self.config.max_staleness + 1:        # the new one is in: unload
            self._unload(self.loaded.pop(0))
        stats.transfer_s = time.perf_counter() - t - stats.verify_s

    def _verify(self, name: str, path: str, state: dict[str, torch.Tensor]) -> None:
        """Rank 0: each live replica's probe under `name` must give the trainer's log-probs and
        not the base's (verify_sync.probe_refusal). One that does not is sent the adapter once
        more (loaded in place) and probed again; then it is taken out (Members), or, if it is the
        last one, the sync raises."""
        self.reference.load(state)
        refusals: dict[str, str | None] = {}

        def probe(c) -> None:
            found = self.reference.probe(c, name, adapter=True)
            tol = tolerance(self.dtypes.get(c.base_url))
            refusals[c.base_url] = probe_refusal(found, name, tol)

        def again(c) -> None:
            if refusals.get(c.base_url):
                c.load_lora_adapter(name, path, load_inplace=True)
                probe(c)
        self._each(probe, f"probing {name}")
        self._each(again, f"loading {name} again")
        failed = [(c, why) for c in self.members.live if (why := refusals.get(c.base_url))]
        self.members.take_out_failed(failed, f"failed the probe of {name}, loaded twice,",
                                     f"LoRA sync: {name} did not load as trained, loaded twice")
        for c, _ in failed:                 # out of routing too (rollout.servers.drop_unverified)
            try:
                unload(c, name)
            except (VLLMError, TimeoutError) as e:     # out of the syncs already: said, not raised
                warnings.warn(f"LoRA sync: {c.base_url} keeps {name} loaded ({e}): the rollout "
                              f"process may still generate from it", stacklevel=2)

    def _reference(self) -> None:
        """Every rank, once: gather the policy (base and adapter) into rank 0's Reference."""
        if self.verify and not self.built:
            dtype = next((d for d in self.dtypes.values() if d), "float32")
            self.reference = Reference.build(self.policy.model, gathered(self.policy.model), dtype)
            self.built = True

    def start(self, version: int) -> None:
        """Every rank, before generation starts: the start probe compares each server's base model
        with the trainer's (the adapter switched off), and one that serves another base stops the
        run with a ValueError before any rollout: an adapter cannot fix its base. Then a resumed
        run loads its saved adapter; a fresh one generates from the base model."""
        if self.verify:
            self._reference()
            on_rank0(self._check_bases)
        if version > 0:
            self.push(version)

    def _check_bases(self) -> None:
        """Rank 0: ValueError naming the first server whose base model's log-probs on the probe are
        farther from the trainer's base than its dtype's tolerance."""
        for c in self.clients:
            tol = tolerance(self.dtypes.get(c.base_url))
            gap = self.reference.probe(c, base_card(c), base=True).gap
            if gap > tol:
                source = getattr(self.policy.model.config, "_name_or_path", "")
                raise ValueError(f"LoRA sync: {c.base_url} serves another base model than the "
                                 f"trained one: on the start probe its log-probs differ from the "
                                 f"trainer's base model's by up to {gap:.3g} (max |Δ log p|; "
                                 f"tolerance {tol:g}), and an adapter cannot fix the base: serve "
                                 f"the checkpoint the trainer loads ({source})")

    def _unload(self, version: int) -> None:
        old = f"{self.prefix}-v{version}"
        self._each(lambda c: unload(c, old), f"unloading {old}")
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


def unload(client, name: str) -> None:
    """Unload adapter `name`; one the server does not hold is fine (a 404: a replica back since
    it was loaded never had it, or its failed probe unloaded it)."""
    try:
        client.unload_lora_adapter(name)
    except VLLMError as e:
        if e.status != 404:
            raise


# ── merged ──────────────────────────────────────────────────────────────────────────────────


class MergedSync(FullSync):
    """A full sync of the merged weights W + s·B·A under the base names; the shards never change."""

    def __init__(self, policy, clients, config):
        super().__init__(policy, clients, config)
        self.plan = merge_plan(policy.model)

    def specs(self) -> list[tuple[str, torch.Size]]:
        return [(name, base.shape) for name, base, _ in self.plan]

    def tensors(self) -> Iterator[torch.Tensor]:
        return (merged(base, delta) for _, base, delta in self.plan)


@dataclasses.dataclass
class Delta:
    """What peft's merge adds to one base tensor (peft/tuners/lora/layer.py, Linear.merge and
    get_delta_weight; DoraLinearVariant.merge_safe for DoRA).

        weight: W + s·B·A, with W read as [out, in] (fan_in_fan_out: GPT-2's Conv1D stores
                [in, out], so peft transposes the delta); DoRA scales each output row to m / ‖row‖
        bias:   b + s·lora_B.bias (lora_bias; a = None)
    """
    a: torch.Tensor | None                 # lora_A.weight [r, in]; None for a bias
    b: torch.Tensor                        # lora_B.weight [out, r], or lora_B.bias [out]
    scale: float                           # layer.scaling[adapter]: per module (rslora, patterns)
    magnitude: torch.Tensor | None = None  # DoRA's m [out]
    fan_in_fan_out: bool = False           # the base weight is stored [in, out]


def merge_plan(peft_model) -> list[tuple[str, torch.Tensor, Delta | None]]:
    """(base model name, base tensor, what peft's merge adds to it or None) for every language-
    model tensor to send. Names lose peft's wrapping: base_model.model.x.base_layer.weight →
    x.weight, x.modules_to_save.<adapter>.weight → x.weight (x.original_module.* is not sent).
    The scale is each layer's own, so rslora (alpha / √r), rank_pattern and alpha_pattern hold.
    A layer merge_refusal refuses stops the run here, at start, in one line."""
    from peft.tuners.lora import LoraLayer
    adapter = peft_model.active_adapter
    layers = {}
    for name, m in peft_model.named_modules():
        if isinstance(m, LoraLayer) and any(adapter in getattr(m, part)
                                            for part in m.adapter_layer_names):
            if why := merge_refusal(m, adapter):
                raise ValueError(f"merged LoRA sync cannot merge {name}: {why}; adapt Linear "
                                 f"layers with plain LoRA or DoRA, lora_bias only where the "
                                 f"layer has a bias")
            layers[name] = m
    plan = []
    for name, p in language_parameters(peft_model):
        if "lora_" in name or ".original_module." in name:
            continue
        owner, _, kind = name.rpartition(".base_layer.")
        layer = layers.get(owner)
        delta = None
        if layer is not None and kind == "weight":
            magnitudes = getattr(layer, "lora_magnitude_vector", {})
            delta = Delta(layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                          layer.scaling[adapter],
                          magnitudes[adapter].weight if adapter in magnitudes else None,
                          layer.fan_in_fan_out)
        elif layer is not None and kind == "bias" and layer.lora_bias[adapter]:
            delta = Delta(None, layer.lora_B[adapter].bias, layer.scaling[adapter])
        clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        clean = clean.replace(f".modules_to_save.{adapter}.", ".")
        plan.append((clean, p, delta))
    return plan


def merge_refusal(layer, adapter: str) -> str | None:
    """Why merged() cannot give peft's merge of this LoRA layer (None: it can): it merges peft's
    Linear (over nn.Linear or Conv1D) with plain LoRA or DoRA, not an embedding, a convolution
    or target_parameters, nor another variant; lora_bias needs a base bias (peft's merge raises
    "Impossible to merge LoRA with `lora_bias=True`" without one)."""
    from peft.tuners.lora import Linear
    from peft.tuners.lora.variants import DoraLinearVariant
    if not isinstance(layer, Linear):
        return f"a {type(layer).__name__} layer, not peft's Linear"
    variant = layer.lora_variant.get(adapter)
    if variant is not None and not isinstance(variant, DoraLinearVariant):
        return f"the {type(variant).__name__}, which has no W + s·B·A merge"
    if layer.lora_bias[adapter] and layer.get_base_layer().bias is None:
        return "lora_bias on a layer without a bias"
    return None


def merged(base: torch.Tensor, delta: Delta | None) -> torch.Tensor:
    """The base tensor with peft's merge applied (Delta), computed in fp32 and returned in the base
    dtype; gathered whole (every rank calls it). A Conv1D weight W [in, out] of GPT-2:
    (Wᵀ + s·B·A)ᵀ, since B·A is [out, in]."""
    w = full_tensor(base)
    if delta is None:
        return w
    b = full_tensor(delta.b).float()
    if delta.a is None:
        return (w.float() + delta.scale * b).to(base.dtype)
    w = w.float().T if delta.fan_in_fan_out else w.float()                           # [out, in]
    w = w + delta.scale * (b @ full_tensor(delta.a).float())
    if delta.magnitude is not None:
        w = w * (full_tensor(delta.magnitude).float() / w.norm(dim=1))[:, None]
    return (w.T if delta.fan_in_fan_out else w).to(base.dtype)


def adapter_bytes(model, peft_config, dtype=torch.bfloat16) -> tuple[int, int]:
    """(full weight bytes, adapter bytes) of `model` (meta device is fine) with `peft_config`'s
    targets."""
    from peft import get_peft_model
    full = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    adapted = get_peft_model(model, peft_config)
    lora = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) * dtype.itemsize
    return full, lora


def own_adapters(root: str, prefix: str):
    """Rank 0 at start: hold <root>.locks/<prefix> for as long as this run lives (an flock, which
    the kernel releases when the process dies, however it dies), and remove from root what every
    run whose lock no one holds left there (its adapters: a killed run's), and its lock file.
    Returns the open lock file."""
    locks = root + ".locks"
    os.makedirs(root, exist_ok=True)
    os.makedirs(locks, exist_ok=True)
    held = open(os.path.join(locks, prefix), "w")
    fcntl.flock(held, fcntl.LOCK_EX)
    live = set()
    for name in os.listdir(locks):
        with open(os.path.join(locks, name), "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.remove(os.path.join(locks, name))          # its run is gone
            except BlockingIOError:
                live.add(name)
    for name in os.listdir(root):                     # policy-<run>-vN, .policy-<run>-vN.tmp
        if name.lstrip(".").removesuffix(".tmp").rsplit("-v", 1)[0] not in live:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return held
