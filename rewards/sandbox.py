"""Reward functions in a child process (common/child.py), so that one that hangs on a sample can be
stopped: a hang costs that sample's score (it fails there: rewards.on_failure), never the run.

The child is forked, so it has every function in `REWARD_FUNCTIONS` and every imported user module
as the parent had them (a test's too); a row must be JSON (the data loader keeps only JSON values).
On a timeout the child is killed, with every process the reward started (the child is a session
of its own, ended as one), and a fresh one forked for the next call; a batched reward gets
`rewards.timeout_s` per completion. The child sees the environment variables every child does
(common/child.py: PATH, HOME, LANG, LC_*, its own TMPDIR) and the ones named in `pass_env`.
"""

from __future__ import annotations

from common.child import Child, ChildFailed
from rewards.registry import get_reward


class RewardFailed(ChildFailed):
    """The function raised in the child (`where`: the line), or did not answer within the timeout."""


def _rewards(pipe_fd: int):
    """The child's handler: [name, completion, row] -> the reward (a list for a batched one)."""
    def score(request):
        name, completion, row = request
        value = get_reward(name)(completion, row)
        return [_number(v) for v in value] if isinstance(completion, list) else _number(value)
    return score, "ready"


def _number(value) -> float | None:
    return None if value is None else float(value)


class RewardSandbox:
    def __init__(self, timeout_s: float, pass_env=()):
        self.timeout_s = timeout_s
        self._child = Child("rewards", _rewards, pass_env=pass_env)

    def __call__(self, name: str, completion: str | list[str], row: dict | list[dict]):
        """One sample's reward, or a batched reward's list (completion and row are then lists)."""
        if not self._child.alive():  # killed from outside, or crashed in C
            self._child.restart()
        batched = isinstance(completion, list)
        limit = self.timeout_s * (len(completion) if batched else 1)
        try:
            return self._child.call([name, completion, row], limit, f"no answer within rewards.timeout_s="
                                    f"{self.timeout_s:g} s" + (" per completion" if batched else ""))
        except ChildFailed as e:
            raise RewardFailed(str(e), e.where) from None

    def close(self) -> None:
        self._child.close()
