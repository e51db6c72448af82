"""LoRA's sync: only the adapter goes to the vLLM servers where they can load it, else the merged
weights; chosen once at start, with the servers' checks (choose).

Spec: LoRA (LoRA adapters) and the adapter-sync note (docs/lora_adapter_sync.md,
アダプタだけを同期する仕組み: how only the adapter is synced):
"アダプタを <output_dir>/.vllm_lora/trl-policy-v{N} に保存し、原子的なリネームで公開"
(save the adapter there, publish it by an atomic rename), then the path goes to
/v1/load_lora_adapter. Chosen once at start, on rank 0, from every server's /server_info:

    every server has runtime LoRA, max_lora_rank >= r (and rank_pattern's), max_loras >=
    max_staleness + 2, and vLLM loads the adapter (vllm_refusal: no DoRA, lora_bias,
    modules_to_save...)                                     → AdapterSync
    otherwise                                               → merged sync, with why and the flags

AdapterSync of run 3f9a1c, one sync to version 5 with max_staleness = 2 (3 versions stay loaded):

    write   .vllm_lora/.policy-3f9a1c-v5.tmp/ → rename → policy-3f9a1c-v5/    atomic: vLLM never
                                                                              reads half of one
    load    POST /v1/load_lora_adapter {"lora_name": "policy-3f9a1c-v5", "lora_path": ...}  every
    probe   (verification on) a completion under policy-3f9a1c-v5 shows the   replica; loaded:
            trained adapter, not the base nor v4 (verify_sync; else loaded    v3-5
            again, then the replica is taken out)
    unload  POST /v1/unload_lora_adapter policy-3f9a1c-v2; delete its dir
    end     unload (and delete) v3 v4 v5: a long-lived server keeps no name of a finished run
    A rollout started under version N requests model="policy-<run>-vN" to its end (rollout/loop.py,
    lora_name), so the oldest loaded version may still be in use: max_loras needs a spare slot.

At start the servers' base must be the trainer's. The start probe (verify_sync.Verifier.
check_bases) finds a server whose base differs; only that one is sent the trained base (a full
sync of merge_plan's base tensors, said on a line) where it has weight transfer
(--weight-transfer-config beside --enable-lora, as the spec starts vLLM), else the run stops. A
server that serves the trained base gets adapters only and joins no weight-transfer group. With
verification off there is no probe: the base is sent wherever every server has weight transfer.

The merged sync is a weight_sync.FullSync of W + s·B·A (merge_plan, Delta.merged) under the base
model's names, as peft's merge_and_unload() merges it: the bias of lora_B too (lora_bias), GPT-2's
transposed Conv1D weights (fan_in_fan_out), DoRA; what it cannot merge is refused at start
(merge_plan).

Departures from the spec, one line each:
- Adapters are named policy-<run>-v{N} (spec: trl-policy-v{N}): vLLM keeps a name registered until
  it is unloaded, so a second run (or a crashed one) against the same server never collides.
- Several replicas are served without a proxy: each load and unload goes to each (TRL refuses that).
"""
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.distributed as dist

from checkpoint import exported, full_tensor
from ranks import from_rank0, on_rank0
from vllm_client import VLLMError
from weight_sync import (FullSync, Members, SyncStats, check_servers, language_parameters,
                         take_out_unverified)

PREFIX = "policy"

log = logging.getLogger(__name__)


def max_lora_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM accepts (1, 8, 16, ..., 512) that serves an adapter of
    rank r (r=4 → 8)."""
    return next(rank for rank in (1, 8, 16, 32, 64, 128, 256, 320, 512) if rank >= r)


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
    fan_in_fan_out: lora_A and lora_B keep nn.Linear's [r, in] and [out, r] layout either way.
    A field this peft (>= 0.17) predates reads as None."""
    init, bias = peft_config.init_lora_weights, peft_config.bias
    refused = [(getattr(peft_config, f, None), why) for f, why in VLLM_REFUSES.items()] + [
        (bias != "none", f"vLLM refuses adapters that train base biases (bias={bias!r})"),
        (isinstance(init, str) and init.lower() not in VLLM_INITS,
         f"init_lora_weights={init!r} changes the base weights, which an adapter load cannot "
         "carry")]
    variants = [f.name for f in fields(peft_config) if f.metadata.get("is_lora_variant")]
    refused += [(getattr(peft_config, v), f"vLLM would serve {v} as plain LoRA, which it is not")
                for v in variants]
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


