"""A verifiers environment's dataset and rollouts, run by the interpreter of `make install-verifiers` (.venv-verifiers,
verifiers 0.3.1 and its `verifiers.legacy` API: `load_environment`, `env.run_rollout(input, client, ...)`).

The trainer never imports this file: verifiers and its dependencies live in their own environment, and this script
is run there as a program (stdlib and verifiers only):

    python verifiers_env.py rows <env> <args json> <train|eval>   its dataset's rows, one JSON object a line
    python verifiers_env.py rollout <env> <args json> <model>     one session: its row as a JSON line on stdin, the
                                                                  rollout against $OPENAI_BASE_URL, its reward POSTed

<env> is an installed environment's id (`my-env` imports `my_env`) or a path to its .py file. A rollout's prompt is
the row's `prompt_turns`, the chat the run rendered the group's prompt from, so its first request is that prompt
token for token; its answer, info and example_id are the row's (a row's `task` is not passed: 0.3.1 reads that
field as a serialized task of its own). The reward is the environment's rubric's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import sys
from pathlib import Path

# run as a script, its folder (the trainer's grpo/common) would come first on the import path and its modules would
# shadow installed ones of the same names
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]


def load(env: str, args: dict):
    """The environment, from its id or its file (whose folder goes on the import path). What it prints goes to
    stderr (stdout carries the rows)."""
    path = Path(env)
    if path.suffix == ".py":
        sys.path.insert(0, str(path.resolve().parent))
        env = path.stem
    with contextlib.redirect_stdout(sys.stderr):
        import verifiers as vf

        environment = vf.load_environment(env, **args)
    if getattr(environment, "message_type", "chat") != "chat":
        raise SystemExit(f"verifiers environment {env!r} asks for message_type={environment.message_type!r}; "
                         "the trainer runs chat environments")
    if getattr(environment, "requires_group_rollouts", False):
        raise SystemExit(f"verifiers environment {env!r} has group reward functions (its rubric scores a group "
                         "together); the trainer scores each rollout alone")
    return environment


def rows(env: str, args: dict, split: str) -> None:
    environment = load(env, args)
    with contextlib.redirect_stdout(sys.stderr):
        if split == "train":
            dataset = environment.get_dataset()
        else:
            environment.build_eval_dataset()
            if environment.eval_dataset is None:  # verifiers would evaluate on its train rows
                raise SystemExit(f"verifiers environment {env!r} has no eval dataset: set eval.every=0, or "
                                 "data.eval_path to held-out rows")
            dataset = environment.get_eval_dataset()
    for row in dataset:
        print(json.dumps(row, default=str))


def rollout_input(row: dict) -> dict:
    """verifiers' RolloutInput of a trainer's row (grpo/agent/runner.py harness_row)."""
    answer = row.get("answer", row.get("reference_answer", ""))
    return {"prompt": row["prompt_turns"], "answer": answer if isinstance(answer, str) else json.dumps(answer),
            "info": row.get("info") or {}, "example_id": row.get("example_id", 0)}


async def rollout(env: str, args: dict, model: str) -> None:
    from openai import AsyncOpenAI
    from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

    row = json.loads(sys.stdin.readline())
    # the session's URL and key for this client alone: a process the environment starts (a tool running the
    # model's code) does not inherit them, and a client the environment makes of its own (a judge's) does not
    # call the policy's session
    openai = AsyncOpenAI(base_url=os.environ.pop("OPENAI_BASE_URL"), api_key=os.environ.pop("OPENAI_API_KEY"),
                         max_retries=0)
    environment = load(env, args)
    for name in ("httpx", "httpcore", "openai"):  # their request lines hold the session's URL: never in the output
        logging.getLogger(name).setLevel(logging.WARNING)
    sampling = copy.deepcopy(getattr(environment, "sampling_args", None) or {})  # its max_tokens, stop
    output = await environment.run_rollout(rollout_input(row), OpenAIChatCompletionsClient(openai), model, sampling)
    reward = output.get("reward")
    if reward is None:
        raise SystemExit(f"the verifiers rollout gave no reward (its error: {output.get('error')})")
    if output.get("error"):  # scored by its rubric all the same, as verifiers scores it
        print(f"verifiers rollout ended with an error: {output['error']}")
    await openai.post("/reward", body={"reward": float(reward)}, cast_to=object)
    print(f"verifiers rollout: reward {reward}, metrics {json.dumps(output.get('metrics') or {}, default=str)}")


def main(argv: list[str]) -> None:
    if len(argv) != 4 or argv[0] not in ("rows", "rollout"):
        raise SystemExit(__doc__)
    what, env, args = argv[0], argv[1], json.loads(argv[2])
    os.environ.setdefault("VF_LOG_LEVEL", "WARNING")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # each session's log: its reward, not bars
    if what == "rows":
        rows(env, args, argv[3])
    else:
        asyncio.run(rollout(env, args, argv[3]))


if __name__ == "__main__":
    main(sys.argv[1:])
