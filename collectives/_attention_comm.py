"""Process-group plumbing for the sequence-parallel attention ops: the group view, point-to-point
batches cut into pieces, the cross-rank input check, and the second group TokenRing needs."""
from __future__ import annotations

import hashlib
import inspect
import struct
import threading
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._group_state import destroy_group, note_use, register

# gloo: one large two-way exchange runs at about half speed, ~1 MiB pieces restore it (FIELD_NOTES).
# NCCL pipelines large messages itself, so pieces are only cut for other backends.
PIECE_BYTES = 1 << 20
_TAG_STRIDE = 1 << 12  # piece tags of one logical message: tag * _TAG_STRIDE + piece


class Group:
    """Who we are in `group` (None: the default group; no initialized torch.distributed and
    group=None: a world of one, so the ops also run in a plain single process)."""

    def __init__(self, op: str, group=None):
        if group is not None and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{op}: 'group' was given but torch.distributed is not initialized")
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.pg, self.world, self.rank, self.glob = None, 1, 0, [0]
            self.pieces = False
            return
        if group is not None and group is dist.GroupMember.NON_GROUP_MEMBER:
            # what new_group hands a process outside it (it was refused as "got int -100"; audit finding)
            raise RuntimeError(f"{op}: this process is not a member of the given process group")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{op}: expected 'group' to be a torch.distributed process group or None, got "
                            f"{type(group).__name__} {group!r}")
        pg = dist.group.WORLD if group is None else group
        rank = dist.get_rank(pg)
        if rank < 0:
            raise RuntimeError(f"{op}: this process is not a member of the given process group")
        note_use(pg)
        self.pg = pg
        self.world = dist.get_world_size(pg)
        self.rank = rank
        self.glob = [dist.get_global_rank(pg, i) if pg is not dist.group.WORLD else i
                     for i in range(self.world)]
        self.pieces = dist.get_backend(pg) != "nccl"

    def peer(self, r: int) -> int:
        return self.glob[r % self.world]


def _split(t: torch.Tensor, pieces: bool) -> List[torch.Tensor]:
    flat = t.view(-1)
    step = max(1, PIECE_BYTES // max(1, t.element_size()))
    if not pieces or flat.numel() <= step:
        return [flat]
    return [flat[i:i + step] for i in range(0, flat.numel(), step)]


def post(grp: Group, sends: Sequence[Tuple[torch.Tensor, int, int]],
         recvs: Sequence[Tuple[torch.Tensor, int, int]], pg=None):
    """Start point-to-point transfers: sends/recvs are (contiguous tensor, group rank, tag).
    Returns the works; `wait(works)` finishes them. Each logical message keeps its own tag range, so
    messages of different kinds in flight between the same pair can never be confused."""
    pg = grp.pg if pg is None else pg
    ops = []
    for kind, items in ((dist.isend, sends), (dist.irecv, recvs)):
        for t, r, tag in items:
            if t.numel() == 0:
                continue
            assert t.is_contiguous()
            for i, piece in enumerate(_split(t, grp.pieces)):
                ops.append(dist.P2POp(kind, piece, grp.peer(r), pg, tag * _TAG_STRIDE + i))
    return dist.batch_isend_irecv(ops) if ops else []


def wait(works) -> None:
    for w in works or ():
        w.wait()


LAYOUTS = ("zigzag", "contiguous")  # the sequence layouts of the ring ops, by the index ranks exchange

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def shape_hash(shape) -> int:
    """A 62-bit hash of a whole shape (any number of dims), as one field for check_across_ranks."""
    return int.from_bytes(hashlib.blake2b(repr(tuple(shape)).encode(), digest_size=8).digest(), "little") >> 2


def check_across_ranks(op: str, grp: Group, local_error: Optional[BaseException], fields: Dict[str, int],
                       device: torch.device) -> None:
    """Every rank learns whether any rank got bad input, and raises: a local problem (or shard shapes
    that differ between ranks) becomes an error on *every* rank instead of a hang in the schedule.

    `fields` are small ints that must agree on all ranks (shapes, dtype code, flags)."""
    kinds = {None: 0, TypeError: 1, ValueError: 2}
    code = 0 if local_error is None else kinds.get(type(local_error), 3)
    names = list(fields)
    mine = torch.tensor([code] + [int(fields[n]) for n in names], dtype=torch.int64)
    if grp.world == 1:
        if local_error is not None:
            raise local_error
        return
    dev = torch.device("cpu")
    if dist.get_backend(grp.pg) == "nccl":  # NCCL exchanges CUDA tensors only (a rank's bad device too)
        dev = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    everyone = torch.empty(grp.world * mine.numel(), dtype=torch.int64, device=dev)
    all_gather_flat(everyone, mine.to(dev), grp.pg)
    table = everyone.view(grp.world, -1).cpu()
    if local_error is not None:
        raise local_error
    bad = [r for r in range(grp.world) if int(table[r, 0]) != 0]
    if bad:
        exc = {1: TypeError, 2: ValueError}.get(int(table[bad[0], 0]), RuntimeError)
        raise exc(f"{op}: rank(s) {bad} of the group got invalid input (see the error on that rank)")
    differ = [n for i, n in enumerate(names) if bool((table[:, i + 1] != table[0, i + 1]).any())]
    if differ:
        def shown(n, v):  # the fields as the caller passed them (the scale's bits and the layout's index were shown raw)
            if n == "back":  # TokenRing's second group: hashes of the names of the groups passed
                return "its own" if v == 0 else f"a group passed ({v:x})"
            if n == "scale":
                return repr(struct.unpack("<d", struct.pack("<q", v))[0])
            if n == "layout" and 0 <= v < len(LAYOUTS):
                return repr(LAYOUTS[v])
            return dtype_name(v) if n == "dtype" else str(v)

        per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{n}={shown(n, int(table[r, names.index(n) + 1]))}"
                                                         for n in differ) for r in range(grp.world))
        # a dtype that differs (alone) is a TypeError, as the contract has it for a dtype
        exc = TypeError if differ == ["dtype"] else ValueError
        raise exc(f"{op}: expected the same shard shape and arguments on every rank, got {per_rank}")


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, pg) -> None:
    """out[i*n:(i+1)*n] = rank i's inp (all_gather_single where this torch has it: the older name
    all_gather_into_tensor warns that it is deprecated)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=pg)


def dtype_code(dtype: torch.dtype) -> int:
    """A distinct number per dtype (the floats keep their small codes; every other dtype has its own:
    int64 vs int32 shards of unshard_sequence all got 0, and gloo aborted the process on the size
    mismatch that followed; uint8 vs int8 mixed bytes silently; review finding)."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:  # the same on every rank (crc32 of the name; Python's str hash is salted per process)
        code = 16 + zlib.crc32(str(dtype).encode()) % (1 << 20)
    return code


