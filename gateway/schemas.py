"""Request bodies of the OpenAI-compatible routes, with the ranges OpenAI documents and the bounds
of gateway/bounds.py on everything else. Each turns into the engine's parameters with one call,
`to_sampling_params()`: the fields named as in shared/sampling.py are taken by name, so a sampling
field is declared here only for its bounds (and once more only where OpenAI spells it differently)."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StringConstraints, ValidationInfo, field_validator,
                      model_validator)
from typing_extensions import TypedDict

from gateway import bounds as b
from gateway import structured, tool_calls
from gateway.bounded import mapping
from gateway.agent_schemas import (CallId, Choices, Ebnf, Regex, ResponseFormat, Schema, SchemaText,
                                   StructuredOutputsIn, TemplateKwargs, Tool, ToolCallIn, ToolChoice)
from shared import protocol
from shared.errors import InvalidRequest
from shared.sampling import MODEL_DEFAULTS

TokenId = Annotated[int, Field(ge=0, le=b.TOKEN_ID_MAX, strict=True)]  # not `true` nor `1.0`
Bias = Annotated[float, Field(ge=-b.LOGIT_BIAS_VALUE, le=b.LOGIT_BIAS_VALUE)]
# its keys are "id" strings in JSON
LogitBias = mapping(Annotated[int, Field(ge=0, le=b.TOKEN_ID_MAX)], Bias, b.LOGIT_BIAS)
StopString = Annotated[str, StringConstraints(min_length=1, max_length=b.STOP_CHARS)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both routes share. Unknown fields are accepted, as OpenAI clients send some that only
    label a request; those that would change the output are refused by name (gateway/unsupported.py)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["demo"])
    max_tokens: int | None = Field(None, ge=1, le=b.MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=b.TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=b.N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Union[StopString, Annotated[list[StopString], Field(fail_fast=True)], None] = Field(
        None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=b.INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=b.REPETITION_PENALTY_MIN, le=10.0)
    min_tokens: int = Field(0, ge=0, le=b.MAX_TOKENS)
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=b.STOP_TOKEN_IDS, fail_fast=True)
    include_stop_str_in_output: StrictBool = False
    logit_bias: LogitBias | None = None
    structured_outputs: StructuredOutputsIn | None = None  # vLLM's spelling of a constraint
    response_format: ResponseFormat | None = None  # OpenAI's
    guided_json: Union[Schema, SchemaText, None] = None  # vLLM's older spellings
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Ebnf | None = None
    priority: int = Field(0, ge=-b.PRIORITY, le=b.PRIORITY)
    user: str | None = Field(None, max_length=b.USER_CHARS)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > b.STOP_SEQUENCES:
            raise ValueError(f"at most {b.STOP_SEQUENCES} stop sequences are allowed")
        return stops

    def limit(self) -> int | None:
        return self.max_tokens

    def constraint(self) -> structured.Constraint | None:
        """The one constraint on the output, however it was spelled (400 for two at once)."""
        return structured.one(structured.requested(self))

    def to_sampling_params(self) -> protocol.WireParams:
        """The engine's parameters as they travel: every declared field the wire shares, by name
        (an unknown field a client sent never travels), then those OpenAI spells differently."""
        wire = protocol.WireParams.model_fields
        same = {name: getattr(self, name) for name in type(self).model_fields if name in wire}
        return protocol.WireParams(**{**same, **self._respelled()})

    def left_to_model(self) -> list[str] | None:
        """The sampling fields the client left out, which a worker may take from the model folder
        (shared/sampling.py MODEL_DEFAULTS); None when it set them all."""
        return [name for name in MODEL_DEFAULTS if name not in self.model_fields_set] or None

    def _respelled(self) -> dict:
        """Engine fields OpenAI spells differently (a route adds its own)."""
        constraint = self.constraint()
        return {"max_tokens": self.limit(), "structured_outputs": constraint and constraint.outputs}


class TextPart(TypedDict):
    """The one content part a text model reads; an image or audio part is refused (422), not
    silently dropped. A TypedDict, validated into a plain dict: a body may carry 40,000 parts, and
    a model instance each cost the event loop ~4× as much."""
    __pydantic_config__ = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, Annotated[list[TextPart], Field(fail_fast=True)], None] = None
    name: Annotated[str, StringConstraints(max_length=b.USER_CHARS)] | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=b.TOOL_CALLS, fail_fast=True)  # an assistant's
    tool_call_id: CallId | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _tool_roles(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content)

    def entry(self) -> dict:
        """The message as the entry carries it to the chat template (OpenAI's shape, text content)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=b.MESSAGES, fail_fast=True,
                                        examples=[[{"role": "user", "content": "Hello"}]])
    max_completion_tokens: int | None = Field(None, ge=1, le=b.MAX_TOKENS)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=b.LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=b.TOOLS, fail_fast=True)
    tool_choice: ToolChoice | None = None  # none: `auto` with tools, `none` without
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: TemplateKwargs | None = None
    # thinking is the chat template's switch (Qwen3's enable_thinking; gpt-oss reads the effort
    # itself): "none" turns it off, any other effort on — as the Responses API's reasoning.effort
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_kwargs(self) -> dict | None:
        """What the chat template is rendered with: reasoning_effort's switch, under the client's
        own chat_template_kwargs (which win where both say)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        effort = {"enable_thinking": self.reasoning_effort != "none", "reasoning_effort": self.reasoning_effort}
        return effort | (self.chat_template_kwargs or {})

    def choice(self):
        """`tool_choice` as OpenAI defaults it."""
        return self.tool_choice or ("auto" if self.tools else "none")

    def constraint(self) -> structured.Constraint | None:
        """A forced tool call's constraint, or the output's own; both at once is a 400."""
        forced = tool_calls.forced(self.tools, self.choice(), self.parallel_tool_calls)
        asked = structured.requested(self)
        if forced is not None and asked:
            raise InvalidRequest(f"tool_choice forces a tool call and {asked[0].param} constrains "
                                 f"the output; send only one", param=asked[0].param)
        return structured.Constraint("tool_choice", forced) if forced else structured.one(asked)

    def _respelled(self) -> dict:
        """Chat asks for logprobs with a flag and a count; the engine takes the count, None: off."""
        return {**super()._respelled(), "logprobs": (self.top_logprobs or 0) if self.logprobs else None}


TokenIds = Annotated[list[TokenId], Field(max_length=b.PROMPT_TOKEN_IDS, fail_fast=True)]


class CompletionRequest(_Sampling):
    # one prompt, as text or token ids, or OpenAI's batch of them (a list of strings or of id lists):
    # each prompt with its n choices, prompt p's at p*n .. p*n+n-1. (A batch's count is checked by
    # `_batch`: a bound here would fail its branch, and the union would name another branch's error.)
    prompt: Union[str, TokenIds, Annotated[list[str], Field(fail_fast=True)],
                  Annotated[list[TokenIds], Field(fail_fast=True)]]
    # 0: the prompt is scored and nothing generated (OpenAI's legacy scoring: echo with logprobs)
    max_tokens: int | None = Field(None, ge=0, le=b.MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=b.LOGPROBS)
    echo: StrictBool = False  # the prompt comes back before each choice's text (and its logprobs, with logprobs)
    # vLLM's: each prompt token's logprob and rank plus the top-k, in each choice's `prompt_logprobs`
    prompt_logprobs: int | None = Field(None, ge=0, le=b.LOGPROBS)
    # kvgate's (SGLang's logprob_start_len): positions before it are not scored, and may be read
    # from the prefix cache
    prompt_logprobs_start: int | None = Field(None, ge=0, le=b.MAX_TOKENS)

    @field_validator("echo")
    @classmethod
    def _echo_streams_one_scored_choice(cls, v, info: ValidationInfo):
        """(`prompt`, `logprobs`, `stream` and `n` are validated before `echo`.) A prompt of token ids
        is echoed as the worker's tokenizer writes it (the entry's echo_prompt)."""
        if v and info.data.get("logprobs") is not None and info.data.get("stream") and info.data.get("n", 1) > 1:
            raise ValueError("echo with logprobs streams one choice a prompt (each prompt is scored once); "
                             "send n=1 or stream=false")
        return v

    @model_validator(mode="after")
    def _nothing_to_generate_needs_the_prompt(self):
        """max_tokens 0 answers with the prompt alone: it must ask for it back (echo) or for its scores
        (a 400 naming max_tokens, not pydantic's 422: every field is valid on its own)."""
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise InvalidRequest("max_tokens 0 generates nothing: send echo (the prompt back; with logprobs, its "
                                 "tokens' logprobs) or prompt_logprobs", param="max_tokens")
        return self

    def scores_prompt(self) -> int | None:
        """The engine's prompt_logprobs: asked for directly, or by echo with logprobs (OpenAI's legacy
        way: the echoed prompt's tokens carry theirs)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def _respelled(self) -> dict:
        return {**super()._respelled(), "prompt_logprobs": self.scores_prompt()}

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_token_prompt(cls, v):
        """A batch of one token-id list is that prompt (read as one, so its bad id is named as one's);
        a batch mixing strings and id lists is named as such (the union would name a branch's error)."""
        if not (isinstance(v, list) and v and isinstance(v[0], (str, list))):
            return v
        if any(type(p) is not type(v[0]) for p in v):
            raise ValueError("a batch's prompts are all strings or all lists of token ids")
        if len(v) == 1 and isinstance(v[0], list) and not (v[0] and isinstance(v[0][0], (str, list))):
            return v[0]
        return v

    @field_validator("prompt")
    @classmethod
    def _batch(cls, v, info: ValidationInfo):
        """A batch of one string is that prompt; a batch's choices (prompts × n) are bounded as n is,
        and its token ids all together as one prompt's. (`n` is validated before `prompt`.)"""
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if not (isinstance(v, list) and isinstance(v[0], (str, list))):
            return v
        if len(v) == 1 and isinstance(v[0], str):
            return v[0]
        n = info.data.get("n") or 1
        if len(v) * n > b.N:
            raise ValueError(f"{len(v)} prompts × n ({n}) = {len(v) * n} choices; at most {b.N} a request")
        if isinstance(v[0], list) and sum(map(len, v)) > b.PROMPT_TOKEN_IDS:
            raise ValueError(f"the batch's prompts hold {sum(map(len, v))} token ids; at most "
                             f"{b.PROMPT_TOKEN_IDS} a request")
        if isinstance(v[0], list) and not all(v):  # (an empty string is a prompt: of BOS, or refused by the worker)
            raise ValueError(f"prompt {next(i for i, p in enumerate(v) if not p)} of the batch has no token ids")
        return v

    def num_prompts(self) -> int:
        """How many prompts: a batch's, else 1."""
        return len(self.prompt) if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)) else 1
