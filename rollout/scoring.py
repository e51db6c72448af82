"""Scoring a finished group (spec: the reward sources of ロールアウトループのカスタマイズ
(Customising the rollout loop); 報酬とオフポリシー性 (Rewards and off-policyness); the rollout/,
completions/, tools/ and env/ rows of 記録されたメトリクス (Recorded metrics)).

Pure functions over a RolloutGroup, called by the rollout loop's score loop (rollout/loop.py):

    reward sources ─► one column each (NaN where a source did not score a rollout), checked:
        G numbers or None (checked_column), none infinite, each call within reward_tool_timeout
        reward_funcs (sync ones in threads, all at once) · environment get_reward() (named after
        the environment class) · Rollout.reward (named "rollout")
    group.rewards = Σ columns per rollout (NaN when no source scored it) ─► compute_advantages
    kept iff ≥ 2 rollouts scored and not all equal ─► a RolloutSample per training sequence

A worked example: rewards [1, 0, NaN, 1] → scored [1, 0, 1], kept; mean 2/3, population std
0.471; the default advantages (AsyncRolloutLoop.compute_advantages) are [0.71, -1.41, 0, 0.71];
`reward` = `reward_kept` = 0.667.

Departures from the spec, and why:
- A reward source whose name repeats (two partials of one function) keeps its own column,
  <name>_2, <name>_3, ...: each is summed once and reported apart.
- tools/*_total counts are summed over the run (add_totals): a total is read as its latest value.
- A reward's NaN means None (TRL turns None into NaN: a ported function may return it); an
  infinite one is an error naming the source and the row, not a dropped group, which would hide
  the reward's bug for the whole run.
- A reward function past reward_tool_timeout (ours) fails its group, counted as a failed rollout.
"""
import asyncio
import math
import numbers
from collections import Counter
from typing import Callable

import numpy as np

from rollout.samples import RolloutGroup, RolloutSample, to_sample
from rollout.tool_calls import call_maybe_async


async def score_group(group: RolloutGroup, reward_funcs: list[Callable],
                      compute_advantages: Callable[[RolloutGroup], np.ndarray],
                      eos_token_ids: list[int], num_top: int | None, limit: float | None = None,
                      offers_tools: bool = False, mask_truncated: bool = False,
                      executor=None) -> tuple[list[RolloutSample], dict[str, float]]:
    """Rewards (each call within `limit` seconds, a sync one on `executor`) → group.rewards →
    compute_advantages → drop the group or build its samples; and the group's metrics (its
    tools/*_total counts are this group's: add_totals makes them totals; offers_tools: tools/
    rates also with no call). mask_truncated (mask_truncated_completions): a truncated rollout's
    reward counts in its group's advantages, but it gives no sample (DAPO's overlong filtering)."""
    columns = await score_rewards(reward_funcs, group, limit, executor)
    group.rewards = summed(columns, len(group.rollouts))
    advantages = compute_advantages(group)
    scored = group.rewards[~np.isnan(group.rewards)]
    kept = len(scored) >= 2 and scored.max() > scored.min()
    metrics = group_metrics(group, eos_token_ids, offers_tools)
    metrics["frac_reward_zero_std"] = float(not kept)
    if len(scored):
        metrics["reward"] = float(scored.mean())
    if not kept:
        return [], metrics
    metrics["reward_kept"] = float(scored.mean())
    per_rollout = [{"reward_group_std": float(scored.std())} for _ in group.rollouts]
    for name, column in columns.items():
        std = float(np.nanstd(column)) if not np.isnan(column).all() else math.nan
        for i, m in enumerate(per_rollout):
            m |= {f"rewards/{name}/mean": float(column[i]), f"rewards/{name}/group_std": std}
    samples = [to_sample(seq, num_top, advantage=float(advantages[i]), group_id=group.group_id,
                         model_version=group.model_version, reward=float(group.rewards[i]),
                         metrics=dict(per_rollout[i]), prompt=group.prompts[i],
                         completion=group.completions[i], rollout_id=group.rollouts[i].rollout_id,
                         row_index=group.row_index, prompt_index=group.prompt_index)
               for i, sequences in enumerate(group.completions_sequences) for seq in sequences
               if not (mask_truncated and truncated(group.rollouts[i], eos_token_ids))]
    return samples, metrics


def summed(columns: dict[str, np.ndarray], n: int) -> np.ndarray:
    """[n] each rollout's reward: its sources' sum, NaN where no source scored it."""
    if not columns:
        return np.full(n, np.nan)
    total = np.stack(list(columns.values()), axis=1)              # [n, sources]
    return np.where(~np.isnan(total).all(axis=1), np.nansum(total, axis=1), np.nan)


def truncated(rollout, eos_token_ids: list[int]) -> bool:
    """Whether a rollout was cut: its last turn does not end on a stop token (at
    max_completion_length, or at the context's end), or its next turn found no room in the
    context (Rollout.truncated); completions/clipped_ratio counts them."""
    ids = rollout.turns[-1].output_ids if rollout.turns else []
    return rollout.truncated or not ids or ids[-1] not in eos_token_ids


