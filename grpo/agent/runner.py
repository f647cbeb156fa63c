"""Agent sessions as the step's episodes: each sample's turns are sampled for your own agent loop's requests.

For each prompt row and group member, a session is opened on the sampler's endpoint (grpo/agent/server.py) and
agent.entrypoint is started with the row, the session's base URL and its key (grpo/agent/harness.py). Its first
request is the episode's prompt: the G sessions of a row must open with the same render (the group's shared
prompt; one that differs is refused). Then the engine's episode loop (the same one environments use:
grpo/sampler/episodes.py) samples each turn from token ids with the run's settings, and each turn's message is
the answer to the request waiting for it (bridge.py). The harness's next request is matched with what was served
(the prefix rule: history.py, tokens.py): CLEAN when the template's fresh render extends the row's tokens,
EQUIVALENT when only new tool or user messages follow our message, unchanged, and the template still shows every
earlier turn (the new messages are rendered by the reply rule); anything else (thinking dropped, a history edited
or compacted, a message we did not write) starts a NEW_ROW of the sample: the model reads the fresh render, and
the engine's loop starts that sequence's context again after the group's prompt. A request that changes the
tools or the prompt, or asks for a turn already sampled, is refused, naming why, and the session ends there. The
tokens of the harness's messages and the template's (a new row's re-rendered history too) are context (masked);
only sampled tokens are trained, each once, and a turn whose response did not reach its client whole (never
received) is masked too. A sample's rows share its reward and advantage; each is read after the prompt alone.

With agent.max_sessions, a step's sessions go in waves of whole groups, each wave's harnesses started once the
wave before has ended (its own seed: no two waves draw alike).

The session's reward is what the harness returned or posted to /reward: the `env_reward` reward; the other
rewards in rewards.names score its last assistant message.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from grpo.agent.bridge import Conversation, continues_final, history_of
from grpo.agent.harness import HarnessError, Harnesses
from grpo.agent.history import text_of
from grpo.agent.messages import assistant_turn
from grpo.agent.requests import before_stop, request_limits
from grpo.agent.server import SOCKET_TIMEOUT_S, AgentError, AgentServer, Session, Sessions, Turn
from grpo.agent.tokens import NEW_ROW, RequestTokens, check_not_reread
from grpo.rewards.strict import reward_rows
from grpo.sampler.episode_records import Episode, Episodes
from grpo.sampler.episodes import EpisodeRunner, episode_runner, stamp_versions
from grpo.sampler.rollout.continuous import episode_loop
from grpo.sampler.rollout.decoding import StopStrings
from grpo.sampler.rollout.sequences import NO_LIMITS, NewRow, ReplyTokens, TurnLimits, hashed_seed

if TYPE_CHECKING:
    from grpo.settings import AgentConfig, Config

log = logging.getLogger(__name__)

@dataclass
class AgentSession:
    """One sample's session: its conversation with the harness, and the episode it fills."""

    session: Session
    conversation: Conversation
    episode: Episode
    deadline: float
    harness: object = None  # the Future of the harness's reward
    kind: str = ""  # chat or completions: its first request's
    tools: list | None = None  # the tools its first request offered (the template shows them)
    served: list = field(default_factory=list)  # the messages of the request answered last
    prompt: list[int] = field(default_factory=list)  # its first request's render
    prefill: str = ""  # the text of the assistant turn the last request began (continue_final_message)
    limits: TurnLimits = NO_LIMITS  # the last request's max_tokens and stop, for its answer
    opened: bool = False

    def gone(self) -> bool:
        return self.harness is not None and self.harness.done()


