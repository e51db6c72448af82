"""The vLLM HTTP contract (docs/vllm_api.md; 概要 (Overview) for the server flags): a small
vLLM-compatible server on transformers, the embedded default where vLLM cannot run. It speaks the
subset of vLLM 0.33's API this project uses, so the rollout process, weight sync and adapter sync
run unchanged on a CPU laptop, in CI and in tests.

    python -m local_vllm.server --model PATH_OR_ID     # --model toy: the offline toy model (toy.py)

    client ──► transport.py ──────────► server.py (+ requests.py) ─► engine.py
               the transport: framing,   the contract: parsing and  the engine: continuous
               bounded bodies, JSON      validation (parse_*), one  batching, KV accounting,
               errors, --api-key, a      function per route         sampling, LoRA by hooks,
               client gone → Cancelled   (ROUTES), the CLI (main)   receiving weights

A bad request gets a 4xx in vLLM's JSON shape before it reaches the engine (parse_sampling); a
failure while generating fails its own request (500) and no other. As in vLLM, what its worker
refuses in a weight-sync call is a 500, and the connection closes after any 5xx (uvicorn); any
failed /update_weights ends the session, and an engine that joined no group (a restarted server:
weight version "default") opens a session but refuses the update, as vLLM's worker does. Flags
a client may check: /server_info → vllm_config (server_info; enable_scale_out is ours: with
vLLM, probe for a 403). As in vLLM, the pause, weight-transfer and server-info routes (dev=True)
exist only with VLLM_SERVER_DEV_MODE=1 (launch.LocalServer sets it); without it they answer 404.

Departures from vLLM, one line each:
- No prefix cache (engine.py): /reset_prefix_cache preempts if asked, always succeeds.
- On CPU, one intra-op thread unless OMP_NUM_THREADS is set: the trainer runs on the same cores.
- Requests are checked strictly (requests.py): unknown fields and coercible types are a 400.
- No stop strings, streaming, min_tokens or prompt_logprobs; string prompts get no special tokens.
- /weight_checker's compare checks the names of the baseline it is given (or the last checksum).
- /collective_rpc knows one method, weight_digests, our worker extension (vllm_plugin/), built in:
  as vLLM started with --worker-extension-cls weight_digests.WeightDigests (the flag is accepted).
- A refused weight update is received, dropped and answered 500 with the model untouched, as
  vllm_plugin/'s gloo backend does (vLLM's own engines reload first and cannot generate after).
- /finish_weight_update keeps loaded adapters (vLLM reloads them from disk: the same from outside).
- --api-server-count (vLLM's API processes) is refused with the reason: this is one process.
"""
import argparse
import json
import os
import re
import secrets
import sys
import time

import torch

from local_vllm.transport import Server
from local_vllm.engine import APIError, Engine, Request, Sequence, load_model
from local_vllm.requests import (COMPLETION_FIELDS, GENERATE_FIELDS, INIT_INFO_FIELDS,
                                 SAMPLING_FIELDS, check_fields, check_prompt, parse_prompts,
                                 parse_sampling, typed)

# ── routes ────────────────────────────────────────────────────────────────────────────────

ROUTES = {}
WATCHING = set()                   # routes that block on generation: they stop when the client goes
DEV = set()                        # (method, path) of the routes only VLLM_SERVER_DEV_MODE=1 has


def route(method: str, path: str, watches_client: bool = False, dev: bool = False):
    """Register fn(eng, body, query) for method + path; a watching route also gets `alive`, a
    callable that turns False once its client has disconnected. A dev route exists only in dev
    mode: vLLM registers its dev and RL routers (routers.py) only with VLLM_SERVER_DEV_MODE=1."""
    def register(fn):
        ROUTES[method, path] = fn
        if watches_client:
            WATCHING.add(fn)
        if dev:
            DEV.add((method, path))
        return fn
    return register


