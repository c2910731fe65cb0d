"""A fair queue between owners: a per-owner cap on waiting requests, round-robin turns,
and positions that count what is really ahead. The pure `FairQueue` first, then the real Engine
over a scripted FakeRunner (no model; milliseconds each)."""

from __future__ import annotations

import pytest

from llmweb.engine.queue import FairQueue, Lanes
from llmweb.engine.request import EngineLimits, GenerationRequest, Handle, Waiting
from llmweb.errors import BusyError, Cancelled
from tests.fakes import FakeRunner, fake_engine


def req(ids=(1, 2, 3), n=8, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, **kw)


# ---- the pure queue (no engine, no threads)


def make(queue: FairQueue, *names: str) -> dict[str, Handle]:
    """Push handles named like "A1" (owner "A") in the order given."""
    handles = {}
    for name in names:
        handles[name] = Handle(req(owner=name[0]), engine=None)
        queue.push(handles[name])
    return handles


def serve_all(queue: FairQueue, handles: dict[str, Handle]) -> list[str]:
    names = {id(h): name for name, h in handles.items()}
    order = []
    while len(queue):
        order.append(names[id(queue.pop())])
    return order


def positions(queue: FairQueue, handles: dict[str, Handle]) -> dict[str, int]:
    return {name: queue.position(h) for name, h in handles.items() if queue.position(h)}


def test_owners_take_turns_first_in_first_out_within_one_owner():
    q = FairQueue()
    handles = make(q, "A1", "A2", "A3", "B1", "C1")
    assert len(q) == 5 and q.waiting("A") == 3 and q.waiting("B") == 1 and q.waiting("Z") == 0
    assert positions(q, handles) == {"A1": 1, "B1": 2, "C1": 3, "A2": 4, "A3": 5}
    assert serve_all(q, handles) == ["A1", "B1", "C1", "A2", "A3"]


def test_positions_match_the_serving_order_after_a_turn_a_newcomer_and_a_removal():
    q = FairQueue()
    handles = make(q, "A1", "A2", "A3", "B1", "C1")
    assert q.pop() is handles["A1"]  # A has had its turn: it goes behind everyone who has not
    handles.pop("A1")
    handles.update(make(q, "D1", "B2"))
    assert q.remove(handles["C1"]) and not q.remove(handles["C1"])
    assert q.position(handles["C1"]) == 0
    handles.pop("C1")
    expected = positions(q, handles)
    order = serve_all(q, handles)
    assert order == ["B1", "D1", "A2", "B2", "A3"]
    assert order == sorted(expected, key=expected.get), "each position was the request's real turn"


def test_the_owner_just_served_goes_behind_a_newcomer_even_if_it_asked_first():
    q = FairQueue()
    handles = make(q, "A1")
    q.pop()  # A1 runs; nothing else waits
    handles.update(make(q, "A2", "B1"))
    assert positions(q, handles) == {"B1": 1, "A2": 2}
    assert serve_all(q, handles) == ["B1", "A2"]


def test_owners_served_long_ago_still_go_before_the_ones_served_lately():
    q = FairQueue()
    handles = make(q, "A1", "B1", "C1")
    serve_all(q, handles)  # turns: A, B, C
    handles = make(q, "C2", "B2", "A2")
    assert serve_all(q, handles) == ["A2", "B2", "C2"]


def test_only_the_latest_turns_are_remembered_and_the_forgotten_owner_still_goes_first():
    q = FairQueue()
    q.remember = 2
    handles = make(q, "A1", "B1", "C1")
    serve_all(q, handles)  # turns: A (forgotten), B, C
    assert len(q._served) == 2
    handles = make(q, "C2", "B2", "A2")
    assert serve_all(q, handles) == ["A2", "B2", "C2"]


def test_lanes_bound_each_lane_cap_owners_only_interactive_and_serve_background_last():
    # interactive: bounded by the estimated wait (here 10 s per request ahead), not by a count
    lanes = Lanes(EngineLimits(queue_size=2, queue_per_user=1, max_wait_s=15), wait_s=lambda ahead: 10.0 * len(ahead))
    a1, b1 = Handle(req(owner="A"), engine=None), Handle(req(owner="B"), engine=None)
    jobs = [Handle(req(owner="A", background=True), engine=None) for _ in range(9)]
    lanes.push(jobs[0])
    assert lanes.peek() is jobs[0], "a background job runs when no interactive request waits"
    lanes.push(a1)
    with pytest.raises(BusyError, match="you already have 1 request waiting"):
        lanes.push(Handle(req(owner="A"), engine=None))
    lanes.push(b1)
    with pytest.raises(BusyError, match="about 20 s of work is waiting, over this server's limit of 15 s"):
        lanes.push(Handle(req(owner="C"), engine=None))
    for job in jobs[1:8]:
        lanes.push(job)  # background: 4 x queue_size, no per-owner cap
    with pytest.raises(BusyError, match="8 background jobs are waiting"):
        lanes.push(jobs[8])
    assert lanes.peek() is a1 and lanes.position(a1) == 1 and lanes.position(jobs[0]) == 0
    assert lanes.take(a1) and not lanes.take(a1) and lanes.remove(jobs[3]) and not lanes.remove(jobs[3])
    assert lanes.take(b1) and lanes.peek() is jobs[0]
    assert lanes.drain() == [j for j in jobs[:8] if j is not jobs[3]] and not lanes


# ---- the engine


@pytest.fixture
def engine():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.005), queue_size=8)
    yield e, runner
    e.close()


