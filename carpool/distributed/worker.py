"""A worker: one rank's slice of the model (a pipeline stage x a tensor-parallel shard), its slice
of the KV cache, and the loop that runs the driver's batch plans on it.

The driver (rank 0) holds a `Worker` too and calls `run` itself; every other rank runs
`worker_main`, which serves plans until told to stop. Each `run` receives the previous stage's
activations (unless it is the first stage), computes, and passes its output on (unless it is the
last stage, whose TP ranks gather the logits on the driver). Every micro-batch's compute interval
is recorded, for the pipeline-bubble accounting in `carpool bench pipeline`.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch

from carpool.config import EngineConfig, keep_freed_memory_in_process
from carpool.distributed.comm import Comm, Rendezvous
from carpool.distributed.layout import ParallelLayout
from carpool.distributed.messages import (InitKVCache, LoadModel, RunPlan, SendTimings, Shutdown, Timings,
                                          WorkerReady)
from carpool.model.llama import TensorParallel
from carpool.model.loader import is_gguf, load_model, load_model_config, open_gguf
from carpool.model_runner import ModelRunner, StepPlan

log = logging.getLogger("carpool.worker")

DRIVER = 0


SERVED = (InitKVCache, RunPlan, SendTimings, Shutdown)  # what `serve` acts on (LoadModel comes first, alone)


@dataclass
class StageTiming:
    """When a rank computed one micro-batch (time.monotonic: one clock for all ranks of a host)."""

    micro_batch: int
    start: float
    end: float


class Worker:
    def __init__(self, config: EngineConfig, layout: ParallelLayout, rank: int, comm: Comm,
                 device: torch.device, dtype: torch.dtype, gguf_reader=None):
        self.config, self.layout, self.rank, self.comm = config, layout, rank, comm
        self.device, self.dtype = device, dtype
        self.stage, self.tp_rank = layout.stage(rank), layout.tp_rank(rank)
        model_config = load_model_config(config.model, gguf_reader)
        first, last = layout.layer_ranges(model_config.num_layers)[self.stage]
        tp = TensorParallel(self.tp_rank, layout.tensor_parallel_size, comm.tp_group)
        self.model = load_model(config.model, dtype, device, first, last, tp, gguf_reader,
                                config.quantization)
        self.prev_rank = layout.rank(self.stage - 1, self.tp_rank) if self.stage > 0 else None
        self.next_rank = (layout.rank(self.stage + 1, self.tp_rank)
                          if self.stage < layout.pipeline_parallel_size - 1 else None)
        self.runner: ModelRunner | None = None
        self.timings: deque[StageTiming] = deque(maxlen=1_000_000)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner = ModelRunner(self.model, num_blocks, self.config.block_size, self.device, self.dtype,
                                  enforce_eager=self.config.enforce_eager)

    def run(self, micro_batch: int, plan: StepPlan) -> torch.Tensor | None:
        """Run this rank's share of a micro-batch; logits on the driver, None or hidden elsewhere."""
        hidden = None
        if self.prev_rank is not None:
            hidden = self.comm.recv_tensor((plan.num_tokens, self.model.config.hidden_size), self.dtype,
                                           self.prev_rank)
        if self.device.type == "cuda":  # NCCL receives asynchronously: time the compute alone
            torch.cuda.synchronize(self.device)
        start = time.monotonic()
        out = self.runner.run_stage(plan, hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timings.append(StageTiming(micro_batch, start, time.monotonic()))
        if self.next_rank is not None:
            self.comm.send_tensor(out, self.next_rank)
        return out

    def serve(self) -> None:
        """The loop of a rank other than the driver: act on its messages, in order, until Shutdown."""
        while True:
            msg = self.comm.recv_message(DRIVER, SERVED)
            if isinstance(msg, RunPlan):
                self.run(msg.micro_batch, msg.plan)
            elif isinstance(msg, InitKVCache):
                self.init_kv_cache(msg.num_blocks)
            elif isinstance(msg, SendTimings):
                self.comm.send_message(Timings([(t.micro_batch, t.start, t.end) for t in self.timings]), [DRIVER])
                if msg.reset:
                    self.timings.clear()
            elif isinstance(msg, Shutdown):
                return
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")


def local_device(config: EngineConfig, local_rank: int) -> torch.device:
    from carpool.config import resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def threads_per_process(config: EngineConfig, local_processes: int) -> int:
    """--num-threads, else the host's cores shared out between its processes."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // local_processes)


def worker_main(config: EngineConfig, layout: ParallelLayout, rank: int, rendezvous: Rendezvous,
                local_rank: int, local_processes: int) -> None:
    """Entry point of every rank but the driver (a spawned process, or a torchrun rank)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s carpool worker {rank}: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the driver, which stops the workers
    torch.set_num_threads(threads_per_process(config, local_processes))
    device = local_device(config, local_rank)
    if device.type == "cpu":
        keep_freed_memory_in_process()
    timeout = datetime.timedelta(seconds=config.distributed_timeout)
    if rendezvous.host is not None:  # tell the driver this process is up (see MultiprocExecutor)
        import torch.distributed as dist

        store = dist.TCPStore(rendezvous.host, rendezvous.port, layout.world_size, is_master=False,
                              timeout=timeout)
        store.set(f"carpool/alive/{rank}", str(os.getpid()))
    else:
        store = None
    comm = Comm(layout, rank, device, rendezvous, timeout, store=store)
    dtype = comm.recv_message(DRIVER, (LoadModel,)).dtype  # resolved by the driver: 'auto' may differ by host
    try:
        reader = open_gguf(config.model) if is_gguf(config.model) else None
        worker = Worker(config, layout, rank, comm, device, dtype, reader)
        status = None
    except Exception as exc:  # reported to the driver, which fails the engine start with it
        log.exception("loading the model failed")
        status = f"{type(exc).__name__}: {exc}"
    comm.send_message(WorkerReady(status), [DRIVER])
    if status is not None:
        comm.wait_sent(30.0)  # deliver the error before exiting
        os._exit(1)
    try:
        worker.serve()
    except Exception:  # a peer died or the driver went away: nothing left to serve
        log.exception("worker %s stopped", layout.describe(rank))
        sys.stderr.flush()
        os._exit(1)
    try:
        comm.close()
    finally:
        os._exit(0)
