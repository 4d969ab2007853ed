"""Executor: one process per accelerator; holds the KV tensors and runs the model (arrives with its issue)."""
