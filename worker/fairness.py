"""Token-fair order across tenants: the virtual token counter (VTC) idea of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI'24), written for kvgate's worker.

Each tenant (an API key; entries without one share a tenant) has a counter of the tokens it was
served, prompt and output, each divided by its key's weight. Of the entries waiting, the worker
admits first the best priority, then the tenant with the least counter, then the oldest entry. A
tenant that comes back from idle starts at the least counter of the tenants with work (the lift),
so idling banks no credit: it is served next, but only until it has caught up.

Order alone cannot start a request while the batch is full: the next entry waits for a slot. So when
the next entry's tenant holds fewer of the engine's sequence slots than its weighted share and
another tenant, served more, holds more than its own, that tenant yields a slot (`over_share`; the
engine preempts one of its sequences by recompute) — a light tenant starts at once beside a flood,
and a tenant within its share is never preempted, so two backlogged tenants do not thrash.

Pure bookkeeping, no Redis and no engine: the consumer asks it which entry is next, the service tells
it what was admitted and what each step produced, and the engine's scheduler may order its waiting
queue by `request_counter`.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import orjson

SHARED_TENANT = ""  # entries that carry no key id
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0  # the key record's bounds; entries are clamped to them here too


@dataclass(frozen=True)
class Claim:
    """What the order needs of a queued entry, read leniently (an entry that does not decode is
    answered by admission; here it is just the shared tenant's, at default priority)."""

    request_id: str | None = None
    tenant: str = SHARED_TENANT
    weight: float = 1.0
    priority: int = 0


def claim_of(raw: bytes) -> Claim:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Claim()
    if not isinstance(data, dict):
        return Claim()
    rid, key, weight, priority = (data.get(k) for k in ("request_id", "key_id", "weight", "priority"))
    weight = weight if isinstance(weight, (int, float)) and not isinstance(weight, bool) else 1.0
    return Claim(rid if isinstance(rid, str) else None, key if isinstance(key, str) else SHARED_TENANT,
                 min(MAX_WEIGHT, max(MIN_WEIGHT, float(weight))),
                 priority if type(priority) is int else 0)


class FairOrder:
    """Virtual token counters per tenant, and the requests in flight whose tokens they count."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.level = 0.0  # the least counter among tenants with work, when last seen
        self.requests: dict[str, tuple[str, float]] = {}  # in flight: request id -> (tenant, weight)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, self.level)

    def request_counter(self, request_id: str) -> float:
        """The counter of a request's tenant (the engine's waiting-queue order); unknown: the level."""
        tenant = self.requests.get(request_id)
        return self.level if tenant is None else self.counter(tenant[0])

    def active(self, waiting: Iterable[Claim]) -> set[str]:
        """The tenants with work here: entries `waiting` in the look-ahead, or requests in flight."""
        return {c.tenant for c in waiting} | {tenant for tenant, _ in self.requests.values()}

    def lift(self, tenant: str, active: Collection[str]) -> None:
        """`tenant` gets work while the `active` tenants have some: it starts no lower than the
        least of them (or, with none active, than the level last seen), so idling banks nothing."""
        if tenant in active:
            return
        if active:
            self.level = min(self.counter(t) for t in active)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), self.level)
        self._forget_idle(active | {tenant})

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        self.counters[tenant] = self.counter(tenant) + tokens / weight

    def started(self, request_id: str, claim: Claim, prompt_tokens: int) -> None:
        """Admitted: its prompt is charged now, its outputs as they come."""
        self.requests[request_id] = (claim.tenant, claim.weight)
        self.charge(claim.tenant, prompt_tokens, claim.weight)

    def served(self, outputs: Iterable, alive: Callable[[str], bool]) -> None:
        """Charge each output's new tokens to its request's tenant; forget requests no longer
        `alive` (finished, failed, cancelled)."""
        for out in outputs:
            if (held := self.requests.get(out.request_id)) is not None and out.new_token_ids:
                self.charge(held[0], len(out.new_token_ids), held[1])
        for rid in [rid for rid in self.requests if not alive(rid)]:
            del self.requests[rid]

    def tenant_of(self, request_id: str) -> str | None:
        held = self.requests.get(request_id)
        return None if held is None else held[0]

    def over_share(self, claim: Claim, holders: Mapping[str, int], slots: int) -> str | None:
        """The tenant that should yield a sequence slot to `claim`'s, or None. `holders`: running
        sequences per tenant, out of `slots`. A tenant's share is `slots` times its weight over the
        weights of the tenants holding slots and `claim`'s. `claim`'s tenant must stay within its
        share with one more; the one that yields holds more than its share and has been served
        more (by counter); of several, the most served."""
        weights = {tenant: weight for tenant, weight in self.requests.values() if holders.get(tenant)}
        weights[claim.tenant] = claim.weight
        total = sum(weights.values())
        if (holders.get(claim.tenant, 0) + 1) * total > slots * claim.weight:
            return None
        mine = self.counter(claim.tenant)
        over = [t for t, held in holders.items() if t != claim.tenant and t in weights
                and held * total > slots * weights[t] and self.counter(t) > mine]
        return max(over, key=self.counter, default=None)

    def rank(self, claim: Claim, lane: int, arrival: int) -> tuple:
        """Ascending: lane (interactive first), priority, the tenant's counter, arrival."""
        return lane, claim.priority, self.counter(claim.tenant), arrival

    def _forget_idle(self, active: Collection[str]) -> None:
        """A tenant without work at or below the level would be lifted to it anyway: drop it, so
        the counters hold only tenants with work or with a debt."""
        if len(self.counters) > 4 * len(active) + 64:
            for t in [t for t, c in self.counters.items() if t not in active and c <= self.level]:
                del self.counters[t]
