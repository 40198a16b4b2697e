"""The /admin API: API keys (create, list, show, update, revoke, rotate) and usage. Admin keys only."""
from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query

from gateway.admin_schemas import (ErrorBody, KeyCreate, KeyList, KeyRotate, KeySecret, KeyUpdate,
                                   UsageReport, UsageRow)
from gateway.auth import require_admin
from gateway.deps import KeyStoreDep, UsageDep
from gateway.durations import parse_duration
from gateway.keys import BOOTSTRAP_IDS, KeyRecord
from gateway.strict_json import ParsedJSONRoute
from shared.errors import Conflict, InvalidRequest

KeyRef = Annotated[str, Path(max_length=64, description="A key's name or id")]
NOT_NULL = ("name", "role", "models", "best_priority", "weight", "cache_scope", "version_override",
            "metadata")

ERRORS = {status: {"model": ErrorBody, "description": what} for status, what in (
    (401, "No key, or an unknown, revoked or expired one"), (403, "Not an admin key"),
    (404, "No such key"), (409, "The name is taken, or the key is revoked"))}
router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"],
                   responses=ERRORS, route_class=ParsedJSONRoute)


@router.post("/keys", status_code=201, response_model=KeySecret)
async def create_key(body: KeyCreate, store: KeyStoreDep) -> KeySecret:
    """A new key; its secret is in this response and nowhere else, ever."""
    fields = body.model_dump(exclude={"expires_in"})
    expires = time.time() + body.expires_in if body.expires_in else None
    record, secret = await store.create(store.new_record(expires=expires, **fields))
    return KeySecret(key=record, secret=secret)


@router.get("/keys", response_model=KeyList)
async def list_keys(store: KeyStoreDep) -> KeyList:
    return KeyList(data=await store.list())


@router.get("/keys/{key}", response_model=KeyRecord)
async def show_key(key: KeyRef, store: KeyStoreDep) -> KeyRecord:
    """`key` is a key's name or id."""
    return await store.get(key)


@router.patch("/keys/{key}", response_model=KeyRecord)
async def update_key(key: KeyRef, body: KeyUpdate, store: KeyStoreDep) -> KeyRecord:
    """Only the fields sent change, applied to the record as it is when written: a PATCH that
    races a revoke leaves the key revoked."""
    changes = body.model_dump(exclude_unset=True)
    if "expires_in" in changes:
        seconds = changes.pop("expires_in")
        changes["expires"] = time.time() + seconds if seconds else None
    for field in NOT_NULL:
        if field in changes and changes[field] is None:
            raise InvalidRequest(f"{field} cannot be null", param=field)
    return await store.update(await store.resolve(key), lambda old: old.model_copy(update=changes))


@router.post("/keys/{key}/revoke", response_model=KeyRecord)
async def revoke_key(key: KeyRef, store: KeyStoreDep) -> KeyRecord:
    """Refused by every gateway from the next request on; the record stays, marked revoked."""
    return await store.revoke(await store.resolve(key))


@router.post("/keys/{key}/rotate", response_model=KeySecret)
async def rotate_key(key: KeyRef, store: KeyStoreDep, body: KeyRotate | None = None) -> KeySecret:
    """A new secret; the old one keeps working for `grace_s` seconds (default an hour; 0: dead now).
    A revoked key gets none (409): its new secret would be refused like the old."""
    key_id = await store.resolve(key)
    if (await store.get(key_id)).status == "revoked":
        raise Conflict(f"Key '{key}' is revoked: a new secret for it would be refused too; create a new "
                       "key instead", param="key", code="key_revoked")
    record, secret = await store.rotate(key_id, (body or KeyRotate()).grace_s)
    return KeySecret(key=record, secret=secret)


@router.get("/usage", response_model=UsageReport)
async def usage(store: KeyStoreDep, book: UsageDep,
                key: str | None = Query(None, max_length=64, description="A key's name or id"),
                since: str = Query("7d", max_length=32, description="How far back: 12h, 7d, 4w ... "
                                   "(at most the usage retention, KVGATE_USAGE_RETENTION_DAYS)"),
                by: Literal["model", "day", "key"] = "model") -> UsageReport:
    """Requests, prompt and completion tokens and errors, per model+version, UTC day or key."""
    try:
        seconds = parse_duration(since)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="since") from exc
    start = book.window_start(time.time() - seconds)  # nothing older is kept: no longer report
    key_id = key if key in BOOTSTRAP_IDS or not key else (await store.get(key)).id
    rows = await book.query(start, key_id, by)
    names = {r.id: r.name for r in await store.list()} if by == "key" else {}
    return UsageReport(since=start, by=by, key=key, rows=[
        UsageRow(**row, key_name=names.get(row.get("key_id"), row.get("key_id"))) if by == "key"
        else UsageRow(**row) for row in rows])
