"""Request and response bodies of the /admin API."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.keys import (MAX_LIMIT, MAX_METADATA, MAX_MODELS, MAX_WEIGHT, MIN_WEIGHT, PRIORITY_BOUND,
                          CacheScope, Cohort, KeyLimits, KeyRecord, Metadata, ModelName, Owner, Role)
from shared.settings import MAX_TIMEOUT_S

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"
NAME_DOC = "Unique; up to 64 letters, digits and _ . @ -"
MAX_EXPIRES_IN = 10 * 365 * 86400  # ten years: further is "never" (null)
MAX_GRACE_S = 30 * 86400


class KeyCreate(KeyLimits):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description=NAME_DOC)
    owner: Owner | None = Field(None, description="Who the key belongs to: its tenant (keys with "
                                "the same owner share prefix-cache hits)")
    role: Role = "user"
    expires_in: int | None = Field(None, ge=1, le=MAX_EXPIRES_IN,
                                   description="Seconds from now until the key expires")
    metadata: Metadata = Field(default_factory=dict)


class KeyUpdate(BaseModel):
    """Only the fields sent change; send null to clear a limit (back to default or none)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=NAME_PATTERN, description=NAME_DOC)
    owner: Owner | None = None
    role: Role | None = None
    expires_in: int | None = Field(None, ge=1, le=MAX_EXPIRES_IN,
                                   description="Seconds from now; null: never expires")
    models: list[ModelName] | None = Field(None, max_length=MAX_MODELS, fail_fast=True)
    rpm: int | None = Field(None, ge=1, le=MAX_LIMIT)
    tpm: int | None = Field(None, ge=1, le=MAX_LIMIT)
    max_concurrent: int | None = Field(None, ge=1, le=MAX_LIMIT)
    daily_tokens: int | None = Field(None, ge=1, le=MAX_LIMIT)
    best_priority: int | None = Field(None, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    weight: float | None = Field(None, ge=MIN_WEIGHT, le=MAX_WEIGHT)
    cache_scope: CacheScope | None = None
    canary_cohort: Cohort | None = None
    version_override: bool | None = None
    metadata: Metadata | None = None
    # stored-data quotas; null: back to the gateway's default
    max_stored_bytes: int | None = Field(None, ge=0, le=1 << 50)
    max_files: int | None = Field(None, ge=0, le=100_000)
    max_batches_in_progress: int | None = Field(None, ge=0, le=10_000)
    # time limits; null: back to the route's or the gateway's default
    ttft_timeout_s: float | None = Field(None, ge=0, le=MAX_TIMEOUT_S)
    request_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_s: int = Field(3600, ge=0, le=MAX_GRACE_S,
                         description="Seconds the old secret keeps working")


class KeyList(BaseModel):
    data: list[KeyRecord]


class KeySecret(BaseModel):
    """A key and its secret: the only time the secret is shown."""

    key: KeyRecord
    secret: str = Field(description="The bearer secret; store it now, it cannot be shown again")


class UsageRow(BaseModel):
    model: str | None = None
    version: str | None = None
    day: str | None = Field(None, description="UTC day, YYYYMMDD")
    key_id: str | None = None
    key_name: str | None = None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    errors: int = Field(description="Requests that ended without a usage (error, timeout, client left)")


class UsageReport(BaseModel):
    since: float = Field(description="Unix time; counting starts at the UTC day that holds it")
    by: Literal["model", "day", "key"]
    key: str | None = None
    rows: list[UsageRow]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, which every error of the gateway has."""

    error: ErrorDetail
