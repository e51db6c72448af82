"""The trainer's command line (概要, Overview: `python train.py` runs the toy task end to end): every
AsyncGRPOConfig field is a flag, beside the script's own (model, dataset, reward, serve_local).

    python train.py                                   # toy model, toy task, its own local_vllm
    python train.py --model=toy --max_steps 20        # the same; `=` or a space, either form
    python train.py --model Qwen/Qwen3-4B --dataset trl-lib/DeepMath-103K \
        --reward my_rewards:accuracy --vllm_server_base_url http://gpu0:8000
    python train.py plot runs/toy                     # metrics.jsonl → metrics.png

The toy defaults (toy.TRAIN_DEFAULTS) and the local server depend on the parsed model, never on
argv's spelling (parse_cli). `train.py`'s `__main__` calls main() here.

Departures from the spec, one line each:
- The spec's scripts build AsyncGRPOConfig themselves; these flags are ours (HfArgumentParser's).
"""
import argparse
import importlib
import os
import signal
import sys
from dataclasses import dataclass, fields

import torch

import lora_sync
import train
import train_metrics
from config import AsyncGRPOConfig
from local_vllm.launch import LocalServer


def local_server_args(config, peft_config=None) -> list[str]:
    """local_vllm flags for a run of `config`: gloo weight transfer, processed log-probs, enough
    top log-probs, candidate sets when top-k/top-p are on, LoRA slots for adapter sync."""
    args = ["--weight-transfer-config", '{"backend":"gloo"}',
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
            "--return-sampling-mask", "--enable-scale-out"]
    if peft_config is not None:
        args += ["--enable-lora", "--max-lora-rank", str(lora_sync.max_lora_rank(peft_config.r)),
                 "--max-loras", str(config.max_staleness + 2)]
    return args


@dataclass
class ScriptArguments:
    """The CLI's arguments beside AsyncGRPOConfig's fields."""
    model: str = "toy"                   # a hub id, a local directory, or "toy" (toy.py's model)
    dataset: str = "toy"                 # a `datasets` name, a .json/.jsonl/.csv/.parquet file with
                                         # a `prompt` column, or "toy"
    dataset_split: str = "train"         # the split of a `datasets` name
    reward: str | None = None            # module:function[,...]; "toy" → toy:exact_reward
    serve_local: bool | None = None      # start local_vllm; None: for toy without a server URL
    lora_r: int = 0                      # > 0: train a LoRA adapter of this rank (peft)
    lora_alpha: int = 32                 # the adapter's scale is lora_alpha / lora_r
    lora_target_modules: str = "all-linear"   # comma-separated module names, or all-linear


def import_callable(spec: str):
    """module:function → the function."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--reward {spec!r}: expected module:function")
    return getattr(importlib.import_module(module), name)


def load_prompts(script: ScriptArguments):
    """The prompt dataset of --dataset: the toy prompts, a local file, or a `datasets` name."""
    if script.dataset == "toy":
        import toy
        return toy.make_dataset(toy.NUM_PROMPTS, standard=True, balanced=True)
    import datasets
    kinds = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    kind = kinds.get(os.path.splitext(script.dataset)[1])
    if kind and os.path.isfile(script.dataset):
        return datasets.load_dataset(kind, data_files=script.dataset, split="train")
    return datasets.load_dataset(script.dataset, split=script.dataset_split)


def lora_config(script: ScriptArguments):
    """A peft LoraConfig when --lora_r > 0, else None."""
    if script.lora_r <= 0:
        return None
    from peft import LoraConfig
    targets = script.lora_target_modules
    return LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha,
                      target_modules=targets if targets == "all-linear" else targets.split(","))


def given_args(parser, argv: list[str]) -> dict:
    """The fields `argv` sets, in any form (--name value, --name=value, --name-with-dashes):
    argparse fills in a default only where the namespace lacks the name, so a namespace of
    sentinels keeps the rest."""
    unset = object()
    names = [f.name for kind in (ScriptArguments, AsyncGRPOConfig) for f in fields(kind)]
    namespace = argparse.Namespace(**dict.fromkeys(names, unset))
    parser.parse_known_args(argv, namespace=namespace)
    return {name: value for name, value in vars(namespace).items() if value is not unset}


def parse_cli(argv: list[str]) -> tuple[ScriptArguments, AsyncGRPOConfig]:
    """The CLI's arguments. The toy model (--model toy, the default) puts toy.TRAIN_DEFAULTS under
    the fields argv leaves unset, and resolves serve_local=None to "no --vllm_server_base_url
    given"; any other model gets AsyncGRPOConfig's defaults and no local server unless asked."""
    from transformers import HfArgumentParser
    parser = HfArgumentParser((ScriptArguments, AsyncGRPOConfig),
                              description="Asynchronous GRPO trainer")
    given = given_args(parser, argv)
    toy_run = given.get("model", ScriptArguments.model) == "toy"
    if toy_run:
        import toy
        parser.set_defaults(**toy.TRAIN_DEFAULTS)
    script, config = parser.parse_args_into_dataclasses(argv)
    if script.serve_local is None:
        script.serve_local = toy_run and "vllm_server_base_url" not in given
    return script, config


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # run the finally
    if argv[:1] == ["plot"]:
        print(train_metrics.plot(argv[1] if len(argv) > 1 else "runs/toy"))
        return
    script, config = parse_cli(argv)
    peft_config = lora_config(script)
    dataset = load_prompts(script)
    reward = script.reward or ("toy" if script.dataset == "toy" else None)
    if reward is None:
        raise SystemExit("train.py: error: --reward module:function is required for a dataset "
                         "other than toy")
    rewards = [import_callable("toy:exact_reward" if r == "toy" else r) for r in reward.split(",")]
    output_dir = config.output_dir or "trainer_output"
    server = None
    if script.serve_local and int(os.environ.get("RANK", "0")) == 0:   # rank 0 talks to servers
        import toy
        path = toy.ensure_saved() if script.model == "toy" else script.model
        os.makedirs(output_dir, exist_ok=True)
        log_path = os.path.join(output_dir, "serve_local.log")
        server = LocalServer(path, *local_server_args(config, peft_config), log_path=log_path)
        config.vllm_server_base_url = server.url
        print(f"local_vllm on {server.url} (log: {log_path})", flush=True)
        if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
            # the server (one thread) and the rollout process share these cores: 2 of 2 threads
            # here made each step 1.4x slower (forward+backward 4.5x) than 1 on a 2-core machine
            torch.set_num_threads(max(1, torch.get_num_threads() - 2))
    try:
        metrics = train.train(config, dataset, rewards, model=script.model,
                              peft_config=peft_config)
    finally:
        if server is not None:
            server.stop()
    if metrics:
        shown = {k: round(v, 4) for k, v in metrics.items()
                 if k in ("step", "reward", "loss", "perf/step_s")}
        print(f"done: {shown}; metrics in {output_dir}/metrics.jsonl", flush=True)
