"""Multi-turn episodes: the model's turns and an environment's replies in one completion.

The prompt stays the shared prefix of its G episodes; an environment's opening message (an
OpenEnv reset observation) is part of it (data.prompts.with_opening). An episode's completion is every token
after the prompt: model turns (sampled, with their behaviour log-probs) and the environment's
replies in between (rendered by the chat template in the environment's role; context only).
`model_masks` marks the model's tokens: the trainer's loss, KL, ratio and entropy see only
those (grpo/trainer/training_step.py), and the environment's tokens carry log-prob 0 as placeholders.

Each message is drawn within what is left of `sampling.max_new_tokens`, the budget of the whole
episode. On the HF engine the episodes run in one decode loop (grpo/sampler/rollout/continuous.py):
each goes on to its next message from the KV it has as soon as its environment replied, and the
group's prompt is prefilled once. On vLLM each episode is a task of vLLM's async engine
(grpo/sampler/rollout/vllm_engine.py): each message a request from its whole context, the prefix
cache serving the earlier turns' KV. With sampling.continuous_batching off they go turn by turn:
turn 1 is one `generate` of G samples per prompt, each later turn one sample per live episode from
its whole context (prompt + episode so far). An episode
ends when the environment says so, after `env.max_turns` model turns, or truncated at the budget.
What an episode records, and the step's metrics of them: grpo/sampler/episode_records.py.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from grpo.data.prompts import special_texts
from grpo.environments.lanes import Lanes
from grpo.environments.pool import ReplayMismatch, shown_digest
from grpo.rewards.strict import reward_rows
from grpo.sampler.episode_records import Episode, Episodes
from grpo.sampler.rollout.continuous import episode_loop
from grpo.sampler.rollout.decoding import StopStrings
from grpo.sampler.rollout.sequences import NO_LIMITS, NewRow, TurnLimits, limits_of, message_limit

if TYPE_CHECKING:
    from grpo.settings import Config

log = logging.getLogger(__name__)
MESSAGE, REPLY = "\ue000", "\ue001"  # private-use characters: markers no chat template holds
# what stands for an environment's message when the template is rendered: the marker between the
# characters a template could trim, quote or escape (Llama 3.1's writes tool results through tojson)
REPLY_PROBE = f' \n"\\{REPLY}\u00e9\n '


class TemplateRoleError(ValueError):
    """The chat template cannot render an environment's reply in its role."""


def reply_template(tokenizer, role: str, ended_with: str | None = None, count: int = 1,
                   names: list[str] | None = None) -> list[str]:
    """The template's text around `count` environment messages in `role` (the results of a
    message's tool calls come as several), between the model's message and the model's next turn:
    count + 1 pieces, before the first, between each two, after the last. The model's message ended
    with an EOS token whose text is `ended_with` (default: the tokenizer's eos_token): when the
    template's own turn end is that token, it is left out (the model's token already ended the
    turn); another one (Phi-3 ends turns with <|end|>, an EOS of its generation_config, while a
    model may also stop at <|endoftext|>) is kept, as the template writes it. No chat template:
    newlines. Tool messages carry their tool's name, as the few-shot examples' do (`names`, one per
    message); without names, a template that shows a tool message's name (Hermes 2 Pro, Functionary)
    is refused: its tokens around a result depend on the call it answers."""
    if not getattr(tokenizer, "chat_template", None):
        return ["\n"] * (count + 1)

    def render(tool_names: list[str]) -> str:
        named = [{"name": name} if role == "tool" else {} for name in tool_names]
        turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": MESSAGE},
                 *[{"role": role, "content": REPLY_PROBE, **n} for n in named]]
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that refuses the role
            raise TemplateRoleError(f"the chat template cannot render an environment message in role {role!r} ({e}); "
                                    "use a model whose template does, or have the environment reply in another "
                                    "role (env.args role, or its reply_roles)") from None

    text = render(list(names) if names else ["first_tool"] * count)
    if role == "tool" and not names and render(["second_tool"] * count) != text:
        raise TemplateRoleError("the chat template shows each tool message's tool name: the tokens around a tool "
                                "result would depend on the call it answers, and tool messages are rendered by "
                                "their role here; set model.chat_template to a template that shows a tool "
                                "message's content alone (chatml-tools)")
    tail = text[text.index(MESSAGE) + 1:]
    end = tokenizer.eos_token if ended_with is None else ended_with
    tail = tail[len(end):] if end and tail.startswith(end) else tail
    pieces = tail.split(REPLY_PROBE)
    if len(pieces) != count + 1:  # the trainer would see other tokens than the model was shown
        raise TemplateRoleError(f"the chat template does not show an environment message in role {role!r} as it is "
                                "(it trims, quotes or escapes it, or leaves it out): the tokens the model reads "
                                "could not be rendered once and kept; set model.chat_template to a template that "
                                "shows the message's text unchanged")
    return pieces


