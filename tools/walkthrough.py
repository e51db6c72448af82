"""One prompt of the toy task through the whole system, both processes, step by step, with the
values it really takes (WALKTHROUGH.md shows this script's output; spec: 概要 (Overview), followed
step by step).

    python -m tools.walkthrough                        # every step's values, in ~20 s on one core
    python -m tools.walkthrough --write WALKTHROUGH.md # refresh the document's output blocks
    python -m tools.walkthrough --check WALKTHROUGH.md # exit 1 if a block differs from this run's

    rollout process (rollout/)                          trainer (train.py; rank 0, then every rank)
    ──────────────────────────                          ───────────────────────────────────────────
    admits? (staleness.py: 1) → rollouts (loop.py: 2-3)
      → reconcile (samples.py: 4) → score_group (3)  ──queue──►  Feed.next_step: Planner (5)
                                                                   → TreeRow.pack (trie_pack.py: 6)
                                                                   → train_step (loss.py: 7)
                                                                   → FullSync.push(1) (8)
    the waiting group admitted, started under v1 (9) ◄── v1 ───  set_model_version(1) (9)
    the trained row seen by v1: staleness (10)

Every value comes from the project's own functions, in the order train.py and rollout/loop.py call
them; nothing is recomputed here except the displays (the admission arithmetic, the mask grid,
per-token tables).

Departures from `python train.py`, to stay within seconds and reproducible:
  * the toy warm-up is 30 steps of 32 (toy.warm_up), not the demo model's 200 (toy.save); seeds
    are fixed.
  * both processes' code runs in this one, in turn: the rollout loop's steps on an asyncio loop,
    the trainer's between them; the channels are in-process (queue.Queue, plain values), where
    RolloutWorker.start makes multiprocessing ones and spawns the child.
  * groups start one at a time and their rollouts run in turn (the loop runs them concurrently
    under the replica's cap), so the server's seeds come in order; the rollout process fills its
    window before the trainer's first step (a run interleaves the two as they come).
  * token_budget 48: one row holds one group of these prompts (the default, the server's
    max_model_len, holds about ten); max_staleness 1, the demo's; no torchrun (world size 1).
  * reward: toy.sum_reward (the demo CLI's exact_reward scores a one-digit reply the same).
"""
import argparse
import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import queue
import re
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import toy  # noqa: E402
from checkpoint import TrainState  # noqa: E402
from config import AsyncGRPOConfig  # noqa: E402
from loss import (StepTotals, centering_term, importance_bands, policy_loss,  # noqa: E402
                  token_logprobs)
from rollout import AsyncRolloutLoop  # noqa: E402
from rollout.loop import Channels, spec_channels  # noqa: E402
from rollout.prompts import prompt_stream  # noqa: E402
from rollout.samples import PendingGroup, reconcile  # noqa: E402
from rollout.scoring import score_group  # noqa: E402
from rollout.servers import drop_unverified, pick  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402
from local_vllm.launch import LocalServer  # noqa: E402
from train import Feed, Policy, build_optimizer, load_model, plan_step, scatter_rows  # noqa: E402
from train import local_server_args, train_step  # noqa: E402
from trie_pack import Planner  # noqa: E402
from vllm_client import VLLMClient  # noqa: E402
from weight_sync import FullSync  # noqa: E402

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


# ── the two ends of the process line, in one process ─────────────────────────────────────────


def in_process_channels(worker: RolloutWorker) -> Channels:
    """The channels RolloutWorker.start() makes from a spawn context, made for one process: the
    spec's six primitives as queue.Queue and plain values, ours as loop.spec_channels makes them,
    which start where a new worker's window does (C_v 0, R the prior rate of one process)."""
    channels = spec_channels(worker.config, queue.Queue(worker.config.queue_maxsize),
                             SimpleNamespace(value=worker.initial_version),
                             SimpleNamespace(value=time.time()), threading.Event(),
                             queue.Queue(1), queue.Queue())
    assert (channels.version_start.value, channels.rate.value) == (worker.window.version_start,
                                                                   worker.window.rate)
    return channels


