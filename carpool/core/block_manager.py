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
*free* (no content worth keeping). New blocks come from the free list first, then by evicting the
least recently used cached block, so eviction always happens before the scheduler has to preempt
anything: `num_free_blocks` counts both kinds of unheld blocks.
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

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # unheld, nothing cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld but cached, LRU first
        self._holders: dict[int, set[str]] = {}  # held block -> ids of the requests holding it
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (free, or cached and evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks `request` needs so that its first `num_tokens` tokens have slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(request.block_ids))

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
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._key_of.clear()
        return True

    # ------------------------------------------------------------ allocation
    def allocate(self, request: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow the block table to cover `num_tokens` tokens, first with the `cached` blocks
        (from `cached_prefix`, for a request that holds none yet); all or nothing."""
        need = max(0, blocks_for(num_tokens, self.block_size) - len(request.block_ids) - len(cached))
        revived = sum(1 for b in cached if b in self._evictable)  # leave the free pool when taken
        if need + revived > self.num_free_blocks:
            return False
        rid = request.request_id
        for block in cached:
            holders = self._holders.get(block)
            if holders is None:
                del self._evictable[block]
                self._holders[block] = {rid}
            else:
                holders.add(rid)
            request.block_ids.append(block)
        for _ in range(need):
            block = self._take_free()
            self._holders[block] = {rid}
            request.block_ids.append(block)
        return True

    def _take_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)  # least recently used
        del self._block_of[self._key_of.pop(block)]
        self.num_evictions += 1
        return block

    def free(self, request: Request) -> None:
        """Release the request's blocks. Cached ones stay cached (most recently used), the table's
        tail first in line for eviction: a prefix is worth more than what follows it."""
        self._release(request.request_id, request.block_ids)
        request.block_ids = []

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens: those a step allocated for
        speculative tokens that were then rejected."""
        keep = blocks_for(num_tokens, self.block_size)
        if len(request.block_ids) > keep:
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
        self._free.extend(reversed(plain))

    def holders(self) -> dict[int, set[str]]:
        """Held block -> ids of the requests holding it (for checks and metrics)."""
        return {b: set(h) for b, h in self._holders.items()}

    def evictable(self) -> list[int]:
        """Cached blocks nobody holds, in eviction order."""
        return list(self._evictable)

    def cached(self) -> dict[int, bytes]:
        """Cached block -> key (held or not)."""
        return dict(self._key_of)
