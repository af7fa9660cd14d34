"""BlockManager: a free list of KV-cache blocks handed out to requests, all or nothing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from carpool.core.block_manager import BlockManager, blocks_for
from carpool.request import Request
from carpool.sampling_params import SamplingParams
from tests.helpers import examples


def make_request(rid: str, prompt_len: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4))


def check_consistent(bm: BlockManager, live: list[Request]) -> None:
    owners = bm.holders()
    owned = [b for r in live for b in r.block_ids]
    # No block in two tables, nor twice in one.
    assert len(owned) == len(set(owned))
    # The manager's view and the requests' views agree exactly.
    assert owners == {b: {r.request_id} for r in live for b in r.block_ids}
    free = list(bm._free)
    assert len(free) == len(set(free))
    assert not set(free) & set(owners)
    assert bm.num_free_blocks + len(owners) == bm.num_blocks
    assert set(free) | set(owners) == set(range(bm.num_blocks))


@pytest.mark.parametrize("n,bs,expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 1, 16), (17, 16, 2)])
def test_blocks_for(n, bs, expected):
    assert blocks_for(n, bs) == expected


def test_rejects_empty_cache():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_allocate_free_round_trip():
    bm = BlockManager(8, 4)
    assert bm.capacity_tokens == 32
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    r = make_request("a")
    assert bm.allocate(r, 9)  # 3 blocks
    assert len(r.block_ids) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert bm.holders() == {b: {"a"} for b in r.block_ids}
    # Growing within the last block needs nothing more.
    assert bm.blocks_needed(r, 12) == 0
    assert bm.allocate(r, 12)
    assert len(r.block_ids) == 3
    # Growing past it appends, keeping the existing table as a prefix.
    before = list(r.block_ids)
    assert bm.allocate(r, 13)
    assert r.block_ids[:3] == before and len(r.block_ids) == 4
    # Shrinking requests never release or add blocks.
    assert bm.blocks_needed(r, 1) == 0
    assert bm.allocate(r, 1) and len(r.block_ids) == 4
    bm.free(r)
    assert r.block_ids == []
    assert bm.num_free_blocks == 8 and bm.holders() == {}
    # Freeing an empty table is a no-op.
    bm.free(r)
    assert bm.num_free_blocks == 8


def test_freed_blocks_are_taken_again_first_in_table_order():
    """The next request gets the blocks the last one gave back (their KV pages are mapped, maybe
    cached), in the order it held them; never-used blocks only once those run out."""
    bm = BlockManager(64, 4)
    a, b = make_request("a"), make_request("b")
    assert bm.allocate(a, 12) and a.block_ids == [0, 1, 2]
    assert bm.allocate(b, 8) and b.block_ids == [3, 4]
    bm.free(a)
    c = make_request("c")
    assert bm.allocate(c, 16)
    assert c.block_ids == [0, 1, 2, 5]
    bm.free(b)
    bm.free(c)
    d = make_request("d")
    assert bm.allocate(d, 24) and d.block_ids == [0, 1, 2, 5, 3, 4]


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, 2)
    a, b = make_request("a"), make_request("b")
    assert bm.allocate(a, 5)  # 3 blocks
    assert not bm.can_allocate(b, 3)  # needs 2, 1 free
    assert not bm.allocate(b, 3)
    assert b.block_ids == [] and bm.num_free_blocks == 1
    assert bm.can_allocate(b, 2)
    assert bm.allocate(b, 2)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(a, 7)  # needs one more, none free
    assert len(a.block_ids) == 3
    check_consistent(bm, [a, b])


def test_exact_capacity_fits():
    bm = BlockManager(3, 5)
    r = make_request("a")
    assert bm.allocate(r, 15)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(r, 16)
    assert len(r.block_ids) == 3


def test_free_of_block_not_owned_raises():
    bm = BlockManager(4, 4)
    a, b = make_request("a"), make_request("b")
    assert bm.allocate(a, 4)
    b.block_ids = list(a.block_ids)  # b claims a's block
    with pytest.raises(RuntimeError, match="does not own"):
        bm.free(b)
    # A block that was never handed out at all.
    c = make_request("c")
    c.block_ids = [3]
    with pytest.raises(RuntimeError, match="does not own"):
        bm.free(c)


def test_double_free_via_stale_table_raises():
    bm = BlockManager(2, 4)
    a = make_request("a")
    assert bm.allocate(a, 8)
    stale = list(a.block_ids)
    bm.free(a)
    a.block_ids = stale
    with pytest.raises(RuntimeError):
        bm.free(a)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/grow/free sequences keep the free list and the owners consistent."""

    live = Bundle("live")

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.requests: list[Request] = []
        self.counter = 0

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 8))
    def init(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)

    @rule(target=live, num_tokens=st.integers(0, 60))
    def add(self, num_tokens):
        r = make_request(f"r{self.counter}")
        self.counter += 1
        self.requests.append(r)
        self._grow(r, num_tokens)
        return r

    def _grow(self, r: Request, num_tokens: int) -> None:
        bm = self.bm
        had = list(r.block_ids)
        free_before = bm.num_free_blocks
        need = max(0, blocks_for(num_tokens, bm.block_size) - len(had))
        assert bm.blocks_needed(r, num_tokens) == need
        assert bm.can_allocate(r, num_tokens) == (need <= free_before)
        ok = bm.allocate(r, num_tokens)
        assert ok == (need <= free_before)
        if ok:
            assert r.block_ids[: len(had)] == had
            assert len(r.block_ids) == len(had) + need
            assert len(r.block_ids) * bm.block_size >= num_tokens
            assert bm.num_free_blocks == free_before - need
        else:
            assert r.block_ids == had
            assert bm.num_free_blocks == free_before

    @rule(r=live, extra=st.integers(0, 20))
    def grow(self, r, extra):
        self._grow(r, len(r.block_ids) * self.bm.block_size + extra)

    @rule(r=consumes(live))
    def finish(self, r):
        n = len(r.block_ids)
        free_before = self.bm.num_free_blocks
        self.bm.free(r)
        assert r.block_ids == []
        assert self.bm.num_free_blocks == free_before + n
        self.requests.remove(r)

    @invariant()
    def consistent(self):
        if self.bm is not None:
            check_consistent(self.bm, self.requests)

    def teardown(self):
        if self.bm is not None:
            for r in list(self.requests):
                self.bm.free(r)
            self.requests.clear()
            assert self.bm.num_free_blocks == self.bm.num_blocks
            assert self.bm.holders() == {}
            assert sorted(self.bm._free) == list(range(self.bm.num_blocks))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=examples(80), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBlockManagerMachine = BlockManagerMachine.TestCase
