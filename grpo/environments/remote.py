"""OpenEnv environments as services: `env.name=openenv+http://host:port` (or openenv+https://host[:port][/path]).

The server is OpenEnv's own (`openenv.core.env_server.http_server.create_app` under uvicorn, an
environment's Docker image, a Hugging Face Space) and so is the client (`GenericEnvClient`, its websocket
session protocol at `<url>/ws`), which runs in the sampler process: the network is the point, so it is not
the environments' network-less child. At start GET `<url>/schema` tells the action's text field (its one
required str field, or env.args action_field); a server that does not answer is a ConfigError naming the
address. Each episode is one session: connect, `reset(seed=row_seed(row))` (the G episodes of a prompt
start alike; the reset observation is the opening, made as the in-process adapter makes it), one `step`
per model message (the message in the text field), `close` at the episode's end.

Every call has its own env.timeout_s. One that fails (no reply in time, the server's error, a lost
connection) costs its episode an error message, as in grpo/environments/pool.py, and the session is
dropped: the episode's next step rebuilds it on a new session by replaying its earlier messages, so a
restarted server recovers. A session whose connection closed between calls (the server restarted) is
rebuilt before the step, at no cost. A rebuilt session's opening and replayed replies are checked
against what the episode was shown, as the child pool checks them: one that differs ends the episode
(ReplayMismatch). A server found unreachable, or that let two calls in a row run
past their time limit, is not called again for RETRY_AFTER_S: meanwhile the turn's other episodes fail
at once instead of each waiting out a time limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from grpo.environments import Reply
from grpo.environments.openenv_adapter import observation_text, one_text_field, row_seed, step_reply
from grpo.environments.pool import Replays, failed_reply, opening_of, valid_text
from grpo.settings.tree import ConfigError

log = logging.getLogger(__name__)

PREFIX = "openenv+"
FORM = "openenv+http://host:port (or openenv+https://host[:port][/path])"
SETTINGS = ("action_field", "observation_field", "role")  # env.args of a served environment
RETRY_AFTER_S = 2.0  # a server found unreachable or hung is not tried again sooner: its other episodes fail at once
HANG_UP_S = 1.0  # a session's goodbye at most; a server that has not closed it by then is cut off
GRACE_S = 5.0  # the caller's wait past a call's own limit, should the clients' event loop itself be stuck


class RemoteFailed(Exception):
    """A call to the environment server that failed: no reply in time, its error, a lost connection."""


def is_served(name: str) -> bool:
    return name.startswith(PREFIX)


def server_url(name: str, args: dict) -> str:
    """The server's base URL in env.name; ValueError naming the form, or env.args' unknown keys."""
    unknown = sorted(set(args) - set(SETTINGS))
    if unknown:
        raise ValueError(f"env.args: {', '.join(unknown)} unknown for an OpenEnv server; valid: {', '.join(SETTINGS)}")
    url = name.removeprefix(PREFIX)
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.port == 0:  # reading the port raises for one that is not a number in range
            raise ValueError("port 0")
    except ValueError as e:
        raise ValueError(f"env.name: {name!r} is not a server address ({e}); write {FORM}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"env.name: {name!r} is not a server address; write {FORM}")
    return url.rstrip("/")


def remote_factory(name: str, args: dict):
    """row -> an episode on the server env.name names (environment_factory's form). The address and
    env.args are checked now; the server is first contacted by the first episode."""
    server = Server(server_url(name, args), args)
    return lambda row: RemoteEpisode(server, row)


class Server:
    """An OpenEnv server: its address, the action field the model's message goes in, and the event
    loop (one thread) its sessions' clients run on, which also answers the server's keepalive pings
    while the sampler generates."""

    def __init__(self, url: str, args: dict, timeout_s: float = 10.0):
        self.url, self.timeout_s = url, timeout_s
        self.action_field, self.observation_field = args.get("action_field"), args.get("observation_field")
        self.role = str(args.get("role", "user"))
        self.checked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down_until, self._down_why = 0.0, ""
        self._timeouts = 0  # calls in a row that ran past env.timeout_s

    # -------------------------------------------------------------------------- at start
    def check(self) -> None:
        """GET /schema within env.timeout_s: the server answers, its action has the text field and its
        observation the env.args observation_field (ConfigError naming the address otherwise)."""
        schema = self._schema()
        action, observation = schema.get("action") or {}, schema.get("observation") or {}
        fields, shown = action.get("properties") or {}, observation.get("properties") or {}
        if self.action_field is None:
            required = [f for f in action.get("required", []) if (fields.get(f) or {}).get("type") == "string"]
            try:
                self.action_field = one_text_field(required, f"the action of {self.url}")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.action_field not in fields:
            raise ConfigError(f"env.args.action_field: the action of {self.url} has no field {self.action_field!r} "
                              f"(its fields: {', '.join(fields)})")
        if self.observation_field and self.observation_field not in shown:
            raise ConfigError(f"env.args.observation_field: the observation of {self.url} has no field "
                              f"{self.observation_field!r} (its fields: {', '.join(shown)})")
        self.checked = True

    def _schema(self) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url}/schema", timeout=self.timeout_s) as response:
                schema = json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise ConfigError(f"env.name: {self.url} does not answer as an OpenEnv server (GET /schema: HTTP "
                              f"{e.code})") from None
        except (urllib.error.URLError, OSError) as e:  # refused, no such host, no answer within env.timeout_s
            raise ConfigError(f"env.name: no OpenEnv server answers at {self.url} ({getattr(e, 'reason', e)}); "
                              "start it first (docs/environments.md, Environments as services) or correct the "
                              "address") from None
        except ValueError as e:
            raise ConfigError(f"env.name: {self.url} does not answer as an OpenEnv server (GET /schema: {e})") from None
        if not isinstance(schema, dict):
            raise ConfigError(f"env.name: {self.url} does not answer as an OpenEnv server (GET /schema: not an object)")
        return schema

    # -------------------------------------------------------------------------- calls
    def call(self, coroutine, what: str):
        """`coroutine` on the clients' loop within env.timeout_s; RemoteFailed saying what failed. After
        two calls in a row ran past it (one slow episode is that episode's own), the server is not
        called again for RETRY_AFTER_S: a server that accepts connections and then hangs costs a turn
        two time limits, not one per episode."""
        wait = self._down_until - time.monotonic()
        if wait > 0:
            coroutine.close()
            raise RemoteFailed(f"{self._down_why} (not tried again for {wait:.1f} s)")
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coroutine, self.timeout_s), self._running_loop())
        try:
            answer = future.result(self.timeout_s + GRACE_S)
            self._timeouts = 0
            return answer
        except TimeoutError:
            future.cancel()
            self._timeouts += 1
            why = f"no reply from {self.url} within env.timeout_s={self.timeout_s:g} s"
            if self._timeouts >= 2:
                self._mark_down(why)
            raise RemoteFailed(why) from None
        except Exception as e:
            raise RemoteFailed(f"{what} {self.url}: {_described(e)}") from None

    def _mark_down(self, why: str) -> None:
        self._down_until, self._down_why = time.monotonic() + RETRY_AFTER_S, why

    def connect(self, client) -> None:
        """A new session's connection; a server found unreachable is not tried again for RETRY_AFTER_S."""
        try:
            self.call(client.connect(), "connecting to")
        except RemoteFailed as e:
            if self._down_until <= time.monotonic():
                self._mark_down(str(e))
            raise

    def hang_up(self, clients: list, patient: bool = True) -> None:
        """Sessions ended, all at once: OpenEnv's close message, then the connection closed (HANG_UP_S at
        most: a server that does not answer is cut off; at once after a failed call, `patient` False:
        its server is busy or gone). Never raises."""
        if not clients or self._loop is None:
            return
        wait_s = HANG_UP_S if patient else 0.0
        future = asyncio.run_coroutine_threadsafe(_hang_up_all(clients, wait_s), self._loop)
        try:
            future.result(wait_s + 2 * GRACE_S)
        except Exception as e:
            log.warning("closing %d sessions on %s: %s", len(clients), self.url, _described(e))

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = self._loop = asyncio.new_event_loop()
            threading.Thread(target=_run_forever, args=(loop,), name="openenv-client", daemon=True).start()
        return self._loop

    def stop(self) -> None:
        """The clients' loop ends (its sessions hung up first)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()
    loop.close()


def _described(e: BaseException) -> str:
    from websockets.exceptions import ConnectionClosed

    if isinstance(e, ConnectionClosed):
        return f"the connection was lost ({e})"
    if "CAPACITY_REACHED" in str(e):  # OpenEnv's code for a server holding max_concurrent_envs sessions
        return f"{e}: start it with a larger max_concurrent_envs (docs/environments.md)"
    return str(e) or type(e).__name__


async def _hang_up_all(clients: list, wait_s: float) -> None:
    await asyncio.gather(*(_hang_up(client, wait_s) for client in clients))


async def _hang_up(client, wait_s: float = HANG_UP_S) -> None:
    """OpenEnv's close message, then the server closes the connection (after closing the environment);
    one that has not within HANG_UP_S is cut off. EnvClient.disconnect() closes from this side at once,
    racing the server's own close: a traceback in the server's log for every session."""
    ws, client._ws = getattr(client, "_ws", None), None  # openenv's EnvClient keeps its connection here
    if ws is None:
        return
    try:
        await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), wait_s or GRACE_S)
        await asyncio.wait_for(ws.wait_closed(), wait_s)
    except Exception:  # already lost, or no answer (a step still running there)
        ws.transport.abort()


class RemoteEpisode:
    """One episode on the server, one session: grpo.environments' interface (`opening`, `step`,
    `close`). Any call that fails raises RemoteFailed."""

    def __init__(self, server: Server, row: dict):
        from openenv.core.generic_client import GenericEnvClient  # seconds to import: not at config time

        if not server.checked:
            server.check()
        self.server = server
        self.client = GenericEnvClient(base_url=server.url, connect_timeout_s=server.timeout_s,
                                       message_timeout_s=server.timeout_s)
        try:
            server.connect(self.client)
            result = server.call(self.client.reset(seed=row_seed(row)), "reset at")
            self.opening = self._read(lambda: observation_text(result.observation, server.observation_field,
                                                               skip_empty=True))
        except BaseException:
            self.server.hang_up([self.client], patient=False)  # the episode never starts: nobody else will close it
            raise

    def step(self, message: str) -> Reply:
        s = self.server
        result = s.call(self.client.step({s.action_field: message}), "step at")
        reply = self._read(lambda: step_reply(result.observation, result.done, result.reward, s.observation_field,
                                              s.role))
        reply.text = valid_text(reply.text)
        return reply

    def _read(self, read):
        """An observation as text; one the client cannot read is the call's failure, not the run's."""
        try:
            return read()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RemoteFailed(f"{self.server.url} sent an observation the client cannot read "
                               f"({type(e).__name__}: {e})") from None

    @property
    def lost(self) -> bool:
        """The connection closed since the last call (the server restarted, or dropped the session)."""
        from websockets.protocol import State

        ws = getattr(self.client, "_ws", None)
        return ws is None or ws.state is not State.OPEN

    def close(self) -> None:
        self.server.hang_up([self.client])


class RemotePool(Replays):
    """EnvironmentPool's interface (grpo/environments/pool.py: open, step, forget, close) over an OpenEnv
    server's sessions, one per live episode. A failed call is the episode's error message and drops its
    session; its next step rebuilds it on a new session, replaying its earlier messages one call at a
    time, each within env.timeout_s (a failed message is not replayed), each reply checked against what
    the episode was shown (ReplayMismatch when it differs)."""

    isolation = "server"  # the environments run in the server's process, not in a child of the sampler

    def __init__(self, name: str, args: dict, timeout_s: float, announce: bool = True):
        self.server = Server(server_url(name, args), args, timeout_s)
        self.server.check()  # at start: a server that does not answer is a ConfigError naming its address
        self._episodes: dict[str, RemoteEpisode] = {}  # rebuilt on a new session after a failure or a lost connection
        if announce:  # else another lane of the same server (grpo/environments/lanes.py) said it
            log.info("environments run on the OpenEnv server at %s: one session per episode, the model's message in "
                     "the action's %r field", self.server.url, self.server.action_field)

    def open(self, key: str, row: dict) -> tuple[str | None, str | None]:
        """Start episode `key` from its dataset row: (its opening message or None, the failure or None)."""
        self.forget([key])
        try:
            self._episodes[key] = RemoteEpisode(self.server, row)
        except RemoteFailed as e:
            return None, str(e)
        return opening_of(self._episodes[key]), None

    def step(self, key: str, row: dict, history: list[str], message: str,
             shown: list[str | None] | None = None) -> tuple[Reply, str | None]:
        """The environment's reply to `message` in episode `key` (its earlier messages: `history`);
        on a failure, (an error message for the model, the failure). `shown`: the digests of what the
        episode was shown (grpo.environments.pool.shown_digest), its opening then the reply to each
        message of `history`; a rebuilt session that answers otherwise raises ReplayMismatch (None:
        not checked)."""
        episode = self._episodes.get(key)
        if episode is not None and episode.lost:  # the server closed it between calls: rebuilt, at no cost
            self.forget([key])
            episode = None
        try:
            return (episode or self._rebuilt(key, row, history, shown)).step(message), None
        except RemoteFailed as e:
            self.forget([key], patient=False)  # rebuilt from its messages at its next step
            return failed_reply(str(e)), str(e)

    def _rebuilt(self, key: str, row: dict, history: list[str], shown: list[str | None] | None) -> RemoteEpisode:
        """Episode `key` on a new session, its earlier messages replayed and checked against `shown`."""
        episode = self._episodes[key] = RemoteEpisode(self.server, row)
        self.replay(shown, opening_of(episode), history, episode.step, lambda: self.forget([key]))
        return episode

    def forget(self, keys: list[str], patient: bool = True) -> None:
        """End episodes' sessions (all at once)."""
        self.server.hang_up([self._episodes.pop(key).client for key in keys if key in self._episodes], patient)

    def close(self) -> None:
        self.forget(list(self._episodes))
        self.server.stop()
