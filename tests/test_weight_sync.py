"""weight_sync.py against local_vllm: vLLM's bucket layout, a full sync that lands exactly (the
session's shared run, conftest.train_run), no KV of old weights kept after it, and failures
that end in a clear error with the server resumed, never a hang. (Syncs to several replicas:
test_lora_sync.py; their verification and the probe: test_verify_sync.py.)"""
import hashlib
import os
import signal
import threading
import time

import pytest
import requests
import torch

import toy
from vllm_client import VLLMClient, VLLMError
from weight_sync import WeightSync, begin_update, buckets

ARGS = ("--max-model-len", "64", "--weight-transfer-config", '{"backend":"gloo"}')


def test_buckets_close_right_after_the_buffer_is_first_exceeded():
    assert buckets([40, 40, 80, 16], 100) == [range(0, 3), range(3, 4)]
    assert buckets([100, 1], 100) == [range(0, 2)]                # 100 is not past 100; 101 is
    assert buckets([200, 5, 5], 100) == [range(0, 1), range(1, 3)]
    assert buckets([], 100) == []


@pytest.fixture
def weights(toy_dir):
    model = toy.build_model(len(toy.build_tokenizer()), seed=1)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def push(server, weights, specs=None, timeout=30.0, buffer_bytes=1 << 30):
    client = VLLMClient(server.url, timeout=timeout, max_retries=0)
    sync = WeightSync([client], timeout, buffer_bytes)
    sync.connect()
    specs = specs or [(n, t.shape) for n, t in weights]
    return sync.push(specs, lambda: (t for _, t in weights), version=7)


def test_after_a_sync_the_server_holds_the_trainers_weights(train_run, train_server):
    """The last sync of the shared run (FullSync, after step 4) sent exactly the weights of
    checkpoint-4: the server's checksums of every tensor match the checkpoint's (fp32 on CPU: bit
    for bit)."""
    from safetensors.torch import load_file
    weights = load_file(os.path.join(train_run[0], "checkpoint-4", "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])          # tied
    expected = {n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for n, t in weights.items()}
    body = {"action": "compare", "baseline": expected}
    reply = requests.post(train_server.url + "/weight_checker", json=body).json()
    assert reply == {"match": True, "mismatches": []}
    assert requests.get(train_server.url + "/weight_info").json()["weight_version"] == "4"


def test_a_sync_in_small_buckets_lands_and_reports_its_bytes(start_server, weights):
    server = start_server(*ARGS)
    stats = push(server, weights, buffer_bytes=50_000)
    assert stats.bytes == sum(t.numel() * 4 for _, t in weights)
    assert stats.s >= stats.transfer_s > 0
    assert requests.get(server.url + "/weight_info").json()["weight_version"] == "7"
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}


def test_names_or_shapes_the_server_lacks_are_refused_before_anything_is_sent(server, weights):
    """Real vLLM cannot survive a refused update, so connect() checks every name and shape
    against the checkpoint the server loaded (/server_info's model): a clear error, nothing sent,
    the server untouched."""
    before = requests.get(server.url + "/weight_info").json()
    specs = [(n, t.shape) for n, t in weights]
    bad_name = [("model.no_such.weight", specs[0][1]), *specs[1:]]
    bad_shape = [(specs[0][0], torch.Size([7])), *specs[1:]]
    for bad, what in ((bad_name, "unknown names .'model.no_such.weight'"),
                      (bad_shape, r"other shapes .'model.embed_tokens.weight \[7\]")):
        sync = WeightSync([VLLMClient(server.url, timeout=10, max_retries=0)], 10.0)
        with pytest.raises(ValueError, match=f"{server.url} serves .*{what}.*nothing was sent"):
            sync.connect(bad)
        assert sync.group is None                                   # never joined
    assert requests.get(server.url + "/weight_info").json() == before
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}


def test_a_refused_update_raises_naming_the_server_and_resumes_it(start_server, weights):
    """Past the check (connect without specs), the server refuses with a 500 and closes the
    connection, as vLLM does: the error names it, and /resume goes over a fresh connection."""
    server = start_server(*ARGS)
    specs = [(n if i else "model.no_such.weight", t.shape) for i, (n, t) in enumerate(weights)]
    with pytest.raises(RuntimeError, match=f"weight sync failed.*{server.url}.*HTTP 500.*no_such"):
        push(server, weights, specs)
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}


