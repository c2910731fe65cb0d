"""Constrained decoding: a reply that must match a grammar (a JSON schema, any JSON object, the
tool-call format), one token mask per step.

    constraint = json_schema(schema, "response_format.json_schema.schema")   # caps, then compile
    request = GenerationRequest(..., constraint=constraint)                  # plain data: pickled
    matcher = vocab.matcher(request.constraint, request.stop_ids)             # in the runner
    allowed = matcher.allowed()       # bool (n_vocab,): the ids the grammar allows next
    matcher.seen(token)

The grammar engine is llguidance (chosen by measurement: docs/api.md, tools/grammar_engines.py):
it computes a mask in about 10 us a token on the embedded tokenizer, and it refuses what would
blow up (a schema too large, too deep, a lexer past its fuel) with a message instead of hanging.
Our own caps come first, checked on the parsed schema before anything compiles, each refusal an
`InputError` that names the field and the limit (`ConstraintError.param`).

A `Constraint` is plain data: the llguidance grammar as text (and the schema it came from, for a
remote server that constrains on its own, engine/remote.py). A `Vocab` is one tokenizer's view for
llguidance, built once on first use (~0.3 s); a `Matcher` is one request's state: where the
grammar may end, the request's stop ids are allowed; once it must end, only they are.

Owns: the caps, the grammars, the masks. Must not: know the API's wire shapes, or sample (the
sampler applies the mask where the loop guard's ban goes, engine/runners/sampling.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmweb.errors import InputError

MAX_SCHEMA_CHARS = 64_000  # a schema's JSON text, at most
MAX_DEPTH = 32  # objects and arrays nested in a schema, at most
MAX_NODES = 5_000  # objects in a schema (properties, items, branches), at most
MAX_PATTERN_CHARS = 1_000  # a `pattern`'s length, at most
MAX_REPEAT = 1_000  # a bound of a counted repetition {n,m} in a `pattern`, at most
# as json.dumps writes JSON (what a model has read most), no free whitespace (a small model would
# fill it), oneOf read as anyOf, keywords llguidance does not implement ("format": "uri") ignored
JSON_OPTIONS: Any = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
JSON_OPTIONS.update(coerce_one_of=True, lenient=True)
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class ConstraintError(InputError):
    """A schema or grammar that cannot be used; `param` names the request field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a reply must match: llguidance's grammar as text; `schema` the JSON schema it was
    built from ("" for a grammar of ours: a remote server gets the schema, or refuses)."""

    grammar: str
    schema: str = ""
    kind: str = "json_schema"  # json_schema | json_object | tools


def check_schema(schema: Any, param: str) -> str:
    """The schema's JSON text, after the caps: its size, its depth, its node count, its patterns.
    Iterative: a schema nested any depth is measured without recursion."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"{param} must be a JSON schema object.", param)
    depth_of: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while depth_of:
        node, depth = depth_of.pop()
        if depth > MAX_DEPTH:
            raise ConstraintError(f"{param} is nested more than {MAX_DEPTH} deep (the limit).", param)
        if isinstance(node, dict):
            nodes += 1
            if nodes > MAX_NODES:
                raise ConstraintError(f"{param} has more than {MAX_NODES:,} objects (the limit).", param)
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_pattern(pattern, f"{param} (a pattern)", param)
            depth_of.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            depth_of.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise ConstraintError(
            f"{param} is {len(text):,} characters; the limit is {MAX_SCHEMA_CHARS:,}.",
            param,
        )
    return text


