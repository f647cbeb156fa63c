"""Reward models (`reward_model:<folder>`): a tiny random LlamaForSequenceClassification saved with
the embedded model's tokenizer, scored in padded batches, equals its unpadded forward of each
chat-templated text; models that are not one-logit classifiers are config errors at start."""

import re

import pytest
import torch
from conftest import checked_config, service_settings
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from grpo.config import load_config
from grpo.rewards import score_completions
from grpo.rewards.reward_model import fit_ids, load_reward_model, padding_id
from grpo.rewards.sandbox import RewardSandbox
from grpo.rewards.services import ServiceSettings, service_reward
from grpo.settings.tree import ConfigError

SYSTEM = {"role": "system", "content": "Answer in tags."}
PROMPTS = [(SYSTEM, {"role": "user", "content": "What is 3 + 4?"}),
           (SYSTEM, {"role": "user", "content": "What is 3 + 4?"}),
           ({"role": "user", "content": "Name a prime number larger than ten, and say why it is prime."},)]
COMPLETIONS = ["7", "<think>\n3 + 4 = 7\n</think>\n<answer>7</answer>", "Eleven: no number but 1 and 11 divides it."]


def save_classifier(folder, tokenizer_dir, num_labels: int = 1, chat_template: bool = True, positions: int = 1024):
    """A random 2-layer Llama classifier with a head large enough that scores differ by O(1)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id,
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
                                   call=sandbox, prompts=PROMPTS, services=service_settings(batch_size=2))
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
    assert ("<|im_start|>system\nAnswer in tags." not in text
            and "<|im_start|>user\nAnswer in tags.\n\nWhat is 3 + 4?" in text)


def test_one_bad_chunk_fails_alone(reward_model_dir):
    model = load_reward_model(str(reward_model_dir), "cpu", "float32", 1)
    scores = model(["ok", "ok"], [{}, {}], [PROMPTS[0], [{"role": "user", "content": 5}]])  # the second cannot render
    assert isinstance(scores[0], float) and isinstance(scores[1], Exception)


# ----------------------------------------------------------------------------- texts longer than the model reads

@pytest.mark.parametrize("limit, kept", [
    (25, list(range(20))),  # fits: nothing cut
    (12, [0, 1, 2, 3] + list(range(12, 20))),  # head 0-3 and completion 15-19 stay; the prompt's oldest 4-11 go
    (7, [0, 1] + list(range(15, 20))),  # the completion does not fit beside the system turn: that is cut from its end
    (4, [0, 17, 18, 19]),  # nor beside the special token 0: the completion loses its beginning, not its end
])
def test_fit_ids_keeps_the_head_tokens_the_system_turn_and_the_completion(limit, kept):
    """20 ids: 0 the special head token, 1-3 the system turn, 4-14 the other prompt turns, 15-19 the completion's."""
    assert fit_ids(list(range(20)), limit, specials=1, head=4, tail=15) == kept


WORDS = "answer in tags what is one plus two three four seven because".split()
CHAT = [{"role": "system", "content": "answer in tags"}, {"role": "user", "content": "what is one plus one"},
        {"role": "assistant", "content": "two"}, {"role": "user", "content": "what is three plus four"}]
COMPLETION = "seven because three plus four is seven"


def save_encoder(folder, positions: int = 16):
    """A random 2-layer BertForSequenceClassification (one logit) and a WordPiece tokenizer of a dozen
    whole words, made here: nothing loads from the Hub."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tokenizer = BertTokenizerFast(vocab=vocab)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=positions, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_an_encoder_reward_model_keeps_its_cls_token_the_system_prompt_and_the_completion(tmp_path, caplog):
    """No chat template: "answer in tags\nwhat is one plus one\ntwo\nwhat is three plus four\nseven because
    three plus four is seven", 23 tokens with [CLS] and [SEP], for a BERT that reads 16. Kept: [CLS], the
    system prompt (3), the question's last 4 words and the completion with [SEP] (8); cut from the left, [CLS],
    which BERT pools on, and the system prompt were lost."""
    folder, tokenizer = save_encoder(tmp_path / "bert")
    model = load_reward_model(str(folder), "cpu", "float32", 4)
    ids = tokenizer.convert_tokens_to_ids
    kept = ids(["[CLS]", "answer", "in", "tags", "is", "three", "plus", "four", "seven", "because", "three", "plus",
                "four", "is", "seven", "[SEP]"])
    assert model.max_length == 16 and len(model.token_ids(COMPLETION, CHAT)) == 23
    assert model.fitted(model.encoded(COMPLETION, CHAT)) == kept
    short = [CHAT[0], CHAT[3]]  # with the answer "seven": 11 tokens, not cut
    assert model.fitted(model.encoded("seven", short)) == model.token_ids("seven", short) == ids(
        ["[CLS]", "answer", "in", "tags", "what", "is", "three", "plus", "four", "seven", "[SEP]"])
    fresh = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        alone = [fresh(torch.tensor([seq])).logits[0, 0].item() for seq in (kept, model.token_ids("seven", short))]
    assert model([COMPLETION, "seven"], [{}, {}], [CHAT, short]) == pytest.approx(alone, abs=1e-5)  # one padded batch
    assert [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()] == [
        "reward model: a text of 23 tokens is longer than the 16 the model reads; it is cut in the prompt's middle, "
        "its oldest turns first (the head tokens, the system turn and the completion are kept). Said once"]


def test_a_decoder_reward_model_keeps_the_system_turn_and_the_completions_turn_whole(tiny_model_dir, tmp_path):
    """The SmolLM2 chat template, 48 tokens, for a classifier that reads 32: the system turn (8 tokens, from
    the BOS <|im_start|>) and the assistant turn (13: header, completion, <|im_end|>) stay, with the 11 tokens
    before it, the question's turn; the few-shot exchange (16) goes."""
    folder = save_classifier(tmp_path / "short-llama", tiny_model_dir, positions=32)
    model = load_reward_model(str(folder), "cpu", "float32", 4)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    def render(chat):
        return tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]

    full = render([*CHAT, {"role": "assistant", "content": COMPLETION}])
    system, prompt = render(CHAT[:1]), render(CHAT)
    completion_turn = full[len(prompt):]
    assert (len(full), len(system), len(prompt)) == (48, 8, 35) and full[:35] == prompt and full[:8] == system
    kept = model.fitted(model.encoded(COMPLETION, CHAT))
    assert kept == system + full[24:] and kept[-13:] == completion_turn and kept[0] == tokenizer.bos_token_id
    assert model.tokenizer.decode(kept[len(system):len(kept) - len(completion_turn)]).endswith(
        "<|im_start|>user\nwhat is three plus four<|im_end|>\n")  # the question stays; the older turns went
    fresh = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    fresh.config.pad_token_id = None
    with torch.no_grad():
        alone = fresh(torch.tensor([kept])).logits[0, 0].item()
    assert model([COMPLETION], [{}], [CHAT]) == pytest.approx([alone], abs=1e-5)


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
                               prompts=PROMPTS[:2], services=service_settings())
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
            checked_config(None, [f"rewards.names=[reward_model:{source}]", "rewards.weights=[1.0]"])
