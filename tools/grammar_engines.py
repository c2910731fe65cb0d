"""Compare the grammar engines llmweb could constrain decoding with: llguidance and xgrammar.

    .venv/bin/python tools/grammar_engines.py [tokenizer folder]

On the embedded SmolLM2 tokenizer: the time to build each engine's tokenizer view, to compile a
30-field JSON schema, and to compute one token mask (the mean over a valid 30-field reply, one mask
per token, as the sampler does); then how each meets hostile schemas (nested 1,000 deep, 1 MB, a
regex `pattern` built to explode), each in a child process with a 20 s limit, so a hang or a crash
shows as such. Prints a Markdown table.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

TOKENIZER = Path("data/models/SmolLM2-135M-Instruct-tokenizer")
LIMIT_S = 20.0


def schema30() -> dict:
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


def instance30() -> str:
    values = ["some text here", 42, 3.25, True, "green", ["a", "bc"]]
    return json.dumps({f"field_{i:02d}": values[i % len(values)] for i in range(30)})


def hostile() -> dict[str, str]:
    deep = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "string"}' + "}}" * 1000
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(20000)}}
    regex = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^((a+)+|(a|aa)*){1,99}b{1,999}$"}}}
    return {
        "nested 1,000 deep": deep,
        f"{len(json.dumps(big)) // 1000} KB schema": json.dumps(big),
        "exploding pattern": json.dumps(regex),
    }


def _hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def llguidance_engine(path: Path):
    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    hf = _hf(path)
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    setup = time.perf_counter() - t0

    def compile_(schema: str):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def run(m, ids: list[int]) -> float:
        mask = allocate_token_bitmask(1, tok.vocab_size)
        t = 0.0
        for i in ids:
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, mask)
            t += time.perf_counter() - t0
            assert (mask[0, i // 32] >> (i % 32)) & 1, "the valid reply's token was masked"
            assert m.consume_token(i)
        np.asarray(mask)
        return t / len(ids)

    return hf, setup, compile_, run


def xgrammar_engine(path: Path):
    import xgrammar as xg

    hf = _hf(path)
    t0 = time.perf_counter()
    info = xg.TokenizerInfo.from_huggingface(hf)
    compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0

    def compile_(schema: str):
        return xg.GrammarMatcher(compiler.compile_json_schema(schema))

    def run(m, ids: list[int]) -> float:
        mask = xg.allocate_token_bitmask(1, info.vocab_size)
        t = 0.0
        for i in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            t += time.perf_counter() - t0
            assert (int(mask[0, i // 32]) >> (i % 32)) & 1, "the valid reply's token was masked"
            assert m.accept_token(i)
        return t / len(ids)

    return hf, setup, compile_, run


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine}


def _measure(name: str, path: str, out) -> None:
    hf, setup, compile_, run = ENGINES[name](Path(path))
    t0 = time.perf_counter()
    m = compile_(json.dumps(schema30()))
    compile_s = time.perf_counter() - t0
    ids = hf.encode(instance30(), add_special_tokens=False)
    per_token = min(run(compile_(json.dumps(schema30())), ids) for _ in range(3))
    out.put({"setup_s": setup, "compile_s": compile_s, "mask_us": per_token * 1e6, "tokens": len(ids)})
    del m


def _hostile(name: str, path: str, case: str, out) -> None:
    _, _, compile_, _ = ENGINES[name](Path(path))
    t0 = time.perf_counter()
    try:
        compile_(hostile()[case])
        out.put(f"compiled in {time.perf_counter() - t0:.2f} s")
    except Exception as e:  # what each engine says is the point of the table
        out.put(f"refused in {time.perf_counter() - t0:.2f} s: {str(e).splitlines()[0][:70]}")


def child(target, *args) -> object:
    out: mp.Queue = mp.Queue()
    p = mp.get_context("fork").Process(target=target, args=(*args, out))
    p.start()
    p.join(LIMIT_S)
    if p.is_alive():
        p.kill()
        p.join()
        return f"still running after {LIMIT_S:.0f} s (killed)"
    if p.exitcode != 0:
        return f"crashed (exit code {p.exitcode})"
    return out.get()


def main() -> None:
    path = str(Path(sys.argv[1]) if len(sys.argv) > 1 else TOKENIZER)
    rows = []
    for name in ENGINES:
        m = child(_measure, name, path)
        cases = {case: child(_hostile, name, path, case) for case in hostile()}
        rows.append((name, m, cases))
    print("| engine | tokenizer setup | 30-field schema compile | mask per token | " + " | ".join(hostile()) + " |")
    print("|---" * (4 + len(hostile())) + "|")
    for name, m, cases in rows:
        if isinstance(m, dict):
            figures = (
                f"{m['setup_s']:.2f} s | {m['compile_s'] * 1000:.1f} ms | {m['mask_us']:.0f} us ({m['tokens']} tokens)"
            )
        else:
            figures = f"{m} | | "
        print(f"| {name} | {figures} | " + " | ".join(str(v) for v in cases.values()) + " |")


if __name__ == "__main__":
    main()