# ── evaluation: eval prompts scored, never trained on ──────────────────────────────────────


def eval_result(group: RolloutGroup, columns: dict[str, np.ndarray],
                eos_token_ids: list[int]) -> dict:
    """One eval prompt's figures, what eval_metrics aggregates: each rollout's reward (summed,
    and by source), length and truncation, and the version the group ran under."""
    return {"rewards": summed(columns, len(group.rollouts)), "columns": columns,
            "lengths": [len(r.completion_ids) for r in group.rollouts],
            "truncated": [truncated(r, eos_token_ids) for r in group.rollouts],
            "version": group.model_version}


def pass_at(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of n rollouts of which c passed (Chen et al. 2021, Codex):
    1 - C(n - c, k) / C(n, k), the chance that k drawn without replacement include a pass.
    n = 4, c = 1: pass@1 = 1/4, pass@2 = 1 - 3/6 = 1/2, pass@4 = 1."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(step: int, results: list[dict], pass_reward: float,
                 seconds: float = 0.0) -> dict[str, float]:
    """An evaluation's line (its `step`: the trainer's when it asked): eval/reward (mean, std),
    eval/rewards/<source>/mean, eval/pass@1 and eval/pass@k (a rollout passes when its reward is
    at least pass_reward; k = the rollouts per prompt; means over prompts), eval/completions/
    mean_length and clipped_ratio, the weight versions evaluated (eval/model_version_min/max), the
    prompts scored and failed, eval/duration_s. What is not finite is left out.

    Worked: two prompts of 4 rollouts, rewards [1, 0, 0, 0] and [0, 0, 0, 0], pass_reward 1:
    eval/reward 0.125, eval/pass@1 (1/4 + 0)/2 = 0.125, eval/pass@4 (1 + 0)/2 = 0.5."""
    ok = [r for r in results if not r.get("failed")]
    line = {"step": step, "eval/prompts": len(ok), "eval/failed_prompts": len(results) - len(ok),
            "eval/duration_s": seconds}
    if ok:
        rewards = np.concatenate([r["rewards"] for r in ok])
        scored = rewards[~np.isnan(rewards)]                              # NaN: unscorable
        k = len(ok[0]["rewards"])
        passed = [int(np.sum(r["rewards"] >= pass_reward)) for r in ok]   # NaN never passes
        line |= {"eval/reward": float(np.mean(scored)) if len(scored) else math.nan,
                 "eval/reward_std": float(np.std(scored)) if len(scored) else math.nan,
                 "eval/pass@1": float(np.mean([pass_at(k, c, 1) for c in passed])),
                 f"eval/pass@{k}": float(np.mean([pass_at(k, c, k) for c in passed])),
                 "eval/completions/mean_length": float(np.mean([n for r in ok
                                                                for n in r["lengths"]])),
                 "eval/completions/clipped_ratio": float(np.mean([t for r in ok
                                                                  for t in r["truncated"]])),
                 "eval/model_version_min": min(r["version"] for r in ok),
                 "eval/model_version_max": max(r["version"] for r in ok)}
        for name in dict.fromkeys(n for r in ok for n in r["columns"]):
            column = np.concatenate([r["columns"][name] for r in ok if name in r["columns"]])
            if (~np.isnan(column)).any():
                line[f"eval/rewards/{name}/mean"] = float(np.nanmean(column))
    return {k: v for k, v in line.items() if not isinstance(v, float) or math.isfinite(v)}


def add_totals(totals: dict[str, float], metrics: dict[str, float]) -> None:
    """Turn a group's *_total counts in `metrics` into running totals since the process started,
    kept in `totals` (both updated in place): groups adding 2, then 3 calls report 2, then 5."""
    for name in [n for n in metrics if n.endswith("_total")]:
        totals[name] = totals.get(name, 0) + metrics[name]
        metrics[name] = totals[name]


def reward_name(func: Callable) -> str:
    """rewards/<name>/...: a function's __name__, a partial's function, a callable's class."""
    inner = getattr(func, "func", func)
    return getattr(inner, "__name__", type(inner).__name__)


