"""The rollout, both ends of the spec's process line (概要 (Overview): the rollout worker;
ロールアウトループのカスタマイズ (Customising the rollout loop)): worker.py is the trainer's side,
the rest is what the spawned child runs. The child never imports worker.py, so neither does this
map (`from rollout.worker import RolloutWorker`). One folder, not one rollout.py: that file would
be ~2,000 lines over six spec sections. It imports nothing of the top level but vllm_client.py.

    trainer, rank 0                       spawned child (CUDA_VISIBLE_DEVICES="", one asyncio loop)
    ───────────────                       ──────────────────────────────────────────────────────────
    RolloutWorker.start() ─ pickle ─────► child_main → run(): connect_all, setup(), `ready`
    set_model_version(v) ─ model_version, ► _generate_loop: filtered_stream (filter_prompt) →
                           C_v, R           room in the score queue → staleness.admits → pick a
      consumed ─────────────────────────►     replica → G rollouts under its cap, each under the
                                              version it started in: generate_one → reconcile
                                                 │ a complete group
                                                 ▼ score queue (asyncio.Queue, score_queue_maxsize)
    get() ◄── rollout_buffer (mp.Queue) ── _score_loop: score_group (rewards → compute_advantages
                                              → samples); None at the end of the prompts
    resume_index() ◄── progress ────────── (prompt_index, samples queued) per finished prompt
    drain_metrics() ◄── metrics ────────── per group, and every metrics_interval_s (_metrics_loop)
    get() checks health ◄── heartbeat, failed + traceback;  stop() ── stop ──► run() returns

    worker.py      the trainer's side (rank 0): RolloutWorker spawns the child, takes its samples,
                   publishes versions, watches its health; the main-script hazard
    loop.py        AsyncRolloutLoop: the spec's hooks, the generate and score loops; child_main;
                   Channels, the one record both processes share
    staleness.py   admission by staleness: Window (published by the parent), admits (the child)
    prompts.py     the prompt stream, filter_prompt's epochs, ResumeIndex (rollout_state.json)
    samples.py     TurnRecord → reconcile → Rollout → RolloutGroup → RolloutSample
    scoring.py     rewards → compute_advantages → samples
    servers.py     replicas, prefix-affinity routing, the KV-adaptive ConcurrencyCap
    tool_calls.py  tools and environments: parse a turn's calls, run them, environment rewards
"""
from rollout.loop import AsyncRolloutLoop
from rollout.samples import Rollout, RolloutGroup, RolloutSample, TurnRecord

__all__ = ["AsyncRolloutLoop", "Rollout", "RolloutGroup", "RolloutSample", "TurnRecord"]
