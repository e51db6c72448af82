"""lora_sync.py: LoRA training and its sync, and every sync reaching every replica, against
local_vllm.

Log-probs, not checksums, judge adapters and merges: the server applies an adapter by hooks (or
holds W + s·B·A computed on our side), so its log-probs must equal those of the trained PeftModel
forward.
"""
import json
import os
import re
import shutil
import warnings

import pytest
import requests
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Qwen3ForCausalLM

import lora_sync
import toy
import train
import weight_sync
from lora_sync import adapter_refusal, max_lora_rank, merge_plan
from local_vllm_helpers import PROMPT, reference_logprobs
from train import AsyncGRPOConfig
from train_helpers import SERVER_ARGS, SMALL
from vllm_client import VLLMClient

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ARGS = SERVER_ARGS + ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "3")
LORA_SMALL = SMALL | {"learning_rate": 1e-2, "max_staleness": 1}   # max_loras 3 = max_staleness + 2


@pytest.fixture
def servers(start_server):
    """servers(n, *args): n replicas of the toy model (conftest's start_server stops them)."""
    def start(n: int, *args: str) -> list:
        return [start_server(*args) for _ in range(n)]
    return start


def run(servers, toy_dir, out, peft_config, steps=3):
    urls = ",".join(s.url for s in servers)
    config = AsyncGRPOConfig(output_dir=str(out), vllm_server_base_url=urls, max_steps=steps,
                             save_steps=steps, **LORA_SMALL)
    return train.train(config, toy.make_dataset(64), [toy.sum_reward], model=toy_dir,
                       peft_config=peft_config)


def served_logprobs(server, model: str | None = None) -> tuple[list[int], list[float]]:
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "seed": 3, "logprobs": 0,
            "return_token_ids": True} | ({"model": model} if model else {})
    reply = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    choice = reply.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_serves(server, reference_model, model: str | None = None, tol: float = 1e-5):
    tokens, logprobs = served_logprobs(server, model)
    ref = reference_logprobs(reference_model, PROMPT, tokens)
    assert max(abs(v - ref[j, t].item()) for j, (t, v) in enumerate(zip(tokens, logprobs))) <= tol


def trained(toy_dir, checkpoint: str) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(toy_dir)
    return PeftModel.from_pretrained(base, checkpoint).eval()


def adapter_cards(server) -> list[str]:
    return sorted(c["id"] for c in requests.get(server.url + "/v1/models").json()["data"][1:])


def served_at_close(monkeypatch, servers) -> list[dict]:
    """What each server serves just before the run unloads its adapters (AdapterSync.close)."""
    seen = []
    close = lora_sync.AdapterSync.close

    def snapshot(sync):
        names = [adapter_cards(s) for s in servers]
        newest = sync.loaded[-1]
        seen.append({"prefix": sync.prefix, "cards": names, "disk": sorted(os.listdir(sync.root)),
                     "served": [served_logprobs(s, newest) for s in servers]})
        close(sync)
    monkeypatch.setattr(lora_sync.AdapterSync, "close", snapshot)
    return seen


