"""weight_sync.py against local_vllm: vLLM's bucket layout, a full sync that lands exactly (the
session's shared run, train_fixtures.train_run), and failures that end in a clear error with the
server resumed, never a hang. (Syncs to several replicas: test_lora_sync.py.) And the proof that
the served policy is the trained one (verify_sync.py): every sync verified by digests, every
adapter load by a probe, the served model probed at start; the fault switch
(ASYNC_GRPO_FAULT_NOISE) corrupts one tensor, which verification and the parity figure catch."""
import hashlib
import os
import signal
import time

import pytest
import requests
import torch
from peft import LoraConfig

import toy
import train
import verify_sync
from local_vllm.engine import FAULT, fault_noise
from train import AsyncGRPOConfig
from train_helpers import SERVER_ARGS, SMALL, lines
from verify_sync import chosen, digest, digest_route
from vllm_client import VLLMClient, VLLMError
from weight_sync import WeightSync, buckets

pytest_plugins = ["train_fixtures"]

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
    assert stats.total_s >= stats.transfer_s > 0
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
        start_server, weights):
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
    with pytest.warns(UserWarning, match=f"{b.url} stopped answering and is taken out") as warned:
        sync.push(specs, lambda: (t for _, t in weights), version=1)
    assert not [w for w in warned if "another run" in str(w.message)]   # the resend's own session
    assert requests.get(a.url + "/weight_info").json() == {"weight_version": "1"}
    assert requests.get(a.url + "/is_paused").json() == {"is_paused": False}
    sync.push(specs, lambda: (t for _, t in weights), version=2)
    assert requests.get(a.url + "/weight_info").json() == {"weight_version": "2"}


# ── verification (verify_sync.py) ───────────────────────────────────────────────────────────

CORRUPT = "model.layers.1.mlp.down_proj.weight"      # the fault switch's tensor in these tests
LORA = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "3")


def test_every_tensor_is_verified_within_verify_every_syncs():
    names = [f"t{i}" for i in range(19)]
    always = {"base_model.model.t0", "t18"}                 # a prefix names the same tensor
    for every in (1, 4, 8):
        seen = [chosen(names, v, every, always) for v in range(10, 10 + every)]
        assert set().union(*seen) == set(names)
        assert all({"t0", "t18"} <= set(s) for s in seen)
        assert max(map(len, seen)) <= len(names) // every + 3
    assert chosen(names, 5, 8, always, first=True) == names         # a run's first sync: all
    assert chosen(names, 5, 0, always) == []                         # off


@pytest.fixture
def corrupted(start_server, monkeypatch):
    """corrupted(name=CORRUPT): a server whose fault switch adds noise to that tensor after every
    update."""
    def start(name: str = CORRUPT):
        monkeypatch.setenv(FAULT, name)
        server = start_server(*SERVER_ARGS)
        monkeypatch.delenv(FAULT)
        return server
    return start


def test_the_stand_in_hashes_only_the_names_asked(start_server, weights):
    server = start_server(*SERVER_ARGS)
    client = VLLMClient(server.url, timeout=30)
    assert digest_route(client) == ("checker", "")
    name = "model.norm.weight"
    shown = client.weight_checker("checksum", names=[name, "model.no_such.weight"])["checksums"]
    assert list(shown) == [name]                                   # unknown names: absent
    assert len(client.weight_checker("checksum")["checksums"]) > 10       # without names: all


def test_a_corrupted_replica_is_named_with_its_tensor_and_digests_and_taken_out(
        start_server, corrupted, weights):
    """Two servers, b's fault switch on: the first sync verifies every tensor (a's all match; b's
    CORRUPT holds other bytes: the warning names b, the tensor and both digests, and b is taken
    out, resumed); the next sync sends b the weights again and verifies them again."""
    a, b = start_server(*SERVER_ARGS), corrupted()
    sync = WeightSync([VLLMClient(s.url, timeout=30, max_retries=1) for s in (a, b)], 30.0)
    sync.connect()
    specs = [(n, t.shape) for n, t in weights]
    sent = dict(weights)[CORRUPT]
    with pytest.warns(UserWarning, match=f"{b.url} failed the sync's verification") as warned:
        stats = sync.push(specs, lambda: (t for _, t in weights), version=1)
    said = " ".join(str(w.message) for w in warned)
    assert f"{CORRUPT}: sent sha256 {digest(sent)}, served {digest(fault_noise(sent))}" in said
    assert stats.verified_tensors == len(weights) and stats.verify_s > 0      # a: every tensor
    assert sync.members.live == [sync.members.clients[0]]
    for s in (a, b):
        assert requests.get(s.url + "/is_paused").json() == {"is_paused": False}
    version = [n for n, _ in weights].index(CORRUPT) + verify_sync.VERIFY_EVERY   # in its slice
    with pytest.warns(UserWarning, match=f"{b.url} failed the sync's verification"):
        stats = sync.push(specs, lambda: (t for _, t in weights), version)
    assert stats.verified_tensors < len(weights)                          # a slice of them
    assert requests.get(a.url + "/weight_info").json() == {"weight_version": str(version)}


