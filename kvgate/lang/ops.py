"""What a program appends to its state: text, a role message, a generation, a selection. Each is a
plain value; the state (state.py) runs them in order."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class Gen:
    """Generate into variable `name`: at most `max_tokens`, ending at a `stop` string (excluded), under
    at most one constraint (regex, json_schema, or one of `choices`); None: the server's default."""

    name: str
    max_tokens: int | None = None
    stop: list[str] | str | None = None
    temperature: float | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: dict | str | None = None
    choices: list[str] | None = None
    top_p: float | None = None

    @property
    def step(self) -> str:
        return f"gen '{self.name}'"

    def params(self) -> dict[str, Any]:
        """The request's sampling fields (OpenAI's and vLLM's names), None left out."""
        out = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed,
               "top_p": self.top_p, "stop": [self.stop] if isinstance(self.stop, str) else self.stop}
        constraint = {"regex": self.regex, "json": self.json_schema, "choice": self.choices}
        constraint = {k: v for k, v in constraint.items() if v is not None}
        if len(constraint) > 1:
            raise ValueError(f"{self.step}: at most one of regex, json_schema and choices")
        if constraint:
            out["structured_outputs"] = constraint
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Select:
    """Set variable `name` to the choice whose tokens are likeliest after the state: the highest mean
    token log-probability (length-normalised, so a long choice is not penalised for its length)."""

    name: str
    choices: list[str]

    @property
    def step(self) -> str:
        return f"select '{self.name}'"


Part = Union[str, Gen, Select]


@dataclass(frozen=True)
class Role:
    """A chat message: the model's role markers around `parts` (text, or a generation)."""

    role: str
    parts: list[Part] = field(default_factory=list)

    @property
    def step(self) -> str:
        return f"{self.role}(...)"


def gen(name: str, max_tokens: int | None = None, stop: list[str] | str | None = None,
        temperature: float | None = None, seed: int | None = None, regex: str | None = None,
        json_schema: dict | str | None = None, choices: list[str] | None = None,
        top_p: float | None = None) -> Gen:
    return Gen(name, max_tokens, stop, temperature, seed, regex, json_schema, choices, top_p)


def select(name: str, choices: list[str]) -> Select:
    if not choices:
        raise ValueError(f"select '{name}': no choices")
    return Select(name, list(choices))


def _role(role: str):
    def make(*parts: Part) -> Role:
        return Role(role, list(parts))
    make.__name__ = role
    make.__doc__ = f"A {role} message of the served model's chat template."
    return make


system, user, assistant = _role("system"), _role("user"), _role("assistant")
