"""`python -m llmweb bench constrained`: what a grammar costs, and an agent's session kept in its context.

1. The decode rate under a 30-field JSON schema against the free rate at the same length, on one
   loaded model, interleaved (`--repeats` pairs): the constrained reply runs first, then a free one
   of exactly its length (no stop ids); the ratio is of the medians.
2. The 30-field schema's compile time: our caps and llguidance's check (engine/constraint.py's
   `json_schema`), then one request's matcher (the grammar against the tokenizer), medians.
3. An agent loop through the stateless API of a real `python -m llmweb serve` (bench/served.py):
   `--steps` steps, each a required tool call and a 3,000-character result sent back with the
   whole history; every step must be answered with a call whose arguments parse, and every
   prompt + reply must fit the context (the server's `x_llmweb` says both).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULT_CHARS = 3_000
TOOL = {
    "type": "function",
    "function": {
        "name": "read_page",
        "description": "Read one page of the report.",
        "parameters": {"type": "object", "properties": {"page": {"type": "integer"}}, "required": ["page"]},
    },
}


def schema30() -> dict:
    """A 30-field object of mixed types (strings, integers, numbers, booleans, enums, lists)."""
    kinds = [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string"}},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(30)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def run(
    settings,
    new_tokens: int = 128,
    repeats: int = 3,
    steps: int = 200,
    loaded=None,
    progress: Callable[[str], None] = print,
) -> dict:
    result = {"bench": "constrained", "new_tokens": new_tokens, "repeats": repeats}
    result.update(_rates(settings, new_tokens, repeats, loaded, progress))
    result["agent"] = _agent(settings, steps, progress) if steps else None
    return result


def _rates(settings, new_tokens: int, repeats: int, loaded, progress) -> dict:
    from llmweb.chat.tokens import TemplateFormat, render_prompt
    from llmweb.engine import models
    from llmweb.engine.backends import grammar_vocab, make_engine
    from llmweb.engine.constraint import json_schema
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits, GenerationRequest

    loaded = loaded or models.load(settings, progress=progress)
    fmt = TemplateFormat(loaded.tokenizer, model_stops=loaded.stop_ids)
    schema = schema30()
    compile_ms, matcher_ms = [], []
    vocab = grammar_vocab(loaded.tokenizer)
    assert vocab is not None, "the model's tokenizer is a fast one"
    vocab.matcher(json_schema(schema, "bench"), fmt.stop_ids, len(loaded.tokenizer))  # builds the vocabulary once
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        c = json_schema(schema, "bench")
        t1 = time.perf_counter()
        vocab.matcher(c, fmt.stop_ids, len(loaded.tokenizer))
        compile_ms.append((t1 - t0) * 1000)
        matcher_ms.append((time.perf_counter() - t1) * 1000)

    text = f"Fill in this form about a made-up person, as JSON: {', '.join(schema['properties'])}."
    ids = render_prompt(fmt, settings.system_prompt, [("user", text)])
    limits = EngineLimits(max_new_tokens=new_tokens, kv_reuse=False, request_timeout_s=3600)
    engine = make_engine(loaded, KVStore(0, 1), limits)
    pairs = []
    try:
        for n in range(repeats):
            progress(f"bench constrained: pair {n + 1} of {repeats}…")
            h = engine.submit(GenerationRequest(ids, new_tokens, stop_ids=fmt.stop_ids, constraint=c))
            h.result()
            assert h.stats is not None, "a finished request has its stats"
            length = h.stats.generated_tokens
            free = engine.submit(GenerationRequest(ids, length))  # no stop ids: exactly `length` tokens
            free.result()
            assert free.stats is not None, "a finished request has its stats"
            pairs.append((h.stats.decode_tok_s, free.stats.decode_tok_s, length, fmt.decode(h.generated)))
    finally:
        engine.close()
    constrained = statistics.median(p[0] for p in pairs)
    free_rate = statistics.median(p[1] for p in pairs)
    parsed = sum(1 for p in pairs if _parses(p[3]))
    return {
        "backend": loaded.backend,
        "compile_ms": round(statistics.median(compile_ms), 2),
        "matcher_ms": round(statistics.median(matcher_ms), 2),
        "constrained_tok_s": round(constrained, 1),
        "free_tok_s": round(free_rate, 1),
        "ratio": round(constrained / free_rate, 3) if free_rate else None,
        "lengths": [p[2] for p in pairs],
        "replies_parsed": parsed,
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _agent(settings, steps: int, progress) -> dict:
    import tempfile

    from .served import serve

    with tempfile.TemporaryDirectory(prefix="llmweb-bench-agent-") as folder:
        with serve(Path(folder), 64, progress, {"LLMWEB_SAMPLE_DOCS": "0"}) as srv:
            return _loop(srv, steps, progress)


def _loop(srv, steps: int, progress) -> dict:
    messages: list[dict] = [{"role": "user", "content": "Read the report's pages one by one, then summarise it."}]
    answered, worst, limit, t0 = 0, 0, 0, time.perf_counter()
    summarized = 0
    for step in range(steps):
        if step % 20 == 0:
            progress(f"bench constrained: agent step {step + 1} of {steps}…")
        r = srv.completion({"model": "llmweb", "messages": messages, "tools": [TOOL], "tool_choice": "required"})
        choice, x = r["choices"][0], r["x_llmweb"]
        calls = choice["message"].get("tool_calls") or []
        ok = choice["finish_reason"] == "tool_calls" and bool(calls)
        ok = ok and all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
        answered += ok
        limit = x["context_limit"]
        worst = max(worst, r["usage"]["prompt_tokens"] + x["max_tokens"])
        summarized = max(summarized, x.get("summarized_messages", 0))
        made = calls[0]["function"] if calls else {"name": "read_page", "arguments": "{}"}
        call_id = calls[0]["id"] if calls else f"call_{step}"
        call = {"id": call_id, "type": "function", "function": {"name": made["name"], "arguments": made["arguments"]}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        page = " ".join(f"Page {step}, line {i}: the figures of this page are as reported." for i in range(60))
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": page[:RESULT_CHARS]})
    return {
        "steps": steps,
        "answered": answered,
        "largest_prompt_and_reply": worst,
        "context_limit": limit,
        "within_context": worst <= limit,
        "summarized_messages": summarized,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(r: dict) -> str:
    lines = [
        f"## Constrained decoding ({r['backend']}, greedy, a 30-field JSON schema, {r['repeats']} pairs)",
        "",
        "| 30-field schema: check + compile | its matcher | constrained tok/s | free tok/s, same length | ratio |",
        "|---:|---:|---:|---:|---:|",
        f"| {r['compile_ms']} ms | {r['matcher_ms']} ms | {r['constrained_tok_s']} | {r['free_tok_s']} "
        f"| **{r['ratio']}** |",
        "",
        f"Lengths {r['lengths']}; {r['replies_parsed']} of {len(r['lengths'])} constrained replies parse as JSON"
        " (a reply cut by the length cap does not).",
    ]
    a = r.get("agent")
    if a:
        lines += [
            "",
            f"Agent loop through the stateless API: {a['answered']} of {a['steps']} steps answered with a tool "
            f"call; the largest prompt + reply {a['largest_prompt_and_reply']:,} tokens of "
            f"{a['context_limit']:,} ({'within' if a['within_context'] else 'OVER'} the context); up to "
            f"{a['summarized_messages']} messages summarised; {a['seconds']} s.",
        ]
    return "\n".join(lines)
