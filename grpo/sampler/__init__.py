"""The sampler's side: one step top to bottom, rollouts, episodes, evaluation."""
