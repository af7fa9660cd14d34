"""One rank's torch.distributed plumbing: process groups, control messages and activations.

Three kinds of traffic, each on its own process group so they never queue behind each other:

* control (gloo, all ranks, CPU tensors): the driver's batch plans and commands out, worker
  replies back. Objects are pickled once and sent as a uint8 tensor with a length header.
  Its timeout is effectively infinite: an idle server's workers wait for the next plan.
* activations (the default group: gloo on CPU, NCCL on CUDA): hidden states from a stage to the
  same tensor rank of the next stage, point to point.
* tensor parallel (one group per stage): the all-reduces inside the model and the logits gather.

Sends are non-blocking (isend): a stage hands its output on and starts the next micro-batch.
A gloo send only reports completion once waited on, so each destination keeps its last
`max_pending` sends (and their tensors) and waits on older ones, which are long delivered:
receivers take messages in order and are never more than a few micro-batches behind.
"""

from __future__ import annotations

import datetime
import pickle
import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from carpool.distributed.layout import ParallelLayout

FOREVER = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: the driver's TCPStore on this host (spawned workers), or, when
    `host` is None, env:// (MASTER_ADDR, MASTER_PORT, set by torchrun)."""

    host: str | None = None
    port: int | None = None


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Comm:
    def __init__(self, layout: ParallelLayout, rank: int, device: torch.device, rendezvous: Rendezvous,
                 timeout: datetime.timedelta, store: dist.Store | None = None):
        self.layout, self.rank, self.device = layout, rank, device
        world = layout.world_size
        backend = backend_for(device)
        if rendezvous.host is None:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        else:
            if store is None:
                store = dist.TCPStore(rendezvous.host, rendezvous.port, world, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.control = dist.new_group(list(range(world)), backend="gloo", timeout=FOREVER)
        self.tp_group = None
        if layout.tensor_parallel_size > 1:
            for stage in range(layout.pipeline_parallel_size):
                group = dist.new_group(layout.stage_ranks(stage), timeout=timeout)
                if stage == layout.stage(rank):
                    self.tp_group = group
        self._pending: dict[int, deque[tuple[Any, tuple[torch.Tensor, ...]]]] = defaultdict(deque)
        self.max_pending = 4 * (layout.pipeline_parallel_size + 2)

    # ------------------------------------------------------------ control messages (CPU, pickled)
    def send_object(self, obj: Any, dsts: list[int]) -> None:
        """Pickle once, send to every rank in `dsts` without waiting."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        header = torch.tensor([body.numel()], dtype=torch.int64)
        for dst in dsts:
            self._track(dst, dist.isend(header, dst, group=self.control), header)
            self._track(dst, dist.isend(body, dst, group=self.control), body)

    def recv_object(self, src: int) -> Any:
        header = torch.empty(1, dtype=torch.int64)
        dist.recv(header, src, group=self.control)
        body = torch.empty(int(header.item()), dtype=torch.uint8)
        dist.recv(body, src, group=self.control)
        return pickle.loads(body.numpy())

    # ------------------------------------------------------------ activations between stages
    def send_tensor(self, x: torch.Tensor, dst: int) -> None:
        x = x.contiguous()
        self._track(dst, dist.isend(x, dst), x)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, src)
        return x

    # ------------------------------------------------------------ housekeeping
    def _track(self, dst: int, work, *tensors: torch.Tensor) -> None:
        pending = self._pending[dst]
        pending.append((work, tensors))
        while len(pending) > self.max_pending:
            pending.popleft()[0].wait()

    def wait_sent(self, timeout: float) -> bool:
        """Wait for every pending send, for at most `timeout` s (a receiver may be gone or stuck)."""
        works = [w for pending in self._pending.values() for w, _ in pending]
        self._pending.clear()

        def wait_all() -> None:
            try:
                for w in works:
                    w.wait()
            except Exception:  # a receiver died: nothing more to deliver
                pass

        waiter = threading.Thread(target=wait_all, name="carpool-wait-sent", daemon=True)
        waiter.start()
        waiter.join(timeout)
        return not waiter.is_alive()

    def close(self) -> None:
        self._pending.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
