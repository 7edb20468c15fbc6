"""Per-process-group state (detected topologies, level communicators, tuned parameters, scratch
buffers, shared-memory segments, the async runners), released once its group is destroyed.

Why: every cache keyed by a ProcessGroup holds a reference to it. A group that
dist.destroy_process_group() had destroyed stayed alive in them until the interpreter exited, gloo's
worker threads still running; a worker that freed a finished collective's Work while the interpreter
was finalizing needed the GIL for the Work's tensors, was made to exit inside a noexcept destructor,
and the process aborted ("terminate called without an active exception": about one run in four of
the README's distributed example, after it had printed its results). Released here (whenever a group
is first used, and at exit), the group's own destructor joins its workers while the interpreter is
whole. A process that forms groups again and again also stops accumulating our state of them, and
the gloo groups collectives made for one (a hierarchy's level sub-groups, TokenRing's second group) are
destroyed with it (destroy_group), their own caches (a level's shared-memory segment) released in the
same pass. They had stayed registered with torch: per new_group/use/destroy cycle, +2 groups, 11 fds,
6 threads and a 16 MiB segment per rank (hierarchical on 4 ranks), +1 group, 5 fds, 3 threads
(TokenRing on 2 ranks; out of fds at ulimit 1024 after ~200 cycles; audit).

Destroying a gloo group is local (no message to the peers: measured 0.1 ms, and a peer blocked on it
is held only until its timeout, as by any absent rank), so each rank may release at its own time: a
rank releases its groups on its own next first use of a group, only after the user destroyed the
group they served, i.e. after this rank's last call on them returned. Other backends' groups (NCCL:
destroying a communicator was a collective in some NCCL versions) stay registered with torch.

Known limit (review): torch names a group made with new_group(use_local_synchronization=True) by its
ranks and the number of groups the process holds. Ranks release our groups at their own next first use
of a group, so between a destroy_process_group() and every rank's next collectives call, ranks may hold
different numbers of groups, and such a group made then may get different names on different ranks
(its rendezvous then times out). torch has the same fragility whenever ranks hold different groups;
make local-synchronization groups before the destroy, or after a collectives call on every rank.
"""
from __future__ import annotations

import atexit
import threading
import warnings
from typing import Callable, Optional

import torch.distributed as dist

# (cache, the lock that guards it, what to do with a released value or None, order); keys are a group or
# a tuple whose first item is the group
_CACHES: list = []


def register(cache: dict, lock, on_release: Optional[Callable] = None, order: int = 0) -> dict:
    """`order`: released values' on_release run in increasing order within a pass (the async runners
    (-1) end before the groups their queued calls use are destroyed (1))."""
    _CACHES.append((cache, lock, on_release, order))
    return cache


def _group_of(key):
    return key[0] if isinstance(key, tuple) else key


def release_destroyed() -> None:
    """Drops every cached entry of a process group that is no longer live (destroyed). Takes each
    cache's lock in turn: never call it while holding one."""
    for _ in range(8):  # a pass that destroys our sub-groups leaves their own entries for the next
        try:
            live = dist.distributed_c10d._world.pg_map  # private: if it moves, groups live as long as the process
        except Exception:  # noqa: BLE001
            return
        released = []
        for cache, lock, on_release, order in _CACHES:
            with lock:
                gone = [k for k in cache if _group_of(k) not in live]
                values = [cache.pop(k) for k in gone]
            if on_release is not None:
                released += [(order, on_release, v) for v in values]
        if not released:
            return
        # outside the locks (closing a segment may take its own), runners before the groups they use
        for _, on_release, value in sorted(released, key=lambda r: r[0]):
            on_release(value)


def destroy_group(pg) -> None:
    """Destroys a gloo group that collectives made (never one of the user's), if torch still has it.
    Local: see the module's docstring. A group of another backend is left registered with torch."""
    try:
        c10d = dist.distributed_c10d
        if pg not in c10d._world.pg_map or dist.get_backend(pg) != "gloo":
            return
        dist.destroy_process_group(pg)
    except Exception as exc:  # noqa: BLE001 - never let a release fail the caller's own call
        warnings.warn(f"collectives: could not destroy a sub-group made for a destroyed group: {exc}", stacklevel=2)


_SEEN_LOCK = threading.Lock()
_SEEN: dict = register({}, _SEEN_LOCK)  # every group used so far -> True


def note_use(group) -> None:
    """Called with the group of every call (~70 ns): a group's first use releases the groups destroyed
    since the last one."""
    if group not in _SEEN:
        release_destroyed()
        with _SEEN_LOCK:
            _SEEN[group] = True


atexit.register(release_destroyed)
