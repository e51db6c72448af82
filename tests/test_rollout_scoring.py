"""rollout/scoring.py: reward sources summed per rollout and checked, flat groups dropped, the
group's metrics and their running totals."""
import asyncio
import functools
import math

import pytest

import rollout_helpers as h
from metrics import reduce_window
from rollout.samples import ToolCall
from rollout.scoring import add_totals, score_group
from rollout.tool_calls import CallTimeout

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)


def scored(tokenizer, group, reward_funcs=()):
    """score_group with the default loop's compute_advantages."""
    loop = h.make_loop(tokenizer)
    return asyncio.run(score_group(group, list(reward_funcs), loop.compute_advantages,
                                   loop.eos_token_ids, loop.num_top))


def test_score_group_sums_sources_and_drops_flat_groups(tokenizer):
    group = h.group_of([0.5, None, 1.0], env_rewards=[(h.Counter, 2.0), None, None])
    samples, metrics = scored(tokenizer, group, [h.solved_reward])
    assert group.rewards == pytest.approx([1.0 + 2.0 + 0.5, 1.1, 1.2 + 1.0])
    assert len(samples) == 3 and samples[0].model_version == 5
    assert samples[0].reward == pytest.approx(3.5)
    assert samples[0].metrics["rewards/Counter/mean"] == 2.0
    assert math.isnan(samples[1].metrics["rewards/Counter/mean"])
    assert metrics["frac_reward_zero_std"] == 0.0
    assert metrics["reward_kept"] == pytest.approx(metrics["reward"])
    assert sum(s.advantage for s in samples) == pytest.approx(0.0, abs=1e-6)

    # no reward functions: only Rollout.reward, all equal
    samples, metrics = scored(tokenizer, h.group_of([1.0, 1.0, None]))
    assert samples == [] and metrics["frac_reward_zero_std"] == 1.0 and "reward_kept" not in metrics
    samples, metrics = scored(tokenizer, h.group_of([1.0, None, None]))  # < 2 scored
    assert samples == [] and metrics["reward"] == 1.0


def weighted_rank(prompts, completions, weight, **kwargs) -> list[float]:
    return [weight * i for i in range(len(completions))]


def test_reward_sources_sharing_a_name_are_all_summed(tokenizer):
    """Two partials of one function (and an environment class named like a function) are separate
    sources."""
    funcs = [functools.partial(weighted_rank, weight=1.0),
             functools.partial(weighted_rank, weight=10.0)]
    group = h.group_of([None, None, None], env_rewards=[(h.Counter, 100.0), None, None])
    samples, _ = scored(tokenizer, group, funcs)
    assert group.rewards == pytest.approx([100.0, 11.0, 22.0])
    assert samples[1].metrics["rewards/weighted_rank/mean"] == 1.0
    assert samples[1].metrics["rewards/weighted_rank_2/mean"] == 10.0


def test_tool_calls_are_counted_by_kind_and_totals_run(tokenizer):
    calls = [ToolCall("add", 0.1, False, False, 0),   # ran
             ToolCall("add", 0.1, True, False, 0),    # ran and raised
             ToolCall("nope", 0.0, False, True, 0),   # unknown
             ToolCall(None, 0.0, True, False, 1)]     # malformed
    totals = {}
    per_group = []
    for _ in range(2):
        group = h.group_of([0.0, 1.0], row={}, tool_calls=[calls, []])
        metrics = scored(tokenizer, group)[1]
        add_totals(totals, metrics)
        per_group.append(metrics)
    first, second = per_group
    assert not any("None" in name for name in first)
    assert first["tools/failure_frequency"] == 0.5   # the raise and the malformed, not the unknown
    names = ["tools/unknown_name_total", "tools/add/call_total", "tools/add/failure_total"]
    assert [first[n] for n in names] == [1, 2, 1] and [second[n] for n in names] == [2, 4, 2]


@pytest.mark.parametrize("returned, shown", [
    ([0.0, 1.0, 2.0, 3.0], r"\[0.0, 1.0, 2.0, 3.0\]"),       # one value too many
    ([0.0, 1.0], r"\[0.0, 1.0\]"),                           # one too few
    (1.0, "1.0"),                                            # a single number
    ([0.0, "1", 2.0], r"\[0.0, '1', 2.0\]"),                 # not a number
    ([0.0, math.inf, 2.0], r"\[0.0, inf, 2.0\]"),            # infinite
], ids=["too many", "too few", "a number", "a string", "inf"])
def test_a_reward_function_returning_anything_but_its_groups_numbers_is_named(tokenizer, returned,
                                                                              shown):
    def reward(prompts, completions, **kwargs):
        return returned
    with pytest.raises(ValueError, match=rf"reward function reward returned {shown} for dataset "
                                         r"row 1 \(prompt \[\{'role': 'user', 'content': '3\+4="
                                         r"'\}\]\); expected a list of 3 numbers or None"):
        scored(tokenizer, h.group_of([None, None, None]), [reward])


