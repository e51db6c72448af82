"""local_vllm/requests.py: what the stand-in accepts, checked before anything reaches the
engine, refused with a 400 in vLLM's JSON shape naming the field, and the server keeps serving.

Requests are written from vLLM's own rules (SamplingParams._verify_args, the protocol's field
types). The property test draws request bodies from the schema, valid and invalid. The fuzz test
is marked `slow` (deselected by default): `pytest -m slow tests/test_local_vllm_requests.py` runs
2000 examples, schema requests and raw-byte mutations of them (so transport.py's framing too);
SERVE_FUZZ_EXAMPLES=N sets another count.
"""
import http.client
import json
import math
import os
import socket
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local_vllm_helpers import (PROMPT, assert_error, complete, error_message, metrics, ok, post,
                                raw, request)

VOCAB = 105            # the toy model's vocabulary
MAX_LEN = 256          # srv's --max-model-len (conftest)


# ── bad input ─────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokns": 4}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 106}),          # the vocab (105) at most
    ("/v1/completions", {"prompt": [1, 2, 105]}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 250}),         # 7 + 250 > 256 positions
    ("/v1/completions", {"prompt": [[1, 2], [3, -1]]}),
    ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"top_k": 0}}),  # top_k > 0
    ("/inference/v1/generate", {"token_ids": PROMPT,
                                "sampling_params": {"top_k": 2, "temperature": 0}}),
    ("/inference/v1/generate", {"token_ids": PROMPT,
                                "sampling_params": {"top_k": 2, "best_of": 2}}),
    ("/weight_checker", {"action": "explode"}),
])
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, path, body):
    assert_error(post(server, path, body), 400)
    assert complete(server, max_tokens=2)["choices"][0]["finish_reason"] in ("stop", "length")


# ── vLLM's parameter rules ────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"),                         # vLLM: temperature in [0, 2]
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"n": 16385}, "n"),                                           # VLLM_MAX_N_SEQUENCES' default
    ({"n": 2, "temperature": 0}, "n"),                             # greedy needs n == 1
    ({"seed": 2**63}, "seed"),                                     # 64-bit signed
    ({"seed": -2**63 - 1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": -2}, "logprobs"),
    ({"max_tokens": True}, "max_tokens"),                          # a bool is not an int
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": 10**400}, "temperature"),                     # an integer beyond any float
    ({"model": ["toy"]}, "model"),
    ({"model": 3}, "model"),
    ({"stream": "no"}, "stream"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"prompt": [PROMPT] * 8193, "n": 2}, "prompt"),               # 16386 sequences in one request
    ({"prompt": {"ids": PROMPT}}, "prompt"),
])
def test_vllm_parameter_rules(srv, fields, param):
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **fields})
    assert_error(r, 400)
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_floats_are_refused(srv, value):
    for field in (b"temperature", b"top_p", b"min_p", b"repetition_penalty"):
        body = b'{"prompt": [5, 17], "max_tokens": 2, "' + field + b'": ' + value + b"}"
        status, reply, _ = raw(srv, request("POST", "/v1/completions", body))
        assert status == 400 and reply["error"]["param"] == field.decode(), reply


def test_tiny_temperatures_are_raised_to_vllms_floor(srv):
    def run(t):
        r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": t,
                                          "seed": 9, "logprobs": 0, "return_token_ids": True,
                                          "ignore_eos": True})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["token_ids"], c["logprobs"]["token_logprobs"]
    floor = run(0.01)
    assert run(1e-300) == run(1e-6) == run(1e-3) == floor          # 0 < t < 0.01 samples at 0.01
    assert all(math.isfinite(v) for v in floor[1]) and floor != run(0.0)   # only 0 is greedy


def test_extreme_but_valid_values_are_served(srv):
    for fields in ({"seed": 2**63 - 1, "n": 3}, {"seed": -2**63}, {"seed": -1},
                   {"repetition_penalty": 1e300}, {"top_p": 1e-300}, {"top_k": 10**30},
                   {"top_k": -1}, {"min_p": 1.0}, {"stop_token_ids": list(range(VOCAB)) * 50}):
        r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, **fields})
        assert r.status_code == 200, (fields, r.text)


def test_work_is_bounded_before_the_engine(srv):
    start = time.monotonic()
    r = post(srv, "/v1/completions", {"prompt": "ab " * (1 << 19), "max_tokens": 2})  # 1.5 MB
    assert_error(r, 400)
    assert "maximum context length" in r.json()["error"]["message"]
    assert time.monotonic() - start < 30
    r = post(srv, "/v1/completions", {"prompt": [PROMPT] * 5000, "max_tokens": 250})  # each checked
    assert_error(r, 400)
    assert metrics(srv)["vllm:num_requests_waiting"] == 0


# ── generated requests ────────────────────────────────────────────────────────────────────────

CHAR = st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff"]))     # lone surrogates too


