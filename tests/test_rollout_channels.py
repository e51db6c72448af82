"""rollout/channels.py: the one record both processes share, and a loop built from the spec's six
inter-process primitives (spec_channels: in-process stand-ins for ours)."""
import multiprocessing as mp
import queue
import threading

import pytest

from config import AsyncGRPOConfig
from rollout.channels import Channels, spec_channels
from rollout.staleness import prior_rate

SPEC_SIX = ("rollout_buffer", "model_version_value", "heartbeat_value", "failed_event",
            "exception_info_queue", "metrics_queue")


def six():
    ctx = mp.get_context("spawn")
    return dict(rollout_buffer=ctx.Queue(), model_version_value=ctx.Value("q", 3),
                heartbeat_value=ctx.Value("d", 0.0), failed_event=ctx.Event(),
                exception_info_queue=ctx.Queue(1), metrics_queue=ctx.Queue())


def test_the_spec_six_are_the_records_channels_and_ours_are_stand_ins():
    config = AsyncGRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    given = six()
    channels = spec_channels(config, **given)
    assert isinstance(channels, Channels)
    assert channels.rollout_buffer is given["rollout_buffer"]
    assert channels.metrics is given["metrics_queue"]
    assert channels.exception_info is given["exception_info_queue"]
    assert channels.model_version.value == 3 and channels.failed is given["failed_event"]
    assert isinstance(channels.progress, queue.Queue)            # nobody reads resume progress
    assert isinstance(channels.stop, threading.Event) and not channels.stop.is_set()
    assert channels.rate.value == prior_rate(config, 1) == 8     # no trainer publishes a window
    assert (channels.version_start.value, channels.consumed.value) == (0, 0)


@pytest.mark.parametrize("missing", SPEC_SIX)
def test_a_missing_primitive_is_named(missing):
    given = six() | {missing: None}
    with pytest.raises(TypeError, match=rf"AsyncRolloutLoop needs {missing} \(or one `channels`"):
        spec_channels(AsyncGRPOConfig(), **given)
