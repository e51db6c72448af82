"""Rollout records, and how a rollout's turns become training samples (spec: the ROLLOUT → TURN →
reconcile → SEQUENCE → SAMPLE diagram of 記録されたメトリクス, and the Rollout / TurnRecord / RolloutGroup
reference).

Pure data and pure functions: no asyncio, no server, no process. The rollout loop (rollout.py) calls
them; the planner and the loss read `RolloutSample`, the only per-sample object that crosses the
process boundary, without importing the loop.

    server reply ──parse_completion / parse_generate──► TurnRecord ─┐  (one per sampling request)
                                                                    ├─ reconcile ─► TrainingSequence(s)
    Rollout.turns ──────────────────────────────────────────────────┘        │
                                                    to_sample(+ group advantage) ▼
                                                                    RolloutSample ──► rollout buffer

Reconcile and fork (spec: the ROLLOUT → TURN → reconcile → SEQUENCE diagram). Each turn re-renders the
whole conversation with the chat template, so a later prompt need not start with the tokens the server
actually sampled. A worked example (E = end of turn, t = tool result tokens):

    turn 1   prompt  u u a                      sampled  x y E
    turn 2   prompt  u u a x y' E t t a         sampled  z E    (the template re-rendered y as y')
    turn 3   prompt  u u a x y' E t t a z E t a sampled  w E

    held after turn 1:  u u a x y E     turn 2's prompt does not extend it: they agree on 4 tokens
                                        (u u a x), so the boundary is a fork with drift 6 - 4 = 2
    sequence 0   u u a x y E                     mask 0 0 0 1 1 1
    sequence 1   u u a x y' E t t a z E t a w E  mask 0 0 0 0 0  0 0 0 0 1 1 0 0 1 1   (turn 3 extends it)

    rollout/fork_frac = 1/2, rollout/drift_tokens_mean = (2 + 0)/2, rollout/samples_per_rollout = 2.
    Both sequences share `u u a x`, which the trainer's prefix trie forwards once.
"""
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_tools import ToolCall


# ── records ──────────────────────────────────────────────────────────────────────────────────


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
    tool_calls: list[ToolCall] = field(default_factory=list)  # one record per executed (or refused) call
    loop_exhausted: bool = False  # still asking for tools when max_tool_calling_iterations stopped it


@dataclass
class TrainingSequence:
    """Token lists of one training sequence, built turn by turn by `reconcile` (per token t)."""
    input_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    candidates: list[list[int] | None] = field(default_factory=list)

    def add_context(self, ids: list[int]) -> None:
        self.input_ids += ids
        self.completion_mask += [0] * len(ids)
        self.sampler_logprobs += [0.0] * len(ids)
        self.top_logprobs += [None] * len(ids)
        self.candidates += [None] * len(ids)

    def add_output(self, turn: TurnRecord) -> None:
        n = len(turn.output_ids)
        mask = turn.output_mask if turn.output_mask is not None else [1] * n
        tops = turn.output_sampler_logprobs or [None] * n
        sets = turn.output_sampling_mask or [None] * n
        for t, m in enumerate(mask):  # a masked output token is context: no log-prob, no top-k, no candidates
            self.input_ids.append(turn.output_ids[t])
            self.completion_mask.append(m)
            self.sampler_logprobs.append(turn.output_log_probs[t] if m else 0.0)
            self.top_logprobs.append(tops[t] if m else None)
            self.candidates.append(sets[t] if m else None)


@dataclass
class RolloutGroup:
    """The num_generations rollouts of one prompt, scored together; every list has one entry per rollout."""
    prompts: list[Any]
    reward_kwargs: dict[str, list[Any]]
    completions: list[Any]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    prompt_index: int = -1                                         # position in the prompt stream (resume)
    rollouts: list[Rollout] = field(default_factory=list)          # for the rollout/, completions/, tools/ metrics
    stats: list[dict[str, Any]] = field(default_factory=list)      # per rollout: duration, drift, env timings


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
    prompt_index: int = -1  # position in the prompt stream: RolloutWorker.resume_index() counts these


