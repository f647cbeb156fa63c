"""Environments: what answers the model between its turns (tools, feedback, games).

An episode starts from a dataset row's prompt. The model speaks (one assistant message, ended by
EOS); the environment's `step(message)` returns a `Reply`: text for the model's next turn (a tool
result, feedback), whether the episode is over, an optional reward, and how many tool calls it
served and how many failed. The episode runner (grpo/sampler/episodes.py) keeps the environment's tokens
in the completion as context and out of the loss.

An environment is a class (or factory) `make(row: dict, **env.args)` -> an object with
`step(message: str) -> Reply` and optionally `opening` (a str: a message the model reads after the
question before its first turn, the same for the G episodes of a prompt); one instance per episode,
stepped in a child process (grpo/environments/pool.py) with a time limit and no network. `env.name` picks it:
  calculator                           the shipped GSM8K example (grpo/environments/calculator.py)
  tools                                Python functions as tools, env.tools (grpo/environments/tools.py);
                                       the name env.tools alone picks
  openenv:package.module:Class         an OpenEnv `Environment` (grpo/environments/openenv_adapter.py)
  openenv+http://host:port             an OpenEnv server: a session per episode (grpo/environments/remote.py)
  package.module:factory               your own, importable
  path/to/file.py:factory              your own, by file
docs/environments.md has the interface, an environment written from scratch, and how it
compares with OpenEnv and verifiers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

MAX_RESULT_CHARS = 4000  # a tool's result or error, an environment's error, beyond this is cut: context the model reads


def cut(text: str) -> str:
    """A message for the model within MAX_RESULT_CHARS (a tool's result, or an error: the tool's, the
    environment's, or one that repeats what the model wrote)."""
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " ... (cut)"


@dataclass
class Reply:
    """The environment's answer to one model message."""

    text: str | list[str] = ""  # what the model reads next (ignored when done); a list: several messages in `role`
    done: bool = False  # the episode is over: no reply is shown, no further turn
    reward: float | None = None  # adds to the episode's `env_reward` (None: gives none)
    role: str = "user"  # the chat role the text is shown in (the chat template renders it)
    tool_calls: int = 0  # tool calls this message made
    tool_errors: int = 0  # of them, the ones that failed (the error went back to the model as text)
    malformed_calls: int = 0  # of those, the ones that could not be read or named no tool or bad arguments

    def to_json(self) -> list:
        """JSON values whatever the environment returned (a numpy float reward, a bool count)."""
        text = [str(t) for t in self.text] if isinstance(self.text, (list, tuple)) else str(self.text)
        return [text, bool(self.done), None if self.reward is None else float(self.reward), str(self.role),
                int(self.tool_calls), int(self.tool_errors), int(self.malformed_calls)]

    @classmethod
    def from_json(cls, value) -> "Reply":
        text, done, reward, role, calls, errors, malformed = value
        text = [str(t) for t in text] if isinstance(text, list) else str(text)
        return cls(text, bool(done), None if reward is None else float(reward), str(role), int(calls), int(errors),
                   int(malformed))


BUILT_IN = {"calculator": "grpo.environments.calculator:Calculator",
            "tools": "grpo.environments.tools:ToolEnvironment"}  # env.tools: Python functions as tools


VALID_NAMES = ("'' (off)", *BUILT_IN, "openenv:package.module:Class", "openenv+http://host:port",
               "package.module:factory", "path/to/file.py:factory")
OPENENV = ("openenv:", "openenv+")  # OpenEnv's environments: in-process, or served (no class of ours to read)


def _environment_class(name: str):
    """The class or factory a built-in name or an import path names (not an openenv: one)."""
    from grpo.common.imports import import_object

    if name not in BUILT_IN and ":" not in name:
        raise ValueError(f"env.name: unknown environment {name!r}; valid: {', '.join(VALID_NAMES)}")
    return import_object(BUILT_IN.get(name, name), "env.name")


def args_problems(name: str, args: dict) -> list[str]:
    """env.args keys the environment's factory does not take, one config error each, found at start
    (the factory is imported by then: environment_factory). OpenEnv's: its class's keyword arguments
    (env.args.init; the adapter's settings are checked by the adapter); the tool environment's and a
    served one's: checked with their settings (grpo/run/preflight.py, remote.py)."""
    if name == "tools" or name.startswith("openenv+"):
        return []
    if name.startswith("openenv:"):
        return unknown_keyword_problems(_openenv_class(name), dict(args.get("init") or {}), "env.args.init",
                                        name.removeprefix("openenv:"), takes_row=False)
    label = f"the {name} environment" if name in BUILT_IN else name
    return unknown_keyword_problems(_environment_class(name), args, "env.args", label, takes_row=True)


def _openenv_class(name: str):
    from grpo.common.imports import import_object

    return import_object(name.removeprefix("openenv:"), "env.name")


KIND = inspect.Parameter  # the kinds of a parameter


def unknown_keyword_problems(factory, given: dict, key: str, label: str, takes_row: bool) -> list[str]:
    """`key`'s entries that `factory` has no keyword parameter for (its first one is the row when
    `takes_row`); none when it takes **kwargs or its signature cannot be read (a C callable)."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return []
    if any(p.kind is KIND.VAR_KEYWORD for p in parameters):
        return []
    if takes_row and parameters and parameters[0].kind in (KIND.POSITIONAL_ONLY, KIND.POSITIONAL_OR_KEYWORD):
        parameters = parameters[1:]
    takes = [p.name for p in parameters if p.kind in (KIND.POSITIONAL_OR_KEYWORD, KIND.KEYWORD_ONLY)]
    return [f"{key} key {unknown!r} is not a parameter of {label} (it takes: {', '.join(takes) or 'nothing'})"
            for unknown in given if unknown not in takes]


def environment_args(env_cfg) -> dict:
    """The factory's keyword arguments: env.args, and for the tool environment env.tools and
    env.tool_parser (which the environments' child needs to build it)."""
    args = dict(env_cfg.args)
    if env_cfg.name == "tools":
        args.update(tools=list(env_cfg.tools), parser=env_cfg.tool_parser)
    return args


def prompt_options(env_cfg) -> dict:
    """What the environment adds to every prompt (data.prompts.build_prompts): the few-shot
    examples' `demonstrate`, and the `tools` the chat template offers (their JSON schemas)."""
    if env_cfg.name == "tools":
        from grpo.environments.tools import tool_schemas

        demonstration = env_cfg.args.get("demonstration")
        demonstrate = None
        if demonstration:
            from grpo.common.imports import import_object

            demonstrate = import_object(demonstration, "env.args.demonstration")
        return {"demonstrate": demonstrate, "tools": tool_schemas(list(env_cfg.tools))}
    return {"demonstrate": environment_demonstration(env_cfg.name), "tools": None}


def environment_factory(name: str, args: dict) -> Callable[[dict], object]:
    """row -> a new environment instance for `env.name` / `env.args` (imports the environment)."""
    if name.startswith("openenv:"):
        from grpo.environments.openenv_adapter import openenv_factory

        return openenv_factory(name.removeprefix("openenv:"), args)
    if name.startswith("openenv+"):
        from grpo.environments.remote import remote_factory

        return remote_factory(name, args)
    make = _environment_class(name)
    return lambda row: make(row, **args)


def reply_roles(name: str, args: dict) -> tuple[str, ...]:
    """The chat roles an environment's replies come in, which the chat template must render
    (checked at start): its class's `reply_roles`, else the `role` of env.args, else user."""
    declared = None if not name or name.startswith(OPENENV) else \
        getattr(_environment_class(name), "reply_roles", None)
    return tuple(declared) if declared else (str(args.get("role", "user")),)


def environment_demonstration(name: str):
    """The environment's `demonstration(row, answer) -> chat turns | None` for few-shot examples
    (data.prompts.solved_turns), or None when it has none (OpenEnv environments have none)."""
    if not name or name.startswith(OPENENV):
        return None
    return getattr(_environment_class(name), "demonstration", None)
