"""train.py end to end on CPU, against local_vllm: in this process, as a CLI, and on two ranks.

The stale-drop test reads the session's shared run (conftest.train_run, also read by
test_checkpoint.py, test_metrics.py and test_weight_sync.py); the other tests train against
servers of their own (a sync changes a server's weights), and the two-rank and failure tests start
processes of their own. Then the command line (parse_cli); last, the trainer's surface: the
spec's positional order and refusals, callbacks, trainer.state and save_model.
"""
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
import toy
import train
from rollout_helpers import CurriculumConfig, CurriculumRolloutLoop
from config import AsyncGRPOConfig
from loss import StepTotals
from train import AsyncGRPOTrainer
from test_rollout_worker import family
from train_helpers import LAUNCHED, ROOT, SERVER_ARGS, SMALL, cli, lines, newest_checkpoint
from trie_pack import Planner
from weight_sync import free_port, full_tensor, language_parameters


def test_stale_samples_are_dropped_and_counted(train_run):
    """max_staleness=0 with a token budget: the sample that closes a micro-batch waits in the next
    row while the weights move on, so admission alone would let it through one version stale."""
    records = lines(train_run[0])
    assert all(r["sample/staleness_max"] == 0 for r in records)
    dropped = [r["sample/dropped_stale_total"] for r in records]
    assert dropped == sorted(dropped) and dropped[-1] >= 3    # a running total; one a step boundary


