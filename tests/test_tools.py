"""Tools as Python functions (grpo/environments/tools.py, tool_calls.py): schemas through the chat
template, the model's calls parsed, run in the environments' child, and their results rendered as
tool messages, token for token."""

import pytest
import torch
from conftest import REPO, checked_config
from transformers import AutoTokenizer

from grpo.common.sources import ModelError
from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.data.prompts import build_prompts, check_template_offers_tools
from grpo.environments import Reply, environment_args, prompt_options
from grpo.environments.calculator import calculate
from grpo.environments.pool import EnvironmentPool
from grpo.environments.tool_calls import ToolCall, parse_hermes, parse_llama3_json
from grpo.environments.tools import ToolEnvironment, tool_schema
from grpo.model.loading import read_chat_template
from grpo.sampler.episode_records import episode_metrics
from grpo.sampler.episodes import EpisodeRunner
from grpo.sampler.rollout import Rollouts
from grpo.settings.tree import ConfigError

TOOLS = str(REPO / "tests" / "tool_functions.py")
CALCULATE = "grpo.environments.calculator:calculate"


# ----------------------------------------------------------------------------- reading calls

@pytest.mark.parametrize("message, calls", [
    ("The answer is 4.", []),
    ('x\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "48 / 2"}}\n</tool_call>',
     [ToolCall("calculate", {"expression": "48 / 2"})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
     '<tool_call>{"name": "b", "arguments": {"n": 1}}</tool_call>',
     [ToolCall("a", {}), ToolCall("b", {"n": 1})]),
    ('<tool_call>{"name": "a", "arguments": {"n": 2}}', [ToolCall("a", {"n": 2})]),  # unclosed at the EOS: read
    ('<tool_call>{"name": "a", "arguments": {"n": 2</tool_call>',
     [ToolCall("", {}, "the tool call is not valid JSON (Expecting ',' delimiter at character 34)")]),
    ('<tool_call>{"name": "a", "arguments": "n=2"}</tool_call>',
     [ToolCall("a", {}, 'the "arguments" of a tool call must be a JSON object')]),
    ('<tool_call>["a"]</tool_call>', [ToolCall("", {}, 'a tool call is a JSON object with a "name" string')]),
])
def test_hermes_calls_are_read_as_written(message, calls):
    assert parse_hermes(message) == calls


@pytest.mark.parametrize("message, calls", [
    ("The answer is {4}.", []),  # braces in an answer that does not open as a call: no call
    ('{"name": "calculate", "parameters": {"expression": "2 + 2"}}', [ToolCall("calculate", {"expression": "2 + 2"})]),
    ('<|python_tag|>{"name": "a", "arguments": {"n": 1}}; {"name": "b", "arguments": {}}',
     [ToolCall("a", {"n": 1}), ToolCall("b", {})]),
    ('{"name": "a", "arguments": {"n": 1}',
     [ToolCall("", {}, "the tool call is not valid JSON (Expecting ',' delimiter at character 35)")]),
    ('{"tool": "a"}', [ToolCall("", {}, 'a tool call is a JSON object with a "name" string')]),
    ('<think>\n{"name": "a", "arguments": {"n": 1}', [ToolCall("", {}, "the tool call is not valid JSON (Expecting "
                                                                          "',' delimiter at character 35)")]),
])
def test_llama3_json_calls_are_read_as_written(message, calls):
    assert parse_llama3_json(message) == calls


# ----------------------------------------------------------------------------- the tools

def test_a_tools_schema_is_transformers_own_from_its_signature_and_docstring():
    from transformers.utils import get_json_schema

    schema = tool_schema(calculate)
    assert schema == get_json_schema(calculate)
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_a_tool_without_a_described_argument_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"tool_functions.py:undocumented cannot be offered to the model"):
        checked_config(None, [f"env.tools=[{TOOLS}:undocumented]"])
    with pytest.raises(ConfigError, match=r"env.tools: .*no_such_function"):
        checked_config(None, [f"env.tools=[{TOOLS}:no_such_function]"])
    with pytest.raises(ConfigError, match="env.tool_parser must be one of hermes, llama3_json; got 'mistral'"):
        checked_config(None, [f"env.tools=[{CALCULATE}]", "env.tool_parser=mistral"])
    with pytest.raises(ConfigError, match="env.tools is set, and env.name is 'calculator'"):
        checked_config(None, [f"env.tools=[{CALCULATE}]", "env.name=calculator"])
    with pytest.raises(ConfigError, match="model.chat_template: 'no-such.jinja' is neither a template file"):
        checked_config(None, ["model.chat_template=no-such.jinja"])
    with pytest.raises(ConfigError, match="env.args: max_call unknown for the tool environment; valid: max_calls, "
                                          "demonstration"):
        checked_config(None, [f"env.tools=[{CALCULATE}]", "env.args={max_call: 3}"])


