"""Real OpenEnv environments for the adapter's tests (env.name=openenv:tests/openenv_envs.py:GuessNumber) and
for the served ones' (tests/openenv_server.py serves SlowGuessNumber)."""

import os
import random
import re
import time
from pathlib import Path

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessNumber(Environment):
    """Guess a number in [low, high]: "higher" / "lower" until right (reward 1) or out of tries (0)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # instances share nothing: a server may hold many sessions

    def __init__(self, low: int = 0, high: int = 9, tries: int = 3, closed_log: str = ""):
        super().__init__()
        self.low, self.high, self.tries, self.closed_log = low, high, tries, closed_log

    def close(self) -> None:
        if self.closed_log:  # one line per close, from the environments' child process
            with open(self.closed_log, "a") as f:
                f.write(f"{self._state.episode_id}\n")

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target = random.Random(seed).randint(self.low, self.high)
        self._state = State(episode_id=episode_id or str(random.random()), step_count=0)
        return GuessObservation(feedback=f"guess a number from {self.low} to {self.high}")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        found = re.findall(r"-?\d+", action.guess)
        if not found:
            return GuessObservation(feedback="say a number", done=self._state.step_count >= self.tries, reward=0.0)
        guess = int(found[-1])
        if guess == self.target:
            return GuessObservation(feedback="right", done=True, reward=1.0)
        return GuessObservation(feedback="higher" if guess < self.target else "lower",
                                done=self._state.step_count >= self.tries, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class SlowGuessNumber(GuessNumber):
    """GuessNumber whose step first sleeps the seconds a message asks for ("wait 2.5"; the message is then a
    guess as usual), touching the file named by $OPENENV_TEST_WAITING as it starts to wait."""

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        wait = re.match(r"wait (\d+(?:\.\d+)?)", action.guess)
        if wait:
            if os.environ.get("OPENENV_TEST_WAITING"):
                Path(os.environ["OPENENV_TEST_WAITING"]).touch()
            time.sleep(float(wait.group(1)))
        return super().step(action)
