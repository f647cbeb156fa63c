"""Datasets (the embedded GSM8K copy, GSM8K from the Hub or a local folder), chat prompts, and the resumable cursor.
Installed as grpo.data (pyproject.toml's package-dir)."""
