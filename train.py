"""AsyncGRPOConfig: the spec's configuration (spec: AsyncGRPOConfig, 非同期ロールアウトパイプライン).

(The FSDP2 training loop, weight-sync cadence, checkpoints and metrics will live here too; for now this
file holds the configuration that the rollout process, the planner and the loss already read, and
`python train.py` is a demo of the generation side: it starts `serve_local.py` on the toy model and
samples completions with their per-token log-probs, scored by the toy reward.)

Only the fields the project implements exist: an option that would be accepted and ignored is not
declared. Names and defaults are the spec's, so a TRL config reads the same here:

    config = AsyncGRPOConfig(output_dir="runs/x", top_p=0.95, top_k=512)   # needs a server with
                                                                            # --return-sampling-mask --enable-scale-out
"""
import os
import warnings
from dataclasses import dataclass


@dataclass
class AsyncGRPOConfig:
    # run
    output_dir: str | None = None
    seed: int = 42
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # generation
    num_generations: int = 8
    max_completion_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict | None = None
    max_tool_calling_iterations: int | None = None
    # vLLM server
    vllm_server_base_url: str = "http://localhost:8000"
    vllm_server_timeout: float = 1800.0
    # objective
    epsilon: float = 0.2
    epsilon_high: float | None = None
    score_centering: bool = True
    vllm_importance_sampling_clip_min: float = 0.5
    vllm_importance_sampling_clip_max: float = 5.0
    num_sampler_logprobs: int = 8
    router_aux_loss_coef: float | None = None
    # packing
    token_budget: int | None = None
    # asynchronous rollout pipeline
    max_concurrent_rollouts: int | None = None
    max_staleness: int = 4
    queue_maxsize: int = 1024
    weight_sync_steps: int = 1
    rollout_worker_timeout: float = 300.0
    log_completions: bool = False
    num_completions_to_print: int | None = None

    def __post_init__(self):
        def need(ok: bool, field: str, fix: str):
            if not ok:
                raise ValueError(f"AsyncGRPOConfig.{field}: {fix}")

        need(self.num_generations >= 2, "num_generations", "must be >= 2: advantages are standardised within a group")
        need(self.temperature > 0, "temperature", "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.top_k >= 0, "top_k", "must be >= 0 (0 disables top-k)")
        truncated = self.top_p < 1 or self.min_p is not None
        need(not truncated or self.top_k > 0, "top_k",
             "top_p < 1 and min_p also need top_k > 0: vLLM bounds the returned candidate set by top_k")
        need(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.epsilon > 0 and (self.epsilon_high is None or self.epsilon_high > 0), "epsilon", "must be > 0")
        need(0 <= self.vllm_importance_sampling_clip_min < 1 < self.vllm_importance_sampling_clip_max,
             "vllm_importance_sampling_clip_min/max", "need clip_min < 1 < clip_max")
        need(self.num_sampler_logprobs >= 1 or not self.score_centering, "num_sampler_logprobs",
             "score centering needs >= 1 sampler log-probs per token")
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        if self.repetition_penalty != 1.0:
            warnings.warn("AsyncGRPOConfig.repetition_penalty != 1: the server's processed log-probs include the "
                          "penalty and the trainer's log-probs do not, so every importance ratio is biased", stacklevel=2)
        need(self.weight_sync_steps >= 1, "weight_sync_steps", "must be >= 1")
        need(self.max_concurrent_rollouts is None or self.max_concurrent_rollouts >= 1, "max_concurrent_rollouts",
             "must be >= 1 (or None for the default)")

    def default_max_concurrent_rollouts(self, num_processes: int) -> int:
        """Spec: max(max_staleness, 1) × per_device_train_batch_size × gradient_accumulation_steps × num_processes."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return max(self.max_staleness, 1) * self.per_device_train_batch_size * self.gradient_accumulation_steps * num_processes


def demo(num_prompts: int = 4, num_generations: int = 4) -> None:
    """Start serve_local.py on the toy model, sample completions, print them with log-probs and rewards."""
    import socket
    import subprocess
    import sys

    from transformers import AutoTokenizer

    import toy
    from vllm_client import VLLMClient

    model_dir = toy.ensure_saved()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "serve_local.py", "--model", model_dir, "--port", str(port),
                               "--logprobs-mode", "processed_logprobs"], cwd=os.path.dirname(os.path.abspath(__file__)))
    client = VLLMClient(f"http://127.0.0.1:{port}", timeout=60.0)
    try:
        client.wait_for_health(timeout=120.0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        print(f"serve_local.py on {client.base_url}: toy model, max_model_len={client.max_model_len()}")
        for i, row in enumerate(toy.make_dataset(num_prompts, seed=1)):
            prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)
            reply = client.completions({"prompt": prompt_ids, "n": num_generations, "max_tokens": 8, "temperature": 1.0,
                                        "logprobs": 0, "return_token_ids": True, "seed": 1000 * i})
            texts = [tokenizer.decode(c["token_ids"], skip_special_tokens=True) for c in reply["choices"]]
            rewards = toy.sum_reward(None, texts, [row["answer"]] * len(texts))
            print(f"\nprompt {row['prompt'][0]['content']!r} (answer {row['answer']})")
            for choice, text, reward in zip(reply["choices"], texts, rewards):
                logps = " ".join(f"{lp:.2f}" for lp in choice["logprobs"]["token_logprobs"])
                print(f"  reward {reward:.1f}  {text!r:14}  log-probs [{logps}]")
    finally:
        client.close()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    demo()
