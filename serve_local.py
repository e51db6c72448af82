"""A small vLLM-compatible server on transformers: the embedded default where vLLM cannot run.

`python serve_local.py --model PATH_OR_ID` speaks the subset of vLLM 0.33's HTTP API that this
project uses (`reference/vllm_api.md` is the contract: paths, fields, status codes, reply shapes,
the plain-text LoRA replies), so the rollout process, weight sync and adapter sync run unchanged
on a CPU laptop, in CI and in tests. `--model toy` builds the offline toy model (`toy.py`).

This file is vLLM's contract: request parsing and validation, one function per route (the reply
shapes of the contract) and the CLI. Below it, `serve_http.py` is the transport (framing and bounding
bodies, JSON errors for every refusal, --api-key, noticing a client that went away), and
`serve_local_engine.py` the engine (continuous batching, KV accounting, sampling, LoRA by hooks, receiving
weights); their docstrings draw them and list their own departures from vLLM.

Validation follows vLLM's SamplingParams and protocol rules for every field we implement, before the
request reaches the engine (so one request's work is bounded before any lock is held):
    temperature  finite, in [0, 2]; 0 < t < 0.01 is raised to 0.01; 0 is greedy, which needs n = 1
    n            1 .. VLLM_MAX_N_SEQUENCES (16384), and prompts × n within it for a batch of prompts
    seed         64-bit signed (-1 = none); top_p (0, 1]; top_k >= -1; min_p [0, 1]; penalty finite > 0
    types        strict JSON types for every field, `model` included (a bool is not an int, "16" not 16)
A bad request gets a 4xx in vLLM's JSON shape; a failure while generating fails its own request (500)
and no other.

Where to find the flags a client may check: `/server_info` → `vllm_config.model_config` carries
`dtype`, `max_model_len`, `logprobs_mode`, `max_logprobs`, `return_sampling_mask` (as in vLLM);
`vllm_config.lora_config`, `vllm_config.weight_transfer_config` (null when off) and
`vllm_config.enable_scale_out` (ours only; with real vLLM probe `/inference/v1/generate` for 403).

Departures from vLLM, and why:
- There is no prefix cache (see serve_local_engine.py), so `/reset_prefix_cache` only preempts running
  requests when asked to and always succeeds.
- On CPU the engine uses one intra-op thread unless OMP_NUM_THREADS says otherwise: the trainer
  runs on the same cores, and a small model's step is many tiny ops that extra threads slow down.
- Unknown request fields are refused with 400 (vLLM ignores them with a warning), so a typo never
  silently changes sampling; types are strict where pydantic would coerce ("16", 16.0). String
  prompts are tokenized (no special tokens added).
  `stop` strings, streaming, `min_tokens`, `prompt_logprobs` and the like do not exist here.
- Weight transfer: `/weight_checker`'s `compare` checks the names of the baseline it is given (or the
  last `checksum` taken). "Weight transfer not configured" is a 400 so clients do not retry.
  `/finish_weight_update` keeps loaded adapters (vLLM 0.33 drops the workers' copies and reloads
  them from disk on next use, which looks the same from outside).
- `--api-server-count` (vLLM's API-server processes, which serialise log-probs in parallel) has no
  counterpart in one process: it is refused with that reason rather than accepted and ignored.
"""
import argparse
import json
import math
import os
import re
import secrets
import sys
import time

import torch

from serve_local_engine import APIError, Engine, Request, SamplingParams, Sequence
from serve_http import Server

# ── request parsing ───────────────────────────────────────────────────────────────────────

SAMPLING_FIELDS = {"max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                   "stop_token_ids", "ignore_eos", "logprobs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"model", "prompt", "return_token_ids", "return_tokens_as_token_ids", "stream"}
GENERATE_FIELDS = {"token_ids", "sampling_params", "model", "request_id", "stream"}
INIT_INFO_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "packed",
                    "packed_buffer_size_bytes", "packed_num_buffers"}
