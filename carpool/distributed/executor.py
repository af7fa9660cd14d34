"""The multi-process executor (carpool/executor.py has the interface): T x P worker processes
over torch.distributed, with the driver's shard in this process.

The driver (this process, rank 0) keeps the scheduler, block manager and sampler. On submit it
flattens the batch into one plan (token ids, positions, KV slots, block tables, rows to sample)
and sends that same plan to every worker, so no rank recomputes any scheduling decision. It also
holds the last pipeline stage (TP rank 0) itself: `collect` runs that stage for the oldest
micro-batch, gathers the vocabulary-parallel logits and returns them for sampling.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass

import torch

from carpool.config import EngineConfig
from carpool.executor import ExecutorError
from carpool.core.scheduler import ScheduledBatch
from carpool.distributed.comm import Comm, Rendezvous, loopback_store
from carpool.distributed.layout import ParallelLayout
from carpool.distributed.messages import (InitKVCache, LoadModel, RunPlan, SendTimings, Shutdown, Timings,
                                          WorkerReady)
from carpool.distributed.worker import Worker, local_device, threads_per_process, worker_main
from carpool.model.loader import is_gguf, open_gguf
from carpool.model_runner import ModelRunner, StepPlan, kv_bytes_per_token

log = logging.getLogger("carpool")


@dataclass
class MicroBatchRecord:
    """What the driver submitted: for per-request bubble accounting."""

    micro_batch: int
    submit_time: float
    pipeline_was_empty: bool  # nothing in flight when it was submitted (the pipeline had drained)
    request_ids: list[str]
    num_tokens: int


class WorkerGroup:
    """The worker processes and process groups of a MultiprocExecutor, kept apart from it so a
    finalizer can stop them when an engine is dropped without `shutdown()` (nothing here refers
    back to the executor). Also the watchdog: a worker that exits while the engine runs is
    recorded as the failure, and all the others are stopped, which breaks every transfer the
    driver might be waiting on, so nothing hangs."""

    def __init__(self, layout: ParallelLayout):
        self.layout = layout
        self.processes: dict[int, mp.process.BaseProcess] = {}
        self.store = None  # the loopback rendezvous store of spawned workers (None under torchrun)
        self.comm: Comm | None = None
        self.failure: str | None = None
        self.closed = False
        self._wake_fds: tuple[int, int] | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def workers(self) -> list[int]:
        return list(range(1, self.layout.world_size))

    def start_watchdog(self) -> None:
        self._wake_fds = os.pipe()
        self._watchdog = threading.Thread(target=self._watch, name="carpool-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: rank for rank, p in self.processes.items()}
        ready = mp.connection.wait([*by_sentinel, self._wake_fds[0]])
        dead = [by_sentinel[s] for s in ready if s in by_sentinel]
        if self.closed or not dead:
            return
        self.failure = self.death_message(dead[0])
        log.error("%s; stopping the other workers", self.failure)
        _terminate(list(self.processes.values()))

    def death_message(self, rank: int) -> str:
        p = self.processes[rank]
        p.join(1)
        code = p.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        return f"worker {self.layout.describe(rank)}, pid {p.pid}, {how}"

    def explain(self, exc: BaseException, wait: float = 3.0) -> str:
        """Why a transfer failed: a dead worker if one shows up within `wait` s, else the error."""
        deadline = time.monotonic() + wait
        while self.failure is None and self.processes and time.monotonic() < deadline:
            dead = [r for r, p in self.processes.items() if p.exitcode is not None]
            if dead:
                self.failure = self.death_message(dead[0])
            else:
                time.sleep(0.02)
        return self.failure or f"{type(exc).__name__}: {exc}"

    def shutdown(self) -> None:
        """Stop the workers (a Shutdown message, then signals) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self._wake_fds is not None:
            os.write(self._wake_fds[1], b"x")
        if self.comm is not None and self.failure is None:
            try:
                self.comm.send_message(Shutdown(), self.workers)
                self.comm.wait_sent(5.0)
            except Exception:
                pass
        _terminate(list(self.processes.values()), grace=5.0)
        if self._watchdog is not None:
            self._watchdog.join(5.0)
            for fd in self._wake_fds:
                os.close(fd)
            self._wake_fds = None
        if self.comm is not None:
            try:
                self.comm.close()
            except Exception:
                log.debug("leaving the process group failed", exc_info=True)
        self.store = None  # closes its listening socket


