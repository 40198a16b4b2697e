"""`kvgate keys ...` and `kvgate usage`: a client of the gateway's /admin API, so it works against a
remote deployment as well as the one `kvgate up` started (whose URL and admin key are in .kvgate/)."""
from __future__ import annotations

import json
import sys
from datetime import datetime, timezone

import click
from rich.console import Console
from rich.table import Table

from kvgate.cli_client import GatewayClient, KeySource, with_gateway

console = Console(width=None if sys.stdout.isatty() else 160)  # piped output: no squeezed tables
CLEARABLE = ("owner", "models", "rpm", "tpm", "max-concurrent", "daily-tokens", "expires",
             "canary-cohort", "max-stored-bytes", "max-files", "max-batches-in-progress",
             "ttft-timeout", "request-timeout")
CLEARED_FIELD = {"expires": "expires_in", "ttft-timeout": "ttft_timeout_s",
                 "request-timeout": "request_timeout_s"}  # where the API's name is not the option's
ADMIN_KEY = KeySource("admin key", "--admin-key", "KVGATE_ADMIN_KEY", "admin.key",
                      forbidden="the key given is not an admin key")
with_client = with_gateway(ADMIN_KEY)


def limit_options(func):
    """The options `create` and `update` share."""
    for decorator in reversed((
        click.option("--owner", help="Who the key belongs to"),
        click.option("--models", help="Comma-separated served names the key may use (default all)"),
        click.option("--rpm", type=click.IntRange(min=1), help="Requests per minute"),
        click.option("--tpm", type=click.IntRange(min=1), help="Tokens per minute"),
        click.option("--max-concurrent", type=click.IntRange(min=1), help="Requests in flight at once"),
        click.option("--daily-tokens", type=click.IntRange(min=1), help="Tokens per UTC day"),
        click.option("--expires", help="Lifetime from now: 12h, 30d, 2w ..."),
        click.option("--role", type=click.Choice(["user", "admin"])),
        click.option("--best-priority", type=click.IntRange(-100, 100),
                     help="Best (lowest) request priority the key may ask for; lower is served "
                     "first (default 0: it may only lower its own)"),
        click.option("--weight", type=click.FloatRange(0.01, 100),
                     help="The key's share of a busy worker against other keys (default 1; 2: "
                     "twice the tokens of a weight-1 key while both wait)"),
        click.option("--cache-scope", type=click.Choice(["tenant", "key", "shared"]),
                     help="Whose prefix-cache hits the key shares: tenant (same owner; the "
                     "default), key (only its own), shared (every shared key)"),
        click.option("--canary-cohort", help="Canary cohort this key's traffic joins"),
        click.option("--version-override/--no-version-override", default=None,
                     help="May force a version with the x-kvgate-version header"),
        click.option("--meta", multiple=True, metavar="K=V", help="Metadata (repeatable)"),
        click.option("--max-stored-bytes", type=click.IntRange(min=0),
                     help="Bytes of files the key may keep (default: KVGATE_MAX_STORED_BYTES_PER_KEY)"),
        click.option("--max-files", type=click.IntRange(min=0),
                     help="Files the key may keep (default: KVGATE_MAX_FILES_PER_KEY)"),
        click.option("--max-batches-in-progress", type=click.IntRange(min=0),
                     help="Batches not yet final (default: KVGATE_MAX_BATCHES_IN_PROGRESS_PER_KEY)"),
        click.option("--ttft-timeout", "ttft_timeout_s", type=click.FloatRange(min=0),
                     help="Seconds a request may wait for its first token (0: no limit but the "
                     "total; default: the route's, else KVGATE_TTFT_TIMEOUT_S)"),
        click.option("--request-timeout", "request_timeout_s", type=click.FloatRange(min=0, min_open=True),
                     help="Seconds a request may take in total (default: the route's, else "
                     "KVGATE_REQUEST_TIMEOUT_S)"),
    )):
        func = decorator(func)
    return func


