"""The request parts agents send: what the output must match (`response_format`, vLLM's
`structured_outputs`), the tools a model may call, and the calls and tool results a conversation
carries back. Shapes and bounds only (422 when broken); whether a schema is valid and compiles, and
how the parts combine, is gateway/structured.py's (400)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StringConstraints

from gateway import bounds as b
from gateway.bounded import encodable
from shared.sampling import json_depth

# arguments the template is rendered with by the worker itself: a client must not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "chat_template", "tokenizer", "padding", "truncation", "max_length",
    "bos_token", "eos_token", "pad_token", "unk_token"})


def call_arguments(text: str) -> str:
    """JSON text, read as strictly as a request body is (no NaN or Infinity, no lone surrogate, no
    number past a double) and nested no deeper than a schema: the worker renders the conversation
    with the arguments parsed (templates expect a mapping), where a deep one would exhaust Python's
    recursion limit."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"must be JSON text ({exc})") from None
    if json_depth(value) > b.TOOL_ARGUMENTS_DEPTH:
        raise ValueError(f"JSON nested at most {b.TOOL_ARGUMENTS_DEPTH} deep")
    return text


def _schema_size(schema: dict[str, Any]) -> dict[str, Any]:
    try:
        size = len(orjson.dumps(schema))
    except TypeError as exc:  # an integer past 64 bits: a 422, not a 500
        raise ValueError(f"the schema is not writable as JSON: {exc}") from None
    if size > b.SCHEMA_CHARS:
        raise ValueError(f"the schema is larger than {b.SCHEMA_CHARS} characters of JSON")
    return schema


def _template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"{', '.join(reserved)}: set by kvgate itself, not by chat_template_kwargs")
    if json_depth(kwargs) > b.TEMPLATE_KWARGS_DEPTH:  # before orjson, which refuses past 255 with a TypeError
        raise ValueError(f"nested at most {b.TEMPLATE_KWARGS_DEPTH} deep")
    if len(orjson.dumps(kwargs)) > b.TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"at most {b.TEMPLATE_KWARGS_CHARS} characters of JSON are allowed")
    return kwargs


Schema = Annotated[dict[str, Any], AfterValidator(_schema_size)]
SchemaText = Annotated[str, StringConstraints(max_length=b.SCHEMA_CHARS), AfterValidator(encodable)]
Regex = Annotated[str, StringConstraints(min_length=1, max_length=b.REGEX_CHARS), AfterValidator(encodable)]
Ebnf = Annotated[str, StringConstraints(min_length=1, max_length=b.GRAMMAR_CHARS), AfterValidator(encodable)]
Choice = Annotated[str, StringConstraints(min_length=1, max_length=b.CHOICE_CHARS), AfterValidator(encodable)]
Choices = Annotated[list[Choice], Field(min_length=1, max_length=b.CHOICES, fail_fast=True)]
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Description = Annotated[str, StringConstraints(max_length=b.DESCRIPTION_CHARS), AfterValidator(encodable)]
CallId = Annotated[str, StringConstraints(min_length=1, max_length=b.TOOL_CALL_ID_CHARS)]
TemplateKwargs = Annotated[dict[str, Any], Field(max_length=b.TEMPLATE_KWARGS),
                           AfterValidator(_template_kwargs)]


class StructuredOutputsIn(BaseModel):
    """vLLM's `structured_outputs`, bounded: exactly one of these (gateway/structured.py checks)."""

    model_config = ConfigDict(extra="forbid")

    json_: Union[Schema, SchemaText, None] = Field(None, alias="json")
    json_object: StrictBool = False
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Ebnf | None = None


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: FunctionName
    schema_: Schema | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: Description | None = None


class ResponseFormat(BaseModel):
    """`text`, `json_object` or `json_schema`; another type is refused by name (400), not ignored."""

    type: Annotated[str, StringConstraints(max_length=64)]
    json_schema: JsonSchemaSpec | None = None


class FunctionDef(BaseModel):
    name: FunctionName
    description: Description | None = None
    parameters: Schema | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Annotated[str, StringConstraints(max_length=64)]  # only "function" is served (400 otherwise)
    function: FunctionDef


class NamedFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(BaseModel):
    name: FunctionName
    arguments: Annotated[str, StringConstraints(max_length=b.SCHEMA_CHARS),
                         AfterValidator(call_arguments)]  # JSON text, as OpenAI sends


class ToolCallIn(BaseModel):
    """A call an assistant message made earlier in the conversation."""

    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction
