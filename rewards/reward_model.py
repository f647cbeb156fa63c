"""A reward model: `rewards.names: [reward_model:<folder or Hub id>]`, a sequence classifier with one
logit (AutoModelForSequenceClassification, num_labels=1; e.g. one trained with TRL's RewardTrainer).

It scores the prompt and the completion as its own tokenizer renders them: the prompt's chat
turns plus {"role": "assistant", "content": completion} through its chat template (as TRL does),
or, for a tokenizer without one, the turns' contents and the completion joined by newlines. The
score is the classifier's own pooling of that text: a decoder's logit at the last token, an
encoder's (BERT, DeBERTa) at its [CLS] head token. Batches are right-padded with an id that no
sequence ends with, so a decoder's pooling (the last token that is not padding) reads exactly
there, and a padded batch gives what each text gives alone. Loaded once per process.

A text longer than the model reads is cut where it matters least: the model's special head tokens
([CLS], BOS), the system turn and the whole completion's turn stay, and the prompt's middle goes,
its oldest turns (few-shot examples, earlier exchanges) first. Cutting from the left would drop
[CLS], which an encoder pools on, and a decoder's BOS and system prompt.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.common.model_files import DTYPES, resolve_device, resolve_model_path
from grpo.common.sources import EMBEDDED_MODELS, HUB_ID_RE, cached_hub_snapshot, hub_unreachable_reason

log = logging.getLogger(__name__)

PREFIX = "reward_model:"


@dataclass(frozen=True)
class Encoded:
    """A text's token ids and the parts a cut keeps (token indices)."""

    ids: list[int]
    specials: int  # the model's special head tokens ([CLS], BOS, <|im_start|>): ids[:specials], always kept
    head: int  # they and the system turn: ids[:head], kept while the completion's turn fits beside them
    tail: int  # where the completion's turn starts: ids[tail:] is kept whole while it fits


class RewardModelError(ValueError):
    """A reward model that cannot be had, or a model that is not a one-logit sequence classifier."""


def model_path(source: str, cache_dir: str | None = None) -> str:
    """What from_pretrained should get for `source` (a folder, a Hub id or an embedded alias)."""
    if source in EMBEDDED_MODELS or Path(source).expanduser().is_dir():
        return resolve_model_path(source, cache_dir)
    if not HUB_ID_RE.match(source):
        raise RewardModelError(f"{PREFIX}{source}: there is no folder {source} (and it is not a Hub id org/name)")
    reason = hub_unreachable_reason()
    if reason is None:
        return source
    snapshot = cached_hub_snapshot(source)
    if snapshot is None:
        raise RewardModelError(f"{PREFIX}{source} is a Hugging Face Hub id, it is not in the local cache and the Hub "
                               f"cannot be reached ({reason}); give a local folder")
    return str(snapshot)


def check_classifier(source: str, cache_dir: str | None = None, trust_remote_code: bool = False) -> str:
    """The model's path, after checking from its config alone that it is a one-logit sequence classifier."""
    from transformers import AutoConfig

    path = model_path(source, cache_dir)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise RewardModelError(f"{PREFIX}{source}: cannot read its config ({e})") from None
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RewardModelError(f"{PREFIX}{source} is a {'/'.join(architectures) or 'model without architectures'}, "
                               "not a sequence classifier: a reward model is an AutoModelForSequenceClassification "
                               "with one logit (e.g. LlamaForSequenceClassification, num_labels=1)")
    if config.num_labels != 1:
        raise RewardModelError(f"{PREFIX}{source} has {config.num_labels} labels; a reward model gives one "
                               "logit (num_labels=1)")
    return path


@functools.lru_cache(maxsize=None)  # once per process: a model of gigabytes is not loaded per step
def load_reward_model(source: str, device: str, dtype: str, batch_size: int, cache_dir: str | None = None,
                      trust_remote_code: bool = False) -> "RewardModel":
    return RewardModel(source, device, dtype, batch_size, cache_dir, trust_remote_code)


