"""The gateway's Prometheus metrics and the page its /metrics route serves (gateway/app.py).

Two sources, one page:
- per-process counters, histograms and gauges (requests, latency, TTFT, rate-limit refusals, open
  streams). `kvgate gateway` points PROMETHEUS_MULTIPROC_DIR at a fresh folder before any of its
  processes starts, so with `--workers N` every process writes its values to files there and any
  process answering a scrape sums all of them: a counter equals the requests sent, whichever
  process served them. Without that variable (the app run in-process) the default registry is used.
- cluster state read from Redis at scrape time (stream depth, live workers, canary weight and
  counters): one value per series whichever process answers, never summed across processes.
  Several gateway replicas report the same values: dashboards take `max` over instances.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.breaker import STATE_VALUE
from shared import names
from shared.canary import RouteStore

log = logging.getLogger("kvgate.gateway")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LIMITS = ("rpm", "concurrency", "tpm", "daily")
LANES = (names.DEFAULT_LANE, names.BATCH_LANE)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                80.0, 160.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0, 640.0)

REQUESTS = Counter("kvgate_gateway_requests", "Requests answered, by route, HTTP status (for a "
                   "stream: the status of the error it ended with; 499: the client left), model "
                   "and version (empty before routing)", ["route", "status", "model", "version"])
LATENCY = Histogram("kvgate_gateway_request_duration_seconds", "From the request's arrival to its "
                    "last byte, as the client sees it", ["route", "model", "version"],
                    buckets=LATENCY_BUCKETS)
TTFT = Histogram("kvgate_gateway_time_to_first_token_seconds", "From a streamed request's arrival "
                 "to its first token, as the client sees it", ["model", "version"],
                 buckets=TTFT_BUCKETS)
RATE_LIMITED = Counter("kvgate_gateway_rate_limited", "Requests refused with 429, by the limit "
                       "they hit", ["limit"])
CONNECTIONS_REFUSED = Counter("kvgate_gateway_connections_refused", "Connections closed by the "
                              "HTTP layer before the app saw their request, by reason "
                              "(gateway/http_protocol.py)", ["reason"])
REFUSAL_REASONS = ("head_too_large", "too_many_chunks", "too_many_pipelined")
STREAMS = Gauge("kvgate_gateway_streams_in_flight", "SSE streams open to clients", ["model", "version"],
                multiprocess_mode="livesum")
LOOP_LAG = Gauge("kvgate_gateway_event_loop_lag_seconds", "How late this process's event loop ran "
                 "a timer, worst of the last 5 s (gateway/loop_lag.py): every request on it waits "
                 "as long", multiprocess_mode="livemax")
REDIS_CONNECTIONS = Gauge("kvgate_gateway_redis_connections", "This process's pooled Redis connections, "
                          "idle or in use (idle ones close after KVGATE_REDIS_IDLE_TIMEOUT_S)",
                          ["state"], multiprocess_mode="livesum")
QUEUE_GATE_WAITING = Gauge("kvgate_gateway_queue_gate_waiting", "Requests waiting in this process for "
                           "their key's place on a model's stream (KVGATE_FAIR_QUEUE_PER_KEY)",
                           multiprocess_mode="livesum")
for _limit in LIMITS:  # every limit has a series from the start
    RATE_LIMITED.labels(_limit)
for _reason in REFUSAL_REASONS:
    CONNECTIONS_REFUSED.labels(_reason)


def rate_limited(limit: str) -> None:
    RATE_LIMITED.labels(limit).inc()


# -- the /metrics page (its route is in gateway/app.py) -----------------------------------------
async def page(state) -> bytes:
    """Every process's metrics summed, then the cluster state from Redis."""
    return process_metrics() + await cluster_metrics(state)


def process_metrics() -> bytes:
    folder = os.environ.get(MULTIPROC_ENV)
    if not folder:
        return generate_latest(REGISTRY)
    from prometheus_client import multiprocess

    _forget_dead_processes(Path(folder))
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=folder)
    return generate_latest(registry)


