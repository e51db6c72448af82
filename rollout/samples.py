"""Rollout records, and how a rollout's turns become training samples (spec: the ROLLOUT → TURN →
reconcile → SEQUENCE → SAMPLE diagram of 記録されたメトリクス (Recorded metrics); the reference of
Rollout, TurnRecord and RolloutGroup).

Pure data and pure functions, a leaf: it imports nothing of ours. The rollout loop (rollout/loop.py)
calls them; the planner and the loss read `RolloutSample`, the only per-sample object that crosses
the process boundary. Each record says which of its fields are the spec's and which are ours.

    server reply ─ parse_completion / parse_generate ─► TurnRecord (one per sampling request)
    Rollout (its turns) ─ reconcile ─► TrainingSequence(s), held in a FinishedRollout slot
    PendingGroup (G slots) ─ build ─► RolloutGroup ─ scored (rollout/scoring.py) ─ to_sample ─►
    RolloutSample (a sequence + the group's advantage) ─► the rollout buffer

Reconcile and fork, a worked example. Each turn re-renders the whole conversation with the chat
template, so a later prompt need not start with the tokens the server sampled (E = end of turn,
t = tool result tokens):

    turn 1   prompt  u u a                      sampled  x y E
    turn 2   prompt  u u a x y' E t t a         sampled  z E    (the template re-rendered y as y')
    turn 3   prompt  u u a x y' E t t a z E t a sampled  w E

    held after turn 1:  u u a x y E     turn 2's prompt does not extend it: they agree on 4 tokens
                                        (u u a x), so the boundary is a fork with drift 6 - 4 = 2
    sequence 0   u u a x y E                     mask 0 0 0 1 1 1
    sequence 1   u u a x y' E t t a z E t a w E  mask 0 0 0 0 0  0 0 0 0 1 1 0 0 1 1  (turn 3: +)

    rollout/fork_frac = 1/2, rollout/drift_tokens_mean = (2 + 0)/2, rollout/samples_per_rollout = 2.
    Both sequences share `u u a x`, which the trainer's prefix trie forwards once.

Departures from the spec: none in its fields; those marked ours are additions (tool-call records,
the resume position, the sampler's top-k and candidate sets as arrays, what the metrics need).
"""
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np


# ── records ──────────────────────────────────────────────────────────────────────────────────


@dataclass
class TurnRecord:
    """One sampling request: the whole prompt sent to the server and what it sampled. All fields
    are the spec's."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None                    # 1 = train on the token, 0 = context
    output_sampling_mask: list[list[int]] | None = None     # per token: its candidate set
    output_sampler_logprobs: list[dict[int, float]] | None = None  # per token: sampler's top-k


@dataclass
class ToolCall:
    """One requested tool call (ours: the spec counts calls; the tools/ metrics need each one).
    `name` is None when the call did not parse (then `failed`); `unknown` when no tool has the
    name (not `failed`: no tool ran)."""
    name: str | None
    latency_s: float
    failed: bool
    unknown: bool
    turn_index: int


@dataclass
class Rollout:
    """One finished conversation, as `generate_one` returns it. Fields are the spec's unless
    marked ours."""
    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=lambda: secrets.token_hex(8))
    tool_calls: list[ToolCall] = field(default_factory=list)  # ours: each executed or refused call
    loop_exhausted: bool = False  # ours: still calling tools when max_tool_calling_iterations hit
    truncated: bool = False       # ours: its next turn found no room left in max_model_len


@dataclass
class TrainingSequence:
    """Token lists of one training sequence, built turn by turn by `reconcile`, entry t per token t
    (the spec names the class; its fields are ours)."""
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
        """The turn's sampled tokens; a masked one is context (no log-prob, top-k or candidates).
        One entry per mask entry: a shorter token, log-prob, top-k or candidate list is an
        IndexError."""
        n = len(turn.output_ids)
        mask = turn.output_mask if turn.output_mask is not None else [1] * n
        tops = turn.output_sampler_logprobs or [None] * n
        sets = turn.output_sampling_mask or [None] * n
        if min(n, len(turn.output_log_probs), len(tops), len(sets)) < len(mask):
            raise IndexError(f"a turn of {len(mask)} mask entries has {n} tokens, "
                             f"{len(turn.output_log_probs)} log-probs, {len(tops)} top-k and "
                             f"{len(sets)} candidate sets")
        self.input_ids += turn.output_ids[:len(mask)]
        self.completion_mask += mask
        if turn.output_mask is None:            # every token sampled (the common case): as is
            self.sampler_logprobs += turn.output_log_probs[:n]
            self.top_logprobs += tops[:n]
            self.candidates += sets[:n]
            return
        self.sampler_logprobs += [lp if m else 0.0 for lp, m in zip(turn.output_log_probs, mask)]
        self.top_logprobs += [top if m else None for top, m in zip(tops, mask)]
        self.candidates += [c if m else None for c, m in zip(sets, mask)]


@dataclass
class RolloutGroup:
    """The num_generations rollouts of one prompt, scored together; every list has one entry per
    rollout. Fields are the spec's unless marked ours."""
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
    environments: list[Any] | None = None  # ours: the rollouts' environments (reward kwarg)
    prompt_index: int = -1                                     # ours: place in the prompt stream
    rollouts: list[Rollout] = field(default_factory=list)      # ours: for the group's metrics
    stats: list[dict[str, Any]] = field(default_factory=list)  # ours: duration, drifts, env timings


