"""The governance gateway: OpenAI-compatible API in front of the Redis streams."""
