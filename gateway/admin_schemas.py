"""Request and response bodies of the /admin API."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.keys import KeyLimits, KeyRecord, Role

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"
NAME_DOC = "Unique; up to 64 letters, digits and _ . @ -"


class KeyCreate(KeyLimits):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description=NAME_DOC)
    owner: str | None = None
    role: Role = "user"
    expires_in: int | None = Field(None, ge=1, description="Seconds from now until the key expires")
    metadata: dict[str, str] = Field(default_factory=dict)


class KeyUpdate(BaseModel):
    """Only the fields sent change; send null to clear a limit (back to default or none)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=NAME_PATTERN, description=NAME_DOC)
    owner: str | None = None
    role: Role | None = None
    expires_in: int | None = Field(None, ge=1, description="Seconds from now; null: never expires")
    models: list[str] | None = None
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    daily_tokens: int | None = Field(None, ge=1)
    cache_isolation: bool | None = None
    canary_cohort: str | None = None
    version_override: bool | None = None
    metadata: dict[str, str] | None = None
    # stored-data quotas; null: back to the gateway's default
    max_stored_bytes: int | None = Field(None, ge=0, le=1 << 50)
    max_files: int | None = Field(None, ge=0, le=100_000)
    max_batches_in_progress: int | None = Field(None, ge=0, le=10_000)


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_s: int = Field(3600, ge=0, le=30 * 86400,
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
