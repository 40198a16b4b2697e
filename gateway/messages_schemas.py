"""The body of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), bounded
as chat's is, and its one translation, `chat()`: the chat request every API becomes. Blocks a text
model cannot serve (images, documents) are refused by their type; thinking blocks handed back are
accepted and not rendered, as chat templates drop earlier thinking."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StrictBool, StringConstraints,
                      Tag)

from gateway import bounds as b
from gateway.agent_schemas import CallId, Description, FunctionName, Schema
from gateway.schemas import StopString
from gateway.unsupported import refuse_chat_fields
from shared.errors import InvalidRequest
from shared.sampling import json_depth


def _arguments(value: dict[str, Any]) -> dict[str, Any]:
    """A call's input must travel as JSON text (chat's `arguments`): no integer past 64 bits, and
    no larger nor deeper than a schema may be."""
    if json_depth(value) > b.TOOL_ARGUMENTS_DEPTH:
        raise ValueError(f"JSON nested at most {b.TOOL_ARGUMENTS_DEPTH} deep")
    try:
        size = len(orjson.dumps(value))
    except TypeError as exc:
        raise ValueError(f"not writable as JSON: {exc}") from None
    if size > b.SCHEMA_CHARS:
        raise ValueError(f"larger than {b.SCHEMA_CHARS} characters of JSON")
    return value


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: no effect on the output here

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: CallId
    name: FunctionName
    input: Annotated[dict[str, Any], AfterValidator(_arguments)]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: CallId
    content: Union[str, Annotated[list[TextBlock], Field(fail_fast=True)]] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["thinking", "redacted_thinking"]


def _block_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "thinking" if kind == "redacted_thinking" else kind if kind in (
        "tool_use", "tool_result", "thinking") else "text"


Block = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                        Annotated[ToolResultBlock, Tag("tool_result")],
                        Annotated[ThinkingBlock, Tag("thinking")]], Discriminator(_block_type)]


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[Block], Field(max_length=b.TOOL_CALLS * 2, fail_fast=True)]]


class Tool(BaseModel):
    """A client tool: name, description, input_schema. Anthropic's server tools (bash, web search,
    ...) carry a type of their own and are refused (400)."""

    model_config = ConfigDict(extra="ignore")  # cache_control

    type: Annotated[str, StringConstraints(max_length=64)] | None = None
    name: FunctionName
    description: Description | None = None
    input_schema: Schema | None = None


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: StrictBool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")  # display: thinking comes back whole

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1, le=b.MAX_TOKENS)  # accepted; max_tokens caps both


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: Schema = Field(alias="schema")


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted: no effect here
    format: OutputFormat | None = None


System = Union[str, Annotated[list[TextBlock], Field(max_length=b.MESSAGES, fail_fast=True)]]


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["demo"])
    messages: list[Message] = Field(min_length=1, max_length=b.MESSAGES, fail_fast=True)
    system: System | None = None
    tools: list[Tool] | None = Field(None, max_length=b.TOOLS, fail_fast=True)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def conversation(self) -> list[dict]:
        """The chat messages: the system prompt first, each tool result as a tool message."""
        out = [{"role": "system", "content": _text(self.system)}] if self.system else []
        for message in self.messages:
            out += _chat_messages(message)
        return out


class MessagesRequest(CountTokensRequest):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier: labels; what changes output: below

    max_tokens: int = Field(ge=1, le=b.MAX_TOKENS)  # required, as Anthropic requires it
    stop_sequences: list[StopString] | None = Field(None, max_length=b.STOP_SEQUENCES, fail_fast=True)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=b.TOP_K)
    output_config: OutputConfig | None = None
    stream: StrictBool = False

    def refuse_unserved(self) -> None:
        """400 naming what kvgate does not do here, rather than ignore it."""
        for name in ("mcp_servers", "container"):
            if (self.model_extra or {}).get(name) is not None:
                raise InvalidRequest(f"{name} is not supported: kvgate runs no server tools", param=name,
                                     code="unsupported_parameter")
        refuse_chat_fields(self, "/v1/messages", {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
                                                  "response_format": "output_config.format",
                                                  "chat_template_kwargs": "thinking"})

    def chat(self) -> dict[str, Any]:
        """The chat request this is. A stop sequence is asked with include_stop_str_in_output, so
        the finishing text shows which one ended it (cut off again before it is rendered)."""
        out: dict[str, Any] = {"model": self.model, "messages": self.conversation(),
                               "max_tokens": self.max_tokens, "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.stop_sequences:
            out |= {"stop": self.stop_sequences, "include_stop_str_in_output": True}
        if self.tools:
            out["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            out |= _chat_choice(self.tool_choice)
        if self.output_config is not None and self.output_config.format is not None:
            out["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        if self.thinking is not None:
            out["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return out


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _chat_messages(message: Message) -> list[dict]:
    """One Anthropic message as chat messages: tool results first (each its own tool message, as
    Anthropic puts them first in a user turn), then the text; an assistant's tool_use blocks are
    its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    blocks = message.content
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
               for block in blocks if isinstance(block, ToolResultBlock)]
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": orjson.dumps(block.input).decode()}}
             for block in blocks if isinstance(block, ToolUseBlock)]
    if calls and message.role != "assistant":
        raise InvalidRequest("tool_use blocks belong to assistant messages", param="messages")
    if results and message.role != "user":
        raise InvalidRequest("tool_result blocks belong to user messages", param="messages")
    out = results
    if text or calls or not results:
        out = out + [{"role": message.role, "content": text, **({"tool_calls": calls} if calls else {})}]
    return out


def _chat_tool(i: int, tool: Tool) -> dict:
    if tool.type not in (None, "custom"):
        raise InvalidRequest(f"tools[{i}] is of type '{tool.type}'; only client tools (name, "
                             "description, input_schema) are served", param=f"tools.{i}.type")
    if tool.input_schema is None:  # Anthropic requires it of a client tool
        raise InvalidRequest(f"tools[{i}].input_schema is required: a JSON schema of the tool's input "
                             '(`{"type": "object"}` for any)', param=f"tools.{i}.input_schema")
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _chat_choice(choice: ToolChoice) -> dict:
    parallel = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest("tool_choice of type tool needs a name", param="tool_choice.name")
        return {"tool_choice": {"type": "function", "function": {"name": choice.name}}, **parallel}
    return {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type], **parallel}
