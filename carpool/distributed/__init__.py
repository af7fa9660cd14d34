"""Tensor and pipeline parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

layout.py: which rank holds which shard; comm.py: process groups and transfers; worker.py: one
rank's model slice and its loop; executor.py: the engine's single-process and multi-process
executors; launch.py: the torchrun entry point for several hosts.
"""
