"""`kvgate bench structured`: what a JSON-schema constraint costs the paged engine, on a random ~58M
Llama built for the run (`--model DIR`: any folder).

64 concurrent requests constrained by a realistic JSON schema (an order: nested customer object,
an array of line items, enums, integers, bounded strings: every field bounded, so random weights
finish the object rather than write digits until max_tokens), then the same requests free, each
run to as many tokens as its constrained twin produced in a first run (ignore_eos), so both decode
about as many tokens at the same lengths; tokens/s compare per output token. Grammar compile
times are measured over distinct variants of the schema (each compiled once, as the cache would).
"""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvgate.bench.engine import MODEL, build_model, cpu_name, describe_model
from shared.sampling import SamplingParams, StructuredOutputs
from worker.engine.engine import LLMEngine
from worker.engine.kv_budget import cdiv

TARGET = 0.9  # the constrained run's tokens/s at least this share of the free run's


def order_schema(variant: int = 0) -> dict:
    """An e-commerce order as an agent would ask for one; `variant` renames fields and enums so each
    variant is a distinct spec (a distinct compile)."""
    v = f"_{variant}" if variant else ""
    return {
        "type": "object", "additionalProperties": False,
        "required": [f"order_id{v}", "customer", "items", "status", "total_cents"],
        "properties": {
            f"order_id{v}": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {"type": "object", "additionalProperties": False, "required": ["name", "tier"],
                         "properties": {"name": {"type": "string", "maxLength": 16},
                                        "tier": {"enum": ["free", "pro", f"enterprise{v}"]},
                                        "email": {"type": "string", "maxLength": 24}}},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price_cents"],
                "properties": {"sku": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{3}"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 20},
                               "price_cents": {"type": "integer", "minimum": 0, "maximum": 100000}}}},
            "status": {"enum": ["pending", "paid", "shipped", f"cancelled{v}"]},
            "total_cents": {"type": "integer", "minimum": 0, "maximum": 10000000},
            "gift": {"type": "boolean"},
        },
    }


def prompts(n: int, vocab_size: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(16, 64))] for _ in range(n)]


def run_batch(engine: LLMEngine, reqs: list[tuple[list[int], SamplingParams]]) -> tuple[list[int], float]:
    """All at once; output tokens per request and the seconds from the first add to the last token."""
    counts = [0] * len(reqs)
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            counts[int(out.request_id)] += len(out.new_token_ids)
    return counts, time.perf_counter() - start


def throughput(engine: LLMEngine, ps: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """A first constrained run warms up at full batch and sets the lengths the free requests run to;
    then the two take turns, so load from other processes falls on both alike; the ratio is the
    median of the rounds' (constrained ÷ free tokens/s)."""
    spec = StructuredOutputs(json=json.dumps(order_schema()))
    constrained = [(p, SamplingParams(max_tokens=max_tokens, temperature=1.0, structured_outputs=spec))
                   for p in ps]
    engine.grammars.submit(spec).result()  # compiled before the clock starts, as a cached schema is
    lengths, _ = run_batch(engine, constrained)
    free = [(p, SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True)) for p, n in zip(ps, lengths)]
    ratios, tok_s = [], {"constrained": [], "free": []}
    for _ in range(rounds):
        for name, reqs in (("constrained", constrained), ("free", free)):
            counts, seconds = run_batch(engine, reqs)
            tok_s[name].append(sum(counts) / seconds)
        ratios.append(tok_s["constrained"][-1] / tok_s["free"][-1])
    return {"requests": len(ps), "rounds": rounds, "mean_output_tokens": sum(lengths) / len(ps),
            "output_tokens": sum(lengths), "constrained_tok_s": statistics.median(tok_s["constrained"]),
            "free_tok_s": statistics.median(tok_s["free"]), "round_ratios": ratios,
            "vs_free": statistics.median(ratios)}


def compile_times(engine: LLMEngine, variants: int) -> dict:
    """Each variant compiled once (cold), one after another, in milliseconds."""
    before = len(engine.grammars.compile_seconds)
    for v in range(1, variants + 1):
        engine.grammars.submit(StructuredOutputs(json=json.dumps(order_schema(v)))).result()
    ms = sorted(s * 1e3 for s in engine.grammars.compile_seconds[before:])
    return {"schemas": len(ms), "compile_ms_p50": statistics.median(ms),
            "compile_ms_p99": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], "compile_ms_max": ms[-1]}


def run_bench(quick: bool = False, out_json: str | None = "bench-out/structured.json",
              model_dir: str | Path | None = None) -> dict:
    n, max_tokens, variants, rounds = (16, 160, 8, 1) if quick else (64, 200, 32, 3)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(model_dir) if model_dir else build_model(Path(tmp) / "bench-llama")
        engine = LLMEngine.from_model_dir(path, max_num_seqs=max(64, n), max_num_batched_tokens=2048,
                                          num_blocks=n * cdiv(64 + max_tokens, 16) + 64, block_size=16)
        ps = prompts(n, engine.vocab_size)
        structured = {**throughput(engine, ps, max_tokens, rounds), **compile_times(engine, variants)}
        report = {"quick": quick, "cpu": cpu_name(), "threads": torch.get_num_threads(),
                  "device": str(engine.runner.device),
                  "model": describe_model(path) if model_dir else MODEL, "structured": structured}
    print(format_table(report))
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(report, indent=2))
    return report


def format_table(report: dict) -> str:
    s = report["structured"]
    met = "yes" if s["vs_free"] >= TARGET else "NO"
    rows = ["quick run: fewer requests, the target is for the full run"] if report["quick"] else []
    rows += [f"on {report['cpu']} ({report['device']}), {report['threads']} torch threads",
             f"{s['requests']} requests, ~{s['output_tokens']} output tokens a run "
             f"({s['mean_output_tokens']:.0f} per request), {s['rounds']} round(s) each, taking turns",
             f"tok/s constrained {s['constrained_tok_s']:.1f}, free {s['free_tok_s']:.1f} (medians); "
             f"ratio per round {', '.join(f'{r:.3f}' for r in s['round_ratios'])}",
             f"structured.vs_free        {s['vs_free']:.3f}  >={TARGET}  {met}",
             f"structured.compile_ms_p50 {s['compile_ms_p50']:.1f}  ({s['schemas']} schemas)",
             f"structured.compile_ms_p99 {s['compile_ms_p99']:.1f}"]
    return "\n".join(rows)
