"""One prompt of the toy task through the whole system, step by step, with the values it really
takes (WALKTHROUGH.md shows this script's output; spec: 概要 (Overview), followed step by step).

    python -m tools.walkthrough                    # every step's values, in ~15 s on one CPU core
    python -m tools.walkthrough --write WALKTHROUGH.md # refresh the document's output blocks
    python -m tools.walkthrough --check WALKTHROUGH.md # exit 1 if a block differs from this run's

    toy model ─► local_vllm ─► AsyncRolloutLoop.generate_one ×8 ─► reconcile ─► score_group
      (step 0)     (a subprocess)     rollout/loop.py (steps 1-2)          (3)          (2: rewards,
                                                                                    advantages)
    ─► build_row(samples).pack() ─► compute_loss, train_step ─► FullSync.push(1) ─► the server
       trie_pack.py (4)              loss.py, train.py (5)      weight_sync.py (6)  answers as v1

Every value comes from the project's own functions, in the order train.py and rollout/loop.py call
them; nothing is recomputed here except the displays (the mask grid, per-token tables).

Departures from `python train.py`, to stay within seconds and reproducible:
  * the toy warm-up is 30 steps of 32 (toy.warm_up), not toy.save's 100 of 64; seeds are fixed.
  * one group, generated rollout by rollout (the loop runs a group's rollouts concurrently).
  * no rollout process, no torchrun: the same functions, called in one process (world size 1).
  * reward: toy.sum_reward (the demo CLI's exact_reward scores a one-digit reply the same).
"""
import argparse
import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import toy  # noqa: E402
from config import AsyncGRPOConfig  # noqa: E402
from loss import (StepTotals, centering_term, importance_bands, policy_loss,  # noqa: E402
                  token_logprobs)
from rollout import AsyncRolloutLoop  # noqa: E402
from rollout.samples import RolloutGroup, reconcile  # noqa: E402
from rollout.scoring import score_group  # noqa: E402
from local_vllm.launch import LocalServer  # noqa: E402
from train import Policy, build_optimizer, load_model, train_step  # noqa: E402
from train import local_server_args  # noqa: E402
from weight_sync import FullSync  # noqa: E402
from trie_pack import build_row  # noqa: E402
from vllm_client import VLLMClient  # noqa: E402

PROMPT_ROW = 1          # toy.make_dataset(8, seed=0)[1]: a group whose rewards differ
GRID_FROM = 20          # the mask grid shows packed positions from here on (0.. are the prompt)


def show_tokens(tokenizer, ids) -> str:
    """Tokens as the tokenizer names them, newlines made visible."""
    return " ".join(tokenizer.convert_ids_to_tokens(int(i)).replace("\n", "\\n") for i in ids)


def fmt(x: float, digits: int = 4) -> str:
    """A fixed-point number whose last digit does not flip with -0.0."""
    s = f"{x:.{digits}f}"
    return s[1:] if s.startswith("-") and float(s) == 0 else s


