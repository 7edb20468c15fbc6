"""What the collectives need to run under torch.compile(fullgraph=True) (API.md: every op is a
torch.library op that compiles without a graph break).

Eager calls run the Python schedules directly (no dispatcher hop on the latency-bound path). While
dynamo traces, the public functions call torch.ops.pykernels.<op> instead, whose real implementation
runs those same schedules at run time. A custom op cannot take a ProcessGroup, so it takes the group's
name (a constant dynamo reads off the group while tracing, as torch's functional collectives do) and
resolves it back when it runs.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

NO_GROUP = ""  # torch.distributed not initialized and group=None: a world of one


def group_name(op: str, group) -> str:
    """The name of `group` (None: the default group) for a custom op's arguments, with the errors the
    eager paths raise for a group that is not one. Traceable by dynamo."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError(f"{op}: 'group' was given but torch.distributed is not initialized")
        return NO_GROUP
    if group is None:
        return dist.group.WORLD.group_name
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: expected 'group' to be a torch.distributed process group or None, got "
                        f"{type(group).__name__} {group!r}")
    return group.group_name


def group_of(name: str) -> Optional[dist.ProcessGroup]:
    """The process group a custom op's `group` argument names (None for NO_GROUP)."""
    if name == NO_GROUP:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


