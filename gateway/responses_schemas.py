"""The body of OpenAI's Responses API (`POST /v1/responses`), bounded as chat's is, and its one
translation: `conversation()` and `chat()` make the chat request every API becomes (the one
request path). Items and parts that a text model cannot serve are refused by their type (422);
items the client merely hands back (reasoning) are accepted and not rendered, as chat templates
drop earlier thinking."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StrictBool, StringConstraints,
                      Tag)
from typing_extensions import TypedDict

from gateway import bounds as b
from gateway.bounded import mapping
from gateway.agent_schemas import CallId, Description, FunctionName, Schema, call_arguments
from gateway.unsupported import refuse_chat_fields
from shared.errors import InvalidRequest

Text = Annotated[str, StringConstraints(max_length=b.SCHEMA_CHARS * 32)]  # the body limit binds first
Metadata = mapping(str, str, 16)


class InputText(TypedDict):
    """`input_text` (the user's), `output_text` (an earlier answer handed back), or plain `text`; a
    TypedDict, as chat's TextPart is (gateway/schemas.py). Other keys (annotations, logprobs of a
    handed-back answer) are dropped."""
    __pydantic_config__ = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status, phase: labels of a handed-back item

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, Annotated[list[InputText], Field(fail_fast=True)]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p["text"] for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: CallId
    name: FunctionName
    arguments: Annotated[str, StringConstraints(max_length=b.SCHEMA_CHARS), AfterValidator(call_arguments)]


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: CallId
    output: Union[str, Annotated[list[InputText], Field(fail_fast=True)]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p["text"] for p in self.output)


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(BaseModel):
    """Responses' function tool (flat, not nested under `function` as chat's)."""

    type: Annotated[str, StringConstraints(max_length=64)]  # only "function" is served (400 otherwise)
    name: FunctionName | None = None
    description: Description | None = None
    parameters: Schema | None = None
    strict: StrictBool | None = None


class FunctionChoice(BaseModel):
    type: Annotated[str, StringConstraints(max_length=64)]
    name: FunctionName | None = None


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: Schema | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: Description | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity: how much prose; refused below when set

    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(BaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # accepted; thinking comes back whole, as reasoning_text


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # labels clients send; those that change output: below

    model: str = Field(min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["demo"])
    input: Union[Text, Annotated[list[InputItem], Field(max_length=b.MESSAGES, fail_fast=True)]] = Field(
        examples=["Hello"])
    instructions: Text | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=b.TOOLS, fail_fast=True)
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=b.MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=b.TOP_K)  # vLLM's extras, as on chat
    seed: int | None = Field(None, ge=0, le=b.INT64_MAX)
    stream: StrictBool = False
    store: StrictBool = True  # as OpenAI documents
    previous_response_id: Annotated[str, StringConstraints(max_length=128)] | None = None
    background: StrictBool | None = None
    metadata: Metadata | None = None
    user: str | None = Field(None, max_length=b.USER_CHARS)

    def refuse_unserved(self) -> None:
        """400 naming what kvgate does not do, rather than ignore it."""
        extra = self.model_extra or {}
        refuse_chat_fields(self, "/v1/responses", {"max_tokens": "max_output_tokens",
                                                   "max_completion_tokens": "max_output_tokens",
                                                   "response_format": "text.format",
                                                   "reasoning_effort": "reasoning.effort"})
        if self.background:
            raise InvalidRequest("background responses are not supported; send background: false "
                                 "(stream: true gives the same early start)", param="background",
                                 code="unsupported_parameter")
        for name in ("conversation", "prompt", "max_tool_calls", "include", "top_logprobs"):
            if extra.get(name):
                raise InvalidRequest(f"{name} is not supported on /v1/responses", param=name,
                                     code="unsupported_parameter")
        if extra.get("truncation") not in (None, "disabled"):
            raise InvalidRequest("truncation 'auto' is not supported: a conversation longer than the "
                                 "context is refused", param="truncation", code="unsupported_parameter")
        if self.text is not None and self.text.verbosity is not None:
            raise InvalidRequest("text.verbosity is not supported", param="text.verbosity",
                                 code="unsupported_parameter")

    def conversation(self, earlier: list[dict]) -> list[dict]:
        """The chat messages of the conversation so far: `earlier` (a stored one, when this turn
        names its previous response) then this turn's input, without the instructions (they are
        this request's alone, as OpenAI keeps them)."""
        messages = [dict(m) for m in earlier]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                _add_call(messages, {"id": item.call_id, "type": "function",
                                     "function": {"name": item.name, "arguments": item.arguments}})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return messages

    def chat(self, conversation: list[dict]) -> dict[str, Any]:
        """The chat request this turn is: same model, messages, tools, constraint and sampling."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        out: dict[str, Any] = {"model": self.model, "messages": system + conversation,
                               "max_tokens": self.max_output_tokens, "stream": self.stream,
                               "parallel_tool_calls": self.parallel_tool_calls, "user": self.user}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tools:
            out["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            out["tool_choice"] = _chat_choice(self.tool_choice)
        if self.text is not None and self.text.format is not None:
            out["response_format"] = _response_format(self.text.format)
        if self.reasoning is not None and self.reasoning.effort is not None:
            # the chat route's reasoning_effort: the template's thinking switch (Qwen3's
            # enable_thinking) off for "none", on otherwise; kvgate has no budget of thinking tokens
            out["reasoning_effort"] = self.reasoning.effort
        return out


def _add_call(messages: list[dict], call: dict) -> None:
    """Calls one after the other belong to one assistant turn (parallel calls)."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last["tool_calls"] = [*last.get("tool_calls", ()), call]
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _chat_tool(i: int, tool: FunctionTool) -> dict:
    if tool.type != "function":
        raise InvalidRequest(f"tools[{i}] is of type '{tool.type}'; only function tools are served",
                             param=f"tools.{i}.type")
    if tool.name is None:
        raise InvalidRequest(f"tools[{i}] needs a name", param=f"tools.{i}.name")
    function = tool.model_dump(exclude_none=True, exclude={"type"})
    return {"type": "function", "function": function}


def _chat_choice(choice) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise InvalidRequest(f"tool_choice of type '{choice.type}' is not supported; use none, auto, "
                             "required or {\"type\": \"function\", \"name\": ...}", param="tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(fmt: TextFormat) -> dict:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.name is None or fmt.schema_ is None:
        raise InvalidRequest("text.format json_schema needs a name and a schema", param="text.format")
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
