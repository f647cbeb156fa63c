"""GSM8K loading, answer parsing, prompts, and the resumable cursor."""

import gzip
import json
import shutil
from pathlib import Path

import pytest

from grpo.config import DataConfig, load_config
from grpo.data.cursor import PromptCursor
from grpo.data.embedded import EMBEDDED_DIR, EMBEDDED_GSM8K, EmbeddedDataError, embedded_rows
from grpo.data.problems import Columns, DataError, load_problems, load_split, parse_final_answer, solution_reasoning
from grpo.data.prompts import build_prompts, encode_prompts, prompt_text
from grpo.settings.tree import ConfigError


def test_embedded_gsm8k_has_all_rows_and_every_answer_parses(gsm8k_data):
    train, train_stats = load_problems(gsm8k_data, "train")
    test, test_stats = load_problems(gsm8k_data, "test")
    assert (len(train), len(test)) == (7473, 1319)
    assert train_stats.skipped == {} and test_stats.skipped == {}
    assert train[0].id == "train-0" and train[0].question.startswith("Natalia sold clips")
    assert train[0].answer == "72"
    assert all(p.answer.lstrip("-").replace(".", "", 1).isdigit() for p in train + test)


def test_embedded_gsm8k_is_the_shared_copy_row_for_row(shared_gsm8k):
    for split in ("train", "test"):
        assert embedded_rows(split) == [json.loads(line) for line in
                                        (shared_gsm8k / f"{split}.jsonl").read_text().splitlines()]
        assert load_problems(EMBEDDED_GSM8K, split)[0] == load_problems(str(shared_gsm8k), split)[0]


def _damaged_copy(tmp_path, split: str, mutate) -> Path:
    folder = tmp_path / "embedded"
    shutil.copytree(EMBEDDED_DIR, folder)
    path = folder / f"{split}.jsonl.gz"
    path.write_bytes(mutate(path.read_bytes()))
    return folder


