"""GPU worker service: pulls requests from Redis streams and runs them on an engine."""