@dataclass
class RolloutSample:
    """One training sequence with its group's advantage: the only per-sample object that crosses
    the queue (the spec's SAMPLE: "Sequence + group advantage + reward + metrics"; the other
    fields are ours).

    Every per-token array is aligned with `input_ids`: entry t describes the distribution that
    produced token t (predicted from position t-1). Context tokens (prompt, tool results, drifted
    history) have completion_mask 0, sampler log-prob 0 and no top-k/candidates.

        input_ids         p1 p2 p3 a1 a2          (L,)   int64
        completion_mask    0  0  0  1  1          (L,)   int8
        sampler_logprobs   0  0  0 -.3 -1.2     (L,)   float32  log π_sampler(input_ids[t] | [:t])
        top_ids           -1 -1 -1 [..k] [..k]  (L, k) int64    sampler's k likeliest at t (-1 pads)
        top_logprobs                             (L, k) float32  their log-probs (-inf pads)
        candidate_counts   0  0  0  c3 c4       (L,)   int32    size of t's candidate set (0: all)
        candidate_ids     [c3 ids | c4 ids]     (Σc,)  int32    candidate sets laid end to end
    """
    input_ids: np.ndarray                              # spec: the sequence
    completion_mask: np.ndarray                        # spec: the sequence
    sampler_logprobs: np.ndarray                       # spec: the sequence
    advantage: float                                   # spec: the group advantage
    group_id: int                                      # ours: the group it came from
    model_version: int                                 # ours: its staleness is measured from it
    top_ids: np.ndarray | None = None                  # ours: score centering
    top_logprobs: np.ndarray | None = None             # ours: score centering
    candidate_counts: np.ndarray | None = None         # ours: top-k/top-p renormalisation
    candidate_ids: np.ndarray | None = None            # ours: top-k/top-p renormalisation
    reward: float = float("nan")                       # spec
    metrics: dict[str, float] = field(default_factory=dict)  # spec
    prompt: list[dict[str, Any]] | None = None         # ours: for logging completions
    completion: list[dict[str, Any]] | None = None     # ours: for logging completions
    rollout_id: str = ""                               # ours: the rollout it came from
    row_index: int = -1                                # ours: the dataset row
    enqueued_at: float = 0.0                           # ours: sample/time_in_queue_s
    prompt_index: int = -1                             # ours: the resume index counts it


