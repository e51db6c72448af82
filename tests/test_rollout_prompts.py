"""rollout/prompts.py: the prompt stream (epochs, resume, streaming, the shuffled order),
filter_prompt's epoch rule, and the resume index."""
import pytest
from datasets import IterableDataset

import toy
from config import AsyncGRPOConfig
from rollout.prompts import ResumeIndex, filtered_stream, first_prompt_index, prompt_stream

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)


def test_prompt_stream_epochs_resume_and_streaming():
    ds = toy.make_dataset(4)
    assert [(i, e, r) for i, e, r, _ in prompt_stream(ds, 0, 1.5, -1)] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 1, 0), (5, 1, 1)]
    assert [(i, e, r) for i, e, r, _ in prompt_stream(ds, 6, 2, -1)] == [(6, 1, 2), (7, 1, 3)]
    endless = prompt_stream(ds, 0, 1, max_steps=10)
    assert len([next(endless) for _ in range(9)]) == 9
    stream = IterableDataset.from_generator(lambda: ({"prompt": str(i)} for i in range(3)))
    assert [(i, e, r) for i, e, r, _ in prompt_stream(stream, 2, 2, -1)] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    with pytest.raises(ValueError, match="empty"):  # not a busy loop that starves the heartbeat
        next(prompt_stream(EmptyStream(), 0, 1, max_steps=10))


def rows(config, start=0):
    """The rows of two epochs over 16 prompts, from prompt `start`, in `config`'s order."""
    stream = prompt_stream(toy.make_dataset(16), start, 2, -1, config.shuffle_seed())
    return [row_index for _, _, row_index, _ in stream]


def test_random_sampling_shuffles_each_epoch_reproducibly_and_a_resume_keeps_the_order():
    default = rows(AsyncGRPOConfig())                  # data_seed None: seeded by seed (42)
    assert sorted(default[:16]) == sorted(default[16:]) == list(range(16))
    assert list(range(16)) != default[:16] != default[16:]       # shuffled, each epoch anew
    assert rows(AsyncGRPOConfig(seed=42)) == default
    assert rows(AsyncGRPOConfig(seed=7)) != default
    assert rows(AsyncGRPOConfig(seed=7, data_seed=42)) == default             # data_seed wins
    assert rows(AsyncGRPOConfig(), start=5) == default[5:]        # a resume: the same order on
    assert rows(AsyncGRPOConfig(), start=21) == default[21:]
    assert rows(AsyncGRPOConfig(train_sampling_strategy="sequential")) == list(range(16)) * 2


class EmptyStream:
    """A streaming dataset (no len) without rows; a third pass over it means the stream spins."""
    passes = 0

    def __iter__(self):
        self.passes += 1
        assert self.passes < 3, "prompt_stream keeps re-reading an empty stream"
        return iter([])


def first_two_rows(row_index, row, epoch) -> bool:
    return row_index < 2


def no_row(row_index, row, epoch) -> bool:
    return False


def test_a_resumed_epoch_is_not_rejected_for_its_missing_part():
    """Resuming after an epoch's last accepted prompt: the rest rejected is not 'every prompt
    rejected'; an epoch seen whole and rejected whole raises."""
    resumed = filtered_stream(prompt_stream(toy.make_dataset(4), 2, 1, -1), first_two_rows)
    assert [(i, accepted) for i, _, _, _, accepted in resumed] == [(2, False), (3, False)]
    whole = filtered_stream(prompt_stream(toy.make_dataset(4), 0, 1, -1), no_row)
    with pytest.raises(RuntimeError, match="rejected every prompt of epoch 0"):
        list(whole)
    two_epochs = filtered_stream(prompt_stream(toy.make_dataset(4), 0, 2, -1), first_two_rows)
    assert sum(accepted for *_, accepted in two_epochs) == 4


