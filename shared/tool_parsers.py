"""Tool-call parsers per model family (`--tool-call-parser`): they find the calls a model writes in its
own format in the text it streams, and turn them into OpenAI's `tool_calls`. A small registry that a
new family plugs into (issue 17); the gateway runs the parser its workers register.
"""
from __future__ import annotations

# name -> parser class; filled by the implementations below
PARSERS: dict[str, type] = {}
NAMES = ("hermes", "llama3")  # the families implemented: Hermes/Qwen <tool_call>{...}</tool_call>, Llama 3.x JSON


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template implies, when it is recognisable."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3"
    return None