class AgentRunner:
    """Runs a step's samples as agent sessions on any engine; `run` gives Episodes like EpisodeRunner's."""

    def __init__(self, settings: AgentConfig, tokenizer, max_new_tokens: int, max_prompt_tokens: int,
                 model_name: str, entrypoint=None, scores_env_reward: bool = True,
                 truncated_reward: float | None = None, verifiers_args: dict | None = None):
        from grpo.common.imports import import_object

        self.settings, self.tokenizer = settings, tokenizer
        self.max_new_tokens, self.max_prompt_tokens = max_new_tokens, max_prompt_tokens
        self.sessions = Sessions()
        self.server = AgentServer(self.sessions, model_name)
        if entrypoint is None and (settings.command or settings.verifiers):
            from grpo.agent.command import AgentCommand, verifiers_command

            command, readable = settings.command, settings.readable
            if settings.verifiers:  # its rollout script, run as a command
                command, readable = verifiers_command(settings.verifiers, verifiers_args or {}, model_name, readable)
            entrypoint = AgentCommand(command, self.server.port, settings.session_timeout_s,
                                      settings.memory_mb, settings.max_processes, settings.cpu_s, readable)
        self.harnesses = Harnesses(entrypoint or import_object(settings.entrypoint, "agent.entrypoint"))
        # its reply rule (the harness's new messages after our turn) and its turn-by-turn path are the environments'
        self.episodes = EpisodeRunner(None, tokenizer, max_new_tokens, settings.max_turns, roles=())
        self.requests = RequestTokens(tokenizer, self.episodes.reply_tokens, self.episodes._tokenizing, max_new_tokens)
        self.scores_env_reward, self.truncated_reward = scores_env_reward, truncated_reward
        self._told_unscored = False
        self._ids = 0
        self._ids_lock = threading.Lock()
        self.runs = 0

    def close(self) -> None:
        self.server.close()
        if hasattr(self.harnesses.fn, "close"):  # agent.command's jails
            self.harnesses.fn.close()

    def run(self, engine, prompts: list, group_size: int, *, seed: int | None = None, greedy: bool = False) -> Episodes:
        """The step's sessions, all at once, or in waves of whole groups of at most agent.max_sessions sessions
        (each wave's seed its own: no two waves draw alike)."""
        self.runs += 1
        rows = reward_rows(prompts)
        per_wave = max(1, self.settings.max_sessions // group_size if self.settings.max_sessions else len(prompts))
        shown, episodes = [], []
        for w, start in enumerate(range(0, len(prompts), per_wave)):
            wave_seed = seed if seed is None or w == 0 else hashed_seed(f"{seed}/agent-wave{w}")
            wave_shown, wave_episodes = self._wave(engine, prompts[start:start + per_wave],
                                                   rows[start:start + per_wave], group_size, wave_seed, greedy)
            shown += wave_shown
            episodes += wave_episodes
        return Episodes.of(shown, episodes, [rows[j // group_size] for j in range(len(episodes))])

    def _wave(self, engine, prompts: list, rows: list[dict], group_size: int, seed: int | None,
              greedy: bool) -> tuple[list, list[Episode]]:
        agents = [self._open(harness_row(prompts[j // group_size], rows[j // group_size]))
                  for j in range(len(prompts) * group_size)]
        executor, crashed = ThreadPoolExecutor(len(agents), thread_name_prefix="agent-turn"), True
        try:
            shown = [self._group_prompt(prompt, agents[i * group_size:(i + 1) * group_size])
                     for i, prompt in enumerate(prompts)]
            self._sample(engine, shown, group_size, agents, executor, seed, greedy)
            crashed = False
        finally:
            for agent in agents:  # every session ends with the step: a later request is refused
                agent.conversation.end()
            executor.shutdown(wait=True)  # the turns' threads see their sessions ended
            # a session that never opened is left out whatever its harness says: it is not waited for
            rewards = [self._reward(agent, wait=not crashed and agent.opened) for agent in agents]
            for agent in agents:
                self.sessions.forget(agent.session.token)
        episodes = [agent.episode for agent in agents]
        for e, reward in zip(episodes, rewards):  # a session cut at the budget scores what the run says
            e.reward = self.truncated_reward if e.truncated and self.truncated_reward is not None else reward
        return shown, episodes

    # ------------------------------------------------------------------ sessions' start and end

    def _open(self, row: dict) -> AgentSession:
        conversation = Conversation(self.settings.idle_timeout_s, self.settings.session_timeout_s)
        session = self.sessions.open(conversation.answer, on_end=conversation.end)
        agent = AgentSession(session, conversation, Episode(agent=True),
                             time.monotonic() + self.settings.session_timeout_s)
        agent.harness = self.harnesses.start(row, self.server.base_url(session), session.token)
        return agent

    def _group_prompt(self, prompt, agents: list[AgentSession]):
        """The group's prompt: its sessions' first requests rendered, which must agree; the dataset's prompt where
        none opened (its samples then fail)."""
        for agent in agents:
            self._first(agent)
        opened = [agent for agent in agents if agent.opened]
        if not opened:
            log.warning("prompt %s: none of its %d agent sessions sent a request (%s); its samples fail",
                        prompt.problem.id, len(agents), agents[0].episode.env_error)
            return prompt
        first = opened[0]
        for agent in opened[1:]:
            if agent.prompt != first.prompt:
                at = next((k for k, (a, b) in enumerate(zip(agent.prompt, first.prompt)) if a != b),
                          min(len(agent.prompt), len(first.prompt)))
                self._refuse(agent, AgentError(400, f"the {len(agents)} sessions of a dataset row must open with the "
                                                    "same messages (they share the group's prompt); this one's "
                                                    f"render differs from the first's at token {at}",
                                               code="group_prompt"), "group_prompt")
        return replace(prompt, token_ids=list(first.prompt), turns=tuple(first.served))

    def _first(self, agent: AgentSession) -> None:
        """The session's first request taken and rendered (agent.opened), or its failure recorded."""
        taken = agent.conversation.first(min(self.settings.idle_timeout_s, agent.deadline - time.monotonic()),
                                         agent.gone)
        if isinstance(taken, str):
            self._fail(agent, self._why_no_request(agent), opened=False)
            return
        kind, body = taken
        try:
            ids = self.requests.first(kind, body)
        except AgentError as error:
            self._refuse(agent, error, error.code or "bad_request")
            return
        except Exception as error:  # a bug's or a request's: this session is refused, the step goes on
            log.exception("agent session %s: its first request failed", agent.session.token[:6])
            self._refuse(agent, AgentError(500, f"the sampler failed on this request ({type(error).__name__})",
                                           kind="server_error"), "server_error")
            return
        if len(ids) > self.max_prompt_tokens:
            self._refuse(agent, AgentError(400, f"the first request is {len(ids)} tokens, over "
                                                f"data.max_prompt_tokens={self.max_prompt_tokens}",
                                           code="context_length_exceeded"), "context_length_exceeded")
            return
        agent.kind, agent.tools, agent.prompt = kind, body.get("tools"), ids
        self._serve(agent, body)
        agent.opened = True

    def _why_no_request(self, agent: AgentSession) -> str:
        if agent.gone():
            error = agent.harness.exception()
            return str(error) if error is not None else "the agent returned without a request"
        return f"the agent sent no request within agent.idle_timeout_s={self.settings.idle_timeout_s:g} s"

    def _refuse(self, agent: AgentSession, error: AgentError, reason: str) -> None:
        """The session's first request refused: it ends before any turn, and is left out of the step's scores."""
        agent.conversation.refuse(error)
        agent.conversation.end()
        agent.opened = False
        agent.episode.breaks[reason] = agent.episode.breaks.get(reason, 0) + 1
        self._fail(agent, f"refused: {error}", opened=False)

    @staticmethod
    def _fail(agent: AgentSession, why: str, opened: bool = True) -> None:
        """A failure of the session; `opened` False: before any turn (no score of it would mean anything: it is
        left out, as an environment that could not open)."""
        agent.episode.count_failure(why)
        agent.episode.open_failed = agent.episode.open_failed or not opened

    def _reward(self, agent: AgentSession, wait: bool = True) -> float | None:
        """The session's reward: posted to /reward, else returned by the harness (waited for until the session's
        deadline, unless `wait` is False; a harness still running then is cancelled, or left to return); None
        where it gave none."""
        e = agent.episode
        try:
            returned = agent.harness.result(timeout=max(agent.deadline - time.monotonic(), 0.0) if wait else 0.0)
        except HarnessError as error:
            returned = None
            if agent.session.reward is None or getattr(self.harnesses.fn, "failure_voids_reward", False):
                agent.session.reward = None  # a program that failed: what was posted from inside it is not trusted
                e.count_failure(str(error))
        except Exception:  # still running (TimeoutError), or cancelled
            returned = None
            agent.harness.cancel()
            e.count_failure(f"the agent did not return within agent.session_timeout_s="
                            f"{self.settings.session_timeout_s:g} s")
            log.warning("an agent harness is still running past agent.session_timeout_s=%g s: its session is "
                        "closed (every call it makes is refused)", self.settings.session_timeout_s)
        reward = agent.session.reward if agent.session.reward is not None else returned
        if reward is not None and not self.scores_env_reward and not self._told_unscored:
            self._told_unscored = True
            log.warning("your agent gives rewards, and rewards.names does not hold env_reward: they are not trained "
                        "on; add env_reward to rewards.names (and its weight to rewards.weights)")
        if reward is None and self.scores_env_reward and not e.env_errors:
            e.count_failure("the agent gave no reward: return one from agent.entrypoint, or POST {\"reward\": x} to "
                            "the session's /reward")
        return reward

    # ------------------------------------------------------------------ sampling

    def _sample(self, engine, prompts: list, group_size: int, agents: list[AgentSession], executor, seed, greedy):
        def on_turn(j: int, ids: torch.Tensor, logps: torch.Tensor, truncated: bool) -> list[int] | None:
            return self._turn(agents[j], prompts[j // group_size].token_ids, ids, logps, truncated)

        prompt_ids = [p.token_ids for p in prompts]
        # continuous batching off, the HF loop would call each harness in turn: turn by turn waits on all at once
        continuous = getattr(getattr(engine, "cfg", None), "continuous_batching", True)
        loop = episode_loop(engine) if continuous else None
        limits = [agent.limits for agent in agents]  # each first request's max_tokens and stop
        if loop is not None:
            stamp_versions([agent.episode for agent in agents],
                           loop(prompt_ids, group_size, on_turn, self.max_new_tokens, seed=seed, greedy=greedy,
                                executor=executor, first_limits=limits))
        else:
            # a round's turns handed to all their harnesses at once: each waits for its own, not the others'
            self.episodes._turn_by_turn(engine, prompt_ids, group_size, on_turn, seed, greedy, executor=executor,
                                        first_limits=limits)

    def _turn(self, agent: AgentSession, prompt: list[int], ids: torch.Tensor, logps: torch.Tensor,
              truncated: bool) -> list[int] | None:
        """One sampled turn handed to the request waiting for it; the tokens of the harness's next request, or
        None when the session is over. Whatever goes wrong in it ends this session, never the step."""
        e = agent.episode
        before = len(e.tokens)
        self.episodes._add_model_turn(e, ids, logps, truncated)
        e.truncated = truncated and len(e.tokens) >= self.max_new_tokens  # not at a request's own max_tokens
        if not agent.opened:  # its harness never asked: nobody reads this turn, and it is not trained
            e.model[before:] = [False] * (len(e.tokens) - before)
            return None
        try:
            return self._answered(agent, e, prompt, ids, truncated, before)
        except Exception as error:  # a bug's or a request's: this session fails, the others go on
            log.exception("agent session %s failed", agent.session.token[:6])
            agent.conversation.refuse(AgentError(500, f"the sampler failed on this request ({type(error).__name__})",
                                                 kind="server_error"))
            agent.conversation.end()
            e.count_failure(f"the sampler failed on its request ({type(error).__name__}: {error})")
            return None

    def _answered(self, agent: AgentSession, e: Episode, prompt: list[int], ids: torch.Tensor, truncated: bool,
                  before: int) -> list[int] | None:
        start = e.row_starts[-1] if e.row_starts else 0  # where the row the model read begins
        turn = self._as_turn(agent, e, ids, truncated, len(prompt) + before - start)
        e.last_message = agent.prefill + e.last_message  # what the rewards score: the whole assistant message
        # what the next request must repeat: the turn's message, with the text the request began it with
        returned = turn.message()
        if agent.prefill:
            returned["content"] = agent.prefill + (returned["content"] or "")
        # given to the request waiting for it, and written to its client whole (else never received: never trained)
        if not (agent.conversation.reply(turn, agent.served, returned)
                and agent.conversation.delivered(SOCKET_TIMEOUT_S + 10)):
            e.model[before:] = [False] * (len(e.tokens) - before)  # never received: never trained
            e.undelivered += 1
            agent.conversation.end()
            return None
        if e.truncated or time.monotonic() > agent.deadline:  # cut at the budget: the session can go no further
            agent.conversation.end()
            return None
        taken = agent.conversation.next(agent.gone)
        if isinstance(taken, str):
            return None
        kind, body, continuation = taken
        if e.turns >= self.settings.max_turns:  # it wants another turn: the session is cut there
            return self._cut(agent, AgentError(400, f"this session had its agent.max_turns={self.settings.max_turns} "
                                                    "turns", code="max_turns"))
        row = prompt + e.tokens[start:]  # what the model has read: its context
        try:
            how, tokens, why = self.requests.continued((agent.kind, agent.tools, agent.prompt), row, len(e.tokens),
                                                       kind, body, continuation)
            if how == NEW_ROW:
                check_not_reread(agent.prompt, e.rows(), tokens)
        except AgentError as error:
            agent.conversation.refuse(error)
            agent.conversation.end()
            e.breaks[error.code] = e.breaks.get(error.code, 0) + 1
            return None
        if len(tokens) >= self.max_new_tokens - len(e.tokens):  # its messages leave the model no room
            return self._cut(agent, AgentError(400, f"the conversation is past sampling.max_new_tokens="
                                                    f"{self.max_new_tokens} tokens after the first request",
                                               code="context_length_exceeded"))
        e.continued[how] = e.continued.get(how, 0) + 1
        self._serve(agent, body)
        if how == NEW_ROW:  # the sample goes on in a row of its own: the prompt, then the request's render after it
            e.new_row(tokens, why)
        else:
            e.add(tokens, model=False)
        e.replies += 1
        return (NewRow if how == NEW_ROW else ReplyTokens).of(tokens, agent.limits)

    def _cut(self, agent: AgentSession, error: AgentError) -> None:
        """The request refused with `error`, and the session cut at a limit: scored as cut at the budget."""
        agent.conversation.refuse(error)
        agent.conversation.end()
        self.episodes._cut(agent.episode)
        agent.episode.breaks[error.code] = agent.episode.breaks.get(error.code, 0) + 1

    @staticmethod
    def _serve(agent: AgentSession, body: dict) -> None:
        """The request is the one answered next: its history, the assistant text it began (a prefill), and its
        answer's limits."""
        agent.served = list(history_of(body))
        agent.prefill = text_of(body["messages"][-1].get("content")) if continues_final(body) else ""
        agent.limits = request_limits(body)

    def _as_turn(self, agent: AgentSession, e: Episode, ids: torch.Tensor, truncated: bool, context: int) -> Turn:
        stops = self._stopped_at(agent.limits, ids)  # the text then stops before that string
        if agent.kind == "completions":
            return Turn(before_stop(e.last_message, stops), "length" if truncated else "stop", context, len(ids))
        # calls are read with the special tokens kept (a model's call tags may be special tokens, as vLLM's parsers
        # read them); a message without calls is its text without them
        turn = assistant_turn(before_stop(e.said, stops), self.settings.tool_parser, self._call_id, truncated,
                              context, len(ids), self.settings.split_reasoning)
        if turn.tool_calls:
            return turn
        return assistant_turn(before_stop(e.last_message, stops), None, self._call_id, truncated, context, len(ids),
                              self.settings.split_reasoning)

    def _stopped_at(self, limits: TurnLimits, ids: torch.Tensor) -> tuple[str, ...]:
        """The request's stop strings when its answer ended at one (read as the engines read them), else none."""
        if not limits.stop:
            return ()
        with self.episodes._tokenizing:
            return limits.stop if StopStrings(self.tokenizer, list(limits.stop)).hit(ids.tolist()) else ()

    def _call_id(self) -> str:
        with self._ids_lock:
            self._ids += 1
            return f"call_{self.runs}_{self._ids}"

def harness_row(prompt, row: dict) -> dict:
    """What the harness is given of its dataset row: the row's columns, its `id` and `question`, and what the
    rewards get (`reference_answer`, `prompt_turns`: the chat turns the run's own prompt is rendered from)."""
    return {"id": prompt.problem.id, "question": prompt.problem.question, **row}


def rollout_runner(cfg: Config, tokenizer) -> AgentRunner | EpisodeRunner | None:
    """What runs each sample beyond one completion: your agent's sessions (agent.entrypoint), an environment's
    episodes (env.name), or nothing."""
    return agent_runner(cfg, tokenizer) if cfg.agent.harness else episode_runner(cfg, tokenizer)


def agent_runner(cfg: Config, tokenizer) -> AgentRunner:
    """With agent.entrypoint, agent.command or agent.verifiers: the endpoint on loopback, and the runner of its
    sessions."""
    runner = AgentRunner(cfg.agent, tokenizer, cfg.sampling.max_new_tokens, cfg.data.max_prompt_tokens,
                         cfg.model.name_or_path, scores_env_reward="env_reward" in cfg.rewards.names,
                         truncated_reward=cfg.env.truncated_reward, verifiers_args=cfg.data.task_args)
    for client in ("httpx", "httpx2"):  # the OpenAI client's line per request, in the sampler's log
        logging.getLogger(client).setLevel(logging.WARNING)
    log.info("agent sessions of %s on %s: at most %d model turns, %d tokens in all", cfg.agent.harness,
             runner.server.url, cfg.agent.max_turns, cfg.sampling.max_new_tokens)
    return runner

