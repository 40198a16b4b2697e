"""A flood deeper than the worker's look-ahead: the whole stack (`kvgate up`, one worker of one
sequence slot, a 15 ms pause per step, a look-ahead of 2 entries per lane), two keys. Tenant A
sends ten requests at once; once its first is done, tenant B sends one. With the gateway keeping at
most 2 of a key's requests on the stream (KVGATE_FAIR_QUEUE_PER_KEY, gateway/queue_gate.py), B's
entry is within the worker's look-ahead and the fair order serves it after a few of A's; without
(0), A's eight queued entries are ahead of it on the stream, out of the worker's sight, and B waits
behind nearly all of them. Asserted on the order of completions, not on times."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import start_stack, stop_stack

FLOOD = 10


def _key(url: str, admin: str, name: str) -> str:
    resp = httpx.post(f"{url}/admin/keys", headers={"Authorization": f"Bearer {admin}"}, timeout=30,
                      json={"name": name})
    resp.raise_for_status()
    return resp.json()["secret"]


@pytest.mark.parametrize("per_key", [2, 0], ids=["gated", "ungated"])
def test_a_flood_deeper_than_the_look_ahead_does_not_hide_another_tenant(tmp_path, tiny_model_dir, per_key):
    env = {"KVGATE_FAULT_STEP_MS": "15", "KVGATE_MAX_NUM_SEQS": "1", "KVGATE_FAIR_LOOKAHEAD": "2",
           "KVGATE_FAIR_QUEUE_PER_KEY": str(per_key)}
    stack = start_stack(tiny_model_dir, tmp_path / "stack", "paged", env)
    try:
        admin = (tmp_path / "stack" / "admin.key").read_text().strip()
        keys = {t: _key(stack.url, admin, f"tenant-{t}") for t in "ab"}
        done: list[str] = []

        async def call(client: httpx.AsyncClient, tenant: str, i: int) -> None:
            resp = await client.post(stack.url + "/v1/completions", headers={"Authorization": f"Bearer {keys[tenant]}"},
                                     json={"model": "demo", "prompt": f"{tenant} {i} says", "max_tokens": 8,
                                           "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 8
            done.append(f"{tenant}{i}")

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                flood = [asyncio.create_task(call(client, "a", i)) for i in range(FLOOD)]
                while not done:
                    await asyncio.sleep(0.005)
                await call(client, "b", 0)
                await asyncio.gather(*flood)

        asyncio.run(scenario())
        a_before_b = done.index("b0")
        print(f"per_key={per_key}: completion order {' '.join(done)}; {a_before_b} of A's {FLOOD} before B")
        if per_key:  # A's first, the one running when B arrives, the one ahead of B in the
            # worker's look-ahead, and one on a tie at most
            assert a_before_b <= 4, done
        else:  # B's entry was read only once nearly all of A's had been admitted
            assert a_before_b >= 7, done
    finally:
        stop_stack(stack.proc)
