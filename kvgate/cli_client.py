"""What the `kvgate` commands that talk to a gateway share: --url and a key (from the option, the
environment, or the .kvgate/ files `kvgate up` wrote), --json, and one clear line for any failure.
Which key a group of commands takes (admin or API) is a `KeySource`."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

STATE_DIR = Path(".kvgate")


@dataclass(frozen=True)
class KeySource:
    """A kind of key: its option and variable, the .kvgate/ file `kvgate up` leaves it in, and how
    errors name it."""
    noun: str                     # "admin key": the missing-key and refused-key lines say this
    option: str                   # "--admin-key"
    envvar: str
    state_file: str               # under STATE_DIR
    purpose: str = ""             # the option's help, before where else the key comes from
    forbidden: str | None = None  # what a 403 means for this key, where it means one thing

    @property
    def help(self) -> str:
        return f"{self.purpose} [env {self.envvar}; .kvgate/{self.state_file}]".lstrip()


class GatewayClient:
    """Calls the gateway with one key and turns every failure into one clear line (a ClickException)."""

    def __init__(self, url: str, secret: str, key: KeySource):
        self.url = url.rstrip("/")
        self.key = key
        self.http = httpx.Client(base_url=self.url, timeout=30,
                                 headers={"Authorization": f"Bearer {secret}"})

    def call(self, method: str, path: str, **kwargs) -> dict:
        try:
            resp = self.http.request(method, path, **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise click.ClickException(f"cannot reach the gateway at {self.url}: "
                                       f"{exc or type(exc).__name__}") from None
        if resp.status_code < 400:
            return resp.json()
        raise click.ClickException(self._explain(resp))

    def _explain(self, resp: httpx.Response) -> str:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{self.url} answered {resp.status_code}: is it a kvgate gateway?"
        if resp.status_code == 401:
            return f"the gateway at {self.url} refused the {self.key.noun} ({message})"
        if resp.status_code == 403 and self.key.forbidden:
            return f"{self.key.forbidden} ({message})"
        return message


def _from_state(name: str) -> str | None:
    path = STATE_DIR / name
    return path.read_text().strip() if path.exists() else None


def with_gateway(key: KeySource):
    """A decorator: the command gets --url, the key's option and --json, and is called with a
    GatewayClient and as_json."""
    def decorate(func):
        @click.option("--url", envvar="KVGATE_URL", help="Gateway URL [env KVGATE_URL; .kvgate/gateway.url]")
        @click.option(key.option, "secret", envvar=key.envvar, help=key.help)
        @click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts)")
        @functools.wraps(func)
        def wrapper(url, secret, as_json, **kwargs):
            url = url or _from_state("gateway.url")
            secret = secret or _from_state(key.state_file)
            if not url:
                raise click.ClickException("no gateway URL: pass --url, set KVGATE_URL, or run where "
                                           "`kvgate up` wrote .kvgate/")
            if not secret:
                raise click.ClickException(f"no {key.noun}: pass {key.option}, set {key.envvar}, or run "
                                           f"where `kvgate up` wrote .kvgate/{key.state_file}")
            return func(GatewayClient(url, secret, key), as_json, **kwargs)
        return wrapper
    return decorate
