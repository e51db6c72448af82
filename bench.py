"""Benchmarks: each case measures the compared variants side by side in one run and prints their ratio.

    python bench.py planner     # trie_pack.py: unique tokens/s of the planner on a realistic stream (CPU)
    python bench.py packing     # tree vs padding-free packing fwd+bwd through our own code path (GPU; tiny on CPU)
    python bench.py logprobs    # loss.py: chunked vs naive log-prob peak memory and exactness
    python bench.py learn       # train.py: the toy demo's reward at the start and the end, and minutes
    python bench.py overlap     # train.py: asynchronous vs alternating (max_staleness=0) wall time
    python bench.py sync        # weight_sync.py vs lora_sync.py: seconds and bytes per sync

Speed goals live here, never in timed tests: these machines are noisy, ratios from one run are not.
Each case ends with one summary line `<case> key=value ...` that a script can grep.
"""
import sys

# ---- planner, packing (trie_pack.py, tree_attention.py) -------------------------------------------

def planner(argv):
    """Unique tokens per CPU-second of the planner plus pack() and metrics of every row (rank 0's work), one core.

    Stream: 8 rollouts per prompt, a 200-token system prompt shared by all prompts, prompts ~1024 tokens,
    completions 64-1024, top-8 sampler log-probs per token, a quarter of the rollouts multi-turn with a
    fork (a second sample that re-uses part of the first turn), groups arriving interleaved.
    """
    import argparse
    import time

    import numpy as np
    import torch

    from rollout_samples import RolloutSample
    from trie_pack import Planner

    ap = argparse.ArgumentParser(prog="bench.py planner")
    ap.add_argument("--world-sizes", default="1,2,4,8")
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    vocab, k = 151936, 8

    def make(ids, n_context, group):
        mask = np.zeros(len(ids), np.int8)
        mask[n_context:] = 1
        lp = np.where(mask > 0, -rng.random(len(ids)), 0).astype(np.float32)
        return RolloutSample(ids, mask, lp, float(rng.normal()), group, 0,
                             top_ids=rng.integers(0, vocab, (len(ids), k)), top_logprobs=-rng.random((len(ids), k), np.float32))

    system = rng.integers(0, vocab, 200)
    groups = []
    for g in range(args.groups):
        prompt = np.concatenate([system, rng.integers(0, vocab, rng.integers(700, 1000))])
        group = []
        for _ in range(8):
            comp = rng.integers(0, vocab, rng.integers(64, 1025))
            group.append(make(np.concatenate([prompt, comp]), len(prompt), g))
            if rng.random() < 0.25:
                history = np.concatenate([prompt, comp[: rng.integers(1, len(comp) + 1)], rng.integers(0, vocab, 40)])
                group.append(make(np.concatenate([history, rng.integers(0, vocab, rng.integers(64, 513))]), len(history), g))
        groups.append(group)
    stream = []                                          # rollouts finish out of order across 4 groups in flight
    for i in range(0, len(groups), 4):
        window = [s for group in groups[i: i + 4] for s in group]
        stream += [window[j] for j in rng.permutation(len(window))]

    def run(world_size):
        plan = Planner(world_size, args.token_budget, per_device_train_batch_size=8)
        t0, packed, metrics = time.process_time(), [], []    # CPU time: single-threaded, and the
        for rows in [plan.add(s) for s in stream] + [plan.flush()]:   # machine's other jobs don't count
            if rows:
                packed.append([r.pack() for r in rows])
                metrics.append(plan.metrics(packed[-1]))
        return time.process_time() - t0, [p for ps in packed for p in ps], metrics

    run(1)                                               # warm-up: first-call costs of numpy and torch
    total_unique, total_raw, total_s = 0, 0, 0.0
    for world_size in map(int, args.world_sizes.split(",")):
        runs = [run(world_size) for _ in range(args.repeats)]
        dt, packed, metrics = min(runs, key=lambda r: r[0])   # best of a few: this machine is shared
        unique, raw = sum(p.unique_tokens for p in packed), sum(p.raw_tokens for p in packed)
        mean = lambda key: sum(m[key] for m in metrics) / len(metrics)
        print(f"world_size={world_size} micro_batches={len(metrics)} samples={len(stream)} unique_tokens={unique} "
              f"raw_tokens={raw} cpu_seconds={dt:.3f} unique_tokens_per_s={unique / dt:,.0f} "
              f"samples_per_row={mean('batch/samples_per_row'):.1f} row_fill_frac={mean('batch/row_fill_frac'):.2f} "
              f"row_imbalance={mean('batch/row_imbalance'):.2f}")
        total_unique, total_raw, total_s = total_unique + unique, total_raw + raw, total_s + dt
    print(f"planner unique_tokens_per_s={total_unique / total_s:.0f} packing_ratio={total_raw / total_unique:.2f}")


