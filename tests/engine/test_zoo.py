"""Bring your own model: a zoo of tiny random-weight models (tests/engine/zoo.py: llama with Llama 3's
template, Qwen3, Gemma 3, Phi-3, and a base model with no template), built from configs and converted
by llama.cpp's own converter, each through the whole chat path on llama.cpp and on transformers.

With random weights the replies are gibberish, so every check is of structure: the prompt is the
family's own template (its markers, the system prompt once, no probe text), the stops are the
family's (the end of turn read from its template, the eos its files declare), a reply ends at its
end-of-turn token or at the cap, every prompt fits the context (the history outgrows it), the second
turn reuses the first's KV cache, and the stats are filled. On transformers (fp32) a chat with KV
reuse gives exactly the replies of one without (on llama.cpp the f16 cache computed in other chunks
may flip a near tie: not asserted). A sliding-window model's cache on llama.cpp is reused only as far
back as its window reaches.

The converter comes with the llama-cpp-python sdist that requirements.txt pins; LLMWEB_LLAMA_CONVERTER
names its convert_hf_to_gguf.py (.ci/run sets it; locally, point it at an unpacked sdist).
"""

from __future__ import annotations

import random

import pytest

from llmweb.engine import models
from llmweb.errors import ConfigError
from llmweb.records import LOCAL_OWNER
from llmweb.runtime import Runtime
from tests.conftest import MODEL_CACHE, make_settings
from tests.engine import zoo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not zoo.converter(),
        reason=f"no llama.cpp converter: {zoo.CONVERTER_ENV} names convert_hf_to_gguf.py of the pinned sdist (.ci/run)",
    ),
]

SYSTEM = "You are a tiny test model."
QUESTIONS = [
    "Hello there, who are you?",
    "Tell me more about that.",
    "And then what happened next?",
    "Why did it happen?",
    "Say it all again in one line.",
]
CONTEXT = 128  # five turns outgrow it: the planner must fold or drop history
CAP = 24
# the family whose llama.cpp chat runs in an engine process of its own, as the app does by default
# (the others in this process: an engine process costs a start of its own, ~5 s)
IN_ENGINE_PROCESS = "gemma3"


@pytest.fixture(scope="session")
def zoo_models(tmp_path_factory) -> dict[str, zoo.Built]:
    """Every family built once per session (about 15 s): HF folders and GGUF files in a tmp dir."""
    folder, name = models.embedded_gguf()
    settings = make_settings(tmp_path_factory.mktemp("zoo-data"))
    base = models.tokenizer_source(settings, folder / name, progress=lambda _: None)  # under MODEL_CACHE
    assert base.is_relative_to(MODEL_CACHE)
    converter = zoo.converter()
    assert converter is not None
    return zoo.build(list(zoo.FAMILIES.values()), base, tmp_path_factory.mktemp("zoo"), converter)


def runtime(tmp_path, built: zoo.Built, backend: str, **kw) -> Runtime:
    model = built.gguf if backend == "llama.cpp" else built.hf_dir
    kw.setdefault("engine_process", "0")
    kw.setdefault("quant", "fp32" if backend == "transformers" else "auto")
    settings = make_settings(
        tmp_path,
        model=str(model),
        backend=backend,
        device="cpu",
        context_limit=CONTEXT,
        max_new_tokens=CAP,
        summary_tokens=48,
        system_prompt=SYSTEM,
        **kw,
    )
    return Runtime(settings).start(background=False)


def chat(rt: Runtime, questions=QUESTIONS) -> list:
    """Each question as a turn of one chat: [(Finished, the engine request of its reply)]."""
    sent = []
    submit = rt.engine.submit

    def recorded(request, *a, **kw):
        sent.append(request)
        return submit(request, *a, **kw)

    rt.engine.submit = recorded
    session = rt.wait_ready()
    turns, conv = [], None
    for q in questions:
        fin = session.ask(LOCAL_OWNER, conv, q, use_docs=False, wait_summary=True)
        conv = fin.conv_id
        reply = [r for r in sent if not r.background][-1]  # a fold's summary job runs in the background
        turns.append((fin, reply))
    return turns


def check_stops(family: zoo.Family, rt: Runtime) -> None:
    """The chat's stops: the end of turn its template writes (none without a template), and the eos
    and the ends its files declare (a GGUF's eos id, generation_config's eos_token_id)."""
    fmt, loaded = rt.chat.fmt, rt.loaded
    end = fmt.tokenizer.convert_tokens_to_ids(family.end_of_turn)
    assert fmt.end_of_turn_ids == ((end,) if family.template else ()), family.name
    assert loaded is not None and fmt.tokenizer.eos_token_id in loaded.stop_ids, (family.name, loaded.stop_ids)
    assert {end, *loaded.stop_ids} <= fmt.stop_ids, family.name


