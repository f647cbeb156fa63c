"""Chat prompts: the system prompt, the question, and an optional prefill of the answer."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.common.sources import ModelError
from grpo.common.verifiers_bridge import is_verifiers
from grpo.data.images import ImageReader, PromptImages
from grpo.data.problems import Problem


@dataclass(frozen=True)
class Prompt:
    problem: Problem
    token_ids: list[int]  # the whole prompt, prefill included, no padding
    turns: tuple = ()  # the chat it was rendered from (before the generation prompt and prefill)
    tools: tuple = ()  # the tools' JSON schemas the chat template offered in it (env.tools)
    images: object = None  # ImageSource of its images, or None (text alone)


def solved_answer(shot: Problem) -> str:
    """A shot's answer in the trained format: its worked solution in <think> when it has one
    (GSM8K), else the answer alone (a reasoning-gym task's rows carry no solution)."""
    if shot.reasoning:
        return f"<think>\n{shot.reasoning}\n</think>\n<answer>\n{shot.answer}\n</answer>"
    return f"<answer>{shot.answer}</answer>"


def solved_turns(shots: list[Problem], demonstrate=None) -> list[dict]:
    """Few-shot examples as earlier chat turns, answered in the trained format. `demonstrate(row,
    answer)`: an environment's way to show a shot solved in turns with it (its tool calls and
    replies, then the answer), or None to show the answer alone."""
    turns = []
    for shot in shots:
        shown = demonstrate(shot.row, solved_answer(shot)) if demonstrate is not None else None
        turns += [{"role": "user", "content": shot.question},
                  *(shown or [{"role": "assistant", "content": solved_answer(shot)}])]
    return turns


def prompt_turns(question: str, system_prompt: str | None, shots: list[Problem] = (), messages: tuple = (),
                 demonstrate=None) -> list[dict]:
    """The prompt's chat turns. A dataset's own chat `messages` replace the question; the system
    prompt goes first unless they open with a system turn of their own (or it is None: none)."""
    conversation = list(messages) or [{"role": "user", "content": question}]
    own = conversation[0]["role"] == "system" or system_prompt is None
    system = [] if own else [{"role": "system", "content": system_prompt}]
    return [*system, *solved_turns(shots, demonstrate), *conversation]


def render(tokenizer, turns: list[dict], prefill: str, tools: tuple | list = ()) -> str:
    return tokenizer.apply_chat_template(turns, tools=list(tools) or None, tokenize=False,
                                         add_generation_prompt=True) + prefill


def check_template_offers_tools(tokenizer, tools: list[dict]) -> None:
    """A chat template that ignores `tools` would train a model never told of them: ModelError."""
    turns = [{"role": "user", "content": "q"}]
    if (not getattr(tokenizer, "chat_template", None)
            or render(tokenizer, turns, "", tools) == render(tokenizer, turns, "")):
        raise ModelError("the model's chat template does not offer tools (env.tools): set model.chat_template to "
                         "a template that does, e.g. model.chat_template=chatml-tools for a ChatML model such as "
                         "the embedded SmolLM2 (docs/environments.md)")


OPENING = "\ue002"  # a private-use character: a marker no chat template holds


def prompt_text(tokenizer, question: str, system_prompt: str, prefill: str = "", shots: list[Problem] = (),
                messages: tuple = (), demonstrate=None) -> str:
    """The chat-templated prompt (see `prompt_turns`), prefill included."""
    return render(tokenizer, prompt_turns(question, system_prompt, shots, messages, demonstrate), prefill)


def with_opening(tokenizer, prompt: Prompt, opening: str, prefill: str,
                 max_tokens: int | None = None) -> tuple[Prompt, bool]:
    """The prompt with an environment's opening message (an OpenEnv environment's reset
    observation) after the question: in the question's own user turn, so that templates which
    require alternating roles take it, else in a user turn of its own; and whether the opening was
    cut to keep the prompt within `max_tokens`. The opening is read as plain text: special tokens
    in it cannot end the turn. Whole, it is tokenized with the template around it in one piece, as
    the whole conversation is (with Qwen2's pre-tokenizer a `.` and the newline after it are one
    token); cut, or holding a special token's text, the pieces are tokenized apart. A prompt not
    rendered from chat turns (made by hand) gets it after its tokens between newlines."""
    body = tokenizer(opening, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    if not prompt.turns or not getattr(tokenizer, "chat_template", None):
        before, after = prompt.token_ids + newline, newline
    else:
        head, tail = render(tokenizer, list(_opened_turns(prompt.turns, OPENING)), prefill, prompt.tools).split(OPENING)
        before, after = (tokenizer(x, add_special_tokens=False)["input_ids"] for x in (head, tail))
        whole = tokenizer(head + opening + tail, add_special_tokens=False)["input_ids"]
        if not any(special in opening for special in special_texts(tokenizer)) and \
                (max_tokens is None or len(whole) <= max_tokens):  # as serving tokenizes the conversation
            return Prompt(prompt.problem, whole, _opened_turns(prompt.turns, opening), prompt.tools), False
    room = len(body) if max_tokens is None else max_tokens - len(before) - len(after)
    if room < 0:  # not even an empty opening fits
        return prompt, True
    shown = body[:room]
    return Prompt(prompt.problem, before + shown + after, _opened_turns(prompt.turns, tokenizer.decode(shown)),
                  prompt.tools), \
        room < len(body)


def special_texts(tokenizer) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (<|im_end|>, ...): what an environment's message may not
    turn into control tokens."""
    return tuple(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)


def _opened_turns(turns: tuple, opening: str) -> tuple:
    """The prompt's turns with the opening in the last user turn, else a user turn of its own."""
    if not turns:
        return turns
    if turns[-1]["role"] == "user":
        return (*turns[:-1], {**turns[-1], "content": f"{turns[-1]['content']}\n\n{opening}"})
    return (*turns, {"role": "user", "content": opening})


ENCODE_BATCH = 2048  # prompts per tokenizer call


@dataclass(frozen=True)
class ImageSource:
    """A prompt's images, made into the model's input when a step draws the prompt (`load`): a dataset's pixel
    values held for every prompt at once would not fit in memory."""

    reader: ImageReader
    images: tuple[bytes, ...]

    def load(self) -> PromptImages:
        return self.reader.pixels(self.images)


def prompt_images(prompts: list) -> list | None:
    """Each prompt's images (PromptImages, or None for a prompt without), made now; None when no prompt has any."""
    if all(p.images is None for p in prompts):
        return None
    return [p.images.load() if isinstance(p.images, ImageSource) else p.images for p in prompts]


def image_prompt_text(tokenizer, reader: ImageReader, turns: list[dict], prefill: str,
                      images: tuple[bytes, ...]) -> str:
    """A prompt with images, as text: its images as content parts before the last turn's text (the chat template
    writes a placeholder for each), each placeholder widened to its image's tokens."""
    last = turns[-1]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": last["content"]}]
    text = render(tokenizer, [*turns[:-1], {**last, "content": parts}], prefill)
    return reader.widen(text, reader.token_counts(images))


def encode_prompts(tokenizer, problems: list[Problem], system_prompt: str | None, prefill: str,
                   max_prompt_tokens: int, shots: list[Problem] = (), demonstrate=None,
                   tools: list[dict] | None = None, processor=None) -> tuple[list[Prompt], int]:
    """Tokenised prompts, and how many were dropped for being longer than `max_prompt_tokens`.
    The `shots` themselves are not asked. `tools`: JSON schemas the chat template offers. `processor`: the
    vision-language model's, for problems with images (their image tokens count in the length)."""
    tools = tuple(tools or ())
    if tools:
        check_template_offers_tools(tokenizer, list(tools))
    shown = {shot.id for shot in shots}
    asked = [problem for problem in problems if problem.id not in shown]
    turns = [prompt_turns(problem.question, system_prompt, shots, problem.messages, demonstrate) for problem in asked]
    # in batches: a fast tokenizer encodes each in Rust (10k prompts: ~0.5 s against ~2.6 s one by one),
    # a few thousand at a time to bound the memory; the chat template already holds the special tokens,
    # so no BOS is added twice
    if any(problem.images for problem in asked) and processor is None:
        raise ModelError("the dataset's prompts hold images (data.image_column), and the model has no image "
                         "processor: use a vision-language model (Qwen2-VL, Qwen2.5-VL) with its processor's files")
    texts = [image_prompt_text(tokenizer, processor, t, prefill, problem.images) if problem.images
             else render(tokenizer, t, prefill, tools) for problem, t in zip(asked, turns)]
    encoded = [ids for start in range(0, len(texts), ENCODE_BATCH)
               for ids in tokenizer(texts[start:start + ENCODE_BATCH], add_special_tokens=False,
                                    return_attention_mask=False)["input_ids"]]
    prompts = [Prompt(problem, ids, tuple(t), tools, ImageSource(processor, problem.images) if problem.images else None)
               for problem, ids, t in zip(asked, encoded, turns) if len(ids) <= max_prompt_tokens]
    return prompts, len(asked) - len(prompts)


def few_shot_examples(data_cfg, count: int) -> list[Problem]:
    """The first `count` train problems (data.few_shot), solved, to show before every question."""
    if count == 0:
        return []
    from grpo.data.problems import load_split

    problems, _ = load_split(data_cfg, "train")
    return problems[:count]


def build_prompts(tokenizer, data_cfg, problems: list[Problem], demonstrate=None,
                  tools: list[dict] | None = None, processor=None) -> tuple[list[Prompt], int]:
    """The training / evaluation prompts as `data.*` configures them (`demonstrate`: see
    `solved_turns`; `tools`: grpo.environments.prompt_options; `processor`: a vision-language model's, for
    prompts with images)."""
    shots = few_shot_examples(data_cfg, data_cfg.few_shot)
    # a verifiers environment's prompt is its own, as its rollouts send it: no system prompt of the run's added
    system_prompt = None if is_verifiers(data_cfg.path) else data_cfg.system_prompt
    return encode_prompts(tokenizer, problems, system_prompt, data_cfg.prefill, data_cfg.max_prompt_tokens,
                          shots, demonstrate, tools, processor)
