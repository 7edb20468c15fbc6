"""Ring and TokenRing attention (issue #6). Not implemented yet."""


def _todo(*args, **kwargs):
    raise NotImplementedError("collectives.ring_attention: not implemented yet (issue #6)")


ring_attention = token_ring_attention = shard_sequence = unshard_sequence = _todo
