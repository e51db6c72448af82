"""What the stand-in's tests share (test_local_vllm_*.py, and the sync and rollout tests that
check what a server returns): a prompt, HTTP calls on a LocalServer, vLLM's error shape, raw
requests on a socket, and the log-probs a server should return, recomputed independently.

- PROMPT, TARGETS: token ids the toy model takes; the module names a LoRA adapter targets.
- post / get / complete / metrics / wait_for / assert_error: one route's call and its checks.
- raw / request / error_message / ok: bytes as they are on a socket, and "the server still serves".
- reference_logprobs: the same model directory loaded with transformers, prompt + generated tokens
  forwarded in one go, and the sampler's processing (repetition penalty, temperature, min-p, top-k,
  top-p) written again here the way vLLM writes it (ascending sort for top-p).
- make_adapter: a peft LoRA adapter of the toy model saved to a directory.
"""
import http.client
import json
import math
import socket
import time

import requests
import torch
from transformers import AutoModelForCausalLM


PROMPT = [5, 17, 33, 8, 40, 41, 60]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def post(server, path, body=None, **kw) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120, **kw)


def get(server, path) -> requests.Response:
    return requests.get(server.url + path, timeout=30)


def complete(server, **body) -> dict:
    r = post(server, "/v1/completions", {"prompt": PROMPT, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(server) -> dict[str, float]:
    """Prometheus text → {name: value} (labels dropped; one series per name here)."""
    out = {}
    for line in get(server, "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def assert_error(r: requests.Response, status: int) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]


def reference_logprobs(model, prompt, output, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                       repetition_penalty=1.0, processed=True) -> torch.Tensor:
    """(T, V) log-probs of the distribution each output token was drawn from."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + output]), use_cache=False)
        logits = out.logits[0, len(prompt) - 1:-1].float()                   # (T, V)
    rows = []
    for j, x in enumerate(logits):
        if processed:
            x = x.clone()
            for t in set(prompt + output[:j]):
                x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
            x = x / temperature
            if min_p > 0:
                p = x.softmax(-1)
                x[p < min_p * p.max()] = -math.inf
            if top_k > 0:
                x[x < x.sort(descending=True).values[top_k - 1]] = -math.inf
            if top_p < 1:
                ascending, order = x.sort()
                drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
                drop[-1] = False
                x[order[drop]] = -math.inf
        rows.append(x.log_softmax(-1))
    return torch.stack(rows)


def make_adapter(toy_dir, path, r=4):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(toy_dir),
                           LoraConfig(r=r, lora_alpha=8, target_modules=TARGETS,
                                      init_lora_weights=False))
    model.save_pretrained(path)
    return model.eval()


def raw(server, data: bytes, timeout: float = 15.0) -> tuple:
    """Send bytes as they are; (status, JSON body or None, http.client.HTTPResponse) of the one
    reply."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        method = "HEAD" if data.startswith(b"HEAD") else "POST"
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        body = response.read()
    return response.status, json.loads(body) if body else None, response


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    """The bytes of one HTTP/1.1 request (Content-Length of the body unless headers are given)."""
    if headers is None:
        headers = {"Content-Length": str(len(body))}
    lines = [f"{method} {path} HTTP/1.1\r\n"] + [f"{k}: {v}\r\n" for k, v in
                                                 {"Host": "x", **headers}.items()]
    return "".join(lines).encode() + b"\r\n" + body


def error_message(body) -> str:
    err = body["error"]
    return err if isinstance(err, str) else err["message"]


def ok(server) -> list[int]:
    """A normal request still works: the server kept serving."""
    r = requests.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                            "seed": 1, "return_token_ids": True},
                      timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]
