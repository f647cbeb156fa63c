"""reasoning-gym tasks as data (data/procedural.py) and their scorer as the `reasoning_gym` reward."""

import json

import pytest
from conftest import checked_config

from grpo.config import load_config
from grpo.data.problems import DataError, load_problems, load_split
from grpo.data.procedural import DEFAULT_SEED, TEST_SEED_OFFSET, split_settings, task_rows
from grpo.data.prompts import Prompt, build_prompts, solved_answer
from grpo.rewards import get_reward
from grpo.rewards.strict import passes, reward_rows, strict_rates
from grpo.settings.tree import ConfigError

CHAIN_SUM = "reasoning-gym:chain_sum"
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "size": 300, "test_size": 200}


def test_split_settings_keep_the_tasks_keys_and_put_the_held_out_seed_a_billion_rows_away():
    args = {"min_terms": 2, "size": 50, "seed": 7, "test_size": 20}
    assert split_settings(args, "train") == {"min_terms": 2, "size": 50, "seed": 7}
    assert split_settings(args, "test") == {"min_terms": 2, "size": 20, "seed": 7 + TEST_SEED_OFFSET}
    assert split_settings({}, "train") == {"size": 10_000, "seed": DEFAULT_SEED}
    assert split_settings({"test_seed": 3}, "test") == {"size": 1_000, "seed": 3}


def test_a_task_loads_as_problems_with_its_columns_and_the_task_in_each_row():
    problems, stats = load_problems(CHAIN_SUM, "train", task_args=SMALL)
    assert len(problems) == 300 and stats.skipped == {}
    first = problems[0]
    assert first.id == "train-0"
    assert first.question.startswith("State the final answer to the following arithmetic problem: ")
    # the answer is the value of the expression the question asks about
    expression = first.row["metadata"]["expression"]
    assert first.answer == str(eval(expression)) == first.row["answer"]
    assert first.row["metadata"]["source_dataset"] == "chain_sum"
    json.dumps(first.row)  # crosses to the reward process as JSON


def test_the_same_settings_give_the_same_rows_and_another_seed_other_rows():
    a = task_rows(CHAIN_SUM, "train", SMALL)
    assert task_rows(CHAIN_SUM, "train", SMALL) == a
    b = task_rows(CHAIN_SUM, "train", {**SMALL, "seed": 5})
    assert [r["question"] for r in a] != [r["question"] for r in b]


def test_train_and_held_out_splits_are_disjoint_even_where_the_seeds_would_overlap():
    train = {r["question"] for r in task_rows(CHAIN_SUM, "train", SMALL)}
    test = [r["question"] for r in task_rows(CHAIN_SUM, "test", SMALL)]
    assert test and not train & set(test)
    # test_seed 200 would make half of the held-out rows train's rows 200..299: removed, none served
    overlapping = task_rows(CHAIN_SUM, "test", {**SMALL, "test_seed": 200})
    assert overlapping and not train & {r["question"] for r in overlapping}
    assert len(overlapping) <= 100 < len(test)


def test_load_split_reads_the_task_args_from_the_data_config():
    cfg = load_config(None, [f"data.path={CHAIN_SUM}",
                             "data.task_args={size: 40, test_size: 30, min_terms: 2, max_terms: 2}",
                             "data.few_shot=0"])
    train, _ = load_split(cfg.data, "train")
    test, _ = load_split(cfg.data, "test")
    assert len(train) == 40 and 0 < len(test) <= 30
    assert all(p.row["metadata"]["num_terms"] == 2 for p in train + test)


def test_a_task_that_does_not_exist_is_one_config_error_naming_the_key_and_the_valid_names():
    with pytest.raises(ConfigError) as e:
        checked_config(None, ["data.path=reasoning-gym:chain_sums"])
    message = str(e.value)
    assert "data.path='reasoning-gym:chain_sums': reasoning-gym has no task 'chain_sums'; valid tasks: " in message
    assert "chain_sum, circuit_logic" in message and "\n" not in message.split("invalid config:\n  ", 1)[1]
    with pytest.raises(DataError, match="has no task 'nope'"):
        load_problems("reasoning-gym:nope", "train")


def test_a_setting_the_task_does_not_have_names_the_key_and_its_settings():
    with pytest.raises(ConfigError, match=r"data.task_args: reasoning-gym task 'chain_sum' has no setting 'max_term'; "
                                          r"its settings: min_terms, max_terms, min_digits, max_digits"):
        checked_config(None, [f"data.path={CHAIN_SUM}", "data.task_args={max_term: 3}"])
    with pytest.raises(ConfigError, match="data.task_args are the settings of a reasoning-gym task"):
        load_config(None, ["data.task_args={size: 3}"])
    with pytest.raises(DataError, match="a reasoning-gym task has the splits train, test; got 'validation'"):
        load_problems(CHAIN_SUM, "validation", task_args=SMALL)


def test_few_shot_turns_of_a_task_show_the_answer_alone(smollm2):
    _, tokenizer = smollm2
    cfg = load_config(None, [f"data.path={CHAIN_SUM}", f"data.task_args={json.dumps(SMALL)}", "data.few_shot=2",
                             "data.prefill=<answer>"])
    problems, _ = load_split(cfg.data, "train")
    assert solved_answer(problems[0]) == f"<answer>{problems[0].answer}</answer>"
    prompts, _ = build_prompts(tokenizer, cfg.data, problems[:5])
    text = tokenizer.decode(prompts[0].token_ids)
    assert [p.problem.id for p in prompts] == ["train-2", "train-3", "train-4"]  # the shots are not asked
    assert text.count(f"<answer>{problems[0].answer}</answer>") == 1 and text.endswith("assistant\n<answer>")