@pytest.mark.slow
def test_adapter_sync_reaches_both_replicas_and_keeps_the_staleness_window(servers, toy_dir,
                                                                           tmp_path, monkeypatch):
    """3 steps, max_staleness 1: every replica serves policy-<run>-v3 with exactly the trained
    adapter (checkpoint 3), differently from the base model, and exactly max_staleness + 1
    versions stay loaded and on disk; at the end the run unloads them all."""
    replicas = servers(2, *LORA_ARGS)
    seen = served_at_close(monkeypatch, replicas)
    last = run(replicas, toy_dir, tmp_path, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    model = trained(toy_dir, str(tmp_path / "checkpoint-3"))
    (at_close,) = seen
    prefix = at_close["prefix"]
    assert re.fullmatch(r"policy-[0-9a-f]{6}", prefix)
    assert at_close["disk"] == [f"{prefix}-v2", f"{prefix}-v3"]
    base = AutoModelForCausalLM.from_pretrained(toy_dir)
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    assert 0 < last["perf/weight_sync_bytes"] < full_bytes / 4        # the adapter, not the model
    for server, cards, (tokens, logprobs) in zip(replicas, at_close["cards"], at_close["served"]):
        assert cards == [f"{prefix}-v2", f"{prefix}-v3"]
        ref = reference_logprobs(model, PROMPT, tokens)
        assert max(abs(v - ref[j, t].item()) for j, (t, v) in enumerate(zip(tokens, logprobs))) \
            <= 1e-5
        assert served_logprobs(server) != (tokens, logprobs)          # differs from the base
        assert adapter_cards(server) == []                            # unloaded at the end
    assert os.listdir(tmp_path / ".vllm_lora") == []
    saved = json.load(open(tmp_path / "checkpoint-3" / "adapter_config.json"))
    assert saved["r"] == 4 and not (tmp_path / "checkpoint-3" / "model.safetensors").exists()


@pytest.mark.slow
def test_full_sync_reaches_every_replica(servers, toy_dir, tmp_path):
    """One collective group with both replicas' ranks: after the run both hold the checkpoint's
    weights."""
    replicas = servers(2, *SERVER_ARGS)
    run(replicas, toy_dir, tmp_path, None, steps=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-2").eval()
    for server in replicas:
        assert requests.get(server.url + "/weight_info").json()["weight_version"] == "2"
        assert_serves(server, model)


@pytest.mark.parametrize("case", ["dora", "rank above the server's"])
def test_merged_fallback_sends_the_merged_weights_with_a_warning(servers, toy_dir, tmp_path, case,
                                                                caplog):
    (server,) = servers(1, *LORA_ARGS)
    if case == "dora":
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=True)
    else:
        peft_config = LoraConfig(r=16, lora_alpha=8, target_modules=TARGETS)
    last = run([server], toy_dir, tmp_path, peft_config, steps=2)
    said = caplog.text
    assert "merged weights" in said
    assert ("DoRA" in said) if case == "dora" else ("--max-lora-rank 16" in said)
    assert last["perf/weight_sync_bytes"] > 1e6                           # the whole model
    assert_serves(server, trained(toy_dir, str(tmp_path / "checkpoint-2")), tol=2e-5)
    assert [c["id"] for c in requests.get(server.url + "/v1/models").json()["data"]][1:] == []


def test_adapter_refusals_name_the_problem_and_the_flags():
    lora = {"lora_config": {"max_lora_rank": 32, "max_loras": 6}}
    plain = LoraConfig(r=32)
    assert adapter_refusal([lora], ["u"], plain, max_staleness=4) is None
    short = {"lora_config": {"max_lora_rank": 32, "max_loras": 5}}
    assert "--max-loras 6" in adapter_refusal([lora, short], ["u", "v"], plain, 4)
    none = {"lora_config": None}
    assert "v serves no LoRA" in adapter_refusal([lora, none], ["u", "v"], plain, 4)
    assert "--max-lora-rank 64" in adapter_refusal([lora], ["u"], LoraConfig(r=48), 4)
    assert "DoRA" in adapter_refusal([lora], ["u"], LoraConfig(r=8, use_dora=True), 4)
    data_parallel = lora | {"parallel_config": {"data_parallel_size": 2}}  # the LoRA note's refusal
    assert "v runs --data-parallel-size 2" in adapter_refusal([lora, data_parallel], ["u", "v"],
                                                              plain, 4)
    whole = LoraConfig(r=8, modules_to_save=["lm_head"])
    assert "modules_to_save" in adapter_refusal([lora], ["u"], whole, 4)


def test_adapter_refusals_follow_what_vllm_loads():
    """vLLM 0.32's PEFTHelper refuses lora_bias, base-bias training, base-changing inits and
    checks the largest rank_pattern rank; it loads rslora, alpha_pattern and fan_in_fan_out
    adapters (lora_A, lora_B have nn.Linear's layout either way); peft variants it does not read
    are refused, since it would serve them as plain LoRA."""
    lora = {"lora_config": {"max_lora_rank": 8, "max_loras": 6}}
    for loads in (LoraConfig(r=8, use_rslora=True), LoraConfig(r=8, fan_in_fan_out=True),
                  LoraConfig(r=4, rank_pattern={"q_proj": 8}, alpha_pattern={"v_proj": 32})):
        assert adapter_refusal([lora], ["u"], loads, 4) is None
    refusals = {"lora_bias": LoraConfig(r=8, lora_bias=True),
                "bias='all'": LoraConfig(r=8, bias="all"),
                "init_lora_weights='pissa'": LoraConfig(r=8, init_lora_weights="pissa"),
                "velora_config as plain LoRA": LoraConfig(r=8, velora_config={}),
                "--max-lora-rank 16 --max-loras 6": LoraConfig(r=8, rank_pattern={"q_proj": 16})}
    for said, peft_config in refusals.items():
        assert said in adapter_refusal([lora], ["u"], peft_config, 4)


def gpt2() -> GPT2LMHeadModel:
    """A one-layer GPT-2: its c_attn, c_proj and c_fc are Conv1D, whose weight is [in, out]."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                      n_positions=32, bos_token_id=0, eos_token_id=0))


def toy_qwen3(attention_bias: bool = False) -> Qwen3ForCausalLM:
    """toy.py's Qwen3, optionally with biases on q/k/v/o_proj (its MLP has none)."""
    config = toy.build_model(64).config
    config.attention_bias = attention_bias
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


VARIANTS = {
    "gpt2 fan_in_fan_out lora_bias": (gpt2, LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
        lora_bias=True)),
    "gpt2 fan_in_fan_out dora modules_to_save": (gpt2, LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
        use_dora=True, modules_to_save=["ln_f"])),
    "qwen3 lora_bias": (lambda: toy_qwen3(attention_bias=True), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_bias=True)),
    "qwen3 rslora": (toy_qwen3, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                           use_rslora=True)),
    "qwen3 rank_pattern alpha_pattern": (toy_qwen3, LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, rank_pattern={"q_proj": 8, "down_proj": 2},
        alpha_pattern={"v_proj": 32})),
}