def text(**kw):
    return st.text(CHAR, **kw)


def containers(inner):
    return st.lists(inner, max_size=3) | st.dictionaries(text(max_size=4), inner, max_size=3)


ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | text(max_size=5),
                        containers, max_leaves=8)
TOKEN = st.integers(0, VOCAB - 1)


def field(valid, invalid):
    """A field's value: mostly valid, sometimes invalid (a wrong value or a wrong type)."""
    return st.one_of(valid, valid, invalid, ANY_JSON)


SAMPLING = {
    "max_tokens": field(st.integers(1, 4), st.integers(max_value=0) | st.integers(MAX_LEN, 2**70)),
    "n": field(st.integers(1, 3), st.integers(max_value=0) | st.integers(16385, 2**64)),
    "temperature": field(st.floats(0, 2), st.floats(allow_nan=True) | st.floats(2.0001, 1e308)),
    "top_p": field(st.floats(1e-9, 1), st.floats(max_value=0) | st.floats(1.0001)),
    "top_k": field(st.integers(-1, 200), st.integers(max_value=-2)),
    "min_p": field(st.floats(0, 1), st.floats(1.0001) | st.floats(max_value=-1e-9)),
    "repetition_penalty": field(st.floats(0.01, 10), st.floats(max_value=0)),
    "seed": field(st.integers(-2**63, 2**63 - 1),
                  st.integers(2**63) | st.integers(max_value=-2**63 - 1)),
    "stop_token_ids": field(st.lists(TOKEN, max_size=4), st.lists(st.integers(), max_size=3)),
    "ignore_eos": field(st.booleans(), st.integers()),
    "logprobs": field(st.integers(-1, 5), st.integers(max_value=-2)),
}
COMPLETION = {**SAMPLING,
              "prompt": field(st.lists(TOKEN, min_size=1, max_size=12)
                              | text(min_size=1, max_size=20)
                              | st.lists(st.lists(TOKEN, min_size=1, max_size=6), min_size=1,
                                         max_size=2),
                              st.lists(st.integers(), max_size=4) | st.just([])),
              "model": field(st.just("toy-dir") | st.none(), text(max_size=5)),
              "return_token_ids": field(st.booleans(), text(max_size=2)),
              "return_tokens_as_token_ids": field(st.booleans(), st.integers()),
              "stream": field(st.just(False), st.just(True)),
              "max_tokns": ANY_JSON}                            # a typo: always refused
GENERATE_SAMPLING = {**SAMPLING, "top_k": field(st.integers(1, 50), st.integers(max_value=0))}
GENERATE = {"token_ids": COMPLETION["prompt"],
            "sampling_params": st.fixed_dictionaries({}, optional=GENERATE_SAMPLING) | ANY_JSON,
            "request_id": field(text(max_size=8), st.integers()), "model": COMPLETION["model"]}


def bodies():
    """(path, body) for the generation routes and the small control routes (not /pause: it would
    stop the shared server; not weight transfer: a valid init_info joins a group and waits for a
    trainer)."""
    control_paths = st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                                     "/weight_checker", "/update_weight_version"])
    control_fields = st.sampled_from(["lora_name", "lora_path", "load_inplace", "action",
                                      "baseline", "new_version"])
    return st.one_of(
        st.tuples(st.just("/v1/completions"), st.fixed_dictionaries({}, optional=COMPLETION)),
        st.tuples(st.just("/inference/v1/generate"), st.fixed_dictionaries({}, optional=GENERATE)),
        st.tuples(control_paths, st.dictionaries(control_fields, ANY_JSON)))


def check_reply(server, path, body) -> None:
    r = requests.post(server.url + path, data=json.dumps(body).encode(), timeout=60)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert error_message(r.json()), r.text


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request_=bodies())
def test_generated_requests_get_200_or_a_4xx_and_the_server_keeps_serving(srv, request_):
    check_reply(srv, *request_)
    ok(srv)


@pytest.mark.slow
def test_fuzz_run_stays_green(srv):
    """Minutes of requests: schema requests, and raw-byte mutations of them (noise spliced in
    anywhere)."""
    examples = int(os.environ.get("SERVE_FUZZ_EXAMPLES", 2000))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies(), st.binary(max_size=64), st.integers(0, 400), st.booleans())
    def fuzz(req, noise, cut, mangle_bytes):
        path, body = req
        if not mangle_bytes:
            check_reply(srv, path, body)
        else:
            data = request("POST", path, json.dumps(body).encode())
            data = data[:cut] + noise + data[cut:]
            try:
                status, reply, _ = raw(srv, data, timeout=10)
            except (http.client.HTTPException, ConnectionError):    # no whole request: no reply
                status, reply = None, None
            except socket.timeout:
                status, reply = None, None                          # a body never sent: 60 s rule
            if status is not None:
                assert status == 200 or 400 <= status < 500, (data, status, reply)
        ok(srv)
    fuzz()