def dtype_name(code: int) -> str:
    """The dtype a dtype_code stands for (for error messages), or the number if none of torch's."""
    for dt in (getattr(torch, n) for n in dir(torch)):
        if isinstance(dt, torch.dtype) and dtype_code(dt) == code:
            return str(dt).replace("torch.", "")
    return str(code)


def float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


# TokenRing sends Q and the returning partials on two process groups so both directions are in flight
# at once (separate gloo contexts / NCCL communicators). The second group is made once per group and
# destroyed with it (_group_state: a gloo group is left to torch otherwise, 5 fds and 3 threads each;
# audit). Its name is the user's group's name plus _SECOND_SUFFIX: the same on every rank whatever each
# has made or released before, and as unique as torch's own names. new_group(use_local_synchronization=
# True), used before, names a group by its ranks and the number of groups this process holds, which
# repeats once groups are destroyed (plain torch: the second new/destroy cycle of such a group timed out
# in all_reduce) and differs between ranks that release at different times: the next second group of
# the same ranks took a destroyed one's name, read its gloo addresses from the store and failed to
# connect or hung (4 of 6 runs; review finding).
_SECOND_LOCK = threading.Lock()
_SECOND_SUFFIX = ":pykernels-token-ring-back"
_SECOND: Dict[object, object] = register({}, _SECOND_LOCK, lambda pg: _release_second(pg), order=1)


def _release_second(pg) -> None:
    # only a group of ours by name: one made by new_group (the fallback below) is left to torch, as its
    # name may come back
    if str(getattr(pg, "group_name", "")).endswith(_SECOND_SUFFIX):
        destroy_group(pg)


def _new_named_group(ranks: List[int], name: str, timeout):
    """What dist.new_group(ranks, timeout, use_local_synchronization=True) does (only the members take
    part), with the name given; None where this torch's private helper is not the one expected."""
    c10d = dist.distributed_c10d
    helper = getattr(c10d, "_new_process_group_helper", None)
    try:
        params = inspect.signature(helper).parameters
        default_pg = c10d._get_default_group()
        backend, store = c10d._world.pg_map[default_pg]
        pg_group_ranks = c10d._world.pg_group_ranks
    except Exception:  # noqa: BLE001
        return None
    if not {"group_name", "timeout", "group_desc", "device_id"} <= set(params):
        return None
    backend = dist.Backend(backend)
    if timeout is None:
        timeout = c10d._get_default_timeout(backend)
    ranks = sorted(ranks)
    pg, _ = helper(len(ranks), ranks.index(dist.get_rank()), ranks, backend, store, name, timeout=timeout,
                   group_desc="pykernels token_ring_attention second group",
                   device_id=default_pg.bound_device_id)
    pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def _gloo(pg) -> bool:
    try:
        return dist.get_backend(pg) == "gloo"
    except Exception:  # noqa: BLE001
        return False


def second_group(grp: Group):
    key = grp.pg
    if key not in _SECOND:
        # with the user's group's timeout: new_group's default (30 min on gloo) held the other ranks for
        # that long after one rank failed mid-schedule (review finding)
        from .topology import _group_timeout

        timeout = _group_timeout(grp.pg)
        second = None
        # named (and destroyed with its group) only where destroy_group will destroy it: gloo all through;
        # an NCCL one stays registered with torch, so a fixed name could be asked for twice (review)
        if _gloo(grp.pg) and _gloo(dist.distributed_c10d._get_default_group()):
            try:
                second = _new_named_group(list(grp.glob), f"{grp.pg.group_name}{_SECOND_SUFFIX}", timeout)
            except ValueError:  # torch: "The specified group name has already been created"
                second = None
        if second is None:
            # with the user's group's backend: new_group's default is the default group's (an NCCL default
            # group under a gloo group of CPU tensors: the partials never arrived; audit finding)
            second = dist.new_group(ranks=list(grp.glob), timeout=timeout, backend=dist.get_backend(grp.pg),
                                    use_local_synchronization=True)
        with _SECOND_LOCK:  # (release_destroyed iterates the dict under it)
            _SECOND[key] = second
    return _SECOND[key]
