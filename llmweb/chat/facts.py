"""The user's facts, kept word for word, and grounding a model-written summary in its turns.

Pure text logic: no torch, no I/O. ("Memory" elsewhere in llmweb means RAM and VRAM.) A small
model's summary can invent names and numbers ("Dana Okafor, a Maltese Terrier..."); `ground()`
drops every summary sentence that carries a name, number or date found nowhere in the text it
summarises. `extract_facts()` picks the user's own sentences that state facts (names, numbers,
dates, preferences, "remember ...") so they can be kept verbatim next to the summary, whatever
the model's size. `select_facts()` applies a token cap: every pinned fact, then the newest
unpinned ones that fit; the oldest unpinned go first. The planner (chat/context.py) places them as
their own prompt section, "facts".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

FACTS_HEADER = "Facts the user stated (verbatim):"

# A sentence: a run of text up to its end marks (full-width marks end CJK sentences), or up to the
# end of the text; a run cut by a newline is not a sentence. Linear: the lookbehind starts a match
# only where a run starts, and the possessive run never gives characters back (a plain
# `[^...]+(?:[...]+|$)` retried every suffix of a long line cut by a newline: quadratic).
_SENTENCE = re.compile(r"(?<![^.!?。！？\n])[^.!?。！？\n]++(?:[.!?。！？]+|$)")
# letters of any script; numbers. The group repeat is possessive: a plain one kept a backtracking
# point per character of a word, and a 500,000-letter word took 100x the time of a 32,000-letter one.
_WORD = re.compile(r"[^\W\d_](?:[^\W\d_]|['’\-])*+|\d[\d,.:/\-]*")
_NUMBER = re.compile(r"\d")
_VERBISH = re.compile(r"(ed|ing|ly|s)$")
_MONTHS = (
    "january february march april may june july august september october november december "
    "monday tuesday wednesday thursday friday saturday sunday"
).split()
# capitalised words that are not names: sentence starters, pronouns, chat roles
_COMMON = set(
    """a an the this that these those there here it its i i'm i've i'd i'll me my mine we our you your
