"""Request and response bodies of /admin/canary."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.bounded import bounded, mapping
from gateway.keys import Cohort
from shared.canary import MAX_COHORTS, MAX_INTERVAL_S, MAX_STEPS, Event, Route, Thresholds
from shared.canary_stats import VersionStats

Version = bounded(128)
Reason = bounded(500, min_length=0)
Cohorts = mapping(Cohort, Version, MAX_COHORTS)


class CanarySet(BaseModel):
    """Put a version on trial under an alias (replacing any canary there)."""

    model_config = ConfigDict(extra="forbid")

    version: Version = Field(description="The canary version (it may have no worker yet)")
    stable: Version | None = Field(None, description="Default: the route's stable, else the one "
                                   "other version of the alias")
    weight: float | None = Field(None, ge=0, le=100, description="Percent of keys to the canary; "
                                 "default: the first step, else 0 (cohorts only)")
    steps: list[Annotated[float, Field(gt=0, le=100)]] = Field(
        default_factory=list, max_length=MAX_STEPS, fail_fast=True, description="Ascending weights in (0, 100]")
    interval_s: int | None = Field(None, ge=1, le=MAX_INTERVAL_S,
                                   description="Seconds between steps (needed with steps)")
    cohorts: Cohorts = Field(default_factory=dict, description="Cohort -> version pins")
    thresholds: Thresholds = Field(default_factory=Thresholds)

    @field_validator("steps")
    @classmethod
    def _ascending(cls, steps: list[float]) -> list[float]:
        if any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
            raise ValueError("steps must be distinct, ascending, each in (0, 100]")
        return steps

    @model_validator(mode="after")
    def _interval(self) -> "CanarySet":
        if self.steps and self.interval_s is None:
            raise ValueError("interval_s is needed with steps")
        return self


class CanaryRollback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Reason = "rolled back by an admin"


class VersionObserved(VersionStats):
    role: str = Field(description="stable or canary")
    configured_share: float = Field(description="Percent of keys the route sends here")
    observed_share: float | None = Field(None, description="Percent of the window's requests "
                                         "served here")
    live_workers: int
    breaker: str = Field("closed", description="Its circuit breaker: closed, open (refused, or "
                         "a canary's requests sent to stable) or half_open (one probe trying it)")


class CanaryStatus(BaseModel):
    route: Route
    versions: dict[str, VersionObserved]
    counters: dict[str, int] = Field(description="rollbacks, manual_rollbacks, promotions, "
                                     "failovers, rescued")
    events: list[Event] = Field(description="The last events, newest first")


class RouteList(BaseModel):
    data: list[Route]
