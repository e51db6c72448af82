"""A small vLLM-compatible server on transformers: the embedded default where vLLM cannot run.

`python serve_local.py --model PATH_OR_ID` speaks the subset of vLLM 0.33's HTTP API that this
project uses (`reference/vllm_api.md` is the contract: paths, fields, status codes, reply shapes,
the plain-text LoRA replies), so the rollout process, weight sync and adapter sync run unchanged
on a CPU laptop, in CI and in tests. `--model toy` builds the offline toy model (`toy.py`).

    HTTP threads (ThreadingHTTPServer)         one engine thread, one step at a time
    ----------------------------------         -------------------------------------------------
    POST /v1/completions  ─┐                   admit waiting sequences while KV capacity allows
    POST /inference/v1/    ├─► waiting queue ─► one batched forward per adapter group  (B, L)
         generate         ─┘        ▲           sample each sequence from its processed logits
         ▲                          │ preempt   finish on EOS / stop ids / max_tokens
         └──── reply ◄── done event ┴────────── (most recently admitted, when KV overflows)

Every generated token is sampled from exactly the distribution whose log-prob is returned:
logits → repetition penalty → temperature → min-p → top-k → top-p (vLLM's order), masked tokens
are -inf; `--logprobs-mode processed_logprobs` returns the log-softmax of that, `raw_logprobs` the
log-softmax of the model's logits. temperature=0 is greedy (argmax of the penalised logits).

KV figures are real token counts: held = Σ over running sequences of (prompt + generated) tokens,
capacity = `--kv-cache-tokens` (default 16 × max_model_len). A waiting sequence is admitted only if
it fits in the free capacity; when running sequences grow past it, the most recently admitted goes
back to the front of the queue (a preemption; its tokens are kept and recomputed on readmission).

Where to find the flags a client may check: `/server_info` → `vllm_config.model_config` carries
`dtype`, `max_model_len`, `logprobs_mode`, `max_logprobs`, `return_sampling_mask` (as in vLLM);
`vllm_config.lora_config`, `vllm_config.weight_transfer_config` (null when off) and
`vllm_config.enable_scale_out` (ours only; with real vLLM probe `/inference/v1/generate` for 403).

Departures from vLLM, and why:
- No KV cache: every step recomputes each running sequence in full (right-padded batch, so causal
  attention never sees a pad). Exact and simple; O(L²) per step is fine for small models.
  "Blocks" are single tokens (`block_size` 1) and there is no prefix cache, so
  `/reset_prefix_cache` only preempts running requests when asked to and always succeeds.
- On CPU the engine uses one intra-op thread unless OMP_NUM_THREADS says otherwise: the trainer
  runs on the same cores, and a small model's step is many tiny ops that extra threads slow down.
- Sequences that name different LoRA adapters run as one forward per adapter in the same step.
  LoRA is applied by forward hooks (y += s·x·Aᵀ·Bᵀ) on the base model, so parameter names never
  change and full-weight updates still load by HF name. Plain LoRA only (no DoRA, no bias, no
  modules_to_save: refused with 400). More than `--max-loras` adapters evicts the least recently
  used one from the registry (vLLM keeps the name and reloads it from disk), so a request naming
  it afterwards gets 404; requests already running on it finish normally.
- Unknown request fields are refused with 400 (vLLM ignores them with a warning), so a typo never
  silently changes sampling. String prompts are tokenized (no special tokens added).
  `stop` strings, streaming, `min_tokens`, `prompt_logprobs` and the like do not exist here.
- n > 1: choice i uses a generator seeded with seed + i; without a seed, the server draws one
  from its own generator (`--seed`), so runs of the same server are reproducible.
- Weight transfer: the trainer (rank 0) owns a TCPStore at master_address:master_port; this
  server joins as rank `rank_offset` through `PrefixStore("weight_transfer", store)` and a
  ProcessGroupGloo (CPU) or ProcessGroupNCCL (`"backend": "nccl"`, CUDA). vLLM uses its own
  NCCL communicator instead; the HTTP sequence and the packed chunk layout are the same.
  `packed_num_buffers` only sets stream double-buffering in vLLM, which a blocking receive
  here does not need. A received update is applied in one go between two engine steps, so
  no forward ever mixes old and new weights. `/weight_checker` checksums are sha256 over each tensor's
  bytes in the server dtype; `compare` checks the names of the baseline it is given (or the
  last `checksum` taken). "Weight transfer not configured" is a 400 so clients do not retry.
  `/finish_weight_update` keeps loaded adapters (vLLM 0.33 drops the workers' copies and reloads
  them from disk on next use, which looks the same from outside).
"""
import argparse
import hashlib
import json
import math
import os
import re
import secrets
import sys
import threading
import time
import traceback
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist

# ── records ───────────────────────────────────────────────────────────────────────────────


