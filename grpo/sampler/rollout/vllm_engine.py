"""vLLM rollouts (optional: `make install-vllm` builds .venv-vllm; the CPU build without a GPU).

vLLM's async engine (`AsyncLLM`, on its own event loop: grpo/sampler/rollout/vllm_async.py) runs one
task per sequence, and its continuous batching refills a finished sequence's slot at once. An
episode is one task for all its messages: when a message ends, its environment answers on a thread
of the environment lanes while the other episodes go on decoding, and its next message is a new
request with the whole context as tokens (the model's own tokens, never re-tokenized), its earlier
KV served by the prefix cache. Each sequence is seeded on its own: the G samples of prompt i draw
with `prompt_seeds(seed)[i] + g`, as vLLM seeds the samples of one n=G request, and an episode's
later messages with `episode_seed`, so a sequence's tokens do not depend on what shares its batch.
With `then`, the next step's completions start as this step's end, one for each that ends, with the
weights served now; new weights, or another sampled call, abort them.

In-flight updates (`sampling.in_flight_updates`, LoRA): while a sampled call decodes, a poller looks for
a newly published version every IN_FLIGHT_POLL_S and loads its adapter; each live request is then
aborted and made again from its tokens so far with the new adapter (as AReaL resumes), so its prefix is
prefilled under the new weights and every recorded log-prob is its token's under the version that drew
it (the KV is recomputed: vLLM's prefix cache is keyed by adapter). The rest of a resumed sequence draws
with a seed of its own (`resumed_seed`): the first seed again would reuse the draws of its first tokens.
The completions started for the next step follow a newer adapter too, rather than being made again
(a step back, a trainer resumed from an older checkpoint, still aborts them). The poller and the
resumed seed: grpo/sampler/rollout/vllm_tasks.py.

Prefix caching serves the G samples of a prompt from one prefill. Log-probs
are vLLM's "processed" ones: those of the distribution the token was drawn from, after
temperature, as the trainer computes them. The checkpoint's generation_config is ignored
(`generation_config="vllm"`): its repetition penalty or top-k would change the distribution
the tokens come from, as with the HF engine (grpo/sampler/rollout/hf_engine.py).

Weights are swapped without restarting the engine. LoRA: each load adds its own adapter, loaded
at once so that a bad adapter fails here and the previous one keeps serving, then the previous
one is removed. Its name and integer id count the engine's loads, not the version: the prefix
cache is keyed by them, and a trainer that resumes from an older checkpoint republishes a
version number with other weights, whose prompt KV must not be served from the cache. Full
fine-tuning: the version's safetensors are reloaded in place by the engine's workers (with the
tied output head's CPU kernel made again: grpo/sampler/rollout/vllm_worker.py), and the prefix cache is reset.

On the CPU, vLLM reserves `gpu_memory_utilization` of the *host's* memory at start; the engine
asks instead for a KV cache of `sampling.vllm.kv_cache_gb`, and says plainly when that does not
fit in the memory available (`engine_arguments`: grpo/sampler/rollout/vllm_arguments.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from grpo.model.completions import eos_token_ids
from grpo.sampler.rollout import SEED_BLOCK, Rollouts, prompt_seeds
from grpo.sampler.rollout.sequences import (
    Call,
    NewRow,
    NextCall,
    OnTurn,
    TurnLimits,
    check_room,
    episode_seed,
    limits_of,
    message_limit,
)
from grpo.sampler.rollout.vllm_arguments import INSTALL_HINT, VllmUnavailable, cpu_threads_environment, engine_arguments
from grpo.sampler.rollout.vllm_async import EngineLoop, EnvironmentCalls, StepCounts
from grpo.sampler.rollout.vllm_tasks import InFlightPoller, all_of, cancelled, resumed_seed
from grpo.weights.folder import INITIAL_DIGEST, Staged

if TYPE_CHECKING:
    from grpo.settings import Config

ENGINE_CALL_TIMEOUT_S = 600.0  # a weight reload or adapter load on a large model: minutes at most


@dataclass(frozen=True)
class Sample:
    """One sequence's request: its tokens so far, its seed (None: greedy, or vLLM's own draw) and its limit."""

    prompt: list[int]
    seed: int | None
    limit: int
    stop: tuple[str, ...] = ()  # its own stop strings, beside sampling.stop


@dataclass
class CarriedRequests:
    """A call's completions started while the call before it ended (`generate`'s `then`)."""

    key: tuple  # the call it is: prompts, G, seed, limits
    greedy: bool
    started: list = field(default_factory=list)  # asyncio tasks, in the call's order
    rest: deque = field(default_factory=deque)  # its Samples not started yet


class VllmEngine:
    """The `RolloutEngine` on vLLM, with its own copy of the weights."""

    generates_with_scoring_model = False

    @classmethod
    def build(cls, cfg: Config, model, tokenizer) -> VllmEngine:
        return cls(cfg, eos_token_ids(tokenizer, model))

    def __init__(self, cfg: Config, eos_ids: list[int]):
        try:
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError:
            raise VllmUnavailable(f"sampling.engine=vllm needs vLLM: {INSTALL_HINT}") from None
        import psutil

        self._vllm, self.cfg, self.eos_ids = vllm, cfg, list(eos_ids)
        self.continuous = cfg.sampling.continuous_batching  # off: episodes turn by turn (for comparison)
        if not torch.cuda.is_available():
            os.environ.update(cpu_threads_environment(sorted(os.sched_getaffinity(0)), torch.get_num_threads(),
                                                      os.environ))
        args = engine_arguments(cfg, torch.cuda.is_available(), psutil.virtual_memory().available)
        self.loop = EngineLoop()

        async def start():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        try:
            self.llm = self.loop.run(start())
        except BaseException:
            self.loop.close()
            raise
        self.lora_request = None  # None: the base model (version 0, or a full fine-tune)
        self.adapter_loads = 0  # names and numbers each adapter load (see the module's docstring)
        self.version, self.weights_digest = 0, INITIAL_DIGEST
        self.carried: CarriedRequests | None = None
        self.loop_metrics = StepCounts()  # started ahead, environment waits: the step's metrics
        self._request_ids = itertools.count()
        # sampling.in_flight_updates: loads a newly published version (the sampler's watcher), True when it did;
        # polled while a sampled call decodes
        self.poll_weights: Callable[[], bool] | None = None
        self.digests = {0: INITIAL_DIGEST}  # each version served: the oldest token's is the batch's
        self._users: dict[int | None, int] = {}  # live requests per adapter id (None: the base model)
        self._moved = asyncio.Event()  # set (and replaced) when the served adapter changes
        self._resumed = 0  # requests made again on a new adapter, in the call under way

    # ------------------------------------------------------------------ weights

    def stage_weights(self, folder: Path, manifest: dict, version: int) -> Staged:
        """LoRA: the adapter is loaded now (a bad one fails here) and served from the commit on.
        Full weights are reloaded in place at the commit: nothing can hold them beside the served ones.
        The commit aborts the completions started for the next step with the weights before (with in-flight
        updates, a newer adapter's moves them on to it instead)."""
        if manifest["kind"] == "lora":
            return self._stage_adapter(folder, manifest, version)

        def reload():
            self.drop_carried()
            self._ask("to reload the weights", self.llm.collective_rpc(
                "reload_policy", kwargs={"weights_path": str(folder)}))  # grpo/sampler/rollout/vllm_worker.py
            if not self._ask("to reset its prefix cache", self.llm.reset_prefix_cache()):  # KV of the old weights
                raise RuntimeError("vLLM could not reset its prefix cache after loading new weights (requests still "
                                   "hold its blocks): the prompts' cached KV would be served with the old weights")
            self.version, self.weights_digest = version, manifest["digest"]
            self.digests[version] = manifest["digest"]
        return Staged(reload)

    def load_weights(self, folder: Path, manifest: dict, version: int) -> None:
        self.stage_weights(folder, manifest, version).commit()

    def _stage_adapter(self, folder: Path, manifest: dict, version: int) -> Staged:
        from vllm.lora.request import LoRARequest

        if not self.cfg.lora.enabled:
            raise RuntimeError(f"{folder} is a LoRA adapter but lora.enabled is false")
        self.adapter_loads += 1
        request = LoRARequest(f"policy-v{version}-load{self.adapter_loads}", self.adapter_loads, str(folder))
        if not self._ask("to load an adapter", self.llm.add_lora(request)):  # a bad one fails here, the old one serves
            raise RuntimeError(f"vLLM could not load the adapter in {folder}")

        def serve():
            if self.poll_weights is None or version <= self.version:  # a step back: their versions are gone
                self.drop_carried()  # started with the adapter before: made again with this one
            self._ask("to serve the new adapter", self._serve(request, version, manifest["digest"]))
        return Staged(serve, discard=lambda: self._ask("to remove an adapter",
                                                       self.llm.remove_lora(request.lora_int_id)))

    async def _serve(self, request, version: int, digest: str) -> None:
        """`request`'s adapter served from now on (on the loop, where the requests read it); the requests that
        follow the served adapter told to move on to it (in-flight updates); the adapter before removed once
        no request uses it."""
        previous, self.lora_request = self.lora_request, request
        self.version, self.weights_digest = version, digest
        self.digests[version] = digest
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()
        if previous is None:
            return
        while self._users.get(previous.lora_int_id, 0):
            await asyncio.sleep(0.005)
        await self.llm.remove_lora(previous.lora_int_id)

    def adapters(self) -> set[int]:
        """The ids of the adapters vLLM holds now."""
        return self._ask("for its adapters", self.llm.list_loras())

    def _ask(self, what: str, coroutine):
        """A call to vLLM's engine process, within ENGINE_CALL_TIMEOUT_S: a dead engine process never answers."""
        async def bounded():
            try:
                return await asyncio.wait_for(coroutine, ENGINE_CALL_TIMEOUT_S)
            except TimeoutError:
                raise RuntimeError(f"vLLM's engine did not answer within {ENGINE_CALL_TIMEOUT_S:.0f} s "
                                   f"when asked {what} "
                                   "(its process may have died: see the sampler's log above)") from None
        return self.loop.run(bounded())

    def close(self) -> None:
        self.drop_carried()

        async def shutdown():  # on the loop: vLLM cancels its output handler there
            self.llm.shutdown()
        self.loop.run(shutdown())
        self.loop.close()
        del self.llm

    # ------------------------------------------------------------------ single completions

    def generate(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                 greedy: bool = False, max_new_tokens: Sequence[int] | None = None,
                 then: NextCall | None = None) -> Rollouts:
        """G completions of each prompt, each its own request (the samples of prompt i seeded
        `prompt_seeds(seed)[i] + g`). `then`: the next call, started with the weights served now, one
        completion for each of this call's that ends; it finds them started (or done). A greedy call (an
        evaluation) leaves them; another sampled call, or new weights, abort them."""
        if group_size > SEED_BLOCK:
            raise ValueError(f"group_size {group_size} is above {SEED_BLOCK}, the seeds one prompt's samples may take")
        key, samples = self._samples(NextCall(prompts, group_size, seed, max_new_tokens))
        carried = None
        if self.carried is not None and self.carried.key == key and self.carried.greedy == greedy:
            carried, self.carried = self.carried, None
        elif not greedy:
            self.drop_carried()
        nxt = None
        if then is not None:
            self.drop_carried()  # a newer one replaces it
            then_key, then_samples = self._samples(then)
            nxt = CarriedRequests(then_key, greedy, rest=deque(then_samples))
        try:
            outputs = self.loop.run(self._generate(samples, greedy, carried, nxt))
        except BaseException:  # interrupted before it ran: what it was given to finish is aborted
            for requests in (carried, nxt):
                if requests is not None:
                    requests.rest.clear()
                    self.loop.run(cancelled(requests.started))
            raise
        if nxt is not None:
            self.carried = nxt
        return Rollouts([o[0] for o in outputs], [o[2] for o in outputs], [o[1] for o in outputs],
                        token_versions=[o[3] for o in outputs])

    def _samples(self, call: NextCall) -> tuple[tuple, list[Sample]]:
        limits = list(call.max_new_tokens) if call.max_new_tokens is not None else \
            [self.cfg.sampling.max_new_tokens] * len(call.prompts)
        seeds = [None] * len(call.prompts) if call.seed is None else prompt_seeds(call.seed, len(call.prompts))
        samples = [Sample(list(prompt), None if first is None else first + g, limit)
                   for prompt, first, limit in zip(call.prompts, seeds, limits) for g in range(call.group_size)]
        return (tuple(map(tuple, call.prompts)), call.group_size, call.seed, tuple(limits)), samples

    async def _generate(self, samples: list[Sample], greedy: bool, carried: CarriedRequests | None,
                        nxt: CarriedRequests | None) -> list[tuple]:
        poller = None if greedy or self.poll_weights is None else InFlightPoller(self.poll_weights)
        self._resumed = 0
        if carried is not None:
            self.loop_metrics.add({"sampler/started_ahead_fraction": len(carried.started) / max(len(samples), 1)})
            tasks = carried.started + [self._start(s, greedy) for s in carried.rest]
        else:
            tasks = [self._start(s, greedy) for s in samples]
        if nxt is not None:
            def refill(_):  # a slot this call's completion leaves: the next call's next one
                if nxt.rest:
                    nxt.started.append(self._start(nxt.rest.popleft(), greedy))
            for task in tasks:
                task.add_done_callback(refill)
        gathered = asyncio.gather(*tasks)
        if poller is not None:
            poller.start(on_error=gathered.cancel)  # a failed load ends the call at once, with its error
        try:
            return await gathered
        except BaseException:
            if nxt is not None:
                nxt.rest.clear()
            await cancelled(tasks + (nxt.started if nxt is not None else []))
            raise
        finally:
            if poller is not None:
                self.loop_metrics.add({"sampler/in_flight_loads": float(await poller.stop()),
                                       "sampler/in_flight_resumed": float(self._resumed)})

    def _start(self, sample: Sample, greedy: bool) -> asyncio.Task:
        follow = not greedy and self.poll_weights is not None
        return asyncio.ensure_future(self._complete(sample, greedy, self.served, follow=follow))

    @property
    def served(self) -> tuple:
        """(the adapter served, its version), read together: a request's tokens carry the version of its adapter."""
        return self.lora_request, self.version

    async def _complete(self, sample: Sample, greedy: bool, served: tuple, calls: EnvironmentCalls | None = None,
                        follow: bool = False) -> tuple:
        """One request to its end, with `served` = (adapter, version): (token ids, their log-probs, truncated,
        the version of each token). `follow`: when the served adapter changes, the request is made again from
        its tokens so far with the new one (in-flight updates)."""
        ids: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        lora, version = served
        if calls is not None:
            calls.request(1)
        try:
            while True:
                if follow:
                    lora, version = self.served
                seed = sample.seed if not ids or sample.seed is None else resumed_seed(sample.seed, len(ids))
                before = len(ids)
                reason = await self._request(sample.prompt + ids, sample.limit - len(ids), seed, greedy, lora,
                                             self._moved if follow else None, ids, logps, sample.stop)
                versions += [version] * (len(ids) - before)
                if reason is not None:
                    break
                self._resumed += 1
        finally:
            if calls is not None:
                calls.request(-1)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(logps, dtype=torch.float32), reason == "length", \
            torch.tensor(versions, dtype=torch.int32)

    async def _request(self, prompt: list[int], limit: int, seed: int | None, greedy: bool, lora,
                       moved: asyncio.Event | None, ids: list[int], logps: list[float],
                       stop: tuple[str, ...] = ()) -> str | None:
        """One vLLM request, its tokens and log-probs appended to `ids` and `logps` as they come: its
        finish reason, or None when `moved` was set first (the request aborted)."""
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        if limit <= 0:  # its tokens so far reached the limit as the adapter changed
            return "length"
        s = self.cfg.sampling
        params = self._vllm.SamplingParams(  # tokens only: no text is made (detokenize) but for stop strings
            n=1, temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
            min_p=0.0 if greedy else s.min_p, repetition_penalty=1.0 if greedy else s.repetition_penalty,
            stop=[*s.stop, *stop] or None, include_stop_str_in_output=True, detokenize=bool(s.stop or stop),
            skip_special_tokens=False,  # stop strings read in the text special tokens included, as the HF engine's
            max_tokens=limit, logprobs=0, seed=seed, stop_token_ids=self.eos_ids,
            output_kind=RequestOutputKind.FINAL_ONLY if moved is None else RequestOutputKind.DELTA)

        async def run() -> str:
            reason = None
            async for out in self.llm.generate(tokens_input(prompt), params, str(next(self._request_ids)),
                                               lora_request=lora):
                new = out.outputs[0]
                ids.extend(new.token_ids)  # both in one go: a move between two outputs finds them alike
                logps.extend(step[t].logprob for step, t in zip(new.logprobs, new.token_ids))
                reason = new.finish_reason
            if reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a request with finish_reason={reason!r}")
            return reason

        key = lora.lora_int_id if lora is not None else None
        self._users[key] = self._users.get(key, 0) + 1
        try:
            if moved is None:
                return await run()
            request, waiter = asyncio.ensure_future(run()), asyncio.ensure_future(moved.wait())
            try:
                await asyncio.wait([request, waiter], return_when=asyncio.FIRST_COMPLETED)
                if request.done():
                    return request.result()
                await cancelled([request])  # vLLM aborts it
                return None
            finally:
                await cancelled([request, waiter])
        finally:
            self._users[key] -= 1

    def complete(self, prompt: list[int], seed: int | None, limit: int, greedy: bool = False) -> tuple:
        """One request on its own: (token ids, their log-probs, truncated)."""
        return self.loop.run(self._complete(Sample(list(prompt), seed, limit), greedy, self.served))[:3]

    def drop_carried(self) -> None:
        """The completions started for the next call, aborted."""
        carried, self.carried = self.carried, None
        if carried is not None:
            carried.rest.clear()
            self.loop.run(cancelled(carried.started))

    # ------------------------------------------------------------------ episodes

    def run_episodes(self, prompts: list[list[int]], group_size: int, on_turn: OnTurn, budget: int | list[int], *,
                     seed: int | None = None, greedy: bool = False, executor=None,
                     first_limits: list[TurnLimits] | None = None) -> None:
        """B x G episodes, episode j of prompt j // G, each one task: a message, `on_turn` on `executor`'s
        threads (one thread of its own without), the next message from the whole context, until `on_turn`
        says the episode is over; within `budget` tokens after its prompt (one budget, or one per prompt);
        each message within its own limits where set (`first_limits`, then each `ReplyTokens`')."""
        call = Call.of(prompts, group_size, budget, seed, greedy, on_turn, first_limits)  # budgets checked, seed drawn
        budgets, seed = call.budgets, call.seed
        firsts = [None] * len(prompts) if greedy else prompt_seeds(seed, len(prompts))
        calls, own = EnvironmentCalls(), None
        if executor is None:
            executor = own = ThreadPoolExecutor(1, thread_name_prefix="environment")
        # episode j's first message is seeded as `generate` seeds sample j % G of its prompt
        episodes = [functools.partial(self._episode, j, prompts[j // group_size], budgets[j // group_size],
                                      None if greedy else firsts[j // group_size] + j % group_size, seed, greedy,
                                      on_turn, executor, calls, call.first(j))
                    for j in range(len(prompts) * group_size)]
        try:
            self.loop.run(all_of(episodes))
        finally:
            if own is not None:
                own.shutdown()
        self.loop_metrics.add(calls.metrics())

    async def _episode(self, j: int, prompt: list[int], budget: int, first: int | None, seed: int | None,
                       greedy: bool, on_turn: OnTurn, executor, calls: EnvironmentCalls, limits: TurnLimits) -> None:
        context, used, turn, served = list(prompt), 0, 0, self.served
        while True:
            turn_seed = first if turn == 0 or greedy else episode_seed(seed, j, turn)
            sample = Sample(context, turn_seed, message_limit(budget - used, limits), limits.stop)
            ids, logps, cut, _ = await self._complete(sample, greedy, served, calls)
            reply = await calls.call(executor, on_turn, j, ids, logps, cut)
            if reply is None:
                return
            used += len(ids) + len(reply)
            check_room(j, len(reply), budget, used)
            limits = limits_of(reply)
            # a NewRow starts the context again after the prompt; its tokens count against the budget all the same
            context = list(prompt) + reply if isinstance(reply, NewRow) else context + ids.tolist() + reply
            turn += 1
