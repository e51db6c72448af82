"""serve_local_engine.py: continuous batching (requests share engine steps), KV capacity
(admission waits, preemption when running sequences grow), and a step that is never seen half
ended. The batching tests go through the server's routes; the last one drives an Engine directly."""
import threading
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoModelForCausalLM, AutoTokenizer

from local_vllm.engine import Engine, SamplingParams
from test_serve_local import PROMPT, complete, metrics, post, wait_for


def test_concurrent_requests_share_engine_steps(server):
    """8 requests of 10 tokens queued together take 10 engine steps, not 80."""
    steps = metrics(server)["serve_local:engine_steps_total"]
    assert post(server, "/pause?mode=keep&clear_cache=false").json() == {"status": "paused"}
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, server, max_tokens=10, ignore_eos=True, seed=i)
                   for i in range(8)]
        wait_for(lambda: metrics(server)["vllm:num_requests_waiting"] == 8)
        assert post(server, "/resume").json() == {"status": "resumed"}
        assert all(len(f.result()["choices"][0]["token_ids"]) == 10 for f in futures)
    m = metrics(server)
    assert m["serve_local:engine_steps_total"] - steps == 10
    assert m["serve_local:max_batch_size"] >= 8


def test_kv_capacity_limits_admission_and_preempts(start_server):
    """Budget 128 tokens; 6 sequences of 16 + 80 tokens cannot all run: some wait, some are
    preempted."""
    plain_server = start_server("--max-model-len", "128", "--kv-cache-tokens", "128")
    seen = []
    with ThreadPoolExecutor(6) as pool:
        post(plain_server, "/pause?mode=keep")
        futures = [pool.submit(post, plain_server, "/v1/completions", {
            "prompt": PROMPT + [i] * 9, "max_tokens": 80, "ignore_eos": True,
            "return_token_ids": True}) for i in range(6)]
        wait_for(lambda: metrics(plain_server)["vllm:num_requests_waiting"] == 6)
        post(plain_server, "/resume")
        while not all(f.done() for f in futures):
            seen.append(metrics(plain_server))
            time.sleep(0.01)
        replies = [f.result().json() for f in futures]
    assert all(len(r["choices"][0]["token_ids"]) == 80 for r in replies)
    assert any(m["vllm:num_requests_running"] > 0 and m["vllm:num_requests_waiting"] > 0
               for m in seen)
    assert all(m["vllm:kv_cache_usage_perc"] <= 1.0 for m in seen)
    assert max(m["vllm:kv_cache_usage_perc"] for m in seen) >= 0.75
    assert metrics(plain_server)["vllm:num_preemptions_total"] > 0


class WatchedEngine(Engine):
    """An Engine whose lock records every moment the engine thread lets other threads (/metrics,
    /pause) take it while `running` holds a finished sequence or more tokens than the KV
    capacity."""

    def __init__(self, model, tokenizer, kv_tokens):
        self.seen: list[str] = []
        args = Namespace(model="toy", seed=0, kv_cache_tokens=kv_tokens,
                         logprobs_mode="processed_logprobs", return_sampling_mask=False,
                         max_model_len=128)
        super().__init__(model, tokenizer, args)

    @property
    def cond(self):
        return self.watched_cond

    @cond.setter
    def cond(self, value):
        engine = self

        class Cond(type(value)):
            def __exit__(self, *exc):
                if threading.current_thread().name == "engine":
                    engine.check()
                return super().__exit__(*exc)
        self.watched_cond = Cond()

    def check(self) -> None:
        finished = [s for s in self.running if s.finish_reason]
        overfull = self.held() > self.args.kv_cache_tokens and len(self.running) > 1
        if finished or overfull:
            self.seen.append(f"{len(finished)} finished of {len(self.running)} running, "
                             f"{self.held()} tokens held")


def test_metrics_never_see_a_step_half_ended(toy_dir):
    """Between sampling and the end of a step the lock must not be released: a /metrics reader
    would count finished requests as running and KV usage above 1.0."""
    model = AutoModelForCausalLM.from_pretrained(toy_dir).eval()
    engine = WatchedEngine(model, AutoTokenizer.from_pretrained(toy_dir), kv_tokens=40)
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=4, seed=1)
    [r] = engine.generate([PROMPT], params, None)
    assert [len(s.token_ids) for s in r.seqs] == [6] * 4 and engine.preemptions > 0
    assert engine.seen == []


def test_any_valid_sampling_parameter_gives_a_reply_never_a_server_error(server):
    """A tiny repetition_penalty (> 0, so valid) or temperature pushes logits past fp32's range;
    the stand-in keeps them finite and answers 200, where it answered 500 ("probability tensor
    contains inf, nan or element < 0")."""
    for params in (dict(repetition_penalty=1e-40), dict(repetition_penalty=1e-40,
                                                        temperature=1e-6),
                   dict(repetition_penalty=1e40, top_p=0.5), dict(temperature=1e-30)):
        reply = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                 "return_token_ids": True, "logprobs": 1,
                                                 **params})
        assert reply.status_code == 200, (params, reply.text)
        assert len(reply.json()["choices"][0]["token_ids"]) >= 1, params
