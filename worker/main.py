"""`kvgate worker`: build the engine the settings name and serve its stream until SIGTERM/SIGINT."""
from __future__ import annotations

import logging
import signal
from dataclasses import fields

from shared import logs, telemetry
from shared.settings import WorkerSettings
from worker.engine.config import EngineConfig
from worker.engine.kv_budget import KVCacheTooSmall

log = logging.getLogger("kvgate.worker")


# The EngineConfig knobs the other engines take (their from_model_dir's parameters of the same
# names); the paged engine takes them all. Synthetic has no batch cap, by design (load tests).
HONOURED = {"hf": ("device", "dtype", "max_model_len"), "synthetic": ("max_model_len",)}


def engine_config(s: WorkerSettings) -> EngineConfig:
    """The engine's knobs from the worker's settings by field name, as nano-vllm fills its Config
    with `fields()`: a knob added to both is passed on with no edit here."""
    knobs = {f.name: getattr(s, f.name) for f in fields(EngineConfig) if f.name in WorkerSettings.model_fields}
    return EngineConfig(**{**knobs, "model_dir": s.model, "device": _device(s.device)})


def build_engine(s: WorkerSettings):
    """The paged engine by default; `hf` is the naive one-at-a-time baseline kept for benchmarks."""
    config = engine_config(s)
    if s.engine == "paged":
        from worker.engine.engine import LLMEngine

        return LLMEngine(config)
    if s.engine == "hf":
        from worker.engine.hf_engine import HFEngine as engine
    elif s.engine == "synthetic":  # no model: fixed tokens, for gateway-path load tests only
        from worker.engine.synthetic import SyntheticEngine as engine
    else:
        raise ValueError(f"unknown engine {s.engine!r}: choose 'paged', 'hf' or 'synthetic'")
    return engine.from_model_dir(config.model_dir, **{k: getattr(config, k) for k in HONOURED[s.engine]})


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
