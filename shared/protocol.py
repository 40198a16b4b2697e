"""The messages that cross Redis, with their schema version; encode and decode live only here.

Request entries go gateway → worker on a stream; deltas, errors and done go worker → gateway on
the gateway's reply channel, each numbered by a per-request sequence so duplicates and gaps show.

Rolling upgrades: a process decodes its own schema version and the one before it, and writes the
older one to a peer that speaks only that (a worker answers in its entry's version; a gateway writes
an entry in the oldest version among the workers of its stream, which they put in their registry
entries). What each version added is listed in ADDED, so writing down drops exactly those fields.
A feature an older peer would drop that way is not sent to it at all: the gateway refuses the
request while such a peer serves its stream (NEEDS, `missing_features`).
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Union, get_type_hints

import orjson
from pydantic import BaseModel, Field, TypeAdapter, create_model, model_validator

from shared.sampling import ON_ENTRY, OPTIONAL, SamplingParams

SCHEMA_VERSION = 10
# still decoded, and written to peers that need it: at least the previous release's (2); 1 as well,
# which costs nothing (later versions only add fields) and keeps a fleet that skipped a release served
OLDEST_SCHEMA = 1
ENTRY_FIELD = b"m"  # the single field of a stream entry; its value is the encoded RequestEntry


def _wire_params() -> type[BaseModel]:
    """SamplingParams as it travels, derived from the dataclass (no second list of fields): each
    field with its type and default, but those carried on the entry; an OPTIONAL field (max_tokens)
    travels as None when the client left it out."""
    hints, specs = get_type_hints(SamplingParams), {}
    for f in dataclasses.fields(SamplingParams):
        if f.metadata.get(ON_ENTRY):
            continue
        if OPTIONAL in f.metadata:
            specs[f.name] = (hints[f.name] | None, None)
        elif f.default_factory is not dataclasses.MISSING:
            specs[f.name] = (hints[f.name], Field(default_factory=f.default_factory))
        else:
            specs[f.name] = (hints[f.name], f.default)
    return create_model("WireParams", __module__=__name__, __doc__="Sampling parameters as they travel; "
                        "the worker turns them into engine SamplingParams.", **specs)


WireParams = _wire_params()
ENTRY_PARAMS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.metadata.get(ON_ENTRY))


# v5: kinds a worker answers from its tokenizer alone (vLLM's /tokenize, /detokenize; v8 its
# /tokenizer_info): never run
TOKENIZER_KINDS = ("tokenize", "detokenize", "tokenizer_info")


class RenderOptions(BaseModel):
    """v5: how a tokenize entry's prompt or messages become ids, with vLLM's defaults for a prompt
    (a chat's add_special_tokens is False: its template places BOS itself)."""

    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class RequestEntry(BaseModel):
    v: int = SCHEMA_VERSION
    type: Literal["request"] = "request"
    request_id: str
    reply_channel: str
    model: str
    version: str
    kind: Literal["chat", "completion", "tokenize", "detokenize", "tokenizer_info", "embed", "score"]
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None  # a message may carry tool_calls / tool_call_id
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, given to the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": true}
    prompt_token_ids: list[int] | None = None  # a detokenize entry's tokens
    # v8: a batched completion's prompts (texts, or token ids), each with its n choices: prompt p's are
    # p*n .. p*n+n-1 (OpenAI's order); `prompt` and `prompt_token_ids` then unset. v9: an embed
    # entry's inputs (each one embedding, input i's at index i)
    prompts: list[str] | list[list[int]] | None = None
    render: RenderOptions | None = None  # v5: a tokenize entry's options
    params: WireParams = Field(default_factory=WireParams)
    created: float
    deadline: float
    priority: int = 0
    key_id: str | None = None
    weight: float = Field(1.0, gt=0)  # the key's share under the worker's fair order (worker/fairness.py)
    cache_salt: str | None = None
    trace: dict[str, str] = Field(default_factory=dict)
    # v6: the client reads the answer as it is made (SSE); False lets the worker hold a whole answer's
    # deltas after its first token and send them together (worker/held.py). An older peer streams each
    streamed: bool = True
    # v7: the MODEL_DEFAULTS the client left out: the worker may take them from the model folder's
    # generation_config.json (worker/model_defaults.py); an older worker keeps OpenAI's defaults
    from_model: list[str] | None = None
    # v8: the prompts' text comes back on the admission verdict (`Delta.prompt_texts`): a completion that
    # echoes prompts sent as token ids, which only the worker's tokenizer can write as text
    echo_prompt: bool = False
    # v9: an embed entry's vector length (Matryoshka models: the first `dimensions` of the pooled
    # state, then normalized); None: the model's whole hidden size
    dimensions: int | None = None
    # v9: an embed entry's inputs keep their last `truncate` tokens (vLLM's truncate_prompt_tokens; -1: as many
    # as the worker's context holds); None: an input past the context is refused
    truncate: int | None = None
    # v10: a score entry's (query, document) pairs as indices into `texts` (a rerank's query is sent
    # once, not once a document), each pair scored alone (pair i's score at index i) by a reranker:
    # the worker renders each as its folder or score template says
    texts: list[str] | None = None
    pairs: list[tuple[int, int]] | None = None

    @model_validator(mode="after")
    def _pairs_name_texts(self):
        if self.pairs is not None and any(not 0 <= i < len(self.texts or ()) for pair in self.pairs for i in pair):
            raise ValueError("a pair names a text the entry does not carry")
        return self

    def sampling_params(self, model_defaults: dict | None = None, **when_absent) -> SamplingParams:
        """The engine's parameters: `params` and the entry's own (priority, cache_salt) by name; an
        OPTIONAL one the client left out takes its value from `when_absent`, and one named in
        `from_model` the model's default, if `model_defaults` has one."""
        values = dict(self.params) | {name: getattr(self, name) for name in ENTRY_PARAMS}
        values |= {name: value for name, value in when_absent.items() if values[name] is None}
        if model_defaults and self.from_model:
            values |= {name: model_defaults[name] for name in self.from_model if name in model_defaults}
        return SamplingParams(**values)


class Delta(BaseModel):
    """New text of one choice; `finish_reason` is set on the last delta of that choice."""

    v: int = SCHEMA_VERSION
    type: Literal["delta"] = "delta"
    request_id: str
    seq: int
    index: int = 0
    text: str = ""
    reasoning: str | None = None  # thinking text (a reasoning model's), apart from the answer's text
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    # v4: on a request's first delta of choice 0, one entry per prompt token (logprob None: unscored)
    prompt_logprobs: list[dict[str, Any]] | None = None
    token_strs: list[str] | None = None  # v5: a tokenize answer's tokens as its tokenizer spells them
    prompt_texts: list[str] | None = None  # v8: one a prompt, on the admission verdict of an entry with echo_prompt
    # v9: an embed entry's vector for input `index`: base64 of little-endian float32 (OpenAI's base64
    # encoding_format, so a gateway passes it through), on that input's one delta (finish_reason "stop")
    # v10: a score entry's score for pair `index`, as one such float32
    embedding: str | None = None
    finish_reason: str | None = None


class Done(BaseModel):
    """The request is over: usage is what the client is charged."""

    v: int = SCHEMA_VERSION
    type: Literal["done"] = "done"
    request_id: str
    seq: int
    prompt_tokens: int
    completion_tokens: int


class ErrorReply(BaseModel):
    v: int = SCHEMA_VERSION
    type: Literal["error"] = "error"
    request_id: str
    seq: int
    code: str
    message: str
    param: str | None = None
    retryable: bool = False  # v2: the same request may succeed if sent again (503, not 500)


class Cancel(BaseModel):
    v: int = SCHEMA_VERSION
    type: Literal["cancel"] = "cancel"
    request_id: str
    reason: str = "client_disconnected"


Reply = Annotated[Union[Delta, Done, ErrorReply], Field(discriminator="type")]
_reply_adapter: TypeAdapter = TypeAdapter(Reply)


# version -> message type -> the fields that version added (a peer of an older version never sees them)
ADDED: dict[int, dict[str, frozenset[str]]] = {
    2: {"error": frozenset({"retryable"})},
    3: {"request": frozenset({"tools", "chat_template_kwargs"}), "delta": frozenset({"reasoning"})},
    4: {"delta": frozenset({"prompt_logprobs"})},
    5: {"request": frozenset({"render", "weight"}), "delta": frozenset({"token_strs"})},
    6: {"request": frozenset({"streamed"})},
    7: {"request": frozenset({"from_model"})},
    8: {"request": frozenset({"prompts", "echo_prompt"}), "delta": frozenset({"prompt_texts"})},
    9: {"request": frozenset({"dimensions", "truncate"}), "delta": frozenset({"embedding"})},
    10: {"request": frozenset({"texts", "pairs"})},
}
# request features an older peer would drop without a word (the params' new fields travel inside
# `params`, which a v2 worker reads leniently): a gateway refuses them while such a peer serves
NEEDS: dict[str, int] = {"tools": 3, "chat_template_kwargs": 3, "structured_outputs": 3, "logit_bias": 3,
                         "prompt_logprobs": 4, "tokenize": 5, "echo": 8, "batched prompts": 8,
                         "tokenizer_info": 8, "embeddings": 9, "scores": 10}


def missing_features(entry: RequestEntry, version: int) -> list[str]:
    """The features `entry` uses that a peer speaking `version` would not honour."""
    used = {"tools": entry.tools, "chat_template_kwargs": entry.chat_template_kwargs,
            "structured_outputs": entry.params.structured_outputs, "logit_bias": entry.params.logit_bias,
            "prompt_logprobs": entry.params.prompt_logprobs is not None,
            "tokenize": entry.kind in TOKENIZER_KINDS,  # an older worker cannot read the kind
            "echo": entry.echo_prompt, "batched prompts": entry.prompts is not None,
            "tokenizer_info": entry.kind == "tokenizer_info", "embeddings": entry.kind == "embed",
            "scores": entry.kind == "score"}
    return [name for name, value in used.items() if value and NEEDS[name] > version]


class ProtocolError(ValueError):
    """A message that is not ours or not of a schema version we understand."""


def encode(msg: BaseModel, version: int | None = None) -> bytes:
    """`msg` in schema `version` (default: the version it carries, the newest for a new message)."""
    data = _dumped(msg)
    version = data["v"] if version is None else version
    if not OLDEST_SCHEMA <= version <= SCHEMA_VERSION:
        raise ProtocolError(f"cannot write schema version {version}")
    for newer in range(version + 1, SCHEMA_VERSION + 1):
        for name in ADDED.get(newer, {}).get(data["type"], ()):
            data.pop(name, None)
    data["v"] = version
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)  # logit_bias is keyed by token id


