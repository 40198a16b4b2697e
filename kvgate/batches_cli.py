"""`kvgate batches list|show|cancel`: a client of the gateway's /v1/batches. A batch belongs to the
key that made it, so these take that key: --api-key, else KVGATE_API_KEY, else the dev key that
`kvgate up` wrote to .kvgate/dev.key."""
from __future__ import annotations

import time

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvgate.admin_cli import _print_json, _when, console
from kvgate.cli_client import GatewayClient, KeySource, with_gateway

FINAL = ("completed", "failed", "expired", "cancelled")


API_KEY = KeySource("API key", "--api-key", "KVGATE_API_KEY", "dev.key",
                    purpose="The key that owns the batches")
with_api = with_gateway(API_KEY)


@click.group()
def batches() -> None:
    """Batch jobs (/v1/batches) of one API key."""


@batches.command("list")
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True)
@with_api
def list_(client: GatewayClient, as_json: bool, limit: int) -> None:
    """The key's batches, newest first."""
    data = client.call("GET", "/v1/batches", params={"limit": limit})["data"]
    if as_json:
        return _print_json(data)
    table = Table("id", "status", "endpoint", "model", "completed", "failed", "total", "created")
    for b in data:
        counts = b["request_counts"]
        table.add_row(b["id"], b["status"], b["endpoint"], b["model"] or "", str(counts["completed"]),
                      str(counts["failed"]), str(counts["total"]), _when(b["created_at"]))
    console.print(table)


@batches.command("show")
@click.argument("batch_id")
@click.option("--follow", is_flag=True, help="A progress bar until the batch has ended")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between polls with --follow")
@with_api
def show(client: GatewayClient, as_json: bool, batch_id: str, follow: bool, interval: float) -> None:
    """One batch: status, progress, result files."""
    batch = client.call("GET", f"/v1/batches/{batch_id}")
    if follow and not as_json:
        batch = _follow(client, batch, interval)
    elif follow:
        while batch["status"] not in FINAL:
            time.sleep(interval)
            batch = client.call("GET", f"/v1/batches/{batch_id}")
    _print_batch(batch, as_json)


def _follow(client: GatewayClient, batch: dict, interval: float) -> dict:
    """Polls until the batch ends, with a bar of lines done (completed + failed) of the total."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(batch["id"], total=None, failed=0)
        while True:
            counts = batch["request_counts"]
            progress.update(bar, description=f"{batch['id']} {batch['status']}",
                            total=counts["total"] or None,
                            completed=counts["completed"] + counts["failed"], failed=counts["failed"])
            if batch["status"] in FINAL:
                return batch
            time.sleep(interval)
            batch = client.call("GET", f"/v1/batches/{batch['id']}")


@batches.command("cancel")
@click.argument("batch_id")
@with_api
def cancel(client: GatewayClient, as_json: bool, batch_id: str) -> None:
    """Stop a batch: no more lines are sent, those in flight are aborted; what completed is kept."""
    _print_batch(client.call("POST", f"/v1/batches/{batch_id}/cancel"), as_json)


def _print_batch(batch: dict, as_json: bool) -> None:
    if as_json:
        return _print_json(batch)
    counts = batch["request_counts"]
    rows = [("id", batch["id"]), ("status", batch["status"]), ("endpoint", batch["endpoint"]),
            ("model", batch["model"] or ""), ("input file", batch["input_file_id"]),
            ("requests", f"{counts['completed']} completed, {counts['failed']} failed, "
                         f"{counts['total']} in all"),
            ("output file", batch["output_file_id"] or ""), ("error file", batch["error_file_id"] or ""),
            ("tokens", f"{batch['usage']['input_tokens']:,} in, {batch['usage']['output_tokens']:,} out")]
    rows += [(name.removesuffix("_at").replace("_", " "), _when(batch[name]))
             for name in ("created_at", "in_progress_at", "finalizing_at", "completed_at",
                          "cancelling_at", "cancelled_at", "failed_at", "expired_at", "expires_at")
             if batch.get(name)]
    rows += [(f"metadata {k}", v) for k, v in (batch.get("metadata") or {}).items()]
    rows += [("error", f"{e['code']}: {e['message']}") for e in (batch.get("errors") or {}).get("data", [])]
    table = Table("field", "value", show_header=False)
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
