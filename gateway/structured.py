"""Structured outputs, gateway side: the one constraint a request asks for, whichever way it spells
it (`response_format`, vLLM's `structured_outputs`, the older `guided_*`, or a forced tool call),
checked before anything is queued: a JSON schema must be a valid schema (the jsonschema meta-check)
and every constraint must compile (xgrammar's grammar front end needs no tokenizer), so a worker
never meets a constraint it cannot build. The engine compiles it again against its vocabulary."""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.bounds import SCHEMA_DEPTH
from shared.errors import InvalidRequest, InvalidStructuredOutput
from shared.sampling import StructuredOutputs, json_depth

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    param: str  # how the client spelled it, named in a 400
    outputs: StructuredOutputs


def _schema_text(schema: dict | str) -> str:
    return schema if isinstance(schema, str) else orjson.dumps(schema).decode()


def _from_response_format(rf) -> StructuredOutputs | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputs(json_object=True)
    if rf.type != "json_schema":
        raise InvalidRequest(f"response_format type '{rf.type}' is not supported; use text, "
                             f"json_object or json_schema", param="response_format.type")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidRequest("response_format json_schema needs json_schema.schema",
                             param="response_format.json_schema")
    return StructuredOutputs(json=_schema_text(rf.json_schema.schema_))


def _from_structured_outputs(so) -> StructuredOutputs | None:
    if so is None:
        return None
    values = {"json": so.json_, "json_object": so.json_object or None, "regex": so.regex,
              "choice": so.choice, "grammar": so.grammar}
    chosen = [k for k, v in values.items() if v is not None]
    if len(chosen) != 1:
        raise InvalidRequest(f"structured_outputs sets {', '.join(chosen) or 'nothing'}: set "
                             f"exactly one of {', '.join(KINDS)}", param="structured_outputs")
    kind = chosen[0]
    return StructuredOutputs(**{kind: _schema_text(so.json_) if kind == "json" else values[kind]})


def requested(body) -> list[Constraint]:
    """Every constraint the body asks for, by each spelling it used."""
    asked = [
        ("response_format", _from_response_format(body.response_format)),
        ("structured_outputs", _from_structured_outputs(body.structured_outputs)),
        ("guided_json", None if body.guided_json is None
         else StructuredOutputs(json=_schema_text(body.guided_json))),
        ("guided_regex", body.guided_regex and StructuredOutputs(regex=body.guided_regex)),
        ("guided_choice", body.guided_choice and StructuredOutputs(choice=body.guided_choice)),
        ("guided_grammar", body.guided_grammar and StructuredOutputs(grammar=body.guided_grammar)),
    ]
    return [Constraint(param, so) for param, so in asked if so is not None]


def one(constraints: list[Constraint]) -> Constraint | None:
    """The constraint, or 400 naming the two when a request asks for more than one."""
    if len(constraints) > 1:
        first, second = constraints[0].param, constraints[1].param
        raise InvalidRequest(f"{first} and {second} both constrain the output; send only one",
                             param=second)
    return constraints[0] if constraints else None


def meta_check(schema: Any, param: str) -> None:
    """400 unless `schema` is a valid JSON schema (checked against its own meta-schema), nested
    no deeper than SCHEMA_DEPTH."""
    import jsonschema  # imported on first use: most requests carry no schema

    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{param}: a JSON schema must be an object", param=param,
                             code="invalid_schema")
    if json_depth(schema) > SCHEMA_DEPTH:
        raise InvalidRequest(f"{param}: the schema nests deeper than {SCHEMA_DEPTH} levels",
                             param=param, code="invalid_schema")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator
                                            ).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top"
        raise InvalidRequest(f"{param} is not a valid JSON schema at {where}: {exc.message}",
                             param=param, code="invalid_schema") from None
    except RecursionError:
        raise InvalidRequest(f"{param}: the schema is nested too deeply", param=param,
                             code="invalid_schema") from None


@functools.cache
def _xgrammar():
    import xgrammar  # slow to import (it brings torch): once, off the event loop

    return xgrammar


@functools.lru_cache(maxsize=256)  # agents send the same schema again and again; only a pass is kept
def _checked(json_text: str | None, regex: str | None, grammar: str | None, param: str) -> None:
    xgr = _xgrammar()
    if json_text is not None:
        try:
            schema = orjson.loads(json_text)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"{param}: the schema is not JSON: {exc}", param=param,
                                 code="invalid_schema") from None
        meta_check(schema, param)
        xgr.Grammar.from_json_schema(json_text)
    elif regex is not None:
        xgr.Grammar.from_regex(regex)
    elif grammar is not None:
        xgr.Grammar.from_ebnf(grammar)


async def check(constraint: Constraint, timeout_s: float) -> None:
    """400 naming the problem unless the constraint is valid and compiles within `timeout_s`."""
    so, param = constraint.outputs, constraint.param
    if so.json is None and so.regex is None and so.grammar is None:
        return  # json_object and choice: nothing a client could get wrong here
    await asyncio.to_thread(_xgrammar)
    try:
        await asyncio.wait_for(asyncio.to_thread(_checked, so.json, so.regex, so.grammar, param),
                               timeout_s)
    except asyncio.TimeoutError:
        raise InvalidStructuredOutput(f"{param} did not compile within {timeout_s:g} s; simplify it",
                                      param=param) from None
    except RuntimeError as exc:  # xgrammar's parse errors: "[time] file.cc:line: what went wrong"
        problem = str(exc).strip().split(": ", 1)[-1]
        raise InvalidStructuredOutput(f"{param} does not compile: {problem}", param=param) from None