def check_pattern(pattern: str, what: str, param: str) -> None:
    """A regex `pattern` within the caps: its length and its counted repetitions' bounds."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConstraintError(f"{what} is {len(pattern):,} characters; the limit is {MAX_PATTERN_CHARS:,}.", param)
    for m in _REPEAT.finditer(pattern):
        if any(g and int(g) > MAX_REPEAT for g in m.groups()):
            raise ConstraintError(f"{what} repeats {m.group(0)} times; the limit is {MAX_REPEAT:,}.", param)


def json_schema(schema: Any, param: str) -> Constraint:
    """A reply that is a JSON value matching `schema` (compact: no free whitespace)."""
    text = check_schema(schema, param)
    return Constraint(_compiled(_json_grammar(text), param), text, "json_schema")


def json_object(param: str = "response_format") -> Constraint:
    """A reply that is one JSON object."""
    text = '{"type":"object"}'
    return Constraint(_compiled(_json_grammar(text), param), text, "json_object")


def tools_schema(schema: Any, param: str) -> Constraint:
    """A reply in a tool-call format written as a JSON schema (web/api/tools.py builds it from the
    request's tools; each tool's parameters were checked there under its own field)."""
    text = check_schema(schema, param)
    return Constraint(_compiled(_json_grammar(text), param), text, "tools")


def tagged_calls(call_schema: Any, open_tag: str, close_tag: str, parallel: bool, param: str) -> Constraint:
    """A reply of tool calls in a model's own tagged format (Hermes, Qwen: `<tool_call>\\n{...}\\n</tool_call>`):
    one call (or, `parallel`, one or more on lines of their own), each `open_tag`, a JSON value
    matching `call_schema`, `close_tag`. A lark grammar with the JSON schema inside it."""
    text = check_schema(call_schema, param)
    body = json.dumps({**json.loads(text), "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
    more = ' ("\\n" call)*' if parallel else ""
    lark = f"start: call{more}\ncall: {json.dumps(open_tag)} body {json.dumps(close_tag)}\nbody: %json {body}\n"
    return Constraint(_compiled(_lark_grammar(lark), param), "", "tools")


def _lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def _json_grammar(schema_text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_OPTIONS)


def _compiled(grammar: str, param: str) -> str:
    """`grammar`, once llguidance accepts it (without a tokenizer: the rules and the lexer)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        said = " ".join(line.strip() for line in error.splitlines() if line.strip())
        raise ConstraintError(f"{param} cannot be used: {said[:300]}", param)
    return grammar


class Vocab:
    """One tokenizer's view for llguidance, built on first use and kept (a runner holds one)."""

    def __init__(self, tokenizer: Any, n_vocab: int | None = None):
        self._tokenizer = tokenizer
        self._n_vocab = n_vocab
        self._ll: Any = None
        self._lock = threading.Lock()

    def _built(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._n_vocab)
            return self._ll

    def matcher(self, constraint: Constraint, stop_ids: Iterable[int], n_logits: int) -> Matcher:
        return Matcher(self._built(), constraint, frozenset(stop_ids), n_logits)


class Matcher:
    """One reply's place in its grammar: the allowed ids before each step, `seen` after it."""

    def __init__(self, ll_tokenizer: Any, constraint: Constraint, stop_ids: frozenset[int], n_logits: int):
        import llguidance
        from llguidance.numpy import allocate_token_bitmask

        self._m = llguidance.LLMatcher(ll_tokenizer, constraint.grammar, log_level=0)
        self._eos = ll_tokenizer.eos_token
        self._bits = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        self.stop_ids = sorted(i for i in stop_ids if 0 <= i < n_logits)
        self.n_logits = n_logits
        self.failed = ""  # llguidance's error, once the matcher is in its error state

    def allowed(self) -> np.ndarray:
        """A (n_logits,) bool mask: what the grammar allows next; the stop ids where it may end (only
        they once it must end, or once it failed: a reply is never left without a way out)."""
        from llguidance.numpy import fill_next_token_bitmask

        allowed = np.zeros(self.n_logits, dtype=bool)
        if self._m.is_error() or self._m.is_stopped():
            self.failed = self._m.get_error() if self._m.is_error() else ""
            allowed[self.stop_ids] = True
            return allowed
        fill_next_token_bitmask(self._m, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        n = min(len(bits), self.n_logits)
        allowed[:n] = bits[:n].astype(bool)
        if 0 <= self._eos < self.n_logits and self._eos not in self.stop_ids:
            allowed[self._eos] = False  # the grammar's end is the request's stop ids
        allowed[self.stop_ids] = self._m.is_accepting()
        if not allowed.any():
            allowed[self.stop_ids] = True
        return allowed

    def seen(self, token: int) -> None:
        if token not in self.stop_ids:
            self._m.consume_token(token)
