"""Benchmarks: the spec's claims, each measured side by side against the variant it improves on.

Spec claims measured (the spec states them; these cases measure our code against them):
- ツリーパッキング (Tree packing): shared prefixes are stored and computed once (planner, packing).
- Top-kおよびTop-pサンプリング (Top-k and top-p sampling): log-probs are taken in chunks of rows,
  never as full [N, V] logits, and match the full computation (logprobs).
- 概要 (Overview): generation and training overlap, and the toy demo learns (learn, overlap).
- LoRA and the adapter-sync note: adapter-only sync moves a small share of the bytes (sync).

    python -m tools.bench CASE [args]      # CASE --help lists its options

Cases here: planner, packing, logprobs, fingerprint; the trainer's runs (learn, overlap, sync,
servers) and its step (step) in bench_train.py; the rollout process against an instant server
(rollout) in bench_rollout.py.

    case      code measured          the summary line it prints (README and gpu_check.py grep it)
    planner   trie_pack.py           planner unique_tokens_per_s=... packing_ratio=...
    packing   tree_attention.py      packing speedup=... flop_bound=... efficiency=...
    logprobs  loss.py                logprobs peak_ratio=... max_diff=... max_abs_diff=...
    fingerprint verify_sync.py       fingerprint gb_per_s=... copy_gb_per_s=... agree=...
    learn     train.py, toy.py       learn reward_start=... reward_end=... eval_pass1_start=...
                                     eval_pass1_peak=... eval_pass1_end=... steps=... minutes=...
                                     (further flags go to train.py)
    overlap   train.py, rollout/     overlap async_s=... sync_s=... ideal_s=... speedup=...
    rollout   rollout/               rollout rollouts_per_s=... samples_per_s=...
                                     cpu_per_rollout_ms=...
    sync      lora_sync.py           sync full_s=... adapter_s=... bytes_ratio=... (+2 shape lines)
    servers   the whole pipeline     servers local_s=... local_gen_tok_s=... vllm_s=... (needs
                                     VLLM_PYTHON)
    step      train.py (train_step)  step backend=... step_s=... tokens_per_s=... finite=...

Departures, one line each:
- Speed goals live here, never in timed tests: these machines are noisy, ratios from one run aren't.
- planner: random tokens, CPU time on one core: the figure is the planner's, not the machine's.
- packing: random weights; without CUDA a tiny model checks correctness only (timings mean nothing).
- learn, overlap: the offline toy task on CPU, not a real model and dataset: it runs in minutes.
- rollout: an instant loopback server, not vLLM: the figure is the rollout process's own cost.
- sync: a ~25M model on CPU (gloo) to local_vllm; the spec setups' bytes come from shapes alone.
- step: random weights and rows, no server; without CUDA a tiny model, one step: the path only.
"""
import re
import sys

# ── planner, packing (trie_pack.py, tree_attention.py) ───────────────────────────────────────────

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

    from rollout.samples import RolloutSample
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
        for rows in [plan.add(s) for s in stream if not plan.oversize(s)] + [plan.flush()]:
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
    the H200 probe in docs/LOG.md (× 8/6 on the first two with --checkpointing, which
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
    from rollout.samples import RolloutSample
    from tools import bench_train
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
        shape = bench_train.QWEN3_0_6B
        device = "cuda"
        dtype = torch.bfloat16
    else:
        print("no CUDA: a tiny model on the sdpa backend, fp32; checks correctness only, "
              "the timings mean nothing")
        shape = bench_train.TINY_QWEN3
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


# ── logprobs (loss.py) ───────────────────────────────────────────────────────────────────────────

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
            results[variant] = torch.load(out, weights_only=True)
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


# ── fingerprint (verify_sync.py: what a full sync's verification costs) ─────────────────────────

def fingerprint(argv):
    """verify_sync's fingerprint (vllm_plugin/weight_digests.fingerprint) where the tensors live:
    its GB/s beside a copy of the same bytes on the same device (memory-bound: a copy reads and
    writes each byte, the fingerprint reads it once), and whether the CPU's fingerprints of the
    same tensors equal the device's (they must: integer sums, bit-exact on both).

    Tensors: a Qwen3-4B layer's matrices and its embedding in bf16, a norm, an odd fp32 one."""
    import argparse
    import time

    import torch

    from vllm_plugin.weight_digests import fingerprint as fp
    parser = argparse.ArgumentParser(prog="python -m tools.bench fingerprint")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    scale = 1 if cuda else 16                 # a CPU: the same shapes, 16x fewer rows
    g = torch.Generator().manual_seed(0)
    shapes = [((151936 // scale, 2560), torch.bfloat16), ((9728 // scale, 2560), torch.bfloat16),
              ((2560,), torch.bfloat16), ((3, 1001), torch.float32)]
    tensors = [torch.randn(shape, generator=g).to(dtype).to(device) for shape, dtype in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def seconds(fn) -> float:
        fn()                                                       # warm-up (cuBLASLt plans)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.repeats

    fp_s = seconds(lambda: [fp(t) for t in tensors])
    copy_s = seconds(lambda: [t.clone() for t in tensors])
    agree = all(fp(t) == fp(t.cpu()) for t in tensors)
    print(f"fingerprint device={device.type} bytes={nbytes} gb_per_s={nbytes / fp_s / 1e9:.1f} "
          f"copy_gb_per_s={nbytes / copy_s / 1e9:.1f} ratio={copy_s / fp_s:.2f} agree={agree}")


def _case(name: str):
    """The function of case `name`, from the module that holds it."""
    if name in ("learn", "overlap", "sync", "servers", "step"):
        from tools import bench_train as module
    elif name == "rollout":
        from tools import bench_rollout as module
    else:
        module = sys.modules[__name__]
    return getattr(module, name)


CASES = ("planner", "packing", "logprobs", "fingerprint", "learn", "overlap", "rollout", "sync",
         "servers", "step")



def usage() -> str:
    """The usage line, then each case with the first sentence of its docstring."""
    lines = [f"usage: python -m tools.bench {{{'|'.join(CASES)}}} [args]   (CASE --help: its "
             "options)", ""]
    for name in CASES:
        first = " ".join((_case(name).__doc__ or "").strip().split("\n\n")[0].split())
        sentence = re.split(r"(?<=[.:])\s", first)[0].rstrip(".:")
        lines.append(f"  {name:<9} {sentence}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] in (["--help"], ["-h"]):
        print(usage())
    elif len(sys.argv) < 2 or sys.argv[1] not in CASES:
        sys.exit(usage())
    else:
        _case(sys.argv[1])(sys.argv[2:])