def ask_admission(loop: AsyncRolloutLoop, group_id: int, say) -> bool:
    """loop._admissible() (staleness.admits on the window the trainer published), with its
    arithmetic shown."""
    counts, channels, config = loop.counts, loop.channels, loop.config
    G = config.num_generations
    start, rate = channels.version_start.value, channels.rate.value
    admitted = loop._admissible()
    if counts.rollouts_done == 0:
        why = (f"no rollout done yet, nothing pending,\n    and the trainer lacks samples "
               f"(consumed {channels.consumed.value} < C_v + R = {start + rate:g})")
    else:
        per = counts.samples_done / counts.rollouts_done
        need = counts.queued + per * (counts.pending_rollouts + G)
        end = start + (config.max_staleness + 1) * rate
        why = (f"queued {counts.queued} + {per:.2f}·(pending {counts.pending_rollouts} + {G}) = "
               f"{need:g} {'≤' if need <= end else '>'} C_v + {config.max_staleness + 1}·R = "
               f"{end:g}")
    say(f"  admission for group {group_id}: {why} → {'start' if admitted else 'wait'}")
    return admitted


def start_group(loop: AsyncRolloutLoop, prompt: tuple, group_id: int) -> PendingGroup:
    """What the generate loop does once a group is admitted: one replica for the whole group, its
    rollouts pending until scored, the version stamped when its first rollout starts."""
    prompt_index, _, row_index, row = prompt
    replica = pick(loop.replicas)
    group = PendingGroup(group_id, row_index, prompt_index, row, loop.config.num_generations,
                         replica)
    loop.counts.pending_rollouts += group.size
    replica.assigned += group.size
    group.model_version = loop.model_version
    return group


async def run_rollouts(loop: AsyncRolloutLoop, group: PendingGroup) -> None:
    """The group's rollouts in turn (loop._rollout: generate_one, reconcile; the complete group
    goes to the score queue)."""
    for i in range(group.size):
        group.replica.inflight += 1
        await loop._rollout(group, i)


async def score(loop: AsyncRolloutLoop, say) -> tuple:
    """What the score loop does with a complete group: score_group, the samples onto the rollout
    queue, the prompt's count to the trainer's resume index (_finish_prompt)."""
    group = loop.score_queue.get_nowait()
    samples, metrics = await score_group(group, loop.reward_funcs, loop.compute_advantages,
                                         loop.eos_token_ids, loop.num_top)
    for sample in samples:
        sample.enqueued_at = time.time()
        await loop._put(sample)
    loop._finish_prompt(group.prompt_index, len(group.rollouts), len(samples))
    rewards = " ".join(f"{r:g}" for r in group.rewards)
    fate = (f"kept: {len(samples)} samples queued" if samples
            else "dropped (equal rewards): nothing queued")
    say(f"  group {group.group_id} scored: rewards {rewards} → {fate} "
        f"(queued {loop.counts.queued})")
    return group, samples, metrics


def describe(group: PendingGroup, what: str) -> str:
    return (f"group {group.group_id} (dataset row {group.row_index}, "
            f"{group.row['prompt'][0]['content']!r}) {what}")


async def fill_window(loop: AsyncRolloutLoop, prompts, say) -> tuple:
    """Step 1: the rollout process's loops, a group at a time, until admission says wait.
    Admission is asked for the next group once a group's rollouts are done (still pending:
    unscored) and again once it is scored. Returns the first kept group (RolloutGroup, samples,
    metrics), the prompt left waiting and its group id."""
    first_kept = None
    prompt, group_id = next(prompts), 0
    ask_admission(loop, group_id, say)                   # the first group: admitted
    group = start_group(loop, prompt, group_id)
    while True:
        await run_rollouts(loop, group)
        say(describe(group, f"started under version {group.model_version}: its "
                            f"{group.size} rollouts are done"))
        prompt, group_id = next(prompts), group_id + 1
        admitted = ask_admission(loop, group_id, say)
        scored = await score(loop, say)
        if first_kept is None and scored[1]:
            first_kept = scored
        if not admitted:
            admitted = ask_admission(loop, group_id, say)
        if not admitted:
            return first_kept, prompt, group_id
        group = start_group(loop, prompt, group_id)


