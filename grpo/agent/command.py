"""agent.command: your agent as a program, one process per session, in the jail the model's code runs in.

Each session's command runs as one jailed call (grpo/common/jail.py): a folder of its own as its working folder
and home, none of the run's files (its data, its reference answers, its weights), a network of its own whose
only way out is 127.0.0.1:<the endpoint's port>, relayed to the endpoint (grpo/common/jail_relay.py; TCP connects
to that port alone, no UDP, no other family, no listening: the trainer's sockets are closed to it), budgets of
memory, processes and CPU (agent.memory_mb, max_processes, cpu_s). It gets OPENAI_BASE_URL (its session's /v1)
and OPENAI_API_KEY, and its dataset row as one JSON line on stdin (read once: a process it starts later cannot
read it again). Its reward is what it POSTs to $OPENAI_BASE_URL/reward (once), else the run's rewards on its last
message; a command that exits with another status than 0 fails its session, and what it posted is dropped. A
session past its time limit, or one that never opened, has its command killed with every process it started. A
warden (one jail) serves one session at a time; they are kept between steps, as many as sessions ran at once.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path

from grpo.agent.harness import HarnessError
from grpo.common.child import ChildFailed, ChildRefused
from grpo.common.jail import Jail, JailLimits, jail_description

log = logging.getLogger(__name__)
TARGET = "command"


def command_words(command: str | list[str]) -> list[str]:
    """The command line's words (a list is taken as it is): a leading `python` (or `python3`) is this environment's
    interpreter, a program found on PATH is named by its path, and a word that names a file here is made absolute
    (the command runs in a folder of its own)."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    if words and words[0] in ("python", "python3"):
        words[0] = sys.executable
    elif words and "/" not in words[0] and shutil.which(words[0]):
        words[0] = shutil.which(words[0])
    # absolute, links kept: a venv's bin/python is a link whose own path tells Python its environment
    return [str(Path(w).absolute()) if not w.startswith("-") and Path(w).is_file() else w for w in words]


def readable_paths(words: list[str], readable: list[str] = ()) -> tuple[str, ...]:
    """What the command may read besides the system's, the interpreter's and the project's files: the files its
    command line names (its program, its script; never a folder: `.` would open the run's), the paths of
    agent.readable, and the system's public certificates (an HTTP client builds its TLS context when it starts,
    even for plain HTTP)."""
    named = [w for w in words if os.path.isabs(w) and os.path.isfile(w) and w != sys.executable]
    return tuple(dict.fromkeys([*named, *(str(Path(p).resolve()) for p in readable), *CERTIFICATES]))


CERTIFICATES = ("/etc/ssl", "/etc/ca-certificates", "/etc/pki")


def verifiers_command(env: str, args: dict, model_name: str, readable: list[str]) -> tuple[list[str], list[str]]:
    """agent.verifiers as a command: (the words of its rollout script in .venv-verifiers, what its jail reads)."""
    from grpo.common.verifiers_bridge import readable_for, script_words

    return script_words("rollout", env, args, model_name), [*readable, *readable_for(env)]


