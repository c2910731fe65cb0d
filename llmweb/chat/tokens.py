"""Chat-template rendering and token counting, one message at a time.

The contract (`ChatFormat`): a prompt is the concatenation of per-message token ids:

    system_ids(system) + message_ids(role, text) for each later message + generation_prompt_ids()

Each message's ids depend only on that message, so the ids of an unchanged history are the
same on every turn. That is what lets the session KV cache (engine/kvcache.py) reuse them, and what
lets the planner (chat/context.py) count each section without re-rendering the whole prompt.

`TemplateFormat` derives the per-message segments from the model's real chat template by
rendering with and without the message and taking the difference. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from llmweb.errors import ConfigError

_PROBE_SYSTEM = "S"


class ChatFormat(Protocol):
    def system_ids(self, text: str) -> list[int]: ...

    def message_ids(self, role: str, text: str) -> list[int]: ...

    def generation_prompt_ids(self) -> list[int]: ...

    def count(self, text: str) -> int: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...


class TemplateFormat:
    """A `ChatFormat` over a Hugging Face tokenizer and its chat template."""

    def __init__(self, tokenizer, cache_size: int = 2048):
        self.tokenizer = tokenizer
        render = self._render
        probe = render([{"role": "system", "content": _PROBE_SYSTEM}])
        with_gen = render([{"role": "system", "content": _PROBE_SYSTEM}], add_generation_prompt=True)
        if not with_gen.startswith(probe):
            raise ConfigError("this model's chat template does not render a prompt as a sequence of messages")
        self._probe = probe
        self._gen_text = with_gen[len(probe) :]
        self._gen_ids = self._encode(self._gen_text)
        self.system_ids = lru_cache(maxsize=256)(self._system_ids)
        self.message_ids = lru_cache(maxsize=cache_size)(self._message_ids)
        stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                stops.add(tid)
        self._stop_ids = frozenset(stops)

    def _render(self, messages, add_generation_prompt=False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja's TemplateError for templates without a system role, etc.
            raise ConfigError(f"this model's chat template cannot render a system prompt: {e}") from e

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _system_ids(self, text: str) -> list[int]:
        return self._encode(self._render([{"role": "system", "content": text}]))

    def _message_ids(self, role: str, text: str) -> list[int]:
        full = self._render([{"role": "system", "content": _PROBE_SYSTEM}, {"role": role, "content": text}])
        assert full.startswith(self._probe), "chat template is not prefix-stable"
        return self._encode(full[len(self._probe) :])

    def generation_prompt_ids(self) -> list[int]:
        return list(self._gen_ids)

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids


def render_prompt(fmt: ChatFormat, system: str, messages: Sequence[tuple[str, str]]) -> list[int]:
    """The ids of a whole prompt: system, then (role, text) messages, then the generation prompt."""
    ids = list(fmt.system_ids(system))
    for role, text in messages:
        ids += fmt.message_ids(role, text)
    return ids + fmt.generation_prompt_ids()
