"""`kvgate worker`: build the engine the settings name and serve its stream until SIGTERM/SIGINT."""
from __future__ import annotations

import gc
import logging
import signal
from dataclasses import astuple, fields

from shared import logs, reasoning, telemetry, tool_parsers
from shared.settings import WorkerSettings
from worker.engine.config import EngineConfig
from worker.engine.kv_budget import KVCacheTooSmall
from worker.engine.tokenizer import load_tokenizer
from worker.models.pooling import is_encoder_folder

log = logging.getLogger("kvgate.worker")


# The EngineConfig knobs the other engines take (their from_model_dir's parameters of the same
# names); the paged engine takes them all. Synthetic has no batch cap, by design (load tests).
HONOURED = {"hf": ("device", "dtype", "max_model_len"), "synthetic": ("max_model_len",)}


def engine_config(s: WorkerSettings) -> EngineConfig:
    """The engine's knobs from the worker's settings by field name, as nano-vllm fills its Config
    with `fields()`: a knob added to both is passed on with no edit here."""
    knobs = {f.name: getattr(s, f.name) for f in fields(EngineConfig) if f.name in WorkerSettings.model_fields}
    return EngineConfig(**{**knobs, "model_dir": s.model, "device": _device(s.device)})


def resolve_parsers(s: WorkerSettings, tokenizer) -> WorkerSettings:
    """The settings with `reasoning_parser` and `tool_call_parser` resolved: None is what the model's
    chat template implies (or none), a name is taken as given. Raises ValueError for a name that is
    not implemented, or reasoning markers that are not single tokens of this tokenizer."""
    from worker.thinking import Markers

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # a folder with named templates: any of them may say
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    think = s.reasoning_parser or reasoning.detect(template)
    tools = s.tool_call_parser or tool_parsers.detect(template)
    if think is not None and think not in (*reasoning.PARSERS, reasoning.HARMONY):
        raise ValueError(f"unknown --reasoning-parser {think!r}; choose one of "
                         f"{', '.join((*reasoning.PARSERS, reasoning.HARMONY))}")
    if tools is not None and tools not in tool_parsers.NAMES:
        raise ValueError(f"unknown --tool-call-parser {tools!r}; choose one of "
                         f"{', '.join(tool_parsers.NAMES)}")
    if think is not None and Markers.of(tokenizer, think) is None:
        words = reasoning.HARMONY_TOKENS if think == reasoning.HARMONY else astuple(reasoning.PARSERS[think])
        if s.reasoning_parser:
            raise ValueError(f"--reasoning-parser {think}: {' and '.join(words)} are not single "
                             f"tokens of this model's tokenizer")
        log.warning("the chat template writes %s, but they are not single tokens here: no reasoning parser",
                    " and ".join(words))
        think = None
    if think == reasoning.HARMONY and tools is None:  # its calls reach the gateway in Hermes's form (thinking.py)
        tools = "hermes"
    return s.model_copy(update={"reasoning_parser": think, "tool_call_parser": tools})


def build_engine(s: WorkerSettings):
    """The paged engine by default; `hf` is the naive one-at-a-time baseline kept for benchmarks."""
    config = engine_config(s)
    if is_encoder_folder(config.model_dir):  # BERT-style: embeddings and scores, by its own engine
        from worker.engine.encoder import EncoderEngine

        return EncoderEngine(config)
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
        s = resolve_parsers(s, load_tokenizer(s.model))
    except ValueError as exc:  # a parser named wrong: say so, no traceback
        log.error("%s", exc)
        raise SystemExit(f"kvgate worker: {exc}") from None
    try:
        engine = build_engine(s)
    except (KVCacheTooSmall, ValueError) as exc:  # a setting or a folder to change (an unsupported
        # config, a reranker without its --score-tokens): say which, the traceback only at debug
        log.error("%s", exc)
        log.debug("the engine did not start", exc_info=exc)
        raise SystemExit(f"kvgate worker: {exc}") from None
    service = WorkerService(s, engine, engine.tokenizer)
    service.metrics.describe_engine(engine.max_model_len, engine.kv_cache)
    service.metrics.serve(s.metrics_host, s.metrics_port, s.metrics_ssl_certfile,
                          s.metrics_ssl_keyfile)
    # what start-up built (~260,000 objects for the demo model: torch's modules, the tokenizer,
    # transformers) is never scanned again: a full collection walked all of it, ~90 ms in which no
    # request got a token, set off by any burst of objects (one prompt's scores are ~100,000)
    gc.freeze()
    signal.signal(signal.SIGTERM, lambda *_: service.drain())  # finish in-flight, then exit
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    try:
        service.run()
    finally:
        getattr(engine, "close", lambda: None)()  # a tensor-parallel engine's other ranks
        telemetry.shutdown()  # spans still batched go out before the process ends