def served_routes() -> dict:
    """The routes this server has: all of them in dev mode (read at start, as vLLM's
    envs.VLLM_SERVER_DEV_MODE: an integer), else all but DEV, which answer 404."""
    dev_mode = bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))
    return {key: fn for key, fn in ROUTES.items() if dev_mode or key not in DEV}


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
        return {"id": id, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": root, "parent": parent, "max_model_len": max_len, "permission": []}
    with eng.cond:
        cards = [card(a.name, a.path, eng.name, None) for a in eng.adapters.values()]
    base = card(eng.name, eng.args.model_path, None, eng.args.max_model_len)
    return {"object": "list", "data": [base, *cards]}


@route("GET", "/server_info", dev=True)
def server_info(eng, body, query):
    args = eng.args
    model_config = {"model": args.model_path, "dtype": str(eng.model.dtype),
                    "max_model_len": args.max_model_len, "logprobs_mode": args.logprobs_mode,
                    "max_logprobs": args.max_logprobs,
                    "return_sampling_mask": args.return_sampling_mask}
    lora = {"max_lora_rank": args.max_lora_rank, "max_loras": args.max_loras}
    return {"vllm_config": {
        "model_config": model_config,
        "cache_config": cache_config(eng),
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1,
                            "pipeline_parallel_size": 1},
        "lora_config": lora if args.enable_lora else None,
        "weight_transfer_config": args.weight_transfer_config,
        "enable_scale_out": args.enable_scale_out,
    }, "vllm_env": {}, "system_env": {}}


def cache_config(eng) -> dict:
    tokens = eng.args.kv_cache_tokens
    return {"block_size": 1, "num_gpu_blocks": tokens, "kv_cache_size_tokens": tokens}


@route("GET", "/get_world_size", dev=True)
def world_size(eng, body, query):
    return {"world_size": 1}


@route("GET", "/metrics")
def metrics(eng, body, query):
    labels = f'engine="0",model_name="{eng.name}"'
    info = ",".join(f'{k}="{v}"' for k, v in cache_config(eng).items())
    with eng.cond:
        usage_perc = eng.held() / eng.args.kv_cache_tokens
        rows = [("gauge", "vllm:num_requests_running", labels, len(eng.running)),
                ("gauge", "vllm:num_requests_waiting", labels, len(eng.waiting)),
                ("gauge", "vllm:kv_cache_usage_perc", labels, usage_perc),
                ("counter", "vllm:num_preemptions_total", labels, eng.preemptions),
                ("gauge", "vllm:cache_config_info", f"{info},{labels}", 1),
                ("counter", "serve_local:engine_steps_total", labels, eng.steps),   # ours: batching
                ("gauge", "serve_local:max_batch_size", labels, eng.max_batch)]
    return "".join(f"# TYPE {name} {kind}\n{name}{{{lab}}} {float(v)}\n"
                   for kind, name, lab, v in rows)


def refuse_streaming(body: dict) -> None:
    if typed(body, "stream", bool, False):
        raise APIError(400, "stream=true is not supported by local_vllm", param="stream")