def reply_ids(tokenizer, pieces: list[str], texts: list[str], prefill: str = "", after: str = "",
              specials: tuple[str, ...] = ()) -> list[int]:
    """The environment's turn as tokens: the template's `pieces` around its messages `texts`, then the
    next turn's `prefill`, tokenized in one piece after the model's last token (whose text is `after`:
    its EOS), as the tokenizer reads the whole conversation. So the episode's ids are the
    tokenization of the template's rendering of the conversation past the model's own tokens: with
    Qwen2's or Llama 3's pre-tokenizer `]}` or `.` and the newline the template writes after a tool
    result are one token, which tokenizing the message and the template apart would split.

    The boundary is the model's EOS, a special token, which tokenization never merges across; where
    it is not one (the tokenizer merges it with what follows), the turn is tokenized from its own
    start. The model's own tokens stay as it drew them: where they are not the tokenizer's own
    reading of their text (it drew "a","b" where the tokenizer writes "ab"), the episode differs from
    a re-tokenized conversation there, in the tokens that were sampled and are trained on.
    A message that holds a special token's text (`specials`: a tool echoing <|im_end|>) is read as
    plain text, never as the template's control tokens: then the pieces and each message are
    tokenized apart."""
    if any(special in text for text in texts for special in specials):
        ids = tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
        for text, piece in zip(texts, pieces[1:], strict=True):
            ids += tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids + (tokenizer(prefill, add_special_tokens=False)["input_ids"] if prefill else [])
    turn = pieces[0] + "".join(text + piece for text, piece in zip(texts, pieces[1:], strict=True)) + prefill
    before = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    ids = tokenizer(after + turn, add_special_tokens=False)["input_ids"]
    if ids[:len(before)] == before:
        return ids[len(before):]
    return tokenizer(turn, add_special_tokens=False)["input_ids"]


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of turn `turn` (0: the step's seed itself), hashed so no two turns share a stream."""
    if seed is None or turn == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/turn{turn}".encode()).digest()[:8], "big") >> 2


class EpisodeRunner:
    """Runs episodes of the environments in `pool` (grpo/environments/pool.py; several at once:
    grpo/environments/lanes.py) with any engine. In the HF engine's continuous loop the environment
    calls run on threads, one per lane, off the decode loop: the tokenizer is used by one thread at a time."""

    def __init__(self, pool, tokenizer, max_new_tokens: int, max_turns: int, prefill: str = "",
                 roles: tuple[str, ...] = ("user",), max_prompt_tokens: int | None = None,
                 continued: bool = True, truncated_reward: float | None = None, scores_env_reward: bool = True):
        self.pool, self.tokenizer, self.prefill = pool, tokenizer, prefill
        self._tokenizing = threading.Lock()  # a fast tokenizer shared by threads can raise "Already borrowed"
        self._in_turn = False  # this run's environment calls come one at a time (turn by turn)
        self.continued = continued  # False: turn by turn on every engine (the HF engine's reference, benchmarks)
        self.max_new_tokens, self.max_turns, self.max_prompt_tokens = max_new_tokens, max_turns, max_prompt_tokens
        # the roles the environment replies in, rendered now: a template that refuses one stops the start
        self._templates = {(role, None, 1): reply_template(tokenizer, role) for role in roles}
        self._specials = special_texts(tokenizer)
        # the tokens that end a turn as the model's EOS does (a message's last token otherwise, one that completed a
        # stop string, is part of what it said)
        self._end_ids = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special} | {
            tokenizer.eos_token_id}
        self.runs = 0
        # an episode cut at the token budget: the batch's worst, or its env_reward this value
        self.truncated_reward = truncated_reward
        self.scores_env_reward = scores_env_reward  # env_reward is among rewards.names (else: said once, at a reward)
        self._told_unscored = False
        self._mismatch = ""  # the last replay that differed, for the run's warning

    @property
    def pool(self) -> Lanes:
        return self._lanes

    @pool.setter
    def pool(self, pool) -> None:
        self._lanes = pool if pool is None or isinstance(pool, Lanes) else Lanes.of(pool)

    def close(self) -> None:
        """The environments gone (their child, their server's sessions)."""
        if self.pool is not None:
            self.pool.close()

    def reply_tokens(self, text: str | list[str], role: str, ended_with: int | None = None,
                     prefill: str | None = None) -> list[int]:
        """An environment's message (or several, in one role) as tokens: the template around them,
        then the next turn's prefill (`prefill`, default data.prefill), tokenized as the whole conversation
        is (`reply_ids`); after the model's turn that ended with token `ended_with` (None: the eos_token).
        Their text cannot smuggle in special tokens: read as plain text."""
        with self._tokenizing:
            return self._reply_tokens(text, role, ended_with, self.prefill if prefill is None else prefill)

    def _reply_tokens(self, text: str | list[str], role: str, ended_with: int | None, prefill: str) -> list[int]:
        texts = [text] if isinstance(text, str) else list(text)
        key = (role, ended_with, len(texts))
        end = self.tokenizer.eos_token if ended_with is None else self.tokenizer.decode([ended_with])
        if key not in self._templates:
            # the template's own turn end is left out after a special token (the model's EOS ended the turn); after
            # another (a turn cut at its request's max_tokens) it stays whole, even where it begins with its text ("<")
            ended = ended_with is None or end in self._specials
            self._templates[key] = reply_template(self.tokenizer, role, None if ended_with is None else
                                                  end if ended else "", len(texts))
        return reply_ids(self.tokenizer, self._templates[key], texts, prefill, end or "", self._specials)

    def run(self, engine, prompts: list, group_size: int, *, seed: int | None = None, greedy: bool = False) -> Episodes:
        self.runs += 1
        rows = reward_rows(prompts)
        owner = [i for i in range(len(prompts)) for _ in range(group_size)]
        episodes = [Episode() for _ in owner]
        loop = episode_loop(engine) if self.continued else None
        self._in_turn = loop is None  # turn by turn the calls come one at a time: one lane serves them
        prompts = self._opened(prompts, rows, group_size, episodes)
        over = []

        def on_turn(j: int, ids: torch.Tensor, logps: torch.Tensor, truncated: bool) -> list[int] | None:
            """Episode j's message: recorded, answered; the reply's tokens, or None when the episode is over."""
            e = episodes[j]
            self._add_model_turn(e, ids, logps, truncated)
            before = len(e.tokens)
            if self._answer(j, e, rows[owner[j]]):
                return e.tokens[before:]
            over.append(f"{self.runs}/{j}")
            return None

        prompt_ids = [p.token_ids for p in prompts]
        try:
            if loop is not None:
                stamp_versions(episodes, loop(prompt_ids, group_size, on_turn, self.max_new_tokens, seed=seed,
                                              greedy=greedy, executor=self.pool.executor))
            else:
                self._turn_by_turn(engine, prompt_ids, group_size, on_turn, seed, greedy)
        finally:  # all at once: a served environment hangs up its sessions together
            self.pool.forget(over)
        mismatched = sum(e.replay_mismatch for e in episodes)
        if mismatched:
            log.warning("%d of %d episodes ended, failed: %s", mismatched, len(episodes), self._mismatch)
        return Episodes.of(prompts, episodes, [rows[i] for i in owner])

    def _opened(self, prompts: list, rows: list[dict], group_size: int, episodes: list[Episode]) -> list:
        """Every episode's environment started; the prompts with their environment's opening message.
        The G episodes of a prompt start from one seed, so they open alike; where they do not (a
        reset that ignores its seed), the first one's opening is shown. An opening that would make
        the prompt longer than data.max_prompt_tokens is cut to fit."""
        from grpo.data.prompts import with_opening

        shown = []
        opened = [self._opening(episodes[j], f"{self.runs}/{j}", rows[j // group_size]) for j in range(len(episodes))]
        for i, prompt in enumerate(prompts):
            openings, failures = [], []
            for j in range(i * group_size, (i + 1) * group_size):
                opening, failure = opened[j].result() if isinstance(opened[j], Future) else opened[j]
                episodes[j].open_failed = failure is not None  # counted once: its first step opens it again
                episodes[j].count_failure(failure)
                episodes[j].shown = [None if failure else shown_digest(opening)]  # its own, checked on a rebuild
                openings += [opening] if failure is None else []
                failures += [failure] if failure is not None else []
            if not openings:
                log.warning("prompt %s: no episode's environment could open (%s); shown without an opening",
                            prompt.problem.id, failures[0])
            if len(set(openings)) > 1:
                log.warning("the %d episodes of prompt %s opened with different messages (does the environment's "
                            "reset follow its seed?): all are shown the first", group_size, prompt.problem.id)
            if openings and openings[0] is not None:
                prompt, cut = with_opening(self.tokenizer, prompt, openings[0], self.prefill, self.max_prompt_tokens)
                if cut:
                    log.warning("prompt %s: its environment's opening message is cut to keep the prompt within "
                                "data.max_prompt_tokens=%d", prompt.problem.id, self.max_prompt_tokens)
            shown.append(prompt)
        return shown

    def _opening(self, e: Episode, key: str, row: dict):
        """The episode's environment started: (opening, failure), or a Future of them where the calls run
        at once (the lanes' threads)."""
        if self._in_turn:
            return self._counted(e, "open", key, row)
        return self.pool.executor.submit(self._counted, e, "open", key, row)

    def _turn_by_turn(self, engine, prompt_ids: list[list[int]], group_size: int, on_turn, seed: int | None,
                      greedy: bool, executor=None, first_limits: list[TurnLimits] | None = None) -> None:
        """Turn 1 for every episode, then each later turn for the live ones, each from its whole context;
        every turn within what is left of the episode's budget (`max_new_tokens`), as in the loop, and within
        its own limits where set (`first_limits`, then each `ReplyTokens`'). A round's `on_turn` calls go one at a
        time, or all at once on `executor`'s threads (agents' sessions, each waiting on its own harness)."""
        out = engine.generate(prompt_ids, group_size, seed=seed, greedy=greedy,
                              max_new_tokens=[self.max_new_tokens] * len(prompt_ids))
        live, turn = list(range(len(prompt_ids) * group_size)), 0
        contexts = {j: list(prompt_ids[j // group_size]) for j in live}
        used = dict.fromkeys(live, 0)  # tokens of each episode's budget used: its messages and replies
        limits = dict(enumerate(first_limits or []))  # each episode's next message's own limits
        kept = {}  # each message's tokens as its limits keep them
        while live:
            def answered(k: int, out=out, live=live) -> list[int] | None:
                ids, logps, cut = out.completion_ids[k], out.logps[k], bool(out.truncated[k])
                n, cut = self._own_end(ids.tolist(), limits.get(live[k], NO_LIMITS), cut)
                kept[k] = ids[:n]
                return on_turn(live[k], ids[:n], logps[:n], cut)

            ks = range(len(live))
            replies = list(executor.map(answered, ks) if executor is not None else map(answered, ks))
            going_on = []
            for k, (j, reply) in enumerate(zip(live, replies)):
                if reply is not None:
                    restart = isinstance(reply, NewRow)  # its context starts again after the prompt
                    contexts[j] = (list(prompt_ids[j // group_size]) if restart
                                   else contexts[j] + kept[k].tolist()) + reply
                    used[j] += len(kept[k]) + len(reply)
                    limits[j] = limits_of(reply)
                    going_on.append(j)
            live = going_on
            if not live:
                break
            turn += 1
            budgets = [message_limit(self.max_new_tokens - used[j], limits[j]) for j in live]
            out = engine.generate([contexts[j] for j in live], 1, seed=turn_seed(seed, turn), greedy=greedy,
                                  max_new_tokens=budgets)

    def _own_end(self, ids: list[int], limits: TurnLimits, cut: bool) -> tuple[int, bool]:
        """(how many of a message's tokens its own limits keep, whether it is then cut at a limit). The first turn's
        group decodes as one, past any row's own limits: they are applied here, and keep the same tokens a decode
        stopping there draws (each row's draws are its own)."""
        with self._tokenizing:
            stopped = StopStrings(self.tokenizer, list(limits.stop)).end(ids) if limits.stop else None
        if stopped is not None and (limits.max_tokens is None or stopped <= limits.max_tokens):
            return stopped, False
        if limits.max_tokens is not None and len(ids) > limits.max_tokens:
            return limits.max_tokens, True
        return len(ids), cut

    def _add_model_turn(self, e: Episode, ids: torch.Tensor, logps: torch.Tensor, truncated: bool) -> None:
        e.add(ids, model=True, logps=logps)
        e.turns += 1
        e.truncated = truncated
        # the environment reads every token but the turn's EOS: a model's tool-call tags may be
        # special tokens, which the rewards' text leaves out (vLLM's tool parsers keep them too)
        said = ids[:-1] if not e.truncated and len(ids) and int(ids[-1]) in self._end_ids else ids
        with self._tokenizing:
            e.last_message = self.prefill + self.tokenizer.decode(ids, skip_special_tokens=True)
            e.said = self.prefill + self.tokenizer.decode(said, skip_special_tokens=False)

    def _answer(self, j: int, e: Episode, row: dict) -> bool:
        """The environment's reply to episode j's last message, added to it; whether it goes on."""
        if e.truncated:  # cut at the token budget: the message is unfinished
            self._cut(e)
            return False
        try:
            reply, failure = self._counted(e, "step", f"{self.runs}/{j}", row, e.messages, e.said, e.shown)
        except ReplayMismatch as error:  # it cannot go on in the world it was shown: ended, failed
            e.replay_mismatch, self._mismatch = True, str(error)
            e.count_failure(str(error))
            return False
        if failure is None:  # a message whose step failed is not replayed when the episode is rebuilt
            e.messages.append(e.said)
            e.shown.append(shown_digest(reply))
            e.replies += 1
        elif not (e.open_failed and e.turns == 1):  # that failure is counted already
            e.count_failure(failure)
        e.tool_calls, e.tool_errors = e.tool_calls + reply.tool_calls, e.tool_errors + reply.tool_errors
        e.malformed_calls += reply.malformed_calls
        e.call_messages += reply.tool_calls > 0
        e.well_formed_messages += reply.tool_calls > 0 and reply.malformed_calls == 0
        if reply.reward is not None:
            e.reward = (e.reward or 0.0) + reply.reward
            self._tell_unscored()
        if reply.done or e.turns >= self.max_turns:
            return False
        try:
            ids = self.reply_tokens(reply.text, reply.role, ended_with=e.tokens[-1])  # not truncated: an EOS
        except TemplateRoleError as error:  # a role it did not declare, which the template refuses: this episode ends
            log.warning("episode %s: %s; the episode ends here (declare the role in the environment's "
                        "reply_roles to have it checked at start)", j, error)
            e.env_errors += 1
            return False
        room = self.max_new_tokens - len(e.tokens)
        if len(ids) >= room:  # no room left for the model to answer: the episode ends at the budget
            e.add(ids[:room], model=False)
            self._cut(e)
            return False
        e.add(ids, model=False)
        return True

    def _counted(self, e: Episode, method: str, key: str, *args):
        """`pool.method(key, *args)` on the episode's lane, with what rebuilding environments cost during it
        counted in `e`."""
        def count(cost: tuple[int, int, int]) -> None:
            e.child_restarts, e.rebuilds, e.replayed_steps = (e.child_restarts + cost[0], e.rebuilds + cost[1],
                                                              e.replayed_steps + cost[2])
        return self.pool.call(key, method, *args, counted=count, in_turn=self._in_turn)

    def _cut(self, e: Episode) -> None:
        """Episode e ends at the token budget, unfinished: truncated, so it scores the batch's worst
        (grpo/sampler/batches.py), or, with env.truncated_reward, its env_reward is that value whatever
        its replies gave: running out of tokens scores what the run says, never a free 0."""
        e.truncated = True
        if self.truncated_reward is not None:
            e.reward = self.truncated_reward

    def _tell_unscored(self) -> None:
        """Said once, at the first reward an environment gives while env_reward is not trained on."""
        if not self.scores_env_reward and not self._told_unscored:
            self._told_unscored = True
            log.warning("the environment gives rewards, and rewards.names does not hold env_reward: they are not "
                        "trained on; add env_reward to rewards.names (and its weight to rewards.weights)")


def episode_runner(cfg: Config, tokenizer) -> EpisodeRunner | None:
    """With env.name: the environments (in their child process, or an OpenEnv server's sessions), and the
    runner of episodes (agent.entrypoint's sessions: grpo/agent/runner.py's, which builds on this one)."""
    if not cfg.env.name:
        return None
    from grpo.environments import environment_args, reply_roles
    from grpo.environments.pool import EnvironmentPool
    from grpo.environments.remote import RemotePool, is_served

    # the runner renders the roles first: a refused one is a start-up error before the child is forked
    runner = EpisodeRunner(None, tokenizer, cfg.sampling.max_new_tokens, cfg.env.max_turns, cfg.data.prefill,
                           reply_roles(cfg.env.name, cfg.env.args), cfg.data.max_prompt_tokens,
                           truncated_reward=cfg.env.truncated_reward,
                           scores_env_reward="env_reward" in cfg.rewards.names)
    # an OpenEnv server's sessions, in this process (the network is the point), else the child
    args = environment_args(cfg.env)
    def make(first: bool):
        if is_served(cfg.env.name):
            return RemotePool(cfg.env.name, args, cfg.env.timeout_s, announce=first)
        return EnvironmentPool(cfg.env.name, args, cfg.env.timeout_s, cfg.env, announce=first)

    runner.pool = Lanes(make, environment_lanes(cfg))
    log.info("episodes with environment %s: at most %d model turns, %d tokens in all, up to %d environment calls "
             "at once", cfg.env.name, cfg.env.max_turns, cfg.sampling.max_new_tokens, runner.pool.count)
    return runner


def environment_lanes(cfg: Config) -> int:
    """Environment calls in flight at once: env.concurrency, or one per row of the decode batch. One where the
    calls are made in turn anyway (sampling.continuous_batching off: blocks, or turn by turn)."""
    if not cfg.sampling.continuous_batching:
        return 1
    return cfg.env.concurrency or cfg.sampling.generation_batch_size


def stamp_versions(episodes: list[Episode], versions: dict[int, list[int]] | None) -> None:
    """Each episode's draws given the versions the decode loop recorded for them (episode j: sequence j), where it
    recorded them (the HF engine's loop: in-flight loads can change the version mid-episode)."""
    if versions is not None:
        for j, e in enumerate(episodes):
            e.stamp(versions.get(j, []))
