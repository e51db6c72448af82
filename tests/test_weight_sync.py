"""weight_sync.py against local_vllm: vLLM's bucket layout, a full sync that lands exactly (the
session's shared run, conftest.train_run), no KV of old weights kept after it, failures that end
in a clear error with the server resumed, never a hang, and servers that come and go: one
restarted on its URL (between syncs, during one, several times) is regrouped and given the
weights; a SIGTERM mid-sync leaves no server paused; a refused update's process exits at once.
(Syncs to several replicas through train(): test_lora_sync.py, test_replicas.py; verification
and the probe: test_verify_sync.py.)"""
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

import toy
from conftest import ROOT
from local_vllm.launch import LocalServer
from train_helpers import SERVER_ARGS, SMALL
from vllm_client import VLLMClient, VLLMError
from vllm_plugin.weight_packing import buckets
from weight_sync import WeightSync, begin_update

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


# ── servers that come and go ─────────────────────────────────────────────────────────────────


def checksums(weights) -> dict[str, str]:
    """/weight_checker's baseline for `weights`: sha256 of each tensor's bytes (fp32 on CPU)."""
    return {n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in weights}


def holds(server, weights, version: str) -> bool:
    """Does the server hold exactly `weights`, published as `version`?"""
    body = {"action": "compare", "baseline": checksums(weights)}
    same = requests.post(server.url + "/weight_checker", json=body).json()["match"]
    return same and requests.get(server.url + "/weight_info").json()["weight_version"] == version


def scaled(weights, by: float):
    return [(n, t * by) for n, t in weights]


def test_a_server_restarted_between_syncs_is_regrouped_and_given_the_weights(
        start_server, toy_dir, weights, caplog):
    """A supervisor's quick restart within one sync interval, several times: b restarts on its
    port (a new process: weight version "default", no weight-transfer group), then a, then b
    twice in a row; each next sync sees the version it reports, regroups and lands on both."""
    a, b = start_server(*ARGS), start_server(*ARGS)
    servers = {"a": a, "b": b}
    clients = [VLLMClient(s.url, timeout=30.0, max_retries=1) for s in (a, b)]
    sync = WeightSync(clients, 30.0)
    sync.connect()
    specs = [(n, t.shape) for n, t in weights]
    sync.push(specs, lambda: (t for _, t in weights), version=1)
    try:
        for version, who in enumerate(["b", "a", "b", "b"], start=2):
            servers[who].stop()
            servers[who] = LocalServer(toy_dir, *ARGS, port=servers[who].port)
            sent = scaled(weights, 1 + version / 10)
            sync.push(specs, lambda: (t for _, t in sent), version=version)
            assert all(holds(s, sent, str(version)) for s in servers.values())
            assert f"{servers[who].url} restarted (it reports weight version 'default', " \
                   f"not '{version - 1}')" in caplog.text
    finally:
        for s in servers.values():
            s.stop()


def test_a_server_restarted_during_a_transfer_is_regrouped_and_sent_the_weights_again(
        start_server, toy_dir, weights, caplog):
    """b restarts while its /update_weights is under way (the new process has no session and no
    group, and refuses it): the transfer fails, b answers /health but reports weight version
    "default", so the transfer goes once more, regrouped, and lands on both; nothing is left
    paused. (The new process is started from a thread that outlives the test's use of it: a
    server dies with the thread that started it, launch.die_with.)"""
    a, b = start_server(*ARGS), start_server(*ARGS)
    asked, restarted, finished = threading.Event(), threading.Event(), threading.Event()
    new = []

    def restart():
        asked.wait()
        b.stop()
        new.append(LocalServer(toy_dir, *ARGS, port=b.port))
        restarted.set()
        finished.wait()
        new[0].stop()
    supervisor = threading.Thread(target=restart)
    supervisor.start()

    class RestartsAtUpdate(VLLMClient):
        def update_weights(self, update_info):
            if not restarted.is_set():
                asked.set()
                restarted.wait()
            super().update_weights(update_info)

    sync = WeightSync([VLLMClient(a.url, timeout=30.0, max_retries=1),
                       RestartsAtUpdate(b.url, timeout=30.0, max_retries=1)], 30.0)
    try:
        sync.connect()
        specs = [(n, t.shape) for n, t in weights]
        restarted.set()                          # the first sync: no restart
        sync.push(specs, lambda: (t for _, t in weights), version=1)
        restarted.clear()
        sent = scaled(weights, 2.0)
        sync.push(specs, lambda: (t for _, t in sent), version=2)
        assert f"{b.url} restarted (it reports weight version 'default', not '1')" in caplog.text
        assert "taken out" not in caplog.text
        assert holds(a, sent, "2") and holds(new[0], sent, "2")
        for s in (a, new[0]):
            assert requests.get(s.url + "/is_paused").json() == {"is_paused": False}
    finally:
        asked.set()
        finished.set()
        supervisor.join()


