"""OpenEnv environments (`openenv-core`) in episodes: `env.name=openenv:package.module:Class`.

An OpenEnv `Environment` is a Gym-style class: `reset(seed=...)` then `step(action)` -> an
`Observation` with `done` and `reward`. Each episode gets its own instance, reset with a seed
taken from the dataset row (the G episodes of a prompt start alike, and a rebuilt episode
replays the same way). The observation `reset()` returns, where it has text, is the episode's
opening message: the model reads it after the question. The model's message becomes the action's
text field; the observation's fields (less done, reward, metadata) become the reply: the one field
as it is, several as JSON.

env.args: `init` (the class's keyword arguments), `action` (the Action class as an import path;
default: the type of `step`'s action parameter), `action_field` (default: the action's one
required str field), `observation_field` (default: every field, as above), `role` (default user).

The same environment served by an OpenEnv server (env.name=openenv+http://...) is
grpo/environments/remote.py, which makes its openings and replies with the functions below.
"""

from __future__ import annotations

import json
import typing
import zlib

from grpo.environments import Reply
from grpo.rewards.registry import PROMPT_TURNS

SETTINGS = ("init", "action", "action_field", "observation_field", "role")
NOT_SHOWN = ("done", "reward", "metadata")


def openenv_factory(path: str, args: dict):
    """row -> an episode of the OpenEnv Environment class at `path` (ValueError naming what is wrong)."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action

    from grpo.common.imports import import_object

    unknown = sorted(set(args) - set(SETTINGS))
    if unknown:
        raise ValueError(f"env.args: {', '.join(unknown)} unknown for an OpenEnv environment; "
                         f"valid: {', '.join(SETTINGS)}")
    cls = import_object(path, "env.name")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"env.name: {path!r} is not an OpenEnv Environment class")
    action_cls = import_object(args["action"], "env.args.action") if "action" in args else \
        typing.get_type_hints(cls.step).get("action")
    if not (isinstance(action_cls, type) and issubclass(action_cls, Action)) or action_cls is Action:
        raise ValueError(f"env.args.action: give the Action class of {path!r} as 'package.module:Class' "
                         f"(its step() does not name one)")
    field = args.get("action_field") or _text_field(action_cls)
    init, observation_field, role = dict(args.get("init", {})), args.get("observation_field"), args.get("role", "user")
    return lambda row: OpenEnvEpisode(cls(**init), action_cls, field, observation_field, role, row)


def _text_field(action_cls) -> str:
    required = [name for name, f in action_cls.model_fields.items() if f.is_required() and f.annotation is str]
    return one_text_field(required, action_cls.__name__)


def one_text_field(required: list[str], action: str) -> str:
    """The action's field the model's message goes in: its one required str field (ValueError otherwise)."""
    if len(required) != 1:
        raise ValueError(f"env.args.action_field: {action} has {len(required)} required str fields "
                         f"({', '.join(required) or 'none'}); name the one that takes the model's message")
    return required[0]


def row_seed(row: dict) -> int:
    """A reset seed from the dataset row: the same for every episode of a prompt (the prompt's chat, which
    the row carries for the rewards, left out: a new system prompt does not change the environments)."""
    kept = {key: value for key, value in row.items() if key != PROMPT_TURNS}
    return zlib.crc32(json.dumps(kept, sort_keys=True, default=str).encode())


class OpenEnvEpisode:
    def __init__(self, env, action_cls, action_field: str, observation_field: str | None, role: str, row: dict):
        self.env, self.action_cls, self.action_field = env, action_cls, action_field
        self.observation_field, self.role = observation_field, role
        try:
            observation = self.env.reset(seed=row_seed(row))
        except BaseException:
            self.env.close()  # the episode never starts: nobody else will close it
            raise
        # what the model reads first (grpo.environments: `opening`); a reset that returns nothing shows nothing
        self.opening = self.text_of(observation, skip_empty=True) if observation is not None else None

    def close(self) -> None:
        self.env.close()  # OpenEnv's Environment.close(): what its server calls at a session's end

    def step(self, message: str) -> Reply:
        observation = self.env.step(self.action_cls(**{self.action_field: message}))
        return step_reply(observation.model_dump(mode="json"), observation.done, observation.reward,
                          self.observation_field, self.role)

    def text_of(self, observation, skip_empty: bool = False) -> str | None:
        return observation_text(observation.model_dump(mode="json"), self.observation_field, skip_empty)


def step_reply(fields: dict, done, reward, observation_field: str | None, role: str) -> Reply:
    """A step's observation (its fields, `done`, `reward`) as the Reply the model's episode gets."""
    return Reply(text=observation_text(fields, observation_field), done=bool(done),
                 reward=None if reward is None else float(reward), role=role)


def observation_text(fields: dict, observation_field: str | None = None, skip_empty: bool = False) -> str | None:
    """An observation (its fields, as `model_dump()` gives them or an OpenEnv server sends them) as the
    text the model reads: `observation_field` alone, else every field less done, reward and metadata; one
    field as it is, several as JSON. skip_empty (the opening): fields that are None or empty are left
    out, and an observation with nothing left is None, not "{}" or "None"."""
    if observation_field:
        fields = {observation_field: fields[observation_field]}
    shown = {k: v for k, v in fields.items() if k not in NOT_SHOWN
             and not (skip_empty and (v is None or (hasattr(v, "__len__") and len(v) == 0)))}
    if skip_empty and not shown:
        return None
    if len(shown) == 1:
        return str(next(iter(shown.values())))
    return json.dumps(shown, default=str)
