"""A zoo of tiny random-weight chat models, one per architecture family, built from configs in the
test session: each a Hugging Face folder (safetensors, tokenizer with the family's own special tokens
and chat template) and a GGUF file made from it by llama.cpp's own converter.

Every family shares the embedded SmolLM2's byte-level BPE vocabulary (on disk once the embedded
model's tokenizer is cached, so no download) plus its own special tokens: the converter identifies a
BPE pre-tokenizer by hashing its output, not by architecture, so the same vocabulary converts for
llama, Qwen3, Gemma 3 and Phi-3 alike (Gemma 3 takes a BPE vocabulary when there is no
`tokenizer.model`; Phi-3 when `tokenizer_class` is GPT2Tokenizer, as Phi-4 ships). With random
weights the replies are gibberish: the tests assert structure, not words.

The converter is the one in the llama-cpp-python sdist that requirements.txt pins
(`vendor/llama.cpp/convert_hf_to_gguf.py`); LLMWEB_LLAMA_CONVERTER names it (.ci/run sets it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CONVERTER_ENV = "LLMWEB_LLAMA_CONVERTER"

# the shapes every family shares: a forward pass is well under a millisecond of work
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
}

# Llama 3 Instruct's template: a header per message, each closed by <|eot_id|>, the bos at the start.
LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen3's template (its tool branches left out): ChatML; an assistant message after the last user
# message shows its reasoning in <think> tags, earlier ones lose it.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Gemma 3's template: no system role of its own (a system message becomes the start of the first
# user turn), roles must alternate, the assistant is "model", contents are trimmed.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# Phi-3 mini's template: a tag per role, each message closed by <|end|>, and the eos token after a
# conversation that does not ask for a reply.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """One architecture family: its config, its special tokens and chat template, and what a test
    expects of them (the markers a rendered prompt shows, the token that ends a reply)."""

    name: str
    architecture: str  # the transformers class in config.json
    config: dict  # beyond SHAPE
    specials: tuple[str, ...]  # special tokens to add (those not in the SmolLM2 vocabulary)
    bos: str | None
    eos: str
    end_of_turn: str  # the token the template closes a message with (the stop that matters)
    template: str | None
    markers: tuple[str, ...]  # what a rendered prompt shows, special tokens included
    added: tuple[str, ...] = ()  # tokens to add that are not special
    # the class in tokenizer_config.json: the fast tokenizer of tokenizer.json as it is (Qwen2Tokenizer
    # would rebuild the pre-tokenizer with Qwen's own split, which this vocabulary does not have)
    tokenizer_class: str = "PreTrainedTokenizerFast"
    pad: str | None = None


FAMILIES = {
    f.name: f
    for f in (
        Family(
            name="llama",
            architecture="LlamaForCausalLM",
            config={"model_type": "llama", "rope_theta": 500000.0},
            specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            bos="<|begin_of_text|>",
            eos="<|end_of_text|>",  # Llama 3's base eos: the reply ends at <|eot_id|>, which llmweb must know
            end_of_turn="<|eot_id|>",
            template=LLAMA3_TEMPLATE,
            markers=("<|begin_of_text|><|start_header_id|>system<|end_header_id|>", "<|start_header_id|>user"),
        ),
        Family(
            name="qwen3",
            architecture="Qwen3ForCausalLM",
            config={"model_type": "qwen3", "rope_theta": 1000000.0},
            specials=(),  # <|im_start|>, <|im_end|>, <|endoftext|> are in the vocabulary
            added=("<think>", "</think>"),  # added tokens, not special: a reply's reasoning shows in its text
            bos=None,
            eos="<|im_end|>",
            end_of_turn="<|im_end|>",
            template=QWEN3_TEMPLATE,
            markers=("<|im_start|>system\n", "<|im_start|>user\n", "<|im_start|>assistant\n"),
            pad="<|endoftext|>",
        ),
        Family(
            name="gemma3",
            architecture="Gemma3ForCausalLM",
            config={
                "model_type": "gemma3_text",
                "sliding_window": 32,  # shorter than a conversation: the SWA cache matters
                "query_pre_attn_scalar": 16,
            },
            specials=("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"),
            bos="<bos>",
            eos="<eos>",
            end_of_turn="<end_of_turn>",
            template=GEMMA3_TEMPLATE,
            markers=("<bos><start_of_turn>user\n", "<start_of_turn>model\n"),
            pad="<pad>",
        ),
        Family(
            name="phi3",
            architecture="Phi3ForCausalLM",
            config={
                "model_type": "phi3",
                "original_max_position_embeddings": 2048,
                "sliding_window": None,
            },
            # Phi-3's own <unk>, <s>, </s> too: llama.cpp sets their attributes by name for a model named phi3
            specials=("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
            bos="<s>",
            eos="<|endoftext|>",
            end_of_turn="<|end|>",
            template=PHI3_TEMPLATE,
            markers=("<|system|>\n", "<|user|>\n", "<|assistant|>\n"),
            tokenizer_class="GPT2Tokenizer",  # the converter's BPE path for Phi-3 (Phi-4 ships this)
        ),
        Family(
            name="plain",  # a base model: no chat template at all
            architecture="LlamaForCausalLM",
            config={"model_type": "llama"},
            specials=(),
            bos=None,
            eos="<|endoftext|>",
            end_of_turn="<|endoftext|>",
            template=None,
            markers=(),
        ),
    )
}


@dataclass(frozen=True)
class Built:
    family: Family
    hf_dir: Path  # the Hugging Face folder (transformers loads it)
    gguf: Path  # the converter's file (llama.cpp loads it)


def converter() -> str | None:
    return os.environ.get(CONVERTER_ENV) or None


def build_tokenizer(family: Family, base_dir: Path, out: Path):
    """The SmolLM2 vocabulary with the family's special tokens, ends and chat template, saved to `out`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    tok.add_tokens(list(family.added))
    tok.add_special_tokens({"additional_special_tokens": list(family.specials)}, replace_extra_special_tokens=True)
    tok.bos_token = family.bos
    tok.eos_token = family.eos
    tok.pad_token = family.pad or family.eos
    tok.chat_template = family.template
    tok.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = family.tokenizer_class
    if family.template is None:
        config.pop("chat_template", None)
        (out / "chat_template.jinja").unlink(missing_ok=True)
    config_file.write_text(json.dumps(config, indent=2))
    return AutoTokenizer.from_pretrained(out)