def _dumped(msg: BaseModel) -> dict:
    """`msg.model_dump(exclude_none=True)`, without the deep copy where every field is JSON as it
    stands: a Delta's (its logprobs are lists of plain dicts; copying a 1,500-token prompt's scores
    held the worker's serving loop 27 ms)."""
    if isinstance(msg, Delta):
        return {name: value for name, value in msg if value is not None}
    return msg.model_dump(exclude_none=True)


def peer_version(advertised: int | None) -> int:
    """The version to write to a peer that advertised `advertised` (None: a peer from before peers
    advertised one, which spoke 1)."""
    return max(OLDEST_SCHEMA, min(SCHEMA_VERSION, advertised or 1))


def _load(raw: bytes | str) -> dict:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    return _checked(data)


def _checked(data) -> dict:
    version = data.get("v") if isinstance(data, dict) else None
    if not isinstance(version, int) or not OLDEST_SCHEMA <= version <= SCHEMA_VERSION:
        raise ProtocolError(f"unsupported schema version {version!r} (this process reads "
                            f"{OLDEST_SCHEMA}..{SCHEMA_VERSION})")
    return data


def addressee(raw: bytes | str) -> tuple[str, str | None] | None:
    """(request_id, reply_channel) of a message that could not be decoded, read as leniently as
    possible, so its sender can still be answered with an error instead of silence; None if even
    those are not there."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("request_id"), str):
        return None
    channel = data.get("reply_channel")
    return data["request_id"], channel if isinstance(channel, str) else None


def addressees(raw: bytes | str) -> list[str]:
    """The request ids named in a reply message (one reply or an array) that could not be decoded."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return []
    items = data if isinstance(data, list) else [data]
    return [i["request_id"] for i in items if isinstance(i, dict) and isinstance(i.get("request_id"), str)]


def decode_entry(raw: bytes | str) -> RequestEntry:
    return RequestEntry.model_validate(_load(raw))


def decode_reply(raw: bytes | str) -> Delta | Done | ErrorReply:
    return _reply_adapter.validate_python(_load(raw))


def encode_replies(encoded: list[bytes]) -> bytes:
    """Several encoded replies as one pub/sub message (a JSON array): a worker sends each gateway
    one message per engine step, however many of its requests got a token."""
    return b"[" + b",".join(encoded) + b"]"


def decode_replies(raw: bytes | str) -> list[Delta | Done | ErrorReply]:
    """A message of `encode_replies` (or a single encoded reply)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    return [_reply_adapter.validate_python(_checked(item)) for item in (data if isinstance(data, list) else [data])]


def decode_cancel(raw: bytes | str) -> Cancel:
    return Cancel.model_validate(_load(raw))
