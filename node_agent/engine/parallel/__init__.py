"""Tensor parallelism behind one replica object: the only package that imports torch.distributed.

group.py joins the replica's process group, steps.py carries rank 0's instructions to the other
ranks, and replica.py is what the engine loop calls (a LocalReplica, or a TensorParallelReplica).
"""
