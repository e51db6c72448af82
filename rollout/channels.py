"""The channels between the trainer and the rollout process (spec: AsyncRolloutLoop's arguments
rollout_buffer, model_version_value, heartbeat_value, failed_event, exception_info_queue and
metrics_queue), as one record: RolloutWorker builds it from one spawn context and passes it to the
child; a loop built from the spec's six gets in-process stand-ins for the rest (spec_channels).

    parent (rollout_worker.py)          Channels                    child (rollout/loop.py)
    get() ◄──────────────────────── rollout_buffer, metrics ◄────── _score_loop, _metrics_loop
    resume_index() ◄─────────────── progress ◄───────────────────── _finish_prompt
    set_model_version(), consumed ─► model_version, version_start,  _admissible (staleness.py)
                                     rate, consumed
    stop() ────────────────────────► stop; ready, failed, heartbeat ◄ run(), _heartbeat

Departures from the spec: the six travel in one record beside ours, not as six arguments.
"""
import queue
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from rollout.staleness import prior_rate


@dataclass
class Channels:
    """Everything the parent and the child share (all from one spawn context). The spec's loop
    takes six of them as arguments (marked spec, with its name where it differs); the rest are
    ours: resume progress, the staleness window (rollout/staleness.py), stop and ready."""
    rollout_buffer: Any     # spec. Queue: RolloutSample child → parent; None once prompts run out
    metrics: Any            # spec metrics_queue. Queue: metric dicts child → parent; None ends
    progress: Any           # ours. Queue: (prompt_index, samples queued) per finished prompt
    exception_info: Any     # spec exception_info_queue. Queue: (type, message, traceback)
    model_version: Any      # spec model_version_value. Value('q'), set after each weight sync
    version_start: Any      # ours. Value('q'): C_v, samples consumed when the version began
    rate: Any               # ours. Value('d'): R, samples the trainer consumes per version
    consumed: Any           # ours. Value('q'): samples the parent has handed to the trainer
    heartbeat: Any          # spec heartbeat_value. Value('d'): time.time() of the child's beat
    stop: Any               # ours. Event parent → child
    ready: Any              # ours. Event child → parent: connected and set up
    failed: Any             # spec failed_event. Event child → parent: see exception_info


def spec_channels(config, rollout_buffer, model_version_value, heartbeat_value, failed_event,
                  exception_info_queue, metrics_queue) -> Channels:
    """Channels from the spec's six primitives; ours are in-process stand-ins (no trainer
    publishes a staleness window: the prior rate of one process holds)."""
    missing = [name for name, v in [("rollout_buffer", rollout_buffer),
                                    ("model_version_value", model_version_value),
                                    ("heartbeat_value", heartbeat_value),
                                    ("failed_event", failed_event),
                                    ("exception_info_queue", exception_info_queue),
                                    ("metrics_queue", metrics_queue)] if v is None]
    if missing:
        raise TypeError(f"AsyncRolloutLoop needs {', '.join(missing)} (or one `channels` record)")
    return Channels(rollout_buffer=rollout_buffer, metrics=metrics_queue, progress=queue.Queue(),
                    exception_info=exception_info_queue, model_version=model_version_value,
                    version_start=SimpleNamespace(value=0),
                    rate=SimpleNamespace(value=prior_rate(config, 1)),
                    consumed=SimpleNamespace(value=0), heartbeat=heartbeat_value,
                    stop=threading.Event(), ready=threading.Event(), failed=failed_event)
