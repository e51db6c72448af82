"""rollout/staleness.py: the admission protocol with plain numbers (the docstrings' worked
examples)."""
import pytest

from config import AsyncGRPOConfig
from rollout.staleness import Window, admits, prior_rate


def admits_now(**counts) -> bool:
    """admits() for G = 4, max_staleness = 1, R = 8, C_v = 0 unless `counts` say otherwise."""
    numbers = dict(queued=0, pending=0, scored=0, consumed=0, version_start=0, rate=8,
                   num_generations=4, max_staleness=1)
    return admits(**(numbers | counts))


def test_the_worked_example_waits_then_is_admitted_by_the_next_version():
    counts = dict(queued=10, pending=4, scored=8)          # left side: 10 + 7/6 · 8 = 19.33
    assert not admits_now(**counts)                         # right side under version 0: 16
    assert admits_now(**counts, consumed=8, version_start=8)  # version 1, C_1 = 8: 24


def test_the_window_is_max_staleness_plus_one_versions_of_samples():
    assert admits_now(queued=12, scored=12)                 # 12 + 1 · 4 = 16 ≤ 2 · 8
    assert not admits_now(queued=13, scored=13)             # 17 > 16
    assert admits_now(queued=13, scored=13, max_staleness=2)


def test_a_window_smaller_than_a_group_still_admits_when_the_trainer_waits():
    numbers = dict(num_generations=8, max_staleness=0, rate=4)
    assert admits_now(**numbers)                            # 8 > 4, but nothing pending or queued
    assert not admits_now(**numbers, pending=8)             # something is still coming
    assert not admits_now(**numbers, queued=8, scored=8, consumed=4)  # 4 queued samples unread
    assert not admits_now(**numbers, queued=8, scored=8, consumed=8)  # this version has its R = 4
    assert admits_now(**numbers, queued=8, scored=8, consumed=8, version_start=5)  # 8 < 5 + 4


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
    window.new_version(4, consumed=16)
    assert (window.rate, window.version_start) == (pytest.approx(16 / 3), 16)


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