@dataclass
class FinishedRollout:
    """One slot of a pending group (ours): a rollout done generating and reconciled."""
    prompt: Any                           # as sent (with an environment's observation)
    rollout: Rollout
    sequences: list[TrainingSequence]     # reconcile(rollout.turns)
    env_reward: tuple[type, float] | None  # (environment class, get_reward()), if it has one
    stats: dict[str, Any]                 # duration_s, drifts, env/reset_s, env/reward_s
    environment: Any = None               # its environment_factory instance, if any


@dataclass(eq=False)
class PendingGroup:
    """A group while its rollouts run (ours): slots filled in any order, built into the spec's
    RolloutGroup once every rollout is done."""
    group_id: int
    row_index: int
    prompt_index: int
    row: dict
    size: int
    replica: Any = None             # the server its rollouts run on (servers.Replica)
    model_version: int = 0          # the version when the group's first rollout started
    done: set[int] = field(default_factory=set)
    failed: bool = False
    evaluation: int | None = None   # an eval prompt's group: the step that asked (never trained)
    result: dict | None = None      # ... and its figures once scored (scoring.eval_result)
    slots: list[FinishedRollout | None] = field(init=False)

    def __post_init__(self):
        self.slots = [None] * self.size

    def build(self, queued_at: float = 0.0) -> RolloutGroup:
        """The spec's RolloutGroup: one entry per rollout; the row's other columns as reward
        kwargs."""
        rollouts = [slot.rollout for slot in self.slots]
        reward_kwargs = {k: [v] * self.size for k, v in self.row.items() if k != "prompt"}
        return RolloutGroup(
            prompts=[slot.prompt for slot in self.slots], reward_kwargs=reward_kwargs,
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=[slot.sequences for slot in self.slots],
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=self.model_version, group_id=self.group_id, row_index=self.row_index,
            env_rewards=[slot.env_reward for slot in self.slots],
            rollout_rewards=[r.reward for r in rollouts], queued_at=queued_at,
            prompt_index=self.prompt_index, rollouts=rollouts,
            stats=[slot.stats for slot in self.slots],
            environments=[slot.environment for slot in self.slots]
            if self.slots[0].environment is not None else None)


# ── reconcile: turns → training sequences ────────────────────────────────────────────────────


