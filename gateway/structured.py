"""Structured outputs, gateway side: the one constraint a request asks for, whichever way it spells
it (`response_format`, vLLM's `structured_outputs`, the older `guided_*`, or a forced tool call),
checked before anything is queued: a JSON schema must be a valid schema (the jsonschema meta-check)
and every constraint must compile (xgrammar's grammar front end needs no tokenizer), so a worker
never meets a constraint it cannot build. The engine compiles it again against its vocabulary."""
from __future__ import annotations

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


@dataclass(frozen=True)
class Check:
    """One thing to check before a request is queued: `kind` is schema (a tool's parameters: the
    meta-check), json (the meta-check and the compile), regex or grammar."""
    kind: str
    text: str
    param: str

    def refusal(self, code: str, detail: str) -> InvalidRequest:
        """The 400 for a `problem` this check's text has, naming where the client sent it."""
        if code == "invalid_schema":
            return InvalidRequest(f"{self.param}{detail}", param=self.param, code=code)
        return InvalidStructuredOutput(f"{self.param}{detail}", param=self.param)

    def late(self, timeout_s: float) -> InvalidStructuredOutput:
        """The 400 for a check that ran past the checker's time bound."""
        what = "could not be checked" if self.kind == "schema" else "did not compile"
        return InvalidStructuredOutput(f"{self.param} {what} within {timeout_s:g} s; simplify it",
                                       param=self.param)


def checks(constraint: Constraint | None, tools) -> list[Check]:
    """What a request's tools and constraint need checked (json_object and choice: nothing a
    client could get wrong)."""
    found = [Check("schema", orjson.dumps(tool.function.parameters).decode(),
                   f"tools.{i}.function.parameters")
             for i, tool in enumerate(tools or ()) if tool.function.parameters is not None]
    so = constraint.outputs if constraint is not None else None
    for kind in ("json", "regex", "grammar"):
        if so is not None and getattr(so, kind) is not None:
            found.append(Check(kind, getattr(so, kind), constraint.param))
    return found


def problem(kind: str, text: str) -> tuple[str, str] | None:
    """What is wrong with one check's text, as (code, the message after the param), or None. Slow
    (Python's jsonschema, xgrammar's front end) and run where it cannot stall the gateway (the
    checker process, gateway/checker.py)."""
    if kind in ("schema", "json"):
        try:
            schema = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            return "invalid_schema", f": the schema is not JSON: {exc}"
        found = _meta_problem(schema)
        if found is not None or kind == "schema":
            return found
        unenforced = _unenforced(schema)
        if unenforced is not None:
            return "invalid_schema", (f" uses {unenforced[1]} at {unenforced[0]}, which the grammar cannot enforce "
                                      f"(none of {', '.join(UNENFORCED)} is): the output could break it; leave it out")
    import xgrammar as xgr

    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except RuntimeError as exc:
        return "invalid_structured_output", f" does not compile: {_xgrammar_words(str(exc))}"
    return None


def _xgrammar_words(error: str) -> str:
    """xgrammar's error ("[time] file.cc:line: what went wrong", or an assertion's "Check failed:
    (expression) is false: what") as what went wrong, in words about the request."""
    said = error.strip().split(": ", 1)[-1]
    if said.startswith("Check failed:"):
        said = said.split(" is false: ", 1)[-1]
        if "INT64" in error:
            said += " (an integer's bounds must lie within 64 bits, ±9223372036854775807)"
    return said


# JSON schema keywords xgrammar's grammars do not enforce: their grammar is that of the schema without
# them (checked by comparing the two), or for `not` and `if`, an equivalent one; an output could break
# them and still be "valid", so a schema that uses one is refused by name rather than half-honoured
UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
              "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf", "items")


def _unenforced(schema: Any) -> tuple[str, str] | None:
    """(where, keyword) of the first keyword of UNENFORCED the schema uses, walking only where
    schemas are (a property named "not" is a name, not a keyword; an enum's values are data)."""
    todo = [(schema, "#")]
    while todo:
        node, where = todo.pop()
        if not isinstance(node, dict):
            continue
        for word in UNENFORCED:
            if word in node:
                return where, word
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                todo += [(sub, f"{where}/{key}/{name}") for name, sub in node[key].items()]
        for key in _SCHEMA_ONE:
            if isinstance(node.get(key), dict):
                todo.append((node[key], f"{where}/{key}"))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                todo += [(sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key])]
    return None


def _meta_problem(schema: Any) -> tuple[str, str] | None:
    """Unless `schema` is a valid JSON schema (checked against its own meta-schema), nested no
    deeper than SCHEMA_DEPTH: what is wrong with it."""
    import jsonschema  # imported on first use: most requests carry no schema

    if not isinstance(schema, (dict, bool)):
        return "invalid_schema", ": a JSON schema must be an object"
    if json_depth(schema) > SCHEMA_DEPTH:
        return "invalid_schema", f": the schema nests deeper than {SCHEMA_DEPTH} levels"
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator
                                            ).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top"
        return "invalid_schema", f" is not a valid JSON schema at {where}: {exc.message}"
    except RecursionError:
        return "invalid_schema", ": the schema is nested too deeply"
    return None

