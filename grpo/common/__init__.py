"""What the top-level packages share (grpo, rewards and data import it; it imports none of them):
child processes, files written whole, where models and data come from, code named by import path."""