def test_tools_alone_pick_the_tool_environment():
    cfg = load_config(None, [f"env.tools=[{CALCULATE}]"])
    assert cfg.env.name == "tools"
    assert environment_args(cfg.env) == {"tools": [CALCULATE], "parser": "hermes"}


def test_every_call_of_a_message_is_answered_and_every_failure_is_the_models_to_read():
    env = ToolEnvironment({}, [CALCULATE, f"{TOOLS}:lookup"], max_calls=3)
    message = ('<tool_call>{"name": "calculate", "arguments": {"expression": "48 / 2"}}</tool_call>'
               '<tool_call>{"name": "calculate", "arguments": {"expression": "1 / 0"}}</tool_call>'
               '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
               '<tool_call>{"name": "calculate", "arguments": {"formula": "2"}}</tool_call>'
               '<tool_call>{"name": "lookup", "arguments": {"key": "b"}}</tool_call>'
               '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>')
    reply = env.step(message)
    assert reply == Reply(text=["24",
                                "error: ZeroDivisionError: division by zero",
                                "error: there is no tool 'search'; tools: calculate, lookup",
                                "error: bad arguments for calculate: missing a required argument: 'expression'",
                                '{"b": [1, 2]}',
                                "error: no tool calls left in this episode"],
                          role="tool", tool_calls=6, tool_errors=4, malformed_calls=2)
    assert env.step("It is 24.") == Reply(done=True)  # no call: the answer


# ----------------------------------------------------------------------------- the chat template

