"""The vLLM HTTP contract (docs/vllm_api.md), request side: what local_vllm/server.py accepts,
checked before anything reaches the engine, and refused in vLLM's JSON error shape (a 400).

    {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0.7, "logprobs": 2}
      → check_fields (unknown fields: 400) → parse_sampling → SamplingParams(max_tokens=8, ...)
      → parse_prompts → [[1, 2, 3]] (ids below the vocabulary, room for max_tokens)

Departures from vLLM, one line each (server.py lists the rest):
- Unknown request fields are a 400 (vLLM warns and ignores them): a typo never changes sampling.
- Types are strict where pydantic would coerce ("16", 16.0), so a wrong type is never guessed.
"""
import math
import os

from local_vllm.engine import APIError, Engine, SamplingParams

SAMPLING_FIELDS = {"max_tokens", "n", "temperature", "top_p", "top_k", "min_p",
                   "repetition_penalty", "seed", "stop_token_ids", "ignore_eos", "logprobs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"model", "prompt", "return_token_ids",
                                       "return_tokens_as_token_ids", "stream"}
GENERATE_FIELDS = {"token_ids", "sampling_params", "model", "request_id", "stream"}
INIT_INFO_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "packed",
                    "packed_buffer_size_bytes", "packed_num_buffers"}
MAX_N = int(os.environ.get("VLLM_MAX_N_SEQUENCES", 16384))  # vLLM's bound on n, same variable
INT64 = (-2**63, 2**63 - 1)                                  # vLLM: seeds are 64-bit signed
MIN_TEMPERATURE = 1e-2                                       # vLLM: 0 < t < 0.01 becomes 0.01
MAX_TEMPERATURE = 2.0                                        # vLLM: t <= 2


def check_fields(body: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"Unknown field(s) in {where}: {unknown[:20]}; local_vllm accepts "
                       f"{sorted(allowed)}", param=str(unknown[0]))


def typed(body: dict, name: str, kind: type, default=None, ok=None, rule: str = ""):
    """body[name] checked for type and `ok` (a predicate, None: any value); `default` when absent
    or null. Strict JSON types: bools are not ints, "16" is not a number; ints are accepted as
    floats, and a float must be finite."""
    v = body.get(name)
    if v is None:
        return default
    if kind is float and type(v) in (int, float):
        try:
            v = float(v)
        except OverflowError:                      # an integer literal beyond any float
            v = math.inf
        if not math.isfinite(v):
            raise APIError(400, f"{name} must be a finite number, got {body[name]!r:.40}",
                           param=name)
    if type(v) is not kind or (ok is not None and not ok(v)):
        raise APIError(400, f"Invalid {name}={v!r:.200}: expected {kind.__name__} {rule}".rstrip(),
                       param=name)
    return v


def token_ids_below(vocab: int):
    """A predicate: a list of token ids, each in [0, vocab)."""
    def ok(ids) -> bool:
        return all(type(t) is int and 0 <= t < vocab for t in ids)
    return ok


def parse_sampling(body: dict, eng: "Engine") -> SamplingParams:
    """vLLM's SamplingParams rules, for every field we implement, checked before the request
    reaches the engine:

        temperature  finite, in [0, 2]; 0 < t < 0.01 is raised to 0.01; 0 is greedy (needs n = 1)
        n            1 .. VLLM_MAX_N_SEQUENCES (16384)
        seed         64-bit signed (-1 = none); top_p (0, 1]; top_k >= -1 (-1 = 0 = off);
                     min_p [0, 1]; repetition_penalty finite > 0; logprobs <= --max-logprobs
        types        strict JSON types for every field (a bool is not an int, "16" not 16)
    """
    vocab = eng.vocab
    temperature = typed(body, "temperature", float, 1.0, lambda v: 0 <= v <= MAX_TEMPERATURE,
                        f"in [0, {MAX_TEMPERATURE:g}]")
    p = SamplingParams(
        max_tokens=typed(body, "max_tokens", int, 16, lambda v: v >= 1, ">= 1"),
        n=typed(body, "n", int, 1, lambda v: 1 <= v <= MAX_N,
                f"in [1, {MAX_N}] (VLLM_MAX_N_SEQUENCES)"),
        temperature=0.0 if temperature == 0 else max(temperature, MIN_TEMPERATURE),
        top_p=typed(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=max(0, typed(body, "top_k", int, 0, lambda v: v >= -1,
                           "(-1 or 0 = off, else >= 1)")),
        min_p=typed(body, "min_p", float, 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        repetition_penalty=typed(body, "repetition_penalty", float, 1.0, lambda v: v > 0, "> 0"),
        seed=typed(body, "seed", int, None, lambda v: INT64[0] <= v <= INT64[1],
                   "in the 64-bit signed range"),
        stop_token_ids=frozenset(typed(body, "stop_token_ids", list, [], token_ids_below(vocab),
                                       f"of token ids in [0, {vocab})")),
        ignore_eos=typed(body, "ignore_eos", bool, False),
        logprobs=typed(body, "logprobs", int, None, lambda v: v >= -1, ">= -1"),
    )
    if p.seed == -1:
        p.seed = None
    if p.temperature == 0:                         # greedy: vLLM resets the filters, needs n == 1
        p.top_p = 1.0
        p.top_k = 0
        p.min_p = 0.0
        if p.n > 1:
            raise APIError(400, f"n must be 1 when using greedy sampling, got {p.n}.", param="n")
    limit = vocab if eng.args.max_logprobs == -1 else eng.args.max_logprobs
    if p.logprobs is not None and (vocab if p.logprobs == -1 else p.logprobs) > limit:
        raise APIError(400, f"Requested logprobs={p.logprobs} exceeds --max-logprobs ({limit})",
                       param="logprobs")
    return p


def check_prompt(ids, p: SamplingParams, eng: "Engine") -> list[int]:
    if type(ids) is not list or not ids or not token_ids_below(eng.vocab)(ids):
        raise APIError(400, f"A prompt must be a non-empty list of token ids in [0, {eng.vocab})",
                       param="prompt")
    needed = len(ids) + p.max_tokens
    if needed > eng.args.max_model_len:
        raise APIError(400, f"This model's maximum context length is {eng.args.max_model_len} "
                       f"tokens, but the request needs {needed} ({len(ids)} prompt + "
                       f"{p.max_tokens} max_tokens); shorten the prompt or lower max_tokens",
                       param="max_tokens")
    return ids


def parse_prompts(prompt, p: SamplingParams, eng: "Engine") -> list[list[int]]:
    """vLLM's `prompt`: a string, token ids, or a batch of either; at most VLLM_MAX_N_SEQUENCES
    sequences in all (n per prompt), so one request's work is bounded before it reaches the
    engine (strings are bounded by the body size)."""
    batch = (isinstance(prompt, list) and bool(prompt)
             and all(isinstance(t, (str, list)) for t in prompt))
    prompts = prompt if batch else [prompt]
    if len(prompts) * p.n > MAX_N:
        raise APIError(400, f"{len(prompts)} prompts x n={p.n} sequences exceed {MAX_N} "
                       "(VLLM_MAX_N_SEQUENCES)", param="prompt")
    ids = [eng.tokenizer.encode(t, add_special_tokens=False) if isinstance(t, str) else t
           for t in prompts]
    return [check_prompt(t, p, eng) for t in ids]


