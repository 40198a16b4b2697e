"""The gateway's state as typed dependencies (the FastAPI project template's `deps.py`): a handler
names what it needs, `store: KeyStoreDep`, and never reaches into `app.state`. None of these adds
a parameter to the OpenAPI document: each reads only the request."""
from __future__ import annotations

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


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway  # the one name on app.state (set by gateway/app.py)


StateDep = Annotated[GatewayState, Depends(gateway_state)]


def _settings(state: StateDep) -> GatewaySettings:
    return state.settings


def _router(state: StateDep) -> Router:
    return state.router


def _keystore(state: StateDep) -> KeyStore:
    return state.keystore


def _limits(state: StateDep) -> Limits:
    return state.limits


def _usage(state: StateDep) -> UsageBook:
    return state.usage


def _files(state: StateDep) -> FileStore:
    return state.files


def _batches(state: StateDep) -> BatchStore:
    return state.batches


SettingsDep = Annotated[GatewaySettings, Depends(_settings)]
RouterDep = Annotated[Router, Depends(_router)]
KeyStoreDep = Annotated[KeyStore, Depends(_keystore)]
LimitsDep = Annotated[Limits, Depends(_limits)]
UsageDep = Annotated[UsageBook, Depends(_usage)]
FilesDep = Annotated[FileStore, Depends(_files)]
BatchesDep = Annotated[BatchStore, Depends(_batches)]
