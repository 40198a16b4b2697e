"""/v1/batches: create, retrieve, list, cancel, with OpenAI's batch object. The gateway records a
batch and queues it; the Celery runner (services/batch.py) does the work and moves its status.
A batch belongs to the key that made it; to any other key it does not exist (404). A key has at
most its quota of batches in progress (429). Every call counts against the key's requests per
minute, except polling one batch (`retrieve`)."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.admin_schemas import ErrorBody
from gateway.deps import BatchesDep, StateDep
from gateway.files_api import Account, Metered, quota_limits
from gateway.list_page import ListPage
from gateway.strict_json import ParsedJSONRoute
from shared.batches import BatchObject, Endpoint
from shared.errors import Conflict, InvalidRequest

ERRORS = {status: {"model": ErrorBody, "description": what} for status, what in (
    (400, "The input file is not a batch file"), (401, "No or a bad key"),
    (403, "A batch line's token"), (404, "No such batch or input file for this key"),
    (409, "The batch can no longer be cancelled"),
    (429, "Requests per minute, or the quota of batches in progress, exceeded"))}
router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=ERRORS,
                   route_class=ParsedJSONRoute)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer clients send fields we do not use

    input_file_id: str = Field(max_length=128, description="A file uploaded with purpose 'batch'")
    endpoint: Endpoint = Field(description="Where every line of the file goes")
    completion_window: Literal["24h"] = Field(description="Lines not done by then expire")
    metadata: dict[str, str] | None = Field(None, max_length=16,
                                            description="Up to 16 pairs; keys ≤ 64 characters, "
                                            "values ≤ 512")

    @field_validator("metadata")
    @classmethod
    def _sizes(cls, v):
        for key, value in (v or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return v


class BatchList(ListPage[BatchObject]):
    pass


@router.post("", response_model=BatchObject)
async def create(body: BatchCreate, key: Metered, state: StateDep) -> BatchObject:
    """A batch of the file's requests, each governed as this key's (models, limits, budgets)."""
    file = await state.files.get(key.id, body.input_file_id, param="input_file_id")
    if file.purpose != "batch":
        raise InvalidRequest(f"File {file.id} was not uploaded with purpose 'batch'",
                             param="input_file_id")
    batch = await state.batches.create(key.id, body.endpoint, file.id, body.completion_window,
                                       body.metadata, quota_limits(state.settings, key))
    await state.batch_queue.submit(batch.id)
    return batch.public()


@router.get("", response_model=BatchList)
async def list_batches(key: Metered, store: BatchesDep,
                       after: str | None = Query(None, description="A batch id: the page after it"),
                       limit: int = Query(20, ge=1, le=100)) -> BatchList:
    """This key's batches, newest first."""
    batches, more = await store.list(key.id, after, limit)
    return BatchList.of([b.public() for b in batches], more)


@router.get("/{batch_id}", response_model=BatchObject)
async def retrieve(batch_id: str, key: Account, store: BatchesDep) -> BatchObject:
    """Status and progress (`request_counts`) as the runner goes."""
    # Not counted against requests per minute: clients poll it in a loop while the batch runs, and
    # the batch's own lines count against that same minute, so counting the polls would slow the
    # batch its owner is waiting for. It is one read of one hash, behind the key check.
    return (await store.get(key.id, batch_id)).public()


@router.post("/{batch_id}/cancel", response_model=BatchObject)
async def cancel(batch_id: str, key: Metered, store: BatchesDep) -> BatchObject:
    """Stops sending lines and aborts those in flight; the batch is `cancelling` until the runner
    has written what completed, then `cancelled`."""
    await store.get(key.id, batch_id)
    moved, status = await store.move(batch_id, "cancelling", "validating", "in_progress")
    if not moved and status not in ("cancelling", "cancelled"):
        raise Conflict(f"Cannot cancel a batch that is {status}", param="batch_id",
                       code="batch_not_cancellable")
    return (await store.get(key.id, batch_id)).public()
