"""One rank's torch.distributed plumbing: process groups, control messages and activations.

Three kinds of traffic, each on its own process group so they never queue behind each other:

* control (gloo, all ranks, CPU tensors): the driver's batch plans and commands out, worker
  replies back. Each message is encoded once as a typed frame (`messages.py`: a JSON header
  and raw numeric arrays, never pickle) and sent as a uint8 tensor after a length header.
  Its timeout is effectively infinite: an idle server's workers wait for the next plan.
* activations (the default group: gloo on CPU, NCCL on CUDA): hidden states from a stage to the
  same tensor rank of the next stage, point to point.
* tensor parallel (one group per stage): the all-reduces inside the model and the logits gather.

Spawned workers (one host) meet at a TCPStore that listens on 127.0.0.1 only, and their gloo
groups are pinned to the loopback interface: nothing of a single-host run is reachable from
the network. Under torchrun (env://) the launcher's store and interfaces are used as given.

Sends are non-blocking (isend): a stage hands its output on and starts the next micro-batch.
A gloo send only reports completion once waited on, so each destination keeps its last
`max_pending` sends (and their tensors) and waits on older ones, which are long delivered:
receivers take messages in order and are never more than a few micro-batches behind.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from carpool.distributed.layout import ParallelLayout
from carpool.distributed.messages import MAX_FRAME_BYTES, MESSAGES, ProtocolError, decode, encode

FOREVER = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: the driver's loopback TCPStore (spawned workers on this host), or,
    when `host` is None, env:// (MASTER_ADDR, MASTER_PORT, set by torchrun)."""

    host: str | None = None
    port: int | None = None


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def loopback_store(world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store of a single-host run, on 127.0.0.1 only. TCPStore's own server listens
    on every interface whatever host name it is given, so it gets a socket bound here instead."""
    sock = socket.create_server(("127.0.0.1", 0))
    try:
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], world_size, is_master=True,
                              wait_for_workers=False, timeout=timeout, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns (and closes) the listening socket now
    return store


def loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), next((n for n in names if n.startswith("lo")), None))


@contextlib.contextmanager
def gloo_on_loopback():
    """gloo listens on the address this host's name resolves to (often a network one) unless
    GLOO_SOCKET_IFNAME names an interface: name the loopback one while groups are created."""
    iface, old = loopback_interface(), os.environ.get("GLOO_SOCKET_IFNAME")
    if iface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


class Comm:
    def __init__(self, layout: ParallelLayout, rank: int, device: torch.device, rendezvous: Rendezvous,
                 timeout: datetime.timedelta, store: dist.Store | None = None):
        self.layout, self.rank, self.device = layout, rank, device
        with contextlib.nullcontext() if rendezvous.host is None else gloo_on_loopback():
            self._init_groups(rendezvous, timeout, store)
        self._pending: dict[int, deque[tuple[Any, tuple[torch.Tensor, ...]]]] = defaultdict(deque)
        self.max_pending = 4 * (layout.pipeline_parallel_size + 2)

    def _init_groups(self, rendezvous: Rendezvous, timeout: datetime.timedelta, store: dist.Store | None) -> None:
        layout, rank, world = self.layout, self.rank, self.layout.world_size
        backend = backend_for(self.device)
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

    # ------------------------------------------------------------ control messages (CPU, typed)
    def send_message(self, msg: Any, dsts: list[int]) -> None:
        """Encode once (`messages.encode`), send to every rank in `dsts` without waiting."""
        body = torch.frombuffer(bytearray(encode(msg)), dtype=torch.uint8)
        header = torch.tensor([body.numel()], dtype=torch.int64)
        for dst in dsts:
            self._track(dst, dist.isend(header, dst, group=self.control), header)
            self._track(dst, dist.isend(body, dst, group=self.control), body)

    def recv_message(self, src: int, expect: tuple[type, ...] = MESSAGES) -> Any:
        """The next message from `src`, which must be one of `expect` (else ProtocolError)."""
        header = torch.empty(1, dtype=torch.int64)
        dist.recv(header, src, group=self.control)
        size = int(header.item())
        if not 0 < size <= MAX_FRAME_BYTES:
            raise ProtocolError(f"control frame of {size} bytes from rank {src}")
        body = torch.empty(size, dtype=torch.uint8)
        dist.recv(body, src, group=self.control)
        return decode(body.numpy(), expect)

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
