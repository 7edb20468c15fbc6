"""collectives.Topology: how the ranks of a process group nest (GCD pair < GPU node < cluster...).

`Topology([2, 4, 8])` lists the level sizes innermost first: 2 ranks share the fastest link, 4 such
pairs share a node, 8 nodes make the job (64 ranks). Position k of the mixed-radix numbering
(k = c0 + 2*(c1 + 4*c2)) is group rank `ranks[k]` (identity by default; `detect` fills it from where the
ranks actually live). The level-l group of a rank holds the ranks that differ from it only in c_l.
"""
from __future__ import annotations

import math
import numbers
import operator
import os
import socket
import threading
import warnings
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ._allreduce_algos import Comm
from ._group_state import destroy_group, note_use, register

_LOCK = threading.RLock()
_DETECTED: dict = register({}, _LOCK)  # group -> Topology
_LEVELS: dict = register({}, _LOCK)    # (group, sizes, ranks) -> [Comm per level]
# (group, sizes, ranks) -> the level sub-groups comms() made for it (those this rank is in), destroyed
# with the group (their shared-memory segments are released in the same pass, _group_state). Their
# names are torch's global count (new_group without use_local_synchronization, which every rank of the
# world enters): never reused while the default group lives, so the next group's sub-groups cannot
# find a destroyed one's addresses in the store.
_SUBGROUPS: dict = register({}, _LOCK, lambda groups: [destroy_group(g) for g in groups], order=1)


