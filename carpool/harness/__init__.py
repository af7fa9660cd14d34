"""What benchmarks (carpool/bench) and the simulator (carpool/sim) share: workloads, the drivers
that replay them on an engine, the metrics and capacity search over what they record, and
synthetic batches for timing exact shapes."""
