"""What a request to the agent endpoint may ask (grpo/agent/server.py serves it): refused by name where it would
sample from another policy than the one trained, or cannot be rendered; the sampling settings it names that the
run's own settings override, listed back to it; the limits of its answer (max_tokens, stop)."""

from __future__ import annotations

from grpo.sampler.rollout.sequences import TurnLimits

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "tool_choice", "parallel_tool_calls",  # the run's own hold
           "logprobs", "top_logprobs", "chat_template_kwargs")  # not returned; the template as the run renders it
CAPS = ("max_completion_tokens", "max_tokens")  # the answer's length: honoured within the episode's budget
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings a request may name, and their length
CONSTRAINED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
               "allowed_token_ids", "bad_words")  # vLLM's constrained decoding, refused as response_format is

class AgentError(Exception):
    """A request refused: the HTTP status, OpenAI's error type, the message (names what to change)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code, "param": None}}


def check_request(body, kind: str) -> list[str]:
    """AgentError for what cannot be honoured; the names of the sampling settings that are ignored."""
    if not isinstance(body, dict):
        raise AgentError(400, "the request body must be a JSON object")
    if kind == "chat":
        problem = messages_problem(body.get("messages"))
        if problem:
            raise AgentError(400, problem, code="messages")
    if kind == "chat" and body.get("tools") is not None and not (
            isinstance(body["tools"], list) and all(isinstance(t, dict) for t in body["tools"])):
        raise AgentError(400, "tools must be a list of tool objects", code="tools")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise AgentError(400, "stream_options must be an object", code="stream_options")
    if kind == "chat" and body.get("add_generation_prompt") is False and body.get("continue_final_message") is not True:
        raise AgentError(400, "add_generation_prompt=false without continue_final_message would have the model write "
                              "its turn's header itself: not served", code="add_generation_prompt")
    constrained = [name for name in CONSTRAINED if body.get(name) not in (None, [], {}, "")]
    if constrained:
        raise AgentError(400, f"{', '.join(constrained)} is not served: constrained decoding would sample from another "
                              "policy than the one trained", code=constrained[0])
    if kind == "chat" and body.get("continue_final_message") is True:
        if body["messages"][-1].get("role") != "assistant":
            raise AgentError(400, "continue_final_message goes on with the last message, which must be the "
                                  "assistant's", code="continue_final_message")
        if body.get("add_generation_prompt") is True:
            raise AgentError(400, "continue_final_message and add_generation_prompt cannot both be true",
                             code="add_generation_prompt")
    if kind == "completions" and not isinstance(body.get("prompt"), (str, list)):
        raise AgentError(400, "prompt must be a string or a list of token ids", code="prompt")
    for name in CAPS:
        value = body.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise AgentError(400, f"{name} must be a positive integer; got {value!r}", code=name)
    stop = body.get("stop")
    if stop is not None and stops_problem(stop):
        raise AgentError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings, each of 1 to "
                              f"{MAX_STOP_CHARS} characters ({stops_problem(stop)})", code="stop")
    if body.get("n", 1) not in (1, None):
        raise AgentError(400, f"n={body['n']} is not served: each session samples one completion per request "
                              "(the group's G completions are G sessions)", code="n")
    if body.get("logit_bias"):
        raise AgentError(400, "logit_bias is not served: the recorded log-probs must be the behaviour policy's",
                         code="logit_bias")
    if body.get("seed") is not None:
        raise AgentError(400, "seed is not served: the run seeds each turn itself (its seed and the step)",
                         code="seed")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object"):
        raise AgentError(400, f"response_format {response_format['type']} is not served: constrained decoding "
                              "would sample from another policy than the one trained", code="response_format")
    return [name for name in IGNORED if body.get(name) is not None]


def stops_problem(stop) -> str:
    """What makes `stop` no list of stop strings ('' nothing)."""
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        return f"got {type(stop).__name__}" + (f" of {len(stops)}" if isinstance(stops, list) else "")
    for i, x in enumerate(stops):
        if not isinstance(x, str) or not 0 < len(x) <= MAX_STOP_CHARS:
            return f"stop[{i}] is {type(x).__name__}" + (f" of {len(x)} characters" if isinstance(x, str) else "")
        try:
            x.encode()
        except UnicodeEncodeError:
            return f"stop[{i}] is no UTF-8 text (a lone surrogate)"
    return ""


def request_limits(body: dict) -> TurnLimits:
    """The limits of the request's answer: the most tokens it may hold (its max_completion_tokens, else max_tokens;
    None: no cap but the episode's budget, sampling.max_new_tokens, which also bounds a larger one) and its stop
    strings (the answer ends at the token that completes one; the text returned stops before it)."""
    stop = body.get("stop") or ()
    return TurnLimits(next((body[name] for name in CAPS if body.get(name) is not None), None),
                      (stop,) if isinstance(stop, str) else tuple(stop))


def before_stop(text: str, stops: tuple[str, ...]) -> str:
    """The text of an answer that ended at one of `stops`, up to that string (as OpenAI's API returns it): before
    its last place in `text`, where the decode stopped (an earlier one the decode did not read as one, split by a
    special token, say, is what the row holds and is returned as it is)."""
    at = max((text.rfind(stop) for stop in stops), default=-1)
    return text if at < 0 else text[:at]


def messages_problem(messages) -> str:
    """What makes `messages` no list of chat messages the template can render ('' nothing)."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of chat messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}"
        content = message.get("content")
        if content is not None and not isinstance(content, str) and not (
                isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                                  and isinstance(p.get("text"), str) for p in content)):
            return f"messages[{i}].content must be a string or a list of text parts (other parts are not served)"
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                return f"messages[{i}].{key} must be a string"
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            return f"messages[{i}].tool_calls must be a list of function calls"
    return ""
