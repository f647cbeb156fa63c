"""An OpenEnv service whose environment is not deterministic (OpenEnv's own server: create_app under uvicorn):
its secret is drawn at reset from the operating system, whatever the seed, so a session rebuilt after it
was lost holds another one (tests/test_openenv_http.py: the replay is caught).

    uvicorn --app-dir tests openenv_secret_server:app --host 127.0.0.1 --port 8001
"""

import random

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State
from openenv_envs import GuessAction, GuessObservation


class UnseededSecret(Environment):
    """Opens with "find the secret"; replies "secret=<n>, message <k>" to message k, reward 0."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret = random.SystemRandom().randrange(10**9)  # the seed is ignored
        self._state = State(episode_id=episode_id or str(self.secret), step_count=0)
        return GuessObservation(feedback="find the secret")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        return GuessObservation(feedback=f"secret={self.secret}, message {self._state.step_count}", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(UnseededSecret, GuessAction, GuessObservation, max_concurrent_envs=16)
