"""Request bodies of the OpenAI-compatible routes, with the ranges OpenAI documents and the bounds
of gateway/bounds.py on everything else. Each turns into the engine's parameters with one call,
`to_sampling_params()`: the fields named as in shared/sampling.py are taken by name, so a sampling
field is declared here only for its bounds (and once more only where OpenAI spells it differently)."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from gateway import bounds as b
from shared import protocol
from shared.sampling import StructuredOutputs

TokenId = Annotated[int, Field(ge=0, le=b.TOKEN_ID_MAX)]
Bias = Annotated[float, Field(ge=-b.LOGIT_BIAS_VALUE, le=b.LOGIT_BIAS_VALUE)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=b.STOP_CHARS)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both routes share. Unknown fields are accepted and ignored, as OpenAI clients send some."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["demo"])
    max_tokens: int | None = Field(None, ge=1, le=b.MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=b.TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=b.N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[StopString, list[StopString], None] = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=b.INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=b.MAX_TOKENS)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=b.STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=b.LOGIT_BIAS)  # keys: "id" in JSON
    structured_outputs: StructuredOutputs | None = None  # vLLM's spelling of a constraint
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

    def to_sampling_params(self) -> protocol.WireParams:
        """The engine's parameters as they travel: every declared field the wire shares, by name
        (an unknown field a client sent never travels), then those OpenAI spells differently."""
        wire = protocol.WireParams.model_fields
        same = {name: getattr(self, name) for name in type(self).model_fields if name in wire}
        return protocol.WireParams(**{**same, **self._respelled()})

    def _respelled(self) -> dict:
        """Engine fields OpenAI spells differently (a route adds its own)."""
        return {"max_tokens": self.limit()}


class TextPart(BaseModel):
    """The one content part a text model reads; an image or audio part is refused (422), not
    silently dropped."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=b.MESSAGES,
                                        examples=[[{"role": "user", "content": "Hello"}]])
    max_completion_tokens: int | None = Field(None, ge=1, le=b.MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=b.LOGPROBS)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _respelled(self) -> dict:
        """Chat asks for logprobs with a flag and a count; the engine takes the count, None: off."""
        return {**super()._respelled(), "logprobs": (self.top_logprobs or 0) if self.logprobs else None}


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[TokenId], Field(max_length=b.PROMPT_TOKEN_IDS)], list[str]]
    logprobs: int | None = Field(None, ge=0, le=b.LOGPROBS)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:  # refused rather than ignored: a client that asked for its prompt back would not get it
            raise ValueError("echo is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v
