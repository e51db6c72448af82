"""The trainer end to end on CPU: train.py against serve_local.py, in this process or as a CLI.

One shared run (`run`, 4 steps, max_staleness=0, a token budget) serves the metric, stale-drop, sync
and checkpoint tests; the two-rank, resume and failure tests start their own processes.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import toy
import train
from conftest import ROOT, LocalServer, free_port
from rollout_helpers import CurriculumConfig, CurriculumRolloutLoop
from train import AsyncGRPOConfig, AsyncGRPOTrainer

SERVER_ARGS = ("--max-model-len", "128", "--weight-transfer-config", '{"backend":"gloo"}', "--logprobs-mode",
               "processed_logprobs", "--max-logprobs", "-1")
SMALL = dict(num_generations=4, max_completion_length=6, per_device_train_batch_size=4, token_budget=96,
             gradient_checkpointing=False, learning_rate=1e-3, vllm_server_timeout=60.0, disable_tqdm=True)


def lines(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def server(toy_dir):
    s = LocalServer(toy_dir, *SERVER_ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def run(server, toy_dir, tmp_path_factory):
    """4 steps, a sync after each, checkpoints at 2 and 4 (limit 1 kept), max_staleness 0."""
    out = str(tmp_path_factory.mktemp("run"))
    config = AsyncGRPOConfig(output_dir=out, vllm_server_base_url=server.url, max_steps=4, save_steps=2,
                             save_total_limit=1, max_staleness=0, **SMALL)
    last = train.train(config, toy.make_dataset(64), [toy.sum_reward], model=toy_dir)
    return out, last


def test_every_trainer_metric_the_spec_names_is_logged(run):
    out, last = run
    records = lines(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and last == records[-1]
    names = set().union(*records)
    spec = {  # 記録されたメトリクス: the trainer's side (MFU is absent on CPU, as the spec allows)
        "sample/forwarded_tokens_mean", "sample/forwarded_tokens_max", "sample/trained_tokens_mean",
        "sample/rollout_queue_size", "sample/time_in_queue_s", "sample/staleness_mean", "sample/staleness_max",
        "sample/dropped_stale_total", "reward_group_std", "rewards/sum_reward/mean", "rewards/sum_reward/group_std",
        "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max", "num_tokens",
        "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step", "batch/samples_per_step",
        "batch/groups_per_step", "batch/microbatches_per_step", "batch/masked_token_frac", "batch/samples_per_row",
        "batch/row_tokens_mean", "batch/row_tokens_max", "batch/row_fill_frac", "batch/row_imbalance",
        "batch/packing_ratio", "batch/pad_frac", "batch/dropped_oversize_total",
        "perf/step_s", "perf/fwd_bwd_s", "perf/fwd_s", "perf/optimizer_s", "perf/rollout_wait_s",
        "perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s", "perf/weight_sync_transfer_s",
        "perf/forwarded_tok_s_fwd_bwd", "perf/forwarded_tok_s_wall_clock", "perf/trained_tok_s_wall_clock",
        "reward", "frac_reward_zero_std", "rollout/concurrency_cap", "completions/mean_length"}
    assert spec <= names, sorted(spec - names)
    assert not any(name.startswith("perf/mfu") for name in names)
    for r in records:   # the hierarchy the spec describes: a step is its micro-batches of rows
        assert r["batch/microbatches_per_step"] == 1
        assert r["batch/samples_per_step"] == r["batch/samples_per_row"]      # row-slots: GA 1 × 1 rank
    tokens = [r["num_tokens"] for r in records]
    assert tokens == sorted(tokens) and tokens[-1] == sum(r["batch/forwarded_tokens_per_step"] for r in records)


def test_stale_samples_are_dropped_and_counted(run):
    """max_staleness=0 with a token budget: the sample that closes a micro-batch waits in the next row
    while the weights move on, so admission alone would let it through one version stale."""
    records = lines(run[0])
    assert all(r["sample/staleness_max"] == 0 for r in records)
    dropped = [r["sample/dropped_stale_total"] for r in records]
    assert dropped == sorted(dropped) and dropped[-1] >= 3        # a running total; one per step boundary


def test_after_a_sync_the_server_holds_the_trainers_weights(run, server):
    """The last sync (after step 4) sent exactly the weights of checkpoint-4: the server's checksums of
    every tensor match those of the checkpoint (fp32 on CPU: bit for bit)."""
    import hashlib

    from safetensors.torch import load_file
    weights = load_file(os.path.join(run[0], "checkpoint-4", "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])          # tied
    expected = {n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for n, t in weights.items()}
    import httpx
    reply = httpx.post(server.url + "/weight_checker", json={"action": "compare", "baseline": expected}).json()
    assert reply == {"match": True, "mismatches": []}
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == "4"


def test_checkpoints_are_complete_pruned_and_load_with_from_pretrained(run, toy_dir):
    from transformers import AutoModelForCausalLM
    out = run[0]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint")) == ["checkpoint-4"]   # limit 1
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    ckpt = os.path.join(out, "checkpoint-4")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    base = AutoModelForCausalLM.from_pretrained(toy_dir)
    assert model.dtype == torch.float32
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)   # it trained
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert (state["global_step"], state["model_version"]) == (4, 4)
    assert json.load(open(os.path.join(ckpt, "rollout_state.json")))["prompt_index"] > 0


def test_two_ranks_give_the_weights_of_one_process(tmp_path):
    """One optimizer step on 2 gloo ranks (FSDP2 shards, each rank its row of every micro-batch) equals
    one process training every row: the loss is one token mean over the step, summed over ranks."""
    script = os.path.join(ROOT, "tests", "two_rank_step.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, script, str(tmp_path / "one.pt")], check=True, env=env, timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(free_port()), script,
                    str(tmp_path / "two.pt")], check=True, env=env, timeout=300)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    torch.manual_seed(0)
    init = dict(toy.build_model(len(toy.build_tokenizer())).named_parameters())
    moved = max((one[n] - init[n]).abs().max() for n in one)
    assert moved > 1e-3                                                  # the step did something
    for n in one:
        assert (one[n] - two[n]).abs().max() <= 1e-6 * one[n].abs().max(), n
        assert (one[n] - two[n]).abs().max() <= 1e-4 * moved, n


def test_quickstart_and_curriculum_examples_train(server, toy_dir, tmp_path):
    """The spec's quickstart and curriculum example, with the toy model and dataset in place of hub names."""
    trainer = AsyncGRPOTrainer(model=toy_dir, reward_funcs=toy.sum_reward, train_dataset=toy.make_dataset(32),
                               args=AsyncGRPOConfig(output_dir=str(tmp_path / "q"), vllm_server_base_url=server.url,
                                                    max_steps=2, **SMALL))
    assert trainer.train()["step"] == 2

    class CurriculumTrainer(AsyncGRPOTrainer):
        loop_cls = CurriculumRolloutLoop

    args = CurriculumConfig(output_dir=str(tmp_path / "c"), vllm_server_base_url=server.url, max_steps=2,
                            pass_rate_cap=0.9, **SMALL)
    assert CurriculumTrainer(model=toy_dir, reward_funcs=toy.sum_reward, train_dataset=toy.make_dataset(32),
                             args=args).train()["step"] == 2