def test_feed_counts_on_the_state_it_is_given_and_packs_the_step():
    """Feed.next_step drops the stale and the oversize samples and counts them, and the forwarded
    tokens, on the TrainState it is given (here as a resume loads it: the counts continue); it
    returns the Step: packed, its trained-token count (which scatter_rows hands out as is) and
    the figures the metrics read."""
    from test_trie_pack import sample

    class Worker:                       # RolloutWorker's get(), qsize() and dropped_stale()
        def __init__(self, samples):
            self.samples = samples
            self.stale = 0

        def get(self, timeout=None):
            return self.samples.pop(0)

        def qsize(self):
            return len(self.samples)

        def resume_state(self, held):
            return {"prompt_index": 0, "trained": {}}

        def dropped_stale(self):
            self.stale += 1

    fresh = [sample([1, 2, 3 + i], [0, 1, 1], group=i, version=1) for i in range(2)]
    stale = sample([1, 2, 9], [0, 1, 1], version=0)
    big = sample(range(9), [0] + [1] * 8, version=1)                   # over token_budget 8
    state = checkpoint.TrainState(num_tokens=100, dropped_stale_total=2, dropped_oversize_total=1)
    feed = train.Feed(Worker([fresh[0], stale, big, fresh[1], None]), Planner(1, 8, 1), 2, state)
    step = feed.next_step(version=1, max_staleness=0)
    packed = step.packed
    assert [[p.num_samples for p in micro] for micro in packed] == [[2]]   # the prompts ran out
    assert (state.dropped_stale_total, state.dropped_oversize_total) == (3, 2)
    assert feed.worker.stale == 1                   # told: admission's fault, not consumption
    assert state.num_tokens == 100 + packed[0][0].unique_tokens
    assert step.totals.tokens == packed[0][0].trained_tokens == 4
    assert (step.samples, step.queue_size) == (fresh, 5)
    assert step.version == 1 and len(step.row_metrics) == 1
    rows, totals = train.scatter_rows(step, rank=0, world=1)
    assert rows[0] is packed[0][0] and (totals.tokens, totals.samples, totals.rows) == (4, 2, 1)
    assert feed.next_step(version=1, max_staleness=0) is None
    assert train.scatter_rows(None, rank=0, world=1) == (None, None)
    assert (state.num_tokens, state.dropped_stale_total) == (100 + packed[0][0].unique_tokens, 3)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_give_the_weights_of_one_process(tmp_path, precision):
    """One optimizer step on 2 gloo ranks (FSDP2 shards, each rank its row of every micro-batch)
    equals one process training every row: the loss is one token mean over the step, summed over
    ranks. In bf16 too: each row's bf16 forward and backward is the same on either, the
    gradients are reduced in fp32."""
    script = os.path.join(ROOT, "tests", "two_rank_step.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for cmd in ([script, str(tmp_path / "one.pt"), precision],
                ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port()), script, str(tmp_path / "two.pt"),
                 precision]):
        done = subprocess.run([sys.executable, *cmd], env=env, timeout=300, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    torch.manual_seed(0)
    init = dict(toy.build_model(len(toy.build_tokenizer())).named_parameters())
    moved = max((one[n] - init[n]).abs().max() for n in one)
    assert moved > 1e-3                                                  # the step did something
    for n in one:
        assert (one[n] - two[n]).abs().max() <= 1e-6 * one[n].abs().max(), n
        assert (one[n] - two[n]).abs().max() <= 1e-4 * moved, n


def test_a_rank_that_never_joins_fails_within_the_timeout_naming_the_wait(tmp_path):
    """Rank 0 of 2 under torchrun's variables, rank 1 never started: setup_distributed raises
    after ddp_timeout, saying how many joined and where, not a hang."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    code = ("import train; train.setup_distributed(train.AsyncGRPOConfig(ddp_timeout=3, "
            "vllm_server_timeout=1, rollout_worker_timeout=1))")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and time.monotonic() - start < 60
    assert "rank 0 of 2: the process group at 127.0.0.1" in done.stderr
    assert "did not form within 3s" in done.stderr and "1/2 clients joined" in done.stderr


@pytest.mark.slow
def test_quickstart_and_curriculum_examples_train(start_server, toy_dir, tmp_path):
    """The spec's quickstart and curriculum example, with the toy model and dataset in place of hub
    names."""
    server = start_server(*SERVER_ARGS)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "q"), vllm_server_base_url=server.url,
                           max_steps=2, **SMALL)
    trainer = AsyncGRPOTrainer(model=toy_dir, reward_funcs=toy.sum_reward,
                               train_dataset=toy.make_dataset(32), args=args)
    assert trainer.train()["step"] == 2

    class CurriculumTrainer(AsyncGRPOTrainer):
        loop_cls = CurriculumRolloutLoop

    args = CurriculumConfig(output_dir=str(tmp_path / "c"), vllm_server_base_url=server.url,
                            max_steps=2, pass_rate_cap=0.9, **SMALL)
    trainer = CurriculumTrainer(model=toy_dir, reward_funcs=toy.sum_reward,
                                train_dataset=toy.make_dataset(32), args=args)
    assert trainer.train()["step"] == 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_run_trains(start_server, toy_dir, tmp_path, precision, monkeypatch):
    """Issue 32: bf16 stopped at step 1 (FSDP2's input cast emptied the tree masks). bf16, and
    fp16 with loss scaling, train through FSDP2's MixedPrecisionPolicy, with gradient
    checkpointing (its recompute is cast again): finite losses, and the saved matrices moved."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    scales, update = [], ShardedGradScaler.update

    def spy(scaler, *args):                         # the scale each fp16 step's loss was scaled by
        scales.append(scaler.get_scale())
        return update(scaler, *args)
    monkeypatch.setattr(ShardedGradScaler, "update", spy)
    server = start_server(*SERVER_ARGS)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=server.url,
                             max_steps=2, bf16=precision == "bf16", fp16=precision == "fp16",
                             **SMALL | {"gradient_checkpointing": True})
    train.train(config, toy.make_dataset(32), [toy.sum_reward], model=toy_dir)
    records = lines(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert scales == ([2.0 ** 16] * 2 if precision == "fp16" else [])   # 1.0: scaling off
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    before = load_file(os.path.join(toy_dir, "model.safetensors"))
    after = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    assert {t.dtype for t in after.values()} == {dtype}          # saved in the compute dtype
    for name, p in before.items():
        assert p.ndim < 2 or not torch.equal(p.to(dtype), after[name]), name


# ── processes: failures ─────────────────────────────────────────────────────────────────────


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["server", "rollout process"])
def test_a_dying_server_or_rollout_process_stops_the_trainer_cleanly(start_server, indexed,
                                                                      tmp_path, victim):
    """Kill a piece mid-run: the trainer exits non-zero, names the cause, leaves no process behind,
    and the last complete checkpoint stays loadable."""
    server = start_server(*SERVER_ARGS)
    out = str(tmp_path / "out")
    try:
        proc = cli(out, server.url, indexed, "--max_steps", "200", "--save_steps", "1")
        deadline = time.monotonic() + 240
        while newest_checkpoint(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        pgrep = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        children = pgrep.stdout.split()
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
                if os.path.exists(f"/proc/{pid}")
                and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    deadline = time.monotonic() + 10      # multiprocessing's resource tracker leaves on EOF
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(os.path.join(out, f"checkpoint-{newest_checkpoint(out)}"))


def test_the_embedded_servers_exit_is_said_with_its_code_and_log(tmp_path):
    """`python train.py` starts its own server (local_vllm); killed mid-run, the run stops saying
    that this server exited, with its exit code, the end of its log and the log's path (it said
    "is it running? Restart it, or remove it from vllm_server_base_url", for a URL the user
    never gave)."""
    out = tmp_path / "toy"
    with open(tmp_path / "output", "w") as output:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), "--output_dir", str(out),
             "--max_steps", "1000", "--save_strategy", "no", "--disable_tqdm", "true"],
            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True)
    LAUNCHED.append(proc)                       # killed after the test if it outlives it
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "no first step"
        time.sleep(0.2)
    server, = [pid for pid in family(proc.pid)
               if "local_vllm.server" in open(f"/proc/{pid}/cmdline").read()]
    os.kill(server, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    said = (tmp_path / "output").read_text()
    assert re.search(r"RuntimeError: local_vllm.server at http://127.0.0.1:\d+, started by this "
                     r"process, exited with code -9; its log \(" + re.escape(str(out)) +
                     r"/serve_local.log\) ends:\n", said), said[-3000:]


def test_a_vision_language_model_trains_and_syncs_only_its_language_model(tmp_path):
    """A tiny Qwen3.5 vision-language checkpoint loads with AutoModelForImageTextToText; the vision
    tower gets no gradient and no optimizer state, keeps its weights through a step, and is not
    synced."""
    import torch.distributed as dist
    import transformers as tf

    from test_tree_attention import pack, samples
    from test_tree_gated_delta_rule import HYBRID
    text = {**HYBRID, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    torch.manual_seed(0)
    vlm_config = tf.Qwen3_5Config(text_config=text, vision_config=vision)
    vlm = tf.Qwen3_5ForConditionalGeneration(vlm_config)
    vlm.save_pretrained(tmp_path / "vlm")
    config = AsyncGRPOConfig(gradient_checkpointing=False, learning_rate=1e-2,
                             score_centering=False, vllm_importance_sampling_clip_min=0.0,
                             vllm_importance_sampling_clip_max=1e9)
    rank, world, device = train.setup_distributed(config)
    try:
        model, _ = train.load_model(str(tmp_path / "vlm"), config,
                                    processing_class=toy.build_tokenizer())
        assert isinstance(model, tf.Qwen3_5ForConditionalGeneration)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        tower = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert tower and all(".visual." in f".{n}" for n in tower)
        synced = {n for n, _ in language_parameters(model)}
        assert synced and not synced & tower and synced | tower == set(before)
        policy = train.shard(train.Policy(model), config, device)
        optimizer, scheduler = train.build_optimizer(policy, config)
        assert sum(len(g["params"]) for g in optimizer.param_groups) == len(synced)
        row = pack(samples(2))
        train.train_step(policy, optimizer, scheduler, [row], StepTotals.of([row]), config, world,
                         aux_coef=0.0)
        after = {n: full_tensor(p) for n, p in policy.model.named_parameters()}
        assert all(torch.equal(after[n], before[n]) for n in tower)
        assert any(not torch.equal(after[n], before[n]) for n in synced)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_toy_demo_learns(tmp_path):
    """`python train.py` (the toy demo, its own server) on a short schedule: the mean reward of the
    last steps clearly beats the first steps' (`python -m tools.bench learn` runs the whole
    demo)."""
    out = str(tmp_path / "toy")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--output_dir", out,
                    "--max_steps", "300", "--save_strategy", "no", "--disable_tqdm", "true"],
                   check=True, env=env, timeout=900, capture_output=True)
    rewards = [r["reward"] for r in lines(out) if "reward" in r]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, rewards


