"""tests/openenv_envs.py's SlowGuessNumber as an OpenEnv service (OpenEnv's own server: create_app under uvicorn):

    uvicorn --app-dir tests openenv_server:app --host 127.0.0.1 --port 8000

then env.name=openenv+http://127.0.0.1:8000 (docs/environments.md; tests/test_openenv_http.py runs it)."""

from openenv.core.env_server.http_server import create_app
from openenv_envs import GuessAction, GuessObservation, SlowGuessNumber

MAX_SESSIONS = 64  # one session per live episode: at least prompts_per_step * group_size, and some to spare

app = create_app(SlowGuessNumber, GuessAction, GuessObservation, max_concurrent_envs=MAX_SESSIONS)
