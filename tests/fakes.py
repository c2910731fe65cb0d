"""Deterministic fakes for fast unit tests of pure logic (next to real-model tests, never instead)."""

from __future__ import annotations

from typing import Sequence


class FakeFormat:
    """A ChatFormat whose tokens are whitespace-separated words, with fixed per-message overhead.

    system_ids(text) = [BOS, SYS] + words + [END]; message_ids(role, text) = [START, ROLE] + words + [END];
    the generation prompt is [START, ASSISTANT]. Word ids are stable (assigned on first sight).
    """

    BOS, SYS, START, USER, ASSISTANT, END = 1, 2, 3, 4, 5, 6

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def _words(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = 100 + len(self.vocab)
                self.words[self.vocab[w]] = w
            ids.append(self.vocab[w])
        return ids

    def system_ids(self, text: str) -> list[int]:
        return [self.BOS, self.SYS] + self._words(text) + [self.END]

    def message_ids(self, role: str, text: str) -> list[int]:
        return [self.START, self.USER if role == "user" else self.ASSISTANT] + self._words(text) + [self.END]

    def generation_prompt_ids(self) -> list[int]:
        return [self.START, self.ASSISTANT]

    def count(self, text: str) -> int:
        return len(text.split())

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in ids if i in self.words)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.END})
