"""Shared-memory all-reduce among the ranks of one host (collectives.all_reduce, algorithm
"shared_memory"; the data path is pykernels._cpu_runtime.shm_collective, csrc/runtime/runtime_cpu.cpp).

Ranks on one host that exchange vectors through gloo talk TCP over loopback: each byte is copied into
the kernel and out again, with a syscall per message and gloo's I/O threads competing for the cores.
NCCL and MPICH move intra-node traffic through shared memory instead; so does this: one segment in
/dev/shm per process group, mapped by every rank, holding two sets of one slot per rank, a barrier
counter (a futex word), a poison word and two lines per rank (call signatures, pid). Used for the
whole all-reduce of a one-node group ("shared_memory"), and for the innermost level (one node) of the
hierarchical all-reduce: its reduce-scatter and all-gather (_allreduce_algos.shm_reduce_scatter).

Setting a group up is a collective (transport(), on the first call that may use it, in the caller's
thread): every rank reports its host (hostname, boot id, /dev/shm's device); if all match, group rank 0
creates the segment (reserved with posix_fallocate, so a full /dev/shm is an error here and never a
SIGBUS later), every rank maps it and checks a random token written by rank 0, and rank 0 unlinks it
once every rank has mapped it (nothing is left behind in /dev/shm even if a process dies later). If
any step fails on any rank, every rank agrees the transport is unavailable and auto keeps gloo's
point-to-point algorithms.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import socket
import struct
import threading
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ._group_state import register

try:
    from pykernels._cpu_runtime import shm_collective as _shm_collective
    from pykernels._native import dtype_code as _dtype_code
except Exception:  # noqa: BLE001 - not built: no shared-memory transport
    _shm_collective = None

OPNAME = "collectives.all_reduce"
# Both buffer sets of every rank; a slot is min(4 MiB, this / (2 p)): 2 MiB on 4 ranks, so a 64 MiB
# all-reduce is 32 chunks (~60 us of barriers each on 4 ranks / 2 cores, against ~1 ms of copying).
# A segment (this + an 8 KiB header) lives until its process group is destroyed (unmapped when the
# next group sets one up) or its processes exit; a container's default 64 MiB /dev/shm holds three
# live ones (a fourth group finds no room and keeps the point-to-point algorithms).
SEGMENT_BYTES = 16 << 20
MAX_SLOT_BYTES = 4 << 20
MIN_SLOT_BYTES = 64 << 10
_DATA_OFF = 8192  # the header: token, barrier counter, poison, two lines per rank (signatures, pid)
MAX_RANKS = (_DATA_OFF - 128) // 128
# What pykernels._cpu_runtime's reductions (reduce_into, shm_collective) take: dtypes, and op codes
# (avg sums; the caller divides)
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8)
OP_CODES = {"sum": 0, "avg": 0, "prod": 1, "max": 2, "min": 3}
_ALL_REDUCE, _REDUCE_SCATTER, _ALL_GATHER = 0, 1, 2  # kinds (csrc/runtime/runtime_cpu.cpp, ShmKind)

_LOCK = threading.Lock()
_TRANSPORTS: dict = {}  # group -> Transport, or None where unavailable
# a destroyed group's segment is unmapped (a process that forms groups again and again would otherwise
# keep every segment's pages in /dev/shm)
register(_TRANSPORTS, _LOCK, lambda tr: tr is not None and tr.close("its process group was destroyed"))


def slot_bytes_for(p: int) -> int:
    s = min(MAX_SLOT_BYTES, SEGMENT_BYTES // (2 * p))
    return max(MIN_SLOT_BYTES, s // 4096 * 4096)


class Transport:
    """A mapped segment of one process group. One all-reduce at a time per group (all_reduce's
    per-group runner keeps calls in order), so the barrier and chunk counts need no lock."""

    def __init__(self, mm: mmap.mmap, p: int, rank: int, slot_bytes: int, timeout_s: float, watch_pids: bool):
        self.mm = mm
        view = torch.frombuffer(mm, dtype=torch.uint8)
        self.base = view.data_ptr()  # the mapping's address (an mmap never moves; the view is let go so
        del view                     # that close() may unmap it)
        self.p, self.rank, self.slot_bytes, self.timeout_s = p, rank, slot_bytes, timeout_s
        self.watch_pids = watch_pids
        self.pid = os.getpid()  # a forked child inherits the mapping, but is not a rank of the group
        self.barriers = 0  # barriers passed since the segment was made: the same count on every rank
        self.chunks = 0    # chunks done: picks the buffer set of the next one
        self.failed: Optional[str] = None

    def close(self, why: str) -> None:
        """Unmaps the segment (its process group was destroyed); later calls raise instead of touching it."""
        self.failed = why
        try:
            self.mm.close()
        except (BufferError, ValueError):  # still exported somewhere: leave it mapped
            pass

    def all_reduce(self, x: torch.Tensor, n: int, op: str, dtype, signature: str) -> None:
        """x[:n] (contiguous, CPU, a dtype of DTYPES) reduced in place across the group."""
        align = 64 // x.element_size()  # parts in whole cache lines
        per_rank = -(-n // self.p)
        q = -(-per_rank // align) * align
        off = [min(j * q, n) for j in range(self.p + 1)]
        self._call(_ALL_REDUCE, x, (off[:-1], off[1:]), op, dtype, signature, f"numel={n}")

    def reduce_scatter(self, x: torch.Tensor, parts, op: str, dtype, signature: str) -> None:
        """parts = (begin, end): this group's rank r owns elements begin[r]..end[r] of x, which end up
        reduced across the group, in place."""
        self._call(_REDUCE_SCATTER, x, parts, op, dtype, signature + "|rs", f"part {parts[0][self.rank]}..")

    def all_gather(self, x: torch.Tensor, parts, dtype, signature: str) -> None:
        """Every rank's copy of part r of x replaced by rank r's."""
        self._call(_ALL_GATHER, x, parts, "sum", dtype, signature + "|ag", f"part {parts[0][self.rank]}..")

    def _call(self, kind: int, x: torch.Tensor, parts, op: str, dtype, signature: str, what: str) -> None:
        if os.getpid() != self.pid:
            raise RuntimeError(f"{OPNAME}: this process was forked from a rank after the group's shared-memory "
                               f"segment was made; it is not a rank of the group and cannot reduce through it "
                               f"(its calls would count as the parent's)")
        if self.failed:
            raise RuntimeError(f"{OPNAME}: the group's shared-memory transport is unusable after an earlier "
                               f"failure ({self.failed}); make a new process group")
        sig = int.from_bytes(hashlib.blake2b(signature.encode(), digest_size=8).digest(), "little")
        try:
            status, barriers, chunks = _shm_collective(self.base, _DATA_OFF, self.slot_bytes, self.p, self.rank,
                                                       x.data_ptr(), parts[0], parts[1], _dtype_code(x.dtype),
                                                       OP_CODES[op], sig,
                                                       kind, self.barriers, self.chunks, self.timeout_s,
                                                       self.watch_pids)
        except BaseException:  # Ctrl-C while waiting (the segment is poisoned for the other ranks)
            self.failed = "a call on this rank was interrupted"
            raise
        self.barriers += barriers
        self.chunks += chunks
        if status == 1:
            raise RuntimeError(f"{OPNAME}: the ranks of the group disagree on numel, dtype or op (this rank: "
                               f"{what}, dtype={dtype}, op={op}); every rank must pass the same")
        if status:
            self.failed = _FAILURES.get(status, f"status {status}").format(t=self.timeout_s)
            raise RuntimeError(f"{OPNAME}: shared-memory all-reduce: {self.failed} (this rank: {what}, "
                               f"dtype={dtype}, op={op}); every rank must call all_reduce with the same "
                               f"numel, dtype and op, and the group is unusable afterwards")


def transport_if_ready(pg) -> Optional[Transport]:
    """The transport of `pg` if it was set up (no collective): the hierarchical algorithm's inner
    level, set up by all_reduce before the call runs."""
    with _LOCK:
        return _TRANSPORTS.get(pg)


_FAILURES = {2: "a rank did not arrive within the group's timeout of {t:.0f} s",
             3: "a peer rank's process exited",
             4: "another rank gave up on the group (a timeout, an interrupt or a dead peer)"}


def _host_id():
    if _shm_collective is None:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat("/dev/shm")
    except OSError:
        return None
    return (socket.gethostname(), boot, st.st_dev)


def _timeout_s(group) -> float:
    from .topology import _group_timeout

    t = _group_timeout(group)
    if isinstance(t, timedelta):
        return max(t.total_seconds(), 1.0)
    return 1800.0


def transport(group) -> Optional[Transport]:
    """The group's shared-memory transport, or None where its ranks are not all on one host (or the
    segment could not be made). Collective on the first call per group; every rank gets the same
    answer."""
    with _LOCK:
        if group in _TRANSPORTS:
            return _TRANSPORTS[group]
    p = dist.get_world_size(group)
    rank = dist.get_rank(group)
    result = None
    # decided by what every rank sees alike (the group); what may differ between ranks (the native
    # extension, /dev/shm) goes into the host agreement inside _setup, so every rank joins it
    if 2 <= p <= MAX_RANKS and dist.get_backend(group) == "gloo":
        result = _setup(group, p, rank)
    with _LOCK:
        _TRANSPORTS[group] = result
    return result


def _agree(group, ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _setup(group, p: int, rank: int) -> Optional[Transport]:
    hosts = [None] * p
    dist.all_gather_object(hosts, _host_id(), group=group)
    if hosts[0] is None or any(h != hosts[0] for h in hosts):
        return None
    slot = slot_bytes_for(p)
    size = _DATA_OFF + 2 * p * slot
    path, token, fd, mm, watch = "", secrets.token_bytes(16), -1, None, False
    if rank == 0:
        path = f"/dev/shm/pykernels-allreduce-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, size)  # reserve every page now: a full /dev/shm fails here
            os.pwrite(fd, token, 0)
        except OSError:
            if fd >= 0:
                os.close(fd)
                fd = -1
            try:
                os.unlink(path)
            except OSError:
                pass
            path = ""
    obj = [(path, token)]
    dist.broadcast_object_list(obj, group_src=0, group=group)
    path, token = obj[0]
    ok = bool(path)
    try:
        if ok:
            if rank != 0:
                fd = os.open(path, os.O_RDWR)
            if os.fstat(fd).st_size != size:
                ok = False
            else:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                ok = mm[:16] == token
                if ok:  # this rank's pid and pid namespace, for the others' liveness check
                    mm[_PID_OFF + 128 * rank:_PID_OFF + 128 * rank + 16] = struct.pack("<qq", os.getpid(), _pid_ns())
    except Exception:  # noqa: BLE001 - any failure on any rank: every rank keeps the other algorithms
        ok = False
    finally:
        if fd >= 0:
            os.close(fd)  # the mapping stays
    ok = _agree(group, ok)  # every rank has mapped it and written its pid (or failed): the name may go
    if ok:
        # every rank in this pid namespace (a pid names the same process for all: containers sharing
        # /dev/shm and the host name may still have their own namespaces, where a peer's pid number
        # names some other process here) and alive: then a peer that exits while the others wait on it
        # fails them at once instead of after the group's timeout
        ids = [struct.unpack("<qq", mm[_PID_OFF + 128 * j:_PID_OFF + 128 * j + 16]) for j in range(p)]
        watch = all(ns == _pid_ns() != 0 and (j == rank or _visible(pid)) for j, (pid, ns) in enumerate(ids))
    if rank == 0 and path:
        try:
            os.unlink(path)
        except OSError:
            pass
    if not ok:
        if mm is not None:
            mm.close()
        return None
    return Transport(mm, p, rank, slot, _timeout_s(group), watch)


_PID_OFF = 128 + 8  # rank r's pid at _PID_OFF + 128 r (after a signature; csrc/runtime/runtime_cpu.cpp)


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _visible(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False
