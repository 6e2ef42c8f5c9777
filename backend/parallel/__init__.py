"""Tensor and pipeline parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

    group.py         rendezvous, the rank grid (stages x tensor-parallel ranks), its process
                     groups (all-reduce per stage; stage to stage; step messages)
    sharding.py      which part of each checkpoint tensor a tensor-parallel rank keeps
    pipeline.py      stage-to-stage transfers: hidden states forward, logits back to rank 0
    step_message.py  what rank 0 sends each step
    leader.py        rank 0: starting, feeding, watching and stopping the other ranks
    worker.py        ranks 1..N-1: the loop that runs rank 0's steps
"""
