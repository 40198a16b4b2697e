"""`python -m kvgate.probe URL [--cafile F]` (and `kvgate probe`): exit 0 if URL answers 2xx within
3 s, else 1 with the reason on stderr. Compose's healthchecks run it every few seconds in every
container, so it imports the standard library only (the full CLI takes seconds to import on a busy
host), and its arguments hold no spaces (podman's Docker API splits a CMD healthcheck at spaces)."""
from __future__ import annotations

import ssl
import sys
import urllib.request


def probe(url: str, cafile: str | None = None) -> str | None:
    """None if `url` answers 2xx; else why not."""
    context = ssl.create_default_context(cafile=cafile) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as resp:  # noqa: S310
            status = resp.status
    except OSError as exc:  # URLError, HTTPError (4xx/5xx), timeouts, TLS failures
        return f"{url}: {exc}"
    return None if 200 <= status < 300 else f"{url}: answered {status}"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--cafile"):
        print("usage: python -m kvgate.probe URL [--cafile CA.pem]", file=sys.stderr)
        return 2
    why = probe(argv[0], argv[2] if len(argv) == 3 else None)
    if why:
        print(f"Error: {why}", file=sys.stderr)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
