"""A tool-calling agent loop of your own through the endpoint against the same episodes run natively (env.tools): the
real `openai` SDK reads the model's calls as `tool_calls`, runs the tool and sends the results back; the rows the
trainer gets must be the native runner's, token for token and mask for mask."""

import json

import openai
import pytest
import torch
from test_tools import CALCULATE, CALL, ScriptedModel
from transformers import AutoTokenizer

from grpo.agent.runner import AgentRunner
from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.data.prompts import build_prompts
from grpo.environments import environment_args, prompt_options
from grpo.environments.calculator import calculate
from grpo.environments.pool import EnvironmentPool
from grpo.model.loading import read_chat_template
from grpo.sampler.episodes import EpisodeRunner
from grpo.sampler.rollout import Rollouts

SCRIPTS = [["ep0 half of 48 is\n" + CALL.format("48 / 2"), "ep0 then\n" + CALL.format("48 + 24"),
            "<answer>72</answer>"],
           ["ep1 both at once\n" + CALL.format("48 / 2") + "\n" + CALL.format("48 * 1.5"), "<answer>72</answer>"],
           ["ep2 <answer>72</answer>"]]


def tool_agent(tools: list):
    """An agent loop as users write it: ask with the tools, run each call, send the results, until no call."""
    def agent(row, base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        messages = list(row["prompt_turns"])
        for _ in range(4):
            message = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
            if not message.tool_calls:
                return 1.0 if "<answer>72</answer>" in (message.content or "") else 0.0
            messages.append(message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": call.id,
                          "content": calculate(**json.loads(call.function.arguments))} for call in message.tool_calls]
        return 0.0
    return agent


