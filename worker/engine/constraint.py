"""One choice's grammar state: an xgrammar matcher advanced by every token the choice emits, and the
reasoning gate that keeps it off while the model is thinking.

The state is a function of the tokens alone, so it is rebuilt by feeding them again: a request
resumed on another worker replays its emitted tokens through `accept` before it runs. Preemption
by recompute keeps the Sequence, and with it the matcher, so there is nothing to rebuild there.
"""
from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from shared.reasoning import thinking


@dataclass(frozen=True)
class ThinkMarkers:
    start_id: int
    end_id: int


class Constraint:
    def __init__(self, compiled_grammar, prompt_ids: Tokens[int], markers: ThinkMarkers | None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.markers = markers
        # the rule the worker splits reasoning text by (shared/reasoning.py): thinking at the start
        # when the prompt opened it, until the first end marker (accept), never again
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
        if self.thinking:
            self.thinking = token != self.markers.end_id
            return True
        return self.matcher.accept_token(token)

    def replay(self, output_ids: Tokens[int]) -> bool:
        """Rebuild from the tokens a resumed choice already emitted."""
        return all(self.accept(token) for token in output_ids)

    def fill(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def think_markers(parser: str | None, tokenizer) -> ThinkMarkers | None:
    """The parser's markers as token ids, resolved once. None (no parser configured) takes the one
    the chat template implies, as the worker does; markers that are not single tokens of this
    vocabulary leave the gate off when implied, and stop the engine when configured."""
    from shared import reasoning

    name = parser or reasoning.detect(getattr(tokenizer, "chat_template", None))
    if name is None:
        return None
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