def check_chat(family: zoo.Family, tokenizer, turns) -> None:
    """The structure of every turn of a zoo chat (see the module docstring)."""
    end, eos = tokenizer.convert_tokens_to_ids(family.end_of_turn), tokenizer.eos_token_id
    for i, (fin, request) in enumerate(turns):
        prompt = tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        where = f"{family.name}, turn {i + 1}: {prompt!r}"
        assert all(marker in prompt for marker in family.markers), where
        assert prompt.count(SYSTEM) == 1 and "llmweb-probe" not in prompt, where
        assert QUESTIONS[i] in prompt, where
        assert {end, eos} <= request.stop_ids, (where, request.stop_ids)
        g, s = fin.stats.gen, fin.stats
        assert g.finish_reason in ("eos", "length") and 0 <= g.generated_tokens <= CAP, (where, g)
        assert g.finish_reason == "eos" or g.generated_tokens == CAP, (where, g)
        assert g.prompt_tokens == len(request.prompt_ids) == g.reused_tokens + g.prefilled_tokens, (where, g)
        assert g.prompt_tokens + s.sections["reserve"] <= CONTEXT == s.context_limit, (where, s.sections)
        assert sum(v for k, v in s.sections.items() if k != "reserve") == g.prompt_tokens, (where, s.sections)
        assert 0 < g.ttft_s <= g.total_s and g.decode_tok_s >= 0 and g.kv_store_bytes >= 0, (where, g)
    gens = [fin.stats.gen for fin, _ in turns]
    assert any(g.finish_reason == "eos" for g in gens), f"{family.name}: no reply ended at {family.end_of_turn}"
    assert gens[0].reused_tokens == 0 < gens[1].reused_tokens, f"{family.name}: turn 2 did not reuse turn 1's cache"
    assert any(fin.stats.summarized_turns or fin.stats.dropped_turns for fin, _ in turns), "the history never outgrew"


@pytest.mark.parametrize("name", list(zoo.FAMILIES))
def test_every_family_chats_on_llama_cpp(name, zoo_models, tmp_path):
    built = zoo_models[name]
    own_process = name == IN_ENGINE_PROCESS
    rt = runtime(tmp_path, built, "llama.cpp", engine_process="1" if own_process else "0")
    try:
        turns = chat(rt)
        tokenizer = rt.chat.fmt.tokenizer  # read out of the GGUF file, as llmweb does for a user's file
        hf = _hf_tokenizer(built)
        assert tokenizer.chat_template == hf.chat_template, "the GGUF file carries the family's template"
        assert (tokenizer.eos_token, tokenizer.bos_token) == (hf.eos_token, hf.bos_token)
        check_chat(built.family, tokenizer, turns)
        check_stops(built.family, rt)
        assert rt.loaded is not None and rt.loaded.backend == "llama.cpp"
        assert (rt.loaded.model is None) == own_process, "an engine process holds the weights, not this one"
        no_template = "no chat template" in rt.status
        assert no_template == (built.family.template is None), rt.status
    finally:
        rt.close()


@pytest.mark.parametrize("name", list(zoo.FAMILIES))
def test_every_family_chats_on_transformers_and_reuse_never_changes_a_reply(name, zoo_models, tmp_path):
    built = zoo_models[name]
    replies = {}
    for reuse in (True, False):
        rt = runtime(tmp_path / str(reuse), built, "transformers", kv_reuse=reuse)
        try:
            turns = chat(rt)
            if reuse:
                check_chat(built.family, rt.chat.fmt.tokenizer, turns)
                check_stops(built.family, rt)
            else:
                assert not any(fin.stats.gen.reused_tokens for fin, _ in turns)
            replies[reuse] = [fin.reply for fin, _ in turns]
        finally:
            rt.close()
    assert replies[True] == replies[False]


