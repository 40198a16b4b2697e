"""Bounded strings and mappings: a length beside every field (so OpenAPI shows it), and no lone
UTF-16 surrogate: JSON's "\\ud800" decodes to a str that UTF-8 cannot encode, which would fail
later, at storage, as a 500 instead of a 422 now."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints


def encodable(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("must not contain lone UTF-16 surrogates") from None
    return text


def bounded(max_length: int, min_length: int = 1) -> Any:
    """A str of [min_length, max_length] characters that can be stored."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length),
                     AfterValidator(encodable)]


def mapping(key: Any, value: Any, max_entries: int) -> Any:
    """A dict of at most `max_entries`, counted before its entries are: pydantic checks a dict's
    max_length only after validating every entry, one error each (which FastAPI copies again), so
    a 1 MiB mapping of bad entries held the event loop for ~0.3 s. (A request's lists say
    `fail_fast` for the same reason: 300,000 bad token ids took 3.3 s.)"""
    def counted(entries):
        if isinstance(entries, dict) and len(entries) > max_entries:
            raise ValueError(f"at most {max_entries} entries are allowed, not {len(entries)}")
        return entries
    return Annotated[dict[key, value], Field(max_length=max_entries), BeforeValidator(counted)]
