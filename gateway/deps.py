"""The gateway's state as typed dependencies (the FastAPI project template's `deps.py`): a handler
names what it needs, `store: KeyStoreDep`, and never reaches into `app.state`. None of these adds
a parameter to the OpenAPI document: each reads only the request. The dependencies every /v1 call
solves (gateway/auth.py `authenticate`, gateway/admission.py `admit`) call `state_of` instead of
naming `StateDep`: FastAPI walks a dependency's own dependencies again wherever it is named, even
when its value is cached, and `admit` is named twice on a generation route."""
from __future__ import annotations

from dataclasses import fields
from typing import Annotated

from fastapi import Depends, Request

from gateway.keystore import KeyStore
from gateway.limits import Limits
from gateway.routing import Router
from gateway.state import GatewayState
from shared.batches import BatchStore
from shared.files import FileStore
from shared.settings import GatewaySettings
from shared.usage import UsageBook


def state_of(request: Request) -> GatewayState:
    return request.app.state.gateway  # the one name on app.state (set by gateway/app.py)


async def gateway_state(request: Request) -> GatewayState:
    return state_of(request)


StateDep = Annotated[GatewayState, Depends(gateway_state)]


def _part(name: str):
    """A dependency that hands over one part of the state, by its field name (checked here, at
    import, so a misspelt one fails at start-up rather than on its first request)."""
    if name not in {f.name for f in fields(GatewayState)}:
        raise AttributeError(f"GatewayState has no field {name!r}")

    async def part(state: StateDep):
        return getattr(state, name)
    return Depends(part)


SettingsDep = Annotated[GatewaySettings, _part("settings")]
RouterDep = Annotated[Router, _part("router")]
KeyStoreDep = Annotated[KeyStore, _part("keystore")]
LimitsDep = Annotated[Limits, _part("limits")]
UsageDep = Annotated[UsageBook, _part("usage")]
FilesDep = Annotated[FileStore, _part("files")]
BatchesDep = Annotated[BatchStore, _part("batches")]