@pytest.mark.parametrize("completion, expected", [
    ("<answer>-28</answer>", 1.0),
    ("<think>15 - 43</think>\n<answer> -28 </answer>", 1.0),  # stripped, as reasoning-gym does
    ("<answer>28</answer>", 0.0),
    ("<answer>-27</answer> <answer>-28</answer>", 1.0),  # the last block counts
    ("-28", 0.0),  # no block
    ("<answer>-28", 0.0),  # unclosed
    ("", 0.0),
])
def test_the_reasoning_gym_reward_is_the_tasks_own_score_of_the_last_answer_block(completion, expected):
    row = {"question": "State the final answer to the following arithmetic problem: 15 - 43 =", "answer": "-28",
           "metadata": {"source_dataset": "chain_sum", "expression": "15 - 43"}, "reference_answer": "-28"}
    assert get_reward("reasoning_gym")(completion, row) == expected


def test_the_reasoning_gym_reward_does_not_apply_to_rows_of_other_datasets():
    assert get_reward("reasoning_gym")("<answer>7</answer>", {"reference_answer": "7"}) is None


def test_the_reported_rates_of_a_task_come_from_its_scorer():
    problems, _ = load_problems("reasoning-gym:leg_counting", "train", task_args={"size": 3})
    rows = reward_rows([Prompt(problem, []) for problem in problems])
    right, wrong = f"<answer>{problems[0].answer}</answer>", "<answer>-1</answer>"
    assert passes("reasoning_gym", [right, wrong], rows[:2]) == [True, False]
    assert strict_rates([right, wrong], rows[:2], ("reasoning_gym", "reasoning_gym")) == {
        "strict/answer_accuracy": 0.5, "strict/format_rate": 0.5}


def test_the_held_out_split_asks_each_question_once():
    test = [r["question"] for r in task_rows("reasoning-gym:gcd", "test",
                                             {"max_value": 30, "size": 100, "test_size": 300})]
    assert len(test) == len(set(test)) and len(test) > 100


def test_a_task_whose_train_split_holds_every_question_says_so_instead_of_an_empty_held_out_set():
    from grpo.data.procedural import TaskError

    one_digit_sums = {  # 10 x 10 digits x (+, -): 200 questions
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "size": 2000}
    with pytest.raises(TaskError, match=r"all 1000 held-out rows of reasoning-gym:chain_sum are questions the train "
                                        r"split holds \(200 distinct\); lower data.task_args.size"):
        task_rows(CHAIN_SUM, "test", one_digit_sums)


def test_the_recipe_config_loads_as_make_train_passes_it_after_the_default():
    from conftest import REPO

    from grpo.config import parse_cli

    # make train ARGS="--config configs/needle_haystack.yaml" runs launch.py --config config.yaml
    # --config configs/needle_haystack.yaml
    cfg = parse_cli(["--config", str(REPO / "config.yaml"), "--config", str(REPO / "configs" / "needle_haystack.yaml")])
    assert cfg.data.path == "reasoning-gym:needle_haystack" and cfg.rewards.names == ["reasoning_gym"]
    assert (cfg.rewards.accuracy_reward, cfg.rewards.format_reward) == ("reasoning_gym", "answer_format")


def test_every_task_scores_its_own_reference_answer_through_our_path_as_reasoning_gym_does():
    """A row crosses to the reward process as JSON, which turns tuples into lists (arc_agi's and
    rearc's grids then never equal the answer's): the scorer gets the task's own entry, regenerated."""
    import reasoning_gym

    from grpo.data.procedural import original_entry, task_names

    needs_settings = {"composite"}  # made of other tasks named in its settings
    checked = 0
    for task in sorted(set(task_names()) - needs_settings):
        rows = task_rows(f"reasoning-gym:{task}", "train", {"size": 3})
        # the entry as made under its own seed: list_functions draws from the global `random`, so a
        # dataset iterated here directly would make other entries, depending on the tests run before
        entries = [original_entry(row["entry"]) for row in rows]
        for row, entry in zip(rows, entries, strict=True):
            assert entry["question"] == row["question"], task
            row = json.loads(json.dumps(row))  # as the reward sandbox receives it
            expected = reasoning_gym.get_score_answer_fn(task)(str(entry["answer"]).strip(), entry)
            completion = f"<answer>{entry['answer']}</answer>"
            assert get_reward("reasoning_gym")(completion, {**row, "reference_answer": row["answer"]}) == expected, task
            checked += 1
    assert checked == 3 * (len(task_names()) - len(needs_settings))


def test_an_entry_is_regenerated_the_same_whatever_the_global_random_state():
    """list_functions draws from Python's global `random` as it makes an entry: the row a sampler shows
    and the entry the reward's jail regenerates (another process, another state) must be the same one."""
    import random

    import grpo.data.procedural as procedural

    random.seed(1)
    rows = procedural.task_rows("reasoning-gym:list_functions", "train", {"size": 3, "seed": 0})
    procedural._entry.cache_clear()
    procedural._dataset.cache_clear()
    random.seed(2)
    assert [procedural.original_entry(row["entry"])["question"] for row in rows] == [row["question"] for row in rows]
