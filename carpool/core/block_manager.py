"""Fixed-size KV-cache blocks handed to requests as their computed tokens grow, and, with prefix
caching, kept once their requests are done so that later requests with the same prefix skip it.

Prefix caching (content-addressed full blocks, as in vLLM v1). A block whose `block_size` tokens
are all computed is registered under a key that names its tokens *and everything in front of
them*: key_k = sha256(key_{k-1} || tokens of block k). The KV of a token depends on nothing else
(no adapters, no multimodal inputs here), so two requests whose first k blocks have the same keys
have the same KV there, and the later one takes those blocks instead of computing them.

Collisions: a wrong hit needs two different token prefixes with the same 256-bit SHA-256 chain.
By the birthday bound, a cache that registers n blocks over its whole life sees one with
probability below n^2 / 2^257 (1e-59 for n = 2^40, a trillion blocks), and no way is known to
construct one on purpose, so a client cannot aim a prompt at someone else's cached prefix (a
non-cryptographic hash such as Python's `hash` would allow exactly that).

Block states: *held* by one or more requests (reference-counted; cached full blocks are shared),
*free and cached* (nobody holds it; it keeps its KV and its key, least recently used first), or
*free* (no content worth keeping). New blocks come from the free list first (the block given back
last is taken first), then by evicting the least recently used cached block, so eviction always
happens before the scheduler has to preempt anything: `num_free_blocks` counts both kinds of
unheld blocks.

Sliding windows (`window`: Gemma 2 and 3, whose sliding-window layers sit beside full-attention
ones). A block then holds `block_size` tokens of KV for as many layers as the model has
full-attention layers, and the sliding layers, in `window_tables` groups of that many, take one
more block each for every block of a request's table while their window reaches it (the
request's `window_block_ids`, one table per group). Once the request's next query is `window`
tokens past a block, those window blocks go back, so a long context holds the full-attention
layers' KV and only a window of the rest (vLLM's hybrid KV cache manager, llama.cpp's SWA cache).
Window blocks of a cached block stay cached (evicted before any table block), so a later request
with the same prefix resumes where the window before it is all still there.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from carpool.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


ROOT_KEY = bytes(32)  # the "key" of the empty prefix


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a full block: its tokens chained onto the key of the blocks before it."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Block ids and who holds them. A request's `block_ids` is its block table: token at
    position p lives in slot `block_ids[p // block_size] * block_size + p % block_size` of every
    layer. With `enable_prefix_caching`, full blocks are also cached by content (module doc)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: int | None = None, window_tables: int = 0, max_step_tokens: int = 0):
        """window, window_tables: the sliding layers' window and their groups (module doc);
        max_step_tokens: the most tokens one step gives a request (the windows it must hold)."""
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window if window_tables else None
        self.window_tables = window_tables if window else 0
        self.pad_block = num_blocks  # the runner's zeroed block: where a given-back window block was
        # The window blocks of a lone request's longest step: never available to its table.
        self.window_reserve = self.window_tables * (
            blocks_for(window - 1 + max_step_tokens, block_size) + 1) if self.window else 0
        self._window_of: dict[int, list[int]] = {}  # table block -> its window blocks
        self._window_users: dict[int, set[str]] = {}  # table block -> requests whose window reaches it
        self._evictable_windows: OrderedDict[int, None] = OrderedDict()  # cached, unused; LRU first
        self._window_start: dict[str, int] = {}  # request -> table blocks its window has left
        # Unheld, nothing cached; taken from the right: the block given back last goes out first.
        # Its pages are mapped and may still sit in a cache. Taken oldest first, the list walked
        # the whole KV cache, and the first write to each block's pages faulted (the runner
        # allocates it unwritten): 17 ms of a 512-token step of the embedded model, 10% of it.
        self._free: deque[int] = deque(reversed(range(num_blocks)))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld but cached, LRU first
        self._holders: dict[int, set[str]] = {}  # held block -> ids of the requests holding it
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (free, or cached and evictable)."""
        return len(self._free) + len(self._evictable) + self.window_tables * len(self._evictable_windows)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def capacity_tokens(self) -> int:
        """The longest context one request can hold."""
        return (self.num_blocks - self.window_reserve) * self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks `request` needs so that its first `num_tokens` tokens have slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(request.block_ids)) * (1 + self.window_tables)

    def first_in_window(self, position: int) -> int:
        """The first table block a query at `position`, or after, still reads in a window."""
        return max(0, position + 1 - self.window) // self.block_size if self.window else 0

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.blocks_needed(request, num_tokens) <= self.num_free_blocks

    # ------------------------------------------------------------ prefix cache
    def block_keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first `num_blocks` full blocks, computed once per request."""
        keys, bs = request.block_hashes, self.block_size
        for k in range(len(keys), num_blocks):
            keys.append(block_key(keys[-1] if keys else ROOT_KEY, request.token_ids[k * bs:(k + 1) * bs]))
        return keys

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest prefix of a request that holds no blocks yet, within
        its `num_cacheable_tokens`: the last token is always computed (its logits are sampled), so
        a block holding it is never taken, even when it is cached."""
        if not self.enable_prefix_caching or request.block_ids or request.num_computed_tokens:
            return []
        bs, hits = self.block_size, []
        keys = request.block_hashes
        for k in range(request.num_cacheable_tokens // bs):
            key = keys[k] if k < len(keys) else self.block_keys(request, k + 1)[k]
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        if self.window:  # resume only where the window before is all there
            k = len(hits)
            while k and not all(b in self._window_of for b in hits[self.first_in_window(k * bs):k]):
                k -= 1
            del hits[k:]
        return hits

    def cache_blocks(self, request: Request, start: int, end: int) -> None:
        """The request's tokens [start, end) now have their KV: register the blocks this filled."""
        if not self.enable_prefix_caching:
            return
        first, last = start // self.block_size, end // self.block_size
        if first == last:
            return
        keys = self.block_keys(request, last)
        for k in range(first, last):
            block, key = request.block_ids[k], keys[k]
            # Already known: another request computed the same content first (this copy stays
            # private and is freed normally), or this block is itself a hit.
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (a benchmark run starts cold). Only while no request holds
        blocks; returns whether it did."""
        if self._holders:
            return False
        for block in self._evictable_windows:
            self._free.extend(self._window_of.pop(block))
        self._evictable_windows.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._key_of.clear()
        return True

    # ------------------------------------------------------------ allocation
    def allocate(self, request: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow the block table to cover `num_tokens` tokens, first with the `cached` blocks
        (from `cached_prefix`, for a request that holds none yet); all or nothing."""
        rid, m = request.request_id, self.window_tables
        first = 0
        if m:
            first = self.first_in_window(request.num_computed_tokens + len(cached) * self.block_size)
            self._slide(request, first)
        need = max(0, blocks_for(num_tokens, self.block_size) - len(request.block_ids) - len(cached))
        revived = sum(1 for b in cached if b in self._evictable)  # leave the free pool when taken
        revived += m * sum(1 for b in cached[first:] if b in self._evictable_windows)
        if need * (1 + m) + revived > self.num_free_blocks:
            return False
        for i, block in enumerate(cached):
            holders = self._holders.get(block)
            if holders is None:
                del self._evictable[block]
                self._holders[block] = {rid}
            else:
                holders.add(rid)
            request.block_ids.append(block)
            if m:  # (cached_prefix: every block from `first` on has its window blocks)
                if i >= first:
                    self._evictable_windows.pop(block, None)
                    self._window_users.setdefault(block, set()).add(rid)
                self._append_window(request, self._window_of[block] if i >= first else [self.pad_block] * m)
        if m and cached:
            self._window_start[rid] = first
        for _ in range(need):
            block = self._take_free()
            self._holders[block] = {rid}
            request.block_ids.append(block)
            if m:
                self._window_of[block] = [self._take_free() for _ in range(m)]
                self._window_users[block] = {rid}
                self._append_window(request, self._window_of[block])
        return True

    def _take_free(self) -> int:
        if self._free:
            return self._free.pop()
        if self._evictable_windows:  # a cached block's window blocks go before any table block
            block, _ = self._evictable_windows.popitem(last=False)
            taken, *rest = self._window_of.pop(block)
            self._free.extend(rest)
            self.num_evictions += 1
            return taken
        block, _ = self._evictable.popitem(last=False)  # least recently used
        del self._block_of[self._key_of.pop(block)]
        self.num_evictions += 1
        return block

    # ------------------------------------------------------------ sliding windows
    @staticmethod
    def _append_window(request: Request, blocks: Sequence[int]) -> None:
        if not request.window_block_ids:
            request.window_block_ids = [[] for _ in blocks]
        for table, block in zip(request.window_block_ids, blocks):
            table.append(block)

    def _slide(self, request: Request, first: int) -> None:
        """The request's queries now start in table block `first` or later: give back the window
        blocks of the blocks before it."""
        rid = request.request_id
        start, end = self._window_start.get(rid, 0), min(first, len(request.block_ids))
        if end <= start:
            return
        for i in range(start, end):
            self._leave_window(rid, request.block_ids[i])
            for table in request.window_block_ids:
                table[i] = self.pad_block
        self._window_start[rid] = end

    def _leave_window(self, rid: str, block: int) -> None:
        """`rid` no longer reads `block`'s window blocks: the last reader caches them (if the block
        is cached) or frees them."""
        users = self._window_users.get(block)
        if users is None or rid not in users:
            return
        users.discard(rid)
        if users:
            return
        del self._window_users[block]
        if block in self._key_of:
            self._evictable_windows[block] = None
        else:
            self._free.extend(self._window_of.pop(block))

    def free(self, request: Request) -> None:
        """Release the request's blocks. Cached ones stay cached (most recently used), the table's
        tail first in line for eviction: a prefix is worth more than what follows it."""
        rid = request.request_id
        if self.window_tables:
            for block in request.block_ids[self._window_start.pop(rid, 0):]:
                self._leave_window(rid, block)
            request.window_block_ids = []
        self._release(rid, request.block_ids)
        request.block_ids = []

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens: those a step allocated for
        speculative tokens that were then rejected."""
        keep = blocks_for(num_tokens, self.block_size)
        if len(request.block_ids) > keep:
            for block in request.block_ids[keep:]:
                self._leave_window(request.request_id, block)
            for table in request.window_block_ids:
                del table[keep:]
            self._release(request.request_id, request.block_ids[keep:])
            del request.block_ids[keep:]

    def _release(self, rid: str, blocks: list[int]) -> None:
        for block in blocks:
            if rid not in self._holders.get(block, ()):
                raise RuntimeError(f"block {block} freed by {rid}, which does not own it")
        plain = []
        for block in reversed(blocks):
            holders = self._holders[block]
            holders.discard(rid)
            if holders:
                continue
            del self._holders[block]
            if block in self._key_of:
                self._evictable[block] = None
            else:
                plain.append(block)
        self._free.extend(plain)  # the table's first block on the right: taken first

    def holders(self) -> dict[int, set[str]]:
        """Held block -> ids of the requests holding it (for checks and metrics)."""
        return {b: set(h) for b, h in self._holders.items()}

    def evictable(self) -> list[int]:
        """Cached blocks nobody holds, in eviction order."""
        return list(self._evictable)

    def cached(self) -> dict[int, bytes]:
        """Cached block -> key (held or not)."""
        return dict(self._key_of)

    def window_blocks(self) -> dict[int, list[int]]:
        """Table block -> its window blocks, where it still has them (held or cached)."""
        return {b: list(w) for b, w in self._window_of.items()}
