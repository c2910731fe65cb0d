"""Rolling summary: when to fold old turns into it, how to ask for it, how to clean the answer.

Pure parts only: no model calls, no torch, no I/O. The chat session wires them: after a turn it
calls `turns_to_fold(counts, plan.history_room, high, low)`; when that says n > 0 it sends
`summary_request_messages(...)` to the engine as a low-priority job, passes the reply through
`clean_summary(...)`, stores it, and takes the n oldest turns out of the window.

Why hysteresis: the summary sits in the system message, at the very start of the prompt.
Changing it changes the prefix, and every token after the first changed one must be prefilled
again. So we fold rarely and many turns at once: nothing happens until history passes `high` x
room, and then it is brought down to `low` x room. Between two folds the prompt's prefix
(system + summary + the turns in the window) only grows, and the cache reuses all of it.

Why segments: a fold APPENDS a paragraph about the folded turns (`segment_request_messages`)
instead of rewriting the summary, so the cached prefix stays valid up to the end of the previous
summary. Only when the segments together pass the summary's cap are they merged into one
shorter text (`summary_request_messages`): a full rewrite, rarely.

`cap_text` (cut text to a token count at a sentence, else a word, boundary) lives here because
it is the summary's cutter; the planner (chat/context.py) uses it too.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence

from llmweb.chat.tokens import ChatFormat
from llmweb.records import Turn

KEEP_NEWEST = 2  # turns never folded while they fit in the room: what the user is talking about now

_WORD = re.compile(r"\S+")
# a sentence ends at . ! ? (optionally followed by closing quotes/brackets) before whitespace or the end
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")


def cap_text(text: str, max_tokens: int, count: Callable[[str], int]) -> str:
    """`text` (stripped) cut to at most `max_tokens` tokens as `count` measures them.

    Cuts at the last sentence end that fits, if that keeps at least half of the allowed tokens;
    otherwise at the last whole word that fits. Returns "" when not even one word fits.
    """
    text = text.strip()
    if count(text) <= max_tokens:
        return text
    if max_tokens <= 0:
        return ""
    ends = [m.end() for m in _WORD.finditer(text)]
    # The most whole words whose prefix fits: gallop from the start (1, 2, 4... words), then binary
    # search in the last step, so the counts cost about the kept prefix, not the text's length
    # times its log (a long paste is cut to a short summary).
    lo, hi = 0, 1
    while hi < len(ends) and count(text[: ends[hi - 1]]) <= max_tokens:
        lo, hi = hi, 2 * hi
    hi = min(hi, len(ends))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[: ends[mid - 1]]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return ""
    cut = text[: ends[lo - 1]]
    sentence_ends = [m.end() for m in _SENTENCE_END.finditer(cut)]
    if sentence_ends:
        sentence = cut[: sentence_ends[-1]]
        n = count(sentence)
        if 2 * n >= max_tokens and n <= max_tokens:
            return sentence
    return cut


def turns_to_fold(turn_token_counts: Sequence[int], room: int, high: float, low: float, keep: int = KEEP_NEWEST) -> int:
    """How many of the oldest turns to fold into the summary now (0 = leave the window alone).

    `turn_token_counts` are the rendered sizes of the turns still in the window, oldest first;
    `room` is the tokens history may use (`ContextPlan.history_room`).

    - While sum <= high * room: 0. The window, and so the prompt prefix, only grows.
    - Past it: the fewest oldest turns that bring the rest down to <= low * room, except that
      the newest `keep` turns are never folded (even if they alone are over the low-water mark:
      then everything older goes). The planner keeps room for them before the summary and
      retrieved text; one too big for the whole room is left out (and reported) until it is
      no longer among the newest, and is folded then.
    """
    if not 0 < low < high <= 1:
        raise ValueError(f"need 0 < low < high <= 1, got low={low}, high={high}")
    counts = list(turn_token_counts)
    total = sum(counts)
    if total <= high * room:
        return 0

    def fewest_to_fold(limit: float) -> int:
        rest, n = total, 0
        while n < len(counts) and rest > limit:
            rest -= counts[n]
            n += 1
        return n

    n_low = fewest_to_fold(low * room)
    return min(n_low, max(len(counts) - keep, 0))


def segment_request_messages(previous_summary: str, turns: Sequence[Turn], max_tokens: int) -> tuple[str, str]:
    """(system, user) messages asking for a summary of `turns` ONLY, to append to the summary.

    Appending keeps the prompt's prefix: everything cached up to the end of the previous summary
    stays valid, and a fold re-prefills only the new segment and what follows it. The previous
    summary is shown for context (names, what "it" refers to) but must not be repeated.
    """
    words = max(1, max_tokens * 3 // 4)
    system = (
        "You write the next paragraph of the running summary of a conversation between a user and an "
        "assistant. Summarise ONLY the new turns; do not repeat what the summary so far already says. "
        "Keep every name, number, date, decision and open question; drop greetings and small talk. "
        f"Write plain sentences, no lists or headings, at most {max_tokens} tokens (about {words} words). "
        "Reply with the paragraph only."
    )
    exchanges = "\n\n".join(f"User: {t.user.strip()}\nAssistant: {t.assistant.strip()}" for t in turns)
    user = (
        f"Summary so far:\n{previous_summary.strip() or '(none yet)'}\n\n"
        f"New turns:\n{exchanges or '(none)'}\n\n"
        "Write the paragraph about the new turns."
    )
    return system, user


def summary_request_messages(previous_summary: str, turns: Sequence[Turn], max_tokens: int) -> tuple[str, str]:
    """(system, user) messages asking the model for an updated rolling summary.

    The model should merge `previous_summary` with `turns` (the turns leaving the window,
    oldest first) into plain sentences of at most `max_tokens` tokens. Pass its reply through
    `clean_summary`, which enforces the cap whatever the model did.
    """
    words = max(1, max_tokens * 3 // 4)
    system = (
        "You keep the running summary of a conversation between a user and an assistant. "
        "Rewrite the summary so that it covers both the previous summary and the new turns. "
        "Keep every name, number, date, decision and open question; drop greetings and small talk. "
        f"Write plain sentences, no lists or headings, at most {max_tokens} tokens (about {words} words). "
        "Reply with the summary only."
    )
    exchanges = "\n\n".join(f"User: {t.user.strip()}\nAssistant: {t.assistant.strip()}" for t in turns)
    user = (
        f"Previous summary:\n{previous_summary.strip() or '(none yet)'}\n\n"
        f"New turns:\n{exchanges or '(none)'}\n\n"
        "Write the updated summary."
    )
    return system, user


_PREAMBLE_LINE = re.compile(r"^(?:#+\s*)?[*_]*(?:here\b.*|.{0,40}\bsummary\b.{0,40}):[*_]*$", re.I)
_INTERJECTION = re.compile(r"^(?:sure|certainly|of course|okay|ok|absolutely|great)\b[!.,]+\s*", re.I)
_HERE_IS = re.compile(r"^here(?:'s| is| are)\b[^:\n]{0,60}:\s*", re.I)
_LABEL = re.compile(r"^[*_]*(?:updated |rolling |new |running )?summary[*_]*\s*:[*_]*\s*", re.I)
_CHATTER_START = r"(?:let me know|i hope|hope this|feel free|is there anything|if you (?:need|have|want|would))"
_CHATTER = re.compile("^" + _CHATTER_START, re.I)
_MARK = re.compile(r"[.!?]")
_LINE_MARKUP = re.compile(r"^\s*(?:#+\s+|[-*\u2022]\s+|\d+[.)]\s+)")


def clean_summary(text: str, max_tokens: int, fmt: ChatFormat) -> str:
    """The model's summary reply as plain sentences, without chatter, capped at `max_tokens`.

    Removes a leading "Sure! Here is the updated summary:" (or a "Summary:" label) and leading
    markdown headings, bullet and heading marks and bold marks, and trailing "Let me know if..." lines; joins lines into
    sentences; then cuts at a sentence boundary to fit (see `cap_text`).
    """
    lines = [ln.strip() for ln in text.strip().splitlines()]
    first = 0  # an index, not pop(0): that moved every later line, per line dropped
    while first < len(lines) and (
        not lines[first] or lines[first].startswith("#") or _PREAMBLE_LINE.match(lines[first])
    ):
        first += 1
    lines = lines[first:]
    while lines and (not lines[-1] or _CHATTER.match(lines[-1])):
        lines.pop()
    sentences = []
    for i, line in enumerate(lines):
        if i == 0:
            line = _INTERJECTION.sub("", line)
            line = _HERE_IS.sub("", line)
            line = _LABEL.sub("", line)
        line = _LINE_MARKUP.sub("", line).replace("**", "").replace("__", "").strip()
        if not line:
            continue
        if line[-1] not in ".!?:;\"')":
            line += "."
        sentences.append(line)
    joined = " ".join(" ".join(sentences).split())
    return cap_text(_drop_trailing_chatter(joined), max_tokens, fmt.count)


def _drop_trailing_chatter(text: str) -> str:
    """`text` without its last sentences while they are chatter ("Let me know if...", "I hope this helps.").

    A sentence starts at the text's start or after one of . ! ?; the last one is chatter when, after
    whitespace, it starts with `_CHATTER_START` and has no . ! ? before its closing marks (then only
    whitespace). One pass from the end over the marks' positions: linear, where substituting
    `_TRAILING_CHATTER` until nothing changed rescanned the whole text once per sentence dropped.
    """
    marks = [m.start() for m in _MARK.finditer(text)]
    end = len(text)
    while end:
        body = end
        while body and text[body - 1].isspace():
            body -= 1
        while body and text[body - 1] in ".!?":
            body -= 1
        start = marks[bisect.bisect_left(marks, body) - 1] + 1 if body and marks and marks[0] < body else 0
        if not _CHATTER.match(text[start:end].lstrip()):
            break
        end = start
    return text[:end]