def packing(argv):
    """Tree packing vs padding-free packing, fwd+bwd of a random-weight Qwen3-0.6B shape in bf16 (CUDA).

    padding-free  samples end to end, position_ids restarting per sample, transformers' own attention
                  (flex_attention on CUDA, sdpa on CPU) with the document-causal mask it derives itself
    tree          the same samples through TreeRow.pack + tree_attention (flex on CUDA, sdpa on CPU)
    no sharing    every rollout with its own prompt: the tree path must cost what padding-free costs
    Both sides build their masks inside the timed step. The FLOP bound is linear 6·params·tokens +
    attention 14·head_dim·heads·layers·pairs + LM head 6·hidden·vocab·trained, as in
    reference/tree_flex_probe_results.md (× 8/6 on the first two with --checkpointing, which recomputes
    each decoder layer's forward in backward, on both sides). Without CUDA a tiny model runs instead:
    correctness only. Layouts gpu_check.py runs: the defaults (4 prompts of 1024 tokens, 8 rollouts of
    256) and the long prompt `--groups 1 --prompt 8192 --completion 128 --checkpointing` (bound ~7x).
    """
    import argparse
    import statistics
    import time

    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import tree_attention
    from rollout_samples import RolloutSample
    from trie_pack import TreeRow

    ap = argparse.ArgumentParser(prog="bench.py packing")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing per decoder layer (both sides): long layouts fit in memory")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936)
    if not cuda:
        print("no CUDA: a tiny model on the sdpa backend, fp32; checks correctness only, the timings mean nothing")
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=300)
        args.groups, args.rollouts, args.prompt, args.completion, args.iters, args.warmup = 2, 4, 48, 16, 3, 1
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = Qwen3Config(**shape, tie_word_embeddings=True, rope_theta=1e6,
                      max_position_embeddings=max(4096, args.prompt + args.completion))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_linear = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    rng = np.random.default_rng(0)
    vocab, P, C = shape["vocab_size"], args.prompt, args.completion

    def group(g, shared_prompt):
        prompt = rng.integers(0, vocab, P)
        out = []
        for _ in range(args.rollouts):
            ids = np.concatenate([prompt if shared_prompt else rng.integers(0, vocab, P), rng.integers(0, vocab, C)])
            mask = np.r_[np.zeros(P, np.int8), np.ones(C, np.int8)]
            out.append(RolloutSample(ids, mask, np.zeros(P + C, np.float32), float(rng.normal()), g, 0))
        return out

    def tree_step(samples):
        row = TreeRow()
        for s in samples:
            row.add(s)
        p = row.pack()
        ids, pos = p.input_ids.to(device)[None], p.position_ids.to(device)[None]
        index, targets, adv = p.token_index.to(device), p.targets.to(device), p.advantages.to(device)

        def step(backward=True):
            kwargs = tree_attention.row_kwargs(model, p)       # the mask is built per row, inside the step
            return loss_of(model.model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).last_hidden_state[0],
                           index, targets, adv, backward)
        return step, p

    def padding_free_step(samples):
        ids = torch.from_numpy(np.concatenate([s.input_ids for s in samples])).to(device)[None]
        pos = torch.cat([torch.arange(len(s.input_ids)) for s in samples]).to(device)[None]
        starts = np.cumsum([0] + [len(s.input_ids) for s in samples[:-1]])
        index = torch.from_numpy(np.concatenate([o + np.flatnonzero(s.completion_mask[1:]) for o, s in zip(starts, samples)]))
        targets = ids[0, index.to(device) + 1]
        adv = torch.cat([torch.full((int(s.completion_mask[1:].sum()),), s.advantage) for s in samples]).to(device)
        index = index.to(device)

        def step(backward=True):
            return loss_of(model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0],
                           index, targets, adv, backward)
        return step

    def loss_of(hidden, index, targets, adv, backward):
        logp = torch.log_softmax(model.lm_head(hidden[index]).float(), -1).gather(1, targets[:, None])[:, 0]   # [M]
        if backward:
            (-(adv * logp).mean()).backward()
            model.zero_grad(set_to_none=True)
        return logp.detach()

    def timed(step):
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.iters):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def flops(tokens, pairs, trained):
        attn = 14 * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers
        recompute = 8 / 6 if args.checkpointing else 1.0
        return recompute * (6 * n_linear * tokens + attn * pairs) + 6 * cfg.hidden_size * vocab * trained

    shared = [s for g in range(args.groups) for s in group(g, True)]
    unshared = [s for g in range(args.groups) for s in group(g, False)]
    backend = tree_attention.install(model)
    tree, row = tree_step(shared)
    lonely, lonely_row = tree_step(unshared)
    with torch.no_grad():
        lp_tree = tree(backward=False)
    t_tree, t_lonely = timed(tree), timed(lonely)
    model.set_attn_implementation("flex_attention" if cuda else "sdpa")
    free = padding_free_step(shared)
    with torch.no_grad():
        lp_free = free(backward=False)
    t_free = timed(free)             # the unshared set has the same lengths: the same padding-free cost

    raw = sum(len(s.input_ids) for s in shared)
    pairs_free = sum(len(s.input_ids) * (len(s.input_ids) + 1) // 2 for s in shared)
    bound = flops(raw, pairs_free, row.trained_tokens) / flops(row.unique_tokens, row.attention_cost, row.trained_tokens)
    gap = (lp_tree.float() - lp_free.float()).abs().max().item()
    print(f"{device} {dtype} backend={backend} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} "
          f"samples={len(shared)} raw_tokens={raw} unique_tokens={row.unique_tokens} packing_ratio={raw / row.unique_tokens:.2f} "
          f"trained_tokens={row.trained_tokens} unshared_unique_tokens={lonely_row.unique_tokens}")
    print(f"padding_free_s={t_free:.4f} tree_s={t_tree:.4f} tree_unshared_s={t_lonely:.4f} (medians of {args.iters})")
    print(f"no_sharing ratio={t_free / t_lonely:.3f} (padding-free / tree path on unshared samples; target >= 0.97)")
    print(f"packing speedup={t_free / t_tree:.3f} flop_bound={bound:.3f} efficiency={t_free / t_tree / bound:.3f} "
          f"no_sharing={t_free / t_lonely:.3f} max_logprob_gap={gap:.3g}")


# ---- logprobs (loss.py) -------------------------------------------------------------------------

def logprobs(argv):
    """Peak extra memory of log π(targets) fwd+bwd at every one of N positions over a V-token head: full logits
    (log_softmax of [N, V]) vs loss.token_logprobs (chunks of rows, recomputed in backward). Each variant runs
    in its own process; CPU: peak RSS above the inputs (VmHWM after a reset), CUDA: max_memory_allocated.
    max_diff: the largest |difference| of the log-probs and of the hidden/weight gradients between the two,
    divided by max(1, the tensor's largest magnitude): both are fp32 with different summation orders, and an
    fp32 log-prob near -12 (uniform over 152k tokens) has a rounding step of 9.5e-7; max_abs_diff is unscaled.
    """
    import argparse
    import os
    import subprocess
    import tempfile

    import torch

    ap = argparse.ArgumentParser(prog="bench.py logprobs")
    ap.add_argument("--n", type=int, default=8192, help="positions N (all of them trained)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary V (Qwen3's)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size H (small on CPU: the matmul is not measured)")
    ap.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: loss.py's, 2^26 / V)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.variant is None:
        res = {}
        with tempfile.TemporaryDirectory() as tmp:
            for variant in ("naive", "chunked"):
                out = os.path.join(tmp, f"{variant}.pt")
                subprocess.run([sys.executable, __file__, "logprobs", *argv, "--variant", variant, "--out", out], check=True)
                res[variant] = torch.load(out)
        n, c = res["naive"], res["chunked"]
        diffs = {key: (n[key] - c[key]).abs().max().item() for key in ("logp", "grad_hidden", "grad_weight")}
        scaled = {key: d / max(1.0, n[key].abs().max().item()) for key, d in diffs.items()}  # fp32 rounding scales
        print(f"  N={a.n} V={a.vocab} H={a.hidden} device={a.device}: full [N, V] logits would be "
              f"{a.n * a.vocab * 4 / 2**20:.0f} MiB in fp32")
        for name, r in res.items():
            print(f"  {name:8s} peak +{r['peak'] / 2**20:8.0f} MiB   fwd+bwd {r['seconds']:6.2f} s")
        print("  max |naive - chunked|: " + "  ".join(f"{key} {d:.2e} ({scaled[key]:.1e} of its max)" for key, d in diffs.items()))
        print(f"logprobs peak_ratio={c['peak'] / n['peak']:.4f} max_diff={max(scaled.values()):.2e} "
              f"max_abs_diff={max(diffs.values()):.2e}")
        return

    import time

    import torch.nn.functional as F

    import loss

    dev = torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(a.n, a.hidden, device=dev, generator=g).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, device=dev, generator=g) / a.hidden**0.5).requires_grad_()
    targets = torch.randint(0, a.vocab, (a.n,), device=dev, generator=g)
    token_index = torch.arange(a.n, device=dev)

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
    if a.variant == "naive":
        logp = F.linear(hidden[token_index], weight).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    else:
        logp = loss.token_logprobs(hidden, weight, None, token_index, targets, chunk_size=a.chunk_size).target
    grad_hidden, grad_weight = torch.autograd.grad(logp.sum(), (hidden, weight))
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = rss("VmHWM:") - base
    seconds = time.perf_counter() - start
    torch.save({"peak": peak, "seconds": seconds, "logp": logp.detach().cpu(), "grad_hidden": grad_hidden.cpu(),
                "grad_weight": grad_weight.cpu()}, a.out)


