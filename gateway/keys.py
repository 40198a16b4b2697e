"""An API key: its record (what it may do) and its secret (shown once, kept only as an HMAC)."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

from gateway.bounded import bounded, mapping
from shared.errors import PermissionDenied
from shared.settings import MAX_TIMEOUT_S

SECRET_PREFIX = "sk-kvg-"
Role = Literal["user", "admin"]
Status = Literal["active", "revoked"]
CacheScope = Literal["tenant", "key", "shared"]
# the keys that come from settings, not from Redis: (settings field, key id, role)
BOOTSTRAP = (("admin_key", "admin", "admin"), ("api_key", "dev", "user"))
BOOTSTRAP_IDS = tuple(key_id for _, key_id, _ in BOOTSTRAP)
# Lua hands numbers back to Redis printed with 14 significant digits: limits stay below that, exact
MAX_LIMIT = 10**12
PRIORITY_BOUND = 100  # request priorities lie in [-100, 100]; lower is served first
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0  # a key's share under the workers' fair order (worker/fairness.py)
MAX_MODELS = 256
MAX_METADATA = 16
ModelName = bounded(256)
Cohort = bounded(64)
Owner = bounded(128)
Metadata = mapping(bounded(64), bounded(512, min_length=0), MAX_METADATA)  # OpenAI's metadata bounds


class KeyLimits(BaseModel):
    """What a key may do; None means the gateway default (rpm, tpm) or no limit (the rest)."""

    models: list[ModelName] = Field(default_factory=list, max_length=MAX_MODELS, fail_fast=True,
                                    description="Served names allowed; empty: all")
    rpm: int | None = Field(None, ge=1, le=MAX_LIMIT,
                            description="Requests per minute (default: the gateway's)")
    tpm: int | None = Field(None, ge=1, le=MAX_LIMIT,
                            description="Tokens per minute (default: the gateway's)")
    max_concurrent: int | None = Field(None, ge=1, le=MAX_LIMIT, description="Requests in flight at once")
    daily_tokens: int | None = Field(None, ge=1, le=MAX_LIMIT, description="Tokens per UTC day")
    best_priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND,
                               description="The best (lowest) request priority the key may ask "
                               "for; lower is served first. Default 0: a key may only lower its "
                               "own priority. Admin keys may ask any")
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="The key's share of a "
                          "busy worker against other keys: workers serve the key whose tokens "
                          "(prompt + output) divided by its weight are fewest first, so weight 2 gets "
                          "twice the tokens of weight 1 while both wait")
    cache_scope: CacheScope = Field("tenant", description="Whose prefix-cache hits this key's "
                                    "requests share: tenant (keys with the same owner; a key "
                                    "without one is its own tenant), key (only its own), shared "
                                    "(every key that is shared too)")
    canary_cohort: Cohort | None = Field(None, description="Canary cohort this key's traffic joins")
    version_override: bool = Field(False, description="May force a version with the "
                                   "x-kvgate-version request header")
    # stored-data quotas (shared/quota.py); None: the gateway's KVGATE_MAX_*_PER_KEY default
    max_stored_bytes: int | None = Field(None, ge=0, le=1 << 50, description="Bytes of files "
                                         "(uploads and batch results) the key may keep")
    max_files: int | None = Field(None, ge=0, le=100_000, description="Files the key may keep")
    max_batches_in_progress: int | None = Field(None, ge=0, le=10_000, description="Batches of "
                                                "the key not yet in a final status")
    # time limits (gateway/timeouts.py); None: the route's, else the gateway's default
    ttft_timeout_s: float | None = Field(None, ge=0, le=MAX_TIMEOUT_S, description="Seconds an "
                                         "interactive request may wait for its first token "
                                         "(0: no limit but the total)")
    request_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description="Seconds a "
                                            "request may take in total")


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

    @model_validator(mode="before")
    @classmethod
    def _from_cache_isolation(cls, data: Any) -> Any:
        """A record stored before cache_scope: isolation on reads as "key", off as the new default."""
        if isinstance(data, dict) and "cache_isolation" in data:
            data = dict(data)
            isolated = data.pop("cache_isolation")
            data.setdefault("cache_scope", "key" if isolated else "tenant")
        return data

    def refusal(self, now: float | None = None) -> str | None:
        """Why this key may not be used now, or None."""
        if self.status == "revoked":
            return "This API key has been revoked"
        if self.expires is not None and (now or time.time()) >= self.expires:
            return "This API key has expired"
        return None

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def check_priority(self, requested: int) -> None:
        """403 when a request asks to be served sooner than this key may be (a silent clamp would
        hide it); admin keys may ask any priority."""
        if self.role == "admin" or requested >= self.best_priority:
            return
        raise PermissionDenied(
            f"This key may ask for priority {self.best_priority} or higher (lower is served "
            f"first); the request asked for {requested}", param="priority",
            code="priority_not_allowed")

    def cache_salt(self) -> str | None:
        """The engine's prefix-cache salt: only requests with the same salt share cached blocks.
        Hashed, so no owner name travels with requests; None shares with every unsalted request."""
        if self.cache_scope == "shared":
            return None
        tenant = f"key\x00{self.id}" if self.cache_scope == "key" or self.owner is None \
            else f"owner\x00{self.owner}"
        return hashlib.sha256(tenant.encode()).hexdigest()[:32]


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def digest(server_secret: str, key_secret: str) -> str:
    """The only form a secret is stored in: HMAC-SHA256 keyed with the server secret."""
    return hmac.new(server_secret.encode(), key_secret.encode(), hashlib.sha256).hexdigest()


def bootstrap_record(key_id: str, role: Role) -> KeyRecord:
    """The record of a key that comes from settings (dev or admin key): gateway defaults, and its
    own tenant (no owner)."""
    return KeyRecord(id=key_id, name=key_id, role=role, created=0.0)


def bootstrap_keys(settings) -> list[tuple[SecretStr | None, KeyRecord]]:
    """Each key that comes from settings: its secret (None when unset) and its record."""
    return [(getattr(settings, field), bootstrap_record(key_id, role))
            for field, key_id, role in BOOTSTRAP]