he she him her his they them their what which who whom whose when where why how yes no not and but or so if
then also in on at to for from of by with about as after before during since until while user assistant
summary the conversation earlier later finally first second third next they've we've okay ok please thanks
thank sure hello hi dear today tomorrow yesterday some many most all both each every any one two""".split()
)

_FIRST_PERSON = re.compile(r"\b(i|i'm|i've|me|my|mine|we|our|us)\b", re.I)
_FACT_CUES = re.compile(
    r"\b(remember|my name|i am|i'm|my \w+ (?:is|are|was)|i (?:live|work|was born|like|love|prefer|hate|have|own|use)"
    r"|call me|favou?rite|birthday|allergic|deadline|born)\b",
    re.I,
)
# "Remember this" in the languages our users write: the one cue no general rule can see. A stem
# each (German merk-/vergiss nicht, Korean 기억 "memory", Japanese 覚え, Chinese 记住/記住, French
# retiens/souviens, Spanish recuerda); English is in _FACT_CUES.
_REMEMBER = re.compile(
    r"merk|vergiss nicht|erinner|기억|잊지|覚え|忘れないで|记住|記住|retiens|souviens|recuerda", re.I
)
_QUESTION = ("?", "？", "¿")
# a detail worth a fact: 3+ digits (4471, 2019), a time (07:40), or a code with a letter before a
# digit (Zanzibar-0815, v2); not a small count with a counter word after it (Korean "35번", "3개")
_FACT_DETAIL = re.compile(r"\d{3,}|\d:\d\d|[^\W\d_]-?\d")


@dataclass(frozen=True)
class Grounded:
    text: str  # the summary with ungrounded sentences removed
    dropped: tuple[str, ...]  # the removed sentences


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.findall(text) if s.strip()]


def salient_terms(sentence: str) -> set[str]:
    """Names (capitalised words that are not common words), numbers and dates, lower-cased.

    A sentence's first word is capitalised anyway; it counts as a name only when it does not
    look like a verb or adverb ("Discussed", "Asking", "Mostly", "Mentions").
    """
    terms = set()
    for i, word in enumerate(_WORD.findall(sentence)):
        if _NUMBER.match(word):
            terms.add(word.strip(".,:/-"))
        elif word[0].isupper() and word.lower() not in _COMMON:
            if i == 0 and _VERBISH.search(word.lower()):
                continue
            terms.add(_base(word))
    return {t for t in terms if t}


def _base(word: str) -> str:
    w = word.lower()
    for suffix in ("'s", "’s"):
        if w.endswith(suffix):
            w = w[: -len(suffix)]
    return w.strip(".,:/-")


def _vocabulary(source: str) -> set[str]:
    return {_base(w) for w in _WORD.findall(source)}


_TOKEN = re.compile(r"\w[\w'’\-.:/]*")  # any script: letters, digits, "_", and codes like "Zanzibar-7781"
_CODE = re.compile(r"_|[a-z][A-Z]")  # snake_case, camelCase


def detail_terms(text: str) -> set[str]:
    """The details a paraphrase loses, lower-cased: codes and numbers (of 3+ characters, or mixed
    with letters: "7781", "3pm", "v2"), identifiers (snake_case, camelCase) and names (capitalised
    words inside a sentence that are not common words). Any script; a sentence's first word counts
    only as a code or number (a capital there says nothing), and so do one- or two-digit counts
    ("Question 2", "3 eggs") which a summary may drop without losing the point.

    Recall (chat/session.py) brings back an earlier turn only for such details: without them the summary's
    paraphrase already carries what the turn said.
    """
    terms = set()
    for sentence in sentences(text):
        for i, raw in enumerate(_TOKEN.findall(sentence)):
            word = raw.strip(".,:/-'’")
            if not word:
                continue
            digits = sum(c.isdigit() for c in word)
            if digits:
                if len(word) >= 3 or digits < len(word):
                    terms.add(word.lower())
            elif _CODE.search(word):
                terms.add(word.lower())
            elif i > 0 and word[0].isupper() and word.lower() not in _COMMON:
                terms.add(_base(word))
    return terms


def vocabulary(text: str) -> set[str]:
    """Every word and code of `text`, lower-cased, in the form `detail_terms` gives them."""
    return {w.strip(".,:/-'’").lower() for w in _TOKEN.findall(text)} | _vocabulary(text)


# the user speaking about themselves: a subject or possessive pronoun ("I", "my", "we"), not an
# object ("tell me about bread" is a request), in the languages our users write; CJK pronouns are
# not space-delimited words, so no \b around them
_SELF = re.compile(
    r"\b(?:i|i'm|i've|i'd|i'll|my|mine|we|we're|we've|our|ich|mein\w*|wir|unser\w*|je|j'|mon|ma|mes|nous|notre"
    r"|nos|yo|mi|mis|nosotros|nuestr\w*)\b|저는|제가|나는|내가|私|僕|我",
    re.I,
)
# English function words a statement's content leaves out (with _COMMON)
_FUNCTION = set(
    """is am are was were be been being have has had do does did will would can could should shall may
