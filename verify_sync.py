"""Verification of the weight sync: the proof that each vLLM server serves the trained policy,
measured after every sync. Optional: weight_sync_verify_every=0 makes no Verifier (train.py), and
nothing here runs; a fork that drops this file drops that line and the syncs' `verifier`.

Spec: 概要 (Overview: weight_sync_steps) and the adapter-sync note (アダプタだけを同期する仕組み:
how only the adapter is synced) send the weights; this file checks that they arrived. The syncs
call it at one point each, and act on what it finds:

    when                        how                                         the finding
    start (lora_sync.choose:    one 1-token completion of the trained       ValueError: it
    check_start)                tokenizer's largest id (check_vocab)        serves another one
    every full sync, after     every rank gathers again the tensors        a server that holds
    it (FullSync.push:          tensors_to_verify() picks, rank 0           other bytes, named
    check_full)                 fingerprints them, then each server those   with the tensor and
                                it holds (our extension, vllm_plugin/)      both: taken out
    then, as the servers run    the probe: each server samples              sync/probe_kl, scored
                                PROBE_TOKENS with their log-probs (ask);    before the next step
                                every rank scores them with the policy      (score_probe)
    a LoRA run's start          the probe on each server's base, the        the run's noise; a
    (AdapterSync: check_bases)  adapter switched off (swapped)              base that differs
    every adapter load          the probe under the new adapter, scored     refused: loaded once
    (AdapterSync: check_adapter) also as each failed delivery (the base,    more, then the
                                the previous adapter) would serve it        replica is taken out

Fingerprints (vllm_plugin/weight_digests.fingerprint) are integer sums on the tensor's device,
bit-exact on CPU and CUDA, one read of its bytes. Which tensors (tensors_to_verify): a rotating
1/N (N: weight_sync_verify_every, 16) plus the embedding and LM head every sync, every tensor on a
run's first. The arithmetic for an H200: a 4B model is 8 GB in bf16; one read at ~4 TB/s of HBM
is ~2 ms, while NCCL moves the same bytes to a vLLM GPU at ~300 GB/s over NVLink (~27 ms) or
~50 GB/s through one 400 Gb/s NIC. Reading all of them again after each sync would add ~7% to
an NVLink transfer (and, sharded over several ranks, an all-gather of as many bytes): over the 5%
goal, hence the rotation (1/16: ~0.5%). `python -m tools.bench sync` measures the share (CPU).

The probe's scoring is the policy's own forward (train.Policy.token_logprobs): no copy of the
policy, the loss's own log-probs. The adapter verdict (refusal) holds in bf16 because it is
relative: the served log-probs must not lie MARGIN times nearer a failed delivery's than the
trained policy's (where the two lie APART times the run's start noise apart, else the probe cannot
tell them), nor both GAP times that noise and farther than any failed delivery from the trained
ones. A full sync's verdict is its fingerprints; its probe is the figure only.

Departures, one line each:
- vLLM's /weight_checker is not used: it hashes vLLM's fused tensors, and on a CPU each linear
  layer's weight is empty once its GEMM has repacked it.
- The probe's tokens are sampled by the server and scored by the trainer, as rollouts are (the
  stand-in has no prompt_logprobs): the same request on the stand-in and on vLLM.
"""
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

import torch

from ranks import from_rank0, on_rank0
from vllm_client import VLLMError
from vllm_plugin.weight_digests import fingerprint
from weight_sync import FAILED, in_background, served_dtype

log = logging.getLogger(__name__)
EXTENSION = "weight_digests.WeightDigests"       # vllm serve --worker-extension-cls (vllm_plugin/)
METHOD = "weight_digests"                        # its method, called through POST /collective_rpc
ENABLE = (f"start vLLM with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} "
          "(vllm_plugin/: `pip install ./vllm_plugin` into vLLM's environment, GPU or CPU)")