def _forget_dead_processes(folder: Path) -> None:
    """A gateway process that died (uvicorn restarts it) keeps its counters, which must not go
    back, but its open streams must stop counting: drop its live-gauge files."""
    from prometheus_client import multiprocess

    for path in folder.glob("gauge_live*_*.db"):
        match = re.search(r"_(\d+)\.db$", path.name)
        if match and not _alive(int(match.group(1))):
            multiprocess.mark_process_dead(int(match.group(1)), str(folder))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Families:
    """A collector for families built beforehand (generate_latest wants a registry)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families


async def cluster_metrics(state) -> bytes:
    families = []
    try:
        families = await _redis_families(state)
        up = 1.0
    except Exception as exc:  # Redis away: the page still has the process metrics
        log.debug("cluster metrics unavailable: %s", type(exc).__name__)
        up = 0.0
    redis_up = GaugeMetricFamily("kvgate_redis_up", "Whether this gateway reached Redis at scrape time")
    redis_up.add_metric([], up)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([redis_up, *families]))
    return generate_latest(registry)


async def _known_versions(redis) -> dict[str, list[str]]:
    """Every served name and the versions ever registered under it. The names come from their set
    (workers add theirs as they register and beat): /metrics needs no key, and a SCAN walked the
    whole keyspace on every scrape. Only a Redis whose workers came before the set is scanned."""
    served = sorted(n.decode() for n in await redis.smembers(names.SERVED_NAMES))
    if not served:
        served = [names.served_name_of(key.decode()) async for key in
                  redis.scan_iter(match=names.model_versions_key("*"), count=500)]
    out: dict[str, list[str]] = {}
    for name in served:
        versions = sorted(v.decode() for v in await redis.hkeys(names.model_versions_key(name)))
        if versions:
            out[name] = versions
    return out


async def _redis_families(state) -> list:
    redis = state.redis
    known = await _known_versions(redis)
    live = await state.registry.live_workers()

    workers = GaugeMetricFamily("kvgate_workers_live", "Workers heartbeating, by served model and "
                                "version (0: a version once served that has none now)",
                                labels=["model", "version"])
    for model, versions in sorted(known.items()):
        for version in versions:
            n = sum(1 for w in live if w.get("served_name") == model and w.get("version") == version)
            workers.add_metric([model, version], n)

    pipe = redis.pipeline(transaction=False)
    streams = [(m, v, lane) for m, vs in sorted(known.items()) for v in vs for lane in LANES]
    for m, v, lane in streams:
        pipe.xlen(names.request_stream(m, v, lane))
    depths = await pipe.execute()
    depth = GaugeMetricFamily("kvgate_stream_depth", "Requests in a model version's stream, "
                              "waiting or being served (sampled at scrape time)",
                              labels=["model", "version", "lane"])
    for (m, v, lane), n in zip(streams, depths):
        depth.add_metric([m, v, lane], n)
    return [workers, depth, await _breaker_family(state, streams), *await _canary_families(redis)]


async def _breaker_family(state, streams: list) -> GaugeMetricFamily:
    versions = sorted({(m, v) for m, v, _ in streams})
    states = await state.router.breaker.states(versions)
    gauge = GaugeMetricFamily("kvgate_gateway_breaker_state", "Circuit breaker of a model version "
                              "(0 closed, 1 open, 2 half-open: one probe request is trying it)",
                              labels=["model", "version"])
    for (m, v), name in sorted(states.items()):
        gauge.add_metric([m, v], STATE_VALUE[name])
    return gauge


async def _canary_families(redis) -> list:
    store = RouteStore(redis)
    weight = GaugeMetricFamily("kvgate_canary_weight_percent", "Percent of keys routed to the "
                               "version on trial (0 after a rollback)", labels=["model", "version", "phase"])
    rollbacks = CounterMetricFamily("kvgate_canary_rollbacks", "Canary rollbacks, automatic (the "
                                    "periodic check) or manual (the admin API)",
                                    labels=["model", "trigger"])
    events = CounterMetricFamily("kvgate_canary_events", "Canary promotions, failovers to another "
                                 "version and queued requests rescued from a dead version",
                                 labels=["model", "event"])
    for alias in await store.aliases():
        route = await store.get(alias)
        counts = await store.counters(alias)
        if route is not None and route.canary is not None:
            weight.add_metric([alias, route.canary, route.phase], route.weight)
        rollbacks.add_metric([alias, "automatic"], counts.get("rollbacks", 0))
        rollbacks.add_metric([alias, "manual"], counts.get("manual_rollbacks", 0))
        for event in ("promotions", "failovers", "rescued"):
            events.add_metric([alias, event], counts.get(event, 0))
    return [weight, rollbacks, events]