# ---- the trainer (train.py, weight_sync.py, lora_sync.py) ----------------------------------------

def _toy_run(out: str, *args: str) -> tuple[float, list[dict]]:
    """`python train.py` (the toy demo) with extra flags; (wall seconds, its metrics.jsonl records)."""
    import json
    import os
    import shutil
    import subprocess
    import time

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
                    "--output_dir", out, "--save_strategy", "no", "--disable_tqdm", "true", *args], check=True)
    seconds = time.perf_counter() - start
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return seconds, [json.loads(line) for line in f]


def learn(argv):
    """The toy demo as `python train.py` runs it (warm-up-only model, 2 CPU cores): mean reward of the
    first and the last 10 steps. Target: reward_end >= 0.9 within 10 minutes."""
    import numpy as np
    seconds, records = _toy_run("runs/bench-learn", *argv)
    rewards = [r["reward"] for r in records if "reward" in r]
    print(f"learn reward_start={np.mean(rewards[:10]):.3f} reward_end={np.mean(rewards[-10:]):.3f} "
          f"steps={len(records)} minutes={seconds / 60:.2f}")


def overlap(argv):
    """The same short toy training twice: asynchronous (max_staleness 4) and alternating (max_staleness 0:
    a group is admitted only for the version being trained, so generation waits for each sync). Ideal:
    max(generation-only, training-only), from the async run's rollout throughput and compute time."""
    import argparse
    ap = argparse.ArgumentParser(prog="bench.py overlap")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    common = ["--max_steps", str(args.steps), "--learning_rate", "1e-4"]
    async_s, records = _toy_run("runs/bench-overlap-async", *common, "--max_staleness", "4")
    sync_s, _ = _toy_run("runs/bench-overlap-sync", *common, "--max_staleness", "0")
    train_only = sum(r["perf/fwd_bwd_s"] + r["perf/optimizer_s"] + r.get("perf/weight_sync_s", 0) for r in records)
    generated = sum(r["batch/samples_per_step"] * r.get("completions/mean_length", 0) for r in records)
    rates = [r["rollout/generated_tok_s"] for r in records if r.get("rollout/generated_tok_s")]
    generation_only = generated / max(rates) if rates else float("nan")
    print(f"overlap async_s={async_s:.1f} sync_s={sync_s:.1f} speedup={sync_s / async_s:.2f} "
          f"ideal_s={max(train_only, generation_only):.1f} (generation-only {generation_only:.1f} s at the peak "
          f"rate, training-only {train_only:.1f} s; both runs include ~20 s of start-up)")


