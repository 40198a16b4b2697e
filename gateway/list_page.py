"""OpenAI's cursor page, as /v1/files and /v1/batches list their objects."""
from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel

Item = TypeVar("Item", bound=BaseModel)  # a public object with an `id`


class ListPage(BaseModel, Generic[Item]):
    """Subclass it per item (`class FileList(ListPage[FileObject])`) so the OpenAPI schema keeps a
    plain name."""
    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def of(cls, data: list[Item], has_more: bool):
        return cls(data=data, first_id=data[0].id if data else None,
                   last_id=data[-1].id if data else None, has_more=has_more)
