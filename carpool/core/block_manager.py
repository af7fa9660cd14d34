"""Fixed-size KV-cache blocks handed to requests as their computed tokens grow."""

from __future__ import annotations

from collections import deque

from carpool.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """A free list of block ids. A request's `block_ids` is its block table: token at position p
    lives in slot `block_ids[p // block_size] * block_size + p % block_size` of every layer."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks `request` needs so that its first `num_tokens` tokens have slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.blocks_needed(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the block table to cover `num_tokens` tokens; all or nothing."""
        need = self.blocks_needed(request, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block = self._free.popleft()
            self._owner[block] = request.request_id
            request.block_ids.append(block)
        return True

    def free(self, request: Request) -> None:
        for block in request.block_ids:
            if self._owner.pop(block, None) != request.request_id:
                raise RuntimeError(f"block {block} freed by {request.request_id}, which does not own it")
            self._free.append(block)
        request.block_ids = []

    def owners(self) -> dict[int, str]:
        """Block -> request id of every allocated block (for checks and metrics)."""
        return dict(self._owner)