REFUSED_RUN = """
import sys, time
sys.path.insert(0, {root!r})
import toy
from vllm_client import VLLMClient
from weight_sync import WeightSync

class Refused(VLLMClient):
    def update_weights(self, info):     # refused before the server receives a byte (HTTP 400)
        super().update_weights(dict(info, shapes=info["shapes"][:-1]))

weights = [(n, p.detach()) for n, p in toy.build_model(105, seed=1).named_parameters()]
sync = WeightSync([Refused({url!r}, timeout=300.0, max_retries=0)], 300.0)
sync.connect()
try:
    sync.push([(n, t.shape) for n, t in weights], lambda: (t for _, t in weights), version=1)
finally:
    print("failed at", time.time(), flush=True)
"""


def test_a_refused_update_ends_the_process_at_once_with_its_error(start_server):
    """The server refuses the update before it receives anything, so the trainer's broadcast
    is never taken: the group is torn down at the error (the server releases its end first),
    and the process exits within 10 s of it, vllm_server_timeout (300 s) notwithstanding, its
    error the last thing it says; the server is resumed."""
    server = start_server(*ARGS)
    done = subprocess.run([sys.executable, "-c", REFUSED_RUN.format(root=ROOT, url=server.url)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    ended = time.time()
    failed = float(done.stdout.split("failed at")[-1])
    assert done.returncode == 1 and ended - failed < 10, (ended - failed, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: weight sync failed") and "HTTP 400" in last, last
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}


SIGTERM_RUN = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import train
from vllm_client import VLLMClient

update = VLLMClient.update_weights

def stopped_mid_transfer(client, info):     # the scheduler's SIGTERM lands in the 3rd sync
    calls.append(1)
    if len(calls) == 3:
        print("signalled at", time.time(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    update(client, info)

calls = []
VLLMClient.update_weights = stopped_mid_transfer
train.main({argv!r})
"""


@pytest.mark.slow
def test_a_sigterm_mid_sync_leaves_no_server_paused_and_ends_the_run_at_once(start_server,
                                                                             toy_dir, tmp_path):
    """`python train.py` against a server it did not start; SIGTERM arrives while a sync
    transfers (the scheduler's stop): the sync resumes the server on its way out (SystemExit is
    not an Exception), and the run exits 143 within 10 s; the server serves again and a later
    run syncs to it."""
    server = start_server(*SERVER_ARGS)
    argv = ["--model", toy_dir, "--vllm_server_base_url", server.url, "--max_steps", "20",
            "--reward", "toy:sum_reward",     # partial credit: an untrained toy's groups differ
            "--output_dir", str(tmp_path / "out"), "--save_strategy", "no",
            *[f"--{k}={v}" for k, v in SMALL.items()]]
    done = subprocess.run([sys.executable, "-c", SIGTERM_RUN.format(root=ROOT, argv=argv)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    ended = time.time()
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert ended - float(done.stdout.split("signalled at")[-1].split()[0]) < 10
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}
    reply = requests.post(server.url + "/v1/completions",
                          json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
    assert reply.status_code == 200
    client = VLLMClient(server.url, timeout=30.0, max_retries=0)
    sync = WeightSync([client], 30.0)
    sync.connect()
    model = toy.build_model(105, seed=1)
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    sync.push([(n, t.shape) for n, t in weights], lambda: (t for _, t in weights), version=9)
    assert holds(server, weights, "9")
