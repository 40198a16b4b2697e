"""Request and response bodies of vLLM's /tokenize and /detokenize, in vLLM's shapes and defaults,
bounded like the OpenAI routes (gateway/bounds.py). Unknown fields are refused by name (422): a
vLLM field kvgate does not honour (a custom `chat_template`, media kwargs) must not be dropped in
silence."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from gateway import bounds as b
from gateway.agent_schemas import TemplateKwargs, Tool
from gateway.schemas import ChatMessage, TokenId
from shared import protocol


# as vLLM, which serves one model, takes these without one (lm-evaluation-harness's remote tokenizer
# sends none)
MODEL_DEFAULT = "Left out: the one served model this key may use (400 when it may use several)"


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize requests in one body: a `prompt` (TokenizeCompletionRequest) or a chat's
    `messages` (TokenizeChatRequest), exactly one; the chat-only fields need messages."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["demo"],
                              description=MODEL_DEFAULT)
    prompt: str | None = Field(None, examples=["Hello"])
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=b.MESSAGES, fail_fast=True)
    add_special_tokens: StrictBool | None = Field(None, description="Add the tokenizer's special tokens "
                                            "(e.g. BOS); default true for a prompt, false for a chat "
                                            "(its template places them)")
    return_token_strs: StrictBool = Field(False, description="Also return each token as the tokenizer spells it")
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[Tool] | None = Field(None, max_length=b.TOOLS, fail_fast=True)
    chat_template_kwargs: TemplateKwargs | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        chat_only = [f for f in ("tools", "chat_template_kwargs", "continue_final_message")
                     if getattr(self, f) and self.messages is None]
        if chat_only:
            raise ValueError(f"{chat_only[0]} needs messages (a chat), not a prompt")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    def entry_fields(self) -> dict:
        """What the worker's entry carries (shared/protocol.py, kind `tokenize`)."""
        chat = self.messages is not None
        render = protocol.RenderOptions(
            add_special_tokens=not chat if self.add_special_tokens is None else self.add_special_tokens,
            return_token_strs=self.return_token_strs, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message)
        if not chat:
            return {"prompt": self.prompt, "render": render}
        return {"messages": [m.entry() for m in self.messages],
                "tools": [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
                "chat_template_kwargs": self.chat_template_kwargs, "render": render}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None  # None only while no live worker of the version says
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["demo"],
                              description=MODEL_DEFAULT)
    tokens: list[TokenId] = Field(max_length=b.PROMPT_TOKEN_IDS, fail_fast=True, description="At most the model's "
                                  "context length, each inside its vocabulary (400 otherwise)")


class DetokenizeResponse(BaseModel):
    prompt: str
