"""The vLLM HTTP contract (docs/vllm_api.md), the engine behind it: continuous batching on a
transformers model for local_vllm/server.py. `Engine` holds the model, the scheduler queues, the
loaded LoRA adapters and the weight-transfer group. `APIError` lives here because the engine refuses
some requests itself (an unknown adapter, a paused server, a bad adapter or weight update).

    HTTP threads (ThreadingHTTPServer)         one engine thread, one step at a time
    ----------------------------------         -------------------------------------------------
    POST /v1/completions  ─┐                   admit waiting sequences while KV capacity allows
    POST /inference/v1/    ├─► waiting queue ─► one batched forward per adapter group  (B, L)
         generate         ─┘        ▲           sample each sequence from its processed logits
         ▲                          │ preempt   finish on EOS / stop ids / max_tokens
         └──── reply ◄── done event ┴────────── (most recently admitted, when KV overflows)

Every token is sampled from exactly the distribution whose log-prob is returned (process_logits,
in vLLM's order). KV figures are real token counts (Engine.schedule). No request can hurt another
(Engine.loop): a forward that raises fails its adapter group, a sampling that raises fails its own
request, and a caller that goes away aborts its sequences between two steps (Engine.generate).

    engine = Engine(model, tokenizer, args)     # args: server.py's CLI; starts its thread
    [request] = engine.generate([prompt_ids], SamplingParams(max_tokens=8), adapter=None)

Departures from vLLM, one line each:
- No KV or prefix cache, blocks of one token: each step recomputes every sequence, O(L²), exact.
- One forward per LoRA adapter in a step; LoRA by forward hooks, so parameter names never change.
- Plain LoRA only: DoRA, a bias or modules_to_save are refused with 400.
- Past --max-loras the least recently used adapter is forgotten (vLLM reloads it): 404 after.
- n > 1: choice i is seeded with seed + i; without a seed, one from the server's --seed generator.
- Weight transfer by a torch.distributed group (Engine.join_group), not vLLM's NCCL communicator.
- packed_num_buffers sets vLLM's double-buffering, which a blocking receive here does not need.
- The fault switch (tests): ASYNC_GRPO_FAULT_NOISE=<tensor name> adds noise to that tensor after
  every weight update or adapter load that brings it (fault_noise); off unless set.
"""
import hashlib
import json
import math
import os
import re
import threading
import traceback
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from vllm_plugin.weight_digests import fingerprint
from vllm_plugin.weight_group import weight_group

FAULT = "ASYNC_GRPO_FAULT_NOISE"    # the fault switch: a tensor name (vllm_plugin/ reads it too)

# ── records ───────────────────────────────────────────────────────────────────────────────


class APIError(Exception):
    """An HTTP error reply in vLLM's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError",
                 param: str | None = None, bare: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.bare = bare                           # a few vLLM routes answer {"error": "<message>"}

    def body(self) -> dict:
        if self.bare:
            return {"error": self.message}
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


class Cancelled(Exception):
    """generate() gave up because its caller went away; the request's sequences were aborted."""


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
    stop_token_ids: frozenset[int] = frozenset()
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


# ── loading and sampling ──────────────────────────────────────────────────────────────────


