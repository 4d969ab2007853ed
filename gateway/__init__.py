"""Gateway: OpenAI-compatible HTTP front door (arrives with its issue)."""
