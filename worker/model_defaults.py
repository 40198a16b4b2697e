"""A model folder's recommended sampling, for what a request leaves out.

Model makers put the sampling their model is meant to run with in generation_config.json (Qwen3:
temperature 0.6, top_p 0.95, top_k 20; Llama-3.2-Instruct: temperature 0.6, top_p 0.9; Qwen2.5:
also repetition_penalty 1.05). With OpenAI's defaults instead (temperature 1, no top-p/top-k) such a
model rambles or loops. So, as vLLM does by default (`--generation-config auto`), the worker takes
each of shared/sampling.py's MODEL_DEFAULTS the file sets explicitly as the default of a request
that leaves that field out (the gateway names them on the entry, `from_model`); a request's own
value always wins. `do_sample` is not read (vLLM reads it neither): a file that sets temperature 0
is greedy. A value out of range is skipped with a warning, never served. KVGATE_GENERATION_CONFIG
`none`: OpenAI's defaults whatever the folder says.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from shared.sampling import MODEL_DEFAULTS

log = logging.getLogger("kvgate.worker")
FILE = "generation_config.json"


def _valid(name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name == "top_k":
        return isinstance(value, int) and value >= -1
    return {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
            "repetition_penalty": value > 0}[name]


def read_model_defaults(model_dir: str | Path | None) -> dict[str, float | int]:
    """The sampling defaults `model_dir`'s generation_config.json sets (empty without one)."""
    path = Path(model_dir) / FILE if model_dir else None
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s not read (%s): requests get OpenAI's sampling defaults", path, exc)
        return {}
    if not isinstance(raw, dict):
        return {}
    found = {}
    for name in MODEL_DEFAULTS:
        if name not in raw or raw[name] is None:
            continue
        if _valid(name, raw[name]):
            found[name] = float(raw[name]) if name != "top_k" else raw[name]
        else:
            log.warning("%s: %s %r is out of range and not used as a default", path, name, raw[name])
    return found


def said(defaults: dict[str, float | int]) -> str:
    """The start-up line's words for them."""
    return " ".join(f"{name}={value:g}" for name, value in defaults.items())
