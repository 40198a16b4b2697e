"""`kvgate worker`: build the engine the settings name and serve its stream until SIGTERM/SIGINT."""
from __future__ import annotations

import logging
import signal

from shared import logs, telemetry
from shared.settings import WorkerSettings
from worker.engine.kv_budget import KVCacheTooSmall

log = logging.getLogger("kvgate.worker")


def build_engine(s: WorkerSettings):
    """The paged engine by default; `hf` is the naive one-at-a-time baseline kept for benchmarks."""
    if s.engine == "hf":
        from worker.engine.hf_engine import HFEngine

        return HFEngine.from_model_dir(s.model, device=_device(s.device), dtype=s.dtype,
                                       max_model_len=s.max_model_len)
    if s.engine == "paged":
        from worker.engine.engine import LLMEngine

        return LLMEngine.from_model_dir(
            s.model, device=_device(s.device), dtype=s.dtype, block_size=s.block_size,
            kv_cache_memory=s.kv_cache_memory, gpu_memory_utilization=s.gpu_memory_utilization,
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len, enable_prefix_caching=s.enable_prefix_caching,
            attention_backend=s.attention_backend, enforce_eager=s.enforce_eager)
    if s.engine == "synthetic":  # no model: fixed tokens, for gateway-path load tests only
        from worker.engine.synthetic import SyntheticEngine

        return SyntheticEngine.from_model_dir(s.model, max_model_len=s.max_model_len)
    raise ValueError(f"unknown engine {s.engine!r}: choose 'paged', 'hf' or 'synthetic'")


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_worker(s: WorkerSettings) -> None:
    from worker.service import WorkerService

    logs.setup(s.log_level, "worker")
    telemetry.setup_tracing("kvgate-worker", s.otlp_endpoint)
    if s.torch_threads is not None:
        import torch

        torch.set_num_threads(s.torch_threads)
    try:
        engine = build_engine(s)
    except KVCacheTooSmall as exc:  # a setting to change, not a crash: say which, no traceback
        log.error("%s", exc)
        raise SystemExit(f"kvgate worker: {exc}") from None
    service = WorkerService(s, engine, engine.tokenizer)
    service.metrics.describe_engine(engine.max_model_len, engine.kv_cache)
    service.metrics.serve(s.metrics_host, s.metrics_port)
    signal.signal(signal.SIGTERM, lambda *_: service.drain())  # finish in-flight, then exit
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    try:
        service.run()
    finally:
        telemetry.shutdown()  # spans still batched go out before the process ends
