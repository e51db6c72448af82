"""Admission by staleness (spec: 並行性 (Concurrency) and max_staleness in 概要 (Overview); the
rollout queue's backpressure in ロールアウトキュー (Rollout queue)).

The whole protocol between the two processes, in plain numbers: the trainer publishes where the
current version began and how fast it consumes; the rollout process admits a group only if every
sample it will yield is consumed before it goes stale.

    trainer (rollout/worker.py)                    rollout process (rollout/loop.py)
    ───────────────────────────                    ────────────────────────────
    get(): consumed += 1          ── consumed ──►  admits(queued, pending, consumed, version_start,
    set_model_version(v):                                 rate, G, max_staleness, per_rollout)
      Window.new_version(v, consumed) ── C_v, R ─►   True: start the group's G rollouts
    a sample dropped as stale:                       False: wait (rollout/admission_wait_s)
      Window.stale()              ── C_v ───────►  per_rollout: samples per finished rollout
    get() on an empty queue:                         (rollout/samples_per_rollout; forks raise it)
      Window.starved(consumed)    ── R ─────────►

    C_v  Window.version_start   samples consumed when version v began, plus those dropped since
    R    Window.rate            samples trained per version (a prior until it is measured)

`admits` holds the derivation and a worked example; `Window.starved` the one case that raises R.

Departures from the spec (TRL generates whenever a slot is free and drops stale samples later):
- A group starts only if its samples can be consumed in time: nothing is generated to be dropped.
- A window smaller than one group would never admit it: the deadlock exception in `admits`.
- Until a rollout has finished its yield is unknown: one group at a time (the same exception).
- A stale drop is admission's fault, not consumption: it neither raises R nor stays in the window.
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
    rate: float               # R: samples trained per version
    version_start: int = 0    # C_v: samples consumed when the current version began (+ dropped)
    anchor_version: int = 0   # the version from which R is measured ...
    anchor_trained: int = 0   # ... and the samples trained then
    dropped: int = 0          # samples consumed but dropped as stale: never trained

    def new_version(self, version: int, consumed: int) -> None:
        """After a weight sync: C_v = consumed, and R = samples trained per version since the
        anchor (trained: consumed less the stale drops).

        The anchor moves while nothing has been trained (the cold sync at start, a resume), so R
        counts only versions during which the trainer trained. Example: anchor (0, 0); version 1
        with 0 consumed moves it to (1, 0); version 2 with 6 consumed: R = 6/1; version 4 with 18
        consumed of which 2 dropped as stale: R = 16/3."""
        trained = consumed - self.dropped
        if trained == self.anchor_trained:
            self.anchor_version = version
        if version > self.anchor_version and trained > self.anchor_trained:
            self.rate = (trained - self.anchor_trained) / (version - self.anchor_version)
        self.version_start = consumed

    def stale(self) -> None:
        """A sample read from the queue was dropped as stale. It took none of the version's steps,
        so the samples behind it are trained as if it had never been queued: C_v moves past it,
        and R (trained samples) does not count it. Counting it as consumption instead would widen
        the window after each fault (starved: R > consumed − C_v), and admit more to go stale."""
        self.dropped += 1
        self.version_start += 1

    def starved(self, consumed: int) -> None:
        """The trainer waits on an empty queue, so this version consumes more samples than R
        assumed (token-budget rows take as many as fit): R > consumed − C_v. Raising R to that
        bound lets the rollout process admit the groups the trainer is waiting for.

        Worked example: G = 8, max_staleness = 4, prior R = 8, C_v = 0. Admission stops at 40
        samples (5 × 8); the planner needs ~64 to close one micro-batch, so the trainer starves at
        consumed = 40; R becomes 41, the window 5 × 41 = 205, and generation resumes."""
        self.rate = max(self.rate, consumed - self.version_start + 1)


def admits(*, queued: int, pending: int, consumed: int, version_start: int, rate: float,
           num_generations: int, max_staleness: int, per_rollout: float | None) -> bool:
    """May a new group of G = num_generations rollouts start now? (the rollout process's side)

    queued: samples put on the rollout queue so far; pending: rollouts of admitted groups not yet
    scored; consumed, version_start (C_v) and rate (R): what the trainer published; per_rollout:
    samples a finished rollout yielded on average (None: none has finished).

    Derivation. The trainer reads samples in queue order and trains R per version, so sample
    number k (from 0, since the start) is trained under version v + ⌊(k − C_v)/R⌋ (a stale drop
    moves C_v past itself). A sample started now, under v or later, stays within max_staleness iff
    ⌊(k − C_v)/R⌋ ≤ max_staleness, that is k < C_v + (max_staleness + 1)·R. A new group's samples
    come after the queued ones and those the pending rollouts will yield, per_rollout each
    (forks raise it above 1; a dropped group yields none, so assuming every group is kept errs
    on the safe side). So admit iff

        queued + per_rollout·(pending + G) ≤ C_v + (max_staleness + 1)·R.

    Deadlock exception: when nothing is pending, every queued sample is consumed and the trainer
    still lacks samples for this version's steps (consumed < C_v + R), admit anyway: a window
    smaller than one group would otherwise stop the run. Before any rollout has finished,
    per_rollout is unknown and only this exception admits: one group at a time, so a first window
    of forking rollouts is not filled at one sample a rollout.

    Worked example, G = 4, max_staleness = 1, R = 8, rollouts forking into 3 samples: one group
    pending, one of its rollouts finished (per_rollout = 3). 0 + 3 · (4 + 4) = 24 > 0 + 2 · 8 =
    16: wait (at one sample a rollout, 8 ≤ 16 would start it, and 8 of its 12 samples go stale).
    Once the first group is queued (12) and the trainer, having trained 8 of them, publishes
    version 1 with C_1 = 8: 12 + 3 · 4 = 24 ≤ 8 + 16, admitted; its samples 12 to 23 are trained
    under versions 1 and 2.
    The exception, G = 8, max_staleness = 0, R = 4, nothing queued or pending: nothing finished
    yet, but consumed = 0 < 0 + 4, so the group starts (else the trainer would wait forever).
    """
    window_end = version_start + (max_staleness + 1) * rate
    fits = per_rollout is not None and (
        queued + per_rollout * (pending + num_generations) <= window_end)
    return fits or pending == 0 and queued <= consumed < version_start + rate
