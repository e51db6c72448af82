"""The served model against the trained one, at start (spec: AsyncGRPOConfig.dtype: 「不一致は、
トレーニング開始時に警告としてログに記録されます」, a dtype mismatch is logged as a warning at
training start; AsyncGRPOTrainer.model: the config's model names the model on the server; seed 003:
adapter-only sync is refused with --data-parallel-size > 1).

    resume_leftover_pause(client)            → a server a dead run left paused serves again
    dtype_warning(url, info, torch.float32)  → "the vLLM server at http://... serves bfloat16 ..."
    check_vocab(client, tokenizer)           → ValueError when the server refuses our largest id
    adapter_dp_refusal(url, info)            → why adapter-only sync cannot run (lora_sync.py)
    check_servers(clients, config, tokenizer, device)   the first three, every server (train.py)

`info` is a server's /server_info vllm_config. Each check costs at most one 1-token request.
Departures from the spec: none.
"""
import logging

from vllm_client import VLLMError

log = logging.getLogger(__name__)


def resume_leftover_pause(client) -> bool:
    """Resume a server that is paused before this run paused it, with a warning; True if it was.
    A run killed between /pause and /resume (SIGKILL, OOM, a lost node) leaves its servers paused:
    in keep mode every request waits, forever, including this run's first one. A server without
    the RL routes (no VLLM_SERVER_DEV_MODE: a LoRA-only run's) cannot have been paused by a run."""
    try:
        if not client.is_paused():
            return False
    except VLLMError as e:
        if e.status == 404:
            return False
        raise
    log.warning("the vLLM server at %s was paused before this run started (a run that stopped "
                "during a weight sync leaves it so): resuming it", client.base_url)
    client.resume()
    return True


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


def warn_dtype_mismatch(urls: list[str], infos: list[dict], compute_dtype) -> None:
    for url, info in zip(urls, infos):
        if why := dtype_warning(url, info, compute_dtype):
            log.warning(why)


def check_vocab(client, tokenizer) -> None:
    """ValueError when the server does not accept the largest token id the trained model's
    tokenizer writes (one prompt token, one generated): it serves a model with another, smaller
    vocabulary, and every rollout would fail."""
    largest = len(tokenizer) - 1
    base = next(c for c in client.models()["data"] if c.get("parent") is None)
    try:
        client.completions({"model": base["id"], "prompt": [largest], "max_tokens": 1})
    except VLLMError as e:
        if e.status != 400:
            raise
        raise ValueError(f"the vLLM server at {client.base_url} serves {base['id']!r}, which does "
                         f"not accept token id {largest}, the largest of the trained model's "
                         f"tokenizer ({len(tokenizer)} tokens): it serves another model; serve "
                         f"the model you train ({e})") from e


def adapter_dp_refusal(url: str, info: dict) -> str | None:
    """Why adapter-only sync cannot run against this server's data parallelism (None: it can):
    a runtime adapter load reaches one data-parallel engine, and the others would keep sampling
    from an older policy."""
    dp = (info.get("parallel_config") or {}).get("data_parallel_size") or 1
    if dp <= 1:
        return None
    return (f"{url} runs --data-parallel-size {dp}, and a runtime adapter load does not reach "
            "every data-parallel engine; restart it with --data-parallel-size 1 and list each "
            "replica's URL in vllm_server_base_url instead")


def check_servers(clients, config, tokenizer, device) -> None:
    """Rank 0, at start: a server a dead run left paused is resumed (a warning); the served
    vocabulary must hold the trained tokenizer's (an error); the served dtype should be the
    trainer's compute dtype (a warning, spec: dtype)."""
    infos = []
    for c in clients:
        resume_leftover_pause(c)
        check_vocab(c, tokenizer)
        try:
            infos.append(c.server_info())
        except VLLMError:                       # no dev mode: weight sync says what is missing
            infos.append({})
    warn_dtype_mismatch([c.base_url for c in clients], infos, config.compute_dtype(device))