def test_a_turn_stops_on_every_eos_the_generation_config_declares(toy_dir):
    """Issue 10: the stop tokens come from the model's generation config (all its EOS ids), and the
    tokenizer's own EOS."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(toy_dir)
    tokenizer = toy.build_tokenizer()
    model.generation_config.eos_token_id = [7, 3]
    assert train.stop_token_ids(model, tokenizer) == sorted({3, 7, tokenizer.eos_token_id})
    model.generation_config.eos_token_id = None
    assert train.stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id]


def test_weight_decay_spares_biases_and_norms_as_the_trainer_does():
    """build_optimizer: weight_decay on the matrices (embeddings, projections), 0 on the 1-d
    tensors (norm weights, biases), as transformers' Trainer groups them."""
    model = toy.build_model(len(toy.build_tokenizer()))
    optimizer, _ = train.build_optimizer(train.Policy(model), AsyncGRPOConfig(weight_decay=0.1))
    decay = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decay) == (p.ndim >= 2), name
    assert any("norm" in n for n, p in model.named_parameters() if id(p) not in decay)


def test_model_init_kwargs_say_where_config_tokenizer_and_model_come_from(tmp_path, toy_dir):
    """model_init_kwargs={"subfolder": ...} (like "revision" on the hub) reaches AutoConfig and
    the tokenizer as well as the model: a repository whose files are only in a subfolder loads."""
    import shutil
    shutil.copytree(toy_dir, tmp_path / "repo" / "v2")
    config = AsyncGRPOConfig(model_init_kwargs={"subfolder": "v2"})
    model, tokenizer = train.load_model(str(tmp_path / "repo"), config)
    reference, _ = train.load_model(toy_dir, AsyncGRPOConfig())
    assert len(tokenizer) == len(toy.build_tokenizer())
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name


