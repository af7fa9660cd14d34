"""Prefix caching in the block manager and scheduler, on a fake model whose 'KV' is checkable.

The fake KV cache stores, in each slot a step writes, the whole token prefix that the real KV of
that position depends on. Whenever a request is scheduled, every slot of its computed tokens
must hold exactly its own prefix there: a wrong cache hit, a block shared while being written,
or a block evicted from under its holder would all show up as a mismatch.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.core.block_manager import ROOT_KEY, BlockManager, block_key
from carpool.core.scheduler import SCHEDULERS, ScheduledBatch, make_scheduler
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from tests.helpers import examples


def fake_token(prefix: list[int]) -> int:
    """The fake model's next token: a function of the whole prefix, like a real greedy model."""
    return 1 + sum((i + 1) * t for i, t in enumerate(prefix[-5:])) % 3


class CacheHarness:
    """The engine loop over any policy, with up to `depth` micro-batches in flight (pipeline)."""

    def __init__(self, policy: str, num_blocks: int, block_size: int, budget: int, max_num_seqs: int = 8,
                 depth: int = 1, caching: bool = True, window: int | None = None, window_tables: int = 0):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, window=window,
                               window_tables=window_tables, max_step_tokens=budget)
        self.sched = make_scheduler(policy, self.bm, budget, max_num_seqs, max_model_len=self.bm.capacity_tokens)
        self.depth = depth
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix its KV belongs to
        self.in_flight: deque[ScheduledBatch] = deque()
        self.requests: list[Request] = []
        self.iterations = 0

    def add(self, request: Request) -> None:
        self.requests.append(request)
        self.sched.add_request(request)

    def slot(self, r: Request, p: int, table: int = 0) -> int:
        """Position p's slot in r's block table (0) or its window table `table` - 1."""
        bs = self.bm.block_size
        ids = r.block_ids if table == 0 else r.window_block_ids[table - 1]
        return ids[p // bs] * bs + p % bs

    def window_kv(self, r: Request, p: int, table: int) -> tuple:
        """What a window table's slot holds: the prefix, marked with its table."""
        return ("window", table, tuple(r.token_ids[:p + 1]))

    def abort(self, r: Request) -> None:
        self.sched.finish(r, RequestStatus.FINISHED_ABORTED)
        self.check_state()

    def step(self) -> None:
        sched = self.sched
        while len(self.in_flight) < self.depth:
            kept = self.held_cached()
            batch = sched.schedule()
            self.check_kept(kept)
            if not batch.requests:
                break
            for r, n in zip(batch.requests, batch.num_tokens):
                assert r.status is RequestStatus.RUNNING and n >= 1
                assert len(r.block_ids) * self.bm.block_size >= r.num_computed_tokens + n
                for p in range(r.num_computed_tokens):  # the KV it will attend to is its own
                    assert self.kv.get(self.slot(r, p)) == tuple(r.token_ids[:p + 1]), (r.request_id, p)
                self.check_windows(r, n)
                # It never writes into a cached block (those are full and read-only).
                cached = self.bm.cached()
                for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                    assert r.block_ids[p // self.bm.block_size] not in cached
            if self.depth > 1:
                sched.mark_in_flight(batch)
            self.in_flight.append(batch)
            self.check_state()
        if not self.in_flight:
            return
        batch = self.in_flight.popleft()
        for r, n in zip(batch.requests, batch.num_tokens):  # the batch ran: write its KV
            if r.status is RequestStatus.RUNNING:
                for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                    self.kv[self.slot(r, p)] = tuple(r.token_ids[:p + 1])
                    for t in range(1, self.bm.window_tables + 1):
                        self.kv[self.slot(r, p, t)] = self.window_kv(r, p, t)
        kept = self.held_cached()
        for r in sched.commit(batch):
            r.append_token(fake_token(r.token_ids), float(self.iterations))
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        self.check_kept(kept)
        self.iterations += 1
        self.check_state()

    # ------------------------------------------------------------ invariants
    def check_windows(self, r: Request, n: int) -> None:
        """A step of n tokens from r's next one: its window tables reach every key its queries'
        windows do, with r's own KV, and hold the pad block before (given back)."""
        bm, c = self.bm, r.num_computed_tokens
        if not bm.window_tables:
            assert r.window_block_ids == []
            return
        first = bm.first_in_window(c)
        assert [len(t) for t in r.window_block_ids] == [len(r.block_ids)] * bm.window_tables
        for t in range(1, bm.window_tables + 1):
            table = r.window_block_ids[t - 1]
            assert table[:first] == [bm.pad_block] * first
            assert bm.pad_block not in table[first:]
            for p in range(max(0, c + 1 - bm.window), c):
                assert self.kv.get(self.slot(r, p, t)) == self.window_kv(r, p, t), (r.request_id, p, t)

    def live(self) -> list[Request]:
        return list(self.sched.running) + list(self.sched.waiting)

    def held_cached(self) -> dict[tuple[str, int], bytes]:
        """(request, block) -> key of every cached block a running request holds."""
        cached = self.bm.cached()
        return {(r.request_id, b): cached[b] for r in self.sched.running for b in r.block_ids if b in cached}

    def check_kept(self, before: dict[tuple[str, int], bytes]) -> None:
        """A cached block still held by the same running request was not evicted meanwhile."""
        cached = self.bm.cached()
        running = {r.request_id: r for r in self.sched.running}
        for (rid, b), key in before.items():
            if rid in running and b in running[rid].block_ids:
                assert cached.get(b) == key, f"block {b} evicted while {rid} held it"

    def check_state(self) -> None:
        bm = self.bm
        live = self.live()
        holders = bm.holders()
        expected: dict[int, set[str]] = {}
        for r in live:
            assert len(r.block_ids) == len(set(r.block_ids))
            for b in r.block_ids:
                expected.setdefault(b, set()).add(r.request_id)
        # Reference counts are exactly the live tables (so never negative, never leaked).
        assert holders == expected
        for r in self.sched.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
        free, evictable, cached = list(bm._free), bm.evictable(), bm.cached()
        windows = bm.window_blocks()  # table block -> its window blocks, held or cached
        in_windows = [w for ws in windows.values() for w in ws]
        # Every block is in exactly one state: free, cached and unheld, held, or a window block.
        assert len(free) + len(evictable) + len(holders) + len(in_windows) == bm.num_blocks
        assert set(free) | set(evictable) | set(holders) | set(in_windows) == set(range(bm.num_blocks))
        assert not set(free) & set(holders) and not set(evictable) & set(holders)
        assert not set(free) & set(cached) and set(evictable) <= set(cached)
        # Window blocks: of a held block while a request's window reaches it, else of a cached one.
        readers = {b: {r.request_id for r in live if b in r.block_ids
                       and r.window_block_ids[0][r.block_ids.index(b)] != bm.pad_block} for b in windows}
        unread = [b for b, who in readers.items() if not who]
        assert set(unread) <= set(cached) and all(len(ws) == bm.window_tables for ws in windows.values())
        assert bm.num_free_blocks == len(free) + len(evictable) + bm.window_tables * len(unread)
        for r in live:
            for i, b in enumerate(r.block_ids):
                assert [t[i] for t in r.window_block_ids] in ([bm.pad_block] * bm.window_tables, windows.get(b))
        # The key of every cached block is the chain of the token prefix its KV holds.
        bs = bm.block_size
        for b, key in cached.items():
            prefix = self.kv[b * bs + bs - 1]
            assert len(prefix) % bs == 0
            for i in range(bs):
                assert self.kv[b * bs + i] == prefix[:len(prefix) - bs + i + 1]
            k = ROOT_KEY
            for j in range(0, len(prefix), bs):
                k = block_key(k, prefix[j:j + bs])
            assert k == key
        assert len(set(cached.values())) == len(cached)

    def check_done(self) -> None:
        assert not self.sched.has_unfinished_requests() and not self.in_flight
        assert self.bm.holders() == {}
        assert self.bm.num_free_blocks == self.bm.num_blocks
        cached_windows = {w for ws in self.bm.window_blocks().values() for w in ws}
        assert set(self.bm._free) | set(self.bm.evictable()) | cached_windows == set(range(self.bm.num_blocks))


def make_request(rid: str, prompt: list[int], out: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=out))


def run_until_done(h: CacheHarness, limit: int = 5000) -> None:
    while h.sched.has_unfinished_requests() or h.in_flight:
        h.step()
        assert h.iterations < limit, "did not finish"
    h.check_done()


# ------------------------------------------------------------------ property-based
@st.composite
def streams(draw):
    block_size = draw(st.integers(1, 6))
    num_blocks = draw(st.integers(4, 40))
    capacity = num_blocks * block_size
    policy = draw(st.sampled_from(sorted(SCHEDULERS)))
    budget = draw(st.integers(1, 48))
    depth = draw(st.sampled_from([1, 1, 2]))
    docs = [draw(st.lists(st.integers(1, 3), min_size=1, max_size=24)) for _ in range(3)]
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["doc", "doc", "followup", "random"]))
        doc = draw(st.integers(0, 2))
        cut = draw(st.integers(0, 24))
        suffix = draw(st.lists(st.integers(1, 3), min_size=0 if kind != "random" else 1, max_size=10))
        out = draw(st.integers(1, 8))
        arrival = draw(st.integers(0, 40))
        ops.append((kind, doc, cut, suffix, out, arrival))
    abort_prob = draw(st.sampled_from([0.0, 0.0, 0.1]))
    seed = draw(st.integers(0, 2**32 - 1))
    # sliding-window layers' tables, where steps stay within the budget (as the engine has them)
    window = draw(st.sampled_from([None, None, 1, 3, 8, 20])) if SCHEDULERS[policy].steps_within_budget else None
    window_tables = draw(st.integers(1, 2)) if window else 0
    if window:  # room for the windows of a step beside the table
        num_blocks += window_tables * (-(-(window - 1 + budget) // block_size) + 1)
    return (policy, block_size, num_blocks, capacity, budget, depth, docs, ops, abort_prob, seed,
            window, window_tables)


def build_prompt(op, docs, finished: list[Request]) -> list[int]:
    kind, doc, cut, suffix, _, _ = op
    if kind == "followup" and finished:  # the previous turn, its answer, a new message
        return finished[-1].token_ids + suffix
    if kind == "random":
        return suffix
    return docs[doc][:max(1, cut)] + suffix


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_random_streams_keep_cache_invariants(w):
    policy, block_size, num_blocks, capacity, budget, depth, docs, ops, abort_prob, seed, window, window_tables = w
    rng = random.Random(seed)
    h = CacheHarness(policy, num_blocks, block_size, budget, depth=depth, window=window, window_tables=window_tables)
    assert h.bm.capacity_tokens == capacity
    pending = sorted(enumerate(ops), key=lambda p: p[1][5])
    finished: list[Request] = []
    limit = 500 + 50 * sum(len(o[3]) + o[4] + 60 for o in ops)
    tick = 0
    while pending or h.sched.has_unfinished_requests() or h.in_flight:
        assert tick < limit, "did not finish: livelock?"
        while pending and pending[0][1][5] <= tick:
            i, op = pending.pop(0)
            prompt = build_prompt(op, docs, finished)
            out = min(op[4], capacity - 1)
            prompt = prompt[-(capacity - out):]  # prompt + output must fit the whole cache
            if prompt:
                h.add(make_request(f"r{i}", prompt, out))
        tick += 1
        if abort_prob and h.live() and rng.random() < abort_prob:
            h.abort(rng.choice(h.live()))
        if h.sched.has_unfinished_requests() or h.in_flight:
            h.step()
        finished = [r for r in h.requests if r.status is RequestStatus.FINISHED_LENGTH]
    h.check_done()
    for r in h.requests:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens
            # The fake model's outputs are a function of the prefix, so any KV mix-up would have
            # been caught above; the tokens are what the prompt determines.
            toks = list(r.prompt_token_ids)
            for _ in range(r.num_output_tokens):
                toks.append(fake_token(toks))
            assert r.token_ids == toks
    # Hit accounting: queries are the prompts at first admission, hits their cached tokens.
    admitted = [r for r in h.requests if r.first_scheduled_time is not None]
    assert h.sched.prefix_cache_queries == sum(r.num_prompt_tokens for r in admitted)
    assert h.sched.prefix_cache_hits == sum(r.num_cached_tokens for r in admitted)
    assert all(r.num_cached_tokens < r.num_prompt_tokens and r.num_cached_tokens % block_size == 0
               for r in admitted)


# ------------------------------------------------------------------ deterministic
def test_second_request_takes_the_shared_prefix():
    h = CacheHarness("sarathi", 32, 4, budget=64)
    doc = list(range(10, 30))  # 20 tokens = 5 blocks
    a = make_request("a", doc + [1, 2], 2)
    h.add(a)
    run_until_done(h)
    assert a.num_cached_tokens == 0
    assert h.bm.num_cached_blocks == 5  # 23 tokens computed (the last answer token never is)
    b = make_request("b", doc + [3], 2)
    h.add(b)
    h.step()
    assert b.num_cached_tokens == 20 and b.num_computed_tokens == 21
    run_until_done(h)
    assert h.sched.prefix_cache_queries == 22 + 21 and h.sched.prefix_cache_hits == 20


def test_last_token_is_always_computed():
    """A prompt of exactly k cached blocks takes k - 1 of them: its last block is recomputed."""
    h = CacheHarness("sarathi", 32, 4, budget=64)
    doc = list(range(10, 22))  # 3 blocks
    h.add(make_request("a", doc, 1))
    run_until_done(h)
    b = make_request("b", doc, 1)
    h.add(b)
    kept = h.sched.schedule()
    assert kept.num_tokens == [4] and b.num_cached_tokens == 8
    h.in_flight.append(kept)
    run_until_done(h)


def test_blocks_are_chained_not_matched_alone():
    """The same block of tokens after a different prefix is a different block."""
    h = CacheHarness("sarathi", 32, 4, budget=64)
    h.add(make_request("a", [1, 1, 1, 1, 5, 6, 7, 8, 9], 1))
    run_until_done(h)
    b = make_request("b", [2, 2, 2, 2, 5, 6, 7, 8, 9], 1)
    h.add(b)
    run_until_done(h)
    assert b.num_cached_tokens == 0


def test_multi_turn_hits_the_previous_answer():
    h = CacheHarness("sarathi", 64, 4, budget=64)
    a = make_request("a", list(range(10, 19)), 8)  # 9 + 8 tokens; 16 computed = 4 full blocks
    h.add(a)
    run_until_done(h)
    b = make_request("b", a.token_ids + [40, 41, 42], 4)
    h.add(b)
    run_until_done(h)
    assert b.num_cached_tokens == 16


def test_shared_blocks_are_reference_counted():
    h = CacheHarness("sarathi", 32, 4, budget=64)
    doc = list(range(10, 26))
    h.add(make_request("a", doc + [1], 1))
    run_until_done(h)
    b, c = make_request("b", doc + [2], 4), make_request("c", doc + [3], 4)
    h.add(b)
    h.add(c)
    h.step()
    shared = b.block_ids[:4]
    assert c.block_ids[:4] == shared
    assert all(h.bm.holders()[x] == {"b", "c"} for x in shared)
    h.abort(b)
    assert all(h.bm.holders()[x] == {"c"} for x in shared)
    run_until_done(h)
    assert set(shared) <= set(h.bm.evictable())


def test_eviction_is_lru_and_comes_before_preemption():
    h = CacheHarness("sarathi", 8, 4, budget=64)
    first, second = make_request("a", list(range(10, 19)), 1), make_request("b", list(range(50, 59)), 1)
    for r in (first, second):
        h.add(r)
        run_until_done(h)
    assert h.bm.num_cached_blocks == 4 and h.bm.num_free_blocks == 8
    # A request needing 6 blocks: 4 plain free ones, then the least recently used cached ones:
    # a's, tail first.
    c = make_request("c", list(range(100, 121)), 1)
    h.add(c)
    h.step()
    assert h.sched.num_preemptions == 0 and h.bm.num_evictions == 2
    d = make_request("d", list(range(50, 59)), 1)  # b's blocks survived
    h.add(d)
    run_until_done(h)
    assert d.num_cached_tokens == 8


def test_preempted_request_finds_its_own_blocks():
    # Budget 16, 6 blocks of 4: a and b each grow to 4 blocks; b is preempted, its cached blocks
    # survive (a needs only what was free), and b takes them back when it returns.
    h = CacheHarness("sarathi", 6, 4, budget=16)
    a, b = make_request("a", list(range(10, 18)), 8), make_request("b", list(range(30, 38)), 8)
    h.add(a)
    h.add(b)
    readmitted = []
    while h.sched.has_unfinished_requests():
        before = b.num_preemptions
        waiting = b.status is RequestStatus.WAITING and before > 0
        h.step()
        if waiting and b.status is RequestStatus.RUNNING:
            readmitted.append(b.num_computed_tokens)
    h.check_done()
    assert b.num_preemptions >= 1
    assert readmitted and readmitted[0] > 0  # it did not start over from nothing


def test_hits_are_not_counted_without_caching():
    h = CacheHarness("sarathi", 32, 4, budget=64, caching=False)
    for rid in "ab":
        h.add(make_request(rid, list(range(10, 30)), 2))
        run_until_done(h)
    assert h.sched.prefix_cache_queries == 0 and h.sched.prefix_cache_hits == 0
    assert h.bm.num_cached_blocks == 0 and all(r.num_cached_tokens == 0 for r in h.requests)


@pytest.mark.parametrize("policy", sorted(SCHEDULERS))
def test_every_policy_grants_only_the_uncached_rest(policy):
    h = CacheHarness(policy, 64, 4, budget=32)
    doc = list(range(10, 34))  # 24 tokens
    h.add(make_request("a", doc + [1], 3))
    run_until_done(h)
    b = make_request("b", doc + [2, 3], 3)
    h.add(b)
    batch = h.sched.schedule()
    assert batch.requests == [b] and batch.num_tokens == [2] and b.num_cached_tokens == 24
    if policy in ("orca", "request-level"):  # KV for the whole length reserved up front
        assert len(b.block_ids) * 4 >= b.num_prompt_tokens + 3
    h.in_flight.append(batch)
    run_until_done(h)


def test_colliding_content_is_not_shared_while_written():
    """Two requests with the same prompt admitted together both compute it (nothing is cached
    before a batch has run); the second copy stays private and goes back to the free list."""
    h = CacheHarness("sarathi", 32, 4, budget=64)
    a, b = make_request("a", list(range(10, 22)), 1), make_request("b", list(range(10, 22)), 1)
    h.add(a)
    h.add(b)
    h.step()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    run_until_done(h)
    assert h.bm.num_cached_blocks == 3


# ------------------------------------------------------------------ sliding windows
def test_window_blocks_go_back_as_the_request_moves_on():
    """A 6-token window over 4-token blocks: a request's window tables hold only the blocks its
    next queries reach, while its block table keeps the whole context."""
    h = CacheHarness("sarathi", 64, 4, budget=8, window=6, window_tables=2, caching=False)
    r = make_request("a", list(range(10, 40)), 20)
    h.add(r)
    held, table = [], []
    while h.sched.has_unfinished_requests():
        h.step()  # (the harness checks each step's window tables: all its queries' windows reach)
        if r.status is RequestStatus.RUNNING:
            live = [b for b in r.window_block_ids[0] if b != h.bm.pad_block]
            held.append(len(live))
            table.append(len(r.block_ids))
            # window blocks from the first one the step's first query reached: at most ceil((6 - 1 + 8) / 4) + 1
            assert len(live) <= 5
            assert h.bm.num_free_blocks == 64 - len(r.block_ids) - 2 * len(live)
    h.check_done()
    # 8-token chunks, then decodes: the table grows to 12 blocks, the windows hold 2-4
    assert max(table) == 12 and max(held) == 4 and held[-4:] == [3, 2, 2, 2]


def test_windows_a_request_left_are_evicted_first_and_hits_need_the_last_window():
    """Window blocks of cached blocks stay cached once no window reaches them, go before any block
    table's, least recently left first; a prefix hit takes the blocks whose window before is all
    still there."""
    bm = BlockManager(64, 4, enable_prefix_caching=True, window=6, window_tables=1, max_step_tokens=8)
    doc = list(range(100, 140))  # 10 blocks
    a = make_request("a", doc + [1], 1)
    assert bm.allocate(a, 40)
    a.num_computed_tokens = 40
    bm.cache_blocks(a, 0, 40)
    assert bm.allocate(a, 41)  # its queries now start at 40: blocks 0-7 left its window
    assert a.window_block_ids[0][:8] == [bm.pad_block] * 8 and a.block_ids[10] in bm.window_blocks()
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 64 and len(bm.window_blocks()) == 10  # 0-9 cached: their windows too
    follow = make_request("b", doc + [2], 1)
    assert len(bm.cached_prefix(follow)) == 10
    c = make_request("c", list(range(500, 604)), 1)  # 26 blocks and their windows: 52 of the 44 plain free
    assert bm.allocate(c, 104)
    assert bm.num_evictions == 8 and set(bm.window_blocks()) == {*c.block_ids, a_blocks[8], a_blocks[9]}
    assert bm.num_cached_blocks == 10  # no block table's block was evicted
    assert len(bm.cached_prefix(follow)) == 10  # blocks 8 and 9 still have the window a 40-token prefix needs
    assert bm.allocate(c, 108)  # two more: the windows of blocks 8 and 9
    assert bm.num_evictions == 10 and bm.num_cached_blocks == 10
    assert bm.cached_prefix(follow) == []  # every block is cached, but no window before any of them is
