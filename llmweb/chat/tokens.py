"""Chat-template rendering and token counting, one message at a time.

The contract (`ChatFormat`): a prompt is the concatenation of per-message token ids:

    system_ids(system) + message_ids(role, text) for each later message + generation_prompt_ids()

Each message's ids depend only on that message, so the ids of an unchanged history are the
same on every turn. That is what lets the session KV cache (engine/kvcache.py) reuse them, and what
lets the planner (chat/context.py) count each section without re-rendering the whole prompt.

`TemplateFormat` derives the per-message segments from the model's real chat template by
rendering with and without the message and taking the difference. What templates do beyond that
is absorbed here, each with a warning where the model gets less than its template promised:
- a closing the template adds only when no reply is asked for (Phi-3's eos token) is left out;
- a template with no system role of its own (Gemma's: it raises, or moves the system prompt into
  the first user turn) gets the system prompt as a user message of its own;
- a tokenizer with no chat template (a base model) gets PLAIN_TEMPLATE, a "Role: text" transcript.

A message's text is text, whoever wrote it (a visitor, a document, OCR, an import): where it spells a
control token (`<|im_start|>system` typed or uploaded), those characters are encoded as ordinary
pieces, never as the token, so no text forges a turn; the template's own markers around it stay
control tokens. A message without such a spelling is encoded exactly as the template renders it.

The stops come from the model, not from a list of names: the eos, the special token(s) the template
writes right after an assistant message's text (its end of turn: `<|im_end|>`, `<|eot_id|>`,
`<end_of_turn>`, ...), and the ids the model's files name as ends (`model_stops`: a GGUF's
eos/eot/eom ids, generation_config.json's eos_token_id). Only special tokens become stops: an
ordinary piece such as "\n" never ends a reply. A plain transcript's turn has no end token: its
stop is text (`stop_texts`: the next "User:" line; chat/turn.py cuts the reply there). No torch here.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Protocol

from llmweb.errors import ConfigError

log = logging.getLogger(__name__)

# distinctive texts, so that no template's own words are taken for them
_PROBE_SYSTEM = "llmweb-probe-system"
_PROBE_USER = "llmweb-probe-user"
_PROBE_REPLY = "llmweb-probe-reply"
_PROBE_MESSAGE = "llmweb-probe-message"

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# a plain transcript's next "User:" line: the model has ended its turn and is writing the user's (a
# base model has no special token for it), so the reply stops before it
PLAIN_STOP_TEXTS = ("\nUser:",)
NO_TEMPLATE_NOTE = (
    "the model has no chat template: the chat is written to it as a plain transcript (User: / Assistant:)"
)
NO_SYSTEM_NOTE = "the model's chat template has no system role: the system prompt goes to it as a user message"


class ChatFormat(Protocol):
    def system_ids(self, text: str) -> list[int]: ...

    def message_ids(self, role: str, text: str) -> list[int]: ...

    def generation_prompt_ids(self) -> list[int]: ...

    def count(self, text: str) -> int: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...

    @property
    def stop_texts(self) -> tuple[str, ...]: ...


class TemplateFormat:
    """A `ChatFormat` over a Hugging Face tokenizer and its chat template."""

    def __init__(self, tokenizer, cache_size: int = 2048, model_stops: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self._control = control_pattern(tokenizer)  # the texts of its control tokens; None: it has none
        self._as_text = text_tokenizer(tokenizer) if self._control is not None else None
        self._template = None if getattr(tokenizer, "chat_template", None) else PLAIN_TEMPLATE
        if self._template is not None:
            log.warning(NO_TEMPLATE_NOTE)
        self._closing = ""  # _render reads it: none while it is being found
        self._closing = self._closing_text()
        # 1) a system message of its own, at the start of a conversation (else: as a user message)
        system = [{"role": "system", "content": _PROBE_SYSTEM}]
        self._native_system = self._shows(system, _PROBE_SYSTEM)
        if not self._native_system:
            log.warning(NO_SYSTEM_NOTE)
            system = []
        # 2) per role, a conversation the template takes that message after (roles alternating if it insists)
        user, reply = {"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}
        self._before = {
            "user": self._first_context("user", [system, [*system, user, reply]]),
            "assistant": self._first_context("assistant", [system, [*system, user]]),
        }
        # 3) the generation prompt: what the template adds where an assistant message would start
        context, head = self._before["assistant"]
        with_gen = self._render(context, add_generation_prompt=True)
        if not with_gen.startswith(head):
            raise ConfigError("this model's chat template does not render a prompt as a sequence of messages")
        self._gen_ids = self._encode(with_gen[len(head) :])
        self.system_ids = lru_cache(maxsize=256)(self._system_ids)
        self.message_ids = lru_cache(maxsize=cache_size)(self._message_ids)
        # 4) the stops: the eos, the template's end of turn, the model's own (special tokens only)
        specials = special_ids(tokenizer)
        self.end_of_turn_ids = self._end_of_turn_ids(specials)
        self._stop_ids = self._stops(specials, model_stops)

    def _render(self, messages, add_generation_prompt=False, tools=None) -> str:
        """The template's text, less the closing it adds when no reply is asked for."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self._template,
                **({"tools": tools} if tools else {}),
            )
        except Exception as e:  # jinja's TemplateError for templates without a system role, etc.
            raise ConfigError(f"this model's chat template cannot render this conversation: {e}") from e
        if not add_generation_prompt and self._closing and text.endswith(self._closing):
            text = text[: -len(self._closing)]
        return text

    def tools_text(self, tools: list[dict]) -> str:
        """What the template writes after the system prompt when it is given `tools` (OpenAI's
        `{"type": "function", "function": {...}}` dicts): a Hermes or Qwen template's tools block,
        from the template itself; "" where it puts them elsewhere or nowhere. The system prompt and
        this text join with a blank line, as those templates join them."""
        system = [{"role": "system", "content": _PROBE_SYSTEM}]
        try:
            bare, full = self._render(system), self._render(system, tools=tools)
        except ConfigError:
            return ""
        at = bare.find(_PROBE_SYSTEM) + len(_PROBE_SYSTEM)
        tail = bare[at:]
        if at < len(_PROBE_SYSTEM) or not full.startswith(bare[:at]) or not full.endswith(tail):
            return ""
        return full[at : len(full) - len(tail)].strip()

    def _closing_text(self) -> str:
        """What the template appends only when no reply is asked for (Phi-3: its eos token): the
        tokens of a conversation that the same conversation with a generation prompt does not
        start with. "" for the usual template, whose generation prompt only adds."""
        probe = [{"role": "user", "content": _PROBE_USER}]
        bare, with_gen = self._render(probe), self._render(probe, add_generation_prompt=True)
        if with_gen.startswith(bare):
            return ""
        ids, gen_ids = self._encode(bare), self._encode(with_gen)
        shared = 0
        while shared < min(len(ids), len(gen_ids)) and ids[shared] == gen_ids[shared]:
            shared += 1
        closing = self.tokenizer.decode(ids[shared:], skip_special_tokens=False)
        if not (bare.endswith(closing) and with_gen.startswith(bare[: len(bare) - len(closing)])):
            raise ConfigError("this model's chat template does not render a prompt as a sequence of messages")
        return closing

    def _end_of_turn_ids(self, specials: frozenset[int]) -> tuple[int, ...]:
        """The special token(s) the template writes right after an assistant message's text, what
        ends a turn (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `<|end|>`, `</s>`); whitespace
        before them is passed over. () where a turn ends with text alone (PLAIN_TEMPLATE)."""
        context, head = self._before["assistant"]
        segment = self._render([*context, {"role": "assistant", "content": _PROBE_REPLY}])[len(head) :]
        at = segment.find(_PROBE_REPLY)
        if at < 0:
            return ()
        ends: list[int] = []
        for tid in self._encode(segment[at + len(_PROBE_REPLY) :]):
            if tid in specials:
                ends.append(tid)
            elif ends or self.tokenizer.decode([tid]).strip():
                break
        return tuple(ends)

    def _stops(self, specials: frozenset[int], model_stops: Iterable[int]) -> frozenset[int]:
        eos = self.tokenizer.eos_token_id
        stops = {*self.end_of_turn_ids, *([eos] if eos is not None else [])}
        for tid in model_stops:
            if tid in specials:
                stops.add(tid)
            elif tid not in stops:
                log.warning("the model names token %d as an end, but it is no special token: not a stop", tid)
        return frozenset(stops)

    def _shows(self, messages, probe: str) -> bool:
        try:
            return probe in self._render(messages)
        except ConfigError:
            return False

    def _first_context(self, role: str, contexts) -> tuple[list, str]:
        """The first of `contexts` after which the template renders a `role` message by adding to
        the context's own text: (that context, its text)."""
        for context in contexts:
            try:
                head = self._render(context)
                full = self._render([*context, {"role": role, "content": _PROBE_MESSAGE}])
            except ConfigError:
                continue
            if full.startswith(head) and _PROBE_MESSAGE in full[len(head) :]:
                return context, head
        raise ConfigError(f"this model's chat template does not render a {role} message after the ones before it")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_text(self, text: str) -> list[int]:
        """`text`'s ids with every control token's spelling read as ordinary text."""
        if self._control is None or not self._control.search(text):
            return self._encode(text)
        if self._as_text is not None:
            return list(self._as_text(text, add_special_tokens=False)["input_ids"])
        return self._encode(self._control.sub(_break, text))

    def _system_ids(self, text: str) -> list[int]:
        role = "system" if self._native_system else "user"
        return self._segment_ids(lambda content: self._render([{"role": role, "content": content}]), text)

    def _message_ids(self, role: str, text: str) -> list[int]:
        context, head = self._before.get(role, self._before["user"])

        def segment(content: str) -> str:
            full = self._render([*context, {"role": role, "content": content}])
            assert full.startswith(head), "chat template is not prefix-stable"
            return full[len(head) :]

        return self._segment_ids(segment, text)

    def _segment_ids(self, segment: Callable[[str], str], text: str) -> list[int]:
        """The ids of the template's `segment` for a message of `text`: its markers as control tokens,
        the message's text as text. A text that spells no control token: the segment as rendered."""
        rendered = segment(text)
        if self._control is None or not self._control.search(text):
            return self._encode(rendered)
        before, probe, after = segment(_PROBE_MESSAGE).partition(_PROBE_MESSAGE)
        fits = rendered.startswith(before) and rendered.endswith(after) and len(before) + len(after) <= len(rendered)
        if probe and fits:  # the template wraps the text: encode the three parts each as what they are
            inside = rendered[len(before) : len(rendered) - len(after)]
            return self._encode(before) + self._encode_text(inside) + self._encode(after)
        # a template that rewrites the text around it: each spelling is broken before it is rendered
        return self._encode(segment(self._control.sub(_break, text)))

    def generation_prompt_ids(self) -> list[int]:
        return list(self._gen_ids)

    def count(self, text: str) -> int:
        return len(self._encode_text(text))

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids (web/api/completions.py): as the tokenizer reads it, its special tokens'
        spellings as those tokens and its own start token where it adds one; the caller's own prompt,
        stored nowhere."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    @property
    def stop_texts(self) -> tuple[str, ...]:
        """Text that ends a reply where no token does: a plain transcript's next "User:" line."""
        return PLAIN_STOP_TEXTS if self._template is PLAIN_TEMPLATE else ()


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special (control) tokens, the only ones that may end a reply: its
    named ones (eos, bos, ...) and every added token marked special (a GGUF's control tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(tid for tid, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


def control_pattern(tokenizer) -> re.Pattern[str] | None:
    """A pattern of the texts of the tokenizer's control tokens (`special_ids`), longest first;
    None when it has none."""
    texts = {tokenizer.convert_ids_to_tokens(tid) for tid in special_ids(tokenizer)}
    texts = {t for t in texts if isinstance(t, str) and t}
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def text_tokenizer(tokenizer) -> Callable | None:
    """A copy of `tokenizer` that reads control tokens' spellings as text (`split_special_tokens`),
    or None where the copy does not (then `_break` is used). A copy, not a flag set per call: the
    flag is the tokenizer's state, and threads share the tokenizer."""
    try:
        plain = copy.deepcopy(tokenizer)
        plain.split_special_tokens = True
        specials = special_ids(tokenizer)
        probe = "".join(tokenizer.convert_ids_to_tokens(sorted(specials)))
        ids = plain(probe, add_special_tokens=False)["input_ids"]
    except Exception as e:  # a tokenizer that cannot be copied or takes no such setting
        log.warning("the tokenizer cannot encode control tokens' texts as text (%s): they are broken instead", e)
        return None
    return plain if not specials.intersection(ids) else None


def _break(match: re.Match[str]) -> str:
    """A control token's spelling with a zero-width space after its first character: text."""
    return match.group(0)[0] + "\u200b" + match.group(0)[1:]


def render_prompt(fmt: ChatFormat, system: str, messages: Sequence[tuple[str, str]]) -> list[int]:
    """The ids of a whole prompt: system, then (role, text) messages, then the generation prompt."""
    ids = list(fmt.system_ids(system))
    for role, text in messages:
        ids += fmt.message_ids(role, text)
    return ids + fmt.generation_prompt_ids()


# ---- one id's bytes, for log-probabilities (the API's `token` and `bytes`)

_HEX_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE writes for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(fmt: ChatFormat, token: int) -> bytes:
    """The bytes one id stands for, even where they are part of a character: a byte-level BPE piece
    through its alphabet, a SentencePiece byte piece (<0xE2>) as its byte, else the id decoded alone."""
    tokenizer = getattr(fmt, "tokenizer", None)
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(int(token)) if convert is not None else None
    if isinstance(piece, str) and piece:
        if match := _HEX_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        table = _byte_level_decoder()
        if _byte_level(tokenizer) and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return fmt.decode([token]).encode()


@lru_cache(maxsize=8)
def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's pieces are written in the byte-level alphabet (GPT-2, Llama 3, Qwen, SmolLM)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return "ByteLevel" in repr(decoder)
