"""What each rollout engine supports: the table the config's rules and the launcher read, beside the
engines' import paths (grpo/sampler/rollout/__init__.py, ENGINES). A new engine is one line here and
one there."""

from __future__ import annotations

from dataclasses import dataclass

IN_FLIGHT_KV = ("recompute", "keep")  # sampling.in_flight_kv


@dataclass(frozen=True)
class EngineTraits:
    in_flight_kv: tuple[str, ...] = IN_FLIGHT_KV  # the sampling.in_flight_kv modes it takes with in-flight updates
    in_flight_needs_lora: bool = False  # in-flight updates with adapters only (full weights load between steps)
    stop_with_in_flight: bool = True  # sampling.stop together with in-flight updates
    adapter_extras: bool = True  # serves DoRA adapters and lora.modules_to_save
    own_python: bool = False  # runs in an environment of its own: sampling.<name>.python


ENGINE_TRAITS = {
    "hf": EngineTraits(),
    "vllm": EngineTraits(in_flight_kv=("recompute",), in_flight_needs_lora=True, stop_with_in_flight=False,
                         adapter_extras=False, own_python=True),
}
ENGINE_NAMES = tuple(ENGINE_TRAITS)  # sampling.engine's choices