class AgentCommand:
    """The harness of agent.command: called per session with (row, base_url, api_key) on the session's thread
    (grpo/agent/harness.py), it runs the command in a jail of the pool and returns None (its reward is what it
    posted); `stop(api_key)` kills a session's command; `close()` ends every jail."""

    # a command that fails loses the reward posted during it: a process the model's code started in its jail (a
    # tool that runs code, say) may have posted it, and its harness then found the reward taken (a reward is posted
    # once) or was killed
    failure_voids_reward = True

    def __init__(self, command: str | list[str], port: int, timeout_s: float, memory_mb: int = 2048,
                 max_processes: int = 64, cpu_s: int = 600, readable: list[str] = ()):
        self.words = command_words(command)
        self.timeout_s = timeout_s
        self.limits = JailLimits(memory_mb=memory_mb, max_processes=max_processes, cpu_s=cpu_s,
                                 readable=readable_paths(self.words, readable), connect_port=port)
        self._idle: list[Jail] = []
        self._running: dict[str, Jail] = {}
        self._stopped: set[str] = set()  # sessions stopped before their command started
        self._closed = False
        self._jails = 0
        self._lock = threading.Lock()
        # a warden dies with the thread that started it (its parent-death signal is a thread's): all are started
        # from this one, which lives as long as the pool, never from a session's thread
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="agent-jails")

    def __call__(self, row: dict, base_url: str, api_key: str) -> None:
        jail = self._take()
        with self._lock:
            if api_key in self._stopped or self._closed:
                self._stopped.discard(api_key)
                if self._closed:  # the pool's jails are closed already: this one too
                    jail.close()
                else:
                    self._idle.append(jail)
                raise HarnessError("the agent command was stopped before it started")
            self._running[api_key] = jail
        restarts = jail.restarts
        environment = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
                       "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1"}
        try:
            status = jail.call(TARGET, [self.words, environment, json.dumps(row, default=str)], self.timeout_s,
                               f"the agent command ran past agent.session_timeout_s={self.timeout_s:g} s")
        except (ChildFailed, ChildRefused, OSError, ValueError) as e:  # OSError: its jail closed meanwhile
            raise HarnessError(f"the agent command failed: {e}") from None
        finally:
            with self._lock:
                self._running.pop(api_key, None)
                self._stopped.discard(api_key)  # a stop that came as it ended
                # a warden started again on this thread would die with it: not kept
                if jail.alive and jail.restarts == restarts:
                    self._idle.append(jail)
                else:
                    jail.close()
        if status != 0:
            raise HarnessError(f"the agent command exited with status {status} (its output is in the sampler's log, "
                               "marked [jailed call])")
        return None

    def _take(self) -> Jail:
        with self._lock:
            if self._closed:
                raise HarnessError("the agent command was stopped before it started: the sampler is closing")
            while self._idle:
                jail = self._idle.pop()
                if jail.alive:
                    return jail
                jail.close()
        try:
            jail = self._starter.submit(Jail, "agent", f"{__name__}:resolve", [TARGET], self.limits).result()
        except (CancelledError, RuntimeError):  # RuntimeError: submitted after the pool shut down
            raise HarnessError("the agent command was stopped before it started: the sampler is closing") from None
        except ChildRefused as e:
            raise HarnessError(f"the agent command's jail could not start: {e}") from None
        with self._lock:
            self._jails += 1
            first = self._jails == 1
            if self._closed:  # closed while it started: it is not handed out
                jail.close()
                raise HarnessError("the agent command was stopped before it started: the sampler is closing")
        if first:
            log.info("agent.command runs each session in a jail: %s; TCP to port %d alone", jail_description(jail.info),
                     self.limits.connect_port)
        return jail

    def stop(self, api_key: str) -> None:
        """The session's command killed, with every process it started (its jail stays for the next session); one
        not started yet never starts."""
        with self._lock:  # held while killing: the jail cannot pass to another session meanwhile
            jail = self._running.get(api_key)
            if jail is None:
                self._stopped.add(api_key)
            else:
                jail.end_call()

    def close(self) -> None:
        """Every command killed, then every jail closed; none starts after."""
        with self._lock:
            self._closed = True
            for jail in self._running.values():
                jail.end_call()
        self._starter.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._running and time.monotonic() < deadline:  # their sessions' threads hand them back
            time.sleep(0.01)
        with self._lock:
            jails, self._idle = [*self._idle, *self._running.values()], []
        for jail in jails:
            jail.close()


CLOSE_WAIT_S = 2.0


# ----------------------------------------------------------------------------- in the jail

def resolve(target: str):
    if target != TARGET:
        raise ValueError(f"the agent's jail runs its command alone, not {target!r}")
    return run_command


def run_command(words: list[str], environment: dict[str, str], row: str) -> int:
    """In the session's jailed call: the command, its row on stdin, its output the call's (shown in the log); its
    exit status."""
    import subprocess

    # the warden's PYTHONSAFEPATH (no working folder on its import path) is not the program's: a script imports
    # the modules beside it, as it would run anywhere
    passed = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run(words, input=(row + "\n").encode(), env={**passed, **environment}, check=False)
    return done.returncode