def reconcile(turns: list[TurnRecord]) -> tuple[list[TrainingSequence], list[int]]:
    """Chain a rollout's turns into training sequences (the module docstring's worked example).

    A turn whose prompt starts with every token held so far continues the sequence (its new prompt
    tokens are context); any other turn forks: a new sequence starts from the re-rendered prompt.
    Returns the sequences that have a trained token, and per turn boundary the drift (held tokens
    the fork re-rendered; 0 for a clean boundary).
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
                # commonprefix compares any lists element by element, not only paths
                shared = os.path.commonprefix([held, turn.prompt_ids])   # lists both
                drifts.append(len(held) - len(shared))
            sequences.append(TrainingSequence())
            sequences[-1].add_context(list(turn.prompt_ids))
        sequences[-1].add_output(turn)
    return [s for s in sequences if any(s.completion_mask)], drifts


def to_sample(seq: TrainingSequence, num_top: int | None, **fields) -> RolloutSample:
    """Lay a sequence out as the numpy arrays of `RolloutSample` (top-k only given num_top)."""
    L = len(seq.input_ids)
    top_ids = top_lps = counts = cand = None
    if num_top is not None:
        top_ids = np.full((L, num_top), -1, dtype=np.int64)
        top_lps = np.full((L, num_top), -np.inf, dtype=np.float32)
        for t, top in enumerate(seq.top_logprobs):
            if top:
                best = top_k_of(top, num_top)
                top_ids[t, :len(best)] = list(best)
                top_lps[t, :len(best)] = list(best.values())
    if seq.candidates.count(None) < L:                  # some token has a candidate set
        counts = np.array([len(c) if c else 0 for c in seq.candidates], dtype=np.int32)
        cand = np.array([i for c in seq.candidates if c for i in c], dtype=np.int32)
    return RolloutSample(
        input_ids=np.array(seq.input_ids, dtype=np.int64),
        completion_mask=np.array(seq.completion_mask, dtype=np.int8),
        sampler_logprobs=np.array(seq.sampler_logprobs, dtype=np.float32),
        top_ids=top_ids, top_logprobs=top_lps, candidate_counts=counts, candidate_ids=cand,
        **fields)


# ── server replies → TurnRecord ──────────────────────────────────────────────────────────────

LOGPROB_SLACK = 1e-4  # a log-prob this far above 0 is float rounding (a near-certain token's)


def check_turn(turn: TurnRecord, model: str | None, asked: str, max_tokens: int,
               vocab_size: int, stop_ids: list[int] = ()) -> None:
    """ValueError unless a parsed reply can be trained on: one log-prob a token, at most
    max_tokens of them, each id in the tokenizer's vocabulary, each log-prob finite and <= 0 (up
    to LOGPROB_SLACK), no stop id (`stop_ids`, the run's EOS ids) but as the last token (the
    tokens after one would be trained as part of the turn, and the reward would see them glued
    to it), and the reply names the model (or adapter) asked for."""
    ids = np.asarray(turn.output_ids, dtype=np.int64)
    logprobs = np.asarray(turn.output_log_probs, dtype=np.float64)
    if len(logprobs) != len(ids) or len(ids) > max_tokens:
        raise ValueError(f"{len(ids)} tokens, {len(logprobs)} log-probs, max_tokens {max_tokens}")
    if model != asked:
        raise ValueError(f"the reply is from model {model!r}, not {asked!r} as asked")
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        raise ValueError(f"token ids {ids[outside].tolist()[:5]} lie outside the tokenizer's "
                         f"vocabulary of {vocab_size}")
    wrong = ~(np.isfinite(logprobs) & (logprobs <= LOGPROB_SLACK))
    if wrong.any():
        raise ValueError(f"log-probs {logprobs[wrong].tolist()[:5]} are not finite and <= 0")
    stops = np.flatnonzero(np.isin(ids[:-1], list(stop_ids)))
    if len(stops):
        raise ValueError(f"the reply goes on past stop token {ids[stops[0]]} at {stops[0]}")


def top_k_of(entries: dict[int, float], k: int) -> dict[int, float]:
    """The k likeliest of the server's entries (it lists the sampled token first, however
    unlikely)."""
    return dict(sorted(entries.items(), key=lambda kv: -kv[1])[:k])


def parse_completion(prompt_ids: list[int], reply: dict, num_top: int | None) -> TurnRecord:
    """/v1/completions (return_token_ids, return_tokens_as_token_ids, logprobs=k) → TurnRecord."""
    choice = reply["choices"][0]
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    tops = None
    if num_top is not None:
        tops = [top_k_of({int(key.removeprefix("token_id:")): lp for key, lp in d.items()}, num_top)
                for d in choice["logprobs"]["top_logprobs"]]
    return TurnRecord(list(prompt_ids), list(choice["token_ids"]), logprobs,
                      output_sampler_logprobs=tops)


def parse_generate(prompt_ids: list[int], reply: dict, num_top: int | None) -> TurnRecord:
    """/inference/v1/generate (tokens mode) → TurnRecord with the candidate set of every token."""
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    tops = None
    if num_top is not None:
        tops = [top_k_of({e["token_id"]: e["logprob"] for e in c["top_logprobs"]}, num_top)
                for c in content]
    logprobs = [float(c["logprob"]) for c in content]
    return TurnRecord(list(prompt_ids), list(choice["token_ids"]), logprobs,
                      output_sampling_mask=choice["sampling_mask"], output_sampler_logprobs=tops)