def load_model(model_path: str, dtype_name: str):
    """(model, tokenizer) of a hub id or directory, on CUDA when there is one, for inference.
    dtype_name "auto": float32 on CPU, the checkpoint's dtype on CUDA (float32 → bfloat16).
    A RuntimeError of one line when it cannot be loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
    except Exception as e:
        raise RuntimeError(f"cannot load model {model_path!r}: {str(e).splitlines()[0]}") from None
    if dtype_name != "auto":
        dtype = getattr(torch, dtype_name)
    elif device == "cpu":
        dtype = torch.float32
    else:
        dtype = torch.bfloat16 if model.dtype == torch.float32 else model.dtype
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), tokenizer


def process_logits(logits: torch.Tensor, context: list[int], p: SamplingParams) -> torch.Tensor:
    """(V,) fp32 logits → (V,) processed logits in vLLM's order; removed tokens are -inf:

        logits → repetition penalty → temperature → min-p → top-k → top-p

    temperature=0 is greedy (argmax of the penalised logits). `--logprobs-mode processed_logprobs`
    returns the log-softmax of the result, `raw_logprobs` that of the model's logits.
    """
    x = logits.clone()
    big = torch.finfo(x.dtype).max
    if p.repetition_penalty != 1.0:  # every token seen in prompt or output; stays finite
        seen = torch.tensor(sorted(set(context)), device=x.device)
        v = x[seen]
        penalised = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        x[seen] = penalised.clamp(-big, big)
    if p.temperature == 0:           # greedy: vLLM applies nothing else
        return x
    x = (x / p.temperature).clamp(max=big)   # a tiny penalty or temperature: finite, no NaN
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], -math.inf)  # ties with the k-th survive
    if p.top_p < 1.0:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p          # mass of strictly likelier tokens
        drop[0] = False                       # the likeliest stays (a tiny top_p is 0 in fp32)
        x[order[drop]] = -math.inf
    return x


def fault_noise(t: torch.Tensor) -> torch.Tensor:
    """`t` corrupted, as the fault switch does: plus Gaussian noise of its mean magnitude (seed 0,
    the same every time), enough to move log-probs visibly."""
    noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
    return t + noise.to(t.device, t.dtype) * t.abs().mean().clamp(min=1e-3)


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
        self.model = model
        self.tokenizer = tokenizer
        self.args = args
        self.name = args.model
        self.device = model.device
        self.vocab = model.get_input_embeddings().num_embeddings
        gen_eos = model.generation_config.eos_token_id
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = {tokenizer.eos_token_id} | set(gen_eos)
        self.eos_ids.discard(None)
        self.cond = threading.Condition()
        self.stepping = False                      # from scheduling a step to sampling its tokens
        self.holds = 0                             # callers inside between_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in admission order
        self.pause_mode: str | None = None         # None | "abort" | "wait" | "keep"
        self.preemptions = 0
        self.steps = 0
        self.max_batch = 0                         # most sequences in one step
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self.active: Adapter | None = None         # read by the LoRA hooks during a forward
        self.hooked: set[str] = set()
        self.group = None                          # weight-transfer process group
        self.init_info: dict = {}
        self.updating = False                      # between /start_ and /finish_weight_update
        self.last_update: tuple = ()
        self.weight_version = "default"
        self.baseline: dict[str, str] | None = None
        self.fault = os.environ.get(FAULT)          # the fault switch: None (off) or a name
        self.seeds = torch.Generator().manual_seed(args.seed)
        threading.Thread(target=self.loop, daemon=True, name="engine").start()

    # scheduling
    def held(self) -> int:
        return sum(len(s) for s in self.running)

    def ready(self) -> bool:
        """Work to do, not frozen by pause(mode=keep), and nobody waiting in between_steps."""
        return bool(self.running or self.waiting) and self.pause_mode != "keep" and not self.holds

    def loop(self) -> None:
        """Step after step: schedule under `cond`, forward without it (one forward per adapter
        group), then sample and end the step under one hold, so /metrics never sees finished
        requests running or usage above 1. A forward that raises (a bad adapter, a bug) fails its
        adapter group; a sampling that raises fails its own request; the others go on."""
        with torch.inference_mode():
            while True:
                with self.cond:
                    self.cond.wait_for(self.ready)
                    groups = self.schedule()
                outputs = []
                failed = []
                for adapter, seqs in groups.items():
                    try:
                        outputs += zip(seqs, self.forward(seqs, adapter))
                    except Exception as e:
                        traceback.print_exc()
                        failed += [(s, f"{type(e).__name__}: {e}") for s in seqs]
                with self.cond:
                    for s, logits in outputs:
                        try:
                            self.sample(s, logits)
                        except Exception as e:
                            failed.append((s, f"{type(e).__name__}: {e}"))
                    for s, error in failed:
                        self.fail(s.request, error)
                    self.end_step()

    def schedule(self) -> dict[Adapter | None, list[Sequence]]:
        """Admit waiting sequences that fit; the running ones grouped by adapter, a forward each.

        KV figures are real token counts: held = Σ over running sequences of (prompt + generated)
        tokens, capacity = --kv-cache-tokens (default 16 × max_model_len). A waiting sequence is
        admitted only if it fits in the free capacity (end_step preempts when running ones grow).
        """
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
        """Drop finished sequences; while the running ones hold more than the KV capacity, the most
        recently admitted goes back to the front of the queue (a preemption: its tokens are kept
        and recomputed on readmission)."""
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
        s.finish_reason = reason
        s.stop_reason = stop_reason
        if all(q.finish_reason for q in s.request.seqs):
            s.request.done.set()

    def fail(self, r: Request, error: str) -> None:
        """End every sequence of one request with an error (under `cond`); its client gets a 500."""
        r.error = r.error or error
        for s in r.seqs:
            if not s.finish_reason:
                self.finish(s, "abort")
        self.waiting = deque(s for s in self.waiting if s.request is not r)

    def abort(self, reqs: list[Request]) -> None:
        """Drop requests whose client has gone, between two steps."""
        with self.between_steps():
            for r in reqs:
                for s in r.seqs:
                    if not s.finish_reason:
                        self.finish(s, "abort")
            self.running = [s for s in self.running if not s.finish_reason]
            self.waiting = deque(s for s in self.waiting if not s.finish_reason)

    def forward(self, seqs: list[Sequence], adapter: Adapter | None) -> torch.Tensor:
        """Next-token logits (B, V) fp32 for each sequence, from one forward without KV cache:
        each sequence in full, right-padded so causal attention never sees a pad (O(L²) a step)."""
        rows = [s.request.prompt + s.token_ids for s in seqs]
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # (B, L) right-padded
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        last = torch.tensor([len(r) - 1 for r in rows])                       # (B,)
        keep, where = last.unique(return_inverse=True)                        # (K,), (B,)
        self.active = adapter
        try:
            out = self.model(input_ids=ids.to(self.device), logits_to_keep=keep.to(self.device),
                             use_cache=False)
        finally:
            self.active = None
        logits = out.logits[torch.arange(len(rows)), where.to(self.device)]     # (B, K, V) → (B, V)
        return logits.float()

    def sample(self, s: Sequence, logits: torch.Tensor) -> None:
        p = s.request.params
        if logits.isnan().any():
            raise ValueError("the model produced NaN logits for this request")
        x = process_logits(logits, s.request.prompt + s.token_ids, p)          # (V,)
        if p.temperature == 0:
            token = int(x.argmax())
        else:
            token = int(torch.multinomial(x.softmax(-1), 1, generator=s.generator))
        if p.logprobs is not None:
            lp = (x if self.args.logprobs_mode == "processed_logprobs" else logits).log_softmax(-1)
            k = min(lp.numel() if p.logprobs == -1 else p.logprobs, int(lp.isfinite().sum()))
            top = lp.topk(k)
            rank = int((lp > lp[token]).sum()) + 1
            s.logprobs.append(TokenLogprob(token, float(lp[token]), rank,
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
                raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError",
                               "model")
            self.adapters.move_to_end(model)
            return self.adapters[model]

    def generate(self, prompts: list[list[int]], p: SamplingParams, adapter: Adapter | None,
                 alive=None, poll_s: float = 0.1) -> list[Request]:
        """Queue one request per prompt (n sequences each) and block until all have finished; if
        alive() (None: always) turns False meanwhile, the client disconnected: abort them all
        and raise Cancelled, so nothing keeps generating for nobody."""
        reqs = [Request(prompt, p, adapter) for prompt in prompts]
        with self.cond:
            if self.pause_mode in ("abort", "wait"):
                raise APIError(503, f"The server is paused (mode={self.pause_mode}); retry after "
                               "/resume", "ServiceUnavailableError")
            for r in reqs:
                seed = p.seed
                if seed is None:
                    seed = int(torch.randint(2**63 - 1, (1,), generator=self.seeds))
                r.seqs = [Sequence(r, i, torch.Generator(self.device).manual_seed(seed + i))
                          for i in range(p.n)]
                self.waiting.extend(r.seqs)
            self.cond.notify_all()
        for r in reqs:
            while not r.done.wait(poll_s):
                if alive is not None and not alive():
                    self.abort(reqs)
                    raise Cancelled
            if r.error:
                raise APIError(500, f"Generation failed: {r.error}", "InternalServerError")
        return reqs

    def pause(self, mode: str, clear_cache: bool) -> None:
        with self.cond:
            self.pause_mode = mode                 # now: 503 in abort/wait, no new step in keep
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
        """Read, hook (once per module, between steps) and register an adapter. Past --max-loras
        the least recently used is forgotten (vLLM reloads it from disk): naming it then is a 404,
        while requests already running on it finish normally."""
        config_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(config_file):
            raise APIError(404, f"No LoRA adapter found at '{path}' (no adapter_config.json)",
                           "NotFoundError", "lora_path")
        try:
            adapter = self.read_adapter(name, path, config_file)
        except APIError:
            raise
        except Exception as e:                     # unreadable or malformed files: the request's
            raise APIError(400, f"LoRA adapter '{name}' at '{path}' cannot be read: "
                           f"{type(e).__name__}: {e}", param="lora_path") from e
        modules = dict(self.model.named_modules())
        with self.between_steps():
            for module in adapter.weights.keys() - self.hooked:
                modules[module].register_forward_hook(self.lora_hook(module))
                self.hooked.add(module)
        with self.cond:
            self.adapters[name] = adapter
            self.adapters.move_to_end(name)
            while len(self.adapters) > self.args.max_loras:
                evicted, _ = self.adapters.popitem(last=False)
                print(f"local_vllm: evicted LoRA adapter '{evicted}' (more than --max-loras "
                      "loaded)", flush=True)

    def read_adapter(self, name: str, path: str, config_file: str) -> Adapter:
        """adapter_config.json + adapter_model.safetensors → an Adapter, every shape checked."""
        with open(config_file) as f:
            cfg = json.load(f)
        options = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern")
        unsupported = [k for k in options if cfg.get(k)]
        if cfg.get("bias", "none") != "none":
            unsupported.append("bias")
        if unsupported:
            raise APIError(400, f"LoRA adapter '{name}' uses {unsupported}; local_vllm "
                           "supports plain LoRA only")
        r = cfg["r"]
        alpha = cfg["lora_alpha"]
        if type(r) is not int or r < 1 or type(alpha) not in (int, float):
            raise APIError(400, f"LoRA adapter '{name}': r={r!r} and lora_alpha={alpha!r} must be "
                           "numbers, r >= 1")
        if r > self.args.max_lora_rank:
            raise APIError(400, f"LoRA rank {r} is greater than --max-lora-rank "
                           f"{self.args.max_lora_rank}")
        from safetensors.torch import load_file
        modules = dict(self.model.named_modules())
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in load_file(os.path.join(path, "adapter_model.safetensors")).items():
            m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
            module = modules.get(m[1]) if m else None
            if not isinstance(module, torch.nn.Linear):
                raise APIError(400, f"LoRA adapter '{name}': tensor {key} does not target a "
                               "Linear of the base model")
            want = (r, module.in_features) if m[2] == "A" else (module.out_features, r)
            if tuple(t.shape) != want:
                raise APIError(400, f"LoRA adapter '{name}': {key} has shape {tuple(t.shape)}, "
                               f"expected {want}")
            t = fault_noise(t) if key == self.fault else t
            pairs.setdefault(m[1], {})[m[2]] = t.to(self.device, self.model.dtype)
        if any(len(v) != 2 for v in pairs.values()):
            raise APIError(400, f"LoRA adapter '{name}': every module needs both lora_A and lora_B")
        scale = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
        return Adapter(name, path, {k: (v["A"], v["B"]) for k, v in pairs.items()}, scale)

    def lora_hook(self, module_name: str):
        """A forward hook on the base model: parameter names never change, so full-weight updates
        still load by HF name; it adds the active adapter's term, if it has this module."""
        def hook(module, inputs, output):          # output (B, L, out) += s · (B, L, in) Aᵀ Bᵀ
            w = self.active.weights.get(module_name) if self.active else None
            if w is None:
                return output
            return output + self.active.scale * (inputs[0] @ w[0].T @ w[1].T)
        return hook

    # weight transfer
    def join_group(self, info: dict) -> None:
        """Join the trainer's weight-transfer group as rank `rank_offset`, gloo (CPU) or NCCL
        ("backend": "nccl", CUDA), as our gloo plugin joins it (vllm_plugin/weight_group.py).
        vLLM uses its own NCCL communicator instead; the HTTP sequence and the packed chunk
        layout are the same."""
        try:
            self.group = weight_group(info["master_address"], info["master_port"],
                                      info["world_size"], info["rank_offset"],
                                      self.args.weight_transfer_config["backend"], 300)
        except (RuntimeError, ValueError) as e:    # no trainer there (DistNetworkError, ...)
            raise APIError(400, f"Could not join the weight-transfer group at "
                           f"{info['master_address']}:{info['master_port']}: {e}",
                           param="init_info") from e
        self.init_info = info

    def receive(self, names: list[str], dtypes: list[torch.dtype],
                shapes: list[list[int]]) -> list[torch.Tensor]:
        """The tensors rank 0 broadcasts: one per tensor, or packed uint8 chunks (vLLM's layout).
        A chunk is flushed once its running total first exceeds packed_buffer_size_bytes."""
        device = "cpu" if self.args.weight_transfer_config["backend"] == "gloo" else self.device
        opts = dist.BroadcastOptions()
        opts.rootRank = 0

        def broadcast(t: torch.Tensor) -> torch.Tensor:
            self.group.broadcast([t], opts).wait()
            return t

        if not self.init_info["packed"]:
            return [broadcast(torch.empty(s, dtype=d, device=device))
                    for d, s in zip(dtypes, shapes)]
        out, chunk, sizes = [], [], []             # tensors; the open chunk: (dtype, shape), bytes

        def flush():
            buf = broadcast(torch.empty(sum(sizes), dtype=torch.uint8, device=device))  # (Σ bytes,)
            offset = 0
            for (d, s), n in zip(chunk, sizes):
                piece = buf[offset:offset + n].clone()       # clone: aligned for view(d)
                out.append(piece.view(d).reshape(s))
                offset += n
            chunk.clear()
            sizes.clear()

        for d, s in zip(dtypes, shapes):
            chunk.append((d, s))
            sizes.append(math.prod(s) * d.itemsize)
            if sum(sizes) > self.init_info["packed_buffer_size_bytes"]:
                flush()
        if chunk:
            flush()
        return out

    def check_update(self, names: list[str], shapes: list[list[int]]) -> None:
        """Refuse an update that names unknown tensors or other shapes, before the model is
        touched (its buckets were received: the trainer's send must complete)."""
        state = self.model.state_dict()            # tied weights share storage: either name works
        unknown = [n for n in names if n not in state]
        wrong = [n for n, s in zip(names, shapes) if n in state and list(state[n].shape) != s]
        if unknown or wrong:
            raise APIError(500, f"Weight update refused (received and dropped, the model is "
                           f"unchanged): unknown names {unknown[:20]}, wrong shapes {wrong[:20]}",
                           "InternalServerError", "update_info")

    def update_weights(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Apply a received update in one go between two engine steps, so no forward ever mixes
        old and new weights."""
        with self.between_steps(), torch.no_grad():
            state = self.model.state_dict()
            for n, t in zip(names, tensors):
                state[n].copy_(fault_noise(t) if n == self.fault else t)

    def checksums(self) -> dict[str, str]:
        """sha256 over each tensor's bytes in the server dtype, by state-dict name (vLLM's
        /weight_checker)."""
        def sha256(t: torch.Tensor) -> str:
            return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8)
                                  .numpy()).hexdigest()
        with self.between_steps():
            return {n: sha256(t) for n, t in self.model.state_dict().items()}

    def digests(self, names: list[str]) -> dict:
        """Our worker extension's reply (vllm_plugin/weight_digests.py): the fingerprint of each
        named tensor as the model holds it now; a name it lacks is excluded, with why."""
        with self.between_steps():
            state = self.model.state_dict()
            return {"digests": {n: fingerprint(state[n]) for n in names if n in state},
                    "excluded": {n: "no such tensor" for n in names if n not in state}}