@route("POST", "/v1/completions", watches_client=True)
def completions(eng, body, query, alive):
    check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    refuse_streaming(body)
    p = parse_sampling(body, eng)
    prompts = parse_prompts(body.get("prompt"), p, eng)
    as_ids = typed(body, "return_tokens_as_token_ids", bool, False)
    with_ids = typed(body, "return_token_ids", bool, False)
    reqs = eng.generate(prompts, p, eng.adapter_for(typed(body, "model", str)), alive)
    choices = []
    for r in reqs:
        for s in r.seqs:
            stopped = s.finish_reason == "stop"                # the stop token has no text
            text = eng.tokenizer.decode(s.token_ids[:-1] if stopped else s.token_ids,
                                        skip_special_tokens=True)
            logprobs = None if p.logprobs is None else completion_logprobs(s, as_ids, eng.tokenizer)
            choice = {"index": len(choices), "text": text, "logprobs": logprobs,
                 "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
            if with_ids:
                choice |= {"token_ids": s.token_ids, "prompt_token_ids": r.prompt}
            choices.append(choice)
    return {"id": f"cmpl-{secrets.token_hex(16)}", "object": "text_completion",
            "created": int(time.time()), "model": body.get("model") or eng.name,
            "choices": choices, "usage": usage(reqs)}


def completion_logprobs(s: Sequence, as_ids: bool, tokenizer) -> dict:
    """vLLM's completion logprobs: per token the sampled one first, then the top-k, clamped at
    -9999."""
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
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@route("POST", "/inference/v1/generate", watches_client=True)
def generate(eng, body, query, alive):
    if not eng.args.enable_scale_out:
        raise APIError(403, "/inference/v1/generate needs --enable-scale-out",
                       "PermissionDeniedError")
    check_fields(body, GENERATE_FIELDS, "/inference/v1/generate")
    refuse_streaming(body)
    sampling = typed(body, "sampling_params", dict, {})
    check_fields(sampling, SAMPLING_FIELDS | {"output_kind"}, "sampling_params")
    typed(sampling, "output_kind", int, 2, lambda v: v == 2,
          "== 2 (FINAL_ONLY: replies come whole, never streamed)")
    p = parse_sampling(sampling, eng)
    if eng.args.return_sampling_mask and not (p.temperature > 0 and p.top_k > 0):
        raise APIError(400, "With --return-sampling-mask every request needs temperature > 0 and "
                       "top_k > 0", param="sampling_params")
    prompt = check_prompt(body.get("token_ids"), p, eng)
    request_id = typed(body, "request_id", str) or secrets.token_hex(16)
    [r] = eng.generate([prompt], p, eng.adapter_for(typed(body, "model", str)), alive)

    def entry(t: int, v: float, rank: int) -> dict:
        return {"token_id": t, "logprob": v, "rank": rank}

    def content(s: Sequence) -> list[dict]:
        return [entry(lp.token_id, lp.logprob, lp.rank)
                | {"top_logprobs": [entry(t, v, i + 1) for i, (t, v) in enumerate(lp.top)]}
                for lp in s.logprobs]
    choices = [{"index": s.index, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                "token_ids": s.token_ids,
                "logprobs": None if p.logprobs is None else {"content": content(s)},
                "sampling_mask": s.sampling_mask if eng.args.return_sampling_mask else None}
               for s in r.seqs]
    return {"request_id": request_id, "model": body.get("model") or eng.name,
            "prompt_token_ids": prompt, "choices": choices, "usage": usage([r])}


@route("POST", "/pause", dev=True)
def pause(eng, body, query):
    mode = query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise APIError(400, f"Invalid mode {mode!r}: use abort, wait or keep", bare=True)
    eng.pause(mode, flag(query, "clear_cache", True))
    return {"status": "paused"}


@route("POST", "/resume", dev=True)
def resume(eng, body, query):
    eng.resume()
    return {"status": "resumed"}


@route("GET", "/is_paused", dev=True)
def is_paused(eng, body, query):
    return {"is_paused": eng.pause_mode is not None}


@route("POST", "/reset_prefix_cache", dev=True)
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
    name = typed(body, "lora_name", str)
    path = typed(body, "lora_path", str)
    if not name or not path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if name == eng.name:
        raise APIError(400, f"The LoRA adapter name '{name}' clashes with the base model name.",
                       param="lora_name")
    if name in eng.adapters and not typed(body, "load_inplace", bool, False):
        raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to "
                       "load the adapter in place, set 'load_inplace' to True.", param="lora_name")
    eng.load_adapter(name, path)
    return f"Success: LoRA adapter '{name}' added successfully."


@route("POST", "/v1/unload_lora_adapter")
def unload_lora_adapter(eng, body, query):
    needs_lora(eng)
    name = typed(body, "lora_name", str)
    with eng.cond:
        if eng.adapters.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                           "lora_name")
    return f"Success: LoRA adapter '{name}' removed successfully."


def worker_error(message: str, param: str | None = None) -> APIError:
    """What vLLM answers when its worker raises during a weight-sync call: a 500."""
    return APIError(500, message, "InternalServerError", param)


def needs_transfer(eng, updating: bool | None = None) -> None:
    """vLLM's worker checks, in its order and words: configured, in a session (or not). Whether
    the engine joined a group is its own check, at the update (receive_weights): a restarted
    server opens a session before it has one, as vLLM does."""
    if eng.args.weight_transfer_config is None:
        raise worker_error("Weight transfer not configured. "
                           "Please set weight_transfer_config to enable weight transfer.")
    if updating is True and not eng.updating:
        raise worker_error("start_weight_update must be called before update_weights.")
    if updating is False and eng.updating:
        raise worker_error("start_weight_update called while a weight update is already "
                           "active. Call finish_weight_update first.")


@route("POST", "/init_weight_transfer_engine", dev=True)
def init_weight_transfer_engine(eng, body, query):
    needs_transfer(eng)
    info = typed(body, "init_info", dict, {})
    unknown = sorted(set(info) - INIT_INFO_FIELDS)
    missing = {"master_address", "master_port", "rank_offset", "world_size"} - info.keys()
    if unknown or missing:                         # vLLM's dataclass refuses: a worker error
        raise worker_error(f"Invalid init_info: unexpected {unknown[:20]}, missing "
                           f"{sorted(missing)}", "init_info")
    eng.join_group({
        "master_address": typed(info, "master_address", str),
        "master_port": typed(info, "master_port", int, ok=lambda v: 0 < v < 65536,
                             rule="in 1..65535"),
        "world_size": typed(info, "world_size", int, ok=lambda v: v >= 2, rule=">= 2"),
        "rank_offset": typed(info, "rank_offset", int, ok=lambda v: 0 < v < info["world_size"],
                             rule="in 1..world_size-1"),
        "packed": typed(info, "packed", bool, False),
        "packed_buffer_size_bytes": typed(info, "packed_buffer_size_bytes", int, 1 << 30,
                                          lambda v: v > 0, "> 0"),
        "packed_num_buffers": typed(info, "packed_num_buffers", int, 2, lambda v: v >= 1, ">= 1")})
    return {"message": "Weight transfer initialized"}


