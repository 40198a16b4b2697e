"""What a worker tells Prometheus and the tracer. The engine knows nothing of either: its state is
read through `engine.stats()` when Prometheus scrapes (as the heartbeat reads it), and each
request's timings are taken from what the service sees — the entry it admits, the outputs each
step returns, the end. Metric names follow vLLM's (`vllm:` → `kvgate_`), labelled by model
(served name) and version.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.trace import SpanKind
from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared import logs, protocol, telemetry
from worker.engine.types import RequestOutput
from worker.outcomes import ANSWERED, POISONED, Outcomes

log = logging.getLogger("kvgate.worker")
LABELS = ("model", "version")
# vLLM's buckets, trimmed: CPU tests see milliseconds, big models on busy GPUs minutes
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

# engine.stats() key -> metric (vLLM's name under kvgate_), help
GAUGES = (
    ("num_running", "kvgate_num_requests_running", "Requests in the engine's running batch"),
    ("num_waiting", "kvgate_num_requests_waiting", "Requests admitted to the engine, waiting to run"),
    ("kv_usage", "kvgate_kv_cache_usage_perc", "Share of KV cache blocks in use (1 = 100%)"),
)
COUNTERS = (
    ("prefix_cache_queries", "kvgate_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "kvgate_prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    ("num_preemptions", "kvgate_num_preemptions", "Sequences preempted (KV blocks ran out, or a slot "
     "yielded to the fair order)"),
    ("num_fair_preemptions", "kvgate_num_fair_preemptions", "Sequences that yielded their slot to a "
     "tenant below its share (KVGATE_FAIR_YIELD)"),
)


class EngineCollector:
    """Gauges and counters straight from `engine.stats()`, read at scrape time (the engine's own
    counters are cumulative, so a restart shows as a counter reset, as Prometheus expects)."""

    def __init__(self, stats: Callable[[], dict], labels: tuple[str, str]):
        self.stats, self.labels = stats, list(labels)

    def collect(self):
        s = self.stats()
        for key, name, doc in GAUGES:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, float(s.get(key, 0)))
            yield g
        for key, name, doc in COUNTERS:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, float(s.get(key, 0)))
            yield c


class GpuMemoryCollector:
    """Memory of the GPU this worker runs on, device-wide (what an out-of-memory depends on), read
    at scrape time; no series on a CPU worker or before CUDA is initialised (no context is made)."""

    def __init__(self, labels: tuple[str, str]):
        self.labels = list(labels)

    def collect(self):
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        for name, doc, value in (
                ("kvgate_gpu_memory_used_bytes", "GPU memory in use on the worker's device, by "
                 "every process on it", total - free),
                ("kvgate_gpu_memory_total_bytes", "GPU memory of the worker's device", total)):
            g = GaugeMetricFamily(name, doc, labels=[*LABELS, "device"])
            g.add_metric([*self.labels, str(device)], float(value))
            yield g


# KVCacheFacts attribute -> gauge, help: fixed at start-up (what the start-up line says)
KV_GAUGES = (
    ("num_blocks", "kvgate_kv_cache_blocks", "KV cache blocks allocated at start-up"),
    ("tokens", "kvgate_kv_cache_tokens", "Tokens the KV cache holds (blocks x block size)"),
    ("bytes", "kvgate_kv_cache_bytes", "Bytes of the KV cache (K and V, every layer)"),
    ("max_concurrency", "kvgate_kv_cache_max_concurrency", "Sequences of max_model_len tokens the "
     "KV cache holds at once"),
)


class StartupCollector:
    """What the engine was sized to at start-up: the context, the KV cache, and vLLM's
    cache_config_info (value 1, the settings as labels). No KV series for engines without a
    paged pool (hf, synthetic)."""

    def __init__(self, labels: tuple[str, str], max_model_len: int, kv):
        self.labels, self.max_model_len, self.kv = list(labels), max_model_len, kv

    def collect(self):
        g = GaugeMetricFamily("kvgate_max_model_len", "Context length served (after start-up's "
                              "sizing: the model's, lowered to what the KV cache holds)", labels=LABELS)
        g.add_metric(self.labels, self.max_model_len)
        yield g
        if self.kv is None:
            return
        for attr, name, doc in KV_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, float(getattr(self.kv, attr)))
            yield g
        info = GaugeMetricFamily("kvgate_cache_config_info", "KV cache configuration (vLLM's "
                                 "cache_config_info)", labels=(*LABELS, "block_size", "num_blocks",
                                                               "cache_dtype"))
        info.add_metric([*self.labels, str(self.kv.block_size), str(self.kv.num_blocks), self.kv.dtype], 1)
        yield info
        kernel = GaugeMetricFamily("kvgate_engine_kernel_info", "GEMM path the linears took (value 1; "
                                   "chosen by timing at load on CPU)", labels=(*LABELS, "linear"))
        kernel.add_metric([*self.labels, self.kv.linear_kernel], 1)
        yield kernel
        yield from self._ranks()

    def _ranks(self):
        """Tensor parallelism: how many ranks, and what each holds (a rank's GPU fills on its own)."""
        size = GaugeMetricFamily("kvgate_tensor_parallel_size", "Ranks (processes; GPUs on CUDA) the "
                                 "model is sharded across", labels=LABELS)
        size.add_metric(self.labels, self.kv.tp_size)
        yield size
        memory = GaugeMetricFamily("kvgate_rank_memory_bytes", "Bytes each rank holds, by kind "
                                   "(weights, kv)", labels=(*LABELS, "rank", "kind"))
        for r in self.kv.ranks:
            memory.add_metric([*self.labels, str(r["rank"]), "weights"], r["weight_bytes"])
            memory.add_metric([*self.labels, str(r["rank"]), "kv"], r["kv_bytes"])
        yield memory


class OutcomeCollector:
    """How requests ended, read at scrape time from the one tally the registry entry reads too."""

    def __init__(self, outcomes: Outcomes, labels: tuple[str, str]):
        self.outcomes, self.labels = outcomes, list(labels)

    def collect(self):
        success = CounterMetricFamily("kvgate_request_success", "Requests finished, by finish reason",
                                      labels=(*LABELS, "finished_reason"))
        for reason, n in self.outcomes.by_reason().items():
            success.add_metric([*self.labels, reason], n)
        failed = CounterMetricFamily("kvgate_request_failures", "Requests answered with an error by "
                                     "the worker, by error code", labels=(*LABELS, "code"))
        codes = self.outcomes.by_code()
        for code, n in codes.items():
            failed.add_metric([*self.labels, code], n)
        poisoned = CounterMetricFamily("kvgate_requests_poisoned", "Entries retired by the poison cap: "
                                       "delivered KVGATE_MAX_DELIVERIES times without finishing",
                                       labels=LABELS)
        poisoned.add_metric(self.labels, codes[POISONED])
        yield from (success, failed, poisoned)


@dataclass
class _Timing:
    """One admitted request as the worker saw it (Unix seconds)."""

    created: float  # the gateway's XADD
    admitted: float
    parent: object  # the trace context the entry carried
    prompt_tokens: int
    first: float | None = None
    last: float | None = None
    tokens: dict[int, int] = field(default_factory=dict)
    reason: str | None = None


class WorkerMetrics:
    def __init__(self, served_name: str, version: str, worker_id: str, stats: Callable[[], dict],
                 registry: CollectorRegistry | None = None):
        self.labels = (served_name, version)
        self.worker_id = worker_id
        self.registry = registry or CollectorRegistry()
        self.registry.register(EngineCollector(stats, self.labels))
        self.registry.register(GpuMemoryCollector(self.labels))
        r = self.registry
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "From admission to the engine "
                              "to the first token", LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvgate_time_per_output_token_seconds", "Mean time between a request's "
                              "output tokens", LABELS, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvgate_e2e_request_latency_seconds", "From the gateway's enqueue to the "
                             "last token", LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvgate_request_queue_time_seconds", "Time in the Redis stream, from the "
                               "gateway's enqueue to the worker's admission", LABELS,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens prefilled", LABELS, registry=r)
        self.generation_tokens = Counter("kvgate_generation_tokens", "Tokens generated", LABELS, registry=r)
        self.outcomes = Outcomes()
        self.registry.register(OutcomeCollector(self.outcomes, self.labels))
        self.timings: dict[str, _Timing] = {}
        self.url: str | None = None

    def describe_engine(self, max_model_len: int, kv) -> None:
        """Export what start-up sized the engine to (`kv`: its KVCacheFacts, or None)."""
        self.registry.register(StartupCollector(self.labels, max_model_len, kv))

    def serve(self, host: str, port: int, certfile: Path | None = None,
              keyfile: Path | None = None) -> str:
        """Start /metrics on its own port (0: any free one), HTTPS given a certificate; its URL."""
        disable_created_metrics()  # no `_created` series beside each counter and histogram
        tls = bool(certfile and keyfile)
        server, _ = start_http_server(port, addr=host, registry=self.registry,
                                      certfile=str(certfile) if tls else None,
                                      keyfile=str(keyfile) if tls else None)
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.url = f"{'https' if tls else 'http'}://{shown}:{server.server_port}/metrics"
        log.info("metrics at %s", self.url)
        return self.url

    # -- what the service tells us ----------------------------------------------------------
    def admitted(self, entry: protocol.RequestEntry, prompt_tokens: int, resumed: bool = False) -> None:
        """`resumed`: taken over from a worker that stopped."""
        self.outcomes.admitted(resumed)
        now = time.time()
        self.timings[entry.request_id] = _Timing(
            created=min(entry.created, now), admitted=now, parent=telemetry.extract(entry.trace),
            prompt_tokens=prompt_tokens)
        self.queue.labels(*self.labels).observe(max(0.0, now - entry.created))
        self.prompt_tokens.labels(*self.labels).inc(prompt_tokens)

    def output(self, out: RequestOutput) -> None:
        t = self.timings.get(out.request_id)
        if t is None:
            return
        if out.new_token_ids:
            t.last = time.time()
            if t.first is None:
                t.first = t.last
                self.ttft.labels(*self.labels).observe(t.first - t.admitted)
            t.tokens[out.index] = t.tokens.get(out.index, 0) + len(out.new_token_ids)
            self.generation_tokens.labels(*self.labels).inc(len(out.new_token_ids))
        if out.finished:
            t.reason = out.finish_reason

    def finished(self, request_id: str, reason: str | None = None) -> None:
        """The request is over (done, or aborted when `reason` says so)."""
        t = self.timings.pop(request_id, None)
        reason = reason or (t and t.reason) or "stop"
        self.outcomes.ended(reason)
        if t is None:
            return
        now = time.time()
        self.e2e.labels(*self.labels).observe(max(0.0, now - t.created))
        n = max(t.tokens.values(), default=0)
        if n >= 2:
            self.tpot.labels(*self.labels).observe((t.last - t.first) / (n - 1))
        self._spans(request_id, t, now, reason)
        logs_fields = {"finish_reason": reason, "prompt_tokens": t.prompt_tokens,
                       "completion_tokens": sum(t.tokens.values()),
                       "ttft_ms": None if t.first is None else round((t.first - t.admitted) * 1000, 1),
                       "e2e_ms": round((now - t.created) * 1000, 1)}
        with logs.request_context(request_id):
            log.info("request finished", extra=logs_fields)

    def cancelled_unstarted(self) -> None:
        """An entry acknowledged unrun: its request was cancelled before a worker started it."""
        self.outcomes.cancelled_unstarted()

    def rejected(self, request_id: str, code: str, trace: dict[str, str] | None = None,
                 when: str = ANSWERED) -> None:
        """Answered with an error, before running or instead of finishing (`trace`: the context its
        entry carried, when the entry could be read; `when`: worker/outcomes.py's stages)."""
        t = self.timings.pop(request_id, None)
        self.outcomes.errored(code, when)
        if telemetry.enabled():
            now = time.time()
            parent = t.parent if t is not None else telemetry.extract(trace or {})
            telemetry.span_between("worker", parent, t.admitted if t else now, now,
                                   {"kvgate.request_id": request_id, "kvgate.error": code},
                                   kind=SpanKind.CONSUMER, error=code)
        with logs.request_context(request_id):
            log.info("request ended with an error by the worker", extra={"code": code})

    def _spans(self, request_id: str, t: _Timing, end: float, reason: str) -> None:
        """queue wait (gateway enqueue → admission), then the worker's span with prefill (admission
        → first token) and decode (first → last token) under it."""
        if not telemetry.enabled():
            return
        attrs = {"kvgate.request_id": request_id, "kvgate.model": self.labels[0],
                 "kvgate.version": self.labels[1], "kvgate.worker_id": self.worker_id}
        telemetry.span_between("queue wait", t.parent, t.created, t.admitted, attrs)
        worker = telemetry.span_between(
            "worker", t.parent, t.admitted, end, {**attrs, "gen_ai.usage.input_tokens": t.prompt_tokens,
                                                   "gen_ai.usage.output_tokens": sum(t.tokens.values()),
                                                   "kvgate.finish_reason": reason},
            kind=SpanKind.CONSUMER)
        first = t.first or end
        telemetry.span_between("prefill", worker, t.admitted, first, attrs)
        if t.first is not None:
            telemetry.span_between("decode", worker, t.first, t.last or end, attrs)