MAX_N = int(os.environ.get("VLLM_MAX_N_SEQUENCES", 16384))  # vLLM's bound on n, from the same variable
INT64 = (-2**63, 2**63 - 1)                                   # vLLM: seeds are 64-bit signed
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 2.0                 # vLLM: 0 < t < 0.01 becomes 0.01; t <= 2


def check_fields(body: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"Unknown field(s) in {where}: {unknown[:20]}; serve_local.py accepts {sorted(allowed)}",
                       param=str(unknown[0]))


def typed(body: dict, name: str, kind: type, default=None, ok=lambda v: True, rule: str = ""):
    """body[name] checked for type and `ok`; `default` when absent or null. Strict JSON types: bools are
    not ints, "16" is not a number; ints are accepted as floats, and a float must be finite."""
    v = body.get(name)
    if v is None:
        return default
    if kind is float and type(v) in (int, float):
        try:
            v = float(v)
        except OverflowError:                      # an integer literal beyond any float
            v = math.inf
        if not math.isfinite(v):
            raise APIError(400, f"{name} must be a finite number, got {body[name]!r:.40}", param=name)
    if type(v) is not kind or not ok(v):
        raise APIError(400, f"Invalid {name}={v!r:.200}: expected {kind.__name__} {rule}".rstrip(), param=name)
    return v


def parse_sampling(body: dict, eng: "Engine") -> SamplingParams:
    """vLLM's SamplingParams rules, for the fields we implement: temperature in [0, 2], raised to 0.01
    when below it (0 is greedy, where n must be 1), n in [1, VLLM_MAX_N_SEQUENCES], top_p in
    (0, 1], top_k >= -1 (-1 = 0 = off), min_p in [0, 1], repetition_penalty > 0, 64-bit seeds (-1 = none)."""
    vocab = eng.vocab
    temperature = typed(body, "temperature", float, 1.0, lambda v: 0 <= v <= MAX_TEMPERATURE,
                        f"in [0, {MAX_TEMPERATURE:g}]")
    p = SamplingParams(
        max_tokens=typed(body, "max_tokens", int, 16, lambda v: v >= 1, ">= 1"),
        n=typed(body, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"in [1, {MAX_N}] (VLLM_MAX_N_SEQUENCES)"),
        temperature=0.0 if temperature == 0 else max(temperature, MIN_TEMPERATURE),
        top_p=typed(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=max(0, typed(body, "top_k", int, 0, lambda v: v >= -1, "(-1 or 0 = off, else >= 1)")),
        min_p=typed(body, "min_p", float, 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        repetition_penalty=typed(body, "repetition_penalty", float, 1.0, lambda v: v > 0, "> 0"),
        seed=typed(body, "seed", int, None, lambda v: INT64[0] <= v <= INT64[1], "in the 64-bit signed range"),
        stop_token_ids=frozenset(typed(body, "stop_token_ids", list, [], lambda v: all(
            type(t) is int and 0 <= t < vocab for t in v), f"of token ids in [0, {vocab})")),
        ignore_eos=typed(body, "ignore_eos", bool, False),
        logprobs=typed(body, "logprobs", int, None, lambda v: v >= -1, ">= -1"),
    )
    if p.seed == -1:
        p.seed = None
    if p.temperature == 0:                         # greedy: vLLM resets the filters and needs n == 1
        p.top_p, p.top_k, p.min_p = 1.0, 0, 0.0
        if p.n > 1:
            raise APIError(400, f"n must be 1 when using greedy sampling, got {p.n}.", param="n")
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


def parse_prompts(prompt, p: SamplingParams, eng: "Engine") -> list[list[int]]:
    """vLLM's `prompt`: a string, token ids, or a batch of either; at most VLLM_MAX_N_SEQUENCES sequences
    in all (n per prompt), so one request's work is bounded before it reaches the engine (strings are
    bounded by the body size)."""
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, (str, list)) for t in prompt)
    prompts = prompt if batch else [prompt]
    if len(prompts) * p.n > MAX_N:
        raise APIError(400, f"{len(prompts)} prompts x n={p.n} sequences exceed {MAX_N} (VLLM_MAX_N_SEQUENCES)",
                       param="prompt")
    ids = [eng.tokenizer.encode(t, add_special_tokens=False) if isinstance(t, str) else t for t in prompts]
    return [check_prompt(t, p, eng) for t in ids]


