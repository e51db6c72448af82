"""The proof that the served policy is the trained one (概要 (Overview: weight_sync_steps) and the
adapter-sync note): what each vLLM server holds, measured against what the trainer sent, at start
and after every sync. weight_sync.py and lora_sync.py act on the findings (a replica taken out, an
error); this file measures.

    when                       how                                         the finding
    start, before anything     the served checkpoint's names and shapes    ValueError (names,
    is sent (check_servers,    (check_served, from its safetensors), the   shapes, vocabulary);
    WeightSync.connect)        largest token id (check_vocab), the dtype   a dtype warning
    start (FullSync.start,     the server samples PROBE_TOKENS after       full sync: a warning,
    AdapterSync.start)         probe_prompt() (temperature 1, seed fixed)  then the trainer's
                               with each token's log-prob; the trainer's   weights are sent;
                               Reference scores the same tokens            adapter sync: ValueError
    every full sync            rank 0 hashes (sha256) the bytes it         a mismatch names the
    (WeightSync.push, after    broadcasts of the tensors chosen(); then    server, the tensor and
    /finish_weight_update,     each server hashes what it now holds        both digests; that
    before /resume)            (digest_route)                              replica is taken out
    every adapter load         the probe, under the adapter's name: the    loaded once more, then
    (AdapterSync.push)         trainer's log-probs, not the base's         the replica is out

Which tensors a full sync verifies (chosen): the rotating slice names[version % VERIFY_EVERY ::
VERIFY_EVERY] and always the embedding and LM head, so every tensor is verified within
VERIFY_EVERY syncs; a run's first sync verifies every tensor. VERIFY_EVERY keeps verification
under 5% of the sync's time: `python -m tools.bench sync` (a ~25M-parameter fp32 model, gloo on
CPU) measured verify_share 0.030 and 0.019 at 16 (0.047 at 8, 0.133 at 4). The share is about
(hashed bytes / sha256's ~1.4 GB/s per side) / the sync's seconds, so where the transfer outruns
sha256 (NCCL between GPUs) it grows: raise it there (AsyncGRPOConfig.weight_sync_verify_every;
0: no verification at all, probes and their CPU copy of the policy included).

How a server shows what it holds (digest_route):

    our vLLM worker extension    POST /collective_rpc {"method": "weight_digests", "args":
    (vllm_plugin/weight_digests)   ["<names, JSON>"]} → {"results": [{"digests", "excluded"}]}
    local_vllm                   POST /weight_checker {"action": "checksum", "names": [...]}
    neither                      a warning, once per server (how to enable it): not verified

Departures, one line each:
- vLLM's own /weight_checker is not used: it hashes vLLM's fused tensors (qkv_proj, gate_up_proj),
  and on a CPU each linear layer's weight is empty once its GEMM has repacked it.
- The probe's tokens are sampled by the server and scored by the trainer, as rollouts are (the
  stand-in has no prompt_logprobs): the same request shape on the stand-in and on vLLM.
- The reference is a CPU copy on rank 0 (Reference): the policy's weights gathered whole, rounded
  to the served dtype, computed in fp32 with eager attention. Simplest to get right under FSDP2 and
  tree attention; it holds 4 bytes a parameter of host memory while it lives: during the start
  probe with full sync, the whole run with adapter sync (the adapter is swapped in at each sync).
  Each adapter probe costs a request and two CPU forwards of 24 tokens per replica: most of an
  adapter sync on the bench (adapter_verify_share ~0.89 against the stand-in, which recomputes
  every token: no KV cache).
"""
import contextlib
import copy
import glob
import hashlib
import json
import os
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_client import VLLMError

VERIFY_EVERY = 16         # every tensor verified at least every N syncs (tools.bench sync: <= 5%)
EXTENSION = "weight_digests.WeightDigests"       # vllm serve --worker-extension-cls (vllm_plugin/)
METHOD = "weight_digests"                        # its method, called through POST /collective_rpc
ENABLE = (f"start vLLM with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} "
          "(vllm_plugin/: `pip install ./vllm_plugin` into vLLM's environment, GPU or CPU)")
PROBE_LENGTH = 16         # the probe's prompt tokens
PROBE_TOKENS = 8          # tokens the server samples after them
PROBE_SEED = 27
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}   # max |Δ log p| by served dtype


# ── full sync: digests ──────────────────────────────────────────────────────────────────────