def test_nan_is_unscorable_as_none_and_other_sources_are_checked_too(tokenizer):
    group = h.group_of([None, None, None])
    samples, metrics = scored(tokenizer, group, [h.nan_reward])     # TRL's spelling of None
    assert math.isnan(group.rewards[0]) and list(group.rewards[1:]) == [1.0, 2.0]
    assert samples[0].advantage == 0.0 and metrics["reward"] == 1.5
    with pytest.raises(ValueError, match=r"Counter.get_reward\(\) returned \[inf, None, None\]"):
        scored(tokenizer, h.group_of([None, 1.0, 2.0], env_rewards=[(h.Counter, math.inf), None,
                                                                   None]))
    with pytest.raises(ValueError, match=r"Rollout.reward returned \[-inf, 1.0, 2.0\]"):
        scored(tokenizer, h.group_of([-math.inf, 1.0, 2.0]))


def test_tool_rates_are_over_every_group_of_a_run_with_tools(tokenizer):
    """tools/call_frequency and tools/loop_exhausted_frac are per rollout: a group without a call
    counts (1 call in 2 groups of 2 rollouts: 0.25), in a run that offers tools."""
    loop = h.make_loop(tokenizer)
    call = ToolCall("add", 0.1, False, False, 0)
    groups = [h.group_of([0.0, 1.0], row={}, tool_calls=[[call], []]), h.group_of([0.0, 1.0])]
    per_group = [asyncio.run(score_group(g, [], loop.compute_advantages, loop.eos_token_ids,
                                         loop.num_top, offers_tools=True))[1] for g in groups]
    assert reduce_window(per_group)["tools/call_frequency"] == 0.25
    assert [m["tools/loop_exhausted_frac"] for m in per_group] == [0.0, 0.0]
    assert "tools/call_frequency" not in scored(tokenizer, h.group_of([0.0, 1.0]))[1]  # no tools


def test_a_reward_function_past_its_limit_is_named(tokenizer):
    async def stalled(prompts, completions, **kwargs):
        await asyncio.sleep(10)
    loop = h.make_loop(tokenizer)
    with pytest.raises(CallTimeout, match="stalled did not return within "
                                          "reward_tool_timeout=0.1s"):
        asyncio.run(score_group(h.group_of([None] * 3), [stalled], loop.compute_advantages,
                                loop.eos_token_ids, loop.num_top, limit=0.1))


def test_a_truncated_completion_counts_in_its_groups_baseline_and_trains_nothing(tokenizer):
    """mask_truncated_completions (DAPO's overlong filtering): the rollout cut before its end of
    turn keeps its reward in the group's mean and std, and gives no sample; off, it trains."""
    def group():
        g = h.group_of([0.0, 1.0, 2.0])
        g.rollouts[1].turns[-1].output_ids = [9, 9]                 # no end of turn: cut
        return g

    loop = h.make_loop(tokenizer)
    kept, _ = asyncio.run(score_group(group(), [], loop.compute_advantages, loop.eos_token_ids,
                                      loop.num_top))
    masked, metrics = asyncio.run(score_group(group(), [], loop.compute_advantages,
                                              loop.eos_token_ids, loop.num_top,
                                              mask_truncated=True))
    assert [s.reward for s in kept] == [0.0, 1.0, 2.0]
    assert [s.reward for s in masked] == [0.0, 2.0]
    assert [s.advantage for s in masked] == [kept[0].advantage, kept[2].advantage]   # same baseline
    assert metrics["completions/clipped_ratio"] == pytest.approx(1 / 3)


def test_pass_at_k_and_the_eval_line_replay_their_worked_examples():
    """pass_at's n = 4, c = 1 and eval_metrics' two prompts of four rollouts, by hand; a failed
    prompt is counted apart, an unscored reward never passes, what is not finite is left out."""
    import numpy as np

    from rollout.scoring import eval_metrics, pass_at
    assert [pass_at(4, 1, k) for k in (1, 2, 4)] == pytest.approx([0.25, 0.5, 1.0])
    assert pass_at(4, 0, 4) == 0.0 and pass_at(4, 4, 1) == 1.0

    def result(rewards, version, lengths=(2, 2, 2, 2)):
        return {"rewards": np.array(rewards), "columns": {"acc": np.array(rewards)},
                "lengths": list(lengths), "truncated": [False, False, False, True],
                "version": version}

    line = eval_metrics(10, [result([1, 0, 0, 0], 3), result([0, 0, 0, 0], 4), {"failed": True}],
                        pass_reward=1.0, seconds=2.5)
    assert line["step"] == 10 and line["eval/prompts"] == 2 and line["eval/failed_prompts"] == 1
    assert line["eval/reward"] == line["eval/rewards/acc/mean"] == pytest.approx(0.125)
    assert line["eval/pass@1"] == pytest.approx(0.125) and line["eval/pass@4"] == 0.5
    assert (line["eval/model_version_min"], line["eval/model_version_max"]) == (3, 4)
    assert line["eval/completions/clipped_ratio"] == 0.25 and line["eval/duration_s"] == 2.5
    unscored = eval_metrics(3, [result([np.nan, 1, np.nan, 0.5], 0)], pass_reward=1.0)
    assert unscored["eval/reward"] == pytest.approx(0.75) and unscored["eval/pass@1"] == 0.25
    nothing = eval_metrics(4, [{"failed": True}], pass_reward=1.0)
    assert nothing == {"step": 4, "eval/prompts": 0, "eval/failed_prompts": 1,
                       "eval/duration_s": 0.0}
