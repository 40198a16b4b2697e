"""An API key: its record (what it may do) and its secret (shown once, kept only as an HMAC)."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Literal

from pydantic import BaseModel, Field

SECRET_PREFIX = "sk-kvg-"
Role = Literal["user", "admin"]
Status = Literal["active", "revoked"]
BOOTSTRAP_IDS = ("dev", "admin")  # ids of the keys that come from settings, not from Redis


class KeyLimits(BaseModel):
    """What a key may do; None means the gateway default (rpm, tpm) or no limit (the rest)."""

    models: list[str] = Field(default_factory=list, description="Served names allowed; empty: all")
    rpm: int | None = Field(None, ge=1, description="Requests per minute (default: the gateway's)")
    tpm: int | None = Field(None, ge=1, description="Tokens per minute (default: the gateway's)")
    max_concurrent: int | None = Field(None, ge=1, description="Requests in flight at once")
    daily_tokens: int | None = Field(None, ge=1, description="Tokens per UTC day")
    cache_isolation: bool = Field(False, description="Prefix-cache hits only within this key")
    canary_cohort: str | None = Field(None, description="Canary cohort this key's traffic joins")
    version_override: bool = Field(False, description="May force a version with the "
                                   "x-kvgate-version request header")
    # stored-data quotas (shared/quota.py); None: the gateway's KVGATE_MAX_*_PER_KEY default
    max_stored_bytes: int | None = Field(None, ge=0, le=1 << 50, description="Bytes of files "
                                         "(uploads and batch results) the key may keep")
    max_files: int | None = Field(None, ge=0, le=100_000, description="Files the key may keep")
    max_batches_in_progress: int | None = Field(None, ge=0, le=10_000, description="Batches of "
                                                "the key not yet in a final status")


class KeyRecord(KeyLimits):
    """A key as stored and shown. It never holds the secret, nor its digest."""

    id: str
    name: str
    owner: str | None = None
    role: Role = "user"
    status: Status = "active"
    created: float = Field(description="Unix time")
    expires: float | None = Field(None, description="Unix time; None: never")
    revoked: float | None = Field(None, description="Unix time of revocation")
    rotated: float | None = Field(None, description="Unix time of the last rotation")
    metadata: dict[str, str] = Field(default_factory=dict)

    def refusal(self, now: float | None = None) -> str | None:
        """Why this key may not be used now, or None."""
        if self.status == "revoked":
            return "This API key has been revoked"
        if self.expires is not None and (now or time.time()) >= self.expires:
            return "This API key has expired"
        return None

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def digest(server_secret: str, key_secret: str) -> str:
    """The only form a secret is stored in: HMAC-SHA256 keyed with the server secret."""
    return hmac.new(server_secret.encode(), key_secret.encode(), hashlib.sha256).hexdigest()


def bootstrap_record(key_id: str, role: Role) -> KeyRecord:
    """The record of a key that comes from settings (dev or admin key): gateway defaults."""
    return KeyRecord(id=key_id, name=key_id, role=role, created=0.0)