class MultiprocExecutor:
    """Tensor x pipeline parallel over worker processes (see the module docstring)."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.config, self.dtype = config, dtype
        self.layout = layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.max_in_flight = layout.pipeline_parallel_size
        self.group = group = WorkerGroup(layout)
        self.workers = group.workers
        self.micro_batches: deque[MicroBatchRecord] = deque(maxlen=1_000_000)
        self.runner: ModelRunner | None = None
        self._queue: deque[tuple[int, StepPlan]] = deque()
        self._ids = itertools.count()
        # Stops the workers if the engine is dropped, or at exit, without shutdown().
        self._finalizer = weakref.finalize(self, group.shutdown)
        timeout = datetime.timedelta(seconds=config.distributed_timeout)
        try:
            if config.distributed_init_method == "env://":
                rendezvous, store, local_rank = self._join_torchrun()
            else:
                rendezvous, store, local_rank = self._spawn_workers(timeout)
            self.device = local_device(config, local_rank)
            torch.set_num_threads(threads_per_process(config, self.num_local_processes))
            self.comm = group.comm = Comm(layout, 0, self.device, rendezvous, timeout, store=store)
            self.comm.send_message(LoadModel(dtype), self.workers)
            self.gguf_reader = open_gguf(config.model) if is_gguf(config.model) else None
            self.worker = Worker(config, layout, 0, self.comm, self.device, dtype, self.gguf_reader)
            self._wait_for_workers_loaded()
        except BaseException as exc:
            failure = group.failure
            self.shutdown()
            if failure is not None and not isinstance(exc, ExecutorError):
                raise ExecutorError(failure) from exc
            raise
        self.model = self.worker.model
        self.model_config = cfg = self.model.config
        self.kv_layout = None  # the plain one: windowed tables are not sent to workers
        self.kv_bytes_per_token = max(kv_bytes_per_token(cfg, dtype, last - first, layout.tensor_parallel_size)
                                      for first, last in layout.layer_ranges(cfg.num_layers))
        log.info("%d workers: tensor parallel %d x pipeline parallel %d (stages of %s layers)",
                 layout.world_size, layout.tensor_parallel_size, layout.pipeline_parallel_size,
                 "/".join(str(b - a) for a, b in layout.layer_ranges(cfg.num_layers)))

    @property
    def processes(self) -> dict[int, mp.process.BaseProcess]:
        """The spawned worker processes by rank (empty under torchrun)."""
        return self.group.processes

    # ------------------------------------------------------------ start-up
    def _join_torchrun(self) -> tuple[Rendezvous, None, int]:
        rank, world = int(os.environ.get("RANK", "-1")), int(os.environ.get("WORLD_SIZE", "0"))
        if rank != 0:
            raise ValueError("with distributed_init_method='env://' the engine runs on rank 0; start "
                             "the other ranks with `python -m carpool.distributed.launch` (see README)")
        if world != self.layout.world_size:
            raise ValueError(f"WORLD_SIZE is {world} but tensor x pipeline parallel size is "
                             f"{self.layout.world_size}")
        self.num_local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return Rendezvous(), None, int(os.environ.get("LOCAL_RANK", 0))

    def _spawn_workers(self, timeout: datetime.timedelta):
        world = self.layout.world_size
        self.num_local_processes = world
        store = self.group.store = loopback_store(world, timeout)
        rendezvous = Rendezvous("127.0.0.1", store.port)
        ctx = mp.get_context("spawn")  # fork is unsafe once torch has started its thread pools
        for rank in self.workers:
            p = ctx.Process(target=worker_main, name=f"carpool-worker-{rank}", daemon=True,
                            args=(self.config, self.layout, rank, rendezvous, rank, world))
            p.start()
            self.group.processes[rank] = p
        self.group.start_watchdog()
        # Join the process group only once every worker is up, so a worker that dies while
        # starting fails the engine at once instead of leaving the rendezvous to time out.
        keys = [f"carpool/alive/{r}" for r in self.workers]
        deadline = time.monotonic() + timeout.total_seconds()
        while not store.check(keys):
            if self.group.failure is not None:
                raise ExecutorError(self.group.failure)
            if time.monotonic() > deadline:
                raise ExecutorError(f"workers did not start within {timeout.total_seconds():.0f} s")
            time.sleep(0.02)
        return rendezvous, store, 0

    def _wait_for_workers_loaded(self) -> None:
        errors = []
        for rank in self.workers:
            status = self.comm.recv_message(rank, (WorkerReady,)).error
            if status is not None:
                errors.append(f"{self.layout.describe(rank)}: {status}")
        if errors:
            raise RuntimeError("workers failed to load the model: " + "; ".join(errors))

    def _fatal(self, exc: BaseException) -> ExecutorError:
        """Shut everything down after a failed transfer; name the dead worker if there is one."""
        message = self.group.explain(exc)
        self.shutdown()
        return ExecutorError(message)

    # ------------------------------------------------------------ running micro-batches
    def init_kv_cache(self, num_blocks: int) -> None:
        try:
            self.comm.send_message(InitKVCache(num_blocks), self.workers)
            self.worker.init_kv_cache(num_blocks)
        except Exception as exc:
            raise self._fatal(exc) from exc
        self.runner = self.worker.runner

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    def submit(self, batch: ScheduledBatch) -> None:
        if self.group.failure is not None or self.group.closed:
            raise self._fatal(RuntimeError("the executor has shut down"))
        plan = self.runner.plan(batch)
        mb = next(self._ids)
        self.micro_batches.append(MicroBatchRecord(mb, time.monotonic(), not self._queue,
                                                   [r.request_id for r in batch.requests], plan.num_tokens))
        try:
            self.comm.send_message(RunPlan(mb, plan), self.workers)
        except Exception as exc:
            raise self._fatal(exc) from exc
        self._queue.append((mb, plan))

    def collect(self) -> torch.Tensor:
        mb, plan = self._queue.popleft()
        try:
            return self.worker.run(mb, plan)
        except Exception as exc:  # the other ranks cannot be trusted to be in step any more
            raise self._fatal(exc) from exc

    def stage_timings(self, reset: bool = False) -> dict:
        """Every rank's compute interval per micro-batch and the driver's submissions; call with
        nothing in flight. `reset` starts a fresh record (e.g. after a warm-up)."""
        if self._queue:
            raise RuntimeError("stage_timings needs an idle pipeline (micro-batches are in flight)")
        try:
            self.comm.send_message(SendTimings(reset), self.workers)
            per_rank = {0: [(t.micro_batch, t.start, t.end) for t in self.worker.timings]}
            for rank in self.workers:
                per_rank[rank] = self.comm.recv_message(rank, (Timings,)).records
        except Exception as exc:
            raise self._fatal(exc) from exc
        result = {
            "tensor_parallel_size": self.layout.tensor_parallel_size,
            "pipeline_parallel_size": self.layout.pipeline_parallel_size,
            "ranks": [{"rank": r, "stage": self.layout.stage(r), "tp_rank": self.layout.tp_rank(r),
                       "timings": per_rank[r]} for r in sorted(per_rank)],
            "micro_batches": [asdict(m) for m in self.micro_batches],
        }
        if reset:
            self.worker.timings.clear()
            self.micro_batches.clear()
        return result

    def shutdown(self) -> None:
        """Stop the workers (politely, then by signal) and leave the process group. Idempotent."""
        self._queue.clear()
        self._finalizer()


def _terminate(processes: list, grace: float = 0.0) -> None:
    """Give processes `grace` seconds to exit, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
