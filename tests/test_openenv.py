"""rollout/tool_calls.py's environments through the rollout process (rollout/worker.py, loop.py)
end to end: environment_factory with an OpenEnv environment (the spec's pointer to TRL's OpenEnv
guide), run offline: openenv-core's own server (create_app, uvicorn on 127.0.0.1) serves a tiny
game (tests/openenv_helpers.py), openenv's WebSocket client talks to it, and a wrapper written as
the guide writes them is the environment_factory of a real rollout process.

Covered: the wrapper against the server alone (tools from its public methods, schema from the
docstring, a raised exception as the tool's answer); then the rollout process end to end: reset()'s
observation reaches the prompt, every tool call that passes the wrapper is a step counted by the
server, get_reward() scores from the environment's state, and the env/* and tools/* metrics are
logged; reward functions receive `environments`, and instances are reused ("construct once, reset
often": rollout/tool_calls.EnvironmentPool) so that the server's sessions stay bounded. Skipped
without openenv-core (pip install -r requirements-openenv.txt).
"""
import functools
import time

import pytest

pytest.importorskip("openenv.core.env_server", reason="pip install -r requirements-openenv.txt")

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import openenv_helpers as oe  # noqa: E402
import rollout_helpers as h  # noqa: E402
from rollout.tool_calls import environment_tools, tool_schemas  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402

PROMPT = [{"role": "user", "content": "Play the number game."}]


def wait_for_sessions_closed(timeout: float = 10.0) -> None:
    """The server closes a session when its client's socket goes (the rollout process ended)."""
    deadline = time.monotonic() + timeout
    while oe.active_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)


def run_game(long_server, tokenizer, url: str, targets: list[int], **config):
    """The rollout process on prompts with these targets; NumberGameEnv on `url` is the
    environment_factory, ScriptedGuessLoop plays: (samples, metrics)."""
    dataset = Dataset.from_dict({"prompt": [PROMPT] * len(targets), "target": targets})
    config = h.config_for(long_server, max_completion_length=128, **config)
    worker = RolloutWorker(config, dataset, [h.rank_reward, oe.solved], tokenizer,
                           environment_factory=functools.partial(oe.NumberGameEnv, base_url=url),
                           loop_cls=oe.ScriptedGuessLoop)
    return h.run_worker(worker, timeout=120)


def latest(metrics: list[dict], name: str):
    return [m[name] for m in metrics if name in m][-1]


# ── the wrapper against the OpenEnv server, no rollout process ───────────────────────────────


def test_the_wrapper_plays_on_the_openenv_server():
    game = oe.start_server(max_concurrent_envs=1)
    try:
        env = oe.NumberGameEnv(game.url)
        observation = env.reset(target=8, prompt=PROMPT)       # reset(**row): every column
        assert observation == "I picked a whole number from 1 to 9. Guess it."
        tools = environment_tools(env)
        assert [t.__name__ for t in tools] == ["guess"]          # not reset, not get_reward
        schema = tool_schemas(tools)[0]["function"]
        assert schema["name"] == "guess"
        assert schema["parameters"]["properties"]["number"]["type"] == "integer"
        assert "whole number from 1 to 9" in schema["parameters"]["properties"]["number"][
            "description"]
        assert [env.guess(5), env.guess(8)] == ["higher", "correct"]
        assert env.get_reward() == 1.0 and env.done
        with pytest.raises(ValueError, match="Game over"):
            env.guess(2)
        assert oe.GuessTheNumber.counts["steps"] == 2             # the refused guess never left
        assert env.client.state().step_count == 2                 # the session's own state
        env.reset(target=3)                                       # a new episode, same session
        assert env.get_reward() == 0.0 and env.guess(5) == "lower"
        assert oe.GuessTheNumber.counts["sessions_opened"] == 1
        env.client.close()
    finally:
        game.stop()


# ── the rollout process end to end ───────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def game_run(long_server, toy_dir):
    """Rows with targets 8 and 3, two rollouts each: (samples, metrics, server counts)."""
    game = oe.start_server(max_concurrent_envs=8)
    try:
        samples, metrics = run_game(long_server, AutoTokenizer.from_pretrained(toy_dir), game.url,
                                    [8, 3])
        wait_for_sessions_closed()
        return samples, metrics, dict(oe.GuessTheNumber.counts)
    finally:
        game.stop()


def test_an_openenv_environment_drives_the_rollouts(game_run):
    samples, metrics, counts = game_run
    assert len(samples) == 4                                      # rank_reward keeps both groups
    for s in samples:                                             # reset()'s observation
        assert s.prompt[-1]["content"] == ("Play the number game.\n"
                                           "I picked a whole number from 1 to 9. Guess it.")
        tool_answers = [m["content"] for m in s.completion if m["role"] == "tool"]
        if s.row_index == 0:                                      # target 8
            assert tool_answers == ["higher", "correct", "Error: ValueError: Game over."]
            assert s.metrics["rewards/NumberGameEnv/mean"] == 1.0  # get_reward(), its state
        else:                                                     # target 3
            assert tool_answers == ["lower", "lower", "lower"]
            assert s.metrics["rewards/NumberGameEnv/mean"] == 0.0
    calls, failed = latest(metrics, "tools/guess/call_total"), latest(
        metrics, "tools/guess/failure_total")
    assert (calls, failed) == (12, 2)
    assert counts["steps"] == calls - failed == 2 * 2 + 2 * 3     # each call a step on the server
    assert counts["episodes"] == 4                                # a reset per rollout
    group = next(m for m in metrics if "env/reset_s" in m)
    assert group["env/reset_s"] > 0 and "env/reward_s" in group
    assert group["tools/call_frequency"] == 3.0 and "tools/latency_s" in group
    assert counts["sessions_opened"] == counts["sessions_closed"]  # none left when the run ends


def test_reward_functions_read_the_environments(game_run):
    samples, _, _ = game_run
    for s in samples:
        assert s.metrics["rewards/solved/mean"] == s.metrics["rewards/NumberGameEnv/mean"]


def test_instances_are_reused_so_server_sessions_stay_bounded(long_server, tokenizer):
    game = oe.start_server(max_concurrent_envs=6)     # 12 rollouts, 2 at a time, 6 sessions
    try:
        samples, _ = run_game(long_server, tokenizer, game.url, [8, 3] * 3,
                              max_concurrent_rollouts=2)
    finally:
        game.stop()
    assert len(samples) == 12                  # no reset() refused for want of a session
    assert oe.GuessTheNumber.counts["sessions_opened"] <= 6
