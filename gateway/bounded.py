"""Bounded strings for admin bodies: a length beside every field (so OpenAPI shows it), and no lone
UTF-16 surrogate: JSON's "\\ud800" decodes to a str that UTF-8 cannot encode, which would fail
later, at storage, as a 500 instead of a 422 now."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, StringConstraints


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
