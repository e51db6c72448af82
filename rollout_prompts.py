"""The prompts of a run, in order (spec: チェックポイントと再開, and train_dataset / environment_factory of
AsyncGRPOTrainer): epochs, the resume index, streaming datasets, and runs whose environment owns the data.

    dataset of 4 rows, num_train_epochs 1.5, resumed at prompt 3:
    prompt_index  3  4  5        epoch = prompt_index // 4, row = prompt_index % 4
    epoch         0  1  1        the stream ends at ceil(1.5 × 4) = 6 prompts (max_steps > 0: never)
    row_index     3  0  1

prompt_index counts prompts (not samples), so the trainer's resume index (rollout_worker.py) is what
rollout_state.json stores. Departures from the spec: none; as it says, a streaming dataset restarts at
prompt 0 on resume, and max_steps > 0 makes the run's length a number of steps.
"""
import logging
import math
from typing import Iterator

log = logging.getLogger(__name__)


def check_prompt_source(dataset, environment_factory, max_steps: int) -> None:
    """Spec: train_dataset may be omitted only when environment_factory supplies the prompts from
    reset(), and max_steps must then set the run's length."""
    if dataset is not None:
        return
    if environment_factory is None or isinstance(environment_factory, dict):
        raise ValueError("no train_dataset: pass a dataset with a 'prompt' column, or an environment_factory "
                         "(one factory, not a dict: a dict picks environments by a dataset column) whose reset() "
                         "returns each prompt")
    if max_steps <= 0:
        raise ValueError("no train_dataset: the environment supplies the prompts, so set max_steps > 0 to define "
                         "the length of the run")


def prompt_stream(dataset, start_index: int, num_train_epochs: float,
                  max_steps: int) -> Iterator[tuple[int, int, int, dict]]:
    """Yield (prompt_index, epoch, row_index, row): the prompts of the run in order, from `start_index`.

    prompt_index counts prompts across epochs (epoch = prompt_index // len(dataset)), so a resume index
    saved in rollout_state.json also restores the epoch. The stream ends after ceil(num_train_epochs ×
    len(dataset)) prompts, or never when max_steps > 0 (the trainer stops by steps). A streaming
    dataset (no len) cannot be repositioned: it restarts at prompt 0 and counts whole passes. Without a
    dataset (an environment's reset() writes each prompt) every row is empty, in epoch 0.
    """
    endless = max_steps > 0
    if dataset is None:
        index = start_index
        while True:
            yield index, 0, index, {}
            index += 1
    if not hasattr(dataset, "__len__"):
        if start_index:
            log.warning("a streaming dataset cannot be repositioned: the rollout restarts at prompt 0, not %d",
                        start_index)
        index, epoch = 0, 0
        while endless or epoch < math.ceil(num_train_epochs):
            start = index
            for row_index, row in enumerate(dataset):
                yield index, epoch, row_index, row
                index += 1
            if index == start:
                raise ValueError("the training dataset is empty")
            epoch += 1
        return
    n = len(dataset)
    if n == 0:
        raise ValueError("the training dataset is empty")
    end = math.inf if endless else math.ceil(num_train_epochs * n)
    index = start_index
    while index < end:
        yield index, index // n, index % n, dataset[index % n]
        index += 1
