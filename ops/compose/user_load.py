"""What `make compose-check` does through the published ports as a user would: streamed chats
with the official openai client, and the traffic that gives every dashboard panel data (the same
kinds tests/integration/test_observability.py sends: refusals, a rate limit, a canary rolled back)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__range": "5m", "$model": "demo", "$version": "v1"}


def stream_chat(url: str, key: str) -> str:
    """One streamed chat completion; the text it streamed."""
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="demo", stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": "Hello"}])
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop"), chunks[-1]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def dashboard_exprs() -> list[tuple[str, str]]:
    """(board / panel, query) of every dashboard target, variables filled in as Grafana would."""
    out = []
    for f in sorted((ROOT / "ops/grafana/dashboards").glob("*.json")):
        board = json.loads(f.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in SUBSTITUTIONS.items():  # $__rate_interval before $version
                    expr = expr.replace(var, value)
                out.append((f"{board['title']} / {panel['title']}", expr))
    return out


def dashboard_load(url: str, key: str, admin_key: str,
                   query: Callable[[str], list]) -> list[tuple[str, str]]:
    """Plain completions, a 401, a 404, a key limited to 1 RPM hit twice, a canary set and rolled
    back (once its rollback counter has been scraped at 0, so it shows an increase); the queries."""
    plain = {"model": "demo", "prompt": "once upon", "max_tokens": 6, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        user, admin = {"Authorization": f"Bearer {key}"}, {"Authorization": f"Bearer {admin_key}"}
        for _ in range(3):
            assert http.post("/v1/completions", json=plain, headers=user).status_code == 200
        assert http.post("/v1/completions", json=plain,
                         headers={"Authorization": "Bearer sk-kvg-wrong"}).status_code == 401
        assert http.post("/v1/completions", json={**plain, "model": "nope"}, headers=user).status_code == 404
        slow = http.post("/admin/keys", json={"name": "compose-check-rpm1", "rpm": 1}, headers=admin)
        assert slow.status_code in (200, 201), slow.text
        limited = {"Authorization": f"Bearer {slow.json()['secret']}"}
        assert [http.post("/v1/completions", json=plain, headers=limited).status_code
                for _ in range(2)] == [200, 429]
        canary = http.put("/admin/canary/demo", headers=admin,
                          json={"version": "v2", "stable": "v1", "weight": 10})
        assert canary.status_code == 200, canary.text
        deadline = time.monotonic() + 60
        while not query('kvgate_canary_rollbacks_total{trigger="manual"}') and time.monotonic() < deadline:
            time.sleep(1)
        back = http.post("/admin/canary/demo/rollback", json={"reason": "compose-check"}, headers=admin)
        assert back.status_code == 200, back.text
    return dashboard_exprs()
