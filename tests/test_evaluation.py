"""Evaluation during training, end to end (train.py, metrics.MetricsLog.evaluate, rollout/worker.py,
rollout/loop.py's _evaluate, rollout/scoring.eval_metrics) against local_vllm: eval lines at the
asked steps and on_evaluate, eval_on_start, a resume that does not repeat one, epochs, the
refusals, the toy's held-out sums from the command line, and the objectives by name trained
through train()."""
import json
import os
import subprocess
import sys

import pytest

import toy
import train
from config import AsyncGRPOConfig
from rollout_helpers import rank_reward
from train_helpers import ROOT, SMALL, lines


class Recorder:
    """A TrainerCallback-like recorder of on_evaluate and on_log."""

    def __init__(self):
        self.evaluated, self.logged = [], []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluated.append((state.global_step, dict(metrics)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


def evals(out: str) -> list[dict]:
    return [r for r in lines(out) if "eval/prompts" in r]


def test_eval_lines_come_at_the_asked_steps_and_a_resume_does_not_repeat_one(train_server,
                                                                             toy_dir, tmp_path):
    """eval_steps 2 with eval_on_start over 4 steps: eval lines at steps 0, 2 and 4 (each at the
    step that asked, whenever it is done), on_evaluate with each, in log_history too; the eval
    prompts are never trained (completions.jsonl). Resumed to
    step 6 from checkpoint 4: step 4's evaluation, logged already, is not run again (even with
    eval_on_start), step 6's is."""
    out = str(tmp_path / "run")
    config = AsyncGRPOConfig(output_dir=out, vllm_server_base_url=train_server.url, max_steps=4,
                             eval_strategy="steps", eval_steps=2, eval_on_start=True,
                             save_steps=2, log_completions=True, num_generations_eval=3,
                             **SMALL)
    recorder = Recorder()
    held_out = toy.make_dataset(3, seed=11)
    trainer = train.AsyncGRPOTrainer(toy_dir, toy.sum_reward, config, toy.make_dataset(32),
                                     callbacks=[recorder], eval_dataset=held_out)
    trainer.train()
    assert [r["step"] for r in evals(out)] == [0, 2, 4]
    assert [step for step, _ in recorder.evaluated] and all(
        m["eval/prompts"] == 3 and "eval/pass@3" in m and "eval/rewards/sum_reward/mean" in m
        for _, m in recorder.evaluated)
    assert sorted(m["eval/model_version_min"] for _, m in recorder.evaluated) == [0, 2, 4]
    assert sum("eval/prompts" in r for r in trainer.state.log_history) == 3
    trained = [json.loads(x) for x in open(os.path.join(out, "completions.jsonl"))]
    held = {json.dumps(r["prompt"]) for r in held_out} - {json.dumps(r["prompt"])
                                                          for r in toy.make_dataset(32)}
    assert held and not held & {json.dumps(r.get("prompt")) for r in trained if "prompt" in r}
    resumed = AsyncGRPOConfig(**{**config.__dict__, "max_steps": 6})
    train.AsyncGRPOTrainer(toy_dir, toy.sum_reward, resumed, toy.make_dataset(32),
                           eval_dataset=held_out).train(resume_from_checkpoint=True)
    assert [r["step"] for r in evals(out)] == [0, 2, 4, 6]


def test_eval_strategy_epoch_evaluates_after_each_pass_over_the_prompts(train_server, toy_dir,
                                                                        tmp_path):
    """eval_strategy "epoch" over 2 passes of 8 prompts: one evaluation after each pass (the
    second at the run's end); eval_delay 2 (epochs, as transformers reads it: the first may come
    once 2 have passed) leaves out the first."""
    def run(out, **kw):
        config = AsyncGRPOConfig(output_dir=out, vllm_server_base_url=train_server.url,
                                 num_train_epochs=2, eval_strategy="epoch", save_strategy="no",
                                 **(SMALL | kw))
        train.train(config, toy.make_dataset(8), [rank_reward], model=toy_dir,   # never flat
                    eval_dataset=toy.make_dataset(2, seed=5))
        return evals(out)

    both = run(str(tmp_path / "both"))
    steps = [r["step"] for r in lines(str(tmp_path / "both")) if "loss" in r]
    assert len(both) == 2 and both[-1]["step"] == steps[-1] and both[0]["step"] < steps[-1]
    assert len(run(str(tmp_path / "delay"), eval_delay=2)) == 1


def test_an_evaluation_without_eval_prompts_is_refused_in_transformers_words(toy_dir):
    """Transformers' Trainer's rule and phrase for eval_strategy without an eval_dataset; epochs
    need a sized training dataset."""
    config = AsyncGRPOConfig(eval_strategy="steps", **SMALL)
    with pytest.raises(ValueError, match="didn't pass an `eval_dataset`"):
        train.AsyncGRPOTrainer(toy_dir, toy.sum_reward, config, toy.make_dataset(8))
    from rollout.prompts import check_eval_source
    with pytest.raises(ValueError, match="eval_strategy='epoch'"):
        check_eval_source(AsyncGRPOConfig(eval_strategy="epoch"), iter([]), toy.make_dataset(2))


@pytest.mark.slow
def test_the_demo_evaluates_on_held_out_sums_with_one_flag(tmp_path):
    """`python train.py --eval_strategy steps --eval_steps N` needs no other flag: the toy run
    evaluates on its held-out sums (toy.HELD_OUT, never in its training prompts)."""
    out = str(tmp_path / "toy")
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--output_dir", out,
                    "--max_steps", "6", "--eval_strategy", "steps", "--eval_steps", "3",
                    "--save_strategy", "no", "--disable_tqdm", "true"],
                   check=True, timeout=600, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert [(r["step"], r["eval/prompts"]) for r in evals(out)] == [(3, 5), (6, 5)]
    trained = {(r["prompt"], r["answer"]) for r in train.load_prompts("toy", "train")}
    held = {(r["prompt"], r["answer"]) for r in train.load_prompts("toy", "test", held_out=True)}
    assert len(held) == len(toy.HELD_OUT) and not held & trained


@pytest.mark.parametrize("kind", ["grpo", "bnpo", "dr_grpo", "cispo", "gspo"])
def test_each_objective_trains_through_train(train_server, toy_dir, tmp_path, kind):
    """Every loss_type (and the sequence level, GSPO) trains two steps end to end: finite losses,
    the weights move; beta's kl is logged with the KL on."""
    gspo = kind == "gspo"
    config = AsyncGRPOConfig(output_dir=str(tmp_path / kind), max_steps=2,
                             vllm_server_base_url=train_server.url, save_strategy="no",
                             loss_type="dapo" if gspo else kind, epsilon_high=5.0 if kind == "cispo"
                             else None, importance_sampling_level="sequence" if gspo else "token",
                             score_centering=False, beta=0.05, **SMALL)
    last = train.train(config, toy.make_dataset(16), [rank_reward], model=toy_dir)  # never flat
    steps = [r for r in lines(str(tmp_path / kind)) if "loss" in r]
    assert len(steps) == 2 and all(r["loss"] is not None for r in steps)
    assert last["kl"] >= 0 and "grad_norm" in last
