"""What every part of grpo shares (grpo.rewards and grpo.data import it too; it imports none of them):
child processes, the jail, files written whole, where models and data come from, code named by import path."""