def choose(policy, clients, config, tokenizer, peft_config, output_dir: str, verifier=None):
    """Every rank, at start: the servers checked (rank 0: weight_sync.check_servers waits for
    them first), then this run's sync: FullSync without LoRA; with it, AdapterSync when every
    server allows it, else the merged sync, a FullSync of merge_plan (rank 0 decides and says
    why). `verifier`: verify_sync's, or None (verification off)."""
    def decide() -> str:
        if peft_config is not None and config.save_strategy == "no":        # spec: LoRA
            log.warning("save_strategy='no' with LoRA: this run will keep no adapter (.vllm_lora/ "
                        "is the servers' cache, emptied as it goes; checkpoints keep the trained "
                        "adapter)")
        check_servers(clients, config, policy.head().weight.device)
        if verifier is not None:
            verifier.check_start(clients, tokenizer)
        if peft_config is None:
            return "full"
        why = adapter_refusal([c.server_info() for c in clients], [c.base_url for c in clients],
                              peft_config, config.max_staleness)
        if why is None:
            log.info("LoRA sync: adapter only (%s-<run>-v<N> under %s/.vllm_lora/, %d server(s))",
                     PREFIX, output_dir, len(clients))
            return "adapter"
        log.warning("LoRA sync: merged weights (the full model every sync), because %s", why)
        return "merged"

    kind = from_rank0(on_rank0(decide))
    if kind == "adapter":
        return AdapterSync(policy, clients, config, output_dir, verifier)
    plan = merge_plan(policy.model) if kind == "merged" else None
    return FullSync(policy, clients, config, verifier, plan)


# ── adapter only ────────────────────────────────────────────────────────────────────────────


class AdapterSync:
    """Adapter-only sync over disk and /v1/load_lora_adapter (state is real: the loaded window).
    With verification on, every load is proven by the probe (verify_sync.Verifier.check_adapter)
    and a replica that does not show it, loaded twice, is taken out.

        sync = AdapterSync(policy, clients, config, output_dir, verifier)   # every rank
        sync.start(version)           # the servers' base checked (or sent), a resumed adapter
        metrics = sync.push(version)  # every rank, each sync
    """

    def __init__(self, policy, clients, config, output_dir: str, verifier=None):
        self.policy = policy
        self.members = Members(clients, config.vllm_server_timeout, "LoRA sync")
        self.config = config
        self.verifier = verifier                       # verify_sync.Verifier, or None: off
        self.root = os.path.join(os.path.abspath(output_dir), ".vllm_lora")
        self.prefix = f"{PREFIX}-{secrets.token_hex(3)}"    # this run's names: policy-<run>-v<N>
        self.worker_kwargs = {"lora_name": self.prefix}     # rollouts ask for policy-<run>-v<N>
        self.loaded: list[str] = []              # adapters loaded on every server, oldest first

    def start(self, version: int) -> None:
        """Every rank, before generation starts: the adapters' directory (rank 0; what is there
        a killed run left: a live run holds output_dir, checkpoint.hold), the servers' base made
        the trained one (_send_base), and a resumed run's saved adapter loaded."""
        if dist.get_rank() == 0:
            shutil.rmtree(self.root, ignore_errors=True)
            os.makedirs(self.root)
        self._send_base(version)
        if version > 0:
            self.push(version)

    def _send_base(self, version: int) -> None:
        """Every rank: the servers whose base is not the trained one (the start probe's finding;
        without verification, every server, unprobed) are sent it, once, by a full sync of the
        base tensors (merge_plan's, no delta merged), where they have weight transfer. A probed
        server whose base differs and that has none stops the run; unprobed servers are sent it
        only if all of them have it."""
        differ = self.verifier.check_bases(self.members) if self.verifier else None
        targets = [c for c in self.members.clients if differ is None or c.base_url in differ]
        lacking = from_rank0(on_rank0(lambda: [c.base_url for c in targets if not c.server_info()
                                               .get("weight_transfer_config")]))
        if lacking and differ:
            raise ValueError(f"LoRA sync: {lacking[0]} serves another base model than the "
                             f"trained one: {differ[lacking[0]]}, and an adapter cannot fix the "
                             f"base, nor can this run send it (no --weight-transfer-config): "
                             f"serve the checkpoint the trainer loads "
                             f"({self.policy.model.config._name_or_path})")
        if lacking or not targets:              # unprobed: to every server, or to none
            return
        if dist.get_rank() == 0:
            log.warning("LoRA sync: sending the trained base model to %s (%s), once, by a full "
                        "sync", [c.base_url for c in targets],
                        "its base differs" if differ else "unprobed: verification is off")
        base = [(name, p, None) for name, p, _ in merge_plan(self.policy.model)]   # W: no delta
        FullSync(self.policy, targets, self.config, plan=base).start(version)
        if differ and (still := self.verifier.check_bases(self.members, set(differ))):
            raise ValueError(f"LoRA sync: the trained base was sent, yet {still}")

    def push(self, version: int) -> dict[str, float]:
        """Every rank: gather the adapter; rank 0 writes it and loads it on every live replica
        (_publish); with verification on, each load is proven and a replica that fails, loaded
        twice, is taken out (take_out_unverified); rank 0 unloads the version that left the
        staleness window. An error on rank 0 is raised on every rank together."""
        state = exported(self.policy, self.config)      # the adapter, as a checkpoint's
        stats, figures = SyncStats(), {}
        name = f"{self.prefix}-v{version}"
        with stats.timed("s"):
            on_rank0(lambda: self._publish(name, state, stats))
            if self.verifier is not None:     # verification (verify_sync.py): act on its verdict
                refused, figures = self.verifier.check_adapter(name, self.members,
                                                               partial(self._load, name))
                on_rank0(lambda: take_out_unverified(     # and of routing: unloaded there
                    self.members, refused, f"failed the probe of {name}, loaded twice,",
                    f"LoRA sync: {name} did not load as trained, loaded twice",
                    lambda c: unload(c, name)))
            on_rank0(lambda: self._unload(keep=self.config.max_staleness + 1))
        return stats.metrics() | figures

    def _publish(self, name: str, state: dict[str, torch.Tensor], stats: SyncStats) -> None:
        """Rank 0: write the adapter (atomically), load it on every live replica."""
        tmp = os.path.join(self.root, f".{name}.tmp")     # neither is there: a run's own names
        self.policy.model.save_pretrained(tmp, state_dict=state)
        os.rename(tmp, os.path.join(self.root, name))
        stats.bytes = os.path.getsize(os.path.join(self.root, name, "adapter_model.safetensors"))
        with stats.timed("transfer_s"):
            self.members.readmit_healthy()          # back since the last sync: it gets this one
            self._load(name)
        self.loaded.append(name)

    def _load(self, name: str, again: set[str] | None = None) -> None:
        """Rank 0: load adapter `name` on every live replica, or once more, in place, on those
        whose URLs are `again`."""
        path = os.path.join(self.root, name)
        self.members.call(lambda c: c.load_lora_adapter(name, path, again is not None),
                          f"loading {name}" + (" again" if again else ""), only=again)

    def _unload(self, keep: int) -> None:
        """Rank 0: unload the oldest adapters (and delete their files) until `keep` are loaded."""
        while len(self.loaded) > keep:
            old = self.loaded.pop(0)
            self.members.call(lambda c: unload(c, old), f"unloading {old}")
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def close(self) -> None:
        """Rank 0, at the end of the run (also after a failure): unload this run's adapters from
        every server that still answers; a server that does not is warned about, not waited for."""
        while dist.get_rank() == 0 and self.loaded:     # one by one: a failure stops no other
            try:
                self._unload(keep=len(self.loaded) - 1)
            except RuntimeError as e:
                log.warning("%s", e)


