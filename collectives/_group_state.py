"""Per-process-group state (detected topologies, level communicators, tuned parameters, scratch
buffers, shared-memory segments, the async runners), released once its group is destroyed.

Why: every cache keyed by a ProcessGroup holds a reference to it. A group that
dist.destroy_process_group() had destroyed stayed alive in them until the interpreter exited, gloo's
worker threads still running; a worker that freed a finished collective's Work while the interpreter
was finalizing needed the GIL for the Work's tensors, was made to exit inside a noexcept destructor,
and the process aborted ("terminate called without an active exception": about one run in four of
the README's distributed example, after it had printed its results). Released here (whenever a group
is first used, and at exit), the group's own destructor joins its workers while the interpreter is
whole. A process that forms groups again and again also stops accumulating our state of them (the
sub-groups collectives made for one, a hierarchy's levels and TokenRing's second group, stay registered
with torch until the default group is destroyed, as torch keeps every group it made).
"""
from __future__ import annotations

import atexit
import threading
from typing import Callable, Optional

import torch.distributed as dist

# (cache, the lock that guards it, what to do with a released value or None); keys are a group or a
# tuple whose first item is the group
_CACHES: list = []


def register(cache: dict, lock, on_release: Optional[Callable] = None) -> dict:
    _CACHES.append((cache, lock, on_release))
    return cache


def _group_of(key):
    return key[0] if isinstance(key, tuple) else key


def release_destroyed() -> None:
    """Drops every cached entry of a process group that is no longer live (destroyed). Takes each
    cache's lock in turn: never call it while holding one."""
    try:
        live = dist.distributed_c10d._world.pg_map  # private: if it moves, groups live as long as the process
    except Exception:  # noqa: BLE001
        return
    released = []
    for cache, lock, on_release in _CACHES:
        with lock:
            gone = [k for k in cache if _group_of(k) not in live]
            values = [cache.pop(k) for k in gone]
        if on_release is not None:
            released += [(on_release, v) for v in values]
    for on_release, value in released:  # outside the locks: closing a segment may take its own
        on_release(value)


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