async def score_rewards(reward_funcs: list[Callable], group: RolloutGroup,
                        limit: float | None = None, executor=None) -> dict[str, np.ndarray]:
    """Every reward source of a group as a column (NaN where a source did not score a rollout):
    reward functions (sync ones in `executor`'s threads, None: asyncio's default, all
    concurrently, each within `limit` seconds),
    environment rewards (named after the environment class) and Rollout.reward, each checked
    (checked_column). Every source keeps its own column, so each is summed once; a name already
    taken gets a suffix (_2, _3, ...) in the rewards/<name>/ metrics."""
    environments = {} if group.environments is None else {"environments": group.environments}

    async def call(func):
        values = await call_maybe_async(func, executor, limit, prompts=group.prompts,
                                        completions=group.completions,
                                        completion_ids=group.completions_ids, **environments,
                                        **group.reward_kwargs)
        return checked_column(f"reward function {reward_name(func)}", values, group)

    columns: dict[str, np.ndarray] = {}

    def add(name: str, column: np.ndarray) -> None:  # a repeated name gets _2, _3, ...
        key = name
        k = 1
        while key in columns:
            k += 1
            key = f"{name}_{k}"
        columns[key] = column

    for func, column in zip(reward_funcs, await asyncio.gather(*map(call, reward_funcs))):
        add(reward_name(func), column)
    for cls in dict.fromkeys(e[0] for e in group.env_rewards if e is not None):
        values = [e[1] if e is not None and e[0] is cls else None for e in group.env_rewards]
        add(cls.__name__, checked_column(f"{cls.__name__}.get_reward()", values, group))
    if any(r is not None for r in group.rollout_rewards):
        add("rollout", checked_column("Rollout.reward", group.rollout_rewards, group))
    return columns


def checked_column(source: str, values, group: RolloutGroup) -> np.ndarray:
    """A reward source's values for a group: one number or None (unscorable) per rollout, as a
    column with NaN for None. NaN means None, as in TRL (which turns None into NaN), so a reward
    function ported from it may return either; anything else (another length, a non-number, an
    infinite reward, which would turn every advantage of the group into NaN) raises ValueError
    naming the source, what it returned and the row."""
    n = len(group.rollouts)
    ok = isinstance(values, (list, tuple, np.ndarray)) and len(values) == n and all(
        v is None or isinstance(v, (numbers.Real, np.bool_)) for v in values)
    column = np.array([math.nan if v is None else float(v) for v in values]) if ok else None
    if column is None or np.isinf(column).any():
        raise ValueError(f"{source} returned {values!r:.200} for dataset row {group.row_index} "
                         f"(prompt {group.prompts[0]!r:.100}); expected a list of {n} numbers or "
                         "None (None: unscorable), none of them infinite")
    return column


def group_metrics(group: RolloutGroup, eos_token_ids: list[int],
                  offers_tools: bool = False) -> dict[str, float]:
    """The group's rollout/, completions/, tools/ and env/ metrics (spec: 記録されたメトリクス).
    tools/call_frequency and tools/loop_exhausted_frac are per rollout over every group of a run
    that offers tools (offers_tools), a group without a call included: 1 call in 10 groups of
    one rollout is 0.1."""
    rollouts = group.rollouts
    stats = group.stats
    lengths = [len(r.completion_ids) for r in rollouts]
    drifts = [d for s in stats for d in s["drifts"]]
    clipped = [truncated(r, eos_token_ids) for r in rollouts]
    m = {"rollout/duration_s": float(np.mean([s["duration_s"] for s in stats])),
         "rollout/turns_mean": float(np.mean([len(r.turns) for r in rollouts])),
         "rollout/turns_max": max(len(r.turns) for r in rollouts),
         "rollout/samples_per_rollout": float(np.mean([len(s)
                                                       for s in group.completions_sequences])),
         "completions/mean_length": float(np.mean(lengths)),
         "completions/min_length": min(lengths), "completions/max_length": max(lengths),
         "completions/clipped_ratio": float(np.mean(clipped))}
    if drifts:
        m |= {"rollout/fork_frac": float(np.mean([d > 0 for d in drifts])),
              "rollout/drift_tokens_mean": float(np.mean(drifts)),
              "rollout/drift_tokens_max": max(drifts)}
    calls = [c for r in rollouts for c in r.tool_calls]
    if calls or offers_tools:
        m |= {"tools/call_frequency": len(calls) / len(rollouts),
              "tools/loop_exhausted_frac": float(np.mean([r.loop_exhausted for r in rollouts]))}
    if calls:
        per_turn = Counter((j, c.turn_index)        # calls per (rollout, turn)
                           for j, r in enumerate(rollouts) for c in r.tool_calls)
        m |= {"tools/failure_frequency": sum(c.failed for c in calls) / len(calls),
              "tools/latency_s": float(np.mean([c.latency_s for c in calls])),
              "tools/unknown_name_total": sum(c.unknown for c in calls),
              "tools/parallel_calls_mean": float(np.mean(list(per_turn.values())))}
        ran = {c.name for c in calls if c.name is not None and not c.unknown}  # malformed: no name
        for name in ran:
            mine = [c for c in calls if c.name == name]
            m |= {f"tools/{name}/latency_s": float(np.mean([c.latency_s for c in mine])),
                  f"tools/{name}/call_total": len(mine),
                  f"tools/{name}/failure_total": sum(c.failed for c in mine)}
    for key in ("env/reset_s", "env/reward_s"):
        if any(key in s for s in stats):
            m[key] = float(np.mean([s[key] for s in stats if key in s]))
    return m