@route("POST", "/start_weight_update", dev=True)
def start_weight_update(eng, body, query):
    needs_transfer(eng, updating=False)
    eng.updating = True
    return {"message": "Weight update started"}


@route("POST", "/update_weights", dev=True)
def update_weights(eng, body, query):
    needs_transfer(eng, updating=True)
    try:
        names, dtype_names, shapes = update_info(eng, body)
        dtypes = [getattr(torch, d) for d in dtype_names]
        received = eng.receive(names, dtypes, shapes)
        eng.check_update(names, shapes)            # the model's own shapes, before it is touched
    except BaseException as e:
        eng.updating = False                       # vLLM's worker ends the session on any error
        if isinstance(e, RuntimeError):            # the transport: the trainer is gone, or late
            raise worker_error(f"Weight update failed while receiving: {e}") from e
        raise
    eng.update_weights(names, received)
    eng.last_update = (names, dtype_names, shapes)
    return {"message": "Weights updated"}


def update_info(eng, body) -> tuple[list, list, list]:
    """(names, dtype_names, shapes) of an /update_weights body, checked as vLLM's engine checks
    them (after its group: an engine that never joined one refuses first)."""
    if eng.group is None:
        raise worker_error("weight transfer not initialized: POST /init_weight_transfer_engine "
                           "first")
    info = body.get("update_info")
    if isinstance(info, list):                     # one dict per worker rank; we are one worker
        info = info[0] if len(info) == 1 else None
    if not isinstance(info, dict):
        raise APIError(400, "update_info must be a dict, or a list with one dict per worker "
                       "(world size 1)")
    check_fields(info, {"names", "dtype_names", "shapes"}, "update_info")
    names = typed(info, "names", list, [], lambda v: all(type(n) is str for n in v), "of strings")
    dtype_names = typed(info, "dtype_names", list, [], lambda v: all(type(n) is str for n in v),
                        "of strings")
    shapes = typed(info, "shapes", list, [], lambda v: all(
        type(s) is list and all(type(d) is int and d >= 0 for d in s) for s in v),
        "of lists of sizes >= 0")
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise APIError(400, "update_info: names, dtype_names and shapes must have the same length")
    if not names:                                  # all empty: the previous round's metadata
        names, dtype_names, shapes = eng.last_update or ([], [], [])
    if not all(isinstance(getattr(torch, d, None), torch.dtype) for d in dtype_names):
        raise APIError(400, f"update_info: unknown dtype in {dtype_names[:20]}",
                       param="dtype_names")
    return names, dtype_names, shapes


@route("POST", "/finish_weight_update", dev=True)
def finish_weight_update(eng, body, query):
    needs_transfer(eng)
    if not eng.updating:
        raise worker_error("finish_weight_update called without a matching "
                           "start_weight_update.")
    eng.updating = False
    eng.weight_version = typed(body, "weight_version", str, eng.weight_version)
    return {"message": "Weight update finished"}


@route("POST", "/shutdown_weight_transfer_engine", dev=True)
def shutdown_weight_transfer_engine(eng, body, query):
    needs_transfer(eng)
    if eng.updating:
        raise worker_error("Cannot release a trainer connection during a weight update")
    eng.group = None
    return {"message": "Weight transfer shut down"}


@route("POST", "/update_weight_version", dev=True)
def update_weight_version(eng, body, query):
    eng.weight_version = typed(body, "new_version", str, eng.weight_version)
    return {"success": True, "new_version": eng.weight_version}


@route("GET", "/weight_info", dev=True)
def weight_info(eng, body, query):
    return {"weight_version": eng.weight_version}


@route("POST", "/weight_checker", dev=True)
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
            raise APIError(400, "compare needs a 'baseline' or an earlier 'checksum'",
                           param="baseline")
        current = eng.checksums()
        mismatches = sorted(n for n, h in baseline.items() if current.get(n) != h)
        return {"match": not mismatches, "mismatches": mismatches}
    raise APIError(400, f"Unknown action {action!r}: use checksum, reset or compare",
                   param="action")


