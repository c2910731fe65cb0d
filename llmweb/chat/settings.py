"""What one turn of a chat runs with, and the checks on what a visitor may set.

Owns: `TurnSettings` (a chat's own `ChatSettings` over the configuration's), `checked` (a chat's
settings against this server's limits, before they are stored), `clean_message` (a message's
text made safe) and the pinned facts' budget check. Pure: no engine, no store; the budget comes
from chat/context.py's `Budget` (its reply cap and the system prompt's room are decided there).
It must not store anything or call the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from llmweb.chat import context, facts
from llmweb.chat.tokens import ChatFormat
from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.store.models import MAX_SYSTEM_PROMPT_CHARS, MEMORY_MODES, ChatSettings

MAX_TEMPERATURE = 2.0  # a chat may sample this hot at most

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class TurnSettings:
    """What one turn runs with: the chat's own settings over the configuration's (`turn_settings`)."""

    system_prompt: str
    temperature: float
    budget: context.Budget  # max_new_tokens is the chat's reply cap
    use_docs: bool
    summaries: bool  # fold old turns into the rolling summary
    recall: bool  # bring back earlier turns that left the window
    loop_guard: bool = True  # never a sentence a third time (engine/runners/loopguard.py)

    @property
    def memory(self) -> str:
        """The memory mode in effect: one of store.MEMORY_MODES."""
        return "recall" if self.recall else "summary" if self.summaries else "window"


def clean_message(text: str, max_chars: int) -> str:
    """Validate a user message: not empty, not huge; control characters and lone surrogates removed."""
    if not isinstance(text, str):
        raise InputError("A message must be text.")
    text = _CONTROL.sub("", text.encode("utf-8", "replace").decode("utf-8")).strip()
    if not text:
        raise InputError("Your message is empty. Type a question or some text first.")
    if len(text) > max_chars:
        raise InputError(
            f"Your message is {len(text):,} characters; the limit is {max_chars:,}. "
            "Attach long text as a document instead, and ask about it."
        )
    return text


def turn_settings(s: Settings, budget: context.Budget, chosen: ChatSettings) -> TurnSettings:
    """What a turn of a chat with these settings runs with: each field the chat sets, else the
    configuration's. Stored settings were checked against the limits when they were set; a
    server restarted with lower limits still caps them here."""
    memory = chosen.memory or ("recall" if s.summaries and s.recall else "summary" if s.summaries else "window")
    return TurnSettings(
        system_prompt=s.system_prompt if chosen.system_prompt is None else chosen.system_prompt,
        temperature=min(s.temperature if chosen.temperature is None else chosen.temperature, MAX_TEMPERATURE),
        budget=budget.capped(chosen.max_new_tokens),
        use_docs=True if chosen.use_docs is None else chosen.use_docs,
        summaries=memory != "window" and s.summaries,
        recall=memory == "recall" and s.summaries and s.recall,
        loop_guard=s.loop_guard if chosen.loop_guard is None else chosen.loop_guard,
    )


def checked(s: Settings, budget: context.Budget, fmt: ChatFormat, chosen: ChatSettings) -> ChatSettings:
    """A chat's own settings as they may be stored: checked against this server's limits (an
    `InputError` that names the limit), the system prompt cleaned like a message."""
    prompt = chosen.system_prompt
    if prompt is not None:
        prompt = _CONTROL.sub("", prompt.encode("utf-8", "replace").decode("utf-8")).strip()
        if len(prompt) > MAX_SYSTEM_PROMPT_CHARS:
            raise InputError(
                f"This system prompt has {len(prompt):,} characters; the limit is {MAX_SYSTEM_PROMPT_CHARS:,}."
            )
        room = budget.system_prompt_room
        if fmt.count(prompt) > room:
            raise InputError(
                f"This system prompt takes {fmt.count(prompt):,} tokens; at most {room:,} (a quarter "
                "of this server's context) leave room for the chat. Make it shorter."
            )
    if chosen.temperature is not None and not 0 <= chosen.temperature <= MAX_TEMPERATURE:
        raise InputError(f"The temperature must be between 0 and {MAX_TEMPERATURE} (0: the likeliest word).")
    cap = budget.max_new_tokens
    if chosen.max_new_tokens is not None and not 1 <= chosen.max_new_tokens <= cap:
        raise InputError(
            f"The reply cap must be between 1 and {cap:,} tokens: this server's limit "
            "(LLMWEB_MAX_NEW_TOKENS, at most half the context)."
        )
    if chosen.memory is not None and chosen.memory not in MEMORY_MODES:
        raise InputError(f"The memory mode must be one of {', '.join(MEMORY_MODES)}.")
    if chosen.memory in ("summary", "recall") and not s.summaries:
        raise InputError("This server keeps no summaries (LLMWEB_SUMMARIES=0): only window memory is available.")
    if chosen.memory == "recall" and not s.recall:
        raise InputError("This server recalls no earlier turns (LLMWEB_RECALL=0): pick window or summary.")
    return replace(chosen, system_prompt=prompt)


def check_pins(budget: context.Budget, fmt: ChatFormat, known, new) -> None:
    """Pinned facts are never left out of a prompt, so together they must stay within their budget."""
    cap = budget.facts_tokens
    cost = facts.pinned_cost(known, fmt.count) + facts.fact_cost(new, fmt.count)
    if cost > cap:
        raise InputError(
            f"Pinned facts would take {cost:,} tokens; their budget is {cap:,} "
            "(LLMWEB_FACTS_TOKENS). Unpin or delete a fact first, or keep this one shorter."
        )
