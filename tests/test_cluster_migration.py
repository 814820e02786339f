"""DistServe's pull rule as one policy (llmjax/cluster/migration.py), which the real and the
simulated clusters both run: a directed example, then random parks, aborts, decode failures and
pulls (hypothesis), each pull checked against the rule computed from scratch: the unpinned FIFO's
head to any decode instance that can take it, each pinned head only to its instance, the earliest
pull first, ties by first-token time, prefill instance and parking order; nothing overtakes a
head."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmjax.cluster.migration import ParkedQueue, checked_choice


def test_the_module_docs_example_and_fifo_heads():
    q = ParkedQueue()
    q.park("r1", 1.0, 0, "m1")
    q.park("r2", 0.5, 1, "m2")
    q.park("r3", 0.2, 0, "m3", pin=2)
    only3 = lambda j, p: p.ready if j == 3 else None
    pull = q.next_pull([2, 3], only3)
    assert (pull.time, pull.parked.request_id, pull.candidates) == (0.5, "r2", (3,))
    # r3 is pinned to 2, which cannot take it: it waits; r2 goes first, then r1 (FIFO)
    assert q.take(pull).request_id == "r2"
    assert q.next_pull([2, 3], only3).parked.request_id == "r1"
    # instance 2 can take anything at 5: the pinned r3 (ready 0.2) beats r1 on order at a tie
    at5 = lambda j, p: 5.0
    pull = q.next_pull([2, 3], at5)
    assert (pull.parked.request_id, pull.candidates) == ("r3", (2,))
    assert q.take(pull).request_id == "r3"
    with pytest.raises(ValueError, match="head"):
        q.take(pull)  # taken already: no longer a head
    assert len(q) == 1 and "r1" in q and q.discard("r1") and not q.discard("r1")
    assert q.next_pull([2, 3], at5) is None


def test_a_dead_decode_instance_releases_its_pins_in_order():
    q = ParkedQueue()
    q.park("a", 3.0, 0, None, pin=7)
    q.park("b", 1.0, 0, None, pin=7)
    q.park("c", 2.0, 1, None)
    q.unpin(7)
    order = []
    while (pull := q.next_pull([8], lambda j, p: 0.0)) is not None:
        order.append(q.take(pull).request_id)
    assert order == ["b", "c", "a"]


def test_parking_twice_and_bad_router_answers_are_errors():
    q = ParkedQueue()
    q.park("a", 0.0, 0, None)
    with pytest.raises(ValueError, match="parked already"):
        q.park("a", 1.0, 0, None)
    for bad in (True, -1, 3, 1.5, None):
        with pytest.raises(ValueError, match="need an instance index"):
            checked_choice("least_outstanding", bad, 3, "r")
    assert checked_choice("x", 2, 3, "r") == 2


def _expected(live: dict, decode: list[int], accept) -> tuple | None:
    """The rule from scratch over the live parked requests {id: Parked}."""
    order = lambda p: (p.ready, p.instance, p.seq)
    pulls = []
    unpinned = sorted((p for p in live.values() if p.pin is None), key=order)
    if unpinned:
        head = unpinned[0]
        times = {j: accept(j, head) for j in decode}
        times = {j: t for j, t in times.items() if t is not None}
        if times:
            t = min(times.values())
            pulls.append(
                (t, order(head), head.request_id, tuple(j for j in decode if times.get(j) == t))
            )
    for j in decode:
        mine = sorted((p for p in live.values() if p.pin == j), key=order)
        if mine and (t := accept(j, mine[0])) is not None:
            pulls.append((t, order(mine[0]), mine[0].request_id, (j,)))
    return min(pulls, default=None)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("park"), st.integers(0, 2), st.integers(0, 6), st.sampled_from([None, 3, 4, 5])
        ),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("die"), st.sampled_from([3, 4, 5])),
        st.tuples(st.just("pull"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_every_pull_follows_the_rule(operations):
    q = ParkedQueue()
    decode = [3, 4, 5]
    live: dict = {}
    n = 0
    for op in operations:
        if op[0] == "park":
            _, instance, ready, pin = op
            pin = pin if pin in decode else None
            p = q.park(f"r{n}", float(ready), instance, None, pin)
            live[p.request_id] = p
            n += 1
        elif op[0] == "abort":
            rid = f"r{op[1]}"
            assert q.discard(rid) == (rid in live)
            live.pop(rid, None)
        elif op[0] == "die" and op[1] in decode:
            decode.remove(op[1])
            q.unpin(op[1])
            for rid, p in list(live.items()):
                if p.pin == op[1]:
                    live[rid] = q.get(rid)
                    assert live[rid].pin is None and live[rid].seq == p.seq
        elif op[0] == "pull":
            seed = op[1]

            # accept times: a fixed pseudo-random table of (decode, request) -> time or None
            def accept(j, p, seed=seed):
                h = zlib.crc32(f"{seed} {j} {p.request_id}".encode()) % 7
                return None if h == 0 else max(p.ready, float(h))

            want = _expected(live, decode, accept)
            got = q.next_pull(decode, accept)
            if want is None:
                assert got is None
                continue
            assert (got.time, got.parked.request_id, got.candidates) == (want[0], want[2], want[3])
            assert q.take(got) is live.pop(want[2])
        assert len(q) == len(live) and all(rid in q for rid in live)
