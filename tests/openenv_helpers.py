"""What tests/test_openenv.py shares with the rollout process it spawns (which imports what it runs
by name, so all of it is module level): a tiny OpenEnv environment, guess-the-number, in OpenEnv's
own three pieces, and the environment_factory class that TRL's OpenEnv guide would write for it.

    server side   GuessAction / GuessObservation (openenv Action, Observation), GuessTheNumber
                  (openenv Environment: reset, step, state), served by openenv's create_app
    client side   GuessClient (openenv EnvClient over the server's /ws WebSocket), used through
                  its .sync() wrapper as the guide's wrappers use theirs
    the wrapper   NumberGameEnv: __init__ makes the client (its first reset connects: one server
                  session per instance), reset(**row) starts an episode and returns its
                  observation, guess() is the one tool (it calls step);
                  get_reward() and .reward are the two ways a trainer reads the outcome

    reset(target=8)  → "I picked a whole number from 1 to 9. Guess it."
    then guess(5) → "higher", guess(8) → "correct", guess(2) → ValueError("Game over.")

Every server-side environment counts into GuessTheNumber.counts (sessions opened and closed,
episodes, steps), read by the test in the process that serves it.
"""
import threading
import time
from collections import Counter
from dataclasses import dataclass

import uvicorn
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_app

from rollout import AsyncRolloutLoop
from rollout.samples import TurnRecord


# ── the server side ───────────────────────────────────────────────────────────────────────────


class GuessAction(Action):
    number: int


class GuessObservation(Observation):
    message: str = ""


class GuessTheNumber(Environment):
    """One session's game: reset(target) hides a number, each step compares a guess with it."""
    SUPPORTS_CONCURRENT_SESSIONS = True     # each WebSocket session gets its own instance
    counts: Counter = Counter()             # over every instance this process has served
    lock = threading.Lock()                 # sessions run on the server's threads

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self._target = 0
        self.count("sessions_opened")

    @classmethod
    def count(cls, what: str) -> None:
        with cls.lock:
            cls.counts[what] += 1

    def reset(self, seed=None, episode_id=None, target: int = 5, **kwargs) -> GuessObservation:
        self._target = target
        self._state = State(episode_id=episode_id, step_count=0)
        self.count("episodes")
        return GuessObservation(message="I picked a whole number from 1 to 9. Guess it.",
                                reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        self.count("steps")
        if action.number == self._target:
            return GuessObservation(message="correct", done=True, reward=1.0)
        hint = "higher" if action.number < self._target else "lower"
        return GuessObservation(message=hint, reward=0.0)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        self.count("sessions_closed")


@dataclass
class GameServer:
    """openenv's app for GuessTheNumber, served by uvicorn on 127.0.0.1 in a thread of this
    process (start_server)."""
    url: str                      # http://127.0.0.1:<port>; the client speaks ws:// to <url>/ws
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(max_concurrent_envs: int) -> GameServer:
    """A fresh server (GuessTheNumber.counts zeroed) on a free port, answering once it returns."""
    GuessTheNumber.counts.clear()
    app = create_app(GuessTheNumber, GuessAction, GuessObservation, env_name="guess_the_number",
                     max_concurrent_envs=max_concurrent_envs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="openenv-server", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the OpenEnv server did not start (see its log above)")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return GameServer(f"http://127.0.0.1:{port}", server, thread)


def active_sessions() -> int:
    counts = GuessTheNumber.counts
    return counts["sessions_opened"] - counts["sessions_closed"]


# ── the client side ───────────────────────────────────────────────────────────────────────────


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    """The game's OpenEnv client: actions and observations as the server's JSON."""

    def _step_payload(self, action: GuessAction) -> dict:
        return {"number": action.number}

    def _parse_result(self, payload: dict) -> StepResult[GuessObservation]:
        observation = GuessObservation(**payload.get("observation", {}),
                                       done=payload.get("done", False),
                                       reward=payload.get("reward"))
        return StepResult(observation, reward=payload.get("reward"), done=observation.done)

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


# ── the environment_factory class, in the style of TRL's OpenEnv guide ───────────────────────


class NumberGameEnv:
    """An environment_factory class over the OpenEnv server at `base_url` (bind it with
    functools.partial: the factory is then a picklable no-argument callable)."""

    def __init__(self, base_url: str):
        self.client = GuessClient(base_url=base_url).sync()
        self.reward = 0.0
        self.done = False

    def reset(self, target: int, **row) -> str:
        result = self.client.reset(target=target)
        self.reward = 0.0
        self.done = False
        return result.observation.message

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: The guess, a whole number from 1 to 9.

        Returns:
            "higher" or "lower" (where the hidden number lies), or "correct".
        """
        if self.done:
            raise ValueError("Game over.")
        result = self.client.step(GuessAction(number=number))
        self.reward = float(result.reward or 0.0)
        self.done = result.done
        return result.observation.message

    def get_reward(self) -> float:
        return self.reward


def solved(completions, environments=None, **kwargs) -> list[float | None]:
    """The guide's reward function: each rollout's outcome, read off its environment. Without
    `environments` it scores nothing (None: NaN, the rollout unscored by this source)."""
    if environments is None:
        return [None] * len(completions)
    return [env.reward for env in environments]


# ── a model that plays: the toy model rarely writes a well-formed call by itself ─────────────


class ScriptedGuessLoop(AsyncRolloutLoop):
    """Turn k (k tool responses in the prompt so far) calls guess(GUESSES[k]); after the last one
    the model says it is done. Target 8: higher, correct, Game over. Target 3: lower, 3 times."""
    GUESSES = (5, 8, 8)

    async def generate_one_turn(self, prompt_ids):
        k = list(prompt_ids).count(self.tokenizer.convert_tokens_to_ids("<tool_response>"))
        text = "Done."
        if k < len(self.GUESSES):
            call = f'{{"name": "guess", "arguments": {{"number": {self.GUESSES[k]}}}}}'
            text = f"<tool_call>{call}</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(list(prompt_ids), ids, [-0.5] * len(ids))
