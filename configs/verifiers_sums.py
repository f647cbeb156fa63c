"""A verifiers environment of our own (configs/verifiers_sums.yaml, docs/environments.md "A verifiers environment"):
written against verifiers' API as any environment on its hub is, and run by the trainer by name
(agent.verifiers, data.path=verifiers:<it>). Its questions are sums of two or three numbers, made from a seed (no
download: a rollout builds the environment again in its jail, which has no network); its rubric rewards the right
number in <answer> </answer> (1.0), how close the reply's last number is to the sum (0.3 at most: a small model
rarely writes the tags, or the sum, at first) and an answer tag that holds something (0.2).

    load_environment(size=200, eval_size=50, seed=0, terms=2)
"""

import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM = ("Add the numbers. Think step by step inside <think> </think>, then give the sum, a number, inside "
          "<answer> </answer>.")


def sums(size: int, seed: int, terms: int) -> Dataset:
    r = random.Random(seed)
    rows = []
    for _ in range(size):
        numbers = [r.randint(2, 60) for _ in range(terms)]
        rows.append({"question": f"What is {' + '.join(map(str, numbers))}?", "answer": str(sum(numbers)),
                     "info": {"terms": terms}})
    return Dataset.from_list(rows)


def load_environment(size: int = 200, eval_size: int = 50, seed: int = 0, terms: int = 2) -> vf.Environment:
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def right_sum(completion, answer, **kwargs) -> float:
        given = (parser.parse_answer(completion) or "").strip()
        return 1.0 if given == answer else 0.0

    def last_message(completion) -> str:
        return (completion[-1]["content"] or "") if isinstance(completion, list) and completion else str(completion)

    def near(completion, answer, **kwargs) -> float:  # how close the reply's last number is to the sum
        numbers = re.findall(r"-?\d+", last_message(completion))
        return max(0.0, 1.0 - abs(int(numbers[-1]) - int(answer)) / int(answer)) if numbers else 0.0

    def tagged(completion, **kwargs) -> float:  # an answer tag with something in it
        return 1.0 if re.search(r"<answer>\s*\S[^<]*</answer>", last_message(completion)) else 0.0

    rubric = vf.Rubric(funcs=[right_sum, near, tagged], weights=[1.0, 0.3, 0.2], parser=parser)
    return vf.SingleTurnEnv(dataset=sums(size, seed, terms), eval_dataset=sums(eval_size, seed + 1, terms),
                            system_prompt=SYSTEM, parser=parser, rubric=rubric)
