"""Grammars for structured outputs: a request's spec (JSON schema, any JSON object, regex, choice or
EBNF) compiled by xgrammar against the model's vocabulary, off the step loop, once per distinct spec.

Compiles run on a small thread pool (xgrammar releases the GIL while it compiles), so a slow one
delays only its own request, which waits outside the batch until its grammar is ready. Tenants take
turns at the pool, one compile running per tenant: a compile cannot be stopped, so one past its
deadline still holds its thread, and a tenant sending slow schemas must not make every other
tenant's constrained requests wait behind them (requests without a tenant share the whole pool).
A queued compile that every request wanting it gave up on is dropped, not run. Results are kept
in an LRU keyed by a hash of the spec, bounded in entries and in bytes (a compiled grammar's token
masks grow with the vocabulary: a 28 KB schema of 300 integer ranges holds 44 MB with a 32k
vocabulary, so 256 of them would be 11 GB); one larger than the whole bound is refused. A failed
compile is remembered as well, so a bad spec sent again fails at once. xgrammar is imported
lazily: the GPU image has no xgrammar and an engine without constrained requests never needs it
(tests/ops/test_gpu_image_imports.py).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor

from shared.sampling import SCHEMA_DEPTH, StructuredOutputs, json_depth
from worker.engine.types import EngineRejected

CODE = "invalid_structured_output"  # shared/errors.py maps it to a 400
PARAM = "structured_outputs"
CACHE_SIZE = 256  # compiled grammars kept at most; a plain JSON schema's is ~50 KB for a 32k vocabulary
COMPILE_THREADS = 2
# xgrammar 0.2.9 writes a string with maxLength/minLength as characters [^"\\\r\n]: raw control
# characters (invalid JSON, refused by json.loads); its unbounded strings exclude \0-\x1f, as here
LAX_STRING_CHAR, STRICT_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[00:28:09] /project/cpp/x.cc:94: "


def the_spec(spec: StructuredOutputs) -> tuple[str, str | bool | list[str]]:
    """(kind, value) of the one field set; refuses none or several."""
    set_ = [(k, v) for k, v in (("json", spec.json), ("json_object", spec.json_object or None),
                                ("regex", spec.regex), ("choice", spec.choice), ("grammar", spec.grammar))
            if v is not None]
    if len(set_) != 1:
        names = ", ".join(k for k, _ in set_) or "none"
        raise EngineRejected(f"structured_outputs must set exactly one of json, json_object, regex, "
                             f"choice, grammar; got {names}", CODE, PARAM)
    return set_[0]


def check_spec(spec: StructuredOutputs, max_bytes: int) -> str:
    """What can be refused before compiling (size, JSON syntax, an empty choice); returns the
    cache key."""
    kind, value = the_spec(spec)
    text = json.dumps(value) if kind in ("choice", "json_object") else value
    size = len(text.encode())
    if size > max_bytes:
        raise EngineRejected(f"the structured_outputs {kind} is {size} bytes; at most {max_bytes} "
                             "(structured_max_spec_bytes) are compiled", CODE, PARAM)
    if kind == "json":
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise EngineRejected(f"structured_outputs json is not valid JSON: {exc}", CODE, PARAM) from None
        if json_depth(schema) > SCHEMA_DEPTH:
            raise EngineRejected(f"the structured_outputs json schema nests deeper than {SCHEMA_DEPTH} levels",
                                 CODE, PARAM)
    if kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
        raise EngineRejected("structured_outputs choice must be a non-empty list of non-empty strings",
                             CODE, PARAM)
    return hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=16).hexdigest()


def timed_out(timeout_s: float) -> str:
    """What a request whose grammar was not ready within structured_compile_timeout_s is told."""
    return (f"the structured_outputs grammar did not compile within {timeout_s:g} s "
            "(structured_compile_timeout_s); simplify the schema")


def json_schema_ebnf(schema: str) -> str:
    """The schema's grammar with fixed separators (with any whitespace allowed, a model may pad a
    structure until max_tokens: vLLM's disable_any_whitespace) and strict JSON string characters."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(LAX_STRING_CHAR, STRICT_STRING_CHAR)


def compile_error(spec: StructuredOutputs, exc: BaseException) -> str:
    """xgrammar's message without its log prefix, naming the spec's kind."""
    kind, _ = the_spec(spec)
    detail = _XGRAMMAR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
    return f"the structured_outputs {kind} could not be compiled: {detail}"


