"""rollout/staleness.py: the admission protocol with plain numbers (the docstrings' worked
examples)."""
import pytest

from config import AsyncGRPOConfig
from rollout.staleness import Window, admits, prior_rate

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)


def admits_now(**counts) -> bool:
    """admits() for G = 4, max_staleness = 1, R = 8, C_v = 0 unless `counts` say otherwise."""
    numbers = dict(queued=0, pending=0, consumed=0, version_start=0, rate=8, num_generations=4,
                   max_staleness=1, per_rollout=1.0)
    return admits(**(numbers | counts))


def test_the_worked_example_waits_for_forks_then_is_admitted_by_the_next_version():
    assert admits_now(pending=4)                            # one sample a rollout: 8 ≤ 16
    assert not admits_now(pending=4, per_rollout=3)         # 3 · (4 + 4) = 24 > 16
    assert admits_now(queued=12, per_rollout=3, consumed=8, version_start=8)  # 24 ≤ 8 + 16


def test_the_window_is_max_staleness_plus_one_versions_of_samples():
    assert admits_now(queued=12)                            # 12 + 1 · 4 = 16 ≤ 2 · 8
    assert not admits_now(queued=13)                        # 17 > 16
    assert admits_now(queued=13, max_staleness=2)


def test_until_a_rollout_has_finished_one_group_runs_at_a_time():
    assert admits_now(per_rollout=None)                     # the exception: nothing pending
    assert not admits_now(per_rollout=None, pending=4)      # a window of 16 would admit it at 1


def test_a_window_smaller_than_a_group_still_admits_when_the_trainer_waits():
    numbers = dict(num_generations=8, max_staleness=0, rate=4)
    assert admits_now(**numbers)                            # 8 > 4, but nothing pending or queued
    assert not admits_now(**numbers, pending=8)             # something is still coming
    assert not admits_now(**numbers, queued=8, consumed=4)  # 4 queued samples unread
    assert not admits_now(**numbers, queued=8, consumed=8)  # this version has its R = 4
    assert admits_now(**numbers, queued=8, consumed=8, version_start=5)  # 8 < 5 + 4


def test_the_prior_rate_is_one_versions_optimizer_steps():
    config = AsyncGRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             weight_sync_steps=3)
    assert prior_rate(config, num_processes=2) == 24


def test_the_rate_is_measured_from_consumption():
    window = Window(rate=8)
    window.new_version(1, consumed=0)       # the cold sync: nothing consumed, the prior stays
    assert (window.rate, window.version_start) == (8, 0)
    window.new_version(2, consumed=6)
    assert (window.rate, window.version_start) == (6, 6)
    window.stale()                          # a sample read and dropped: not trained
    window.stale()
    assert (window.rate, window.version_start, window.dropped) == (6, 8, 2)
    window.new_version(4, consumed=18)      # the docstring's example: 16 trained in 3 versions
    assert (window.rate, window.version_start) == (pytest.approx(16 / 3), 18)


def test_a_resumed_run_measures_from_its_first_version():
    window = Window(rate=8, anchor_version=5)
    window.new_version(6, consumed=4)
    assert window.rate == 4


def test_a_starved_trainer_raises_the_rate_past_what_it_consumed():
    window = Window(rate=8)                 # the starved() worked example: G 8, max_staleness 4
    window.starved(consumed=40)
    assert window.rate == 41
    window.starved(consumed=10)             # never lowered
    assert window.rate == 41
    window.new_version(1, consumed=64)      # measured again at the next sync
    assert window.rate == 64


def test_stale_drops_neither_raise_the_rate_nor_deadlock_a_starved_trainer():
    """A version of R = 4 whose first 6 samples read go stale: counted as consumption, the starved
    trainer would raise R to 7, widening the window past the fault that just happened; as
    admission's faults, R stays and C_v moves past them, so the deadlock exception still admits
    the group the waiting trainer needs."""
    window = Window(rate=4)
    for _ in range(6):
        window.stale()
    window.starved(consumed=6)
    assert (window.rate, window.version_start) == (4, 6)
    assert admits(queued=6, pending=0, consumed=6, version_start=window.version_start,
                  rate=window.rate, num_generations=8, max_staleness=0, per_rollout=1.0)