def test_a_shuffled_epoch_is_judged_by_where_the_stream_starts_not_by_its_first_row():
    """The default order is shuffled, so an epoch's first row is rarely row 0: an epoch rejected
    whole still raises, a later epoch too, and a resume whose first row is row 0 does not."""
    rows = toy.make_dataset(4)
    for seed in range(8):
        with pytest.raises(RuntimeError, match="rejected every prompt of epoch 0"):
            list(filtered_stream(prompt_stream(rows, 0, 1, -1, shuffle_seed=seed), no_row))

    def only_epoch_0(row_index, row, epoch) -> bool:
        return epoch == 0
    with pytest.raises(RuntimeError, match="rejected every prompt of epoch 1"):
        list(filtered_stream(prompt_stream(rows, 0, 2, -1, shuffle_seed=3), only_epoch_0))
    landing_on_row_0 = [seed for seed in range(32)      # resumed at prompt 1, first row 0
                        if next(prompt_stream(rows, 1, 1, -1, shuffle_seed=seed))[2] == 0]
    assert landing_on_row_0
    for seed in landing_on_row_0:
        verdicts = list(filtered_stream(prompt_stream(rows, 1, 1, -1, shuffle_seed=seed), no_row))
        assert [v[-1] for v in verdicts] == [False] * 3


def test_resume_index_counts_handed_out_dropped_and_filtered_prompts():
    resume = ResumeIndex(3)
    for index, samples in ((3, 2), (4, 0), (5, 1)):
        resume.announce(index, samples)
    assert resume.value() == 3
    resume.handed_out(3)
    assert resume.value() == 3        # prompt 3 still has a sample in the queue
    resume.handed_out(3)
    assert resume.value() == 5        # 4 was dropped or filtered: it counts as done
    resume.handed_out(5)
    assert resume.value() == 6


def test_the_resume_state_counts_held_samples_as_untrained_and_a_resume_skips_the_trained():
    """The module docstring's example: a group split across the checkpoint's step (one sample of
    3 in an open row) and a later prompt trained whole before an earlier one finished."""
    resume = ResumeIndex(3)
    for index, samples in ((3, 2), (4, 0), (5, 1)):
        resume.announce(index, samples)
    assert [resume.handed_out(p) for p in (3, 3, 5)] == [True] * 3
    saved = resume.state(held=[3])
    assert saved == {"prompt_index": 3, "trained": {3: 1, 5: 1}}
    assert resume.state(held=[]) == {"prompt_index": 6, "trained": {}}     # prunes behind it
    resumed = ResumeIndex(3, trained={"3": 1, "5": 1})                   # as read from JSON
    for index, samples in ((3, 2), (4, 0), (5, 1)):     # generated again (3 is split, 5 trained)
        resumed.announce(index, samples)
    assert [resumed.handed_out(p) for p in (3, 5, 3)] == [False, False, True]
    assert resumed.value() == 6 and resumed.state(held=[]) == {"prompt_index": 6, "trained": {}}
    early = ResumeIndex(3, trained={3: 1, 5: 1})    # a checkpoint before any sample came back
    assert early.state(held=[]) == {"prompt_index": 3, "trained": {3: 1, 5: 1}}


def test_a_sample_handed_out_before_its_prompt_is_announced_counts():
    resume = ResumeIndex(0)
    resume.handed_out(0)              # the progress message may arrive after the sample
    assert resume.value() == 0
    resume.announce(0, 1)
    assert resume.value() == 1


def test_the_first_prompt_index_is_the_start_unless_the_dataset_streams():
    streaming = (row for row in [{"prompt": "a"}])                  # no len: cannot be repositioned
    assert first_prompt_index([{"prompt": "a"}] * 8, 5) == 5
    assert first_prompt_index(None, 5) == 5                         # an environment's prompts
    assert first_prompt_index(streaming, 5) == 0
    assert next(prompt_stream(streaming, 5, 1, 0))[0] == 0          # where the stream starts too