class RewardModel:
    """fn(completions, rows, prompts) -> the reward model's score of each (rows are not read)."""

    service = True  # rewards/services.py: runs in the sampler, gets the prompts, scores the batch at once

    def __init__(self, source: str, device: str, dtype: str, batch_size: int, cache_dir: str | None = None,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = check_classifier(source, cache_dir, trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code).to(resolve_device(device)).eval()
        self.batch_size, self.max_length, self.warned_long = batch_size, max_length(self.model, self.tokenizer), False
        log.info("reward model %s on %s in %s", source, self.model.device, dtype)

    def text(self, completion: str, turns) -> str:
        """Prompt and completion as the reward model reads them: through its own chat template (one
        that refuses a system turn, as Gemma's do, gets the system text at the head of the first user
        turn); no template: the contents by newlines, then its EOS, as TRL's RewardTrainer trains them."""
        chat = [*turns, {"role": "assistant", "content": completion}]
        if not getattr(self.tokenizer, "chat_template", None):
            return "\n".join(t.get("content") or "" for t in chat) + (self.tokenizer.eos_token or "")
        try:
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        except Exception:  # jinja2's TemplateError from raise_exception: "System role not supported", ...
            return self.tokenizer.apply_chat_template(without_system_turn(chat), tokenize=False)

    def token_ids(self, completion: str, turns) -> list[int]:
        return self.encoded(completion, turns).ids

    def encoded(self, completion: str, turns) -> Encoded:
        """The text's ids, with where its head (special tokens, system turn) ends and its completion's
        turn starts. A chat template writes its own special tokens (BOS included); plain text gets the
        tokenizer's. Without a fast tokenizer (no offsets) only the special head tokens are known."""
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        text = self.text(completion, turns)
        if not self.tokenizer.is_fast:
            ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
            specials = leading_specials(ids, self.tokenizer)
            return Encoded(ids, specials, specials, len(ids))
        tokens = self.tokenizer(text, add_special_tokens=not templated, return_offsets_mapping=True)
        ids, offsets = tokens["input_ids"], tokens["offset_mapping"]
        system_end, completion_start = self.spans(text, completion, turns, templated)
        specials = leading_specials(ids, self.tokenizer)
        return Encoded(ids, specials, max(specials, token_at(offsets, system_end)), token_at(offsets, completion_start))

    def spans(self, text: str, completion: str, turns, templated: bool) -> tuple[int, int]:
        """(where the system turn ends, where the completion's turn starts), as character positions in `text`."""
        has_system = bool(turns) and turns[0].get("role") == "system"
        system = (turns[0].get("content") or "") if has_system else ""
        if not templated:  # "system\n...\ncompletion" + EOS
            return len(system) + 1 if system else 0, len(text) - len(self.tokenizer.eos_token or "") - len(completion)
        system_end = self._rendered_prefix(text, list(turns[:1])) if system else 0
        if system_end is None:  # a template that renders it elsewhere (in the first user turn): its text
            found = text.find(system)
            system_end = found + len(system) if found >= 0 else 0
        start = self._rendered_prefix(text, list(turns))
        return system_end, start if start is not None else max(text.rfind(completion), 0)

    def _rendered_prefix(self, text: str, chat: list[dict]) -> int | None:
        """The length of `chat` rendered alone when `text` starts with it (None: the template renders
        it otherwise, or refuses it)."""
        try:
            rendered = self.tokenizer.apply_chat_template(chat, tokenize=False)
        except Exception:  # jinja2's TemplateError: a template that wants a user turn, no system turn, ...
            return None
        return len(rendered) if rendered and text.startswith(rendered) else None

    @torch.no_grad()
    def __call__(self, completions: list[str], rows: list[dict], prompts: list) -> list:
        """Each sample's score; where a chunk fails (a template error, out of memory), its samples'
        errors, so the other chunks keep their scores."""
        values = []
        for i in range(0, len(completions), self.batch_size):
            chunk = list(zip(completions[i:i + self.batch_size], prompts[i:i + self.batch_size], strict=True))
            try:
                values += self.scores([self.fitted(self.encoded(c, turns)) for c, turns in chunk])
            except Exception as e:
                values += [e] * len(chunk)
        return values

    def fitted(self, text: Encoded) -> list[int]:
        """The text's ids cut to the model's length (fit_ids), with a warning the first time."""
        if len(text.ids) > self.max_length and not self.warned_long:
            log.warning("reward model: a text of %d tokens is longer than the %d the model reads; it is cut in the "
                        "prompt's middle, its oldest turns first (the head tokens, the system turn and the completion "
                        "are kept). Said once", len(text.ids), self.max_length)
            self.warned_long = True
        return fit_ids(text.ids, self.max_length, text.specials, text.head, text.tail)

    def scores(self, ids: list[list[int]]) -> list[float]:
        """Each sequence's score as the classifier pools it (a decoder: the logit at its last token; an
        encoder: at its [CLS] head token), in one right-padded forward."""
        pad = padding_id(ids, self.tokenizer)
        width = max(map(len, ids))
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)  # [B, T]
        mask = torch.zeros(len(ids), width, dtype=torch.long)  # [B, T]
        for row, seq in enumerate(ids):
            input_ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
        # the classifier pools at the rightmost token that is not config.pad_token_id: make that the last real one
        self.model.config.get_text_config().pad_token_id = pad
        logits = self.model(input_ids=input_ids.to(self.model.device), attention_mask=mask.to(self.model.device)).logits
        return logits[:, 0].float().cpu().tolist()  # [B]


