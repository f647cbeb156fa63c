"""An agent loop of your own, trained as it runs (configs/gsm8k_agent.yaml, docs/environments.md "Your own
agent loop"): a plain OpenAI-client script. The trainer calls `solve` once per sample with the dataset row, a
base URL and a key; every turn the model writes for it is sampled, recorded and trained on.

It asks the question, and when the reply holds no <answer>, asks once more for one; its reward is whether the
final answer is the reference's (the run adds a format reward on the last message: configs/gsm8k_agent.yaml)."""

import re

from openai import BadRequestError, OpenAI

SYSTEM = ("You solve grade-school math problems. Think step by step inside <think> </think>, then give the final "
          "answer, a number, inside <answer> </answer>.")
THINK = "<think>\n"
ANSWER = re.compile(r"<answer>\s*(-?[\d,]*\.?\d+)\s*</answer>")


def solve(row: dict, base_url: str, api_key: str) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["question"]}]
    for _ in range(2):
        try:  # the assistant's turn begun with "<think>" (vLLM's continue_final_message): the small model then
            # writes the tags often enough for the format reward to vary
            reply = client.chat.completions.create(
                model="policy", messages=[*messages, {"role": "assistant", "content": THINK}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
        except BadRequestError:  # the conversation no longer fits in the run's token budget
            return 0.0
        text = THINK + (reply.choices[0].message.content or "")
        found = ANSWER.search(text)
        if found or reply.choices[0].finish_reason == "length":
            break
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "Give the final answer, a number, inside <answer> </answer>."}]
    if not found:
        return 0.0
    return 1.0 if float(found.group(1).replace(",", "")) == float(row["reference_answer"]) else 0.0


if __name__ == "__main__":  # as agent.command (configs/gsm8k_agent_command.yaml): the row on stdin, the reward posted
    import json
    import os
    import sys

    reward = solve(json.loads(sys.stdin.readline()), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
    OpenAI().post("/reward", body={"reward": reward}, cast_to=object)
