"""collectives: multi-rank ops over torch.distributed (gloo on CPU, NCCL on GPU).

  all_reduce, Topology, plan, ddp_comm_hook        topology-aware hierarchical all-reduce (issue #7)
  ring_attention, token_ring_attention,            sequence-parallel attention (issue #6)
  shard_sequence, unshard_sequence
"""
from .all_reduce import all_reduce, Topology, plan, ddp_comm_hook  # noqa: F401
from .ring_attention import ring_attention, token_ring_attention, shard_sequence, unshard_sequence  # noqa: F401

__all__ = ["all_reduce", "Topology", "plan", "ddp_comm_hook",
           "ring_attention", "token_ring_attention", "shard_sequence", "unshard_sequence"]