def test_a_template_that_ignores_tools_is_refused_with_the_fix(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's own template: no tools
    schemas = [tool_schema(calculate)]
    with pytest.raises(ModelError, match="model.chat_template=chatml-tools"):
        check_template_offers_tools(tokenizer, schemas)
    tokenizer.chat_template = read_chat_template("chatml-tools")
    check_template_offers_tools(tokenizer, schemas)


class ScriptedModel:
    """The model's side of the episodes, scripted (a tiny random model makes no tool call): each
    episode's messages in order, found by the tag its first message holds. Everything else is real:
    the template, the tokenizer, the environments' child, the runner."""

    version, weights_digest = 0, ""

    def __init__(self, tokenizer, scripts: list[list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts

    def generate(self, contexts, group_size, *, seed=None, greedy=False, max_new_tokens=None):
        out = []
        for k, context in enumerate(contexts):
            text = self.tokenizer.decode(context)
            script = next((s for s in self.scripts if s[0] in text), None)
            if group_size > 1 or script is None:  # turn 1: each episode's first message, in order
                out += [self.scripts[k * group_size + j][0] for j in range(group_size)]
                continue
            out.append(script[sum(m in text for m in script)])
        ids = [torch.tensor(self.tokenizer(m, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
               for m in out]
        return Rollouts(completion_ids=ids, truncated=[False] * len(ids), logps=[torch.zeros(len(i)) for i in ids])


CALL = '<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


@pytest.mark.parametrize("special_tags", [False, True], ids=["plain-tags", "special-token-tags"])
def test_the_trainer_sees_the_sampled_tokens_and_the_templates_tool_messages_token_for_token(tiny_model_dir,
                                                                                             special_tags):
    """Also where the model's <tool_call> tags are special tokens (decoding for the rewards drops
    them; the environment reads them, as vLLM's parsers do)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = read_chat_template("chatml-tools")
    if special_tags:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    cfg = load_config(None, [f"env.tools=[{CALCULATE}]", "data.few_shot=0"])
    problem = Problem("train-0", "Natalia sold 48 clips in April and half as many in May. How many in all?", "72")
    prompts, _ = build_prompts(tokenizer, cfg.data, [problem], **prompt_options(cfg.env))
    scripts = [["ep0 half of 48 is\n" + CALL.format("48 / 2"), "ep0 then\n" + CALL.format("48 + 24"),
                "<answer>72</answer>"],
               ["ep1 both at once\n" + CALL.format("48 / 2") + "\n" + CALL.format("48 * 1.5"), "<answer>72</answer>"],
               ["ep2 " + CALL.format("48 / 0") + " and <tool_call>{oops}</tool_call>", "<answer>0</answer>"],
               ["ep3 <answer>72</answer>"]]
    pool = EnvironmentPool(cfg.env.name, environment_args(cfg.env), 5.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 400, 4, prefill="<think>\n", roles=("tool",))
        run = runner.run(ScriptedModel(tokenizer, scripts), prompts, 4)
    finally:
        pool.close()
    results = [[["24"], ["72"]], [["24", "72"]], [["error: ZeroDivisionError: division by zero",
                                                  "error: the tool call is not valid JSON (Expecting property name "
                                                  "enclosed in double quotes at character 1)"]], []]
    schemas = list(prompts[0].tools)
    for script, result, e, ids, mask in zip(scripts, results, run.episodes, run.rollouts.completion_ids,
                                            run.rollouts.model_masks):
        turns = list(prompts[0].turns)
        for k, message in enumerate(script):
            turns.append({"role": "assistant", "content": "<think>\n" + message})
            turns += [{"role": "tool", "content": r} for r in (result[k] if k < len(result) else [])]
        whole = tokenizer.apply_chat_template(turns, tools=schemas, tokenize=False).removesuffix("\n")
        assert prompts[0].token_ids + ids.tolist() == tokenizer(whole, add_special_tokens=False)["input_ids"]
        model_ids = [tokenizer(m, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for m in script]
        assert ids[mask].tolist() == sum(model_ids, [])  # the mask: exactly the sampled tokens
        assert e.last_message == "<think>\n" + script[-1]
    assert [(e.turns, e.tool_calls, e.tool_errors, e.malformed_calls) for e in run.episodes] == \
        [(3, 2, 0, 0), (2, 2, 0, 0), (2, 2, 2, 1), (1, 0, 0, 0)]
    assert episode_metrics(run.episodes)["env/well_formed_call_rate"] == 0.75


LLAMA31_TOOL_TURN = ("{% for m in messages %}{% if m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>"
                     "\n\n{{ m['content'] | tojson }}<|eot_id|>{% else %}<|start_header_id|>{{ m['role'] }}"
                     "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_a_template_that_rewrites_tool_results_is_refused_at_start(tiny_model_dir):
    """Llama 3.1's template writes a tool result through tojson: the model would read quotes and
    escapes the trainer never saw. Refused when the runner renders the roles, before any episode."""
    from grpo.sampler.episodes import TemplateRoleError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = LLAMA31_TOOL_TURN
    with pytest.raises(TemplateRoleError, match="does not show an environment message in role 'tool' as it is"):
        EpisodeRunner(None, tokenizer, 64, 4, roles=("tool",))
    EpisodeRunner(None, tokenizer, 64, 4, roles=("user",))  # its user turns are shown as they are


def test_the_gsm8k_tool_example_offers_the_tool_and_shows_solved_calls(tiny_model_dir):
    cfg = load_config(REPO / "configs" / "gsm8k_tools.yaml")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = read_chat_template(cfg.model.chat_template)
    shot = Problem("train-0", "48 clips in April, half as many in May: how many?", "72",
                   row={"answer": "48/2 = <<48/2=24>>24 in May. 48+24 = <<48+24=72>>72 in all.\n#### 72"},
                   reasoning="48/2 = 24 in May. 48+24 = 72 in all.")
    from grpo.data.prompts import encode_prompts

    options = prompt_options(cfg.env)
    prompts, _ = encode_prompts(tokenizer, [Problem("train-1", "What is 2 + 2?", "4")], cfg.data.system_prompt,
                                cfg.data.prefill, cfg.data.max_prompt_tokens, [shot], **options)
    text = tokenizer.decode(prompts[0].token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "calculate"' in text
    assert ('<think>\n48/2 =\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "48/2"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>') in text


# ----------------------------------------------------------------------------- calls checked, errors cut

PROBES = str(REPO / "tests" / "sandbox_probes.py")


def hermes(name: str, arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize("tool, arguments, text", [
    ("calculate", {"expression": 48}, "error: bad arguments for calculate: 'expression' must be a string"),
    ("scale", {"values": [1, "2"], "factor": 2}, "error: bad arguments for scale: 'values'[1] must be an integer"),
    ("scale", {"values": [1], "factor": True}, "error: bad arguments for scale: 'factor' must be a number"),
    ("scale", {"values": [1], "factor": 2, "exact": 1},
     "error: bad arguments for scale: 'exact' must be true or false"),
    ("scale", {"values": 3, "factor": 2}, "error: bad arguments for scale: 'values' must be an array"),
])
def test_arguments_that_do_not_fit_the_tools_schema_are_a_malformed_call_the_tool_never_sees(tool, arguments, text):
    env = ToolEnvironment({}, [CALCULATE, f"{PROBES}:scale"], max_calls=8)
    assert env.step(hermes(tool, arguments)) == Reply(text=[text], role="tool", tool_calls=1, tool_errors=1,
                                                      malformed_calls=1)
    assert env.calls_left == 8  # not run: no call spent
    assert env.step(hermes("scale", {"values": [1, 2], "factor": 2})) == Reply(text=["[2, 4]"], role="tool",
                                                                               tool_calls=1)  # an int is a number


def test_a_tools_error_is_cut_like_its_result():
    from grpo.environments import MAX_RESULT_CHARS

    env = ToolEnvironment({}, [f"{PROBES}:shout"])
    reply = env.step(hermes("shout", {"size": 1_000_000}))
    head = "error: ValueError: "
    assert reply.text == [head + "x" * (MAX_RESULT_CHARS - len(head)) + " ... (cut)"] and reply.tool_errors == 1
    reply = env.step(hermes("y" * 1_000_000, {}))  # an error that repeats what the model wrote
    assert len(reply.text[0]) == MAX_RESULT_CHARS + len(" ... (cut)") and reply.malformed_calls == 1


@pytest.mark.parametrize("message, calls", [
    ('The record is {"name": "Alice", "age": 31}.', []),  # data, not a call: vLLM requires arguments/parameters
    ('The record is {"name": "Alice"} and I call {"name": "a", "parameters": {"n": 1}}', [ToolCall("a", {"n": 1})]),
    ('{"name": "Alice", "age": 31}', [ToolCall("Alice", {}, 'a tool call holds its arguments in "arguments" (or '
                                                            '"parameters"): a JSON object')]),  # opens as a call
    ('<think>\n{"name": "a", "parameters": {"n": 1}', [ToolCall("", {}, "the tool call is not valid JSON (Expecting "
                                                                          "',' delimiter at character 36)")]),
])
def test_llama3_json_reads_an_object_as_a_call_only_with_its_arguments(message, calls):
    assert parse_llama3_json(message) == calls


NAMED_TOOL_TURN = ("{% for m in messages %}{% if m['role'] == 'tool' %}<|tool name={{ m['name'] }}|>{{ m['content'] }}"
                   "<|end|>{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_the_template_probe_renders_tool_messages_with_their_tools_name(tiny_model_dir):
    """A template that shows each tool message's name (as the few-shot examples carry it): rendered
    with the name, never an empty one; refused at start where the name is not known."""
    from test_episodes import reply_parts

    from grpo.sampler.episodes import TemplateRoleError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = NAMED_TOOL_TURN
    before, after = reply_parts(tokenizer, "tool", names=["calculate"])
    assert tokenizer.decode(before).endswith("<|tool name=calculate|>")
    with pytest.raises(TemplateRoleError, match="shows each tool message's tool name"):
        EpisodeRunner(None, tokenizer, 64, 4, roles=("tool",))
    tokenizer.chat_template = read_chat_template("chatml-tools")  # shows the content alone: the name changes nothing
    assert reply_parts(tokenizer, "tool") == reply_parts(tokenizer, "tool", names=["calculate"])


def test_an_environments_error_is_cut_like_a_tools():
    """An environment's exception text reaches the model within MAX_RESULT_CHARS, as a tool's does."""
    from grpo.environments import MAX_RESULT_CHARS
    from grpo.environments.pool import failed_reply

    text = failed_reply("x" * 1_000_000).text
    assert text == "error: the environment failed: " + "x" * (MAX_RESULT_CHARS - 31) + " ... (cut)"
