"""How each version of the policy's weights reaches the samplers: the trainer publishes, every
sampler watches and loads. A channel is a module with

    publisher(cfg) -> an object with publish(model, version, step)        (rank 0 of the trainer)
    watcher(cfg, stagers) -> an object with version, failures, load_seconds, latest() and
                             poll(prefer=None) -> LoadResult | None       (each sampler)

where a stager takes one verified version into one copy of the weights (grpo/weights/folder.py:
Stager). CHANNELS names the module of each weights.channel; the filesystem (folder) is the one today.
"""

from __future__ import annotations

import importlib

CHANNELS = {"folder": "grpo.weights.folder"}


def channel(cfg):
    return importlib.import_module(CHANNELS[cfg.weights.channel])


def open_publisher(cfg):
    """The trainer's end of weights.channel."""
    return channel(cfg).publisher(cfg)


def open_watcher(cfg, stagers: list, initial_version: int = 0):
    """A sampler's end of weights.channel, loading each new version through `stagers`."""
    return channel(cfg).watcher(cfg, stagers, initial_version)