def busy_with(e, runner, owner: str) -> Handle:
    """Start a long request of `owner` and return once the worker runs it (it holds no place)."""
    runner.enqueue(list(range(1000, 1256)))
    first = e.submit(req((1,), n=256, owner=owner))
    assert runner.running.wait(5), "the first request runs"
    assert e.queue_depth == 0
    return first


def served(runner) -> list[int]:
    return [r.prompt_ids[0] for r in runner.requests]


def test_a_flood_from_one_owner_is_capped_and_another_owner_goes_first(engine):
    e, runner = engine
    first = busy_with(e, runner, "A")
    accepted, refused = [], []
    for i in range(2, 11):  # A's requests 2..10 while A's first runs
        try:
            accepted.append(e.submit(req((100 + i,), owner="A")))
        except BusyError as err:
            refused.append(str(err))
    b = e.submit(req((200,), owner="B"))
    assert len(accepted) == 2 and len(refused) == 7, "2 waiting per owner; the running one does not count"
    assert all("you already have 2 requests waiting" in m for m in refused)
    assert e.counters.refused == 7
    assert b.position == 1, "only what is really ahead counts: A has had its turn"
    assert isinstance(ev := next(b.events(poll_s=0.01)), Waiting) and ev.position == 1
    assert [h.position for h in accepted] == [2, 3]
    first.cancel()
    for h in [first, b, *accepted]:
        h.result()
    assert served(runner) == [1, 200, 102, 103], "B's one request is served before A's second and third"


def test_the_single_users_own_requests_queue_past_the_per_owner_cap_and_others_stay_capped():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.01), queue_size=2, uncapped_owner="local")
    try:
        first = busy_with(e, runner, "local")
        mine = [e.submit(req((100 + i,), owner="local")) for i in range(2, 10)]  # 8 = 4 x queue_size
        with pytest.raises(BusyError, match="you already have 8 requests waiting"):
            e.submit(req((110,), owner="local"))
        b = [e.submit(req((200 + i,), owner="B")) for i in range(2)]
        with pytest.raises(BusyError, match="you already have 2 requests waiting"):
            e.submit(req((202,), owner="B"))
        first.cancel()
        for h in [*mine, *b]:
            h.result()
        assert served(runner)[:4] == [1, 200, 102, 201], "the single user's queue does not starve another owner"
    finally:
        e.close()


def test_positions_under_round_robin_follow_the_real_turns_also_after_a_cancel(engine):
    e, runner = engine
    first = busy_with(e, runner, "A")
    a2, a3 = e.submit(req((102,), owner="A")), e.submit(req((103,), owner="A"))
    b1, b2 = e.submit(req((201,), owner="B")), e.submit(req((202,), owner="B"))
    c1 = e.submit(req((301,), owner="C"))
    assert [h.position for h in (b1, c1, a2, b2, a3)] == [1, 2, 3, 4, 5]
    c1.cancel()
    assert [h.position for h in (b1, a2, b2, a3)] == [1, 2, 3, 4]
    assert c1.position == 0 and e.queue_depth == 4
    first.cancel()
    for h in (first, a2, a3, b1, b2):
        h.result()
    with pytest.raises(Cancelled):
        c1.result()
    assert served(runner) == [1, 201, 102, 202, 103]


def test_a_cancelled_waiting_request_frees_its_owners_place_at_once(engine):
    e, runner = engine
    first = busy_with(e, runner, "A")
    a2, a3 = e.submit(req((102,), owner="A")), e.submit(req((103,), owner="A"))
    with pytest.raises(BusyError, match="you already have 2 requests waiting"):
        e.submit(req((104,), owner="A"))
    a2.cancel()
    a4 = e.submit(req((104,), owner="A"))  # not busy: a2's place is free
    assert [a3.position, a4.position] == [1, 2]
    first.cancel()
    for h in (first, a3, a4):
        h.result()
    with pytest.raises(Cancelled, match="before it started"):
        a2.result()
    assert served(runner) == [1, 103, 104]


def test_requests_without_an_owner_share_one_bucket(engine):
    e, runner = engine
    first = busy_with(e, runner, "")
    queued = [e.submit(req()) for _ in range(2)]
    with pytest.raises(BusyError, match="you already have 2 requests waiting"):
        e.submit(req())
    assert e.submit(req(owner="B")).position == 1
    first.cancel()
    for h in queued:
        h.cancel()


def test_the_wait_bound_holds_for_every_owner_with_its_own_message():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.2), queue_size=3, max_wait_s=17)
    try:
        e.pace.step_s, e.pace.stepped = 0.05, lambda seconds: None  # held still: the estimates are exact
        first = busy_with(e, runner, "A")  # 256 tokens: ~12.8 s left
        waiting = [e.submit(req(owner=o, n=40)) for o in "BCD"]  # 2 s each: D waits ~16.8 s
        over = r"busy: about 1[89] s of work is waiting, over this server's limit of 17 s"
        with pytest.raises(BusyError, match=over):
            e.submit(req(owner="E"))
        assert [h.position for h in waiting] == [1, 2, 3] and e.counters.refused == 1
        first.cancel()
        for h in waiting:
            h.cancel()
    finally:
        e.close()


def test_background_jobs_have_no_per_owner_cap_and_still_come_last(engine):
    e, runner = engine
    first = busy_with(e, runner, "A")
    a2, a3 = e.submit(req((102,), owner="A")), e.submit(req((103,), owner="A"))
    summaries = [e.submit(req((900 + i,), owner="A", background=True)) for i in range(3)]
    b = e.submit(req((200,), owner="B"))
    assert all(s.position == 0 for s in summaries), "background jobs are never counted as waiting users"
    first.cancel()
    for h in (first, a2, a3, b, *summaries):
        h.result()
    assert served(runner) == [1, 200, 102, 103, 900, 901, 902]
