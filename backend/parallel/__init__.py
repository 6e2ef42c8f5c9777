"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

    group.py         rendezvous and the two process groups (all-reduce; step messages)
    sharding.py      which part of each checkpoint tensor a rank keeps
    step_message.py  what rank 0 sends each step
    leader.py        rank 0: starting, feeding, watching and stopping the other ranks
    worker.py        ranks 1..N-1: the loop that runs rank 0's steps
"""
