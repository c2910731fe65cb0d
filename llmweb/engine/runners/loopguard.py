"""The loop guard: a reply may say a sentence twice, never a third time.

Why: greedy decoding with a small model falls into loops that the repetition penalty does not
break (a summary said one sentence 12 times). A penalty on every repeated token would also bend
code and lists, which repeat short lines on purpose, so the guard acts on whole sentences only:

    sentence        the ids since the last boundary (a piece that holds a newline or ends in
                    . ! or ?); its first id without its leading spaces (" The" after a period
                    is "The" after a newline: the same sentence); a sentence of fewer than
                    MIN_TOKENS ids is never watched ("}", "- yes", "Thanks!")
    watched         a sentence the reply has already said `max_copies` times (2)
    banned          while the sentence being written is the first k ids of a watched one
                    (MIN_TOKENS <= k < WATCH), the id that would continue the copy; the sampler
                    takes the next best id instead, and counts a cut when the model's first
                    choice was that id
    code            inside a ``` fence nothing is watched or banned: code repeats lines
    give up         after GIVE_UP cuts the reply is looping however it is worded: the next id is
                    a stop id, and the reply ends (the turn's stats say so)

Each step costs at most a dict lookup on the sentence so far, which is looked at only while it is
shorter than WATCH ids, and a watched sentence adds WATCH prefixes at most: a reply of n tokens
costs O(n * WATCH) in all, whatever its sentences' lengths.

Must not: know a runner or a tokenizer: it reads the vocabulary's pieces (strings, one per id)
that the runner gives it once.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_TOKENS = 8  # a sentence shorter than this is never watched
WATCH = 48  # a watched sentence is followed for its first WATCH ids (a copy turns away by then)
GIVE_UP = 3  # cuts before the reply is ended


_NONE: frozenset[int] = frozenset()


class Pieces:
    """What the guard needs of a vocabulary, computed once per tokenizer: each id's text (its
    backticks open and close ``` fences), which ids end a sentence, and each id's bare form (the
    id of its text without leading spaces, where the vocabulary has one)."""

    def __init__(self, pieces: Sequence[str]):
        self.boundary = [_ends_sentence(p) for p in pieces]
        self.pieces = list(pieces)
        ids = {p: i for i, p in reversed(list(enumerate(self.pieces)))}  # the lowest id of each piece
        self.bare = [ids.get(p.lstrip(" "), i) if p.startswith(" ") else i for i, p in enumerate(self.pieces)]

    def __len__(self) -> int:
        return len(self.pieces)


def _ends_sentence(piece: str) -> bool:
    text = piece.rstrip(" ")
    return "\n" in piece or text.endswith((".", "!", "?"))


class LoopGuard:
    """One reply's guard (see the module docstring): `banned()` before each sampled id, `seen(id)` after."""

    def __init__(self, pieces: Pieces, stop_ids: frozenset[int] = frozenset(), max_copies: int = 2):
        self.pieces = pieces
        self.max_copies = max_copies
        self.stop = min(stop_ids) if stop_ids else None
        self.cuts = 0  # copies turned away
        self.gave_up = False  # the reply was ended as a loop
        self._sentence: list[int] = []
        self._counts: dict[tuple[int, ...], int] = {}
        self._next: dict[tuple[int, ...], set[int]] = {}  # a watched sentence's prefix -> the ids that continue it
        self._ticks = 0  # backticks in a row so far
        self._in_code = False

    def banned(self) -> frozenset[int] | set[int]:
        """The ids the next step must not sample (empty: no ban)."""
        if self._in_code or not MIN_TOKENS <= len(self._sentence) < WATCH or not self._next:
            return _NONE
        return self._next.get(tuple(self._sentence), _NONE)

    def forced(self) -> int | None:
        """The stop id that ends a reply the guard has given up on, once it has; else None."""
        return self.stop if self.gave_up else None

    def seen(self, token: int, cut: bool = False) -> None:
        """The sampled id joins the reply; `cut`: a ban turned the model away from its first choice."""
        if cut:
            self.cuts += 1
            if self.cuts >= GIVE_UP and self.stop is not None:
                self.gave_up = True
        known = 0 <= token < len(self.pieces)
        was_code = self._in_code
        self._follow_fences(self.pieces.pieces[token] if known else "")
        if was_code or self._in_code:
            self._sentence = []
            return
        self._sentence.append(self.pieces.bare[token] if known and not self._sentence else token)
        if known and self.pieces.boundary[token]:
            self._end_sentence()

    def _end_sentence(self) -> None:
        sentence = tuple(self._sentence)
        self._sentence = []
        if len(sentence) < MIN_TOKENS:
            return
        count = self._counts.get(sentence, 0) + 1
        self._counts[sentence] = count
        if count == self.max_copies:  # watch it from now on
            for k in range(MIN_TOKENS, min(len(sentence), WATCH)):
                self._next.setdefault(sentence[:k], set()).add(sentence[k])

    def _follow_fences(self, piece: str) -> None:
        for ch in piece:
            if ch == "`":
                self._ticks += 1
                continue
            if self._ticks >= 3:
                self._in_code = not self._in_code
            self._ticks = 0
