"""Environments for the tests, named by path: env.name=tests/scripted_envs.py:<factory>."""

import os
import socket
import time

from grpo.environments import Reply


class Scripted:
    """Replies "reply <k> to <the message's first 3 characters>" to message k (k = 1, 2, ...);
    done at message `length`; reward = the number of messages, given at the end. `opening`: a
    message the model reads before its first turn ("{answer}" becomes the row's reference answer)."""

    def __init__(self, row, length: int = 3, role: str = "user", opening: str = ""):
        self.length, self.role, self.seen = length, role, 0
        self.opening = opening.replace("{answer}", str(row.get("reference_answer")))

    def step(self, message: str) -> Reply:
        self.seen += 1
        if self.seen >= self.length:
            return Reply(done=True, reward=float(self.seen))
        return Reply(text=f"reply {self.seen} to {message[:3]!r}", role=self.role, tool_calls=1,
                     tool_errors=int(self.seen % 2 == 0))


class Unseeded(Scripted):
    """Opens each episode with "open <k>", k counting the episodes made in this process: episodes
    of one prompt open differently (a reset that ignores its seed)."""

    made = 0

    def __init__(self, row, **kwargs):
        super().__init__(row, **kwargs)
        self.opening = f"open {Unseeded.made}"
        Unseeded.made += 1


class Counter:
    """Replies "count <k>": its state is how many messages it has taken."""

    def __init__(self, row):
        self.count = 0

    def step(self, message: str) -> Reply:
        if message == "hang":
            time.sleep(3600)
        if message == "raise":
            raise RuntimeError("the tool broke")
        self.count += 1
        return Reply(text=f"count {self.count}")


class SlowCounter(Counter):
    """Counter, each step taking `delay` seconds (hangs on "hang")."""

    def __init__(self, row, delay: float = 0.6):
        super().__init__(row)
        self.delay = delay

    def step(self, message: str) -> Reply:
        time.sleep(self.delay)
        return super().step(message)


def hangs_or_raises(row, on: str = "hang", turn: int = 2):
    """A Scripted environment that hangs (or raises) at message `turn` of the problem whose
    reference answer is "1"; the other problems' episodes go on."""
    env = Scripted(row, length=4)
    step = env.step

    def faulty(message):
        if row.get("reference_answer") == "1" and env.seen + 1 == turn:
            if on == "hang":
                time.sleep(3600)
            raise RuntimeError("the tool broke")
        return step(message)
    env.step = faulty
    return env


class NetworkProbe:
    """Replies what happened when it tried to open a TCP connection."""

    def __init__(self, row):
        pass

    def step(self, message: str) -> Reply:
        try:
            socket.create_connection(("127.0.0.1", int(message)), timeout=2).close()
            return Reply(text="connected", done=True)
        except OSError as e:
            return Reply(text=f"{type(e).__name__}: {e}", done=True)


class Allocates:
    """Allocates `message` MB and says so (a MemoryError past the child's budget is the step's error)."""

    def __init__(self, row):
        pass

    def step(self, message: str) -> Reply:
        block = bytearray(int(message) * 2**20)
        return Reply(text=f"allocated {len(block) // 2**20} MB")


class SocketProbe:
    """Tries what a Python-level guard would miss: the C socket module, and a subprocess connecting."""

    def __init__(self, row):
        pass

    def step(self, message: str) -> Reply:
        import _socket
        import subprocess
        import sys

        results = []
        try:
            _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM).connect(("127.0.0.1", int(message)))
            results.append("_socket connected")
        except OSError as e:
            results.append(f"_socket {type(e).__name__}")
        import ctypes
        import os

        fd = ctypes.CDLL(None).syscall(41, (1 << 32) | 2, 1, 0)  # socket(AF_INET) with junk in the high bits
        results.append("raw socket refused" if fd < 0 else "raw socket made")
        if fd >= 0:
            os.close(fd)
        code = f"import socket; socket.create_connection(('127.0.0.1', {int(message)}), timeout=2)"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        results.append("subprocess connected" if proc.returncode == 0 else "subprocess refused")
        return Reply(text=", ".join(results), done=True)


class PausesOnce:
    """Scripted, but at message 2 while `pause_file` exists it writes `pause_file`.hit and waits
    there (for the test to kill the sampler mid-episode)."""

    def __init__(self, row, pause_file: str):
        self.env, self.pause_file = Scripted(row, length=3), pause_file

    def step(self, message: str) -> Reply:
        if self.env.seen == 1 and os.path.exists(self.pause_file):
            open(self.pause_file + ".hit", "w").close()
            time.sleep(3600)
        return self.env.step(message)


class Secret:
    """Draws a secret number when it is made and shows it in every reply ("secret=<n>, message <k>"); a
    message holding "hang" hangs. Unseeded (the default) it draws from the operating system, as an
    environment that ignores its seed does: made again, it holds another secret. seeded: drawn from the
    row's question, the same every time."""

    def __init__(self, row, seeded: bool = False):
        import random

        draw = random.Random(str(row.get("question"))) if seeded else random.SystemRandom()
        self.secret, self.seen = draw.randrange(10**9), 0

    def step(self, message: str) -> Reply:
        if "hang" in message:
            time.sleep(3600)
        self.seen += 1
        return Reply(text=f"secret={self.secret}, message {self.seen}")


class WinOrLose:
    """A game scored +1 or -1: a message holding "win" wins, one holding "lose" loses (either ends the
    episode); any other is answered "go on", with `step_reward` (none by default)."""

    def __init__(self, row, step_reward: float | None = None):
        self.step_reward = step_reward

    def step(self, message: str) -> Reply:
        if "win" in message:
            return Reply(done=True, reward=1.0)
        if "lose" in message:
            return Reply(done=True, reward=-1.0)
        return Reply(text="go on", reward=self.step_reward)


class LongReplies:
    """Replies `words` words ("w0 w1 ...": about 2 tokens a word on a byte-level BPE, 3 characters
    each on the tests' character tokenizer) to each message; done at message `length`, with no reward.
    `only`: the long reply goes to the problems with this reference answer, the others get "ok"."""

    def __init__(self, row, words: int = 50, length: int = 3, only: str | None = None):
        self.words, self.length, self.seen = words, length, 0
        self.long = only is None or str(row.get("reference_answer")) == only

    def step(self, message: str) -> Reply:
        self.seen += 1
        if self.seen >= self.length:
            return Reply(done=True)
        return Reply(text=" ".join(f"w{k % 10}" for k in range(self.words)) if self.long else "ok")


class Results:
    """Replies message k with `results[k - 1]` (a text, or a list of texts: several messages, as a
    message's tool calls get) in `role`; done at the message after the last result."""

    def __init__(self, row, results: list, role: str = "tool"):
        self.results, self.role, self.seen = results, role, 0

    def step(self, message: str) -> Reply:
        self.seen += 1
        if self.seen > len(self.results):
            return Reply(done=True)
        return Reply(text=self.results[self.seen - 1], role=self.role)


class Slow(Scripted):
    """Scripted, each step taking `delay` seconds (a tool that waits on something)."""

    def __init__(self, row, delay: float = 0.2, **kwargs):
        super().__init__(row, **kwargs)
        self.delay = delay

    def step(self, message: str) -> Reply:
        time.sleep(self.delay)
        return super().step(message)