class APIError(Exception):
    """An HTTP error reply in vLLM's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None,
                 bare: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.bare = status, message, type, param, bare

    def body(self) -> dict:
        if self.bare:                              # a few vLLM routes answer {"error": "<message>"}
            return {"error": self.message}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None      # top-k log-probs per token; -1 = whole vocabulary


@dataclass
class TokenLogprob:
    """One generated token's log-prob, its rank, and the top-k (token id, log-prob) by rank."""
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Adapter:
    """A loaded LoRA adapter: per module name, A (r, in) and B (out, r); y += scale · x Aᵀ Bᵀ."""
    name: str
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    adapter: Adapter | None
    seqs: list["Sequence"] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    """One choice of a request: what it generated so far and its own sampler."""
    request: Request
    index: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sampling_mask: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None

    def __len__(self) -> int:        # tokens this sequence holds in the KV budget
        return len(self.request.prompt) + len(self.token_ids)


# ── sampling ──────────────────────────────────────────────────────────────────────────────


def process_logits(logits: torch.Tensor, context: list[int], p: SamplingParams) -> torch.Tensor:
    """(V,) fp32 logits → (V,) processed logits in vLLM's order; removed tokens are -inf."""
    x = logits.clone()
    if p.repetition_penalty != 1.0:  # every token seen in prompt or output
        seen = torch.tensor(sorted(set(context)), device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.temperature == 0:           # greedy: vLLM applies nothing else
        return x
    x = x / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], -math.inf)  # ties with the k-th survive
    if p.top_p < 1.0:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs                       # mass of strictly likelier tokens
        x[order[mass_before >= p.top_p]] = -math.inf
    return x


# ── request parsing ───────────────────────────────────────────────────────────────────────

SAMPLING_FIELDS = {"max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                   "stop_token_ids", "ignore_eos", "logprobs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"model", "prompt", "return_token_ids", "return_tokens_as_token_ids", "stream"}
GENERATE_FIELDS = {"token_ids", "sampling_params", "model", "request_id", "stream"}
INIT_INFO_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "packed",
                    "packed_buffer_size_bytes", "packed_num_buffers"}


def check_fields(body: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"Unknown field(s) in {where}: {unknown}; serve_local.py accepts {sorted(allowed)}",
                       param=unknown[0])


