"""LoRA (LoRA adapters) and the adapter-sync note (docs/lora_adapter_sync.md, アダプタだけを同期する仕組み: how
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
    probe   a completion under policy-3f9a1c-v5 shows the trained adapter,    replica; loaded:
            not the base nor v4 (verify_sync.refusal; else loaded again,     v3-5
            then the replica is taken out)
    unload  POST /v1/unload_lora_adapter policy-3f9a1c-v2; delete its dir
    end     unload (and delete) v3 v4 v5: a long-lived server keeps no name of a finished run
    A rollout started under version N requests model="policy-<run>-vN" to its end (rollout/loop.py,
    lora_name), so the oldest loaded version may still be in use: max_loras needs a spare slot.

At start the servers' base must be the trainer's: with weight transfer (--weight-transfer-config
beside --enable-lora, as the spec starts vLLM) the base weights are sent once, as a full sync
would; without, a server whose base differs on the start probe is refused.

MergedSync is a weight_sync.FullSync of W + s·B·A (merged()) under the base model's names, as
peft's merge_and_unload() merges it: the bias of lora_B too (lora_bias), GPT-2's transposed
Conv1D weights (fan_in_fan_out), DoRA; what it cannot merge is refused at start (merge_plan).

Departures from the spec, one line each:
- Adapters are named policy-<run>-v{N} (spec: trl-policy-v{N}): vLLM keeps a name registered until
  it is unloaded, so a second run (or a crashed one) against the same server never collides.
- Several replicas are served without a proxy: each load and unload goes to each (TRL refuses that).
"""
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import time
from typing import Iterator

import torch
import torch.distributed as dist

from checkpoint import exported
from verify_sync import BASE_KL, NOISE_FLOOR, PROBE_TOKENS, base_card, refusal, served_dtype
from vllm_client import VLLMError
from weight_sync import (FAILED, FullSync, Members, SyncStats, ask, full_tensor,
                         language_parameters, on_rank0, parity, probe, shared)

PREFIX = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)    # vLLM's accepted --max-lora-rank values

log = logging.getLogger(__name__)


