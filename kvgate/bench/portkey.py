"""Portkey's open-source AI gateway (npm `@portkey-ai/gateway`, run with Node) as a peer of the
gateway-overhead benchmark: installed once into a folder of its own under bench-out/ (never the
project), started in front of the bare baseline server.

Governance it offers, and what is on: the open-source gateway has no caller keys, rate limits or
budgets (virtual keys, budgets and rate limits are features of Portkey's hosted control plane). Each
request carries its config (`x-portkey-config`: provider, upstream host and key, retries off) with an
input guardrail that is checked in the gateway on every request and denies what fails it:
`default.modelWhitelist` (the served model only). So Portkey's figures include per-request config
parsing and a policy check, but no counting against a shared limit.

One fix is applied to the installed files: @hono/node-server's light Response, made from a stream
and a fetched upstream Response, keeps that response's headers object, which fetch made immutable,
and the gateway then fails every streamed /v1/completions with `TypeError: immutable` (Portkey-AI/
gateway issues 1389 and 1550). The patch copies those headers into a new Headers in that one case
(a stream body and a native Response as init), as the fetch standard's Response constructor does;
everything else (non-streamed responses included) runs as shipped.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

PORTKEY_SPEC = "@portkey-ai/gateway@1.15.2"
_HONO_DIST = Path("node_modules/@hono/node-server/dist")
_HONO_BUG = "body, headers || init?.headers]"
_HONO_FIX = ("body, headers || (typeof body?.getReader !== \"undefined\" && init instanceof GlobalResponse "
             "? new Headers(init.headers) : init?.headers)]")
ENTRY = Path("node_modules/@portkey-ai/gateway/build/start-server.js")


def ensure_portkey(folder: Path) -> tuple[Path | None, str | None]:
    """(folder, None) once the gateway is installed and patched there, else (None, why not)."""
    stamp = folder / ".installed"
    if stamp.exists() and stamp.read_text().strip() == PORTKEY_SPEC:
        return folder, None
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return None, "node and npm are not installed (apt-get install nodejs npm)"
    print(f"installing {PORTKEY_SPEC} into {folder} (once) ...", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "package.json").write_text(json.dumps({"private": True}) + "\n")
    log = folder.with_suffix(".install.log")
    with open(log, "wb") as out:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", PORTKEY_SPEC], cwd=folder,
                              stdout=out, stderr=out)
    if done.returncode != 0 or not (folder / ENTRY).exists():
        return None, f"npm install {PORTKEY_SPEC} failed (exit {done.returncode}; see {log})"
    if not patch_hono(folder):
        return None, f"@hono/node-server in {folder} no longer has the code the streaming fix patches"
    stamp.write_text(PORTKEY_SPEC + "\n")
    return folder, None


def patch_hono(folder: Path) -> bool:
    """The immutable-headers fix in every bundle of @hono/node-server; False if none had the bug
    and none has the fix (a new version: check streaming by hand and update this)."""
    patched = False
    for path in (folder / _HONO_DIST).glob("*.*js"):
        text = path.read_text()
        if _HONO_BUG in text:
            path.write_text(text.replace(_HONO_BUG, _HONO_FIX))
        patched = patched or _HONO_FIX in path.read_text()
    return patched


def command(folder: Path, port: int) -> list[str]:
    return [shutil.which("node") or "node", str(folder / ENTRY), f"--port={port}", "--headless"]


def config_header(upstream_url: str, upstream_key: str, served_name: str) -> dict[str, str]:
    """The per-request config: the baseline as an OpenAI-compatible host, no retries, and the
    model allow-list guardrail, denying on failure."""
    config = {"provider": "openai", "custom_host": upstream_url.rstrip("/") + "/v1", "api_key": upstream_key,
              "retry": {"attempts": 0},
              "input_guardrails": [{"default.modelWhitelist": {"models": [served_name]}, "deny": True}]}
    return {"x-portkey-config": json.dumps(config, separators=(",", ":"))}