# ── reconcile: turns → training sequences ────────────────────────────────────────────────────


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reconcile(turns: list[TurnRecord]) -> tuple[list[TrainingSequence], list[int]]:
    """Chain a rollout's turns into training sequences (see the module docstring's worked example).

    A turn whose prompt starts with every token held so far continues the sequence (its new prompt
    tokens are context); any other turn forks: a new sequence starts from the re-rendered prompt.
    Returns the sequences that have a trained token, and per turn boundary the drift (held tokens the
    fork re-rendered; 0 for a clean boundary).
    """
    sequences: list[TrainingSequence] = []
    drifts: list[int] = []
    for turn in turns:
        held = sequences[-1].input_ids if sequences else None
        if held is not None and turn.prompt_ids[:len(held)] == held:
            drifts.append(0)
            sequences[-1].add_context(turn.prompt_ids[len(held):])
        else:
            if held is not None:
                drifts.append(len(held) - common_prefix(held, turn.prompt_ids))
            sequences.append(TrainingSequence())
            sequences[-1].add_context(list(turn.prompt_ids))
        sequences[-1].add_output(turn)
    return [s for s in sequences if any(s.completion_mask)], drifts


def to_sample(seq: TrainingSequence, num_top: int | None, **fields) -> RolloutSample:
    """Lay a sequence out as the numpy arrays of `RolloutSample` (top-k only when num_top is given)."""
    L = len(seq.input_ids)
    top_ids = top_lps = counts = cand = None
    if num_top is not None:
        top_ids = np.full((L, num_top), -1, dtype=np.int64)
        top_lps = np.full((L, num_top), -np.inf, dtype=np.float32)
        for t, top in enumerate(seq.top_logprobs):
            for j, (token, lp) in enumerate(sorted((top or {}).items(), key=lambda kv: -kv[1])[:num_top]):
                top_ids[t, j], top_lps[t, j] = token, lp
    if any(c is not None for c in seq.candidates):
        counts = np.array([len(c) if c else 0 for c in seq.candidates], dtype=np.int32)
        cand = np.array([i for c in seq.candidates if c for i in c], dtype=np.int32)
    return RolloutSample(
        input_ids=np.array(seq.input_ids, dtype=np.int64),
        completion_mask=np.array(seq.completion_mask, dtype=np.int8),
        sampler_logprobs=np.array(seq.sampler_logprobs, dtype=np.float32),
        top_ids=top_ids, top_logprobs=top_lps, candidate_counts=counts, candidate_ids=cand, **fields)


# ── server replies → TurnRecord ──────────────────────────────────────────────────────────────


def top_k_of(entries: dict[int, float], k: int) -> dict[int, float]:
    """The k most likely of the server's entries (it lists the sampled token first, even if unlikely)."""
    return dict(sorted(entries.items(), key=lambda kv: -kv[1])[:k])


def parse_completion(prompt_ids: list[int], reply: dict, num_top: int | None) -> TurnRecord:
    """/v1/completions (return_token_ids, return_tokens_as_token_ids, logprobs=k) → TurnRecord."""
    choice = reply["choices"][0]
    ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    tops = None
    if num_top is not None:
        tops = [top_k_of({int(key.removeprefix("token_id:")): lp for key, lp in d.items()}, num_top)
                for d in choice["logprobs"]["top_logprobs"]]
    return TurnRecord(list(prompt_ids), list(ids), [float(x) for x in lps], output_sampler_logprobs=tops)


def parse_generate(prompt_ids: list[int], reply: dict, num_top: int | None) -> TurnRecord:
    """/inference/v1/generate (tokens mode) → TurnRecord with the candidate set of every token."""
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    tops = None
    if num_top is not None:
        tops = [top_k_of({e["token_id"]: e["logprob"] for e in c["top_logprobs"]}, num_top) for c in content]
    return TurnRecord(list(prompt_ids), list(choice["token_ids"]), [float(c["logprob"]) for c in content],
                      output_sampling_mask=choice["sampling_mask"], output_sampler_logprobs=tops)