def _shape_replies(model, tok, end: int, scale: float = 0.5, boost: float = 3.0) -> None:
    """Make the random model reply as a chat model would, in what the tests look at.

    It answers in digits only: each digit is a token of its own, so a reply re-tokenises to exactly
    the ids generated (as a real model's words mostly do) and the next turn can reuse the session's
    whole cache; random tokens re-merge into others, and the cache would be cut at the first. And it
    ends its turn now and then: three of the digits carry a direction `c` in their input embedding,
    the end-of-turn token's output row is `boost` times `c`, so a reply often ends right after one
    of them. Greedy replies then end at the family's end-of-turn token within a few tokens, or run
    to the cap."""
    import torch

    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    out = model.get_output_embeddings().weight  # (vocab, hidden), untied
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[digits] = False
    out[others] = 0.0  # a logit of 0: below the best digit's, always in practice
    emb = model.get_input_embeddings().weight
    c = torch.randn(emb.shape[1])
    c *= scale / c.norm()
    emb[digits[:3]] += c
    out[end] = boost * c


def build_model(family: Family, tok, out: Path, seed: int = 0) -> None:
    """Random weights (fixed seed) for the family's config, saved as safetensors to `out`; the
    config's token ids are the tokenizer's, as in a real checkpoint (the converter reads them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = len(tok)  # a row per id (the converter's Gemma 3 path cuts the rows to the tokenizer's count)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    kw = {**SHAPE, **family.config, **ids, "vocab_size": vocab, "architectures": [family.architecture]}
    kw["tie_word_embeddings"] = False  # the output layer is shaped on its own (`_shape_replies`)
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # init's 0.02 std makes every logit alike: spread them
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        _shape_replies(model, tok, tok.convert_tokens_to_ids(family.end_of_turn))
    model.save_pretrained(out)


# A converter process converts several folders: the converter's main() once per folder, its imports
# (torch, transformers, its own gguf-py: ~5 s) paid once per process.
_DRIVER = """
import runpy, sys
script, pairs = sys.argv[1], sys.argv[2:]
sys.path.insert(0, script.rpartition("/")[0])
main = runpy.run_path(script, run_name="converter")["main"]
for hf_dir, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = [script, hf_dir, "--outfile", out, "--outtype", "f16"]
    main()
"""


def convert(pairs: list[tuple[Path, Path]], script: str, processes: int = 2) -> None:
    """Each (Hugging Face folder, GGUF file) through llama.cpp's converter, f16 weights, in
    `processes` converter processes at once (one per core)."""
    shares = [pairs[i::processes] for i in range(processes) if pairs[i::processes]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DRIVER, script, *(str(p) for pair in share for p in pair)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for share in shares
    ]
    errors = [proc.communicate(timeout=600)[1] for proc in procs]
    missing = [out.name for _, out in pairs if not out.is_file()]
    if missing or any(proc.returncode for proc in procs):
        tails = "\n".join(e[-2000:] for e, proc in zip(errors, procs) if proc.returncode)
        raise RuntimeError(f"{Path(script).name} failed (not written: {missing}):\n{tails}")


def build(families: list[Family], base_tokenizer: Path, root: Path, script: str) -> dict[str, Built]:
    """Each family's Hugging Face folder and GGUF file under `root`."""
    built = {f.name: Built(f, root / f.name, root / f"{f.name}.gguf") for f in families}
    for b in built.values():
        build_model(b.family, build_tokenizer(b.family, base_tokenizer, b.hf_dir), b.hf_dir)
    convert([(b.hf_dir, b.gguf) for b in built.values()], script)
    return built