def digest(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes in its dtype, row-major: what the trainer broadcasts, and
    what the stand-in and our worker extension hash. torch.ones(2) in fp32 is 0000803f twice:

    >>> digest(torch.ones(2))[:16]
    '80b8fd6d60fa85fd'
    """
    flat = t.detach().contiguous().view(-1).view(torch.uint8).cpu()    # [bytes]
    return hashlib.sha256(flat.numpy()).hexdigest()


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


def digest_route(client) -> tuple[str | None, str]:
    """How a server shows the digests of what it holds: ("rpc", "") for our worker extension
    (POST /collective_rpc), ("checker", "") for local_vllm (/weight_checker with names), or
    (None, why). Each try asks for no names: nothing is hashed."""
    try:
        results = client.collective_rpc(METHOD, "[]")
    except VLLMError as e:
        if e.status != 404:                    # real vLLM (dev mode) without our extension
            return None, f"/collective_rpc has no {METHOD}: {e.message[:300]}"
    else:
        unsupported = [r["unsupported"] for r in results if "unsupported" in r]
        if unsupported:
            return None, unsupported[0]
        return "rpc", ""
    try:
        shown = client.weight_checker("checksum", names=[])
    except VLLMError as e:
        return None, f"it has neither /collective_rpc nor /weight_checker ({e.message[:300]})"
    if shown.get("checksums") == {}:
        return "checker", ""
    return None, "its /weight_checker hashes every weight (under its own names), not those asked"


def served_digests(client, route: str, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """({name: digest} of what the server now holds, {name: why it cannot be read back}) for
    `names`. With several workers (data parallel), their digests of a tensor joined by " | "
    where they differ: no sent digest equals that."""
    if route == "checker":
        return client.weight_checker("checksum", names=names)["checksums"], {}
    digests: dict[str, str] = {}
    excluded: dict[str, str] = {}
    for result in client.collective_rpc(METHOD, json.dumps(names)):
        excluded |= result["excluded"]
        for name, d in result["digests"].items():
            digests[name] = d if digests.get(name, d) == d else f"{digests[name]} | {d}"
    return digests, excluded


def mismatches(sent: dict[str, str], served: dict[str, str], excluded: dict[str, str]) -> list[str]:
    """One line per sent tensor the server holds otherwise, with both digests; an excluded tensor
    is not verified, so never wrong.

    >>> mismatches({"w": "aa", "b": "bb", "n": "cc"}, {"w": "aa", "b": "ff"}, {"n": "repacked"})
    ['b: sent sha256 bb, served ff']
    """
    return [f"{n}: sent sha256 {d}, served {served.get(n, 'nothing')}"
            for n, d in sent.items() if n not in excluded and served.get(n) != d]


# ── at start: is the served model the one we train? ─────────────────────────────────────────
# (spec: AsyncGRPOConfig.dtype: 「不一致は、トレーニング開始時に警告としてログに記録されます」, a
# dtype mismatch is logged as a warning at training start.) weight_sync.check_servers and
# WeightSync.connect call these before anything is sent; `info` is a server's /server_info
# vllm_config.


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
        warnings.warn(f"{url} serves {model!r}, which this machine cannot read: a sync's names "
                      f"and shapes are not checked before they are sent", stacklevel=3)
        return
    unknown = [n for n, _ in specs if n not in served]
    wrong = [f"{n} {list(s)} (served {served[n]})" for n, s in specs
             if n in served and list(s) != served[n]]
    if unknown or wrong:
        raise ValueError(f"{url} serves {model!r}, whose weights are not the trained model's: "
                         f"unknown names {unknown[:5]}, other shapes {wrong[:5]}; nothing was "
                         f"sent (vLLM cannot survive a refused update): serve the model you train")


def served_dtype(info: dict) -> str | None:
    """The server's dtype without the "torch." prefix ("bfloat16"), or None if it is not said."""
    dtype = (info.get("model_config") or {}).get("dtype")
    return str(dtype).removeprefix("torch.") if dtype else None


def dtype_warning(url: str, info: dict, compute_dtype) -> str | None:
    """Why the trainer's and the server's log-probs differ in precision, with the fix; None when
    they agree (or the server does not say)."""
    served = served_dtype(info)
    ours = str(compute_dtype).removeprefix("torch.")
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


# ── start and adapters: the log-prob probe ──────────────────────────────────────────────────


def tolerance(dtype) -> float:
    """The probe's bound on max |Δ log p| for a served dtype (a torch.dtype or its name; unknown or
    None: the loosest)."""
    return TOLERANCE.get(str(dtype).removeprefix("torch."), max(TOLERANCE.values()))


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


def served_logprobs(client, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """PROBE_TOKENS tokens the server samples after `prompt` under `model` (a base card or an
    adapter's name), with each one's log-prob: temperature 1 and no truncation, so processed and
    raw log-probs agree (the sampling fields are explicit: vLLM fills absent ones from the model's
    generation_config)."""
    body = {"model": model, "prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "seed": PROBE_SEED, "logprobs": 0, "ignore_eos": True, "return_token_ids": True}
    choice = client.completions(body)["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@dataclass
class Probe:
    """One probe of one server: max |Δ log p| over its sampled tokens against the reference (gap),
    against the reference's base (base_gap), and between those two (moved: how far the adapter
    moves these tokens); the last two only for an adapter."""
    gap: float
    base_gap: float | None = None
    moved: float | None = None


class Reference:
    """The trainer's policy on rank 0's CPU, what the probes score with (state is real: a copy of
    the model). Every parameter of the (FSDP2-sharded) policy gathered whole, rounded to the served
    dtype and held in fp32, eager attention, no tree masks; a PeftModel stays one, so its adapter
    can be swapped in (load) and switched off (base=True).

        ref = Reference.build(policy.model, gathered(policy.model), "bfloat16")   # every rank
        ref.probe(client, "policy-3f9a1c-v5", adapter=True).gap                   # rank 0
    """

    def __init__(self, model, dtype: torch.dtype):
        self.model = model
        self.dtype = dtype
        self.vocab = model.get_input_embeddings().num_embeddings
        self.lock = threading.Lock()      # probes of several servers run in threads; base=True
                                          # switches the adapter off for the whole model

    @classmethod
    def build(cls, model, tensors, dtype) -> "Reference | None":
        """Every rank iterates `tensors`, (name, whole tensor) for each of model.named_parameters()
        (gathering them is a collective); rank 0 returns the copy, the other ranks None. The copy
        is made on the meta device and filled: parameters from `tensors`, buffers from the model,
        ties re-tied."""
        dtype = getattr(torch, str(dtype).removeprefix("torch."))
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        state = {}
        for name, t in tensors:                  # every rank: the gathers
            if rank0:
                state[name] = t.detach().to(dtype).float().cpu()
        if not rank0:
            return None
        peft = hasattr(model, "peft_config")
        hf = model.get_base_model() if peft else model
        with torch.device("meta"):
            twin = type(hf)._from_config(copy.deepcopy(hf.config), attn_implementation="eager",
                                         dtype=torch.float32)
            if peft:
                from peft import get_peft_model
                twin = get_peft_model(twin, copy.deepcopy(model.peft_config[model.active_adapter]))
        twin.to_empty(device="cpu")
        _, unexpected = twin.load_state_dict(state, strict=False)      # missing: tied copies
        if unexpected:
            raise ValueError(f"the probe's copy of {type(hf).__name__} has no {unexpected[:5]}")
        for name, b in model.named_buffers():
            twin.get_buffer(name).copy_(b)
        twin.tie_weights()
        return cls(twin.eval().requires_grad_(False), dtype)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy these tensors (by parameter name: an adapter's) into the copy, rounded the same."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t.to(self.dtype).float())

    def logprobs(self, prompt: list[int], tokens: list[int], base: bool = False) -> torch.Tensor:
        """[T] log-probs of `tokens` after `prompt`; base=True: with the adapter switched off."""
        ids = torch.tensor([prompt + tokens])                                       # [1, P + T]
        off = self.model.disable_adapter() if base else contextlib.nullcontext()
        with self.lock, torch.no_grad(), off:
            logits = self.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
        return logits.float().log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]

    def probe(self, client, model: str, base: bool = False, adapter: bool = False) -> Probe:
        """Probe `model` on the server against this copy (its base with base=True; adapter=True:
        against both, for an adapter's name)."""
        prompt = probe_prompt(self.vocab)
        tokens, served = served_logprobs(client, model, prompt)
        served = torch.tensor(served)                                               # [T]
        ours = self.logprobs(prompt, tokens, base)
        gap = float((served - ours).abs().max())
        if not adapter:
            return Probe(gap)
        plain = self.logprobs(prompt, tokens, base=True)
        return Probe(gap, float((served - plain).abs().max()), float((ours - plain).abs().max()))


def probe_refusal(probe: Probe, name: str, tol: float) -> str | None:
    """Why an adapter's probe says the server does not serve the trained adapter (None: it does):
    its log-probs are farther than `tol` from the trainer's, or, where the trained adapter moves
    the probe's log-probs by more than 2·tol (the two are told apart), within `tol` of the base's.

    >>> probe_refusal(Probe(gap=3e-5, base_gap=0.4, moved=0.4), "policy-v2", 1e-4) is None
    True
    >>> probe_refusal(Probe(gap=0.4, base_gap=2e-5, moved=0.4), "policy-v2", 1e-4)[:46]
    'its log-probs under policy-v2 are the base mod'
    """
    if probe.moved > 2 * tol and probe.base_gap <= tol:
        return (f"its log-probs under {name} are the base model's (within {probe.base_gap:.3g}), "
                f"which the trained adapter moves by {probe.moved:.3g}")
    if probe.gap > tol:
        return (f"its log-probs under {name} differ from the trainer's by up to {probe.gap:.3g} "
                f"(tolerance {tol:g})")
    return None