def fit_ids(ids: list[int], limit: int, specials: int, head: int, tail: int) -> list[int]:
    """`ids` cut to `limit` tokens from the middle: ids[:head] (special head tokens, system turn) and
    ids[tail:] (the completion's turn) stay, with as many of the prompt's latest tokens between them
    as fit; the oldest go first. When the completion's turn does not fit beside the head, the system
    turn is cut from its end, down to the special tokens ids[:specials]; when it does not fit beside
    those either, it loses its beginning (a decoder reads the score at its end)."""
    if len(ids) <= limit:
        return ids
    completion = len(ids) - tail  # the completion's turn, its closing tokens included
    kept_head = min(head if head + completion <= limit else max(specials, limit - completion), limit)
    return ids[:kept_head] + ids[len(ids) - (limit - kept_head):]


def token_at(offsets: list[tuple[int, int]], char: int) -> int:
    """The index of the first token that ends after character `char` (the one holding it); tokens the
    tokenizer added itself ([CLS], [SEP]: empty spans) are skipped. len(offsets) when none does."""
    return next((i for i, (start, end) in enumerate(offsets) if start < end and end > char), len(offsets))


def leading_specials(ids: list[int], tokenizer) -> int:
    """How many of the first ids are special tokens ([CLS], BOS, a chat template's opening token)."""
    special = set(tokenizer.all_special_ids)
    return next((i for i, token in enumerate(ids) if token not in special), len(ids))


def max_length(model, tokenizer) -> int:
    """The longest sequence the model reads: its positions, or its tokenizer's limit when smaller."""
    config = model.config.get_text_config()
    limits = [getattr(config, key, None) for key in ("max_position_embeddings", "n_positions")]
    limits.append(tokenizer.model_max_length if tokenizer.model_max_length < 10**7 else None)  # unset: a huge number
    return min((n for n in limits if n), default=10**7)


def without_system_turn(chat: list[dict]) -> list[dict]:
    """The chat with its system turn's text at the head of the first user turn."""
    system = [t for t in chat if t["role"] == "system"]
    rest = [t for t in chat if t["role"] != "system"]
    if system and rest and rest[0]["role"] == "user":
        rest[0] = {**rest[0], "content": f"{system[0]['content']}\n\n{rest[0]['content']}"}
    return rest


def padding_id(ids: list[list[int]], tokenizer) -> int:
    """A token id that no sequence ends with: the tokenizer's pad (or EOS) unless one does, else the lowest free id."""
    last = {seq[-1] for seq in ids if seq}
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None and candidate not in last:
            return candidate
    return next(i for i in range(len(last) + 1) if i not in last)
