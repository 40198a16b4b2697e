"""`kvgate bench programs`: three generation programs (kvgate.lang) through the gateway, each run three
ways: the program on a stack with prefix caching on, the same program with caching off, and the same
calls written naively (one independent request per call, one at a time, no forks) on a third stack,
caching on. Each way runs once untimed on other inputs first (grammars compiled, nothing of the
measured prefixes cached), then timed; the results of the program and the naive calls must agree
(same seeds). Reported: wall time and prompt tokens computed (charged prompt tokens minus those the
worker read from its prefix cache).

1. tree of thought: branch 3, depth 3 (3 + 9 + 27 thoughts of up to 16 tokens);
2. extraction: 8 fields, each constrained by a regex, from one ~1,500-token document, in 8 forks;
3. multiple choice: 64 questions after a shared instruction, each answered with `select` of 4.
Random weights: the texts are nonsense, the calls and their shapes are what is measured. `--quick`
runs the tiny model and smaller sizes (for tests).
"""
from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import orjson
import redis

from kvgate.bench.procs import Processes, Server
from kvgate.lang import Endpoint, function, gen, select
from shared import names

HEARTBEAT_S = 0.2  # the stacks' workers write their registry entry (and hit counters) this often
TARGET = 3.0  # the program at least this many times faster than the naive calls, on (1) and (2)
WORDS = ("invoice order customer shipment total amount date account north river stone bright quiet seven "
         "market ledger signal harbor copper meadow lantern").split()
FIELDS = {  # field -> its regex (bounded: random weights finish each field)
    "invoice": r"INV-[0-9]{4}", "date": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", "total": r"[0-9]{1,5}\.[0-9]{2}",
    "currency": r"(EUR|USD|GBP)", "customer": r"[A-Z][a-z]{2,8}", "country": r"[A-Z]{2}",
    "status": r"(paid|open|late)", "items": r"[1-9][0-9]?"}


@dataclass
class Sizes:
    branch: int = 3
    depth: int = 3
    thought_tokens: int = 16
    doc_tokens: int = 1500
    questions: int = 64
    choices: int = 4
    instruction_tokens: int = 300


QUICK = Sizes(branch=2, depth=2, thought_tokens=4, doc_tokens=200, questions=6, instruction_tokens=40)


# -- the programs -----------------------------------------------------------------------------------
@function
def tree_of_thought(s, question: str, sizes: Sizes):
    """Level by level: every state of a level forks `branch` thoughts, all of the level at once."""
    s += f"Question: {question}\n"
    frontier = [s]
    for d in range(sizes.depth):
        level = []
        for parent, state in enumerate(frontier):
            forks = state.fork(sizes.branch)
            for i, f in enumerate(forks):
                f += f"Thought {d}.{parent}.{i}:"
                f += gen("thought", max_tokens=sizes.thought_tokens, temperature=1.0, seed=d * 1000 + parent * 10 + i)
                f += "\n"
            level += forks
        for f in level:
            f.sync()
        frontier = level
    s["leaves"] = [f.text() for f in frontier]


@function
def extract(s, document: str):
    s += f"Document:\n{document}\n\nFields:\n"
    forks = s.fork(len(FIELDS))
    for f, (field, regex) in zip(forks, FIELDS.items()):
        f += f"{field}: "
        f += gen(field, max_tokens=16, regex=regex, seed=1)
    forks.join()
    for f, field in zip(forks, FIELDS):
        s[field] = f[field]


@function
def multiple_choice(s, instruction: str, question: str, choices: list[str]):
    s += instruction + f"\nQuestion: {question}\nAnswer:"
    s += select("answer", choices)


# -- the same calls, naively -----------------------------------------------------------------------
def naive_tree(ep: Endpoint, question: str, sizes: Sizes) -> list[str]:
    frontier = [f"Question: {question}\n"]
    for d in range(sizes.depth):
        level = []
        for parent, text in enumerate(frontier):
            for i in range(sizes.branch):
                prompt = text + f"Thought {d}.{parent}.{i}:"
                out = ep.generate(prompt, {"max_tokens": sizes.thought_tokens, "temperature": 1.0,
                                           "seed": d * 1000 + parent * 10 + i})
                level.append(prompt + out.text + "\n")
        frontier = level
    return frontier


def naive_extract(ep: Endpoint, document: str) -> dict:
    head = f"Document:\n{document}\n\nFields:\n"
    return {field: ep.generate(head + f"{field}: ", {"max_tokens": 16, "seed": 1,
                                                     "structured_outputs": {"regex": regex}}).text
            for field, regex in FIELDS.items()}