PROBE_LENGTH = 16         # the probe's prompt tokens
PROBE_TOKENS = 8          # tokens the server samples after them (32 at start: the run's noise)
PROBE_SEED = 27
MARGIN = 3.0              # served this many times nearer a failed delivery than trained: refused
APART = 3.0               # ... if that delivery lies this many times the start noise off trained:
                          # a correct load lies up to ~2.3 of it off (bf16), and a delivery within
                          # (1 + 1/MARGIN) of that error can lie as near the served as trained does
GAP = 20.0                # served this many times the start noise off the trained (and farther
                          # than every failed delivery): refused
NOISE_FLOOR = 1e-4        # the least noise assumed (fp32 servers agree to ~1e-6)
BASE_KL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}   # k3 a served base may differ by


class Verifier:
    """Verification's state for one run, on every rank: the fingerprints' rotation, which servers
    can show theirs, the probe in flight and its figure; for adapter sync, the run's noise and the
    previous adapter (each rank its shards).

        verifier = Verifier(policy, config)                  # train.py, every rank
        failed, figures = verifier.check_full(sync, version)  # FullSync.push, after the sync
        refused, figures = verifier.check_adapter(name, members, reload)   # AdapterSync.push
        verifier.score_probe()                               # train.py: before each step
        verifier.probe_kl                                    # train.py: every step's figure
    """

    def __init__(self, policy, config):
        self.policy = policy                 # the probe's scorer: policy.token_logprobs
        self.every = config.weight_sync_verify_every
        self.always = embedding_names(policy.model)            # fingerprinted at every sync
        self.adapter = [p for p in policy.parameters() if p.requires_grad]   # LoRA: its shards
        self.checks = 0                      # full syncs checked: the first checks every tensor
        self.showing: dict[str, bool] = {}   # rank 0: URL → it shows its fingerprints (asked once)
        self.unreadable: set[str] = set()    # rank 0: URLs whose unreadable tensors were said
        self.probe_reply = None              # rank 0: the last full sync's probe (a future)
        self.probe_waiting = False           # every rank: that probe waits to be scored
        self.probe_kl: dict[str, float] = {}   # sync/probe_kl of the last probe
        self.noise = NOISE_FLOOR             # adapter sync: the run's own, the start probe's
        self.previous: list[torch.Tensor] | None = None   # adapter sync: the adapter last loaded

    def check_start(self, clients, tokenizer) -> None:
        """Rank 0, at start, before anything is sent: every server serves the trained model's
        vocabulary (check_vocab)."""
        for c in clients:
            check_vocab(c, tokenizer)

    # ── full sync ──

    def check_full(self, sync, version: int) -> tuple[dict[str, str], dict[str, float]]:
        """Every rank, after a full sync to `version` (weight_sync.FullSync), the servers running
        again: ({url: why} of those that hold other bytes than were sent, on rank 0; the
        sync's figures). Rank 0 picks the tensors (tensors_to_verify; none where no server can
        show what it holds), every rank gathers them once more (sync.tensors), rank 0
        fingerprints them in the wire's dtype and compares each server's. Then the probe is
        asked of the others, in the background (scored by score_probe)."""
        start = time.perf_counter()
        weights = sync.weights
        names = from_rank0(on_rank0(lambda: self._picked(sync.specs(), version, weights.members),
                                    FAILED))
        self.checks += 1
        self.probe_waiting = True
        sent = {}
        for name, t in zip(names, sync.tensors(set(names))):     # every rank: the all-gathers
            if weights.rank == 0:
                sent[name] = fingerprint(t.to(weights.dtype))
        failed, verified = on_rank0(lambda: self._compared(sent, weights.members),
                                    FAILED) or ({}, 0)
        return failed, {"sync/verify_s": time.perf_counter() - start,
                        "sync/verified_tensors": float(verified)}

    def _picked(self, specs: list[tuple[str, torch.Size]], version: int, members) -> list[str]:
        """Rank 0: the names a sync to `version` verifies (tensors_to_verify), none where no
        server can show what it holds (each is asked once; one that cannot is said once, with
        how to enable it)."""
        for c in members.live:
            if c.base_url not in self.showing:
                why = cannot_show(c)
                self.showing[c.base_url] = why is None
                if why:
                    log.warning("weight sync: %s cannot show the weights it holds (%s), so "
                                "syncs to it are not verified; %s", c.base_url, why, ENABLE)
        if not any(self.showing.values()):
            return []
        return tensors_to_verify([n for n, _ in specs], version, self.every, self.always,
                                 not self.checks)

    def _compared(self, sent: dict[str, str], members) -> tuple[dict[str, str], int]:
        """Rank 0: ({url: why} of those that hold other bytes than `sent`, named with the
        tensors and both fingerprints; the fewest tensors a server was verified in). Tensors a
        server cannot read back exactly are said once and not counted. Then the probe is asked
        of the others, in the background."""
        names = list(sent)
        showing = {url for url, yes in self.showing.items() if yes}
        shown = members.call(lambda c: served_digests(c, names), only=showing) if names else {}
        failed, verified = {}, []
        for c, (served, excluded) in shown.items():
            if excluded and c.base_url not in self.unreadable:
                self.unreadable.add(c.base_url)
                log.warning("weight sync: %s cannot read back %d tensor(s) exactly, which are "
                            "not verified: %s", c.base_url, len(excluded), excluded)
            if wrong := mismatches(sent, served, excluded):
                failed[c.base_url] = (f"it holds other bytes than were sent in {len(wrong)} of "
                                      f"{len(names)} verified tensors: {'; '.join(wrong[:3])}")
            else:
                verified.append(len(names) - len(excluded))
        good = {c.base_url for c in members.live} - set(failed)
        self.probe_reply = in_background(lambda: ask(self.policy, members, base_card, good))
        return failed, min(verified, default=0)

    def score_probe(self) -> None:
        """Every rank, before the weights change again (train.py: before each step): the last
        full sync's probe, asked as its servers resumed, scored by the policy (sync/probe_kl), so
        its generation never holds up a step. An adapter's probe was scored as it loaded."""
        if self.probe_waiting:
            self.probe_waiting = False
            reply = on_rank0(lambda: self.probe_reply.result(), FAILED)   # bounded: Members.call
            self.probe_kl = kl_figures(self.scored(reply))

    # ── adapter sync ──

    def check_bases(self, members, only: set[str] | None = None) -> dict[str, str]:
        """Every rank, at a LoRA run's start: each live server's probe (of the servers in `only`,
        if given) on its base card, scored with the adapter switched off (the trainer's base).
        Sets the run's noise (what refusal judges against) from the servers that serve the
        trained base; returns {url: why} of those that serve another (its k3 over BASE_KL)."""
        replies = on_rank0(lambda: ask(self.policy, members, base_card, only, 4 * PROBE_TOKENS),
                           FAILED)
        probes = self.scored(replies, under=lambda: swapped(self.adapter))
        self.probe_kl = kl_figures(probes)
        bounds = from_rank0(on_rank0(lambda: {c.base_url: served_dtype(c.server_info())
                                              for c in members.live}))
        differ = {}
        for p in probes:
            bound = BASE_KL.get(bounds[p.url], max(BASE_KL.values()))
            if p.kl > bound:
                differ[p.url] = (f"on the start probe its log-probs are {p.kl:.3g} (k3 KL) from "
                                 f"the trainer's base model's (bound {bound:g} for "
                                 f"{bounds[p.url]})")
            else:
                self.noise = max(self.noise, p.noise)
        return differ

    def check_adapter(self, name: str, members, reload) -> tuple[dict[str, str], dict]:
        """Every rank, after adapter `name` was loaded: each live replica's probe under `name`
        must show the trained adapter, not a failed delivery (refusal). Those that do not are
        loaded once more (reload(their URLs), on rank 0) and probed again. Returns ({url: why}
        of those still refused, the sync's figures: sync/verify_s)."""
        start = time.perf_counter()
        others = {"the base": lambda: swapped(self.adapter)}
        if self.previous is not None:
            others["the previous adapter"] = lambda: swapped(self.adapter, self.previous)
        refused: dict[str, str] = {}
        for attempt in range(2):
            replies = on_rank0(lambda: ask(self.policy, members, lambda c: name,
                                           set(refused) if attempt else None), FAILED)
            probes = self.scored(replies, others=others)
            if not attempt:
                self.probe_kl = kl_figures(probes)
            refused = {p.url: why for p in probes if (why := refusal(p, self.noise))}
            if not refused or attempt:
                break
            on_rank0(lambda: reload(set(refused)), FAILED)
        self.previous = [p.detach().clone() for p in self.adapter]
        return refused, {"sync/verify_s": time.perf_counter() - start}

    # ── the probe, scored ──

    def scored(self, replies, under=None, others: dict | None = None) -> list["Probe"]:
        """Every rank: rank 0's `replies` (ask's; None elsewhere) scored by the policy, under the
        context `under()` if given (the adapter as zeros: the base), and under each of `others`
        (what → a context: a failed delivery). The findings, the same on every rank."""
        replies = from_rank0(replies)
        prompt = probe_prompt(self.policy.model.get_input_embeddings().num_embeddings)
        sequences = [(prompt, tokens) for _, _, _, tokens, _ in replies]
        if not sequences:
            return []
        with (under or contextlib.nullcontext)():
            ours = self.policy.token_logprobs(sequences)
        theirs = {}
        for what, context in (others or {}).items():
            with context():
                theirs[what] = self.policy.token_logprobs(sequences)
        return [Probe(url, torch.tensor(served), ours[i], {w: t[i] for w, t in theirs.items()},
                      index, several) for i, (url, index, several, _, served) in enumerate(replies)]


