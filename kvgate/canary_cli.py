"""`kvgate canary ...`: canary releases of model versions, through the gateway's /admin/canary API."""
from __future__ import annotations

from datetime import datetime, timezone

import click
from rich.table import Table

from kvgate.admin_cli import _print_json, console, with_client
from kvgate.cli_client import GatewayClient


def _duration(value: str | None, hint: str) -> int | None:
    from gateway.durations import parse_duration

    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def _steps(value: str | None) -> list[float]:
    try:
        return [float(s) for s in value.split(",") if s.strip()] if value else []
    except ValueError:
        raise click.BadParameter("use comma-separated percents, e.g. 5,25,50,100",
                                 param_hint="--steps") from None


def _cohorts(pairs: tuple[str, ...]) -> dict[str, str]:
    split = [p.partition("=") for p in pairs]
    if any(not sep or not k or not v for k, sep, v in split):
        raise click.BadParameter("use NAME=VERSION", param_hint="--cohort")
    return {k: v for k, _, v in split}


@click.group()
def canary() -> None:
    """Canary releases: put a version on trial under an alias, watch it, promote or roll back."""


@canary.command("set")
@click.argument("alias")
@click.option("--version", "version_", required=True, help="The version to put on trial")
@click.option("--stable", help="The stable version (default: the route's, else the one other)")
@click.option("--weight", type=click.FloatRange(0, 100), help="Percent of keys to the canary "
              "(fractions allowed; default: the first step, else 0)")
@click.option("--steps", help="Weights to advance through while the analysis passes, e.g. 5,25,50,100")
@click.option("--interval", help="Time between steps: 90s, 10m, 1h ...")
@click.option("--cohort", "cohorts", multiple=True, metavar="NAME=VERSION",
              help="Keys whose canary cohort is NAME get VERSION (repeatable)")
@click.option("--min-success-rate", type=click.FloatRange(0, 1), help="Default 0.99")
@click.option("--max-ttft-ratio", type=click.FloatRange(min=0, min_open=True),
              help="Canary TTFT p95 / stable's above this fails (default 1.5)")
@click.option("--max-tpot-ratio", type=click.FloatRange(min=0, min_open=True),
              help="Canary TPOT p95 / stable's above this fails (default: not checked)")
@click.option("--min-samples", type=click.IntRange(min=1), help="Requests before judging (default 50)")
@click.option("--window", help="Analysis window: 60s, 2m ... (default 2m)")
@with_client
def set_(client: GatewayClient, as_json: bool, alias: str, version_: str, stable, weight, steps,
         interval, cohorts, window, **thresholds) -> None:
    """Put VERSION on trial under ALIAS."""
    body = {"version": version_, "steps": _steps(steps), "cohorts": _cohorts(cohorts),
            "thresholds": {k: v for k, v in thresholds.items() if v is not None}}
    if (window_s := _duration(window, "--window")) is not None:
        body["thresholds"]["window_s"] = window_s
    for field, value in (("stable", stable), ("weight", weight),
                         ("interval_s", _duration(interval, "--interval"))):
        if value is not None:
            body[field] = value
    route = client.call("PUT", f"/admin/canary/{alias}", json=body)
    if as_json:
        return _print_json(route)
    click.echo(f"{alias}: {route['canary']} on trial at {route['weight']:g}% "
               f"(stable {route['stable']}){_plan(route)}")


@canary.command("status")
@click.argument("alias")
@with_client
def status(client: GatewayClient, as_json: bool, alias: str) -> None:
    """The route, the configured and observed split, success rate and latency per version, the
    last events."""
    out = client.call("GET", f"/admin/canary/{alias}")
    if as_json:
        return _print_json(out)
    route = out["route"]
    click.echo(f"{alias}: stable {route['stable']}, canary {route['canary'] or '-'} "
               f"({route['phase'].replace('_', ' ')}{', paused' if route['paused'] else ''}), "
               f"weight {route['weight']:g}%{_plan(route)}")
    if route["reason"] and route["phase"] == "rolled_back":
        click.echo(f"rolled back because: {route['reason']}")
    t = route["thresholds"]
    table = Table("version", "role", "configured", "observed", "requests", "success", "TTFT p95",
                  "TPOT p95", "workers", "breaker", title=f"last {t['window_s']}s (fails below "
                  f"{t['min_success_rate']:.1%} success or above {t['max_ttft_ratio']:g}x stable's "
                  f"TTFT p95, from {t['min_samples']} samples)")
    for version, v in out["versions"].items():
        table.add_row(version, v["role"], f"{v['configured_share']:g}%", _pct(v["observed_share"]),
                      str(v["requests"]), _rate(v["success_rate"]), _ms(v["ttft_p95_ms"]),
                      _ms(v["tpot_p95_ms"]), str(v["live_workers"]),
                      v.get("breaker", "closed").replace("_", "-"))
    console.print(table)
    if out["counters"]:
        click.echo("counters: " + ", ".join(f"{k} {v}" for k, v in sorted(out["counters"].items())))
    for e in out["events"][:10]:
        click.echo(f"  {_when(e['ts'])}  {e['kind']:<8} {e['message']}")


@canary.command("list")
@with_client
def list_(client: GatewayClient, as_json: bool) -> None:
    """Every alias with a route."""
    data = client.call("GET", "/admin/canary")["data"]
    if as_json:
        return _print_json(data)
    table = Table("alias", "stable", "canary", "weight", "phase", "paused")
    for r in data:
        table.add_row(r["alias"], r["stable"], r["canary"] or "-", f"{r['weight']:g}%",
                      r["phase"], "yes" if r["paused"] else "")
    console.print(table)


def _transition(name: str, doc: str):
    @canary.command(name, help=doc)
    @click.argument("alias")
    @with_client
    def command(client: GatewayClient, as_json: bool, alias: str, **body) -> None:
        route = client.call("POST", f"/admin/canary/{alias}/{name}", json=body or None)
        if as_json:
            return _print_json(route)
        click.echo(f"{alias}: stable {route['stable']}, canary {route['canary'] or '-'} at "
                   f"{route['weight']:g}% ({route['phase'].replace('_', ' ')}"
                   f"{', paused' if route['paused'] else ''})")
    return command


_transition("promote", "Make the canary the stable version, now.")
rollback = _transition("rollback", "Send everyone back to stable (canary weight 0).")
click.option("--reason", default="rolled back by an admin", show_default=True)(rollback)
_transition("pause", "Stop advancing steps (an automatic rollback still happens).")
_transition("resume", "Advance steps again; the interval restarts now.")


def _plan(route: dict) -> str:
    return f", steps {','.join(f'{s:g}' for s in route['steps'])} every {route['interval_s']}s" \
        if route["steps"] else ""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:g}%"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