def naive_choice(ep: Endpoint, instruction: str, question: str, choices: list[str]) -> str:
    """Each choice scored from the prompt's first token (no start: nothing read from the cache)."""
    from kvgate.lang.backends import mean_logprob

    prompt = instruction + f"\nQuestion: {question}\nAnswer:"
    start = ep.generate(prompt, {"max_tokens": 1, "temperature": 0}).prompt_tokens
    scores = []
    for c in choices:
        out = ep._post({"model": ep.model, "prompt": prompt + c, "max_tokens": 1, "temperature": 0,
                        "prompt_logprobs": 0})
        scores.append(mean_logprob(out["choices"][0]["prompt_logprobs"], start, out["usage"]["prompt_tokens"]))
    return choices[max(range(len(scores)), key=scores.__getitem__)]


# -- measuring --------------------------------------------------------------------------------------
def _text(rng: random.Random, tokenizer, tokens: int) -> str:
    words = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += rng.choices(WORDS, k=max(8, (tokens - len(tokenizer.encode(" ".join(words)))) // 2))
    while len(tokenizer.encode(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words)


class Stack:
    """One `kvgate up` and a way to read its worker's prefix-cache hits (from the registry)."""

    def __init__(self, procs: Processes, name: str, model_dir: Path, caching: bool):
        # a registry entry 5 times a second (1 by default), so `hits` waits a fifth of a second
        env = {"KVGATE_HEARTBEAT_S": str(HEARTBEAT_S),
               **({} if caching else {"KVGATE_ENABLE_PREFIX_CACHING": "false"})}
        self.server: Server = procs.kvgate(name, model_dir, "paged", env)
        self.redis = redis.Redis.from_url((procs.log_dir / name / "redis.url").read_text().strip())

    def endpoint(self) -> Endpoint:
        return Endpoint(self.server.url, self.server.key, "demo")

    def hits(self) -> int:
        """The worker's prefix-cache hit tokens, from registry entries written after this call (at
        most a heartbeat later), so they count every request that finished before it."""
        asked, deadline = time.time(), time.monotonic() + 30
        while True:
            ids = self.redis.zrange(names.WORKERS_ZSET, 0, -1)
            entries = [orjson.loads(raw) for raw in (self.redis.get(names.worker_key(i.decode())) for i in ids) if raw]
            if entries and all(e["ts"] >= asked for e in entries):
                return sum(e["stats"]["prefix_cache_hits"] for e in entries)
            if time.monotonic() > deadline:
                raise RuntimeError("no worker of the stack wrote its registry entry in 30 s")
            time.sleep(0.05)


def warm(stack: Stack, run) -> None:
    """`run(endpoint)` untimed, its figures unread (grammars compiled, other prefixes cached)."""
    ep = stack.endpoint()
    run(ep)
    ep.close()


def measure(stack: Stack, run) -> dict:
    """Wall time of `run(endpoint)`, the requests and prompt tokens it was charged, and how many of
    those the worker computed (not read from the prefix cache)."""
    ep = stack.endpoint()
    before = stack.hits()
    t0 = time.perf_counter()
    result = run(ep)
    wall = time.perf_counter() - t0
    hit = stack.hits() - before
    ep.close()
    return {"wall_s": round(wall, 3), "requests": ep.usage["requests"], "prompt_tokens": ep.usage["prompt_tokens"],
            "prompt_tokens_computed": ep.usage["prompt_tokens"] - hit, "result": result}


def run_bench(quick: bool = False, out_json: str | None = "docs/perf/programs.json",
              model_dir: str | None = None, questions: int | None = None, sizes: Sizes | None = None,
              only: tuple[str, ...] = ("tot", "extract", "select")) -> dict:
    """`questions`: fewer multiple-choice questions than the issue's 64 (a slow or shared machine);
    `sizes`: other sizes altogether (the smoke test's); `only`: some of the programs."""
    from worker.engine.tokenizer import load_tokenizer

    sizes = sizes or (QUICK if quick else Sizes())
    if questions:
        sizes = replace(sizes, questions=questions)
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-programs-"))
    model = Path(model_dir) if model_dir else _model(tmp, quick)
    tokenizer = load_tokenizer(model)
    procs = Processes(tmp / "logs")
    finished = False
    try:
        with ThreadPoolExecutor(3) as pool:  # the three start side by side
            started = {way: pool.submit(Stack, procs, name, model, caching)
                       for way, name, caching in (("program_cached", "cached", True),
                                                  ("program_uncached", "uncached", False),
                                                  ("naive", "naive", True))}
            stacks = {way: future.result() for way, future in started.items()}
        timed = _inputs(random.Random(23), tokenizer, sizes)
        warming = _inputs(random.Random(99), tokenizer, replace(sizes, questions=2))  # warming needs few
        report = {"quick": quick, "sizes": sizes.__dict__, "model": str(model), "programs": {}}
        for name in only:
            rows = {}
            for way, stack in stacks.items():
                run = _way(name, way == "naive", sizes)
                warm(stack, lambda ep: run(ep, warming))
                rows[way] = measure(stack, lambda ep: run(ep, timed))
            same = rows["program_cached"].pop("result") == rows["naive"].pop("result")
            rows["program_uncached"].pop("result")
            rows["program_uncached"]["prompt_tokens_computed"] = rows["program_uncached"]["prompt_tokens"]
            report["programs"][name] = {**rows, "same_results": same,
                                        "speedup_vs_naive": round(rows["naive"]["wall_s"] / rows["program_cached"]["wall_s"], 2),
                                        "speedup_vs_uncached": round(rows["program_uncached"]["wall_s"] / rows["program_cached"]["wall_s"], 2)}
            _write(report, out_json)  # each program as it ends: a long run keeps what it measured
        finished = True
    finally:
        procs.stop_all()
        if finished:  # the stacks' logs (and a model built for the run) are only worth keeping after a failure
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kvgate bench programs: the stacks' logs are kept in {tmp / 'logs'}", file=sys.stderr)
    print(format_table(report))
    return report


def _write(report: dict, out_json: str | None) -> None:
    p = report["programs"]
    report["figures"] = {f"programs.{name}_vs_naive": p[name]["speedup_vs_naive"]
                         for name in ("tot", "extract", "select") if name in p}
    report["target"] = {"programs.tot_vs_naive": f">= {TARGET}", "programs.extract_vs_naive": f">= {TARGET}"}
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(report, indent=2) + "\n")


def _inputs(rng: random.Random, tokenizer, sizes: Sizes) -> dict:
    return {"question": _text(rng, tokenizer, 12), "document": _text(rng, tokenizer, sizes.doc_tokens),
            "instruction": _text(rng, tokenizer, sizes.instruction_tokens),
            "questions": [(_text(rng, tokenizer, 12), [" " + _text(rng, tokenizer, rng.randint(1, 4))
                                                      for _ in range(sizes.choices)])
                          for _ in range(sizes.questions)]}


def _way(name: str, naive: bool, sizes: Sizes):
    """run(endpoint, inputs) -> the results, for one program written as a program or naively."""
    if name == "tot":
        if naive:
            return lambda ep, x: naive_tree(ep, x["question"], sizes)
        return lambda ep, x: tree_of_thought.run(question=x["question"], sizes=sizes, backend=ep)["leaves"]
    if name == "extract":
        if naive:
            return lambda ep, x: naive_extract(ep, x["document"])
        return lambda ep, x: _fields(extract.run(document=x["document"], backend=ep))
    if naive:
        return lambda ep, x: [naive_choice(ep, x["instruction"], q, c) for q, c in x["questions"]]
    return lambda ep, x: [s["answer"] for s in multiple_choice.run_batch(
        [{"instruction": x["instruction"], "question": q, "choices": c} for q, c in x["questions"]],
        backend=ep, max_concurrency=8)]


def _fields(state) -> dict:
    return {f: state[f] for f in FIELDS}


def _model(tmp: Path, quick: bool) -> Path:
    if quick:
        from worker.models.demo import build_model_dir

        return build_model_dir(tmp / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               intermediate_size=128)
    from kvgate.bench.engine import build_model

    return build_model(tmp / "model")


def format_table(report: dict) -> str:
    lines = ["program   way               wall s   requests  prompt tok  computed"]
    for name, rows in report["programs"].items():
        for way in ("program_cached", "program_uncached", "naive"):
            r = rows[way]
            lines.append(f"{name:9} {way:16} {r['wall_s']:8.2f} {r['requests']:9d} {r['prompt_tokens']:11d} "
                         f"{r['prompt_tokens_computed']:9d}")
        lines.append(f"{name:9} speedup vs naive {rows['speedup_vs_naive']}x, vs uncached "
                     f"{rows['speedup_vs_uncached']}x, same results: {rows['same_results']}")
    return "\n".join(lines)
