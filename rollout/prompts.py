"""The prompts of a run, in order, and where a resume starts (spec: チェックポイントと再開 (Checkpoints
and resuming); train_dataset / environment_factory of AsyncGRPOTrainer; filter_prompt of
ロールアウトループのカスタマイズ (Customising the rollout loop)).

    dataset of 4 rows, num_train_epochs 1.5, resumed at prompt 3:
    prompt_index  3  4  5        epoch = prompt_index // 4, row = prompt_index % 4
    epoch         0  1  1        the stream ends at ceil(1.5 × 4) = 6 prompts (max_steps > 0: never)
    row_index     3  0  1

    prompt_stream ─► filtered_stream (filter_prompt; an epoch it rejects whole raises) ─► the loop
    the loop announces (prompt_index, samples) ─► ResumeIndex ◄─ the trainer takes each sample
    ResumeIndex.state(): the first prompt not fully trained and what later prompts trained
    already, what rollout_state.json stores (a resume trains each prompt's samples exactly once)

prompt_index counts prompts (not samples), so a saved resume index also restores the epoch.
Departures from the spec, one line each (as it says, a streaming dataset restarts at prompt 0):
- rollout_state.json also holds "trained": samples of prompts past prompt_index trained already.
- max_steps > 0 makes the run's length a number of steps.
"""
import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

log = logging.getLogger(__name__)


def check_prompt_source(dataset, environment_factory, max_steps: int) -> None:
    """Spec: train_dataset may be omitted only when environment_factory supplies the prompts from
    reset(), and max_steps must then set the run's length. A dataset's rows: check_rows. The
    errors hold the phrases TRL's constructor tests match ("`train_dataset` is required",
    "requires a `train_dataset`")."""
    if dataset is not None:
        return check_rows(dataset, environment_factory)
    if environment_factory is None or isinstance(environment_factory, dict):
        raise ValueError("`train_dataset` is required unless one environment_factory's reset() "
                         "returns each prompt (a dict environment_factory requires a "
                         "`train_dataset` with an 'environment' column)")
    if max_steps <= 0:
        raise ValueError("no train_dataset: the environment supplies the prompts, so set "
                         "max_steps > 0 to define the length of the run")


def check_eval_source(config, dataset, eval_dataset) -> None:
    """An evaluation needs eval prompts (transformers' Trainer's rule and words), and
    eval_strategy "epoch" a sized training dataset: an epoch is a pass over it."""
    if config.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(f"You have set `args.eval_strategy` to {config.eval_strategy!r} but you "
                         "didn't pass an `eval_dataset`. Either set `args.eval_strategy` to 'no' "
                         "or pass an `eval_dataset` (AsyncGRPOTrainer(eval_dataset=...), "
                         "train.py --eval_dataset)")
    if config.eval_strategy == "epoch" and not hasattr(dataset, "__len__"):
        raise ValueError("AsyncGRPOConfig.eval_strategy='epoch': an epoch is a pass over a sized "
                         "train_dataset, and this run's prompts are streamed or come from its "
                         "environment; evaluate every eval_steps instead (eval_strategy='steps')")


def check_rows(dataset, environment_factory) -> None:
    """ValueError naming the first bad row of a sized dataset (a streaming one's rows fail as they
    are read): each prompt a non-empty string or list of messages, and with a dict of
    environment factories each `environment` one of its names."""
    columns = (getattr(dataset, "column_names", None) if hasattr(dataset, "__len__") else None
               ) or []
    for i, prompt in enumerate(dataset["prompt"] if "prompt" in columns else []):
        if not (isinstance(prompt, (str, list)) and prompt):
            raise ValueError(f"dataset row {i}: the prompt is {prompt!r:.100}; it must be a "
                             "non-empty string or a non-empty list of messages")
    if isinstance(environment_factory, dict) and "environment" in columns:
        for i, name in enumerate(dataset["environment"]):
            if name not in environment_factory:
                raise ValueError(f"dataset row {i}: environment {name!r} is not among the "
                                 f"environments {sorted(environment_factory)}")


def first_prompt_index(dataset, start_index: int) -> int:
    """Where prompt_stream starts: start_index, except for a streaming dataset (no len), which
    cannot be repositioned and restarts at prompt 0. The resume index counts from the same place."""
    streaming = dataset is not None and not hasattr(dataset, "__len__")
    return 0 if streaming else start_index


def prompt_stream(dataset, start_index: int, num_train_epochs: float, max_steps: int,
                  shuffle_seed: int | None = None) -> Iterator[tuple[int, int, int, dict]]:
    """Yield (prompt_index, epoch, row_index, row): the prompts of the run in order, from
    `start_index`.

    prompt_index counts prompts across epochs (epoch = prompt_index // len(dataset)), so a resume
    index saved in rollout_state.json also restores the epoch. The stream ends after
    ceil(num_train_epochs × len(dataset)) prompts, or never when max_steps > 0 (the trainer stops
    by steps). A streaming dataset (no len) cannot be repositioned: it restarts at prompt 0 and
    counts whole passes. Without a dataset (an environment's reset() writes each prompt) every row
    is empty, in epoch 0. `shuffle_seed` (AsyncGRPOConfig.shuffle_seed(): data_seed, else seed;
    None for "sequential", the dataset's order): each epoch of a sized dataset visits its rows in
    a permutation seeded by (shuffle_seed, epoch), so a resume index finds the same row.
    """
    endless = max_steps > 0
    if dataset is None:
        for index in itertools.count(start_index):
            yield index, 0, index, {}
    if not hasattr(dataset, "__len__"):
        index = first_prompt_index(dataset, start_index)
        if index != start_index:
            log.warning("a streaming dataset cannot be repositioned: the rollout restarts at "
                        "prompt 0, not %d", start_index)
        epochs = itertools.count() if endless else range(math.ceil(num_train_epochs))
        for epoch in epochs:
            start = index
            for row_index, row in enumerate(dataset):
                yield index, epoch, row_index, row
                index += 1
            if index == start:
                raise ValueError("the training dataset is empty")
        return
    n = len(dataset)
    if n == 0:
        raise ValueError("the training dataset is empty")
    end = math.ceil(num_train_epochs * n)
    indices = itertools.count(start_index) if endless else range(start_index, end)
    order = None                                    # the epoch's row order, when shuffled
    for index in indices:
        epoch, i = divmod(index, n)
        if shuffle_seed is not None and (order is None or i == 0):
            order = np.random.default_rng([shuffle_seed, epoch]).permutation(n)
        row_index = i if order is None else int(order[i])
        yield index, epoch, row_index, dataset[row_index]


