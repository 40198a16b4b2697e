"""Rerankers' APIs, as vLLM serves them: /v1/score (text_1 against text_2: one to one, one to many,
or pairwise) and /v1/rerank (Jina's and Cohere's body: a query, its documents, the top_n best first;
also at /rerank and /v2/rerank), answered by the workers of a reranker's folder
(worker/models/pooling.py): one entry of kind `score` (schema 10) carries each distinct text once and
the pairs as indices into them, so a query is sent once, not once a document; each pair's score
comes back as the worker makes it (`Delta.embedding`: one base64 float32), in [0, 1].

Governance as an embedding's (gateway/embeddings_api.py): model access, the key's minute, a slot and
the pairs' tokens reserved with the XADD (estimated from their characters; settled to what the
worker counted), usage recorded as prompt tokens, the key's canary cohort choosing the version.

Bounded work: at most PAIRS pairs, and at most PAIR_CHARS characters rendered all together (a query
of 1 MiB against 2,048 documents is 2 GiB of text for the worker to tokenize, from a 1 MiB body).
"""
from __future__ import annotations

import base64
import struct
import time
from typing import Annotated, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints, field_validator

from gateway import bounds as b
from gateway import estimate
from gateway.admission import Admitted, Lease, admit
from gateway.deps import StateDep
from gateway.embeddings_api import pooled_entry, pooling_model, run_pooled
from gateway.openai_api import json_body, reserving
from gateway.strict_json import ParsedJSONRoute
from shared.errors import InvalidRequest

router = APIRouter(dependencies=[Depends(admit)], tags=["rerank"], route_class=ParsedJSONRoute)

PAIRS = 2048  # as an embeddings request's inputs (the worker's bound too)
PAIR_CHARS = 1 << 23  # the pairs' characters all together: what the worker renders and tokenizes

Text = Annotated[str, StringConstraints(min_length=1)]
Texts = Annotated[list[Text], Field(min_length=1, max_length=PAIRS, fail_fast=True)]


class _Scored(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field that would change the scores is never dropped

    model: str = Field(min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["reranker"])
    user: str | None = Field(None, max_length=b.USER_CHARS)


class ScoreRequest(_Scored):
    """vLLM's /v1/score: text_1 and text_2 each a text or a list; one text_1 is scored against each
    text_2, and two lists of the same length pair by position."""

    text_1: Union[Text, Texts]
    text_2: Union[Text, Texts]

    def texts_and_pairs(self) -> tuple[list[str], list[tuple[int, int]]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise InvalidRequest(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: text_1 is one text "
                                 "(scored against each of text_2) or as many as text_2 (paired by position)",
                                 param="text_1")
        at = len(firsts)
        return firsts + seconds, [(0 if at == 1 else i, at + i) for i in range(len(seconds))]


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: Text


class RerankRequest(_Scored):
    """Jina's and Cohere's /rerank body as vLLM takes it: documents are texts or {"text": ...};
    top_n the best n (0 or unset: all), best first; return_documents (default true) echoes each."""

    query: Text
    documents: Annotated[list[Union[Text, Document]], Field(min_length=1, max_length=PAIRS, fail_fast=True)]
    top_n: StrictInt | None = Field(None, ge=0, le=PAIRS)
    return_documents: StrictBool = True

    @field_validator("documents", mode="before")
    @classmethod
    def _texts_or_objects(cls, v):
        """A document of another kind named as such (the union would name one branch's error)."""
        if isinstance(v, list):
            for i, doc in enumerate(v[:PAIRS + 1]):
                if not isinstance(doc, (str, dict)):
                    raise ValueError(f"documents[{i}] is a {type(doc).__name__}: each document is a text or "
                                     '{"text": "..."}')
        return v

    def texts_and_pairs(self) -> tuple[list[str], list[tuple[int, int]]]:
        docs = [d if isinstance(d, str) else d.text for d in self.documents]
        return [self.query] + docs, [(0, 1 + i) for i in range(len(docs))]


@router.post("/v1/score")
@router.post("/score", include_in_schema=False)
async def score(body: ScoreRequest, request: Request, lease: Admitted, state: StateDep):
    """Each pair's score, in order."""
    texts, pairs = body.texts_and_pairs()
    scores, usage, headers = await _scores(body, texts, pairs, request, lease, state)
    if scores is None:
        return Response(status_code=499)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return json_body({"id": headers["x-request-id"], "object": "list", "created": int(time.time()),
                      "model": body.model, "data": data, "usage": usage}, headers)


@router.post("/v1/rerank")
@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(body: RerankRequest, request: Request, lease: Admitted, state: StateDep):
    """The documents best first (ties in their order), the top_n of them, each with its index."""
    texts, pairs = body.texts_and_pairs()
    scores, usage, headers = await _scores(body, texts, pairs, request, lease, state)
    if scores is None:
        return Response(status_code=499)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": texts[1 + i]}} if body.return_documents else {})} for i in order]
    return json_body({"id": headers["x-request-id"], "model": body.model, "usage": usage, "results": results},
                     headers)


async def _scores(body: _Scored, texts: list[str], pairs: list[tuple[int, int]], request: Request, lease: Lease,
                  state: StateDep) -> tuple[list[float] | None, dict, dict[str, str]]:
    """The pairs' scores (None: the client left) with the tokens the worker counted, under the
    key's governance; the worker's error raises."""
    chars = sum(len(texts[q]) + len(texts[d]) for q, d in pairs)
    if chars > PAIR_CHARS:
        raise InvalidRequest(f"the pairs come to {chars} characters to score all together; at most {PAIR_CHARS} a "
                             "request (send fewer documents, or a shorter query, a request)",
                             param="documents" if isinstance(body, RerankRequest) else "text_2")
    version, facts = await pooling_model(lease, state, body.model, "score")
    entry = pooled_entry(state, lease, body.model, version, "score", texts=texts, pairs=pairs)
    tokens = sum(estimate.prompt_tokens({"prompt": texts[q]}) + estimate.prompt_tokens({"prompt": texts[d]})
                 for q, d in pairs)
    encoded, usage, headers = await run_pooled(request, lease, state, entry, facts.schema, len(pairs),
                                               reserving(request, state, lease, tokens))
    if encoded is None:
        return None, usage, headers
    return [struct.unpack("<f", base64.b64decode(s))[0] for s in encoded], usage, headers