@pytest.mark.parametrize("name", list(zoo.FAMILIES))
def test_llama_cpp_tokenises_the_zoo_as_transformers_does(name, zoo_models, tmp_path):
    """And so does the tokenizer llmweb reads out of the GGUF file, as it loads it: from the copy it
    saved of it (engine/models.py `tokenizer_source`; the chat tests above made it, or this one does)."""
    from llmweb.engine.gguf import GgufModel

    built = zoo_models[name]
    hf, gguf = _hf_tokenizer(built), GgufModel(built.gguf, threads=1)
    settings = make_settings(tmp_path, model=str(built.gguf))
    ours = models.load_tokenizer(settings, "llama.cpp")
    copy = models.tokenizer_source(settings, built.gguf, print)
    assert copy.parent == settings.copies_dir and copy.name.startswith(f"{name}.tokenizer-"), copy
    try:
        specials = "".join(built.family.specials)
        for text in ("Hello world, how are you?", f"{specials}Über 3.14 🐍 naïve café\n\n  x", "  spaced\n\nlines\t"):
            ids = gguf.tokenize(text)
            assert ids == hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False), text
            assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text
        assert (ours.chat_template, ours.bos_token, ours.eos_token) == (hf.chat_template, hf.bos_token, hf.eos_token)
    finally:
        gguf.close()


@pytest.mark.parametrize("name", list(zoo.FAMILIES))
def test_a_gguf_file_on_transformers_is_converted_once_to_the_weights_of_its_folder(name, zoo_models, tmp_path):
    """A user's GGUF file where models run on transformers (a GPU; here LLMWEB_BACKEND=transformers):
    converted once to a safetensors copy (engine/models.py `transformers_source`) whose weights are
    its Hugging Face folder's (the converter wrote them in f16: compared at f16's precision), with a
    tokenizer that encodes as the folder's; or refused where transformers would leave weights random."""
    import torch
    from transformers import AutoModelForCausalLM

    built = zoo_models[name]
    settings = make_settings(tmp_path, model=str(built.gguf), backend="transformers", quant="fp32", device="cpu")
    settings = settings.replace(cache_dir=tmp_path / "copies")
    if name == "qwen3":  # transformers 5.24 maps no head_dim out of a GGUF: Qwen3's default (128), not the zoo's 16
        with pytest.raises(ConfigError, match=r"qwen3\.gguf: transformers could not convert it \(RuntimeError"):
            models.load(settings, progress=lambda _: None)
        assert not list((tmp_path / "copies").glob("qwen3.*")), "no copy with random weights in it"
        return
    loaded = models.load(settings, progress=lambda _: None)
    assert loaded.backend == "transformers" and loaded.name == name
    (copy,) = (tmp_path / "copies").glob(f"{name}.safetensors-*")
    assert models.transformers_source(settings) == copy, "made once, then reused"
    hf = AutoModelForCausalLM.from_pretrained(built.hf_dir, dtype=torch.float32).state_dict()
    ours = loaded.model.state_dict()
    assert set(hf) <= set(ours), set(hf) - set(ours)
    for key, value in hf.items():
        torch.testing.assert_close(
            ours[key], value.half().float(), rtol=1e-3, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
        )
    ids = _hf_tokenizer(built).encode("Hello world, how are you?")
    assert loaded.tokenizer.encode("Hello world, how are you?") == ids
    assert models.load_tokenizer(settings, "transformers").encode("Hello world, how are you?") == ids, (
        "the web process's"
    )


def test_a_sliding_window_cache_is_reused_only_as_far_back_as_its_window_reaches(zoo_models):
    """Gemma 3 (window 32 here) on llama.cpp: the saved state of a session holds only the last window
    of its tokens, so a prompt that parts from it further back than that is prefilled whole, giving
    exactly the fresh reply (before, it reused the cut state and the reply silently changed); one that
    goes on from the whole cache reuses all of it."""
    from llmweb.engine.gguf import GgufModel
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits, GenerationRequest
    from llmweb.engine.runners.llama_cpp import llama_engine

    model = GgufModel(zoo_models["gemma3"].gguf)
    rng = random.Random(0)

    def words(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    def engine():
        return llama_engine(model, KVStore(2**30, 600), EngineLimits(max_new_tokens=16), 256)

    try:
        for _ in range(2):
            first = words(60)
            runs = {}
            for then in ("parted", "on"):
                e = engine()
                assert e.runner.n_swa == 32
                reply = list(e.submit(GenerationRequest(first, 16, session_id="s")).result())  # caches 60 + 15
                # parted: leaves the cache 15 tokens before its end; on: goes on from all of it
                prompt = first + words(20) if then == "parted" else first + reply + words(8)
                h = e.submit(GenerationRequest(prompt, 16, session_id="s"))
                runs[then] = (h.result(), h.stats.reused_tokens, prompt)
                e.close()
            e = engine()
            fresh = e.submit(GenerationRequest(runs["parted"][2], 16)).result()
            e.close()
            assert runs["parted"][:2] == (fresh, 0), "a cut further back than the window prefills it all"
            assert runs["on"][1] == len(first) + len(reply) - 1, "the whole cache is reused"
    finally:
        model.close()


def _hf_tokenizer(built: zoo.Built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built.hf_dir)
