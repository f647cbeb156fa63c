"""Reward models (`reward_model:<folder>`): a tiny random LlamaForSequenceClassification saved with
the embedded model's tokenizer, scored in padded batches, equals its unpadded forward of each
chat-templated text; models that are not one-logit classifiers are config errors at start."""

import re

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from grpo.config import load_config
from grpo.settings.tree import ConfigError
from rewards import score_completions
from rewards.reward_model import load_reward_model, padding_id
from rewards.sandbox import RewardSandbox
from rewards.services import ServiceSettings, service_reward

SYSTEM = {"role": "system", "content": "Answer in tags."}
PROMPTS = [(SYSTEM, {"role": "user", "content": "What is 3 + 4?"}),
           (SYSTEM, {"role": "user", "content": "What is 3 + 4?"}),
           ({"role": "user", "content": "Name a prime number larger than ten, and say why it is prime."},)]
COMPLETIONS = ["7", "<think>\n3 + 4 = 7\n</think>\n<answer>7</answer>", "Eleven: no number but 1 and 11 divides it."]


def save_classifier(folder, tokenizer_dir, num_labels: int = 1, chat_template: bool = True):
    """A random 2-layer Llama classifier with a head large enough that scores differ by O(1)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_()
    model.save_pretrained(folder)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("rm"), tiny_model_dir)


def unpadded_score(folder, text: str, add_special_tokens: bool, dtype=torch.float32) -> float:
    """The classifier's logit for one sequence alone: no padding, read at its last token."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).eval()
    model.config.pad_token_id = None  # one sequence: the score is at its last position
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, 0].float().item()


def chat_text(folder, turns, completion) -> str:
    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [*turns, {"role": "assistant", "content": completion}], tokenize=False)


def test_padded_batches_score_each_chat_templated_text_as_its_unpadded_forward(reward_model_dir):
    """Three completions of different lengths in batches of 2 (one padded pair, one alone), in the
    sampler process though a sandbox is given: each equals its own forward to float tolerance."""
    name = f"reward_model:{reward_model_dir}"
    sandbox = RewardSandbox(timeout_s=30)
    try:
        scores = score_completions(COMPLETIONS, [{"reference_answer": "7"}] * 3, [name], [2.0], fallback=-99.0,
                                   call=sandbox, prompts=PROMPTS, services=ServiceSettings(batch_size=2))
    finally:
        sandbox.close()
    expected = [unpadded_score(reward_model_dir, chat_text(reward_model_dir, p, c), add_special_tokens=False)
                for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores.failures == {name: 0}
    assert scores.per_function[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert scores.total.tolist() == pytest.approx([2 * e for e in expected], abs=2e-5)
    assert len({round(e, 3) for e in expected[1:]}) == 2 and abs(expected[1] - expected[2]) > 1e-2  # they differ
    text = chat_text(reward_model_dir, PROMPTS[1], COMPLETIONS[1])
    assert text.endswith("<|im_start|>assistant\n" + COMPLETIONS[1] + "<|im_end|>\n")  # the completion as the reply


def test_a_template_that_refuses_a_system_turn_gets_its_text_in_the_first_user_turn(reward_model_dir):
    """Gemma's templates raise on a system turn; the prompt's system text then heads the question."""
    model = load_reward_model(str(reward_model_dir), "cpu", "float32", 8)
    template = model.tokenizer.chat_template
    model.tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                                     "supported') }}{% endif %}" + template)
    try:
        text = model.text("<answer>7</answer>", PROMPTS[0])
    finally:
        model.tokenizer.chat_template = template
    assert "<|im_start|>system\nAnswer in tags." not in text and "<|im_start|>user\nAnswer in tags.\n\nWhat is 3 + 4?" in text


def test_a_text_longer_than_the_model_reads_is_cut_from_the_left_and_one_bad_chunk_fails_alone(reward_model_dir):
    model = load_reward_model(str(reward_model_dir), "cpu", "float32", 1)
    assert model.fitted(list(range(model.max_length + 5))) == list(range(5, model.max_length + 5))
    scores = model(["ok", "ok"], [{}, {}], [PROMPTS[0], [{"role": "user", "content": 5}]])  # the second cannot render
    assert isinstance(scores[0], float) and isinstance(scores[1], Exception)


def test_the_score_is_read_at_the_last_token_even_when_that_is_the_pad_token(reward_model_dir):
    """A text that ends with the tokenizer's pad token: the batch pads with another id."""
    model = load_reward_model(str(reward_model_dir), "cpu", "float32", 8)
    pad = model.tokenizer.pad_token_id
    ids = [[5, 6, 7, pad], [5, 6]]
    assert padding_id(ids, model.tokenizer) not in (pad, 6)
    fresh = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    fresh.config.pad_token_id = None
    with torch.no_grad():
        alone = [fresh(torch.tensor([seq])).logits[0, 0].item() for seq in ids]
    assert model.scores(ids) == pytest.approx(alone, abs=1e-5)


def test_without_a_chat_template_the_turns_and_completion_are_joined_by_newlines(tiny_model_dir, tmp_path):
    """Then the tokenizer's EOS, which TRL's RewardTrainer appends to plain-text pairs: the score is
    read where the model was trained to give it."""
    folder = save_classifier(tmp_path / "plain", tiny_model_dir, chat_template=False)
    scores = score_completions(COMPLETIONS[:2], [{}] * 2, [f"reward_model:{folder}"], [1.0], fallback=-99.0,
                               prompts=PROMPTS[:2], services=ServiceSettings())
    eos = AutoTokenizer.from_pretrained(folder).eos_token
    texts = ["Answer in tags.\nWhat is 3 + 4?\n" + c + eos for c in COMPLETIONS[:2]]
    assert scores.per_function[:, 0].tolist() == pytest.approx(
        [unpadded_score(folder, t, add_special_tokens=True) for t in texts], abs=1e-5)


def test_it_is_loaded_once_per_process_in_model_dtype(reward_model_dir):
    cfg = load_config(None, [f"rewards.names=[reward_model:{reward_model_dir}]", "rewards.weights=[1.0]",
                             "model.dtype=bfloat16", "sampling.device=cpu"])
    settings = ServiceSettings.of(cfg)
    assert (settings.device, settings.dtype) == ("cpu", "bfloat16")
    name = f"reward_model:{reward_model_dir}"
    model = service_reward(name, settings)
    assert service_reward(name, settings) is model and model.model.dtype == torch.bfloat16
    text = chat_text(reward_model_dir, PROMPTS[0], COMPLETIONS[0])
    assert model(COMPLETIONS[:1], [{}], PROMPTS[:1]) == pytest.approx(
        [unpadded_score(reward_model_dir, text, False, torch.bfloat16)], abs=1e-6)


def test_a_missing_folder_or_a_model_that_is_not_a_one_logit_classifier_is_a_config_error(tiny_model_dir, tmp_path):
    three = save_classifier(tmp_path / "three", tiny_model_dir, num_labels=3)
    for source, message in [
        (tmp_path / "missing", f"reward_model:{tmp_path / 'missing'}: there is no folder {tmp_path / 'missing'}"),
        (three, f"reward_model:{three} has 3 labels; a reward model gives one logit (num_labels=1)"),
        (tiny_model_dir, f"reward_model:{tiny_model_dir} is a LlamaForCausalLM, not a sequence classifier"),
    ]:
        with pytest.raises(ConfigError, match=f"rewards.names: {re.escape(message)}"):
            load_config(None, [f"rewards.names=[reward_model:{source}]", "rewards.weights=[1.0]"])