# ── processes: resume after SIGKILL, failures ───────────────────────────────────────────────


def cli(out: str, url: str, dataset: str, *extra: str, record: str | None = None) -> subprocess.Popen:
    """`python train.py` against `url`, in its own process group, with recorded_reward."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"), OMP_NUM_THREADS="1")
    if record:
        env["TRAIN_TEST_RECORD"] = record
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", os.path.dirname(dataset) + "/model",
           "--dataset", dataset, "--reward", "train_helpers:recorded_reward", "--vllm_server_base_url", url,
           "--output_dir", out, "--disable_tqdm", "true", *(f"--{k}={v}" for k, v in SMALL.items() if k != "disable_tqdm"),
           *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.fixture
def indexed(tmp_path, toy_dir):
    """A prompt file with an `index` column, and the toy model beside it."""
    os.symlink(toy_dir, tmp_path / "model")
    rows = [dict(r, index=i) for i, r in enumerate(toy.make_dataset(200))]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def newest_checkpoint(out: str) -> int:
    steps = [int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-")] if os.path.isdir(out) else []
    return max(steps, default=0)


def test_killed_run_resumes_at_the_saved_prompt_with_its_optimizer_state(server, indexed, tmp_path):
    out, first, second = str(tmp_path / "out"), str(tmp_path / "first"), str(tmp_path / "second")
    proc = cli(out, server.url, indexed, "--max_steps", "8", "--save_steps", "2", record=first)
    deadline = time.monotonic() + 240
    while newest_checkpoint(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)                         # the trainer and its rollout process, mid-run
    proc.wait()
    k = newest_checkpoint(out)
    assert 2 <= k < 8, proc.stdout.read()
    saved = json.load(open(os.path.join(out, f"checkpoint-{k}", "rollout_state.json")))["prompt_index"]
    proc = cli(out, server.url, indexed, "--max_steps", "8", "--save_steps", "2", "--resume_from_checkpoint",
               "true", record=second)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    resumed = [int(x) for x in open(second).read().split()]
    assert saved in resumed and min(resumed) == saved        # it starts at the first prompt not yet trained
    state = json.load(open(os.path.join(out, "checkpoint-8", "trainer_state.json")))
    assert (state["global_step"], state["model_version"]) == (8, 8)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(os.path.join(out, "checkpoint-8", "fsdp"), tmp_path / "final.pt")
    optim = torch.load(tmp_path / "final.pt", weights_only=False)["optim"]["state"]
    assert {float(s["step"]) for s in optim.values()} == {8.0}   # Adam kept counting from the checkpoint
    steps = [r["step"] for r in lines(out)]
    assert steps[-(8 - k):] == list(range(k + 1, 9))


@pytest.mark.parametrize("victim", ["server", "rollout process"])
def test_a_dying_server_or_rollout_process_stops_the_trainer_cleanly(toy_dir, indexed, tmp_path, victim):
    """Kill a piece mid-run: the trainer exits non-zero, names the cause, leaves no process behind, and
    the last complete checkpoint stays loadable."""
    server = LocalServer(toy_dir, *SERVER_ARGS)
    out = str(tmp_path / "out")
    try:
        proc = cli(out, server.url, indexed, "--max_steps", "200", "--save_steps", "1")
        deadline = time.monotonic() + 240
        while newest_checkpoint(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children, "the rollout process should be running"
        if victim == "server":
            server.stop()
        else:
            for pid in children:
                os.kill(int(pid), signal.SIGKILL)
        log, _ = proc.communicate(timeout=180)
    finally:
        server.stop()
    assert proc.returncode != 0
    cause = "rollout process" if victim == "rollout process" else server.url.split("//")[1]
    assert cause in log, log[-3000:]
    def alive():
        return [open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120] for pid in children
                if os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    deadline = time.monotonic() + 10          # multiprocessing's resource tracker leaves when it sees EOF
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(os.path.join(out, f"checkpoint-{newest_checkpoint(out)}"))


def test_plot_draws_the_run(run):
    import train_metrics
    path = train_metrics.plot(run[0])
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_a_vision_language_model_trains_and_syncs_only_its_language_model(tmp_path):
    """A tiny Qwen3.5 vision-language checkpoint loads with AutoModelForImageTextToText; the vision tower
    gets no gradient and no optimizer state, keeps its weights through a step, and is not synced."""
    import torch.distributed as dist
    import transformers as tf

    from test_tree_attention import pack, samples
    from test_tree_gated_delta_rule import HYBRID
    text = {**HYBRID, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1)
    torch.manual_seed(0)
    tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path / "vlm")
    config = AsyncGRPOConfig(gradient_checkpointing=False, learning_rate=1e-2, score_centering=False,
                             vllm_importance_sampling_clip_min=0.0, vllm_importance_sampling_clip_max=1e9)
    rank, world, device = train.setup_distributed(config)
    try:
        model, _ = train.load_model(str(tmp_path / "vlm"), config, processing_class=toy.build_tokenizer())
        assert isinstance(model, tf.Qwen3_5ForConditionalGeneration)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        tower = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert tower and all(".visual." in f".{n}" for n in tower)
        synced = {n for n, _ in train.language_parameters(model)}
        assert synced and not synced & tower and synced | tower == set(before)
        policy = train.shard(train.Policy(model), config, device)
        optimizer, scheduler = train.build_optimizer(policy, config)
        assert sum(len(g["params"]) for g in optimizer.param_groups) == len(synced)
        row = pack(samples(2))
        train.train_step(policy, optimizer, scheduler, [row], row.trained_tokens, config, world, aux_coef=0.0)
        after = {n: train.full(p) for n, p in policy.model.named_parameters()}
        assert all(torch.equal(after[n], before[n]) for n in tower)
        assert any(not torch.equal(after[n], before[n]) for n in synced)
    finally:
        dist.destroy_process_group()


def test_the_toy_demo_learns(tmp_path):
    """`python train.py` (the toy demo, its own server) on a short schedule: the mean reward of the last
    steps clearly beats the first steps' (bench.py learn runs the whole demo)."""
    out = str(tmp_path / "toy")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--output_dir", out, "--max_steps", "90",
                    "--save_strategy", "no", "--disable_tqdm", "true"], check=True, env=env, timeout=900,
                   capture_output=True)
    rewards = [r["reward"] for r in lines(out) if "reward" in r]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, rewards


def test_a_turn_stops_on_every_eos_the_generation_config_declares(toy_dir):
    """Issue 10: the stop tokens come from the model's generation config (all its EOS ids), and the
    tokenizer's own EOS."""
    from transformers import AutoModelForCausalLM
    model, tokenizer = AutoModelForCausalLM.from_pretrained(toy_dir), toy.build_tokenizer()
    model.generation_config.eos_token_id = [7, 3]
    assert train.stop_token_ids(model, tokenizer) == sorted({3, 7, tokenizer.eos_token_id})
    model.generation_config.eos_token_id = None
    assert train.stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id]