def unload(client, name: str) -> None:
    """Unload adapter `name`; one the server does not hold is fine (a 404: a replica back since
    it was loaded never had it, or its failed probe unloaded it)."""
    try:
        client.unload_lora_adapter(name)
    except VLLMError as e:
        if e.status != 404:
            raise


# ── merged ──────────────────────────────────────────────────────────────────────────────────


@dataclass
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

    def merged(self, base: torch.Tensor) -> torch.Tensor:
        """The base tensor with peft's merge applied, computed in fp32 and returned in the base
        dtype; gathered whole (every rank calls it). A Conv1D weight W [in, out] of GPT-2:
        (Wᵀ + s·B·A)ᵀ, since B·A is [out, in]."""
        w, b = full_tensor(base).float(), full_tensor(self.b).float()
        if self.a is None:
            return (w + self.scale * b).to(base.dtype)
        w = w.T if self.fan_in_fan_out else w                                          # [out, in]
        w = w + self.scale * (b @ full_tensor(self.a).float())
        if self.magnitude is not None:
            w = w * (full_tensor(self.magnitude).float() / w.norm(dim=1))[:, None]
        return (w.T if self.fan_in_fan_out else w).to(base.dtype)


def merge_plan(peft_model) -> list[tuple[str, torch.Tensor, Delta | None]]:
    """(base model name, base tensor, what peft's merge adds to it or None) for every language-
    model tensor to send: the merged sync's plan (weight_sync.FullSync). Names lose peft's
    wrapping: base_model.model.x.base_layer.weight → x.weight, x.modules_to_save.<adapter>.weight
    → x.weight (x.original_module.* is not sent).
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
            dora = layer.lora_magnitude_vector                     # DoRA's m by adapter, or empty
            delta = Delta(layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                          layer.scaling[adapter], dora[adapter].weight if adapter in dora else None,
                          layer.fan_in_fan_out)
        elif layer is not None and kind == "bias" and layer.lora_bias[adapter]:
            delta = Delta(None, layer.lora_B[adapter].bias, layer.scaling[adapter])
        clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        clean = clean.replace(f".modules_to_save.{adapter}.", ".")
        plan.append((clean, p, delta))
    return plan


def merge_refusal(layer, adapter: str) -> str | None:
    """Why Delta.merged cannot give peft's merge of this LoRA layer (None: it can): it merges
    peft's Linear (over nn.Linear or Conv1D) with plain LoRA or DoRA, not an embedding, a
    convolution or target_parameters, nor another variant; lora_bias needs a base bias (peft's
    merge raises "Impossible to merge LoRA with `lora_bias=True`" without one)."""
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