# ── fingerprints ─────────────────────────────────────────────────────────────────────────────


def embedding_names(model) -> set[str]:
    """The names of the input embedding's and the LM head's weights (one name when tied): every
    sync verifies them (tensors_to_verify)."""
    ends = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return {name for name, p in model.named_parameters() if id(p) in ends}


def tensors_to_verify(names: list[str], version: int, every: int, always: set[str],
                      first: bool = False) -> list[str]:
    """The tensors a sync to `version` verifies, in `names` order: none when every <= 0 (off); all
    on a run's first sync (first) or when every is 1; else names[version % every::every] and those
    `always` names (the embedding and LM head: a name there may carry a prefix, as peft's
    base_model.model.lm_head.weight does for the sent lm_head.weight). Each tensor is verified at
    least once in any `every` consecutive versions.

    >>> names = ["embed", "a1", "a2", "a3", "a4", "a5", "head"]
    >>> tensors_to_verify(names, version=6, every=4, always={"embed", "head"})
    ['embed', 'a2', 'head']
    """
    if every <= 0:
        return []
    if first or every == 1:
        return list(names)
    picked = set(names[version % every::every])
    return [n for n in names if n in picked or any(a == n or a.endswith("." + n) for a in always)]


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


# ── at start: does each server serve the trained model? ─────────────────────────────────────