def randomized(model, peft_config) -> PeftModel:
    """model under peft_config with every trained tensor random: peft starts lora_B (and its
    bias) at zero, so an untouched adapter would merge to the base weights, right or wrong."""
    peft_model = get_peft_model(model, peft_config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.5 + ("magnitude" in name))
    return peft_model


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_weights_and_biases_equal_peft_merge_and_unload(variant):
    """Every tensor the merged sync (a FullSync of merge_plan) sends equals the state dict of
    peft's merge_and_unload() (fp32, 1e-6) under the same name; the adapted ones (and a
    modules_to_save copy) differ from the model before peft (the test is not trivial); only the
    LM head, tied to the embedding, is not sent."""
    build, peft_config = VARIANTS[variant]
    warnings.simplefilter("ignore")                         # peft: Conv1D, fan_in_fan_out notes
    model = build()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    peft_model = randomized(model, peft_config)
    plan = merge_plan(peft_model)
    sync = weight_sync.FullSync(None, [], AsyncGRPOConfig(), plan=plan)
    sent = {name: t.clone() for (name, _), t in zip(sync.specs(), sync.tensors())}
    reference = peft_model.merge_and_unload().state_dict()
    assert list(reference) == list(sent) + ["lm_head.weight"]
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
    changed = {name for name in sent if not torch.equal(sent[name], before[name])}
    adapted = {name for name, _, delta in plan if delta is not None}
    assert adapted <= changed and adapted
    if peft_config.lora_bias:
        assert {n for n in adapted if n.endswith(".bias")} == \
            {n.replace(".weight", ".bias") for n in adapted if n.endswith(".weight")}
    if peft_config.modules_to_save:
        assert "transformer.ln_f.weight" in changed


@pytest.mark.parametrize("case", ["embedding", "lora_bias without a bias", "velora"])
def test_what_merged_cannot_merge_is_refused_at_start(case):
    """merge_plan (the merged sync's start) names the layer and why, where Delta.merged would be
    wrong."""
    warnings.simplefilter("ignore")
    peft_config, said = {
        "embedding": (LoraConfig(r=4, target_modules=["embed_tokens"]), "Embedding layer"),
        "lora_bias without a bias": (LoraConfig(r=4, target_modules=["up_proj"], lora_bias=True),
                                     "lora_bias on a layer without a bias"),
        "velora": (LoraConfig(r=4, target_modules=["up_proj"], velora_config={}), "Velora"),
    }[case]
    with pytest.raises(ValueError, match=f"cannot merge base_model.model.model.*{said}"):
        merge_plan(get_peft_model(toy_qwen3(), peft_config))