might must very really just too quite than into onto over under out up down off only own more much such
always never often sometimes usually still even again""".split()
)


def _stem(word: str) -> str:
    """A crude English stem, so that "plays", "playing" and "played" meet "play" ("cellos" "cello")."""
    for suffix in ("ing", "ed", "es", "s"):
        if len(word) > len(suffix) + 3 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


def unkept_statements(text: str, known: set[str]) -> list[str]:
    """The user's statements about themselves in `text` that a summary did not keep.

    A statement is a sentence that is not a question and speaks in the first person ("I play the
    cello in a quartet."); it is unkept when at least half of its content words (not function or
    common words, not numbers, 3+ characters; compared by a crude stem) are missing from `known` (a
    `vocabulary`). Such a sentence carries no detail term (`detail_terms`) a paraphrase loses, yet
    a small model's summary often drops it whole; recall (chat/session.py) brings its turn back when a
    message asks about it.
    """
    known_stems = {_stem(w) for w in known}
    out = []
    for s in sentences(text):
        if s.endswith(_QUESTION) or not _SELF.search(s):
            continue
        words = {w.strip(".,:/-'’").lower() for w in _TOKEN.findall(s)}
        content = {
            _stem(w)
            for w in words
            if len(w) >= 3
            and not any(c.isdigit() for c in w)
            and w not in _COMMON
            and w not in _FUNCTION
            and not _SELF.fullmatch(w)
        }
        if content and 2 * len(content - known_stems) >= len(content):
            out.append(s)
    return out


def ground(summary: str, source: str) -> Grounded:
    """Keep only summary sentences whose names, numbers and dates all occur in `source`."""
    vocab = _vocabulary(source)
    kept: list[str] = []
    dropped: list[str] = []
    for s in sentences(summary):
        missing = {t for t in salient_terms(s) if t not in vocab and t not in _MONTHS}
        (dropped if missing else kept).append(s)
    return Grounded(" ".join(kept), tuple(dropped))


def is_fact(sentence: str) -> bool:
    """Does a user's sentence state a fact worth keeping word for word?

    In any language: a statement (not a question) that asks to be remembered, or that carries a
    code or number a paraphrase would lose (a `detail_terms` term with 3+ digits, a time or a code:
    "4471", "Zanzibar-7781", "07:40", "2019"; not a small count, even with a counter: "35번").
    In English also the cue phrases ("my name", "I prefer") and a first-person sentence with a name."""
    s = sentence.strip()
    if s.endswith(_QUESTION) or (len(s) < 8 and len(s.split()) < 3):  # CJK: few spaces, many characters
        return False
    if _FACT_CUES.search(s) or _REMEMBER.search(s):
        return True
    if any(_FACT_DETAIL.search(term) for term in detail_terms(s)):
        return True
    words = _WORD.findall(s)
    # otherwise: about the user (first person) and carrying a number or a name (a capitalised,
    # uncommon word that is not the first); "Question 3: name a colour." is not a fact
    if not _FIRST_PERSON.search(s):
        return False
    return bool(_NUMBER.search(s)) or any(w[0].isupper() and w.lower() not in _COMMON for w in words[1:])


def extract_facts(user_messages: Iterable[str], max_chars: int = 300) -> list[str]:
    """The fact-stating sentences of the user's messages, verbatim, in order, without repeats."""
    seen, out = set(), []
    for message in user_messages:
        for s in sentences(message):
            key = " ".join(s.lower().split())
            if key in seen or len(s) > max_chars or not is_fact(s):
                continue
            seen.add(key)
            out.append(s)
    return out


SUGGEST_TURNS, SUGGEST_CHARS, SUGGESTIONS = 200, 2000, 20  # what `suggestions` reads, and gives at most


def suggestions(user_messages: Sequence[str], known: Iterable[str]) -> list[str]:
    """The fact sentences of a chat's user messages (the last SUGGEST_TURNS, each's first
    SUGGEST_CHARS) not among `known` (case and spacing aside), the newest SUGGESTIONS: what llmweb
    offers to remember in all the owner's chats. It offers; only the owner's click keeps one."""
    seen = {" ".join(k.lower().split()) for k in known}
    found = extract_facts(m[:SUGGEST_CHARS] for m in user_messages[-SUGGEST_TURNS:])
    return [f for f in found if " ".join(f.lower().split()) not in seen][-SUGGESTIONS:]


@dataclass(frozen=True)
class FactLike:
    text: str
    pinned: bool


def fact_cost(fact, count: Callable[[str], int]) -> int:
    """Tokens one fact takes in the facts block ("- " + text + newline), as `select_facts` counts them."""
    return count(fact.text) + 2


def pinned_cost(facts: Sequence, count: Callable[[str], int]) -> int:
    return sum(fact_cost(f, count) for f in facts if f.pinned)


def select_facts(facts: Sequence, max_tokens: int, count: Callable[[str], int]) -> tuple[list, list]:
    """(kept, dropped): every pinned fact, whatever it costs, then the newest unpinned facts that
    fit in what `max_tokens` leaves. `facts` are oldest first; both lists keep that order."""
    used = pinned_cost(facts, count)
    chosen = {i for i, f in enumerate(facts) if f.pinned}
    for i in reversed(range(len(facts))):
        if facts[i].pinned:
            continue
        cost = fact_cost(facts[i], count)
        if used + cost <= max_tokens:
            chosen.add(i)
            used += cost
    kept = [f for i, f in enumerate(facts) if i in chosen]
    dropped = [f for i, f in enumerate(facts) if i not in chosen]
    return kept, dropped


def facts_block(facts: Sequence) -> str:
    if not facts:
        return ""
    return FACTS_HEADER + "\n" + "\n".join(f"- {f.text}" for f in facts)