class Grammars:
    """The compiler for one model's vocabulary, its thread pool and its LRU of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_spec_bytes: int,
                 cache_bytes: int = 512 << 20, compile_timeout_s: float = float("inf")):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self.max_spec_bytes, self.cache_bytes = max_spec_bytes, cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self._compiler = None  # built on the first constrained request
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes of each cached grammar, once compiled
        self._cache_lock = threading.RLock()  # compiles end on the pool's threads (or at once, in submit)
        # compiles not started, per tenant in turn: (cache key, spec, the future its requests hold)
        self._queued: dict[str | None, deque[tuple[str, StructuredOutputs, Future]]] = {}
        self._wanted: dict[str, float] = {}  # cache key -> when the last request wanting it gives up
        self._running: dict[str | None, int] = {}  # compiles on the pool per tenant
        self.compile_seconds: list[float] = []  # each compile's wall time (the benchmark reads it)

    @property
    def cached_bytes(self) -> int:
        return sum(self._sizes.values())

    def submit(self, spec: StructuredOutputs, tenant: str | None = None) -> Future:
        """The compiled grammar's future: cached (done), compiling, or queued for `tenant`'s turn."""
        key = check_spec(spec, self.max_spec_bytes)
        with self._cache_lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = Future()
                future.add_done_callback(lambda done: self._sized(key, done))
                self._queued.setdefault(tenant, deque()).append((key, spec, future))
            if not future.done():
                self._wanted[key] = time.monotonic() + self.compile_timeout_s
            self._cache.move_to_end(key)
            self._trim()
            self._dispatch()
        return future

    def _dispatch(self) -> None:
        """Each tenant without a compile running starts its next one (the tenant-less share all
        COMPILE_THREADS); a tenant with more queued goes to the back of the turn."""
        for tenant in list(self._queued):
            queue = self._queued.pop(tenant)
            while queue and self._running.get(tenant, 0) < (COMPILE_THREADS if tenant is None else 1):
                key, spec, future = queue.popleft()
                if time.monotonic() > self._wanted.pop(key, 0.0):  # its requests all timed out
                    if self._cache.get(key) is future:
                        del self._cache[key]
                    future.set_exception(EngineRejected(timed_out(self.compile_timeout_s), CODE, PARAM))
                    continue
                self._running[tenant] = self._running.get(tenant, 0) + 1
                self._pool.submit(self._run, tenant, spec, future)
            if queue:
                self._queued[tenant] = queue

    def _run(self, tenant: str | None, spec: StructuredOutputs, future: Future) -> None:
        """On the pool: compile, let the tenant's next compile start, then answer its requests."""
        try:
            grammar, error = self._compile(spec), None
        except Exception as exc:
            grammar, error = None, exc
        with self._cache_lock:
            self._running[tenant] -= 1
            self._dispatch()
        if error is None:
            future.set_result(grammar)
        else:
            future.set_exception(error)

    def _sized(self, key: str, future: Future) -> None:
        """A compile ended: its grammar's bytes count against the cache's bound."""
        if future.exception() is not None:
            return
        with self._cache_lock:
            if self._cache.get(key) is future:
                self._sizes[key] = future.result().memory_size_bytes
                self._trim()

    def _trim(self) -> None:
        """Least recently used out until the bounds hold (the newest entry always stays)."""
        while len(self._cache) > CACHE_SIZE or (len(self._cache) > 1 and self.cached_bytes > self.cache_bytes):
            old, _ = self._cache.popitem(last=False)
            self._sizes.pop(old, None)

    def _compile(self, spec: StructuredOutputs):
        start = time.perf_counter()
        compiler = self.compiler()
        kind, value = the_spec(spec)
        try:
            if kind == "json":
                grammar = compiler.compile_grammar(json_schema_ebnf(value))
            elif kind == "json_object":
                grammar = compiler.compile_grammar(json_schema_ebnf('{"type": "object"}'))
            elif kind == "regex":
                grammar = compiler.compile_regex(value)
            elif kind == "choice":
                literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
                grammar = compiler.compile_grammar(f"root ::= {literals}")
            else:
                grammar = compiler.compile_grammar(value)
        except Exception as exc:
            raise EngineRejected(compile_error(spec, exc), CODE, PARAM) from None
        self._check_opening(grammar, kind)
        self.compile_seconds.append(time.perf_counter() - start)
        if grammar.memory_size_bytes > self.cache_bytes:
            raise EngineRejected(f"the structured_outputs {kind} compiles to a grammar of "
                                 f"{grammar.memory_size_bytes / 2**20:.1f} MiB for this model's vocabulary; "
                                 f"at most {self.cache_bytes / 2**20:g} MiB (structured_cache_mb): "
                                 "simplify it", CODE, PARAM)
        return grammar

    def _check_opening(self, grammar, kind: str) -> None:
        """A grammar that allows no first token has nothing in its language (`[^\\s\\S]`); a JSON
        schema whose only string is the empty one is one xgrammar could not express (a number range
        narrower than it writes digits: minimum 1e-7, maximum 2e-7), since no JSON document is empty.
        Either is refused before any token (a grammar that dead-ends later is caught as it samples:
        logit_rules.GrammarMasks)."""
        import torch
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask, 0)
        allowed = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:self._vocab_size]
        stops = [t for t in self._eos_token_ids if t < self._vocab_size]
        if not bool(allowed.any()):
            raise EngineRejected(f"the structured_outputs {kind} can match nothing: its grammar allows no first "
                                 "token (an empty character class or range?)", CODE, PARAM)
        if kind in ("json", "json_object") and not bool(allowed.index_fill(0, torch.tensor(stops, dtype=torch.long),
                                                                                0).any()):
            raise EngineRejected("the structured_outputs json schema compiles to a grammar of the empty string "
                                 "only: xgrammar cannot express it (a number range narrower than the digits "
                                 "it writes?)", CODE, PARAM)

    def compiler(self):
        """xgrammar's compiler, its TokenizerInfo built from the HF tokenizer with the model's
        vocabulary size (embedding rows past the tokenizer's are never allowed), as vLLM does."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
        return self._compiler

    def _build_compiler(self):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                  stop_token_ids=self._eos_token_ids)
        # our LRU bounds what is kept; xgrammar's own cache would grow without one
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
