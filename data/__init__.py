"""Datasets (GSM8K from the Hub or a local folder), chat prompts, and the resumable cursor."""
