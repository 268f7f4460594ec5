"""Tensor parallelism: process groups, collectives and Megatron-style parallel layers.

`engine.distributed.kv` (KV cache sizing) and `engine.distributed.launch` (spawn N ranks for a one-shot job)
are imported explicitly; they are not needed by the model code.
"""
from engine.distributed.comm import all_gather, all_reduce, all_reduce_min_int, broadcast_object, gather_to_driver
from engine.distributed.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                       QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding, head_partition,
                                       vocab_parallel_logits)
from engine.distributed.parallel_state import (NO_TP, TPGroup, destroy_tensor_parallel, free_port, get_tp_group,
                                               get_tp_rank, get_tp_size, init_tensor_parallel)

__all__ = [
    "NO_TP", "TPGroup", "init_tensor_parallel", "destroy_tensor_parallel", "get_tp_group", "get_tp_rank",
    "get_tp_size", "free_port", "all_reduce", "all_gather", "gather_to_driver", "broadcast_object",
    "all_reduce_min_int", "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
    "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "vocab_parallel_logits", "head_partition",
]