def _body(opts: dict) -> dict:
    """The API body from CLI options: only the options given."""
    from gateway.durations import parse_duration

    body = {k: v for k, v in opts.items() if v is not None and k not in ("meta", "expires")}
    if "models" in body:
        body["models"] = [m.strip() for m in body["models"].split(",") if m.strip()]
    if opts.get("expires"):
        try:
            body["expires_in"] = parse_duration(opts["expires"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--expires") from None
    if opts.get("meta"):
        pairs = [m.partition("=") for m in opts["meta"]]
        if any(not sep for _, sep, _ in pairs):
            raise click.BadParameter("use K=V", param_hint="--meta")
        body["metadata"] = {k: v for k, _, v in pairs}
    return body


@click.group()
def keys() -> None:
    """Manage API keys through the gateway's admin API."""


@keys.command("create")
@click.option("--name", required=True, help="Unique name")
@limit_options
@with_client
def create(client: GatewayClient, as_json: bool, name: str, **opts) -> None:
    """Create a key; its secret is printed once, on a line of its own."""
    out = client.call("POST", "/admin/keys", json={"name": name, **_body(opts)})
    if as_json:
        return _print_json(out)
    click.echo(f"created key '{out['key']['name']}' ({out['key']['id']}); its secret, shown only now:",
               err=True)
    click.echo(out["secret"])


@keys.command("list")
@with_client
def list_(client: GatewayClient, as_json: bool) -> None:
    """All keys, as a table."""
    data = client.call("GET", "/admin/keys")["data"]
    if as_json:
        return _print_json(data)
    table = Table("name", "id", "role", "status", "models", "rpm", "tpm", "concurrent",
                  "daily tokens", "expires", "created")
    for k in data:
        table.add_row(k["name"], k["id"], k["role"], k["status"], ",".join(k["models"]) or "all",
                      _n(k["rpm"], "default"), _n(k["tpm"], "default"), _n(k["max_concurrent"]),
                      _n(k["daily_tokens"]), _when(k["expires"]) or "never", _when(k["created"]))
    console.print(table)


@keys.command("show")
@click.argument("key")
@with_client
def show(client: GatewayClient, as_json: bool, key: str) -> None:
    """One key (by name or id)."""
    _print_record(client.call("GET", f"/admin/keys/{key}"), as_json)


@keys.command("update")
@click.argument("key")
@click.option("--name", "new_name", help="Rename the key")
@click.option("--clear", multiple=True, type=click.Choice(CLEARABLE),
              help="Remove a limit or field (repeatable)")
@limit_options
@with_client
def update(client: GatewayClient, as_json: bool, key: str, new_name: str | None, clear: tuple, **opts) -> None:
    """Change a key's limits or details; only the options given change."""
    body = _body(opts)
    if new_name:
        body["name"] = new_name
    for field in clear:
        body[CLEARED_FIELD.get(field, field.replace("-", "_"))] = [] if field == "models" else None
    if not body:
        raise click.UsageError("nothing to change: give an option or --clear")
    _print_record(client.call("PATCH", f"/admin/keys/{key}", json=body), as_json)


@keys.command("revoke")
@click.argument("key")
@with_client
def revoke(client: GatewayClient, as_json: bool, key: str) -> None:
    """Revoke a key: every gateway refuses it from the next request on."""
    out = client.call("POST", f"/admin/keys/{key}/revoke")
    if as_json:
        return _print_json(out)
    click.echo(f"revoked key '{out['name']}' ({out['id']})")


@keys.command("rotate")
@click.argument("key")
@click.option("--grace", default="1h", show_default=True, help="How long the old secret still works")
@with_client
def rotate(client: GatewayClient, as_json: bool, key: str, grace: str) -> None:
    """Give a key a new secret (printed once); the old one works for the grace period."""
    from gateway.durations import parse_duration

    try:
        grace_s = parse_duration(grace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--grace") from None
    out = client.call("POST", f"/admin/keys/{key}/rotate", json={"grace_s": grace_s})
    if as_json:
        return _print_json(out)
    click.echo(f"rotated key '{out['key']['name']}'; the old secret works for {grace}. "
               "The new secret, shown only now:", err=True)
    click.echo(out["secret"])


@click.command("usage")
@click.option("--key", help="One key (name or id); default all")
@click.option("--since", default="7d", show_default=True, help="How far back: 12h, 7d, 4w ...")
@click.option("--by", type=click.Choice(["model", "day", "key"]), default="model", show_default=True)
@with_client
def usage(client: GatewayClient, as_json: bool, key: str | None, since: str, by: str) -> None:
    """Requests, tokens and errors per model+version, UTC day or key."""
    params = {"since": since, "by": by, **({"key": key} if key else {})}
    report = client.call("GET", "/admin/usage", params=params)
    if as_json:
        return _print_json(report)
    group = {"model": ("model", "version"), "day": ("day",), "key": ("key_name", "key_id")}[by]
    counters = ("requests", "prompt_tokens", "completion_tokens", "total_tokens", "errors")
    table = Table(*group, *counters, title=f"usage since {_when(report['since'])}"
                  + (f" for key '{key}'" if key else ""))
    for row in report["rows"]:
        table.add_row(*(str(row[g]) for g in group), *(f"{row[c]:,}" for c in counters))
    console.print(table)


def _print_record(record: dict, as_json: bool) -> None:
    if as_json:
        return _print_json(record)
    table = Table("field", "value", show_header=False)
    for field, value in record.items():
        if field in ("created", "expires", "revoked", "rotated"):
            value = _when(value)
        table.add_row(field, "" if value is None else str(value))
    console.print(table)


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2))


def _n(value: int | None, none: str = "-") -> str:
    return none if value is None else f"{value:,}"


def _when(t: float | None) -> str:
    if not t:
        return ""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