def _default_group(group, op: str = "collectives.all_reduce", member: bool = False):
    """`group`, or the default group for None; a clear error naming `op` for anything that is not a
    process group, and with member=True for a process outside it (all_reduce itself leaves such a
    process's tensor as it is, as dist.all_reduce does)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialized (call dist.init_process_group first)")
    if group is None:
        group = dist.group.WORLD
        note_use(group)
        return group
    # dist.new_group hands processes outside the new group a sentinel (GroupMember.NON_GROUP_MEMBER)
    if not isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError(f"{op}: expected 'group' to be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__} {group!r}")
    if member and dist.get_rank(group) < 0:
        raise ValueError(f"{op}: this process (global rank {dist.get_rank()}) is not a member of 'group'")
    note_use(group)
    return group


def _group_timeout(pg):
    for dev in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(dev)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend for that device
            continue
    return None


MAX_RANKS = 1 << 24  # a bound on a topology's ranks, far beyond any process group


class Topology:
    """Level sizes innermost first, e.g. Topology([2, 4, 8]); optional `ranks`: group rank at each
    mixed-radix position (default: group rank k at position k)."""

    def __init__(self, sizes: Sequence[int], ranks: Optional[Sequence[int]] = None, *, note: str = ""):
        if isinstance(sizes, (int, torch.SymInt, str, bytes, bytearray)) or not hasattr(sizes, "__iter__"):
            raise TypeError(f"collectives.Topology: sizes must be a sequence of ints (innermost level first), "
                            f"got {type(sizes).__name__}")
        # NumPy integers are ints here, as across the library (an np.array of sizes was refused; audit)
        sizes = [operator.index(s) if isinstance(s, np.integer) else s for s in sizes]
        if not sizes:
            raise ValueError("collectives.Topology: sizes must not be empty")
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int):
                raise TypeError(f"collectives.Topology: every level size must be an int, got {s!r}")
            if s < 1:
                raise ValueError(f"collectives.Topology: level sizes must be >= 1, got {sizes}")
        self.sizes = tuple(sizes)
        self.world = math.prod(self.sizes)
        if self.world > MAX_RANKS:  # (every rank is listed below: 2^40 ranks ate all memory; audit finding)
            raise ValueError(f"collectives.Topology: level sizes {list(self.sizes)} make {self.world} ranks, "
                             f"more than any process group holds ({MAX_RANKS})")
        if ranks is None:
            ranks = range(self.world)
        ranks = tuple(int(r) for r in ranks)
        if sorted(ranks) != list(range(self.world)):
            raise ValueError(f"collectives.Topology: ranks must be a permutation of 0..{self.world - 1} "
                             f"(sizes {list(self.sizes)}), got {list(ranks)}")
        self.ranks = ranks
        self.note = note

    # --------------------------------------------------------------------------------------------
    def __repr__(self):
        if self.ranks == tuple(range(self.world)):
            return f"Topology({list(self.sizes)})"
        return f"Topology({list(self.sizes)}, ranks={list(self.ranks)})"

    def __eq__(self, other):
        return isinstance(other, Topology) and (self.sizes, self.ranks) == (other.sizes, other.ranks)

    def __hash__(self):
        return hash((self.sizes, self.ranks))

    @property
    def num_levels(self) -> int:
        return len(self.sizes)

    def effective(self) -> "Topology":
        """The same topology without levels of size 1."""
        sizes = [s for s in self.sizes if s > 1] or [1]
        return Topology(sizes, self.ranks, note=self.note)

    def _check_position(self, what: str, position, level=None) -> None:
        # (positions past the world gave ranks that do not exist, a level past the last an IndexError; audit)
        if isinstance(position, bool) or not isinstance(position, numbers.Integral) or not 0 <= position < self.world:
            raise ValueError(f"collectives.Topology.{what}: expected a position in [0, {self.world}), got {position!r}")
        if level is not None and (isinstance(level, bool) or not isinstance(level, numbers.Integral)
                                  or not 0 <= level < len(self.sizes)):
            raise ValueError(f"collectives.Topology.{what}: expected a level in [0, {len(self.sizes)}), got {level!r}")

    def members(self, position: int, level: int) -> list[int]:
        """Positions of the level-`level` group that contains `position`, ordered by c_level."""
        self._check_position("members", position, level)
        stride = math.prod(self.sizes[:level])
        c = (position // stride) % self.sizes[level]
        base = position - c * stride
        return [base + j * stride for j in range(self.sizes[level])]

    def coords(self, position: int) -> list[int]:
        self._check_position("coords", position)
        out = []
        for s in self.sizes:
            out.append(position % s)
            position //= s
        return out

    # --------------------------------------------------------------------------------------------
    @classmethod
    def detect(cls, group=None) -> "Topology":
        """Collective (every rank of `group` calls it): ranks on the same host form a node; within a
        host, LOCAL_WORLD_SIZE (torchrun) splits consecutive ranks further into nodes. Hosts with
        different numbers of ranks cannot nest evenly: then the topology is flat (one level), with a
        warning and `note` saying why. Cached per group."""
        group = _default_group(group, "collectives.Topology.detect", member=True)
        with _LOCK:
            if group in _DETECTED:
                return _DETECTED[group]
        p = dist.get_world_size(group)
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        info = (socket.gethostname(), int(local) if local.isdigit() else 0)
        gathered = [None] * p
        if p > 1:
            dist.all_gather_object(gathered, info, group=group)
        else:
            gathered = [info]
        topo = cls.from_placement(gathered)
        if topo.note.startswith("hosts hold different"):
            warnings.warn(f"collectives.Topology.detect: {topo.note}", stacklevel=2)
        with _LOCK:
            _DETECTED[group] = topo
        return topo

    @classmethod
    def from_device_mesh(cls, mesh) -> "Topology":
        """The topology of a torch DeviceMesh whose dimensions go outermost first (e.g. ("node",
        "gpu")): its last dimension is the innermost level. Ranks are the mesh's ranks in row-major
        order (group ranks of the default group)."""
        grid = getattr(mesh, "mesh", mesh)
        if not isinstance(grid, torch.Tensor) or grid.dim() < 1:
            raise TypeError(f"collectives.Topology.from_device_mesh: expected a DeviceMesh (or a rank tensor), "
                            f"got {type(mesh).__name__}")
        return cls(list(reversed(grid.shape)), [int(r) for r in grid.flatten().tolist()],
                   note=f"from a DeviceMesh of shape {tuple(grid.shape)}")

    @classmethod
    def from_placement(cls, placement) -> "Topology":
        """The topology of ranks placed as `placement[r] = (hostname, LOCAL_WORLD_SIZE or 0)` (what
        detect gathers): ranks of one host form a node, in rank order; a single host whose ranks all
        report LOCAL_WORLD_SIZE = L (1 < L < p, p % L == 0) is cut into nodes of L consecutive ranks
        (torchrun's layout). Uneven hosts give a flat topology with a note saying why."""
        if (not isinstance(placement, (list, tuple)) or not placement
                or not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in placement)):
            raise ValueError(f"collectives.Topology.from_placement: expected a non-empty list of (hostname, "
                             f"LOCAL_WORLD_SIZE or 0) pairs, one per rank, got {placement!r:.200}")
        p = len(placement)
        hosts: dict = {}
        for r, (host, _) in enumerate(placement):
            hosts.setdefault(host, []).append(r)
        nodes = list(hosts.values())
        locals_ = {int(lw or 0) for _, lw in placement}
        if len(nodes) == 1 and len(locals_) == 1:
            lw = locals_.pop()
            if 1 < lw < p and p % lw == 0:
                nodes = [list(range(k, k + lw)) for k in range(0, p, lw)]
        counts = {len(n) for n in nodes}
        if len(counts) != 1:
            note = (f"hosts hold different numbers of ranks ({', '.join(str(len(n)) for n in nodes)}): "
                    f"no even nesting, so the topology is flat")
            return cls([p], note=note)
        per = counts.pop()
        if not 1 < per < p:
            return cls([p], note=f"{len(nodes)} node(s) x {per} rank(s), from hostnames and LOCAL_WORLD_SIZE")
        order = [r for n in nodes for r in n]
        return cls([per, len(nodes)], order,
                   note=f"{len(nodes)} node(s) x {per} rank(s), from hostnames and LOCAL_WORLD_SIZE")

    # --------------------------------------------------------------------------------------------
    def comms(self, group=None) -> list[Comm]:
        """This rank's communicator at every level (innermost first). Collective on first use: when
        `group` is the whole world, each level's sub-groups are created with dist.new_group (every
        rank creates every sub-group, in the same order, as new_group requires) and cached; for a
        smaller group, levels talk over `group` itself with rank lists."""
        group = _default_group(group)
        p = dist.get_world_size(group)
        if self.world != p:
            raise ValueError(f"collectives.all_reduce: topology {self!r} has {self.world} ranks but the "
                             f"group has {p}")
        key = (group, self.sizes, self.ranks)
        with _LOCK:
            if key in _LEVELS:
                return _LEVELS[key]
        me = dist.get_rank(group)
        pos = self.ranks.index(me)
        whole = p == dist.get_world_size()
        out, made = [], []
        for level, s in enumerate(self.sizes):
            members = self.members(pos, level)
            mine = members.index(pos)
            granks = [self.ranks[m] for m in members]
            if s == p:
                out.append(Comm(group, granks, mine, native_ok=True))
            elif whole and s > 1:
                sub = None
                timeout = _group_timeout(group)
                for base in self._level_bases(level):
                    ranks = [dist.get_global_rank(group, self.ranks[m]) for m in self.members(base, level)]
                    g = dist.new_group(ranks, timeout=timeout)
                    if base == members[0]:
                        sub = g
                        made.append(g)
                sub_ranks = [dist.get_group_rank(sub, dist.get_global_rank(group, r)) for r in granks]
                out.append(Comm(sub, sub_ranks, mine, native_ok=True))
            else:
                out.append(Comm(group, granks, mine, native_ok=(s == 1)))
        with _LOCK:
            _LEVELS[key] = out
            if made:
                _SUBGROUPS[key] = made
        return out

    def _level_bases(self, level: int) -> list[int]:
        """The first position of every level-`level` group, in a fixed order."""
        stride = math.prod(self.sizes[:level])
        return [q for q in range(self.world) if (q // stride) % self.sizes[level] == 0]