def typed(body: dict, name: str, kind: type, default=None, ok=lambda v: True, rule: str = ""):
    """body[name] checked for type (bools are not ints) and `ok`; `default` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if kind is float and type(v) is int:
        v = float(v)
    if type(v) is not kind or not ok(v):
        raise APIError(400, f"Invalid {name}={v!r}: expected {kind.__name__} {rule}".rstrip(), param=name)
    return v


def parse_sampling(body: dict, eng: "Engine") -> SamplingParams:
    vocab = eng.vocab
    p = SamplingParams(
        max_tokens=typed(body, "max_tokens", int, 16, lambda v: v >= 1, ">= 1"),
        n=typed(body, "n", int, 1, lambda v: v >= 1, ">= 1"),
        temperature=typed(body, "temperature", float, 1.0, lambda v: v >= 0, ">= 0"),
        top_p=typed(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=typed(body, "top_k", int, 0, lambda v: v >= -1, "(-1 or 0 = off, else >= 1)"),
        min_p=typed(body, "min_p", float, 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        repetition_penalty=typed(body, "repetition_penalty", float, 1.0, lambda v: v > 0, "> 0"),
        seed=typed(body, "seed", int),
        stop_token_ids=typed(body, "stop_token_ids", list, [], lambda v: all(type(t) is int and 0 <= t < vocab
                             for t in v), f"of token ids in [0, {vocab})"),
        ignore_eos=typed(body, "ignore_eos", bool, False),
        logprobs=typed(body, "logprobs", int, None, lambda v: v >= -1, ">= -1"),
    )
    limit = vocab if eng.args.max_logprobs == -1 else eng.args.max_logprobs
    if p.logprobs is not None and (vocab if p.logprobs == -1 else p.logprobs) > limit:
        raise APIError(400, f"Requested logprobs={p.logprobs} exceeds --max-logprobs ({limit})", param="logprobs")
    return p


def check_prompt(ids, p: SamplingParams, eng: "Engine") -> list[int]:
    if type(ids) is not list or not ids or not all(type(t) is int and 0 <= t < eng.vocab for t in ids):
        raise APIError(400, f"A prompt must be a non-empty list of token ids in [0, {eng.vocab})", param="prompt")
    if len(ids) + p.max_tokens > eng.args.max_model_len:
        raise APIError(400, f"This model's maximum context length is {eng.args.max_model_len} tokens, but the request "
                       f"needs {len(ids) + p.max_tokens} ({len(ids)} prompt + {p.max_tokens} max_tokens); "
                       "shorten the prompt or lower max_tokens", param="max_tokens")
    return ids


# ── the engine ────────────────────────────────────────────────────────────────────────────


class Engine:
    """The model, the scheduler queues, loaded adapters and the weight-transfer group.

    `cond` guards the queues. The engine thread holds it to schedule a step and to sample from
    its logits, but not during the forward, so requests keep arriving while the model runs.
    Whatever must not overlap a step (aborts, preemptions, new weights, LoRA hooks) runs inside
    `between_steps`: it stops new steps from starting and waits for the one in flight, so no
    forward ever sees half-applied weights.
    """

    def __init__(self, model, tokenizer, args):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.name = args.model
        self.device = model.device
        self.vocab = model.get_input_embeddings().num_embeddings
        gen_eos = model.generation_config.eos_token_id
        self.eos_ids = {tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids.discard(None)
        self.cond = threading.Condition()
        self.stepping = False                      # from scheduling a step to sampling its tokens
        self.holds = 0                             # callers inside between_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in admission order
        self.pause_mode: str | None = None         # None | "abort" | "wait" | "keep"
        self.preemptions = self.steps = self.max_batch = 0
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self.active: Adapter | None = None          # read by the LoRA hooks during a forward
        self.hooked: set[str] = set()
        self.group = None                          # weight-transfer process group
        self.init_info: dict = {}
        self.last_update: tuple = ()
        self.weight_version = "default"
        self.baseline: dict[str, str] | None = None
        self.seeds = torch.Generator().manual_seed(args.seed)
        threading.Thread(target=self.loop, daemon=True, name="engine").start()

    # scheduling
    def held(self) -> int:
        return sum(len(s) for s in self.running)

    def loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: (self.running or self.waiting) and self.pause_mode != "keep"
                                       and not self.holds)
                    groups = self.schedule()
                try:
                    outputs = [(s, row) for adapter, seqs in groups.items()
                               for s, row in zip(seqs, self.forward(seqs, adapter))]
                    with self.cond:                # sample and end the step under one hold: /metrics never
                        for s, logits in outputs:  # sees finished requests running or usage above 1
                            self.sample(s, logits)
                        self.end_step()
                except Exception:                  # a bug or a bad model: fail this step's requests, keep serving
                    traceback.print_exc()
                    with self.cond:
                        for s in self.running:
                            s.request.error = traceback.format_exc(limit=1)
                            self.finish(s, "abort")
                        self.end_step()

    def schedule(self) -> dict[Adapter | None, list[Sequence]]:
        """Admit waiting sequences that fit; the running ones grouped by adapter, one forward each."""
        while self.waiting and self.held() + len(self.waiting[0]) <= self.args.kv_cache_tokens:
            self.running.append(self.waiting.popleft())
        self.stepping = True
        self.steps += 1
        self.max_batch = max(self.max_batch, len(self.running))
        groups: dict[Adapter | None, list[Sequence]] = {}
        for s in self.running:
            groups.setdefault(s.request.adapter, []).append(s)
        return groups

    def end_step(self) -> None:
        self.running = [s for s in self.running if not s.finish_reason]
        while self.held() > self.args.kv_cache_tokens and len(self.running) > 1:
            self.preempt([self.running[-1]])
        self.stepping = False
        self.cond.notify_all()

    @contextmanager
    def between_steps(self):
        """Hold `cond` with no step in flight and none starting until the block ends."""
        with self.cond:
            self.holds += 1
            try:
                self.cond.wait_for(lambda: not self.stepping)
                yield
            finally:
                self.holds -= 1
                self.cond.notify_all()

    def preempt(self, seqs: list[Sequence]) -> None:
        for s in reversed(seqs):                   # keep their order at the front of the queue
            self.running.remove(s)
            self.waiting.appendleft(s)
            self.preemptions += 1

    def finish(self, s: Sequence, reason: str, stop_reason: int | None = None) -> None:
        s.finish_reason, s.stop_reason = reason, stop_reason
        if all(q.finish_reason for q in s.request.seqs):
            s.request.done.set()

    def forward(self, seqs: list[Sequence], adapter: Adapter | None) -> torch.Tensor:
        """Next-token logits (B, V) fp32 for each sequence, from one padded forward."""
        rows = [s.request.prompt + s.token_ids for s in seqs]
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # (B, L) right-padded
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        last = torch.tensor([len(r) - 1 for r in rows])                       # (B,)
        keep, where = last.unique(return_inverse=True)                          # (K,), (B,)
        self.active = adapter
        try:
            out = self.model(input_ids=ids.to(self.device), logits_to_keep=keep.to(self.device), use_cache=False)
        finally:
            self.active = None
        return out.logits[torch.arange(len(rows)), where.to(self.device)].float()  # (B, K, V) → (B, V)

    def sample(self, s: Sequence, logits: torch.Tensor) -> None:
        p = s.request.params
        x = process_logits(logits, s.request.prompt + s.token_ids, p)          # (V,)
        if p.temperature == 0:
            token = int(x.argmax())
        else:
            token = int(torch.multinomial(x.softmax(-1), 1, generator=s.generator))
        if p.logprobs is not None:
            lp = (x if self.args.logprobs_mode == "processed_logprobs" else logits).log_softmax(-1)
            k = min(lp.numel() if p.logprobs == -1 else p.logprobs, int(lp.isfinite().sum()))
            top = lp.topk(k)
            s.logprobs.append(TokenLogprob(token, float(lp[token]), int((lp > lp[token]).sum()) + 1,
                                           list(zip(top.indices.tolist(), top.values.tolist()))))
        if self.args.return_sampling_mask:
            s.sampling_mask.append(x.isfinite().nonzero().flatten().tolist())
        s.token_ids.append(token)
        if len(s.token_ids) >= p.max_tokens:
            self.finish(s, "length")
        elif not p.ignore_eos and token in self.eos_ids:
            self.finish(s, "stop", None if token == self.tokenizer.eos_token_id else token)
        elif token in p.stop_token_ids:
            self.finish(s, "stop", token)

    # requests
    def adapter_for(self, model: str | None) -> Adapter | None:
        if model is None or model == self.name:
            return None
        with self.cond:
            if model not in self.adapters:
                raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            self.adapters.move_to_end(model)
            return self.adapters[model]

    def generate(self, prompts: list[list[int]], p: SamplingParams, adapter: Adapter | None) -> list[Request]:
        """Queue one request per prompt (n sequences each) and block until all have finished."""
        reqs = [Request(prompt, p, adapter) for prompt in prompts]
        with self.cond:
            if self.pause_mode in ("abort", "wait"):
                raise APIError(503, f"The server is paused (mode={self.pause_mode}); retry after /resume",
                               "ServiceUnavailableError")
            for r in reqs:
                seed = p.seed if p.seed is not None else int(torch.randint(2**62, (1,), generator=self.seeds))
                r.seqs = [Sequence(r, i, torch.Generator(self.device).manual_seed(seed + i)) for i in range(p.n)]
                self.waiting.extend(r.seqs)
            self.cond.notify_all()
        for r in reqs:
            r.done.wait()
            if r.error:
                raise APIError(500, f"Generation failed: {r.error}", "InternalServerError")
        return reqs

    def pause(self, mode: str, clear_cache: bool) -> None:
        with self.cond:
            self.pause_mode = mode                 # from now on: 503 in abort/wait, no new step in keep
            self.cond.notify_all()                 # keep → wait: the engine must wake up to drain
            if mode == "wait":
                self.cond.wait_for(lambda: not self.running and not self.waiting)
        with self.between_steps():
            if mode == "abort":
                for s in [*self.running, *self.waiting]:
                    self.finish(s, "abort")
                self.running.clear()
                self.waiting.clear()
            if clear_cache:
                self.preempt(list(self.running))

    def resume(self) -> None:
        with self.cond:
            self.pause_mode = None
            self.cond.notify_all()

    # LoRA
    def load_adapter(self, name: str, path: str) -> None:
        config_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(config_file):
            raise APIError(404, f"No LoRA adapter found at '{path}' (no adapter_config.json)", "NotFoundError",
                           "lora_path")
        with open(config_file) as f:
            cfg = json.load(f)
        unsupported = [k for k in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern")
                       if cfg.get(k)] + (["bias"] if cfg.get("bias", "none") != "none" else [])
        if unsupported:
            raise APIError(400, f"LoRA adapter '{name}' uses {unsupported}; serve_local.py supports plain LoRA only")
        if cfg["r"] > self.args.max_lora_rank:
            raise APIError(400, f"LoRA rank {cfg['r']} is greater than --max-lora-rank {self.args.max_lora_rank}")
        from safetensors.torch import load_file
        modules = dict(self.model.named_modules())
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in load_file(os.path.join(path, "adapter_model.safetensors")).items():
            m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
            if not m or not isinstance(modules.get(m[1]), torch.nn.Linear):
                raise APIError(400, f"LoRA adapter '{name}': tensor {key} does not target a Linear of the base model")
            pairs.setdefault(m[1], {})[m[2]] = t.to(self.device, self.model.dtype)
        scale = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
        adapter = Adapter(name, path, {k: (v["A"], v["B"]) for k, v in pairs.items()}, scale)
        with self.between_steps():
            for module in adapter.weights.keys() - self.hooked:
                modules[module].register_forward_hook(self.lora_hook(module))
                self.hooked.add(module)
        with self.cond:
            self.adapters[name] = adapter
            self.adapters.move_to_end(name)
            while len(self.adapters) > self.args.max_loras:
                evicted, _ = self.adapters.popitem(last=False)
                print(f"serve_local: evicted LoRA adapter '{evicted}' (more than --max-loras loaded)", flush=True)

    def lora_hook(self, module_name: str):
        def hook(module, inputs, output):          # output (B, L, out) += scale · (B, L, in) Aᵀ Bᵀ
            w = self.active.weights.get(module_name) if self.active else None
            return output if w is None else output + self.active.scale * (inputs[0] @ w[0].T @ w[1].T)
        return hook

    # weight transfer
    def join_group(self, info: dict) -> None:
        store = dist.TCPStore(info["master_address"], info["master_port"], info["world_size"], is_master=False,
                              timeout=timedelta(seconds=300))
        store = dist.PrefixStore("weight_transfer", store)
        rank, size = info["rank_offset"], info["world_size"]
        if self.args.weight_transfer_config["backend"] == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=300))
        else:
            self.group = dist.ProcessGroupNCCL(store, rank, size)
        self.init_info = info

    def receive(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
        """The tensors rank 0 broadcasts: one per tensor, or packed uint8 chunks (vLLM's layout)."""
        device = "cpu" if self.args.weight_transfer_config["backend"] == "gloo" else self.device
        opts = dist.BroadcastOptions()
        opts.rootRank = 0

        def broadcast(t: torch.Tensor) -> torch.Tensor:
            self.group.broadcast([t], opts).wait()
            return t

        if not self.init_info["packed"]:
            return [broadcast(torch.empty(s, dtype=d, device=device)) for d, s in zip(dtypes, shapes)]
        out, chunk, sizes = [], [], []

        def flush():
            buf = broadcast(torch.empty(sum(sizes), dtype=torch.uint8, device=device))  # (Σ bytes,)
            offset = 0
            for (d, s), n in zip(chunk, sizes):
                out.append(buf[offset:offset + n].clone().view(d).reshape(s))  # clone: aligned for view(d)
                offset += n
            chunk.clear()
            sizes.clear()

        for d, s in zip(dtypes, shapes):
            chunk.append((d, s))
            sizes.append(math.prod(s) * d.itemsize)
            if sum(sizes) > self.init_info["packed_buffer_size_bytes"]:  # flush after first exceeding
                flush()
        if chunk:
            flush()
        return out

    def update_weights(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        with self.between_steps(), torch.no_grad():
            state = self.model.state_dict()             # tied weights share storage: either name works
            unknown = [n for n in names if n not in state]
            wrong = [n for n, t in zip(names, tensors) if n in state and state[n].shape != t.shape]
            if unknown or wrong:
                raise APIError(400, f"Weight update rejected (nothing applied): unknown names {unknown}, "
                               f"wrong shapes {wrong}", param="update_info")
            for n, t in zip(names, tensors):
                state[n].copy_(t)

    def checksums(self) -> dict[str, str]:
        with self.between_steps():
            return {n: hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy()).hexdigest()
                    for n, t in self.model.state_dict().items()}


# ── routes ────────────────────────────────────────────────────────────────────────────────

ROUTES = {}


def route(method: str, path: str):
    def register(fn):
        ROUTES[method, path] = fn
        return fn
    return register


def flag(query: dict, name: str, default: bool) -> bool:
    v = query.get(name, str(default).lower())
    if v not in ("true", "false"):
        raise APIError(400, f"Query parameter {name} must be true or false, not {v!r}", param=name)
    return v == "true"


@route("GET", "/health")
def health(eng, body, query):
    return None


@route("GET", "/v1/models")
def models(eng, body, query):
    def card(id, root, parent, max_len):
        return {"id": id, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_len, "permission": []}
    with eng.cond:
        cards = [card(a.name, a.path, eng.name, None) for a in eng.adapters.values()]
    return {"object": "list", "data": [card(eng.name, eng.args.model_path, None, eng.args.max_model_len), *cards]}


@route("GET", "/server_info")
def server_info(eng, body, query):
    a = eng.args
    return {"vllm_config": {
        "model_config": {"model": a.model, "dtype": str(eng.model.dtype), "max_model_len": a.max_model_len,
                         "logprobs_mode": a.logprobs_mode, "max_logprobs": a.max_logprobs,
                         "return_sampling_mask": a.return_sampling_mask},
        "cache_config": cache_config(eng),
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
        "lora_config": {"max_lora_rank": a.max_lora_rank, "max_loras": a.max_loras} if a.enable_lora else None,
        "weight_transfer_config": a.weight_transfer_config,
        "enable_scale_out": a.enable_scale_out,
    }, "vllm_env": {}, "system_env": {}}


def cache_config(eng) -> dict:
    tokens = eng.args.kv_cache_tokens
    return {"block_size": 1, "num_gpu_blocks": tokens, "kv_cache_size_tokens": tokens}


@route("GET", "/get_world_size")
def world_size(eng, body, query):
    return {"world_size": 1}


@route("GET", "/metrics")
def metrics(eng, body, query):
    labels = f'engine="0",model_name="{eng.name}"'
    info = ",".join(f'{k}="{v}"' for k, v in cache_config(eng).items())
    with eng.cond:
        rows = [("gauge", "vllm:num_requests_running", labels, len(eng.running)),
                ("gauge", "vllm:num_requests_waiting", labels, len(eng.waiting)),
                ("gauge", "vllm:kv_cache_usage_perc", labels, eng.held() / eng.args.kv_cache_tokens),
                ("counter", "vllm:num_preemptions_total", labels, eng.preemptions),
                ("gauge", "vllm:cache_config_info", f"{info},{labels}", 1),
                ("counter", "serve_local:engine_steps_total", labels, eng.steps),     # ours: batching is visible
                ("gauge", "serve_local:max_batch_size", labels, eng.max_batch)]       # most sequences in one step
    return "".join(f"# TYPE {name} {kind}\n{name}{{{lab}}} {float(v)}\n" for kind, name, lab, v in rows)


@route("POST", "/v1/completions")
def completions(eng, body, query):
    check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    if body.get("stream"):
        raise APIError(400, "stream=true is not supported by serve_local.py", param="stream")
    p = parse_sampling(body, eng)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        prompts = [prompt] if isinstance(prompt, str) else prompt
        prompts = [eng.tokenizer.encode(t, add_special_tokens=False) if isinstance(t, str) else t for t in prompts]
    else:
        prompts = [prompt]
    prompts = [check_prompt(t, p, eng) for t in prompts]
    as_ids = typed(body, "return_tokens_as_token_ids", bool, False)
    with_ids = typed(body, "return_token_ids", bool, False)
    reqs = eng.generate(prompts, p, eng.adapter_for(body.get("model")))
    choices = []
    for r in reqs:
        for s in r.seqs:
            text_ids = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids  # the stop token has no text
            c = {"index": len(choices), "text": eng.tokenizer.decode(text_ids, skip_special_tokens=True),
                 "logprobs": None if p.logprobs is None else completion_logprobs(s, as_ids, eng.tokenizer),
                 "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
            if with_ids:
                c |= {"token_ids": s.token_ids, "prompt_token_ids": r.prompt}
            choices.append(c)
    return {"id": f"cmpl-{secrets.token_hex(16)}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or eng.name, "choices": choices, "usage": usage(reqs)}


def completion_logprobs(s: Sequence, as_ids: bool, tokenizer) -> dict:
    """vLLM's completion logprobs: per token the sampled one first, then the top-k, clamped at -9999."""
    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else tokenizer.decode([t])
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for lp in s.logprobs:
        token = name(lp.token_id)
        top = {token: max(lp.logprob, -9999.0)}
        for t, v in lp.top:
            top.setdefault(name(t), max(v, -9999.0))
        out["text_offset"].append(offset)
        out["token_logprobs"].append(max(lp.logprob, -9999.0))
        out["tokens"].append(token)
        out["top_logprobs"].append(top)
        offset += len(token)
    return out


def usage(reqs: list[Request]) -> dict:
    prompt = sum(len(r.prompt) for r in reqs)
    completion = sum(len(s.token_ids) for r in reqs for s in r.seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@route("POST", "/inference/v1/generate")
def generate(eng, body, query):
    if not eng.args.enable_scale_out:
        raise APIError(403, "/inference/v1/generate needs --enable-scale-out", "PermissionDeniedError")
    check_fields(body, GENERATE_FIELDS, "/inference/v1/generate")
    if body.get("stream"):
        raise APIError(400, "stream=true is not supported by serve_local.py", param="stream")
    sp = typed(body, "sampling_params", dict, {})
    check_fields(sp, SAMPLING_FIELDS | {"output_kind"}, "sampling_params")
    typed(sp, "output_kind", int, 2, lambda v: v == 2, "== 2 (FINAL_ONLY: replies come whole, never streamed)")
    p = parse_sampling(sp, eng)
    if eng.args.return_sampling_mask and not (p.temperature > 0 and p.top_k > 0):
        raise APIError(400, "With --return-sampling-mask every request needs temperature > 0 and top_k > 0",
                       param="sampling_params")
    prompt = check_prompt(body.get("token_ids"), p, eng)
    request_id = typed(body, "request_id", str) or secrets.token_hex(16)
    [r] = eng.generate([prompt], p, eng.adapter_for(body.get("model")))

    def entry(t: int, v: float, rank: int) -> dict:
        return {"token_id": t, "logprob": v, "rank": rank}
    choices = [{"index": s.index, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                "token_ids": s.token_ids,
                "logprobs": None if p.logprobs is None else {"content": [
                    entry(lp.token_id, lp.logprob, lp.rank) | {"top_logprobs": [
                        entry(t, v, i + 1) for i, (t, v) in enumerate(lp.top)]} for lp in s.logprobs]},
                "sampling_mask": s.sampling_mask if eng.args.return_sampling_mask else None} for s in r.seqs]
    return {"request_id": request_id,
            "model": body.get("model") or eng.name, "prompt_token_ids": prompt, "choices": choices,
            "usage": usage([r])}


@route("POST", "/pause")
def pause(eng, body, query):
    mode = query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise APIError(400, f"Invalid mode {mode!r}: use abort, wait or keep", bare=True)
    eng.pause(mode, flag(query, "clear_cache", True))
    return {"status": "paused"}


@route("POST", "/resume")
def resume(eng, body, query):
    eng.resume()
    return {"status": "resumed"}


@route("GET", "/is_paused")
def is_paused(eng, body, query):
    return {"is_paused": eng.pause_mode is not None}


@route("POST", "/reset_prefix_cache")
def reset_prefix_cache(eng, body, query):
    if flag(query, "reset_running_requests", False):
        with eng.between_steps():
            eng.preempt(list(eng.running))
    return {"success": True}


def needs_lora(eng) -> None:
    if not eng.args.enable_lora:
        raise APIError(404, "Not Found (start the server with --enable-lora)", "NotFoundError")


@route("POST", "/v1/load_lora_adapter")
def load_lora_adapter(eng, body, query):
    needs_lora(eng)
    name, path = typed(body, "lora_name", str), typed(body, "lora_path", str)
    if not name or not path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if name == eng.name:
        raise APIError(400, f"The LoRA adapter name '{name}' clashes with the base model name.", param="lora_name")
    if name in eng.adapters and not typed(body, "load_inplace", bool, False):
        raise APIError(400, f"The lora adapter '{name}' has already been loaded. "
                       "If you want to load the adapter in place, set 'load_inplace' to True.", param="lora_name")
    eng.load_adapter(name, path)
    return f"Success: LoRA adapter '{name}' added successfully."


@route("POST", "/v1/unload_lora_adapter")
def unload_lora_adapter(eng, body, query):
    needs_lora(eng)
    name = typed(body, "lora_name", str)
    with eng.cond:
        if eng.adapters.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
    return f"Success: LoRA adapter '{name}' removed successfully."


def needs_transfer(eng, initialised: bool = False) -> None:
    if eng.args.weight_transfer_config is None:
        raise APIError(400, "Weight transfer not configured (start the server with --weight-transfer-config)")
    if initialised and eng.group is None:
        raise APIError(400, "Weight transfer engine not initialised: POST /init_weight_transfer_engine first")


@route("POST", "/init_weight_transfer_engine")
def init_weight_transfer_engine(eng, body, query):
    needs_transfer(eng)
    info = typed(body, "init_info", dict, {})
    check_fields(info, INIT_INFO_FIELDS, "init_info")
    missing = {"master_address", "master_port", "rank_offset", "world_size"} - info.keys()
    if missing:
        raise APIError(400, f"Invalid init_info: missing {sorted(missing)}", param="init_info")
    eng.join_group({
        "master_address": typed(info, "master_address", str),
        "master_port": typed(info, "master_port", int, ok=lambda v: 0 < v < 65536, rule="in 1..65535"),
        "world_size": typed(info, "world_size", int, ok=lambda v: v >= 2, rule=">= 2"),
        "rank_offset": typed(info, "rank_offset", int, ok=lambda v: 0 < v < info["world_size"],
                             rule="in 1..world_size-1"),
        "packed": typed(info, "packed", bool, False),
        "packed_buffer_size_bytes": typed(info, "packed_buffer_size_bytes", int, 1 << 30, lambda v: v > 0, "> 0"),
        "packed_num_buffers": typed(info, "packed_num_buffers", int, 2, lambda v: v >= 1, ">= 1")})
    return {"message": "Weight transfer initialized"}


@route("POST", "/start_weight_update")
def start_weight_update(eng, body, query):
    needs_transfer(eng, initialised=True)
    return {"message": "Weight update started"}


@route("POST", "/update_weights")
def update_weights(eng, body, query):
    needs_transfer(eng, initialised=True)
    info = body.get("update_info")
    if isinstance(info, list):                     # one dict per worker rank; we are one worker
        info = info[0] if len(info) == 1 else None
    if not isinstance(info, dict):
        raise APIError(400, "update_info must be a dict, or a list with one dict per worker (world size 1)")
    check_fields(info, {"names", "dtype_names", "shapes"}, "update_info")
    names, dtype_names, shapes = info.get("names", []), info.get("dtype_names", []), info.get("shapes", [])
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise APIError(400, "update_info: names, dtype_names and shapes must have the same length")
    if not names:                                  # all empty: the previous round's metadata
        names, dtype_names, shapes = eng.last_update or ([], [], [])
    dtypes = [getattr(torch, d, None) for d in dtype_names]
    if not all(isinstance(d, torch.dtype) for d in dtypes):
        raise APIError(400, f"update_info: unknown dtype in {dtype_names}", param="dtype_names")
    eng.update_weights(names, eng.receive(names, dtypes, shapes))
    eng.last_update = (names, dtype_names, shapes)
    return {"message": "Weights updated"}


@route("POST", "/finish_weight_update")
def finish_weight_update(eng, body, query):
    needs_transfer(eng, initialised=True)
    eng.weight_version = typed(body, "weight_version", str, eng.weight_version)
    return {"message": "Weight update finished"}


@route("POST", "/shutdown_weight_transfer_engine")
def shutdown_weight_transfer_engine(eng, body, query):
    needs_transfer(eng)
    eng.group = None
    return {"message": "Weight transfer shut down"}


@route("POST", "/update_weight_version")
def update_weight_version(eng, body, query):
    eng.weight_version = typed(body, "new_version", str, eng.weight_version)
    return {"success": True, "new_version": eng.weight_version}


@route("GET", "/weight_info")
def weight_info(eng, body, query):
    return {"weight_version": eng.weight_version}


@route("POST", "/weight_checker")
def weight_checker(eng, body, query):
    action = body.get("action")
    if action == "checksum":
        eng.baseline = eng.checksums()
        return {"checksums": eng.baseline}
    if action == "reset":
        eng.baseline = None
        return {"status": "reset"}
    if action == "compare":
        baseline = typed(body, "baseline", dict, eng.baseline)
        if baseline is None:
            raise APIError(400, "compare needs a 'baseline' or an earlier 'checksum'", param="baseline")
        current = eng.checksums()
        mismatches = sorted(n for n, h in baseline.items() if current.get(n) != h)
        return {"match": not mismatches, "mismatches": mismatches}
    raise APIError(400, f"Unknown action {action!r}: use checksum, reset or compare", param="action")


# ── HTTP ──────────────────────────────────────────────────────────────────────────────────


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024                     # a rollout process opens many connections at once


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"                 # keep-alive; every reply has a Content-Length

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            fn = ROUTES.get((method, url.path))
            if fn is None:
                raise APIError(404, f"Not Found: {method} {url.path}", "NotFoundError")
            body = json.loads(raw) if raw.strip() else {}
            if not isinstance(body, dict):
                raise APIError(400, "The request body must be a JSON object")
            status, reply = 200, fn(self.server.engine, body, query)
        except json.JSONDecodeError as e:
            status, reply = 400, APIError(400, f"Invalid JSON body: {e}").body()
        except APIError as e:
            status, reply = e.status, e.body()
        except Exception as e:                     # a bug: answer 500 and keep serving
            traceback.print_exc()
            status, reply = 500, APIError(500, f"{type(e).__name__}: {e}", "InternalServerError").body()
        if reply is None:
            data, ctype = b"", "application/json"
        elif isinstance(reply, str):
            data, ctype = reply.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(reply).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):          # one line per request is noise for tests and runs
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face causal LM id or directory; 'toy' = toy.py's")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto = float32 on CPU, the checkpoint's dtype on CUDA (float32 checkpoints → bfloat16)")
    ap.add_argument("--weight-transfer-config", type=json.loads, help='e.g. \'{"backend":"gloo"}\' (or nccl on CUDA)')
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--return-sampling-mask", action="store_true")
    ap.add_argument("--enable-scale-out", action="store_true", help="enable POST /inference/v1/generate")
    ap.add_argument("--max-logprobs", type=int, default=20, help="-1 = the vocabulary size")
    ap.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    ap.add_argument("--kv-cache-tokens", type=int, help="KV capacity in tokens (default 16 × max_model_len)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    wt = args.weight_transfer_config
    if wt is not None and (set(wt) != {"backend"} or wt["backend"] not in ("gloo", "nccl")):
        sys.exit(f"serve_local.py: error: --weight-transfer-config must be {{\"backend\": \"gloo\"|\"nccl\"}}, "
                 f"got {wt}")
    if wt and wt["backend"] == "nccl" and not torch.cuda.is_available():
        sys.exit("serve_local.py: error: the nccl weight-transfer backend needs CUDA; use {\"backend\": \"gloo\"}")

    from transformers import AutoModelForCausalLM, AutoTokenizer
    if args.model == "toy":
        import toy
        args.model_path = toy.ensure_saved()
    else:
        args.model_path = args.model
    hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", args.model_path) and not args.model_path.startswith(".")
    if not hub_id and not os.path.isdir(args.model_path):
        sys.exit(f"serve_local.py: error: model directory {args.model_path!r} does not exist")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype="auto")
    except Exception as e:                         # one clear line, not a traceback
        sys.exit(f"serve_local.py: error: cannot load model {args.model_path!r}: {str(e).splitlines()[0]}")
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)
    else:
        dtype = torch.float32 if device == "cpu" else (torch.bfloat16 if model.dtype == torch.float32 else model.dtype)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    limit = model.config.max_position_embeddings
    args.max_model_len = args.max_model_len or limit
    if args.max_model_len > limit:
        sys.exit(f"serve_local.py: error: --max-model-len {args.max_model_len} exceeds the model's {limit} positions")
    args.kv_cache_tokens = args.kv_cache_tokens or 16 * args.max_model_len
    if args.kv_cache_tokens < args.max_model_len:
        sys.exit(f"serve_local.py: error: --kv-cache-tokens {args.kv_cache_tokens} cannot hold one sequence of "
                 f"--max-model-len {args.max_model_len}")
    torch.manual_seed(args.seed)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)                   # see the docstring: the trainer shares these cores

    httpd = Server((args.host, args.port), Handler)
    httpd.engine = Engine(model, tokenizer, args)
    print(f"serve_local: {args.model} ({dtype}, {device}) on http://{args.host}:{args.port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
