"""Admission by staleness (spec: 並行性 (Concurrency) and max_staleness in 概要 (Overview); the
rollout queue's backpressure in ロールアウトキュー (Rollout queue)).

The whole protocol between the two processes, in plain numbers: the trainer publishes where the
current version began and how fast it consumes; the rollout process admits a group only if every
sample it will yield is consumed before it goes stale.

    trainer (rollout_worker.py)                    rollout process (rollout/loop.py)
    ───────────────────────────                    ────────────────────────────
    get(): consumed += 1          ── consumed ──►  admits(queued, pending, scored, consumed,
    set_model_version(v):                                 version_start, rate, G, max_staleness)
      Window.new_version(v, consumed) ── C_v, R ─►   True: start the group's G rollouts
    get() on an empty queue:                         False: wait (rollout/admission_wait_s)
      Window.starved(consumed)    ── R ─────────►

    C_v  Window.version_start   samples consumed when version v began
    R    Window.rate            samples consumed per version (a prior until it is measured)

`admits` holds the derivation and a worked example; `Window.starved` the one case that raises R.

Departures from the spec (TRL generates whenever a slot is free and drops stale samples later):
- A group starts only if its samples can be consumed in time: nothing is generated to be dropped.
- A window smaller than one group would never admit it: the deadlock exception in `admits`.
- Time waiting for admission is rollout/admission_wait_s (ours), apart from the spec's
  rollout/backpressure_s, which counts only the time a full rollout queue blocks.
"""
from dataclasses import dataclass


def prior_rate(config, num_processes: int) -> int:
    """R before it is measured: the samples that one version's optimizer steps take."""
    return (config.per_device_train_batch_size * config.gradient_accumulation_steps
            * num_processes * config.weight_sync_steps)


@dataclass
class Window:
    """What the trainer publishes: its side of the protocol (ours; the spec has no such record)."""
    rate: float               # R: samples consumed per version
    version_start: int = 0    # C_v: samples consumed when the current version began
    anchor_version: int = 0   # the version from which R is measured ...
    anchor_consumed: int = 0  # ... and the samples consumed then

    def new_version(self, version: int, consumed: int) -> None:
        """After a weight sync: C_v = consumed, and R = samples per version since the anchor.

        The anchor moves while nothing has been consumed (the cold sync at start, a resume), so R
        counts only versions during which the trainer consumed. Example: anchor (0, 0); version 1
        with 0 consumed moves it to (1, 0); version 2 with 6 consumed: R = 6/1; version 4 with 16
        consumed: R = 16/3."""
        if consumed == self.anchor_consumed:
            self.anchor_version = version
        if version > self.anchor_version and consumed > self.anchor_consumed:
            self.rate = (consumed - self.anchor_consumed) / (version - self.anchor_version)
        self.version_start = consumed

    def starved(self, consumed: int) -> None:
        """The trainer waits on an empty queue, so this version consumes more samples than R
        assumed (token-budget rows take as many as fit): R > consumed − C_v. Raising R to that
        bound lets the rollout process admit the groups the trainer is waiting for.

        Worked example: G = 8, max_staleness = 4, prior R = 8, C_v = 0. Admission stops at 40
        samples (5 × 8); the planner needs ~64 to close one micro-batch, so the trainer starves at
        consumed = 40; R becomes 41, the window 5 × 41 = 205, and generation resumes."""
        self.rate = max(self.rate, consumed - self.version_start + 1)


def admits(*, queued: int, pending: int, scored: int, consumed: int, version_start: int,
           rate: float, num_generations: int, max_staleness: int) -> bool:
    """May a new group of G = num_generations rollouts start now? (the rollout process's side)

    queued: samples put on the rollout queue so far; pending: rollouts of admitted groups not yet
    scored; scored: rollouts scored or dropped so far; consumed, version_start (C_v) and rate (R):
    what the trainer published.

    Derivation. The trainer consumes samples in queue order, R per version, so sample number k
    (from 0, since the start) is consumed under version v + ⌊(k − C_v)/R⌋. A sample started now,
    under v or later, stays within max_staleness iff ⌊(k − C_v)/R⌋ ≤ max_staleness, that is
    k < C_v + (max_staleness + 1)·R. A new group's samples come after the queued ones and those
    the pending rollouts will yield. A rollout yields `yield` samples on average (forks raise it,
    dropped groups lower it; the prior, one per rollout, weighs as one group), so admit iff

        queued + yield·(pending + G) ≤ C_v + (max_staleness + 1)·R,
        yield = (queued + G) / (scored + G).

    Deadlock exception: when nothing is pending, every queued sample is consumed and the trainer
    still lacks samples for this version's steps (consumed < C_v + R), admit anyway: a window
    smaller than one group would otherwise stop the run.

    Worked example, G = 4, max_staleness = 1, R = 8: 8 rollouts scored gave 10 samples (one
    forked) and one group (4 rollouts) is pending. yield = (10 + 4)/(8 + 4) = 7/6, the left side
    10 + 7/6 · (4 + 4) = 19.33. Under version 0 (C_0 = 0) the right side is 0 + 2 · 8 = 16: wait.
    Once the trainer publishes version 1 with C_1 = 8 it is 8 + 16 = 24 ≥ 19.33: admitted.
    The exception, G = 8, max_staleness = 0, R = 4, nothing queued or pending: 0 + 1 · 8 > 0 + 4,
    but consumed = 0 < 0 + 4, so the group starts (else the trainer would wait forever).
    """
    expected_yield = (queued + num_generations) / (scored + num_generations)
    window_end = version_start + (max_staleness + 1) * rate
    if queued + expected_yield * (pending + num_generations) <= window_end:
        return True
    return pending == 0 and queued <= consumed < version_start + rate
