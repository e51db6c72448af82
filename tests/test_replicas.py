"""weight_sync.py's Members and rollout/servers.py (take_out/readmit) end to end through
train(): replicas come and go. train() against two local replicas, one killed mid-run and
restarted later, or restarted at once within one sync interval (a supervisor's quick restart),
or both killed; and one that hangs."""
import os
import signal
import time

import pytest
import requests
from transformers import TrainerCallback

import toy
import train
from local_vllm.launch import LocalServer
from train import AsyncGRPOConfig
from train_helpers import SERVER_ARGS, SMALL


def run(servers, out, steps, callback, **fields):
    config = AsyncGRPOConfig(**SMALL | dict(output_dir=str(out), max_steps=steps, save_steps=steps,
                                            vllm_server_base_url=",".join(s.url for s in servers))
                             | fields)
    hooks = train.Hooks([callback], config)
    return train.train(config, toy.make_dataset(200), [toy.sum_reward], model=out.parent / "model",
                       hooks=hooks)


class At(TrainerCallback):
    """Calls actions[step]() after that optimizer step (and its weight sync)."""

    def __init__(self, actions):
        self.actions = actions

    def on_step_end(self, args, state, control, **kwargs):
        if action := self.actions.get(state.global_step):
            action()


@pytest.mark.slow
def test_a_killed_replica_is_left_out_then_rejoins_with_the_current_weights(toy_dir, tmp_path,
                                                                             capfd, caplog):
    """b is killed after step 3: the syncs of steps 4-5 skip it (a warning) and the run goes on;
    b restarts (same port) after step 5 and the next sync gives it the weights: at the end both
    replicas hold version 14 and the same tensors, and the rollout process routed to b again
    once it served the current version (step 7 waits 3 s: its /health poll is every 2 s)."""
    (tmp_path / "model").symlink_to(toy_dir)
    a, b = LocalServer(toy_dir, *SERVER_ARGS), LocalServer(toy_dir, *SERVER_ARGS)
    servers = [a, b]

    def restart():
        servers.append(LocalServer(toy_dir, *SERVER_ARGS, port=b.port))
    try:
        last = run([a, b], tmp_path / "out", 14,
                   At({3: b.stop, 5: restart, 7: lambda: time.sleep(3)}))
        assert f"{b.url} stopped answering and is taken out" in caplog.text
        assert last["step"] == 14
        for s in (a, b):
            assert requests.get(s.url + "/weight_info").json() == {"weight_version": "14"}
        sums = [requests.post(s.url + "/weight_checker", json={"action": "checksum"}).json()
                for s in (a, b)]
        assert sums[0] == sums[1]
        err = capfd.readouterr().err
        assert f"the vLLM server at {b.url} stopped answering" in err       # the rollout process
        back = err.split(f"the vLLM server at {b.url} answers again with policy version ")
        # b got step 6's weights (v6) before the child heard of v6: it may be back under v5
        assert len(back) == 2 and 5 <= int(back[1].split(":")[0]) < 14
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_a_replica_restarted_within_one_sync_interval_rejoins_with_the_current_weights(
        toy_dir, tmp_path, caplog):
    """b is stopped and restarted on its port after step 3's sync, before step 4's (a new
    process: no weight-transfer group, weight version "default"): sync 4 sees the version, says
    so and regroups; the run goes on, and at the end both replicas hold version 8 and the same
    tensors."""
    (tmp_path / "model").symlink_to(toy_dir)
    a, b = LocalServer(toy_dir, *SERVER_ARGS), LocalServer(toy_dir, *SERVER_ARGS)
    servers = [a, b]

    def restart():
        b.stop()
        servers.append(LocalServer(toy_dir, *SERVER_ARGS, port=b.port))
    try:
        last = run([a, b], tmp_path / "out", 8, At({3: restart}))
        assert last["step"] == 8
        assert f"{b.url} restarted (it reports weight version 'default', not '3')" in caplog.text
        for s in (a, b):
            assert requests.get(s.url + "/weight_info").json() == {"weight_version": "8"}
        sums = [requests.post(s.url + "/weight_checker", json={"action": "checksum"}).json()
                for s in (a, b)]
        assert sums[0] == sums[1]
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_when_every_replica_is_killed_the_run_stops_naming_them(toy_dir, tmp_path):
    (tmp_path / "model").symlink_to(toy_dir)
    a, b = LocalServer(toy_dir, *SERVER_ARGS), LocalServer(toy_dir, *SERVER_ARGS)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="no vLLM server is left") as failure:
            run([a, b], tmp_path / "out", 50, At({2: lambda: (a.stop(), b.stop())}))
    finally:
        a.stop()
        b.stop()
    assert a.url in str(failure.value) and b.url in str(failure.value)
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_a_server_that_accepts_connections_but_never_answers_stops_the_run_naming_it(
        toy_dir, tmp_path):
    """SIGSTOP after step 2: the kernel still accepts connections, nothing answers. The run stops
    within vllm_server_timeout and a /health probe (a few times over, not max_retries times),
    naming the server and the wait."""
    (tmp_path / "model").symlink_to(toy_dir)
    a = LocalServer(toy_dir, *SERVER_ARGS)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=f"no vLLM server is left.*{a.url}.*"
                                               "vllm_server_timeout") as failure:
            run([a], tmp_path / "out", 50, At({2: lambda: os.kill(a.proc.pid, signal.SIGSTOP)}),
                vllm_server_timeout=5.0)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
        a.stop()
    assert time.monotonic() - start < 60, failure.value
