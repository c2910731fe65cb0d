"""The sampler's rules, once: greedy when the temperature is 0, else temperature and top-p with a
seeded generator (a request's seed, else the clock), and a repetition penalty over prompt +
generated ids (as transformers' processors: a seen id's logit is divided by the penalty if
positive, multiplied if negative), then the loop guard's ban (runners/loopguard.py: the id that would
begin a third copy of a sentence; when the guard has given up, the stop id). Two back ends do only
the arithmetic: NumpySampler on llama.cpp's logits, TorchSampler on a torch model's (transformers'
own processors). Under a constraint (engine/constraint.py: a JSON schema, the tool-call format)
the grammar's mask goes where the guard's ban does, and the guard and the penalty are off (JSON
repeats its keys by design).

Must not: hold a runner's state or import torch at module level (the llama.cpp path needs none).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from llmweb.engine.constraint import Matcher
from llmweb.engine.request import GenerationRequest
from llmweb.engine.runners.loopguard import LoopGuard, Pieces


class Sampler:
    """The next id from one row of logits: the penalty, the guard's ban, then argmax or a draw; the id is seen."""

    def __init__(
        self,
        request: GenerationRequest,
        prompt: list[int],
        pieces: Pieces | None = None,
        matcher: Matcher | None = None,
    ):
        self.greedy = request.temperature <= 0
        self.temperature = request.temperature
        self.top_p = request.top_p
        self.matcher = matcher  # the request's grammar, where it has one
        self.penalty = (request.repetition_penalty or 1.0) if matcher is None else 1.0
        self.seed = None if self.greedy else (request.seed if request.seed is not None else time.time_ns() % 2**31)
        guarded = request.loop_guard and matcher is None
        self.guard = LoopGuard(pieces, request.stop_ids) if guarded and pieces is not None else None

    def __call__(self, logits: Any) -> int:
        guard = self.guard
        forced = guard.forced() if guard is not None else None
        if forced is not None:
            self._seen(forced)
            return forced
        scores = self._penalised(logits) if self.penalty != 1.0 else self._scores(logits)
        cut = False
        if guard is not None and (banned := guard.banned()):
            cut = self._argmax(scores) in banned  # the model's first choice would go on copying
            scores = self._banned(scores, sorted(banned))
        if self.matcher is not None:
            scores = self._masked(scores, self.matcher.allowed())
        nxt = self._argmax(scores) if self.greedy else self._draw(scores)
        if guard is not None:
            guard.seen(nxt, cut)
        if self.matcher is not None:
            self.matcher.seen(nxt)
        self._seen(nxt)
        return nxt

    # ---- what a back end does
    def _scores(self, logits: Any) -> Any:
        return logits

    def _penalised(self, logits: Any) -> Any:
        raise NotImplementedError

    def _banned(self, scores: Any, ids: list[int]) -> Any:
        """The scores with `ids` at -inf (a copy: the logits may be the back end's own buffer)."""
        raise NotImplementedError

    def _masked(self, scores: Any, allowed: np.ndarray) -> Any:
        """The scores with every id outside `allowed` (a bool (vocab,) mask) at -inf (a copy)."""
        raise NotImplementedError

    def _argmax(self, scores: Any) -> int:
        raise NotImplementedError

    def _draw(self, scores: Any) -> int:
        raise NotImplementedError

    def _seen(self, nxt: int) -> None:
        raise NotImplementedError


class NumpySampler(Sampler):
    """On a (vocab,) numpy row; the seen ids as a boolean mask and as an index array: the penalty
    gathers and scatters only the seen ids (18 us a token at 800 of 49,152, against 81 us through
    the mask, which reads the whole row twice)."""

    def __init__(
        self,
        request: GenerationRequest,
        prompt: list[int],
        n_vocab: int,
        pieces: Pieces | None = None,
        matcher: Matcher | None = None,
    ):
        super().__init__(request, prompt, pieces, matcher)
        self.seen = np.zeros(n_vocab, dtype=bool)
        self.seen_ids = np.zeros(0, dtype=np.int64)
        if self.penalty != 1.0:
            self.seen[np.asarray(prompt, dtype=np.int64)] = True
            self.seen_ids = np.flatnonzero(self.seen)
        self.rng = None if self.seed is None else np.random.default_rng(self.seed)

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        logits = logits.copy()
        seen = logits[self.seen_ids]
        logits[self.seen_ids] = np.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return logits

    def _banned(self, scores: np.ndarray, ids: list[int]) -> np.ndarray:
        scores = scores.copy()
        scores[ids] = -np.inf
        return scores

    def _masked(self, scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        return np.where(allowed[: len(scores)], scores, -np.inf)

    def _argmax(self, scores: np.ndarray) -> int:
        return int(np.argmax(scores))

    def _draw(self, logits: np.ndarray) -> int:
        assert self.rng is not None
        scores = logits.astype(np.float64) / self.temperature
        scores -= scores.max()
        probs = np.exp(scores)
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, self.top_p)) + 1]  # the smallest set reaching top_p
            kept = probs[keep] / probs[keep].sum()
            return int(keep[self.rng.choice(len(keep), p=kept)])
        return int(self.rng.choice(len(probs), p=probs))

    def _seen(self, nxt: int) -> None:
        if not self.seen[nxt]:
            self.seen[nxt] = True
            self.seen_ids = np.append(self.seen_ids, nxt)


class TorchSampler(Sampler):
    """On (1, vocab) torch logits, with transformers' processors; prompt + generated ids in one
    preallocated tensor, filled in place, one column per step."""

    def __init__(
        self,
        request: GenerationRequest,
        prompt: list[int],
        device: str,
        pieces: Pieces | None = None,
        matcher: Matcher | None = None,
    ):
        import torch
        from transformers import (
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        super().__init__(request, prompt, pieces, matcher)
        self.torch = torch
        self.penalise = RepetitionPenaltyLogitsProcessor(self.penalty) if self.penalty != 1.0 else None
        warpers = [] if self.greedy else [TemperatureLogitsWarper(self.temperature)]
        if not self.greedy and self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self._ids = torch.empty(1, len(prompt) + request.max_new_tokens + 1, dtype=torch.long, device=device)
        self._ids[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self._n = len(prompt)
        self.gen = None
        if self.seed is not None:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(int(self.seed))

    def _scores(self, logits):
        return logits.float()

    def _penalised(self, logits):
        assert self.penalise is not None
        return self.penalise(self._ids[:, : self._n], logits.float())

    def _banned(self, scores, ids: list[int]):
        scores = scores.clone()
        scores[0, ids] = float("-inf")
        return scores

    def _masked(self, scores, allowed: np.ndarray):
        keep = self.torch.from_numpy(allowed[: scores.shape[-1]]).to(scores.device)
        return scores.masked_fill(~keep, float("-inf"))

    def _argmax(self, scores) -> int:
        return int(scores.argmax(dim=-1)[0])

    def _draw(self, scores) -> int:
        scores = self.warpers(self._ids[:, : self._n], scores) if len(self.warpers) else scores
        probs = self.torch.softmax(scores, dim=-1)
        return int(self.torch.multinomial(probs, 1, generator=self.gen)[0, 0])

    def _seen(self, nxt: int) -> None:
        if self._n < self._ids.shape[1]:
            self._ids[0, self._n] = nxt
            self._n += 1