def max_lora_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that serves an adapter of rank r (r=4 → 8)."""
    return next(rank for rank in LORA_RANKS if rank >= r)


VLLM_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")   # init_lora_weights it loads
VLLM_REFUSES = {                                   # LoraConfig fields whose adapter vLLM refuses
    "use_dora": "DoRA adapters have no runtime-LoRA form in vLLM",
    "lora_bias": "vLLM refuses adapters with lora_bias (a bias on lora_B)",
    "modules_to_save": "modules_to_save trains whole modules, which an adapter load cannot carry",
    "alora_invocation_tokens": "vLLM does not serve activated LoRA (alora_invocation_tokens)",
    "layer_replication": "vLLM does not serve layer_replication",
    "use_bdlora": "vLLM does not serve block-diagonal LoRA (use_bdlora)",
    "use_qalora": "vLLM does not serve QALoRA (use_qalora)"}


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
    refused = [(given(f), why) for f, why in VLLM_REFUSES.items()] + [
        (bias != "none", f"vLLM refuses adapters that train base biases (bias={bias!r})"),
        (isinstance(init, str) and init.lower() not in VLLM_INITS,
         f"init_lora_weights={init!r} changes the base weights, which an adapter load cannot "
         "carry")]
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
        dp = (info.get("parallel_config") or {}).get("data_parallel_size") or 1
        if dp > 1:              # a runtime load reaches one engine; the others would lag behind
            return (f"{url} runs --data-parallel-size {dp}, and a runtime adapter load does not "
                    "reach every data-parallel engine; restart it with --data-parallel-size 1 "
                    "and list each replica's URL in vllm_server_base_url instead")
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
    why = None
    if dist.get_rank() == 0:
        infos = [c.server_info() for c in clients]
        why = adapter_refusal(infos, [c.base_url for c in clients], peft_config,
                              config.max_staleness)
        if why is None:
            log.info("LoRA sync: adapter only (%s-<run>-v<N> under %s/.vllm_lora/, %d server(s))",
                     PREFIX, output_dir, len(clients))
        else:
            log.warning("LoRA sync: merged weights (the full model every sync), because %s", why)
    if shared(why) is None:
        return AdapterSync(policy, clients, config, output_dir)
    return MergedSync(policy, clients, config)


# ── adapter only ────────────────────────────────────────────────────────────────────────────


@contextlib.contextmanager
def swapped(params: list[torch.Tensor], values: list[torch.Tensor] | None = None):
    """`params` hold `values` (None: zeros) inside the block, their own after it (every rank: its
    shards). An adapter of zeros is the base model exactly: base + 0 (peft's disable_adapter also
    marks the adapter frozen, which FSDP2, initialised in the first forward, would keep)."""
    own = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values or [0.0] * len(params)):
            p.copy_(v) if torch.is_tensor(v) else p.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, own):
                p.copy_(v)


class AdapterSync:
    """Adapter-only sync over disk and /v1/load_lora_adapter (state is real: the loaded window).
    Every load is proven by the probe (verify_sync.refusal), scored by the policy itself on every
    rank: under the trained adapter, with the adapter off (the base) and with the previous one (a
    stale load; each rank keeps its shards of it). weight_sync_verify_every=0: no probe."""

    def __init__(self, policy, clients, config, output_dir: str):
        self.policy = policy
        self.members = Members(clients, config.vllm_server_timeout, "LoRA sync")
        self.config = config
        self.root = os.path.join(os.path.abspath(output_dir), ".vllm_lora")
        self.prefix = f"{PREFIX}-{secrets.token_hex(3)}"    # this run's names: policy-<run>-v<N>
        self.worker_kwargs = {"lora_name": self.prefix}     # rollouts ask for policy-<run>-v<N>
        self.loaded: list[int] = []                    # versions loaded on every server, oldest 1st
        self.verify = config.weight_sync_verify_every > 0   # probes (0: off)
        self.adapter = [p for p in policy.parameters() if p.requires_grad]   # this rank's shards
        self.previous: list[torch.Tensor] | None = None  # the adapter at the last sync (shards)
        self.noise = NOISE_FLOOR                       # the run's own: the start probe's
        self.parity: dict[str, float] = {}             # sync/probe_kl of the last probe
        self.base = None                               # MergedSync of the base, with transfer

    def connect(self) -> None:
        """Every rank: the adapters' directory (rank 0); where every server has weight transfer
        (--weight-transfer-config beside --enable-lora), a sync of the base weights, joined."""
        transfer = None
        if dist.get_rank() == 0:
            # what is here a killed run left: a live run holds output_dir (checkpoint.hold)
            shutil.rmtree(self.root, ignore_errors=True)
            os.makedirs(self.root)
            transfer = all(c.server_info().get("weight_transfer_config")
                           for c in self.members.clients)
        if shared(transfer):
            self.base = MergedSync(self.policy, self.members.clients, self.config, adapter=False)
            self.base.connect()

    def start(self, version: int) -> None:
        """Every rank, before generation starts: the servers' base must be the trainer's. With
        weight transfer it is sent (a full sync of the base, verified as one); then the start
        probe, the adapter switched off, measures the run's own noise (what refusal judges
        against) and, where the base could not be sent, refuses a base farther than BASE_KL:
        an adapter cannot fix its base. A resumed run then loads its saved adapter."""
        if self.base is not None:
            self.base.push(version, probe_after=False)
        if self.verify:
            asked = on_rank0(lambda: ask(self.policy, self.members, base_card, None,
                                         4 * PROBE_TOKENS), FAILED)
            probes = probe(self.policy, asked, under=lambda: swapped(self.adapter))
            self.parity = parity(probes, self.members.clients)
            self.noise = max([NOISE_FLOOR] + [p.noise for p in probes])
            if self.base is None:
                on_rank0(lambda: self._check_bases(probes))
        if version > 0:
            self.push(version)

    def settle(self) -> None:
        """Nothing waits: each adapter load is proven before its version is published."""

    def _check_bases(self, probes) -> None:
        """Rank 0: ValueError naming the first server whose base's probe KL exceeds BASE_KL."""
        for c, p in zip(self.members.clients, probes):          # at start every server is live
            dtype = served_dtype(c.server_info())
            if p.kl > (bound := BASE_KL.get(dtype, max(BASE_KL.values()))):
                raise ValueError(f"LoRA sync: {p.url} serves another base model than the trained "
                                 f"one: on the start probe its log-probs are {p.kl:.3g} (k3 KL) "
                                 f"from the trainer's base model's (bound {bound:g} for {dtype}), "
                                 f"and an adapter cannot fix the base, nor can this run send it "
                                 f"(no --weight-transfer-config): serve the checkpoint the "
                                 f"trainer loads ({self.policy.model.config._name_or_path})")

    def push(self, version: int) -> dict[str, float]:
        """Every rank: gather the adapter; rank 0 writes it and loads it on every live replica
        (_publish); every rank proves the loads (_verify); rank 0 unloads the version that left
        the staleness window. An error on rank 0 is raised on every rank together."""
        start = time.perf_counter()
        state = exported(self.policy, self.config)      # the adapter, as a checkpoint's
        stats = SyncStats()
        name = f"{self.prefix}-v{version}"
        path = on_rank0(lambda: self._publish(version, state, stats))
        if self.verify:
            t = time.perf_counter()
            self._verify(name, path)
            stats.verify_s = time.perf_counter() - t
        self.previous = [p.detach().clone() for p in self.adapter]
        on_rank0(self._retire)
        stats.s = time.perf_counter() - start
        return stats.metrics()

    def _publish(self, version: int, state: dict[str, torch.Tensor], stats: SyncStats) -> str:
        """Rank 0: write the adapter (atomically), load it on every live replica; its path."""
        name = f"{self.prefix}-v{version}"
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".{name}.tmp")     # neither is there: a run's own names
        self.policy.model.save_pretrained(tmp, state_dict=state)
        os.rename(tmp, final)
        stats.bytes = os.path.getsize(os.path.join(final, "adapter_model.safetensors"))
        t = time.perf_counter()
        self.members.returning()               # back since the last sync: it gets this adapter
        self.members.call(lambda c: c.load_lora_adapter(name, final), f"loading {name}")
        self.loaded.append(version)
        stats.transfer_s = time.perf_counter() - t
        return final

    def _verify(self, name: str, path: str | None) -> None:
        """Every rank: each live replica's probe under `name` must show the trained adapter, not
        a failed delivery (verify_sync.refusal). One that does not is sent the adapter once more
        (loaded in place) and probed again; then it is taken out (Members) and the adapter
        unloaded there, or, if it is the last one, the sync raises."""
        others = {"the base": lambda: swapped(self.adapter)}
        if self.previous is not None:
            others["the previous adapter"] = lambda: swapped(self.adapter, self.previous)
        refused: dict[str, str] = {}
        for attempt in range(2):
            asked = on_rank0(lambda: ask(self.policy, self.members, lambda c: name,
                                         set(refused) if attempt else None), FAILED)
            probes = probe(self.policy, asked, others=others)
            if not attempt:
                self.parity = parity(probes, self.members.clients)
            refused = {p.url: why for p in probes if (why := refusal(p, self.noise))}
            if not refused:
                return
            if not attempt:
                on_rank0(lambda: self.members.call(lambda c: c.load_lora_adapter(name, path, True),
                                                   f"loading {name} again", only=set(refused)))
        on_rank0(lambda: self._take_out(name, refused))

    def _take_out(self, name: str, refused: dict[str, str]) -> None:
        """Rank 0: out of the syncs (the last one: the sync raises), and of routing: the adapter
        unloaded there (rollout.servers.drop_unverified)."""
        failed = [(c, refused[c.base_url]) for c in self.members.live if c.base_url in refused]
        self.members.take_out_failed(failed, f"failed the probe of {name}, loaded twice,",
                                     f"LoRA sync: {name} did not load as trained, loaded twice")
        for c, _ in failed:
            try:
                unload(c, name)
            except (VLLMError, TimeoutError) as e:     # out of the syncs already: said, not raised
                log.warning("LoRA sync: %s keeps %s loaded (%s): the rollout process may still "
                            "generate from it", c.base_url, name, e)

    def _retire(self) -> None:
        """Rank 0: unload the versions that left the staleness window (the new one is in)."""
        while len(self.loaded) > self.config.max_staleness + 1:
            self._unload(self.loaded.pop(0))

    def _unload(self, version: int) -> None:
        old = f"{self.prefix}-v{version}"
        self.members.call(lambda c: unload(c, old), f"unloading {old}")
        shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def close(self) -> None:
        """Rank 0, at the end of the run (also after a failure): unload this run's adapters from
        every server that still answers; a server that does not is warned about, not waited for."""
        if self.base is not None:
            self.base.close()
        if dist.get_rank() != 0:
            return
        for version in self.loaded:
            try:
                self._unload(version)
            except RuntimeError as e:
                log.warning("%s", e)
        self.loaded = []


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
    """A full sync of the merged weights W + s·B·A under the base names; the shards never change.
    adapter=False: of the base weights W alone (AdapterSync's base, sent at start)."""

    def __init__(self, policy, clients, config, adapter: bool = True):
        super().__init__(policy, clients, config)
        self.plan = merge_plan(policy.model)
        self.with_adapter = adapter

    def specs(self) -> list[tuple[str, torch.Size]]:
        return [(name, base.shape) for name, base, _ in self.plan]

    def tensors(self) -> Iterator[torch.Tensor]:
        return (merged(base, delta if self.with_adapter else None) for _, base, delta in self.plan)


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