# ── routes ────────────────────────────────────────────────────────────────────────────────

ROUTES = {}
WATCHING = set()                                   # routes that block on generation: they stop when the client goes


def route(method: str, path: str, watches_client: bool = False):
    """Register fn(eng, body, query) for method + path; a watching route also gets `alive`, a callable
    that turns False once its client has disconnected."""
    def register(fn):
        ROUTES[method, path] = fn
        if watches_client:
            WATCHING.add(fn)
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


@route("POST", "/v1/completions", watches_client=True)
def completions(eng, body, query, alive):
    check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    if typed(body, "stream", bool, False):
        raise APIError(400, "stream=true is not supported by serve_local.py", param="stream")
    p = parse_sampling(body, eng)
    prompts = parse_prompts(body.get("prompt"), p, eng)
    as_ids = typed(body, "return_tokens_as_token_ids", bool, False)
    with_ids = typed(body, "return_token_ids", bool, False)
    reqs = eng.generate(prompts, p, eng.adapter_for(typed(body, "model", str)), alive)
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


@route("POST", "/inference/v1/generate", watches_client=True)
def generate(eng, body, query, alive):
    if not eng.args.enable_scale_out:
        raise APIError(403, "/inference/v1/generate needs --enable-scale-out", "PermissionDeniedError")
    check_fields(body, GENERATE_FIELDS, "/inference/v1/generate")
    if typed(body, "stream", bool, False):
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
    [r] = eng.generate([prompt], p, eng.adapter_for(typed(body, "model", str)), alive)

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
    names = typed(info, "names", list, [], lambda v: all(type(n) is str for n in v), "of strings")
    dtype_names = typed(info, "dtype_names", list, [], lambda v: all(type(n) is str for n in v), "of strings")
    shapes = typed(info, "shapes", list, [], lambda v: all(type(s) is list and all(type(d) is int and d >= 0
                   for d in s) for s in v), "of lists of sizes >= 0")
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise APIError(400, "update_info: names, dtype_names and shapes must have the same length")
    if not names:                                  # all empty: the previous round's metadata
        names, dtype_names, shapes = eng.last_update or ([], [], [])
    dtypes = [getattr(torch, d, None) for d in dtype_names]
    if not all(isinstance(d, torch.dtype) for d in dtypes):
        raise APIError(400, f"update_info: unknown dtype in {dtype_names[:20]}", param="dtype_names")
    eng.check_update(names, shapes)                # before receiving: buffers are sized by the model's own shapes
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
    action = typed(body, "action", str)
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


# ── the server as a subprocess (the demo's, bench.py's and the tests') ─────────────────────────


class LocalServer:
    """`python serve_local.py ...` in its own process group (the demo's and the tests' vLLM stand-in);
    `url` once /health answers. stop() ends it and everything it started."""

    def __init__(self, model_dir: str, *args: str, log_path: str | None = None, startup_timeout: float = 120.0):
        import subprocess
        import tempfile

        import httpx
        from weight_sync import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")
        here = os.path.dirname(os.path.abspath(__file__))
        cmd = [sys.executable, os.path.join(here, "serve_local.py"), "--model", model_dir, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve_local.py exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"serve_local.py did not become healthy within {startup_timeout:g}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        import signal
        import subprocess
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


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
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                    help="require `Authorization: Bearer <key>` on every route but /health and /metrics "
                         "(default: $VLLM_API_KEY, as vLLM)")
    if any(a.split("=")[0] == "--api-server-count" for a in sys.argv[1:]):
        sys.exit("serve_local.py: error: --api-server-count sets vLLM's API-server processes; serve_local.py is one "
                 "process, so drop the flag here (keep it for `vllm serve`)")
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

    httpd = Server((args.host, args.port), ROUTES, WATCHING, Engine(model, tokenizer, args), args.api_key)
    print(f"serve_local: {args.model} ({dtype}, {device}) on http://{args.host}:{args.port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
