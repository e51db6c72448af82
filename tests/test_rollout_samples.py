"""rollout/samples.py: reconcile and fork, the sample layout, server replies and their checks,
building a group."""
import math

import numpy as np
import pytest

from rollout.samples import (FinishedRollout, PendingGroup, Rollout, TurnRecord, check_turn,
                             parse_completion, parse_generate, reconcile, to_sample)

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)


def test_reconcile_clean_turns_make_one_sequence():
    turns = [TurnRecord([1, 2], [3, 4], [-0.1, -0.2]),
             TurnRecord([1, 2, 3, 4, 9], [5], [-0.3], output_mask=[1])]
    [seq], drifts = reconcile(turns)
    assert seq.input_ids == [1, 2, 3, 4, 9, 5]
    assert seq.completion_mask == [0, 0, 1, 1, 0, 1]
    assert seq.sampler_logprobs == [0, 0, -0.1, -0.2, 0, -0.3]
    assert drifts == [0]


def test_reconcile_forks_when_history_is_rerendered():
    # the docstring's example: y (=5) re-rendered as y' (=6)
    u, a, x, y, y2, E, t, z, w = 1, 2, 4, 5, 6, 7, 8, 9, 10
    turns = [TurnRecord([u, u, a], [x, y, E], [-1.0] * 3),
             TurnRecord([u, u, a, x, y2, E, t, t, a], [z, E], [-1.0] * 2),
             TurnRecord([u, u, a, x, y2, E, t, t, a, z, E, t, a], [w, E], [-1.0] * 2)]
    seqs, drifts = reconcile(turns)
    assert drifts == [2, 0]
    assert [s.input_ids for s in seqs] == [[u, u, a, x, y, E],
                                           [u, u, a, x, y2, E, t, t, a, z, E, t, a, w, E]]
    assert seqs[1].completion_mask == [0] * 9 + [1, 1, 0, 0, 1, 1]


def test_reconcile_drops_sequences_without_trained_tokens():
    turns = [TurnRecord([1], [2], [-1.0], output_mask=[0]), TurnRecord([9], [3], [-1.0])]
    seqs, drifts = reconcile(turns)
    assert [s.input_ids for s in seqs] == [[9, 3]] and drifts == [2]


def test_to_sample_aligns_arrays_with_input_ids():
    turn = TurnRecord([1, 2], [3, 4], [-0.1, -0.2], output_sampling_mask=[[3, 7], [4]],
                      output_sampler_logprobs=[{3: -0.1, 7: -2.0, 8: -3.0}, {4: -0.2}])
    [seq], _ = reconcile([turn])
    s = to_sample(seq, 2, advantage=1.0, group_id=0, model_version=3)
    assert s.input_ids.dtype == np.int64 and s.completion_mask.tolist() == [0, 0, 1, 1]
    assert s.top_ids.tolist() == [[-1, -1], [-1, -1], [3, 7], [4, -1]]
    assert s.top_logprobs[3, 1] == -np.inf and s.top_logprobs[2, 1] == pytest.approx(-2.0)
    assert s.candidate_counts.tolist() == [0, 0, 2, 1] and s.candidate_ids.tolist() == [3, 7, 4]
    assert to_sample(seq, None, advantage=1.0, group_id=0, model_version=0).top_ids is None


def test_parse_server_replies_keep_the_k_most_likely():
    top = {"token_id:5": -4.0, "token_id:1": -0.5, "token_id:2": -1.0}
    reply = {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-4.0],
                                                         "top_logprobs": [top]}}]}
    turn = parse_completion([1], reply, 2)
    assert turn.output_ids == [5] and turn.output_sampler_logprobs == [{1: -0.5, 2: -1.0}]
    content = [{"token_id": 5, "logprob": -0.7, "rank": 2,
                "top_logprobs": [{"token_id": 1, "logprob": -0.6, "rank": 1}]}]
    reply = {"choices": [{"token_ids": [5], "sampling_mask": [[1, 5]],
                          "logprobs": {"content": content}}]}
    turn = parse_generate([1], reply, 8)
    assert turn.output_log_probs == [-0.7] and turn.output_sampling_mask == [[1, 5]]


def test_a_pending_group_builds_the_specs_group_in_rollout_order():
    row = {"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}
    group = PendingGroup(group_id=7, row_index=3, prompt_index=11, row=row, size=2, model_version=4)
    for i in (1, 0):                                    # slots fill in any order
        turn = TurnRecord([1], [10 + i, 2], [-0.5, -0.5])
        rollout = Rollout([{"role": "assistant", "content": str(i)}], [10 + i, 2], [turn],
                          reward=float(i))
        group.slots[i] = FinishedRollout(row["prompt"], rollout, reconcile([turn])[0],
                                         None, {"duration_s": 1.0, "drifts": []})
    built = group.build(queued_at=5.0)
    assert built.completions_ids == [[10, 2], [11, 2]] and built.rollout_rewards == [0.0, 1.0]
    assert built.reward_kwargs == {"answer": ["2", "2"]}     # the row's other columns, per rollout
    assert (built.group_id, built.row_index, built.prompt_index) == (7, 3, 11)
    assert built.model_version == 4 and built.queued_at == 5.0


def test_check_turn_refuses_what_cannot_be_trained_on():
    """Ids in the vocabulary, log-probs finite and <= 0 up to LOGPROB_SLACK (rounding: 5e-5 passes,
    2e-4 fails), the model asked for, one log-prob a token, no more than max_tokens, and a stop
    id (2 or 3 here) only as the last token: the tokens after one would be trained."""
    def check(ids=(5, 6), logprobs=(-1.0, 5e-5), model="policy-v3", max_tokens=4):
        check_turn(TurnRecord([1], list(ids), list(logprobs)), model, "policy-v3", max_tokens,
                   vocab_size=10, stop_ids=[2, 3])
    check()
    check(ids=(5, 3), logprobs=(-1.0, -1.0))                       # the turn ends on one
    for bad, message in [(dict(ids=(2, 6)), "the reply goes on past stop token 2 at 0"),
                         (dict(ids=(5, 3, 3), logprobs=(-1.0,) * 3),
                          "the reply goes on past stop token 3 at 1"),
                         (dict(ids=(5, 10)), r"token ids \[10\] lie outside the tokenizer's "
                                             "vocabulary of 10"),
                         (dict(ids=(-1, 6)), r"token ids \[-1\]"),
                         (dict(logprobs=(-1.0, 2e-4)), r"log-probs \[0.0002\] are not finite"),
                         (dict(logprobs=(math.nan, -1.0)), r"log-probs \[nan\]"),
                         (dict(logprobs=(-math.inf, -1.0)), r"log-probs \[-inf\]"),
                         (dict(model="base"), "the reply is from model 'base', not 'policy-v3'"),
                         (dict(logprobs=(-1.0,)), "2 tokens, 1 log-probs"),
                         (dict(max_tokens=1), "max_tokens 1")]:
        with pytest.raises(ValueError, match=message):
            check(**bad)