def test_a_stalled_server_fails_within_the_timeout_not_a_hang(start_server, weights):
    server = start_server(*ARGS)
    try:
        sync = WeightSync([VLLMClient(server.url, timeout=3.0, max_retries=0)], 3.0)
        sync.connect()
        os.kill(server.proc.pid, signal.SIGSTOP)                # the server stops answering mid-run
        start = time.monotonic()
        specs = [(n, t.shape) for n, t in weights]
        with pytest.raises(RuntimeError, match="vllm_server_timeout=3s"):
            sync.push(specs, lambda: (t for _, t in weights), version=1)
        assert time.monotonic() - start < 15               # pause and resume each wait 3 s at most
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def test_a_server_that_dies_mid_sync_is_resumed_once_not_retried(start_server, weights):
    """Paused, then gone: start_weight_update spends its retries, the sync raises naming the
    server, and the closing /resume is tried once (the run is over; retrying would only wait)."""
    server = start_server(*ARGS)

    class DiesAfterPause(VLLMClient):
        def start_weight_update(self):
            server.stop()
            super().start_weight_update()

    client = DiesAfterPause(server.url, timeout=10.0, max_retries=2)
    sync = WeightSync([client], 10.0)
    sync.connect()
    specs = [(n, t.shape) for n, t in weights]
    with pytest.raises(RuntimeError, match=f"weight sync with {server.url}.*gave up after 3.*"
                                           f"{server.url} may still be paused"):
        sync.push(specs, lambda: (t for _, t in weights), version=1)
    assert client.retry_total == 2                     # start's two retries; resume's one attempt


def test_a_server_without_weight_transfer_is_refused_with_the_flag(start_server):
    server = start_server("--max-model-len", "64")
    with pytest.raises(ValueError, match="--weight-transfer-config"):
        WeightSync([VLLMClient(server.url, timeout=10)], 10).connect()


def test_only_rank_zero_talks_to_the_servers(monkeypatch):
    """Other ranks gather (the collectives) but never call a server: a WeightSync on rank 1 connects
    to nothing and sends nothing."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    sync = WeightSync([VLLMClient("http://127.0.0.1:9", timeout=1, max_retries=0)], 1.0)
    sync.connect()
    gathered = []
    stats = sync.push([("w", torch.Size([2]))], lambda: iter(gathered.append(1) or [torch.ones(2)]),
                      version=1)
    assert gathered == [1] and stats.bytes == 0


def test_a_server_that_dies_mid_transfer_is_taken_out_and_the_sync_lands_on_the_others(
        start_server, weights, caplog):
    """Two servers; one is killed as its /update_weights is sent: the transfer fails, the dead
    one is taken out (a warning), and the sync is sent once more to the other, which ends at the
    version; the next sync reaches it alone."""
    a, b = start_server(*ARGS), start_server(*ARGS)

    class DiesAtUpdate(VLLMClient):
        def update_weights(self, update_info):
            os.killpg(b.proc.pid, signal.SIGKILL)
            super().update_weights(update_info)

    sync = WeightSync([VLLMClient(a.url, timeout=20.0, max_retries=1),
                       DiesAtUpdate(b.url, timeout=20.0, max_retries=1)], 20.0)
    sync.connect()
    specs = [(n, t.shape) for n, t in weights]
    sync.push(specs, lambda: (t for _, t in weights), version=1)
    assert f"{b.url} stopped answering and is taken out" in caplog.text
    assert "another run" not in caplog.text                       # the resend's own session
    assert requests.get(a.url + "/weight_info").json() == {"weight_version": "1"}
    assert requests.get(a.url + "/is_paused").json() == {"is_paused": False}
    sync.push(specs, lambda: (t for _, t in weights), version=2)
    assert requests.get(a.url + "/weight_info").json() == {"weight_version": "2"}


@pytest.mark.slow
def test_a_sync_leaves_no_kv_of_the_old_weights_running(start_server, weights):
    """A request generating while the weights change: the sync resets the prefix cache with
    reset_running_requests (vLLM 0.33 ignores /pause's clear_cache in keep mode), so the running
    request is preempted and recomputes its KV under the new weights (the server counts it)."""
    server = start_server(*ARGS, "--max-model-len", "512")

    def metric(name: str) -> float:
        text = requests.get(server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "n": 4}
    reply = {}
    generating = threading.Thread(target=lambda: reply.setdefault(
        "r", requests.post(server.url + "/v1/completions", json=body, timeout=300)))
    before = metric("vllm:num_preemptions_total")
    generating.start()
    while not metric("vllm:num_requests_running"):
        time.sleep(0.05)
    push(server, weights)
    running = metric("vllm:num_requests_running") + metric("vllm:num_requests_waiting")
    generating.join()
    assert reply["r"].status_code == 200 and running            # it outlived the sync
    assert metric("vllm:num_preemptions_total") >= before + 4    # every sequence recomputed


def test_a_session_another_run_left_open_is_finished_first_also_on_a_409(start_server, caplog):
    """A run killed between /start_weight_update and /update_weights leaves the session open:
    vLLM 0.33 answers "already active" (a 500), a later revision 409 "already in progress"; both
    are finished with a warning, then the update starts."""
    server = start_server(*ARGS)
    client = VLLMClient(server.url, timeout=10, max_retries=0)
    WeightSync([client], 10.0).connect()
    client.start_weight_update()                                # the dead run's open session
    begin_update(client)
    assert caplog.text.count("another run began and never finished") == 1

    class Answers409(VLLMClient):             # the revision's answer, on the same open session
        def start_weight_update(self):
            if not hasattr(self, "said"):
                self.said = True
                raise VLLMError("weight update already in progress", self.base_url, 409)
            super().start_weight_update()
    begin_update(Answers409(server.url, timeout=10, max_retries=0))
    assert caplog.text.count("another run began and never finished") == 2
    client.finish_weight_update()