def test_when_the_only_server_is_corrupted_the_sync_raises_naming_it(corrupted, weights):
    server = corrupted()
    sync = WeightSync([VLLMClient(server.url, timeout=30, max_retries=1)], 30.0)
    sync.connect()
    specs = [(n, t.shape) for n, t in weights]
    with pytest.raises(RuntimeError, match=f"did not land as sent: {server.url}: .*{CORRUPT}: "
                                           f"sent sha256 [0-9a-f]{{64}}, served [0-9a-f]{{64}}"):
        sync.push(specs, lambda: (t for _, t in weights), version=1)
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}
    off = WeightSync([VLLMClient(server.url, timeout=30)], 30.0, verify_every=0)
    off.connect()
    assert off.push(specs, lambda: (t for _, t in weights), version=2).verified_tensors == 0


def test_a_server_that_cannot_show_its_weights_is_said_once_and_synced_unverified(start_server,
                                                                                  weights):
    """Real vLLM without our worker extension: /collective_rpc has no such method (a 500), and
    its /weight_checker cannot be compared; here a client whose server has neither."""
    server = start_server(*SERVER_ARGS)

    class Unverifiable(VLLMClient):
        def collective_rpc(self, method, *args):
            raise VLLMError("Method 'weight_digests' is not implemented.", self.base_url, 500)

    sync = WeightSync([Unverifiable(server.url, timeout=30)], 30.0)
    with pytest.warns(UserWarning, match="cannot show the weights it holds.*not verified.*"
                                         "--worker-extension-cls weight_digests.WeightDigests"):
        sync.connect()
    specs = [(n, t.shape) for n, t in weights]
    for version in (1, 2):
        stats = sync.push(specs, lambda: (t for _, t in weights), version)
        assert stats.verified_tensors == 0
    assert requests.get(server.url + "/weight_info").json() == {"weight_version": "2"}


def fresh_toy(tmp_path) -> str:
    """The random-init toy model (the warmed-up one's shapes, other weights), saved."""
    path = str(tmp_path / "random-toy")
    toy.build_model(len(toy.build_tokenizer()), seed=5).save_pretrained(path)
    toy.build_tokenizer().save_pretrained(path)
    return path


def run(servers, out, steps, model, peft_config=None, **fields):
    config = AsyncGRPOConfig(**SMALL | dict(output_dir=str(out), max_steps=steps, save_steps=steps,
                                            vllm_server_base_url=",".join(s.url for s in servers))
                             | fields)
    return train.train(config, toy.make_dataset(64), [toy.sum_reward], model=model,
                       peft_config=peft_config)


def test_a_server_on_another_checkpoint_gets_the_trainers_weights_before_generating(
        start_server, tmp_path):
    """The trainer on the warmed-up toy, the server on a random-init toy of the same shapes (the
    names and shapes check passes): the start probe says so, the trainer sends its weights
    before the first rollout, and the first step's samples are the trainer's (max_staleness 0)."""
    from transformers import AutoModelForCausalLM
    from test_lora_sync import assert_serves
    server = start_server(*SERVER_ARGS, model_dir=fresh_toy(tmp_path))
    with pytest.warns(UserWarning, match=f"{server.url} .*another model than the trainer's on the "
                                         "start probe.*sends its weights before generation"):
        run([server], tmp_path / "out", 1, toy.ensure_saved(), max_staleness=0, learning_rate=0.0)
    assert lines(str(tmp_path / "out"))[0]["sampling/mismatch_kl"] <= 1e-6
    assert_serves(server, AutoModelForCausalLM.from_pretrained(toy.ensure_saved()).eval())