# ── the walk ─────────────────────────────────────────────────────────────────────────────────


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
                                 gradient_checkpointing=False, max_steps=1, token_budget=48,
                                 max_staleness=1, train_sampling_strategy="sequential")
        server = LocalServer(tmp, *local_server_args(config), "--seed", "0")
        try:
            config = dataclasses.replace(config, vllm_server_base_url=server.url)
            with asyncio.Runner() as runner:      # the rollout process's event loop
                _walk(config, tokenizer, tmp, warm_loss, server, runner, say, section)
        finally:
            server.stop()


def _walk(config, tokenizer, model_dir, warm_loss, server, runner, say, section) -> None:
    section("model")
    say(f"toy model: {sum(p.numel() for p in toy.build_model(len(tokenizer)).parameters()):,} "
        f"parameters, vocabulary {len(tokenizer)}; warm-up loss {fmt(warm_loss)} "
        f"(floor ln(10)/2 = {fmt(np.log(10) / 2)})")

    # 1. admission: the trainer's published window, the rollout process's check before each group
    dataset = toy.make_dataset(8, seed=0)
    eos = [tokenizer.eos_token_id]
    worker = RolloutWorker(config, dataset, [toy.sum_reward], tokenizer, eos_token_ids=eos)
    worker.channels = in_process_channels(worker)        # start() would spawn the child here
    loop = AsyncRolloutLoop(config, None, dataset, [toy.sum_reward], tokenizer, eos,
                            channels=worker.channels, max_concurrent_rollouts=len(dataset))
    runner.run(loop.connect())                           # every replica checked, as at start
    prompts = prompt_stream(dataset, 0, config.num_train_epochs, config.max_steps,
                            config.shuffle_seed())
    section("admit")
    window = worker.window
    say(f"the trainer publishes C_v = {window.version_start} (samples consumed when version 0 "
        f"began) and R = {window.rate:g}",
        f"(samples a version trains; prior_rate: {config.per_device_train_batch_size} a "
        f"micro-batch × {config.gradient_accumulation_steps} micro-batch × 1 rank × "
        f"{config.weight_sync_steps} step a sync);",
        f"G = {config.num_generations}, max_staleness = {config.max_staleness}: a sample queued "
        f"from now on must be number < C_v + {config.max_staleness + 1}·R = "
        f"{window.version_start + (config.max_staleness + 1) * window.rate:g}")
    (group, samples, metrics), waiting, waiting_id = runner.run(fill_window(loop, prompts, say))
    say(f"the queue holds {worker.qsize()} samples; group {waiting_id} waits for the trainer")
    advantages = loop.compute_advantages(group)
    kept_id = group.group_id

    # 2. the first kept group's prompt, rendered by the chat template and tokenized
    prompt_ids = group.rollouts[0].turns[0].prompt_ids
    row = dataset[group.row_index]
    section("prompt")
    say(f"group {kept_id}, dataset row {group.row_index}: prompt={row['prompt']}  "
        f"answer={row['answer']!r}",
        f"rendered: {tokenizer.decode(prompt_ids)!r}",
        f"{len(prompt_ids)} tokens: {prompt_ids}",
        f"as tokens: {show_tokens(tokenizer, prompt_ids)}")

    # 3. the group: completions, sampler log-probs, rewards, advantages (rollout/scoring.py)
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

    # 4. reconcile: rollout 0's turn → one training sequence → a RolloutSample (rollout/samples.py)
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

    # 5. rank 0 plans the step: Feed takes samples in queue order into the Planner (train.py)
    client = VLLMClient(server.url)
    planner = Planner(1, config.token_budget, config.per_device_train_batch_size)
    state = TrainState()
    feed = Feed(worker, planner, config.gradient_accumulation_steps, state)
    step = plan_step(feed, state.model_version, config.max_staleness)
    rows, totals = scatter_rows(step, 0, 1)
    closed, held = step.rows[0][0], planner.held()
    section("feed")
    placed = len(step.samples) - len(held)
    say(f"Feed.next_step(version {step.version}) took {len(step.samples)} samples from the queue "
        f"(consumed {worker.consumed}): {state.dropped_stale_total} stale, "
        f"{state.dropped_oversize_total} oversize;",
        f"the Planner placed {placed}, group {kept_id}'s, in one row: {closed.unique_tokens} "
        f"unique tokens;",
        f"the next, group {held[0].group_id}'s first, would make {closed.unique_tokens} + "
        f"{closed.match(held[0]).novel} unique tokens > token_budget {config.token_budget}: the "
        f"micro-batch",
        f"closes ({planner.world_size} row: one per rank), and that sample waits in the next "
        f"step's open row ({len(held)} in planner.held());",
        f"gradient_accumulation_steps {config.gradient_accumulation_steps}: {len(step.rows)} "
        f"micro-batch makes the step;",
        f"StepTotals: {totals.tokens} trained tokens, {totals.samples} samples, {totals.rows} row "
        f"(loss_type {config.loss_type} divides by the tokens);",
        f"staleness of the samples taken: "
        f"{[step.version - s.model_version for s in step.samples]};",
        f"the resume cursor: prompt_index {state.prompt_index}, trained {state.trained} "
        f"(the held sample is not trained yet);", f"the queue holds {worker.qsize()}")

    # 6. the packed row (trie_pack.py: TreeRow.pack, called by Feed.next_step)
    section("pack")
    packed = step.packed[0][0]
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

    # 7. the loss: ratios, keep bits, centering (loss.py), then one optimizer step (train.py)
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
    trained = train_step(policy, optimizer, scheduler, rows, totals, config, world=1,
                         aux_coef=0.0)
    say(f"train_step: loss {fmt(trained['loss'], 6)}, grad_norm {fmt(trained['grad_norm'])}, "
        f"ratio mean {fmt(trained['sampling/importance_sampling_ratio/mean'])}, "
        f"masked {fmt(trained['sampling/masked_mean'])}, "
        f"clipped {fmt(trained['clip_ratio/low_mean'] + trained['clip_ratio/high_mean'])}")

    # 8. the sync that sends version 1 (weight_sync.py)
    section("sync")
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

    # 9. the version published (RolloutWorker.set_model_version) and what the rollout process
    #    does with it: a new window, the replicas checked, the waiting group started under v1
    section("publish")
    worker.set_model_version(1)
    say(f"set_model_version(1): C_1 = consumed = {window.version_start}, R = {window.rate:g} "
        f"(samples trained per version since version 0);",
        f"a sample queued from now on must be number < C_1 + {config.max_staleness + 1}·R = "
        f"{window.version_start + (config.max_staleness + 1) * window.rate:g};",
        f"the rollout process reads model_version {loop.model_version}")
    runner.run(drop_unverified(loop.replicas, loop.adapter_name(1), adapter=False))
    say(f"  drop_unverified: {sum(r.down is None for r in loop.replicas)} of "
        f"{len(loop.replicas)} replica in routing (it serves the version sent)")
    ask_admission(loop, waiting_id, say)
    later = start_group(loop, waiting, waiting_id)
    runner.run(run_rollouts(loop, later))
    say(describe(later, f"started under version {later.model_version}: its rollouts are done"),
        f"  (with adapter sync its requests would name the model "
        f"{loop.adapter_name(1) if loop.lora_name else '<lora_name>-v1'}, adapter_name(1))")
    _, later_samples, _ = runner.run(score(loop, say))
    versions = sorted({s.model_version for s in later_samples}) or "-"
    say(f"  its samples' model_version: {versions}")
    queued = [s.model_version for s in worker.channels.rollout_buffer.queue]   # a peek
    for replica in loop.replicas:
        runner.run(replica.client.aclose())

    # 10. the same row under version 1: what a sample of staleness 1 looks like to the loss
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
    held = [s.model_version for s in planner.held()]
    say(f"next step: the open row holds {held.count(0)} sample of version 0, the queue "
        f"{queued.count(0)} of version 0 and {queued.count(1)} of version 1;",
        f"at version 1 all are within max_staleness {config.max_staleness}; a version-0 sample",
        "still there at version 2 would be dropped")


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