def test_a_damaged_embedded_copy_is_an_error_not_a_shorter_dataset(tmp_path):
    # one row fewer, recompressed: valid gzip, valid JSONL, 7472 rows
    shorter = _damaged_copy(tmp_path / "a", "train",
                            lambda b: gzip.compress(b"\n".join(gzip.decompress(b).split(b"\n")[1:])))
    with pytest.raises(EmbeddedDataError, match=r"train.jsonl.gz is damaged: sha256 .*\(7472 rows, expected 7473\)"):
        embedded_rows("train", shorter)
    cut = _damaged_copy(tmp_path / "b", "test", lambda b: b[: len(b) // 2])
    with pytest.raises(EmbeddedDataError, match="test.jsonl.gz cannot be read"):
        embedded_rows("test", cut)
    with pytest.raises(DataError, match="the embedded GSM8K has the splits train, test; got data.split='validation'"):
        load_problems(EMBEDDED_GSM8K, "validation")


@pytest.mark.parametrize("solution, expected", [
    ("3 + 4 = 7\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("#### -3", "-3"),
    ("#### 2.5", "2.5"),
    ("a #### 1 #### 2", "2"),  # the last marker counts
    ("#### seven", None),
    ("no marker 7", None),
    ("#### ", None),
    (None, None),
])
def test_final_answer_is_the_number_after_the_marker(solution, expected):
    assert parse_final_answer(solution) == expected


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    rows = [
        {"question": "q0", "answer": "#### 1"},
        {"question": "q1"},
        {"answer": "#### 2"},
        {"question": "q3", "answer": "#### two"},
        {"question": "", "answer": "#### 4"},
        ["not", "a", "dict"],
        {"question": "q6", "answer": 6},
        {"question": "q7", "answer": "#### 7,000"},
    ]
    lines = [json.dumps(r) for r in rows] + ["{broken json"]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n\n")
    problems, stats = load_problems(str(tmp_path), "train")
    assert [(p.id, p.answer) for p in problems] == [("train-0", "1"), ("train-7", "7000")]
    assert stats.rows == 9
    assert stats.skipped == {"missing answer": 2, "missing question": 2, "non-numeric answer": 1,
                             "not an object": 2}


def test_local_parquet_folder_in_the_hub_layout(tmp_path):
    import datasets

    (tmp_path / "main").mkdir()
    datasets.Dataset.from_list([{"question": "q", "answer": "#### 5"}]).to_parquet(
        str(tmp_path / "main" / "test-00000-of-00001.parquet"))
    problems, _ = load_problems(str(tmp_path), "test")
    assert [(p.question, p.answer) for p in problems] == [("q", "5")]


def test_missing_empty_and_offline_datasets_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match="has no train.jsonl or train.parquet"):
        load_problems(str(tmp_path), "train")
    (tmp_path / "train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match="split 'train' has no column 'answer' \\(data.prompt_column='question', "
                                        "data.answer_column='answer'\\); its columns: question"):
        load_problems(str(tmp_path), "train")
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": null}\n')
    with pytest.raises(DataError, match="has no usable rows \\(1 read, skipped: {'missing answer': 1}\\)"):
        load_problems(str(tmp_path), "train")
    with pytest.raises(DataError, match=r"data.path='no-such-user/no-such-dataset' is a Hugging Face "
                                        r"Hub id and the Hub cannot be reached \(HF_HUB_OFFLINE is "
                                        r"set and it is not in the local cache\); use the embedded "
                                        r"copy \(data.path=gsm8k-embedded\) or a local folder"):
        load_problems("no-such-user/no-such-dataset", "train")  # HF_HUB_OFFLINE=1 in tests
    with pytest.raises(DataError, match="data.path='/no/such/folder' is not a folder, a Hub dataset id"):
        load_problems("/no/such/folder", "train")


def test_cursor_is_deterministic_and_covers_each_epoch_once():
    a, b = PromptCursor(10, seed=3), PromptCursor(10, seed=3)
    first = a.take(10)
    assert sorted(first) == list(range(10)) and first == b.take(10)
    second = a.take(10)
    assert sorted(second) == list(range(10)) and second != first  # a fresh permutation per epoch
    assert PromptCursor(10, seed=4).take(10) != first


def test_cursor_save_and_restore_neither_repeats_nor_skips(tmp_path):
    reference = PromptCursor(7, seed=1)
    expected = [reference.take(3) for _ in range(5)]  # crosses two epoch boundaries
    cursor = PromptCursor(7, seed=1)
    got = [cursor.take(3) for _ in range(3)]
    cursor.save(tmp_path / "cursor.json")
    restarted = PromptCursor(7, seed=1)
    assert restarted.restore(tmp_path / "cursor.json")
    got += [restarted.take(3) for _ in range(2)]
    assert got == expected
    assert json.loads((tmp_path / "cursor.json").read_text()) == {"seed": 1, "size": 7, "epoch": 1, "index": 2}


def test_cursor_refuses_a_state_from_another_dataset(tmp_path):
    PromptCursor(7, seed=1).save(tmp_path / "c.json")
    with pytest.raises(ValueError, match="saved cursor is for seed 1 and 7 prompts, but this run has seed 1 and 8"):
        PromptCursor(8, seed=1).restore(tmp_path / "c.json")
    assert PromptCursor(8, seed=1).restore(tmp_path / "absent.json") is False


def test_prompts_use_the_chat_template_and_drop_overlong(smollm2, gsm8k_data):
    _, tokenizer = smollm2
    problems, _ = load_problems(str(gsm8k_data), "test")
    text = prompt_text(tokenizer, problems[0].question, "SYS", prefill="<think>")
    assert text.startswith("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>")
    prompts, dropped = encode_prompts(tokenizer, problems[:50], "SYS", "", max_prompt_tokens=10**6)
    assert dropped == 0 and len(prompts) == 50
    assert tokenizer.decode(prompts[0].token_ids) == prompt_text(tokenizer, problems[0].question, "SYS")
    lengths = sorted(len(p.token_ids) for p in prompts)
    limit = lengths[25]
    kept, dropped = encode_prompts(tokenizer, problems[:50], "SYS", "", max_prompt_tokens=limit)
    assert dropped == sum(n > limit for n in lengths) and len(kept) == 50 - dropped


def test_solution_reasoning_drops_the_final_line_and_calculator_notes():
    solution = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert solution_reasoning(solution) == ("Natalia sold 48/2 = 24 clips in May.\n"
                                            "Natalia sold 48+24 = 72 clips altogether in April and May.")


def test_few_shot_prompts_show_solved_train_problems_and_do_not_ask_them(smollm2, gsm8k_data):
    _, tokenizer = smollm2
    train, _ = load_problems(str(gsm8k_data), "train")
    data = DataConfig(path=str(gsm8k_data), system_prompt="SYS", prefill="<think>\n", few_shot=2,
                      max_prompt_tokens=10**6)
    prompts, dropped = build_prompts(tokenizer, data, train[:5])
    assert [p.problem.id for p in prompts] == ["train-2", "train-3", "train-4"] and dropped == 0
    text = tokenizer.decode(prompts[0].token_ids)
    first_shot = ("<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as "
                  "many clips in May. How many clips did Natalia sell altogether in April and May?<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\nNatalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 "
                  "clips altogether in April and May.\n</think>\n<answer>\n72\n</answer><|im_end|>\n")
    assert text.startswith("<|im_start|>system\nSYS<|im_end|>\n" + first_shot + "<|im_start|>user\nWeng earns")
    assert text.count("<|im_start|>assistant\n") == 3  # two solved, one open
    assert text.endswith(train[2].question + "<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_any_dataset_with_renamed_columns_text_answers_and_chat_prompts(tmp_path, smollm2):
    """Columns by name, the answer as text, prompts as text or chat messages; the row's JSON columns
    kept for the rewards; a row without an answer skipped and counted, not a crash."""
    rows = [{"problem": "Capital of France?", "solution": " Paris ", "level": 1},
            {"problem": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "solution": 4, "level": 2},
            {"problem": "No answer here", "solution": None},
            {"problem": [{"role": "assistant", "content": "ends with the assistant"}], "solution": "x"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = Columns(prompt="problem", answer="solution", answer_format="text")
    problems, stats = load_problems(str(tmp_path), "train", columns)
    assert [(p.id, p.question, p.answer) for p in problems] == [("train-0", "Capital of France?", "Paris"),
                                                              ("train-1", "2+2?", "4")]
    assert problems[0].row == rows[0] and problems[1].messages == tuple(rows[1]["problem"])
    assert stats.skipped == {"missing solution": 1, "missing problem": 1}
    with pytest.raises(DataError, match="has no column 'prompt' .*its columns: level, problem, solution"):
        load_problems(str(tmp_path), "train", Columns(prompt="prompt", answer="solution", answer_format="text"))

    _, tokenizer = smollm2
    cfg = load_config(None, [f"data.path={tmp_path}", "data.prompt_column=problem", "data.answer_column=solution",
                             "data.answer_format=text", "data.few_shot=0", "data.prefill=", "data.system_prompt=SYS"])
    prompts, _ = build_prompts(tokenizer, cfg.data, load_split(cfg.data, "train")[0])
    own_system = tokenizer.apply_chat_template(rows[1]["problem"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompts[1].token_ids) == own_system  # the dataset's own system turn, not SYS
    assert tokenizer.decode(prompts[0].token_ids) == prompt_text(tokenizer, "Capital of France?", "SYS")


def test_few_shot_needs_gsm8k_answers():
    with pytest.raises(ConfigError, match="data.few_shot=2 shows solved problems .* set data.few_shot=0"):
        load_config(None, ["data.answer_format=text"])


def test_an_environments_opening_joins_the_question_in_its_user_turn(tiny_model_dir):
    """The opening (an OpenEnv reset observation) is rendered as if the question had said it: one
    user turn, so templates that require alternating roles take it; the prefill stays last."""
    from transformers import AutoTokenizer

    from grpo.data.problems import Problem
    from grpo.data.prompts import with_opening

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    problem = Problem("train-0", "Guess the word.", "crane")
    [prompt], _ = encode_prompts(tokenizer, [problem], "SYS", "<think>", 512)
    opened, cut = with_opening(tokenizer, prompt, "_ _ _ _ _ (6 tries)", "<think>")
    assert cut is False
    assert tokenizer.decode(opened.token_ids) == prompt_text(tokenizer, "Guess the word.\n\n_ _ _ _ _ (6 tries)", "SYS",
                                                             prefill="<think>")
    assert opened.turns[-1] == {"role": "user", "content": "Guess the word.\n\n_ _ _ _ _ (6 tries)"}
    assert prompt.turns[-1]["content"] == "Guess the word."  # the dataset's prompt is left as it was


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_prompts_the_sampler_generates_from(tmp_path, tiny_model_dir, tiny_gsm8k):
    """data.chat_template_kwargs (Qwen3's enable_thinking=false) renders every prompt the sampler's main
    loads for either engine; without it the template's default stands."""
    from grpo.workers.sampler import load_policy_and_prompts

    (tmp_path / "thinking.jinja").write_text(THINKING_TEMPLATE)
    common = [f"model.name_or_path={tiny_model_dir}", f"model.chat_template={tmp_path / 'thinking.jinja'}",
              f"data.path={tiny_gsm8k}", "data.few_shot=0", "data.prefill=", "lora.r=4",
              "rewards.timeout_s=0"]  # no rewards run: no jail to start
    texts = {}
    for name, extra in (("off", ["data.chat_template_kwargs={enable_thinking: false}"]), ("default", [])):
        policy, sources = load_policy_and_prompts(load_config(None, [*common, *extra]))
        texts[name] = policy.tokenizer.decode(sources[0][0].token_ids)
        episode_turn = policy.tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                                            add_generation_prompt=True)
        assert episode_turn.endswith("<assistant><think></think>" if name == "off" else "<assistant>"), name
    assert texts["off"].endswith("What is 0 plus 0?</user><assistant><think></think>")
    assert texts["default"].endswith("What is 0 plus 0?</user><assistant>")


def test_evaluations_read_data_eval_path_with_the_training_datas_few_shot_turns(tmp_path, tiny_model_dir, tiny_gsm8k):
    from grpo.model.loading import load_tokenizer
    from grpo.run.preflight import source_problems
    from grpo.workers.sampler import evaluation_prompts

    other = tmp_path / "other"
    other.mkdir()
    (other / "test.jsonl").write_text("".join(json.dumps({"question": f"What is {i} times 1?", "answer": f"#### {i}"})
                                              + "\n" for i in range(5)))
    common = [f"model.name_or_path={tiny_model_dir}", f"data.path={tiny_gsm8k}", "data.few_shot=1",
              "eval.num_problems=3", "eval.every=1"]
    cfg = load_config(None, [*common, f"data.eval_path={other}"])
    prompts = evaluation_prompts(cfg, load_tokenizer(cfg.model))
    assert [p.problem.question for p in prompts] == ["What is 0 times 1?", "What is 1 times 1?", "What is 2 times 1?"]
    assert [t["content"] for t in prompts[0].turns[1:]][::2] == ["What is 0 plus 0?", "What is 0 times 1?"]  # shot
    assert source_problems(cfg) == ([], [])
    assert [p.problem.question for p in evaluation_prompts(load_config(None, common), load_tokenizer(cfg.model))] \
        == ["What is 0 plus 0?", "What is 1 plus 0?", "What is 2 plus 0?"]
    missing, _ = source_problems(load_config(None, [*common, f"data.eval_path={tmp_path / 'nowhere'}"]))
    assert len(missing) == 1 and str(tmp_path / "nowhere") in missing[0]