@route("POST", "/collective_rpc", dev=True)
def collective_rpc(eng, body, query):
    """A method on every worker (one here); vLLM answers a method no worker has with a 500."""
    method = typed(body, "method", str)
    args = typed(body, "args", list, [], lambda v: all(type(a) is str for a in v), "of strings")
    if method != "weight_digests":
        raise worker_error(f"Method {method!r} is not implemented.")
    try:
        names = json.loads(args[0]) if args else []
    except ValueError as e:
        raise worker_error(f"weight_digests: its argument is not JSON: {e}") from e
    return {"results": [eng.digests(names)]}


# ── the CLI ───────────────────────────────────────────────────────────────────────────────

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="A small vLLM-compatible server on transformers.")
    ap.add_argument("--model", required=True,
                    help="a Hugging Face causal LM id or directory; 'toy' = toy.py's")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int,
                    help="default: the model's max_position_embeddings")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto = float32 on CPU, the checkpoint's dtype on CUDA "
                         "(float32 checkpoints → bfloat16)")
    ap.add_argument("--weight-transfer-config", type=json.loads,
                    help='e.g. \'{"backend":"gloo"}\' (or nccl on CUDA)')
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--return-sampling-mask", action="store_true")
    ap.add_argument("--enable-scale-out", action="store_true",
                    help="enable POST /inference/v1/generate")
    ap.add_argument("--max-logprobs", type=int, default=20, help="-1 = the vocabulary size")
    ap.add_argument("--logprobs-mode", default="raw_logprobs",
                    choices=["raw_logprobs", "processed_logprobs"])
    ap.add_argument("--kv-cache-tokens", type=int,
                    help="KV capacity in tokens (default 16 × max_model_len)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker-extension-cls", choices=["weight_digests.WeightDigests"],
                    help="accepted for vLLM's command line: the extension is built in")
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                    help="require `Authorization: Bearer <key>` on every route but /health and "
                         "/metrics (default: $VLLM_API_KEY, as vLLM)")
    if any(arg.split("=")[0] == "--api-server-count" for arg in argv):
        sys.exit("local_vllm: error: --api-server-count sets vLLM's API-server processes; "
                 "local_vllm is one process, so drop the flag here (keep it for `vllm serve`)")
    args = ap.parse_args(argv)
    transfer = args.weight_transfer_config
    if transfer is not None and (set(transfer) != {"backend"}
                                 or transfer["backend"] not in ("gloo", "nccl")):
        sys.exit("local_vllm: error: --weight-transfer-config must be "
                 f"{{\"backend\": \"gloo\"|\"nccl\"}}, got {transfer}")
    if transfer and transfer["backend"] == "nccl" and not torch.cuda.is_available():
        sys.exit("local_vllm: error: the nccl weight-transfer backend needs CUDA; "
                 "use {\"backend\": \"gloo\"}")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.model == "toy":
        import toy
        args.model_path = toy.ensure_saved()
    else:
        args.model_path = args.model
    hub_id = (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", args.model_path)
              and not args.model_path.startswith("."))
    if not hub_id and not os.path.isdir(args.model_path):
        sys.exit(f"local_vllm: error: model directory {args.model_path!r} does not exist")
    try:
        model, tokenizer = load_model(args.model_path, args.dtype)
    except RuntimeError as e:                      # one clear line, not a traceback
        sys.exit(f"local_vllm: error: {e}")
    limit = model.config.max_position_embeddings
    args.max_model_len = args.max_model_len or limit
    if args.max_model_len > limit:
        sys.exit(f"local_vllm: error: --max-model-len {args.max_model_len} exceeds the "
                 f"model's {limit} positions")
    args.kv_cache_tokens = args.kv_cache_tokens or 16 * args.max_model_len
    if args.kv_cache_tokens < args.max_model_len:
        sys.exit(f"local_vllm: error: --kv-cache-tokens {args.kv_cache_tokens} cannot hold "
                 f"one sequence of --max-model-len {args.max_model_len}")
    torch.manual_seed(args.seed)
    if model.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)                   # see the docstring: the trainer shares the cores
    engine = Engine(model, tokenizer, args)
    httpd = Server((args.host, args.port), served_routes(), WATCHING, engine, args.api_key)
    print(f"local_vllm: {args.model} ({model.dtype}, {model.device.type}) on "
          f"http://{args.host}:{args.port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