def mask_grid(packed, tokenizer, start: int) -> list[str]:
    """Rows = queries i >= start, columns = keys j >= start: '#' if i attends to j (j <= i <=
    subtree_end[j]), '.' if not. Keys before `start` are the shared prompt: all queries see them."""
    end = packed.subtree_end.tolist()
    ids = packed.input_ids.tolist()
    n = len(ids)
    names = [show_tokens(tokenizer, [t]) for t in ids]
    lines = ["      " + "".join(str(j // 10) for j in range(start, n)),
             "      " + "".join(str(j % 10) for j in range(start, n))]
    for i in range(start, n):
        row = "".join("#" if j <= i <= end[j] else "." for j in range(start, n))
        lines.append(f"{i:3d}   {row}   {names[i]}")
    return lines


async def rollouts(config, tokenizer, dataset, url):
    """Steps 1-2: the loop's start-up checks, 8 rollouts of one prompt, reconcile, score_group."""
    eos = [tokenizer.eos_token_id]
    loop = AsyncRolloutLoop(config, None, dataset, [toy.sum_reward], tokenizer, eos,
                            channels=None, max_concurrent_rollouts=config.num_generations)
    await loop.connect()                                  # every replica checked, as at start
    row = dataset[PROMPT_ROW]
    done = []
    for _ in range(config.num_generations):                # in turn: the server's seeds in order
        rollout = await loop.generate_one(row["prompt"], [], group_id=0)
        sequences, drifts = reconcile(rollout.turns)
        done.append((rollout, sequences, {"duration_s": 0.0, "drifts": drifts}))
    n = len(done)
    group = RolloutGroup(
        prompts=[row["prompt"]] * n, reward_kwargs={"answer": [row["answer"]] * n},
        completions=[r.completion for r, _, _ in done],
        completions_ids=[r.completion_ids for r, _, _ in done],
        completions_sequences=[s for _, s, _ in done], tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n, model_version=0, group_id=0, row_index=PROMPT_ROW,
        env_rewards=[None] * n, rollout_rewards=[None] * n, rollouts=[r for r, _, _ in done],
        stats=[s for _, _, s in done], prompt_index=PROMPT_ROW)
    samples, metrics = await score_group(group, loop.reward_funcs, loop.compute_advantages, eos,
                                         loop.num_top)
    advantages = loop.compute_advantages(group)
    for replica in loop.replicas:
        await replica.client.aclose()
    return row, group, advantages, samples, metrics


def walkthrough(out) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    logging.disable(logging.WARNING)

    def say(*lines: str) -> None:
        print(*lines, sep="\n", file=out)

    def section(name: str) -> None:
        say(f"=== {name}")

    with tempfile.TemporaryDirectory() as tmp:
        # 0. the toy model, warmed up on the answer format, saved like a hub model
        tokenizer = toy.build_tokenizer()
        model = toy.build_model(len(tokenizer), seed=0)
        warm_loss = toy.warm_up(model, tokenizer, steps=30, batch=32, seed=0)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        with contextlib.redirect_stderr(io.StringIO()):
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        config = AsyncGRPOConfig(output_dir=tmp, max_completion_length=3, learning_rate=3e-4,
                                 gradient_checkpointing=False, max_steps=1, token_budget=512)
        server = LocalServer(tmp, *local_server_args(config), "--seed", "0")
        try:
            config = dataclasses.replace(config, vllm_server_base_url=server.url)
            _walk(config, tokenizer, tmp, warm_loss, server, say, section)
        finally:
            server.stop()


def _walk(config, tokenizer, model_dir, warm_loss, server, say, section) -> None:
    section("model")
    say(f"toy model: {sum(p.numel() for p in toy.build_model(len(tokenizer)).parameters()):,} "
        f"parameters, vocabulary {len(tokenizer)}; warm-up loss {fmt(warm_loss)} "
        f"(floor ln(10)/2 = {fmt(np.log(10) / 2)})")

    # 1. the prompt, rendered by the chat template and tokenized (rollout/loop.py: generate_one)
    dataset = toy.make_dataset(8, seed=0)
    row, group, advantages, samples, metrics = asyncio.run(rollouts(config, tokenizer, dataset,
                                                                    server.url))
    prompt_ids = group.rollouts[0].turns[0].prompt_ids
    section("prompt")
    say(f"dataset row {PROMPT_ROW}: prompt={row['prompt']}  answer={row['answer']!r}",
        f"rendered: {tokenizer.decode(prompt_ids)!r}",
        f"{len(prompt_ids)} tokens: {prompt_ids}",
        f"as tokens: {show_tokens(tokenizer, prompt_ids)}")

    # 2. the group: completions, sampler log-probs, rewards, advantages (rollout/scoring.py)
    section("group")
    say(" i  completion ids   text          log q (sampler)           reward  advantage")
    for i, r in enumerate(group.rollouts):
        turn = r.turns[0]
        text = tokenizer.decode(turn.output_ids)
        lps = " ".join(fmt(x) for x in turn.output_log_probs)
        say(f"{i:2d}  {str(turn.output_ids):15s}  {text!r:12s}  {lps:24s}  "
            f"{group.rewards[i]:.1f}     {fmt(advantages[i])}")
    rewards = group.rewards
    say(f"rewards mean {fmt(rewards.mean())}, population std {fmt(rewards.std())}; advantage = "
        f"(reward - mean) / (std + 1e-4)",
        f"kept: frac_reward_zero_std = {metrics['frac_reward_zero_std']:.0f}; "
        f"{len(samples)} samples queued, model_version {samples[0].model_version}")

    # 3. reconcile: rollout 0's turn → one training sequence → a RolloutSample (rollout/samples.py)
    section("reconcile")
    turn = group.rollouts[0].turns[0]
    s = samples[0]
    sequences, drifts = reconcile(group.rollouts[0].turns)
    say(f"rollout 0: 1 turn (prompt {len(turn.prompt_ids)} tokens, output {turn.output_ids}) → "
        f"{len(sequences)} sequence, drifts {drifts}")
    say(" t  token            mask  sampler_logprobs  top_ids[:3]         top_logprobs[:3]")
    for t in range(len(s.input_ids) - 4, len(s.input_ids)):
        tops = " ".join(fmt(x, 2) for x in s.top_logprobs[t, :3])
        say(f"{t:2d}  {show_tokens(tokenizer, [s.input_ids[t]]):15s}  {s.completion_mask[t]:4d}  "
            f"{fmt(s.sampler_logprobs[t]):>16s}  {str(s.top_ids[t, :3].tolist()):18s}  {tops}")

    # 4. the packed row (trie_pack.py: build_row → TreeRow.pack)
    section("pack")
    row_ = build_row(samples)
    packed = row_.pack()
    say(f"{packed.num_samples} samples, {packed.raw_tokens} raw tokens → {packed.unique_tokens} "
        f"unique (packing ratio {packed.raw_tokens / packed.unique_tokens:.2f}); "
        f"{packed.trained_tokens} loss terms; attention cost {packed.attention_cost}",
        f"cu_seqlens_q {packed.cu_seqlens_q.tolist()}",
        f"position_ids[{GRID_FROM}:] {packed.position_ids[GRID_FROM:].tolist()}",
        f"subtree_end[{GRID_FROM}:]  {packed.subtree_end[GRID_FROM:].tolist()}",
        f"token_index  {packed.token_index.tolist()}",
        f"sample_ids   {packed.sample_ids.tolist()}",
        "attention: query i sees key j iff j <= i <= subtree_end[j];",
        f"keys 0..{GRID_FROM - 1}, the shared prompt, are seen by every query:")
    say(*mask_grid(packed, tokenizer, GRID_FROM))

    # 5. the loss: ratios, keep bits, centering (loss.py), then one optimizer step (train.py)
    model, _ = load_model(model_dir, config, tokenizer)
    policy = Policy(model)
    head = policy.head()
    with torch.no_grad():
        hidden = policy(packed).last_hidden_state[0]                           # [N, H]
        lp = token_logprobs(hidden, head.weight, head.bias, packed.token_index, packed.targets,
                            top_ids=packed.top_ids)
        log_q = packed.sampler_logprobs
        ratio = (lp.target - log_q).exp()                                      # [M]
        inside = ((ratio >= config.vllm_importance_sampling_clip_min)
                  & (ratio <= config.vllm_importance_sampling_clip_max))       # [M] keep bits
        centering = centering_term(lp, packed.top_logprobs, packed.advantages, config)  # [M]
    section("loss")
    say(" m  sample  pos  target      log π     log q     ratio   keep  advantage  c_m")
    for m in range(packed.trained_tokens):
        say(f"{m:2d}  {int(packed.sample_ids[m]):6d}  {int(packed.token_index[m]):3d}  "
            f"{show_tokens(tokenizer, [packed.targets[m]]):10s}  {fmt(lp.target[m]):8s}  "
            f"{fmt(log_q[m]):8s}  {fmt(ratio[m]):6s}  {int(inside[m]):4d}  "
            f"{fmt(packed.advantages[m]):9s}  {fmt(centering[m])}")
    grads = {}
    for centred in (True, False):
        cfg = dataclasses.replace(config, score_centering=centred)
        hidden = policy(packed).last_hidden_state[0]
        lp_g = token_logprobs(hidden, head.weight, head.bias, packed.token_index, packed.targets,
                              top_ids=packed.top_ids)
        loss, _ = policy_loss(lp_g, packed.sampler_logprobs, packed.advantages,
                              packed.sample_ids, StepTotals.of([packed]), cfg, packed.top_logprobs)
        grads[centred] = (loss.item(), torch.autograd.grad(loss, head.weight)[0])
    (loss_c, g_c), (loss_p, g_p) = grads[True], grads[False]
    say(f"loss = Σ keep·-min(r·A, clip(r)·A) / n = {fmt(loss_c, 6)} with centering, "
        f"{fmt(loss_p, 6)} without", "(the centering term adds A·sg(w)·(c - sg(c)) = 0)",
        f"LM-head gradient norm {fmt(float(g_p.norm()), 5)} → {fmt(float(g_c.norm()), 5)} "
        f"with centering; they differ by {fmt(float((g_c - g_p).norm()), 5)}")
    optimizer, scheduler = build_optimizer(policy, config)
    step = train_step(policy, optimizer, scheduler, [packed], StepTotals.of([packed]), config,
                      world=1, aux_coef=0.0)
    say(f"train_step: loss {fmt(step['loss'], 6)}, grad_norm {fmt(step['grad_norm'])}, "
        f"ratio mean {fmt(step['sampling/importance_sampling_ratio/mean'])}, "
        f"masked {fmt(step['sampling/masked_mean'])}, "
        f"clipped {fmt(step['clip_ratio/low_mean'] + step['clip_ratio/high_mean'])}")

    # 6. the sync that publishes version 1 (weight_sync.FullSync)
    section("sync")
    client = VLLMClient(server.url)
    before = client.weight_info()
    baseline = client.weight_checker("checksum")["checksums"]
    sync = FullSync(policy, [client], config)
    sync.connect()
    stats = sync.push(1)
    changed = client.weight_checker("compare", baseline)["mismatches"]
    say(f"server weight_version {before!r} → {client.weight_info()!r}; "
        f"{stats['perf/weight_sync_bytes']:,.0f} bytes sent; "
        f"{len(changed)} of {len(baseline)} tensors changed")
    target = samples[0].input_ids[len(prompt_ids)]
    reply = client.completions({"prompt": list(prompt_ids), "max_tokens": 1, "logprobs": -1,
                                "temperature": 1.0, "return_tokens_as_token_ids": True})
    served = reply["choices"][0]["logprobs"]["top_logprobs"][0][f"token_id:{target}"]
    with torch.no_grad():
        hidden = policy(packed).last_hidden_state[0]
        new = token_logprobs(hidden, head.weight, head.bias, packed.token_index, packed.targets,
                             top_ids=packed.top_ids)
        centering = centering_term(new, packed.top_logprobs, packed.advantages, config)  # [M]
    m = int(np.flatnonzero(packed.sample_ids.numpy() == 0)[0])
    say(f"log-prob of {show_tokens(tokenizer, [target])!r} after the prompt: sampler (v0) "
        f"{fmt(samples[0].sampler_logprobs[len(prompt_ids)])}, trainer (v1) "
        f"{fmt(new.target[m])}, server now {fmt(served)}")
    client.close()

    # 7. the same row under version 1: what a sample of staleness 1 looks like to the loss
    section("stale")
    ratio = (new.target - packed.sampler_logprobs).exp()                          # [M]
    keep, low, high = importance_bands(ratio, packed.advantages, config)          # [M] bool each
    say(" sample  reward  ratio(digit)  ratio(end)  keep  clipped")
    for i in range(packed.num_samples):
        m0, m1 = np.flatnonzero(packed.sample_ids.numpy() == i)
        say(f"{i:7d}  {samples[i].reward:6.1f}  {fmt(ratio[m0]):>12s}  {fmt(ratio[m1]):>10s}  "
            f"{int(keep[m0] & keep[m1]):4d}  {int((low | high)[[m0, m1]].any()):7d}")
    bounds = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    say(f"{int(keep.sum())} of {len(keep)} loss terms inside [{bounds[0]}, {bounds[1]}] (kept), "
        f"{int((low | high).sum())} outside 1 ± {config.epsilon} (clipped);",
        f"centering term max |c_m| = {fmt(centering.abs().max())}")


def blocks(text: str) -> dict[str, str]:
    """The output split by '=== name' headers."""
    out = {}
    name = None
    for line in text.splitlines():
        if line.startswith("=== "):
            name = line[4:]
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


BLOCK = re.compile(r"(<!-- output: (\w+) -->\n```text\n)(.*?)(```)", re.S)


def document_blocks(doc: str) -> dict[str, str]:
    """The output blocks embedded in WALKTHROUGH.md, by name."""
    return {m.group(2): m.group(3) for m in BLOCK.finditer(doc)}


def write(path: str, text: str) -> None:
    """Replace every `<!-- output: name -->` block of the document with this run's."""
    new = blocks(text)
    with open(path) as f:
        doc = f.read()
    doc = BLOCK.sub(lambda m: m.group(1) + new[m.group(2)] + m.group(4), doc)
    with open(path, "w") as f:
        f.write(doc)


def stale(path: str, text: str) -> list[str]:
    """Names of the document's blocks that differ from this run's output (or are missing)."""
    with open(path) as f:
        shown = document_blocks(f.read())
    printed = blocks(text)
    names = list(dict.fromkeys(list(printed) + list(shown)))
    return [n for n in names if shown.get(n) != printed.get(n)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="One prompt of the toy task through the whole system.")
    ap.add_argument("--write", metavar="DOC", help="refresh the output blocks of this document")
    ap.add_argument("--check", metavar="DOC", help="exit 1 if this document shows other values")
    args = ap.parse_args(argv)
    start = time.monotonic()
    out = io.StringIO()
    walkthrough(out)
    sys.stdout.write(out.getvalue())
    if args.write:
        write(args.write, out.getvalue())
    print(f"({time.monotonic() - start:.1f} s)", file=sys.stderr)
    if args.check and (names := stale(args.check, out.getvalue())):
        sys.exit(f"{args.check}: the blocks {names} differ from this run's output; refresh them "
                 f"with `python -m tools.walkthrough --write {args.check}`")


if __name__ == "__main__":
    main()
