"""One choice's grammar state: an xgrammar matcher advanced by every token the choice emits, the
reasoning gate that keeps it off while the model is thinking, and the meter that bounds what its
matching may cost the step loop.

The state is a function of the tokens alone, so it is rebuilt by feeding them again: a request
resumed on another worker replays its emitted tokens through `accept` before it runs. Preemption
by recompute keeps the Sequence, and with it the matcher, so there is nothing to rebuild there.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from shared.reasoning import Harmony, HarmonyIds, thinking
from worker.engine.structured import CODE, PARAM
from worker.engine.types import EngineRejected


@dataclass(frozen=True)
class ThinkMarkers:
    start_id: int
    end_id: int


@dataclass(frozen=True)
class HarmonyGate:
    """harmony's special tokens and a header decoder: each choice's state from its prompt."""

    ids: HarmonyIds
    decode: Callable[[list[int]], str]

    def state(self, prompt_ids: Tokens[int]) -> Harmony:
        return Harmony(self.ids, self.decode, prompt_ids)


class MatchingMeter:
    """What matching costs one choice, in this thread's CPU time (a busy machine does not count),
    held to `max_token_ms` a token on average over its last WINDOW tokens. An ambiguous grammar's
    matching grows with the output (`root ::= s; s ::= s s | "a"`: 20 ms a token at 400 tokens, a
    second at 1,150) and runs on the step loop, where it holds up every request of the batch. A
    legitimate grammar can cost one token far more than the rest when an unusual split of the text
    into tokens reaches a state its precomputed masks do not cover (9-26 ms with a 32k vocabulary,
    against 0.12 ms at p50), which the window absorbs. Past the bound `charge` raises, which ends
    this request alone with a 400."""

    WINDOW = 16

    def __init__(self, max_token_ms: float):
        self.max_token_ms = max_token_ms
        self._recent: deque[int] = deque()  # the last WINDOW tokens' matching, ns each
        self._sum_ns = 0
        self.pending_ns = 0  # the current token's so far: its mask, before its accept

    def charge(self, ns: int) -> None:
        """One token's matching is done (its mask's, in pending_ns, and `ns` more)."""
        ns, self.pending_ns = ns + self.pending_ns, 0
        self._recent.append(ns)
        self._sum_ns += ns
        if len(self._recent) > self.WINDOW:
            self._sum_ns -= self._recent.popleft()
        if self._sum_ns > self.max_token_ms * 1e6 * self.WINDOW:
            raise EngineRejected(
                f"matching the structured_outputs grammar took {self._sum_ns / 1e6:.0f} ms of CPU for "
                f"its last {len(self._recent)} tokens; at most {self.max_token_ms:g} ms a token on "
                f"average over {self.WINDOW} (structured_max_token_ms). An ambiguous grammar's "
                "matching grows with the output: simplify the grammar", CODE, PARAM)


class Constraint:
    def __init__(self, compiled_grammar, prompt_ids: Tokens[int], markers: ThinkMarkers | None,
                 max_token_ms: float = float("inf")):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.markers = markers
        self.meter = MatchingMeter(max_token_ms)
        # the rule the worker splits reasoning text by (shared/reasoning.py): thinking at the start
        # when the prompt opened it, until the first end marker (accept), never again; a harmony
        # reply until its final channel's body begins
        self.harmony = markers.state(prompt_ids) if isinstance(markers, HarmonyGate) else None
        if self.harmony is not None:
            self.thinking = self.harmony.thinking
        else:
            self.thinking = markers is not None and thinking(prompt_ids, (), markers.start_id, markers.end_id)

    @property
    def active(self) -> bool:
        """Masks this step's logits: not while thinking, nor once the grammar has ended."""
        return not self.thinking and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one emitted token; False when the grammar refuses it."""
        if self.thinking and self.harmony is not None:
            self.harmony.feed(token)
            self.thinking = self.harmony.thinking
            return True
        if self.thinking:
            self.thinking = token != self.markers.end_id
            return True
        start = time.thread_time_ns()
        accepted = self.matcher.accept_token(token)
        self.meter.charge(time.thread_time_ns() - start)
        return accepted

    def replay(self, output_ids: Tokens[int]) -> bool:
        """Rebuild from the tokens a resumed choice already emitted."""
        return all(self.accept(token) for token in output_ids)

    def fill(self, bitmask, row: int) -> None:
        start = time.thread_time_ns()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.meter.pending_ns += time.thread_time_ns() - start


def think_markers(parser: str | None, tokenizer) -> ThinkMarkers | HarmonyGate | None:
    """The parser's markers as token ids, resolved once. None (no parser configured) takes the one
    the chat template implies, as the worker does; markers that are not single tokens of this
    vocabulary leave the gate off when implied, and stop the engine when configured."""
    from shared import reasoning

    name = parser or reasoning.detect(getattr(tokenizer, "chat_template", None))
    if name is None:
        return None
    if name == reasoning.HARMONY:
        from worker.engine.tokenizer import marker_ids

        ids = marker_ids(tokenizer, reasoning.HARMONY_TOKENS)
        if ids is None:
            if parser is None:
                return None
            raise ValueError("reasoning_parser 'harmony': its special tokens are not tokens of this model's vocabulary")
        return HarmonyGate(HarmonyIds(*ids), lambda header: tokenizer.decode(header, skip_special_tokens=True))
    if name not in reasoning.PARSERS:
        raise ValueError(f"unknown reasoning_parser {name!r}: one of {', '.join(reasoning.PARSERS)}")
    from worker.engine.tokenizer import marker_ids

    markers = reasoning.PARSERS[name]
    ids = marker_ids(tokenizer, (markers.start, markers.end))  # as the worker's split reads them
    if ids is None:
        if parser is None:
            return None
        raise ValueError(f"reasoning_parser {name!r}: {markers.start} and {markers.end} are not "
                         "tokens of this model's vocabulary")
    return ThinkMarkers(*ids)
