"""The stateless API path's fitting (chat/stateless.py): a client's whole message list answered
inside the budget, the oldest turns folded into a summary that the next call reuses."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmweb.chat.context import Budget
from llmweb.chat.stateless import Memory, SummaryCache, dialogue, fit, prefix_keys
from llmweb.config import Settings
from llmweb.records import Turn
from tests.fakes import FakeFormat

BUDGET = Budget(context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60)


def turns(n: int, words: int = 6) -> list[tuple[str, str]]:
    msgs = []
    for i in range(n):
        msgs.append(("user", f"question {i} " + " ".join(f"u{i}w{j}" for j in range(words))))
        msgs.append(("assistant", f"answer {i} " + " ".join(f"a{i}w{j}" for j in range(words))))
    return msgs


class Folder:
    """A fake summariser: the summary names the folded turns; counts its calls."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, memory: Memory, folded) -> Memory:
        self.calls.append(len(folded))
        return Memory((memory.summary + f" folded {len(folded)} turns.").strip())


def test_dialogue_pairs_turns_joins_runs_and_keeps_system_messages():
    d = dialogue(
        [("system", "S1"), ("assistant", "welcome"), ("user", "a"), ("user", "b"), ("assistant", "c"), ("system", "S2")]
        + [("user", "last")]
    )
    assert d.system == "S1\n\nS2"
    assert d.turns == (Turn("", "welcome"), Turn("a\n\nb", "c"))
    assert d.user == "last" and d.sizes == (1, 3)


def test_a_history_that_fits_is_sent_whole_without_a_summary():
    fmt, fold = FakeFormat(), Folder()
    d = dialogue(turns(3) + [("user", "now?")])
    f = fit(d, "system", BUDGET, fmt, SummaryCache(), "owner", fold, high=0.85, low=0.5)
    assert f.plan.kept_turns == 3 and f.summarized_turns == 0 and not fold.calls
    assert f.report()["left_out_messages"] == 0


def test_a_long_history_is_summarised_oldest_first_within_the_budget_and_the_next_call_reuses_it():
    fmt, fold, cache = FakeFormat(), Folder(), SummaryCache()
    msgs = turns(100)  # 200 messages, ~1,600 words: eight times the context
    f = fit(dialogue(msgs + [("user", "now?")]), "system", BUDGET, fmt, cache, "owner", fold, high=0.85, low=0.5)
    assert len(f.plan.ids) + BUDGET.max_new_tokens <= BUDGET.context_limit
    assert f.summarized_turns > 90 and f.summarized_messages == 2 * f.summarized_turns
    assert f.plan.dropped_turns == 0 and f.plan.kept_turns == 100 - f.summarized_turns
    assert "folded" in f.plan.summary and f.folds == len(fold.calls) >= 1 and not f.from_cache

    # the client sends the same chat, two messages longer: the summary comes from the cache
    calls = len(fold.calls)
    again = fit(
        dialogue(msgs + [("user", "now?"), ("assistant", "ok"), ("user", "and?")]),
        "system", BUDGET, fmt, cache, "owner", fold, high=0.85, low=0.5,
    )  # fmt: skip
    assert again.from_cache and again.summarized_turns >= f.summarized_turns
    assert len(fold.calls) - calls <= 1, "at most one fold of the newest turns, never the whole chat again"
    # another owner's identical chat does not see that cache
    other = fit(dialogue(msgs + [("user", "now?")]), "system", BUDGET, fmt, cache, "someone else", Folder(),
                high=0.85, low=0.5)  # fmt: skip
    assert not other.from_cache


def test_a_fold_that_fails_leaves_the_rest_out_and_says_why():
    from llmweb.errors import BusyError

    def busy(memory, folded):
        raise BusyError("The model is busy: 32 requests are waiting.")

    f = fit(dialogue(turns(100) + [("user", "now?")]), "system", BUDGET, FakeFormat(), SummaryCache(), "o", busy,
            high=0.85, low=0.5)  # fmt: skip
    assert len(f.plan.ids) + BUDGET.max_new_tokens <= BUDGET.context_limit
    assert f.summarized_messages == 0 and f.dropped_messages > 0 and f.dropped_messages + 2 * f.plan.kept_turns == 200
    assert "busy" in f.report()["summary_error"]


def test_folding_sends_batches_that_fit_with_the_summary_as_it_grows():
    from llmweb.chat.stateless import StatelessChat
    from llmweb.chat.summary import segment_request_messages
    from llmweb.chat.tokens import render_prompt

    fmt, cap = FakeFormat(), 30
    seen = []

    def write_summary(previous, batch):
        system, user = segment_request_messages(previous, batch, cap)
        seen.append((len(batch), len(render_prompt(fmt, system, [("user", user)]))))
        grown = previous.split() + [f"s{len(seen)}x{i}" for i in range(20)]  # grows, up to the cap
        return " ".join(grown[-cap:])

    chat = StatelessChat(Settings(), None, fmt, BUDGET, write_summary)  # summary_cap: BUDGET.summary_cap == cap
    memory = chat.fold(Memory(), [Turn(f"u{i} " * 5, f"a{i} " * 5) for i in range(40)])
    assert sum(n for n, _ in seen) == 40 and len(seen) > 1
    assert all(size <= BUDGET.context_limit - cap for _, size in seen), seen
    assert memory.summary.endswith(f"s{len(seen)}x19")


def test_prefix_keys_change_with_any_earlier_message():
    a = prefix_keys("o", [Turn("x", "y"), Turn("z", "w")])
    b = prefix_keys("o", [Turn("x", "y"), Turn("z", "W")])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert prefix_keys("o", [Turn("ab", "c")])[1] != prefix_keys("o", [Turn("a", "bc")])[1]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=40), min_size=0, max_size=60),
    user=st.integers(min_value=1, max_value=50),
    summaries=st.booleans(),
)
def test_any_history_is_answered_inside_the_budget(sizes, user, summaries):
    """Never fails for length, never over the budget, and what is not in the prompt is reported."""
    fmt = FakeFormat()
    msgs = []
    for i, n in enumerate(sizes):
        msgs.append(("user" if i % 2 == 0 else "assistant", " ".join(f"m{i}w{j}" for j in range(n))))
    if msgs and msgs[-1][0] == "user":
        msgs.append(("assistant", "ok"))
    d = dialogue(msgs + [("user", " ".join(f"q{j}" for j in range(user)))])
    f = fit(d, "sys", BUDGET, fmt, SummaryCache(), "o", Folder() if summaries else None, high=0.85, low=0.5)
    assert len(f.plan.ids) + BUDGET.max_new_tokens <= BUDGET.context_limit
    in_prompt = sum(d.sizes[len(d.turns) - f.plan.kept_turns :]) if f.plan.kept_turns else 0
    assert f.summarized_messages + f.dropped_messages + in_prompt == sum(d.sizes)
