"""Run carpool across hosts under torchrun (or any launcher that sets the env:// variables).

Every rank runs the same command line, e.g. on each of two hosts:

    torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \\
        -m carpool.distributed.launch serve --tensor-parallel-size 2 --pipeline-parallel-size 2

Rank 0 runs the carpool command itself (`serve`, `generate`, `bench ...`) as the driver; every other
rank parses the same engine flags and serves as a worker until the driver shuts it down.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("carpool.distributed.launch: RANK and WORLD_SIZE are not set; start it with torchrun",
              file=sys.stderr)
        return 2
    os.environ["CARPOOL_DISTRIBUTED_INIT"] = "env://"
    from carpool.cli import build_parser, main as cli_main

    rank = int(os.environ["RANK"])
    if rank == 0:
        return cli_main(argv)
    args = build_parser().parse_args(argv)
    if not hasattr(args, "tensor_parallel_size"):
        print(f"carpool.distributed.launch: `{argv[0]}` does not run an engine", file=sys.stderr)
        return 2
    from carpool.cli import engine_config
    from carpool.distributed.comm import Rendezvous
    from carpool.distributed.layout import ParallelLayout
    from carpool.distributed.worker import worker_main

    config = engine_config(args)
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
    world = int(os.environ["WORLD_SIZE"])
    if world != layout.world_size:
        print(f"carpool.distributed.launch: WORLD_SIZE is {world} but tensor x pipeline parallel size "
              f"is {layout.world_size}", file=sys.stderr)
        return 2
    worker_main(config, layout, rank, Rendezvous(), int(os.environ.get("LOCAL_RANK", 0)),
                int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
