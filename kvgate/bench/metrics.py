"""Serving metrics from client-side timings, with vLLM `bench serve`'s definitions so figures compare:

- TTFT: request sent → first chunk that carries `choices` (for a non-streamed request: the whole
  response, so TTFT = E2EL).
- ITL: the gap between consecutive such chunks, pooled over all requests.
- TPOT: (E2EL − TTFT) / (output tokens − 1), per request with more than one output token.
- E2EL: request sent → last such chunk.
- Percentiles by linear interpolation (numpy's default); times reported in milliseconds.
- Goodput: completed requests per second that meet every SLO given (TTFT, TPOT, E2EL).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds, `start` relative to the run's start."""

    success: bool = False
    error: str = ""
    label: str = ""  # dataset class of the request ("short", "long", ...), for per-class figures
    start: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def distribution(values_s: list[float]) -> dict:
    """mean, std, median and the percentiles of a list of seconds, in milliseconds."""
    if not values_s:
        return {"mean": 0.0, "std": 0.0, "median": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(ms.mean()), "std": float(ms.std()), "median": float(np.median(ms))}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def meets_slo(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    """A request is good when each metric an SLO was given for is at or under it (TPOT of a
    one-token answer counts as 0, as vLLM does)."""
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slo_ms.items())


def summarize(results: list[RequestResult], duration_s: float, slo_ms: dict[str, float] | None = None) -> dict:
    """The figures of one run: counts, throughputs, goodput and the four latency distributions."""
    ok = [r for r in results if r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    out = {
        "duration_s": duration_s, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    if slo_ms:
        good = sum(meets_slo(r, slo_ms) for r in ok)
        out.update(slo_ms={k: float(v) for k, v in slo_ms.items()}, good_requests=good,
                   request_goodput=good / duration_s)
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [t for r in ok if (t := r.tpot) is not None]),
                         ("itl", [x for r in ok for x in r.itl]), ("e2el", [r.latency for r in ok])):
        for stat, value in distribution(values).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def summarize_by_label(results: list[RequestResult], duration_s: float,
                       slo_ms: dict[str, float] | None = None) -> dict[str, dict]:
    """The same figures for each request class of a mixed dataset (over the same duration)."""
    labels = sorted({r.label for r in results if r.label})
    return {label: summarize([r for r in results if r.label == label], duration_s, slo_ms)
            for label in labels}