def lora_byte_ratio(name: str, r: int) -> tuple[int, int]:
    """(full bf16 weight bytes, all-linear rank-r adapter bytes) from a model's shapes on the meta device."""
    import torch
    from peft import LoraConfig
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lora_sync import adapter_bytes
    shapes = {"qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False),
              "qwen2.5-math-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                        tie_word_embeddings=True)}
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shapes[name]))
    return adapter_bytes(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))


def sync(argv):
    """Full (merged) and adapter-only sync of one random Qwen3-shaped model (~25M parameters, fp32, CPU,
    gloo) to one serve_local.py, 3 syncs each; then the byte ratio of the spec's two setups from shapes."""
    import os
    import tempfile

    import torch
    from peft import LoraConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import lora_sync
    import serve_local
    import toy
    import train
    from vllm_client import VLLMClient

    tokenizer = toy.build_tokenizer()
    path = tempfile.mkdtemp(prefix="bench-sync-")
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536,
                                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                 max_position_embeddings=512)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = train.AsyncGRPOConfig(output_dir=os.path.join(path, "out"), gradient_checkpointing=False,
                                   max_staleness=1)
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    server = serve_local.LocalServer(path, *train.local_server_args(config, peft_config))
    try:
        rank, world, device = train.setup_distributed(config)
        model, _ = train.load_model(path, config, peft_config=peft_config)
        policy = train.shard(train.Policy(model), config, device)
        client = VLLMClient(server.url, timeout=120)
        results = {}
        for kind, syncer in (("full", lora_sync.MergedSync(policy, [client], config)),
                             ("adapter", lora_sync.AdapterSync(policy, [client], config, config.output_dir))):
            syncer.connect()
            runs = [syncer.push(v) for v in (1, 2, 3)]
            results[kind] = (sum(m["perf/weight_sync_s"] for m in runs) / 3, runs[-1]["perf/weight_sync_bytes"])
        torch.distributed.destroy_process_group()
    finally:
        server.stop()
    (full_s, full_b), (adapter_s, adapter_b) = results["full"], results["adapter"]
    print(f"sync full_s={full_s:.3f} adapter_s={adapter_s:.3f} full_bytes={full_b:.0f} adapter_bytes={adapter_b:.0f} "
          f"bytes_ratio={adapter_b / full_b:.4f}")
    for name, r in (("qwen2.5-7b", 32), ("qwen2.5-math-1.5b", 1)):
        full, adapter = lora_byte_ratio(name, r)
        print(f"sync shapes={name} r={r} full_bytes={full / 1e9:.2f}GB adapter_bytes={adapter / 1e6:.1f}MB "
              f"bytes_ratio={adapter / full:.4f}")


if __name__ == "__main__":
    cases = {name: fn for name, fn in globals().items()
             if name in ("planner", "packing", "logprobs", "learn", "overlap", "sync")}
    if len(sys.argv) < 2 or sys.argv[1] not in cases:
        sys.exit(f"usage: python bench.py {{{'|'.join(cases) or 'planner|packing|logprobs'}}} [args]")
    cases[sys.argv[1]](sys.argv[2:])