def base_card(client) -> str:
    """The server's base model card (an adapter's card has a parent)."""
    return next(c["id"] for c in client.models()["data"] if c.get("parent") is None)


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


def ask(policy, members, model_of, only: set[str] | None = None,
        tokens: int = PROBE_TOKENS) -> list[tuple]:
    """Rank 0: (url, its index in vllm_server_base_url, several servers?, tokens, their
    log-probs) of the probe each live server of `members` (in `only`, if given) samples under
    model_of(server), asked in parallel, in the servers' order."""
    prompt = probe_prompt(policy.model.get_input_embeddings().num_embeddings)
    found = members.call(lambda c: served_logprobs(c, model_of(c), prompt, tokens), only=only)
    several = len(members.clients) > 1
    return [(c.base_url, members.clients.index(c), several, *reply) for c, reply in found.items()]


@dataclass
class Probe:
    """One server's probe: the log-probs [T] of the tokens it sampled as it served them (served),
    under the trained policy (ours), and under each failed delivery (others: what → [T])."""
    url: str
    served: torch.Tensor
    ours: torch.Tensor
    others: dict[str, torch.Tensor] = field(default_factory=dict)
    index: int = 0                # the server's in vllm_server_base_url
    several: bool = False         # the run has several servers

    @property
    def kl(self) -> float:
        """k3 of KL(served ‖ trained) over its tokens, (r - 1) - log r (loss.k3's estimator),
        clamped at 0 where rounding makes it a hair negative."""
        log_ratio = (self.ours - self.served).clamp(-20, 20)
        return max(0.0, float((log_ratio.exp() - 1 - log_ratio).mean()))

    @property
    def noise(self) -> float:
        """rms(served - ours): all noise where the server holds the trained weights."""
        return rms(self.served - self.ours)