# ── the command line (parse_cli): the toy defaults and the local server follow the parsed
# --model and --vllm_server_base_url, whichever form argv spells them in ──


def parse(*argv: str):
    return train.parse_cli(list(argv))


def test_the_toy_model_gets_its_defaults_and_a_local_server_in_either_form():
    script, config = parse("--model=toy")
    assert (script, config) == parse("--model", "toy") == parse()
    assert script.serve_local is True
    assert {k: getattr(config, k) for k in toy.TRAIN_DEFAULTS} == toy.TRAIN_DEFAULTS


@pytest.mark.parametrize("argv", [["--model=some/other"], ["--model", "some/other"]])
def test_another_model_gets_no_toy_defaults_and_no_local_server(argv):
    script, config = parse(*argv)
    assert script.model == "some/other"
    assert config == AsyncGRPOConfig()
    assert script.serve_local is False


def test_given_fields_win_over_the_toy_defaults_in_either_form():
    script, config = parse("--model=toy", "--learning_rate=0.1", "--num_generations", "4")
    assert (config.learning_rate, config.num_generations) == (0.1, 4)
    assert config.output_dir == toy.TRAIN_DEFAULTS["output_dir"]
    for url in (["--vllm_server_base_url=http://gpu0:8000"],
                ["--vllm_server_base_url", "http://localhost:8000"]):   # the default, given
        assert parse(*url)[0].serve_local is False
    assert parse("--model=some/other", "--serve_local=true")[0].serve_local is True


@pytest.mark.slow
def test_a_reward_module_in_the_current_directory_is_found(start_server, indexed, tmp_path):
    """Issue 34: `python train.py --reward my_rewards:accuracy` (the README's example) run where
    my_rewards.py lies: the trainer imports it from the current directory, and so does the
    spawned rollout process, which scores with it."""
    server = start_server(*SERVER_ARGS)
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_rewards.py").write_text(
        "def accuracy(prompts, completions, **kwargs):\n"
        "    open('scored', 'a').write('group\\n')\n"
        "    return [float(i) for i in range(len(completions))]\n")
    flags = [f"--{k}={v}" for k, v in SMALL.items()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--model",
         os.path.join(os.path.dirname(indexed), "model"), "--dataset", indexed,
         "--reward", "my_rewards:accuracy", "--vllm_server_base_url", server.url,
         "--output_dir", str(tmp_path / "out"), "--max_steps", "1", *flags],
        cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (work / "scored").read_text().count("group") >= 1
    assert [r["step"] for r in lines(str(tmp_path / "out"))] == [1]


# ── the trainer's surface ────────────────────────────────────────────────────────────────────


def test_the_spec_positional_order_and_refusals():
    config = AsyncGRPOConfig(max_steps=1)
    dataset = toy.make_dataset(4)
    trainer = train.AsyncGRPOTrainer("toy", toy.sum_reward, config, dataset)
    assert trainer.args is config and trainer.train_dataset is dataset
    with pytest.raises(TypeError, match="spec's order"):
        train.AsyncGRPOTrainer("toy", toy.sum_reward, dataset, config)
    with pytest.raises(ValueError, match="optimizers: only"):
        train.AsyncGRPOTrainer("toy", toy.sum_reward, config, dataset, optimizers=(object(), None))
    from train import Rollout, RolloutGroup, TurnRecord                # the spec's records
    from rollout import Rollout as R, RolloutGroup as G, TurnRecord as T
    assert (Rollout, RolloutGroup, TurnRecord) == (R, G, T)