def filtered_stream(stream: Iterator[tuple[int, int, int, dict]],
                    filter_prompt: Callable[[int, dict, int], bool],
                    ) -> Iterator[tuple[int, int, int, dict, bool]]:
    """The stream with filter_prompt's verdict: (prompt_index, epoch, row_index, row, accepted).

    Spec: an epoch whose prompts filter_prompt all rejected raises (no batch could reach the
    trainer). It is judged when the next epoch starts, or when the stream ends. The first epoch
    of a stream that does not start at prompt 0 (a resume) is not judged: its accepted prompts
    may lie before the resume point. (Not its first row's index: a shuffled epoch starts
    anywhere, and a resume may land on row 0.)"""
    whole = None                                # the first epoch: whole if it starts at prompt 0
    for epoch, prompts in itertools.groupby(stream, key=lambda prompt: prompt[1]):
        accepted = 0
        for prompt_index, _, row_index, row in prompts:
            whole = prompt_index == 0 if whole is None else whole
            verdict = bool(filter_prompt(row_index, row, epoch))
            accepted += verdict
            yield prompt_index, epoch, row_index, row, verdict
        if whole and accepted == 0:
            raise RuntimeError(f"filter_prompt rejected every prompt of epoch {epoch}, so no "
                               "batch can reach the trainer; loosen the filter")
        whole = True                            # every later epoch is seen from its start


@dataclass
class ResumeIndex:
    """Where a resume starts: the first prompt index whose samples have not all been trained, and
    how many samples of each later prompt were trained already (rollout_state.json saves both).
    A prompt dropped or filtered by the rollout process (announced with 0 samples), and a sample
    the trainer dropped (stale, oversize), count as trained: the spec drops them for good.

        announce(3, 2), announce(4, 0), announce(5, 1)   value() = 3
        handed_out(3)                                     value() = 3   (one sample of 3 is queued)
        handed_out(3), handed_out(5)                      value() = 6   (4 had none)
        state(held=[3])   {"prompt_index": 3, "trained": {3: 1, 5: 1}}  (one of 3 in an open row)

    Resumed from that state, ResumeIndex(3, trained={3: 1, 5: 1}) tells the trainer to drop the
    first sample of prompt 3 and of prompt 5 it is handed (handed_out returns False): they were
    trained before the checkpoint. The rollout process generates prompt 3's group again, so
    exactly the samples of it the checkpoint lacks are trained.
    """
    next_index: int                                          # no prompt before it is left
    trained: dict[int, int] = field(default_factory=dict)    # prompt ≥ next_index → samples taken
    left: dict[int, int] = field(default_factory=dict)       # prompt → samples not handed out
    announced: set[int] = field(default_factory=set)         # prompts whose count is known
    skip: dict[int, int] = field(default_factory=dict)       # samples trained before the resume

    def __post_init__(self):
        self.trained = {int(p): n for p, n in self.trained.items()}   # JSON keys are strings
        self.skip = dict(self.trained)

    def announce(self, prompt_index: int, samples: int) -> None:
        """The rollout process finished a prompt: it queued `samples` samples for it."""
        self.announced.add(prompt_index)
        self.left[prompt_index] = self.left.get(prompt_index, 0) + samples

    def handed_out(self, prompt_index: int) -> bool:
        """The trainer took one sample of the prompt (possibly before its announcement arrived).
        False: a sample of it was trained before the resumed checkpoint, drop this one."""
        self.left[prompt_index] = self.left.get(prompt_index, 0) - 1
        if self.skip.get(prompt_index, 0) > 0:
            self.skip[prompt_index] -= 1
            return False
        self.trained[prompt_index] = self.trained.get(prompt_index, 0) + 1
        return True

    def value(self) -> int:
        """The first prompt index whose samples have not all been handed out."""
        while self.next_index in self.announced and self.left.get(self.next_index) == 0:
            self.announced.discard(self.next_index)
            self.left.pop(self.next_index)
            self.next_index += 1
        return self.next_index

    def state(self, held: list[int]) -> dict:
        """rollout_state.json: {"prompt_index", "trained"}; `held` lists the prompt index of each
        sample handed out but not trained yet (the planner's open rows)."""
        first = min([self.value(), *held])
        trained = Counter(self.trained) - Counter(held)   # held: not trained yet (keeps n > 0)
        trained = {p: n for p, n in sorted(trained.items()) if p >= first}
        for p in [p for p in self.trained if p < first]:
            del self.trained[p]
            self.skip.pop(p, None)
        return {"prompt_index": first, "trained": trained}