def kl_figures(probes: list[Probe]) -> dict[str, float]:
    """sync/probe_kl (ours): the largest probe KL, and with several servers each one's as
    sync/probe_kl/<its index in vllm_server_base_url>."""
    if not probes:
        return {}
    return {"sync/probe_kl": max(p.kl for p in probes)} | {
        f"sync/probe_kl/{p.index}": p.kl for p in probes if p.several}


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def refusal(probe: Probe, noise: float) -> str | None:
    """Why the probe says the server does not serve the trained policy (None: it does, or the
    deliveries cannot be told apart). Two rules, neither a fixed tolerance:

    - nearest: for each failed delivery a (probe.others: the base, the previous adapter) that
      lies over APART times the run's start noise (`noise`) from the trained policy, the served
      log-probs lying MARGIN times nearer a's than the trained policy's, in rms over the probe's
      tokens. Relative, so bf16's noise, however it grows as training sharpens the policy, does
      not fire it. A delivery within APART times the noise is not judged: a previous adapter
      that the last step moved by about the noise lies as near the served log-probs as the
      trained policy does, both distances are noise, and noise differs 3x now and then. A stale
      adapter is caught once the trained policy has moved APART from what it serves.
    - far: rms(served - ours) over GAP times the run's start noise (`noise`: the start probe's,
      32 tokens on identical weights) and over every failed delivery's own distance from ours.
      What is none of the deliveries (a corrupt load, say) but far. The start noise alone is no
      scale: bf16's error on an uncertain token grows with the logits as training sharpens the
      policy, and the trained policy's distance from the base grows with it.

    Worked, T = 2, start noise 0.01: ours (-1.0, -2.0), the base (-1.4, -1.6), 0.4 apart. Served
    (-1.02, -1.97): 0.03 from ours, 0.38 from the base: accepted. Served (-1.36, -1.64), a stale
    load: 0.36 from ours, 0.04 from the base, 9x nearer: refused. A step that moved little: the
    previous adapter (-1.02, -2.02), 0.02 from ours, within 3 x 0.01; served (-1.021, -2.019):
    20x nearer it, but the two cannot be told apart: accepted. Sharpened: ours (0, -2.36), the
    base (-1.5, -4.0), 1.57 from ours. Served (0, -2.82): 0.33 from ours, over 20 x 0.01 but
    within 1.57, and 1.35 from the base: accepted.
    """
    ours = rms(probe.served - probe.ours)
    for what, theirs in probe.others.items():
        apart = rms(probe.ours - theirs) > APART * noise
        if apart and MARGIN * (nearer := rms(probe.served - theirs)) < ours:
            return (f"on the probe its log-probs lie {ours / max(nearer, 1e-30):.0f}x nearer "
                    f"{what}'s ({nearer:.3g}, rms) than the trained policy's ({ours:.3g})")
    reach = max([rms(probe.ours - theirs) for theirs in probe.others.values()], default=0.0)
    if ours > max(GAP * noise, reach):
        return (f"on the probe its log-probs are {ours:.3g} (rms) from the trained policy's, over "
                f"{GAP:g} times the run's noise {noise:.3g} and farther than any failed delivery "
                f"is ({reach:.3g})")
    return None


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
