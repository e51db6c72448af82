"""Rank 0 acts, every rank raises together: how the trainer's ranks share what only rank 0 does
(it alone talks to the vLLM servers) without leaving a rank waiting in a collective.

Spec: 概要 (Overview: weight_sync_steps), the sync every rank takes part in (FSDP2's gathers are
collectives) while one process drives the servers:

    rank 0                                  rank 1 .. n-1
    fn() → value, or its error              (waits)
    broadcast [error said, its kind] ─────► the same message
    raises, or goes on                      raises the same, or goes on

Departures from the spec, one line each:
- None: the spec does not say how the ranks share rank 0's outcome.
"""
from typing import Callable

import torch.distributed as dist


def agree(error: BaseException | None, failed: str | None = None,
          kind: type[Exception] = RuntimeError) -> None:
    """One collective: rank 0's failure (`error`, or None; the other ranks pass None) reaches
    every rank, and all raise together, or none does. With `failed`, every rank raises
    kind("<failed>: <the error>"), rank 0's `kind`; without, rank 0 raises the error itself and
    the others a RuntimeError("rank 0 stopped: <the error>")."""
    said, kind = from_rank0([None if error is None else f"{type(error).__name__}: {error}", kind])
    if said is not None and (error is None or failed is not None):
        raise kind(f"{failed or 'rank 0 stopped'}: {said}") from error
    if said is not None:
        raise error


def on_rank0(fn: Callable[[], object], failed: str | None = None):
    """fn() on rank 0, and its failure (or none) raised on every rank together (agree, with
    `failed`); its value on rank 0, None on the others."""
    value, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            value = fn()
        except Exception as e:                  # noqa: BLE001 (raised by agree, on every rank)
            error = e
    agree(error, failed)
    return value


def from_rank0(value):
    """Rank 0's `value` on every rank (a picklable object; the other ranks pass anything)."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]