class StopAfterTwo:
    """A TrainerCallback in its minimal form: the events it sees, and a stop."""

    def __init__(self):
        self.events = []

    def on_init_end(self, args, state, control, **kwargs):
        self.events.append(("init", state.global_step))

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("begin", state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", logs["step"]))
        if logs["step"] >= 2:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("end", state.global_step))


def test_a_callback_overriding_an_event_never_called_is_warned_about(caplog):
    """transformers' TrainerCallback has more events than Hooks calls: a callback (a subclass, or
    any object) that overrides one of the others is named with it as it is added, by the
    constructor or add_callback; one overriding only called events, or none, is not."""
    from transformers import TrainerCallback

    class PerEpoch(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            pass

        def on_step_end(self, args, state, control, **kwargs):
            pass

    class Optimizer:                                   # duck-typed, no TrainerCallback
        def on_optimizer_step(self, args, state, control, **kwargs):
            pass

    config = AsyncGRPOConfig(output_dir="unused")
    with caplog.at_level(logging.WARNING, logger="train"):
        trainer = train.AsyncGRPOTrainer("toy", toy.sum_reward, config, toy.make_dataset(8),
                                         callbacks=[PerEpoch, StopAfterTwo(), TrainerCallback()])
        trainer.add_callback(Optimizer())
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("callback PerEpoch overrides on_epoch_end, which AsyncGRPOTrainer "
                              "never calls (it calls on_init_end, on_train_begin, on_step_begin")
    assert said[1].startswith("callback Optimizer overrides on_optimizer_step, which")
    assert [type(c).__name__ for c in trainer.hooks.callbacks] == [
        "PerEpoch", "StopAfterTwo", "TrainerCallback", "Optimizer"]


def test_callbacks_state_dashboard_and_save_model(start_server, toy_dir, tmp_path):
    """One short run: logging_first_step with logging_steps 2, a callback that stops after step
    2, tensorboard with completions, save_only_model, then trainer.state, save_model, model. Its
    own server: the session's train_server must keep the shared run's weights."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from train_helpers import SERVER_ARGS, SMALL
    server = start_server(*SERVER_ARGS)
    out = str(tmp_path / "run")
    config = AsyncGRPOConfig(output_dir=out, vllm_server_base_url=server.url, max_steps=10,
                             logging_steps=2, logging_first_step=True, report_to="tensorboard",
                             run_name="cb", log_completions=True, num_completions_to_print=2,
                             save_only_model=True, save_steps=100, data_seed=3,
                             gradient_checkpointing_kwargs={"use_reentrant": False},
                             **SMALL)
    callback = StopAfterTwo()
    trainer = train.AsyncGRPOTrainer(toy_dir, toy.sum_reward, config, toy.make_dataset(64),
                                     callbacks=[callback])
    trainer.train()
    assert callback.events == [("init", 0), ("begin", 0), ("step", 0), ("log", 1), ("step", 1),
                               ("log", 2), ("save", 2), ("end", 2)]
    assert trainer.state.global_step == 2
    assert [line["step"] for line in trainer.state.log_history] == [1, 2]
    events = EventAccumulator(os.path.join(out, "runs", "cb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    # reward comes from groups scored in the window: one the rollout process scored ahead may
    # leave the second line without it; the dashboard has it exactly where the log has it
    rewarded = [line["step"] for line in trainer.state.log_history if "reward" in line]
    assert rewarded and [e.step for e in events.Scalars("reward")] == rewarded
    assert any("completions" in t for t in events.Tags()["tensors"])
    assert not os.path.exists(os.path.join(out, "checkpoint-2", "fsdp"))    # save_only_model
    with pytest.raises(ValueError, match="save_only_model=True"):
        AsyncGRPOConfig(output_dir=out, resume_from_checkpoint="true", **SMALL)
        train.checkpoint.load(os.path.join(out, "checkpoint-2"), None, None, None)
    saved = trainer.save_model(str(tmp_path / "final"))
    assert os.path.isfile(os.path.join(saved, "config.json"))
    assert not os.path.exists(os.path.join(saved, "trainer_state.json"))
    assert trainer.model.config.vocab_size == len(toy.build_tokenizer())