def test_an_adapter_run_against_another_base_stops_before_the_first_rollout(start_server,
                                                                            tmp_path):
    server = start_server(*SERVER_ARGS, *LORA, model_dir=fresh_toy(tmp_path))
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"{server.url} serves another base model than the "
                                         r"trained one: .*by up to \d.*tolerance 0.0001.*cannot "
                                         "fix the base"):
        run([server], tmp_path / "out", 1, toy.ensure_saved(),
            peft_config=LoraConfig(r=4, lora_alpha=8), max_staleness=1)
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")        # no step was trained
    assert time.monotonic() - start < 60


def test_a_run_with_a_corrupted_replica_goes_on_with_the_other(start_server, corrupted, toy_dir,
                                                               tmp_path):
    """Two replicas, b's fault switch on: every sync's verification names CORRUPT on b and takes
    b out (the run's first sync verifies every tensor; later ones when CORRUPT is in their
    slice), and the run finishes on a, which holds the final weights."""
    a, b = start_server(*SERVER_ARGS), corrupted()
    with pytest.warns(UserWarning, match=f"{b.url} failed the sync's verification.*{CORRUPT}"):
        last = run([a, b], tmp_path, 3, toy_dir, max_staleness=1)
    assert last["step"] == 3 and last["sync/verified_tensors"] >= 2      # embedding, head always
    assert requests.get(a.url + "/weight_info").json() == {"weight_version": "3"}


def test_without_verification_the_parity_figure_catches_a_corrupted_server(corrupted, toy_dir,
                                                                          tmp_path, monkeypatch):
    """The only server corrupted and verification off (weight_sync_verify_every=0): no start
    probe (no CPU copy of the policy is built), no digest (with verification on, this server
    would stop the run), the run goes on, and every step's sampling/mismatch_kl (k3 over the
    tokens sampled by the trainer's current weights) is far above the fp32 floor (1e-6)."""
    built = []
    monkeypatch.setattr(verify_sync.Reference, "build", lambda *a: built.append(a))
    server = corrupted("model.norm.weight")
    last = run([server], tmp_path, 2, toy_dir, max_staleness=0, weight_sync_verify_every=0)
    kl = [r["sampling/mismatch_kl"] for r in lines(str(tmp_path))]
    assert min(kl) > 1e-3, kl
    assert last["sync/verified_tensors"] == 0 and not built


def test_a_corrupted_adapter_load_is_loaded_again_then_the_replica_is_taken_out(
        start_server, monkeypatch, toy_dir, tmp_path, capfd):
    """Adapter sync to two replicas, b's fault switch on one of the adapter's tensors: the probe
    under each new adapter's name finds b's log-probs off the trainer's, b loads it once more
    (in place), fails again and is taken out; the run finishes on a. Alone, b stops the run."""
    corrupt = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    a = start_server(*SERVER_ARGS, *LORA)
    monkeypatch.setenv(FAULT, corrupt)
    b = start_server(*SERVER_ARGS, *LORA)
    monkeypatch.delenv(FAULT)
    loads = []
    load = VLLMClient.load_lora_adapter

    def counted(client, name, path, load_inplace=False):
        loads.append((client.base_url, load_inplace))
        return load(client, name, path, load_inplace)
    monkeypatch.setattr(VLLMClient, "load_lora_adapter", counted)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.warns(UserWarning, match=f"{b.url} failed the probe of policy-[0-9a-f]{{6}}-v1"
                                         f".*differ from the trainer's by up to"):
        last = run([a, b], tmp_path / "two", 2, toy_dir, peft_config=peft_config,
                   learning_rate=1e-2, max_staleness=1)
    assert last["step"] == 2 and last["sync/verify_s"] > 0
    assert (b.url, True) in loads and (a.url, True) not in loads         # b's second load only
    err = capfd.readouterr().err                    # b unloaded it: out of routing too
    assert f"the vLLM server at {b.url} failed the trainer's verification of what it" in err
    with pytest.raises(RuntimeError, match=f"did not load as trained, loaded twice: {b.url}"):
        run([b], tmp_path / "alone", 2, toy_dir, peft_config=peft_config, learning_rate=1e-2,
            max_staleness=1)
    built = []                           # verification off: no probe, no CPU copy of the policy
    monkeypatch.setattr(verify_sync.Reference, "build", lambda *a: built.append(a))
    loads.clear()
    last = run([b], tmp_path / "off", 2, toy_dir, peft_config=peft_config, learning_rate=1e-2,
               max_staleness=1, weight_sync_verify_every=0)
    assert last["step"] == 2 and not built and (b.url, True) not in loads