# Llama 3.1's rules for tools, in SmolLM2's tokens: the functions offered as JSON in a system message, a call written
# as {"name": ..., "parameters": ...} alone (a calling message's text is not shown), a tool's result in the ipython role
LLAMA31_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\nTo call a function, reply with JSON {\"name\": its name, "
    "\"parameters\": its arguments}. Functions:\n' }}{%- for t in tools %}{{- t | tojson + '\n' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\n' }}"
    "{%- for c in m.tool_calls %}{%- set a = c.function.arguments %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (a if a is string else a | tojson) + '}' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>ipython\n' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
JSON_CALL = '{{"name": "calculate", "parameters": {{"expression": "{}"}}}}'
JSON_SCRIPTS = [[JSON_CALL.format("48 / 2"), JSON_CALL.format("48 + 24"), "ep0 <answer>72</answer>"],
                [JSON_CALL.format("48 * 0.5"), "ep1 <answer>72</answer>"],
                ["ep2 <answer>72</answer>"]]


@pytest.mark.parametrize("template, parser, scripts", [("chatml-tools", "hermes", SCRIPTS),
                                                       (LLAMA31_STYLE, "llama3_json", JSON_SCRIPTS)],
                         ids=["qwen2.5-hermes", "llama3.1-json"])
def test_a_tool_loop_through_the_endpoint_gives_the_native_tool_episodes_rows_token_for_token(tiny_model_dir,
                                                                                              template, parser,
                                                                                              scripts):
    """Qwen2.5's template (chatml-tools, hermes calls) and a template with Llama 3.1's rules (JSON calls, results
    in the ipython role): the same scripted turns, through the SDK and natively, give the same rows."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = read_chat_template(template) if template == "chatml-tools" else template
    cfg = load_config(None, [f"env.tools=[{CALCULATE}]", "data.few_shot=0", "data.prefill=",
                             f"env.tool_parser={parser}"])
    problem = Problem("train-0", "Natalia sold 48 clips in April and half as many in May. How many in all?", "72")
    prompts, _ = build_prompts(tokenizer, cfg.data, [problem], **prompt_options(cfg.env))
    pool = EnvironmentPool(cfg.env.name, environment_args(cfg.env), 5.0)
    try:
        native = EpisodeRunner(pool, tokenizer, 400, 4, prefill="", roles=("tool",)).run(
            ScriptedModel(tokenizer, scripts), prompts, 3)
    finally:
        pool.close()

    agent_cfg = load_config(None, ["agent.entrypoint=unused:fn", "data.prefill=", "agent.max_turns=4",
                                   f"agent.tool_parser={parser}"])
    runner = AgentRunner(agent_cfg.agent, tokenizer, 400, 1024, "policy", entrypoint=tool_agent(list(prompts[0].tools)))
    try:
        agent = runner.run(ScriptedModel(tokenizer, scripts), prompts, 3)
    finally:
        runner.close()

    assert agent.prompts[0].token_ids == prompts[0].token_ids  # the first request renders the run's own prompt
    assert [ids.tolist() for ids in agent.rollouts.completion_ids] == \
        [ids.tolist() for ids in native.rollouts.completion_ids]
    assert [m.tolist() for m in agent.rollouts.model_masks] == [m.tolist() for m in native.rollouts.model_masks]
    assert [e.turns for e in agent.episodes] == [e.turns for e in native.episodes] == [3, 2, 1]
    assert [e.env_errors for e in agent.episodes] == [0, 0, 0] and [e.reward for e in agent.episodes] == [1.0] * 3
    assert [e.tool_calls for e in native.episodes] == [2, 1 + (parser == "hermes"), 0]  # hermes: ep1 calls twice
    assert sum(sum(e.continued.values()) for e in agent.episodes) == 3  # every later request continued the row
    assert not any(e.row_starts for e in agent.episodes)


def agent_run(tokenizer, engine, harness, template="chatml-tools"):
    """One prompt's one session of `harness` on a scripted `engine`, with the calculator offered."""
    tokenizer.chat_template = read_chat_template(template)
    cfg = load_config(None, [f"env.tools=[{CALCULATE}]", "data.few_shot=0", "data.prefill="])
    problem = Problem("train-0", "What are 1 + 1, 2 + 2 and 3 + 3?", "2 4 6")
    prompts, _ = build_prompts(tokenizer, cfg.data, [problem], **prompt_options(cfg.env))
    agent_cfg = load_config(None, ["agent.entrypoint=unused:fn", "data.prefill=", "agent.max_turns=3"])
    runner = AgentRunner(agent_cfg.agent, tokenizer, 400, 1024, "policy", entrypoint=harness(list(prompts[0].tools)))
    try:
        return runner.run(engine, prompts, 1)
    finally:
        runner.close()


def test_three_parallel_calls_answered_out_of_order_then_a_message_with_a_malformed_call(tiny_model_dir):
    """The model calls three tools at once; the harness answers them last first (each by its id): the row goes on,
    the results in the order sent. Its next message holds a call that cannot be read beside a good one: the harness
    gets the whole message as text, no tool_calls (as from vLLM's parser), and the row holds what was sampled."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    broken = '<tool_call>\n{"name": "calculate", "arguments": {"expression": </tool_call>'
    scripts = [["ep0 all three\n" + "\n".join(CALL.format(e) for e in ("1 + 1", "2 + 2", "3 + 3")),
                "ep0 again\n" + CALL.format("4 + 4") + "\n" + broken]]
    seen = []

    def harness(tools):
        def agent(row, base_url, key):
            client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
            messages = list(row["prompt_turns"])
            message = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": call.id,
                          "content": calculate(**json.loads(call.function.arguments))}
                         for call in reversed(message.tool_calls)]
            reply = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0]
            seen.append((len(message.tool_calls), reply.finish_reason, reply.message.tool_calls,
                         reply.message.content))
            return 1.0
        return agent

    run = agent_run(tokenizer, ScriptedModel(tokenizer, scripts), harness)
    assert seen == [(3, "stop", None, scripts[0][1])]
    e = run.episodes[0]
    assert e.turns == 2 and sum(e.continued.values()) == 1 and not e.breaks and not e.row_starts
    sampled = [tokenizer(m, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for m in scripts[0]]
    assert [t for t, m in zip(e.tokens, e.model) if m] == sampled[0] + sampled[1]
    context = tokenizer.decode([t for t, m in zip(e.tokens, e.model) if not m])
    assert context.index("6") < context.index("4") < context.index("2")  # the results in the order the harness sent


class ByteTokens:
    """The model's side, scripted as token ids: one message whose characters are split across byte-level tokens
    (é in 2, ☕ in 3), as a model may sample them."""

    version, weights_digest = 0, ""

    def __init__(self, tokenizer, ids: list[int]):
        self.tokenizer, self.ids = tokenizer, ids

    def generate(self, contexts, group_size, *, seed=None, greedy=False, max_new_tokens=None):
        ids = [torch.tensor(self.ids + [self.tokenizer.eos_token_id]) for _ in range(len(contexts) * group_size)]
        return Rollouts(completion_ids=ids, truncated=[False] * len(ids), logps=[torch.zeros(len(i)) for i in ids])


def test_a_character_split_across_sampled_tokens_reaches_a_stream_whole(tiny_model_dir):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    byte = bytes_to_unicode()
    text = "Café ☕ at 7."
    ids = [tokenizer.convert_tokens_to_ids(byte[b]) for b in text.encode()]  # one token a byte
    assert tokenizer.decode(ids[3:5]) == "é" and tokenizer.decode(ids[3:4]) != "é"
    streamed = []

    def harness(tools):
        def agent(row, base_url, key):
            client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
            for chunk in client.chat.completions.create(model="policy", messages=list(row["prompt_turns"]),
                                                        stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    streamed.append(chunk.choices[0].delta.content)
            return 1.0
        return agent

    run = agent_run(tokenizer, ByteTokens(tokenizer, ids), harness)
    assert "".join(streamed) == text and "\ufffd" not in "".join(streamed)
    assert run.episodes[0].tokens == ids + [tokenizer.eos_token_id] and all(run.episodes[0].model)
