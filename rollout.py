"""The rollout process (spec: 概要, 並行性, ロールアウトループのカスタマイズ, ロールアウト/補完/ツール/環境).

(skeleton: the records below are the contract between the rollout process, the planner and the loss;
the process itself is being written.)
"""
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TurnRecord:
    """One sampling request: the whole prompt sent to the server and what it sampled."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None                           # 1 = train on the token, 0 = context only
    output_sampling_mask: list[list[int]] | None = None            # per token: the candidate set it was drawn from
    output_sampler_logprobs: list[dict[int, float]] | None = None  # per token: the sampler's top log-probs


@dataclass
class Rollout:
    """One finished conversation, as `generate_one` returns it."""
    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=lambda: secrets.token_hex(8))


@dataclass
class RolloutSample:
    """One training sequence with its group's advantage: the only per-sample object that crosses the queue.

    Every per-token array is aligned with `input_ids`: entry t describes the distribution that
    produced token t (predicted from position t-1). Context tokens (prompt, tool results, drifted
    history) have completion_mask 0, sampler log-prob 0 and no top-k/candidates.

        input_ids         p1 p2 p3 a1 a2          (L,)   int64
        completion_mask    0  0  0  1  1          (L,)   int8
        sampler_logprobs   0  0  0 -.3 -1.2       (L,)   float32   log π_sampler(input_ids[t] | input_ids[:t])
        top_ids           -1 -1 -1 [..k] [..k]    (L, k) int64     sampler's k most likely tokens at t (-1 pads)
        top_logprobs                               (L, k) float32   their sampler log-probs (-inf pads)
        candidate_counts   0  0  0  c3 c4         (L,)   int32     size of token t's candidate set (0 = vocabulary)
        candidate_ids     [c3 ids | c4 ids]       (Σc,)  int32     candidate sets laid end to end
    """
    input_ids: np.ndarray
    completion_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantage: float
    group_id: int
    model_version: int
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    candidate_counts: np.ndarray | None = None
    candidate_ids: np.ndarray | None = None
    reward: float = float("nan")
    metrics: dict[str, float] = field(default_factory=dict)
    prompt: list[dict[str, Any]] | None = None
    completion: list[dict[str, Any]] | None = None
    rollout_id: str = ""
    row_index: int = -1
    enqueued_at: float = 0.0