def test_lora_with_save_strategy_no_is_warned_about_at_start(tmp_path, caplog):
    """Spec (LoRA): <output_dir>/.vllm_lora/ is a serving cache, so a LoRA run with
    save_strategy='no' ends with nothing; that is said at start, before any server is reached
    (here none answers, and the run stops). A full fine-tuning run is not told."""
    said = "save_strategy='no' with LoRA: this run will keep no adapter"
    for peft_config in (LoraConfig(r=4, target_modules=TARGETS), None):
        config = AsyncGRPOConfig(output_dir=str(tmp_path / str(peft_config is None)),
                                 vllm_server_base_url="http://127.0.0.1:9", save_strategy="no",
                                 **LORA_SMALL | {"vllm_server_timeout": 1.0})
        caplog.clear()
        with pytest.raises(Exception, match="127.0.0.1:9"):
            train.train(config, toy.make_dataset(8), [toy.sum_reward], model="toy",
                        peft_config=peft_config)
        assert (said in caplog.text) == (peft_config is not None), caplog.text


def test_max_lora_rank_is_the_smallest_rank_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 4, 8, 9, 32, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]


def test_a_run_removes_the_adapter_folders_a_killed_run_left(servers, toy_dir, tmp_path):
    """Issue 34: a killed run leaves its adapters in <output_dir>/.vllm_lora/. The next run into
    that output_dir removes them (a half-written one included): no other run can be using them,
    since a live run holds its output_dir (checkpoint.hold, tested in test_checkpoint). At its
    end the run unloads and removes its own: the folder is left empty."""
    root = tmp_path / ".vllm_lora"
    for name in ("policy-dead01-v3", ".policy-dead01-v4.tmp"):
        os.makedirs(root / name)
        (root / name / "adapter_config.json").write_text("{}")
    removed = []
    rmtree = shutil.rmtree

    def recorded(path, *args, **kwargs):
        removed.append(os.path.basename(path))
        rmtree(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "rmtree", recorded)
        run(servers(1, *LORA_ARGS), toy_dir, tmp_path,
            LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), steps=1)
    assert removed[0] == ".vllm_lora" and os.listdir(root) == []


def test_a_lora_run_sends_its_base_only_where_the_served_base_differs(start_server, toy_dir,
                                                                     tmp_path, monkeypatch,
                                                                     caplog):
    """Two replicas of the trained model with weight transfer beside runtime LoRA; another job
    left b holding other weights (a random-init toy, sent by weight transfer). The start probe
    tells them apart: b is sent the trained base (one line says so) and joins a weight-transfer
    group for it; a joins none and gets adapters only (its weight version stays vLLM's
    "default"); both then serve the trained adapter."""
    a, b = start_server(*LORA_ARGS), start_server(*LORA_ARGS)
    other = toy.build_model(len(toy.build_tokenizer()), seed=5)
    weights = [(n, p.detach()) for n, p in weight_sync.language_parameters(other)]
    job = weight_sync.WeightSync([VLLMClient(b.url, timeout=30.0)], 30.0)
    job.connect()
    job.push([(n, t.shape) for n, t in weights], lambda: (t for _, t in weights), version=7)
    joined = []
    init = VLLMClient.init_weight_transfer_engine

    def recorded(client, init_info):
        joined.append(client.base_url)
        init(client, init_info)
    monkeypatch.setattr(VLLMClient, "init_weight_transfer_engine", recorded)
    last = run([a, b], toy_dir, tmp_path / "out", LoraConfig(r=4, lora_alpha=8,
                                                             target_modules=TARGETS), steps=2)
    assert last["step"] == 2 and last["sync/probe_kl"] < 1e-5
    assert joined == [b.url]
    assert f"LoRA sync: sending the trained base model to ['{b.url}']" in caplog.text
    assert requests.get(a.url + "/weight_info").json() == {"weight_version": "default"}
    assert requests.get(b.url + "/weight_info").json() == {"weight_version": "0"}
