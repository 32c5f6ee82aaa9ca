"""Trainers and their shared pieces: the GPT loop, metrics/logging, checkpointing."""
