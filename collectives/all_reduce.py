"""Topology-aware all-reduce over torch.distributed point-to-point messages (issue #7).

    collectives.all_reduce(tensor, op="sum", group=None, *, topology=None, algorithm="auto", async_op=False)
    collectives.Topology.detect(group=None) / collectives.Topology([2, 4, 8])
    collectives.plan(numel, dtype, group=None, topology=None) -> str
    model.register_comm_hook(state, collectives.ddp_comm_hook)
    collectives.all_reduce.tune(group=None, topology=None)   # collective: measure alpha/beta, cache them

Algorithms (collectives/_allreduce_algos.py): recursive doubling, recursive halving-doubling
(Rabenseifner), ring, hierarchical (reduce-scatter per level inside the innermost groups, recurse
outward, all-reduce the shard at the outermost level, all-gather back down), with the MPICH fold for
non-powers of two, uneven splits and 1-4 MiB pieces. "shared_memory" (collectives/_shm.py): ranks that
all run on one host reduce through one /dev/shm segment instead of TCP over loopback (NCCL's and MPICH's
intra-node transport); auto uses it for a group of one node. "auto" picks by an alpha-beta-gamma cost
model per level (Thakur et al. 2005; ../shared/ALGORITHMS.md), whose alpha/beta/gamma and a measured
best-per-size table come from `tune()`; gloo's own dist.all_reduce ("native") is one of the candidates,
so auto never picks something that measured slower than it.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import queue
import statistics
import threading
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from . import _allreduce_algos as A
from . import _shm, _traced
from ._group_state import register
from .topology import Topology, _default_group
from pykernels._backend import fake_on_one_device

__all__ = ["all_reduce", "Topology", "plan", "ddp_comm_hook", "tune", "ALGORITHMS", "AllReduceWork"]

OPNAME = "collectives.all_reduce"
ALGORITHMS = ("auto", "recursive_doubling", "halving_doubling", "ring", "hierarchical", "shared_memory", "native")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT, "product": dist.ReduceOp.PRODUCT,
        "mean": dist.ReduceOp.AVG}
# The reduction of each received piece runs on the calling thread. On CPU it is pykernels' native loop
# (pykernels._cpu_runtime.reduce_into: AVX2, GIL released, one call per piece). The torch fallback (no
# native extension, GPU tensors) runs in slices below ATen's grain size (32768 elements), so each call
# stays on the calling thread: a parallel region would wake the OpenMP pool, whose threads then spin and
# starve gloo's I/O threads on a small machine (measured: 5x slower all-reduce on 4 ranks / 2 cores);
# the slices cost ~8 us of call overhead each (a 1 MiB piece: 1.6x one pass), which the native loop saves.
_GRAIN = 32768
_OP_CODES = _shm.OP_CODES          # the native reductions' op codes and dtypes (one definition)
_NATIVE_DTYPES = _shm.DTYPES
try:
    from pykernels._cpu_runtime import reduce_into as _native_reduce_into
    from pykernels._native import dtype_code as _dtype_code
except Exception:  # noqa: BLE001 - not built, or pykernels fails to import: torch's ops in slices
    _native_reduce_into = None


def _serial(fn, op):
    code = _OP_CODES[op]

    def red(d, s):
        n = d.numel()
        if (_native_reduce_into is not None and d.dtype in _NATIVE_DTYPES and d.device.type == "cpu"
                and s.device.type == "cpu" and s.dtype == d.dtype
                and s.numel() == n and d.is_contiguous() and s.is_contiguous()):
            _native_reduce_into(d.data_ptr(), s.data_ptr(), n, _dtype_code(d.dtype), code)
            return
        if n <= _GRAIN or d.is_cuda:
            fn(d, s)
            return
        for a in range(0, n, _GRAIN):
            fn(d[a:a + _GRAIN], s[a:a + _GRAIN])
    return red


_TORCH_REDUCE = {"sum": lambda d, s: d.add_(s), "avg": lambda d, s: d.add_(s), "prod": lambda d, s: d.mul_(s),
                 "max": lambda d, s: torch.maximum(d, s, out=d), "min": lambda d, s: torch.minimum(d, s, out=d)}
_REDUCE = {op: _serial(fn, op) for op, fn in _TORCH_REDUCE.items()}
_BASE_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
            "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# ================================================================================================
# Argument checks
# ================================================================================================
def _parse_op(op, who: str = OPNAME) -> str:
    if isinstance(op, str):
        key = op.lower()
        if key in _OPS:
            return {"product": "prod", "mean": "avg"}.get(key, key)
        raise ValueError(f"{who}: op must be one of 'sum', 'avg', 'max', 'min', 'prod' (or a dist.ReduceOp), "
                         f"got {op!r}")
    if isinstance(op, (int, float)):  # dist.ReduceOp.MIN == 3 is True: a bare 3 must not pass for it
        raise ValueError(f"{who}: op must be a str or a dist.ReduceOp, got {type(op).__name__} {op!r}")
    for name in ("sum", "avg", "max", "min", "prod"):
        try:
            if op == _OPS[name]:
                return name
        except TypeError:
            break
    raise ValueError(f"{who}: op must be one of 'sum', 'avg', 'max', 'min', 'prod' or the matching "
                     f"dist.ReduceOp, got {op!r}")


def _work_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    # Half types are reduced in fp32 and rounded once at the end (ALGORITHMS.md); max/min are exact in
    # any type. An integer average sums exactly in int64 and divides once (truncating, like NCCL).
    if dtype in (torch.float16, torch.bfloat16) and op in ("sum", "avg", "prod"):
        return torch.float32
    if op == "avg" and not dtype.is_floating_point:
        return torch.int64
    return dtype


def _shared_view(arr) -> torch.Tensor:
    """A torch tensor sharing `arr`'s memory, or ValueError if that is impossible without a copy.

    all_reduce is in place, so a copy would leave the caller's array unchanged (a silent wrong answer).
    Negative strides (np_array[::-1]) must be refused before torch.from_dlpack sees them: torch 2.13
    aborts the interpreter on them; a read-only array cannot receive the result at all."""
    strides = getattr(arr, "strides", None) or ()
    if any(s < 0 for s in strides):
        raise ValueError(f"{OPNAME}: tensor is an array with negative strides {tuple(strides)}, which torch "
                         f"cannot share without a copy, and all_reduce works in place; pass a "
                         f"positive-stride array (e.g. numpy.ascontiguousarray) and read the result from it")
    flags = getattr(arr, "flags", None)
    if flags is not None and getattr(flags, "writeable", True) is False:
        raise ValueError(f"{OPNAME}: tensor is a read-only array and all_reduce works in place; pass a "
                         f"writable array")
    try:
        return torch.from_dlpack(arr)
    except (BufferError, RuntimeError, TypeError) as exc:
        raise ValueError(f"{OPNAME}: tensor could not be shared through DLPack without a copy "
                         f"({exc}), and all_reduce works in place; pass a torch.Tensor") from exc


_DTYPE_ERROR = OPNAME + ": tensor dtype must be one of float32, float64, float16, bfloat16, int32, int64, uint8, got {}"
_OVERLAP_ERROR = (f"{OPNAME}: tensor has elements that share memory (an expanded or overlapping view), so it "
                  f"cannot receive an in-place result; pass a tensor that owns its elements")


def _check_tensor(tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        if hasattr(tensor, "__dlpack__"):
            tensor = _shared_view(tensor)  # shares memory: the in-place result lands in the caller's array
        else:
            raise TypeError(f"{OPNAME}: tensor must be a torch.Tensor (or a DLPack array), got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(_DTYPE_ERROR.format(tensor.dtype))
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(f"{OPNAME}: tensor must be dense (strided), got layout {tensor.layout}")
    if tensor.device.type == "meta":
        raise RuntimeError(f"{OPNAME}: tensor is on the meta device (no data to reduce)")
    if torch._debug_has_internal_overlap(tensor) == 1:  # 1: elements share memory (expand, as_strided)
        raise ValueError(_OVERLAP_ERROR)
    if tensor.is_neg() or tensor.is_conj():
        # its memory holds the negated values: the transports read and write raw memory, which a sum
        # survives but max/min do not (review finding: max gave the min); torch.distributed's all_reduce
        # leaves such a tensor unchanged
        raise ValueError(f"{OPNAME}: tensor is a lazily negated view (torch._neg_view, or the imaginary part of "
                         f"a conjugated complex tensor): reduce tensor.resolve_neg() and copy the result back")
    return tensor


# ================================================================================================
# The cost model: per level alpha (s per message round), beta (s per byte), gamma (s per reduced byte)
# ================================================================================================
_DEFAULTS = {
    # gloo over TCP on one machine (2-core box, measured while idle); replaced by tune().
    "gloo": {"alpha": 150e-6, "beta": 1 / 1.2e9, "gamma": 1 / 4e9, "native_alpha": 400e-6,
             "native_beta": 1 / 0.6e9,
             # the shared-memory transport (ranks of one host, collectives/_shm.py): two futex barriers
             # per chunk; per byte of the vector each rank copies it in and out once and reduces 1/p
             "shm_alpha": 40e-6, "shm_beta": 1 / 2e9},
    # NCCL: our Python-driven rounds cannot beat NCCL's fused kernels; default to native.
    "nccl": {"alpha": 60e-6, "beta": 1 / 40e9, "gamma": 1 / 500e9, "native_alpha": 15e-6,
             "native_beta": 1 / 100e9},
}


class Params:
    """alpha/beta per topology level (innermost first), for the whole group (flat), for native,
    gamma, and the measured best algorithm per message size (bytes) when tuned."""

    def __init__(self, levels, flat, native, gamma, table=None, source="defaults", level_native=None,
                 shm=None, shm_raced=False):
        self.levels = [tuple(map(float, ab)) for ab in levels]
        # gloo's own all-reduce on each level's sub-group (alpha, beta per byte of the vector); by
        # default priced like our ring on that level, and preferred on a tie (it is gloo's own code,
        # and on a rate-limited link it measured faster than p2p messages: FIELD_NOTES/netns runs)
        self.level_native = [None if ab is None else tuple(map(float, ab)) for ab in (level_native or [])] \
            or [None] * len(self.levels)
        self.flat = tuple(map(float, flat))
        self.native = tuple(map(float, native))
        self.gamma = float(gamma)
        self.table = [(int(b), dict(c)) for b, c in (table or [])]
        self.source = source
        # the shared-memory transport: (alpha per chunk, beta per byte), and whether the tuned table
        # raced it (a table tuned without it, e.g. an older cache, must not keep auto off it)
        d = _DEFAULTS["gloo"]
        self.shm = tuple(map(float, shm)) if shm else (d["shm_alpha"], d["shm_beta"])
        self.shm_raced = bool(shm_raced)
        # the hierarchical algorithm may run its innermost level through shared memory (gloo groups:
        # set by _load_params and tune(), not stored)
        self.inner_shm = False
        # auto's choices by (algorithm, p, sizes, nbytes, native outer): evaluating the model and the
        # tuned table cost ~80 us a call (Python), paid on every rank of every call; a new Params (tune(),
        # a reload) starts empty
        self.choices: dict = {}

    def to_json(self) -> str:
        return json.dumps({"levels": self.levels, "flat": self.flat, "native": self.native,
                           "gamma": self.gamma, "table": self.table, "source": self.source,
                           "level_native": self.level_native, "shm": self.shm, "shm_raced": self.shm_raced})

    @classmethod
    def from_json(cls, text: str) -> "Params":
        d = json.loads(text)
        return cls(d["levels"], d["flat"], d["native"], d["gamma"], d.get("table"), d.get("source", "cache"),
                   d.get("level_native"), d.get("shm"), d.get("shm_raced", False))

    @classmethod
    def defaults(cls, backend: str, nlevels: int) -> "Params":
        """Untuned: the innermost level at the backend's typical alpha/beta, and each level further out
        assumed 2x the latency and 4x the time per byte (that is why the ranks were grouped: GCD pair <
        node < network); flat algorithms cross the slowest level. tune() replaces all of it."""
        d = _DEFAULTS.get(backend, _DEFAULTS["gloo"])
        levels = [(d["alpha"] * 2 ** lvl, d["beta"] * 4 ** lvl) for lvl in range(nlevels)]
        return cls(levels, levels[-1], (d["native_alpha"] * 2 ** (nlevels - 1), d["native_beta"] * 4 ** (nlevels - 1)),
                   d["gamma"], source=f"defaults for {backend}")


def _lg(p):
    return p.bit_length() - 1


def _fold_cost(p, nbytes, a, b, g):
    return 0.0 if p & (p - 1) == 0 else 2 * (a + nbytes * b) + nbytes * g


def _flat_cost(name, p, nbytes, a, b, g, own=None):
    """Seconds predicted for a flat all-reduce of nbytes over p members (ALGORITHMS.md). own: the
    (alpha, beta) that "native" and "shared_memory" are priced by instead of the links' a and b."""
    if p <= 1:
        return 0.0
    q = 1 << _lg(p)
    if name == "recursive_doubling":
        return _fold_cost(p, nbytes, a, b, g) + _lg(q) * (a + nbytes * b + nbytes * g)
    if name == "halving_doubling":
        return (_fold_cost(p, nbytes, a, b, g) + 2 * _lg(q) * a + 2 * (q - 1) / q * nbytes * b
                + (q - 1) / q * nbytes * g)
    if name == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * nbytes * b + (p - 1) / p * nbytes * g
    if name == "native":
        na, nb = own
        return na + nbytes * nb
    if name == "shared_memory":
        return _shm_cost(p, nbytes, own)
    raise KeyError(name)


def _shm_cost(p, nbytes, ab):
    """The shared segment (whole all-reduce, or one level's reduce-scatter + all-gather): two
    barriers per chunk (alpha each) and beta per byte of the vector."""
    sa, sb = ab
    return 2 * sa * max(1, -(-int(nbytes) // _shm.slot_bytes_for(p))) + nbytes * sb


def _rs_cost(how, s, nbytes, a, b, g, shm=None):
    """Reduce-scatter plus the matching all-gather of nbytes over s members (shm: the shared-memory
    transport's (alpha per chunk, beta per byte), for how == "shm")."""
    if s <= 1:
        return 0.0
    if how == "shm":
        return _shm_cost(s, nbytes, shm)
    frac = (s - 1) / s * nbytes
    rounds = {"direct": 1, "ring": s - 1, "halving": _lg(s)}[how]
    return 2 * rounds * a + 2 * frac * b + frac * g


def _inner_options(params: Params, lvl: int, s: int) -> list:
    """The reduce-scatters an inner level of s ranks may run. The innermost level is one node: its shared
    segment where it has one (gloo; a node without one runs the direct reduce-scatter in its place,
    _allreduce_algos.shm_reduce_scatter)."""
    return (["shm"] if lvl == 0 and params.inner_shm else []) + ["direct", "ring"] + \
        (["halving"] if s & (s - 1) == 0 else [])


def _outer_options(native_outer: bool) -> list:
    """The all-reduces the outer level may run (native: gloo's/NCCL's own, on the outer sub-group)."""
    return ["recursive_doubling", "halving_doubling", "ring"] + (["native"] if native_outer else [])


def _best_hier(params: Params, sizes, nbytes, native_outer: bool):
    """The cheapest (inner choices, outer choice) for the hierarchical algorithm, and its cost."""
    g = params.gamma
    inner, cost, cur = [], 0.0, float(nbytes)
    for lvl, s in enumerate(sizes[:-1]):
        a, b = params.levels[lvl]
        how = min(_inner_options(params, lvl, s), key=lambda h: _rs_cost(h, s, cur, a, b, g, params.shm))
        inner.append(how)
        cost += _rs_cost(how, s, cur, a, b, g, params.shm)
        cur /= s
    a, b = params.levels[len(sizes) - 1]
    s = sizes[-1]
    outs = _outer_options(native_outer)
    # native on the outer sub-group: gloo's own all-reduce, as measured on that level
    nat = params.level_native[len(sizes) - 1]
    costs = {o: cost + _flat_cost(o, s, cur, a, b, g, nat) for o in outs if o != "native"}
    if native_outer:
        outer_native = (_flat_cost("ring", s, cur, a, b, g) if nat is None
                        else _flat_cost("native", s, cur, a, b, g, nat))
        # pipelined (see _allreduce_algos.hierarchical): with K segments the inner levels overlap the
        # outer all-reduce except for the first segment's way down and the last one's way up
        k = max(1, min(A.MAX_SEGMENTS, int(nbytes) // A.SEGMENT_BYTES)) if len(sizes) > 1 else 1
        costs["native"] = (cost / k + max(outer_native, cost * (k - 1) / k)) if k > 1 else cost + outer_native
    outer = min(costs, key=lambda o: (costs[o] * (0.999 if o == "native" else 1.0)))
    return inner, outer, costs[outer]


def _candidates(params: Params, p: int, sizes, nbytes: int, native_outer: bool, shm: bool = False):
    """{description: (choice dict, predicted seconds)} for every algorithm auto may run (shm: the
    group has the shared-memory transport)."""
    g = params.gamma
    a, b = params.flat
    out = {}
    for name in ("recursive_doubling", "halving_doubling", "ring"):
        out[name] = ({"algorithm": name}, _flat_cost(name, p, nbytes, a, b, g))
    out["native"] = ({"algorithm": "native"}, _flat_cost("native", p, nbytes, a, b, g, params.native))
    if shm:
        out["shared_memory"] = ({"algorithm": "shared_memory"},
                                _flat_cost("shared_memory", p, nbytes, a, b, g, params.shm))
    if len(sizes) > 1:
        inner, outer, cost = _best_hier(params, sizes, nbytes, native_outer)
        out["hierarchical"] = ({"algorithm": "hierarchical", "inner": inner, "outer": outer}, cost)
        if native_outer and outer != "native" and _segments(sizes, nbytes) > 1:
            # the pipelined variant (native outer level) as its own candidate: on slow links it
            # measured better than the model predicts (tune() times it head to head)
            out["hierarchical_pipelined"] = ({"algorithm": "hierarchical", "inner": inner, "outer": "native"},
                                             _hier_cost_with_outer(params, sizes, nbytes, inner, "native"))
    return out


def _segments(sizes, nbytes) -> int:
    return max(1, min(A.MAX_SEGMENTS, int(nbytes) // A.SEGMENT_BYTES)) if len(sizes) > 1 else 1


def _hier_cost_with_outer(params, sizes, nbytes, inner, outer):
    g, cost, cur = params.gamma, 0.0, float(nbytes)
    for lvl, (s, how) in enumerate(zip(sizes[:-1], inner)):
        a, b = params.levels[lvl]
        cost += _rs_cost(how, s, cur, a, b, g, params.shm)
        cur /= s
    a, b = params.levels[len(sizes) - 1]
    nat = params.level_native[len(sizes) - 1]
    if outer != "native":
        return cost + _flat_cost(outer, sizes[-1], cur, a, b, g)
    on = _flat_cost("ring", sizes[-1], cur, a, b, g) if nat is None else _flat_cost("native", sizes[-1], cur, a, b, g, nat)
    k = _segments(sizes, nbytes)
    return (cost / k + max(on, cost * (k - 1) / k)) if k > 1 else cost + on


def _tuned_choice(choice: dict, cands: dict, params: Params, sizes, native_outer: bool) -> dict:
    """The tuned table's choice (an algorithm auto may run here) rebuilt from the fields it may set, each
    checked: the table is read from a cache file, and its dict went to the run as it was (audit: a cached
    "agreed": true skipped the agreement check before gloo's own all-reduce, so ranks that disagreed on
    the size aborted instead of raising). A hierarchical choice that does not fit this topology or group
    becomes the model's."""
    name = choice["algorithm"]
    if name != "hierarchical":
        return cands[name][0]
    inner, outer = choice.get("inner"), choice.get("outer")
    fits = (isinstance(inner, (list, tuple)) and len(inner) == len(sizes) - 1 and outer in _outer_options(native_outer)
            and all(how in _inner_options(params, lvl, s) for lvl, (how, s) in enumerate(zip(inner, sizes))))
    return {"algorithm": "hierarchical", "inner": list(inner), "outer": outer} if fits else cands["hierarchical"][0]


def _choose(params: Params, p: int, sizes, nbytes: int, native_outer: bool, shm: bool = False):
    """(choice, reason) for auto."""
    if p == 1:
        return {"algorithm": "none"}, "a group of one rank: nothing to exchange"
    cands = _candidates(params, p, sizes, nbytes, native_outer, shm)
    if params.table and (params.shm_raced or not shm):
        # The measured best at the nearest tuned size (within a factor of 2) wins over the model.
        lb = math.log2(max(nbytes, 1))
        size, choice = min(params.table, key=lambda t: abs(math.log2(max(t[0], 1)) - lb))
        if abs(math.log2(max(size, 1)) - lb) <= 1.0:
            name = choice.get("algorithm")
            if name in cands:
                return (_tuned_choice(choice, cands, params, sizes, native_outer),
                        f"measured fastest by tune() at {_fmt_bytes(size)} ({params.source})")
    best = min(cands, key=lambda k: cands[k][1])
    # Prefer gloo's own unless ours is predicted clearly (15%) faster: the model is only a model.
    if best != "native" and cands[best][1] > 0.85 * cands["native"][1]:
        return cands["native"][0], (f"model: {best} within 15% of native, so native (safe choice) "
                                    f"({params.source})")
    return cands[best][0], f"lowest predicted time in the alpha-beta-gamma model ({params.source})"


def _fmt_bytes(n):
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.3g} {unit}"
    return f"{int(n)} B"


# ================================================================================================
# Per-group state: topology, communicators, model parameters (agreed on by every rank)
# ================================================================================================
_STATE_LOCK = threading.RLock()
_PARAMS: dict = register({}, _STATE_LOCK)


def _backend_name(group) -> str:
    try:
        return dist.get_backend(group)
    except Exception:  # noqa: BLE001
        return "gloo"


def _cache_key(group, topo: Topology, backend: str) -> dict:
    return {"backend": backend, "world": dist.get_world_size(group), "topology": list(topo.sizes)}


def _cache_device(backend):
    return "cuda" if backend == "nccl" and torch.cuda.is_available() else "cpu"


def _load_params(group, topo: Topology) -> Params:
    """The model parameters for (group, topology): the autotune cache as rank 0 sees it, else defaults,
    broadcast from rank 0 once so every rank decides identically (a collective on first use)."""
    key = (group, topo)
    with _STATE_LOCK:
        if key in _PARAMS:
            return _PARAMS[key]
    backend = _backend_name(group)
    text = None
    if dist.get_rank(group) == 0:
        params = Params.defaults(backend, topo.num_levels)
        try:
            import pykernels.autotune as at

            entry = at.lookup("all_reduce", _cache_key(group, topo, backend), _cache_device(backend),
                              backend="cuda" if backend == "nccl" else "cpu")
            if entry is not None:
                params = Params.from_json(json.dumps(entry["config"]["params"]))
        except Exception:  # noqa: BLE001 - a broken cache must never break the collective
            pass
        text = params.to_json()
    if dist.get_world_size(group) > 1:
        # the level sizes AND the ranks' order: ranks that listed the members of a node in another order
        # met each other's messages (same sizes, same tags) and returned wrong sums without an error
        # (review finding); all raise together, through one more collective on first use: before, only
        # the ranks that disagreed with rank 0 raised and the others waited for the group timeout
        mine = (list(topo.sizes), list(topo.ranks))
        obj = [(text, mine)]
        dist.broadcast_object_list(obj, group_src=0, group=group)
        text, theirs = obj[0]
        agree = torch.tensor([int(theirs == mine)], dtype=torch.int64,
                             device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
        if not int(agree):
            raise ValueError(f"{OPNAME}: the ranks disagree on the topology: rank 0 of the group has level sizes "
                             f"{theirs[0]} and ranks {theirs[1]}, this rank {mine[0]} and {mine[1]}; every rank "
                             f"must pass the same")
    params = Params.from_json(text)
    params.inner_shm = _inner_shm_possible(group)
    with _STATE_LOCK:
        _PARAMS[key] = params
    return params


_TOPOLOGIES: dict = register({}, _STATE_LOCK)  # (group, topology as given) -> its effective Topology, checked against the group


def _topology_for(group, topology) -> Topology:
    """The effective topology of this call (memoized: built and checked ~10-30 us a call otherwise)."""
    # list/tuple sizes keyed with their types: by equality alone [2.0, 2] or [True, 4] would reuse the
    # topology of an earlier [2, 2] or [1, 4] call and skip the checks that refuse them (review finding)
    given = ((type(topology),) + tuple((type(s), s) for s in topology) if isinstance(topology, (list, tuple))
             else topology)
    try:
        key = (group, given)
        hit = _TOPOLOGIES.get(key)
    except TypeError:  # an unhashable argument: the checks below name it
        key, hit = None, None
    if hit is not None:
        return hit
    topo = _topology_for_uncached(group, topology)
    if key is not None:
        with _STATE_LOCK:
            if len(_TOPOLOGIES) > 1024:
                _TOPOLOGIES.clear()
            _TOPOLOGIES[key] = topo
    return topo


def _topology_for_uncached(group, topology) -> Topology:
    if topology is None:
        return Topology.detect(group).effective()
    if not isinstance(topology, Topology):
        if isinstance(topology, (list, tuple)):
            sizes_ok = all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in topology)
            if sizes_ok and math.prod(topology) != dist.get_world_size(group):  # before listing every rank
                raise ValueError(f"{OPNAME}: topology {list(topology)} has {math.prod(topology)} ranks but the "
                                 f"group has {dist.get_world_size(group)} (level sizes must multiply to the "
                                 f"group size)")
            topology = Topology(topology)
        else:
            raise TypeError(f"{OPNAME}: topology must be a collectives.Topology or a list of level sizes, "
                            f"got {type(topology).__name__}")
    p = dist.get_world_size(group)
    if topology.world != p:
        raise ValueError(f"{OPNAME}: topology {topology!r} has {topology.world} ranks but the group has {p} "
                         f"(level sizes must multiply to the group size)")
    return topology.effective()


# ================================================================================================
# Running one all-reduce
# ================================================================================================
def _execute(tensor: torch.Tensor, op: str, group, topo: Topology, choice: dict):
    """The all-reduce itself (the choice already resolved). The caller's tensor is reduced through a
    detached view, as dist.all_reduce does: a leaf that requires grad is fine, and an inference tensor
    is reduced under inference mode."""
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            return _execute(tensor, op, group, topo, choice)
    with torch.no_grad():
        _execute_detached(tensor.detach(), op, group, topo, choice)
    return tensor


def _execute_detached(tensor: torch.Tensor, op: str, group, topo: Topology, choice: dict):
    p = dist.get_world_size(group)
    wdt = _work_dtype(tensor.dtype, op)
    n = tensor.numel()
    # gloo's point-to-point ops take CPU tensors only (its collectives stage CUDA tensors through the
    # host themselves): do the same
    dev = torch.device("cpu") if tensor.device.type != "cpu" and _backend_name(group) == "gloo" else tensor.device
    inplace = tensor.is_contiguous() and wdt == tensor.dtype and dev == tensor.device
    if inplace:
        x = tensor.view(-1)
    else:
        x = torch.empty(n, dtype=wdt, device=dev)
        x.copy_(tensor.reshape(-1))
    if p > 1:
        _run_choice(choice, x, n, op, group, topo, tensor.dtype)
    if op == "avg":
        if x.dtype.is_floating_point:
            x.div_(p)
        else:
            x = torch.div(x, p, rounding_mode="trunc")
    if not inplace or x.data_ptr() != tensor.data_ptr():
        tensor.copy_(x.view(tensor.shape))  # half types: the single rounding
    return tensor


def _plan_call(tensor: torch.Tensor, op: str, group, topo: Topology, algorithm: str) -> dict:
    """Everything that may issue a collective on `group` before the data moves (the topology's
    sub-groups, the tuned parameters' broadcast): run in the caller's thread, in call order, so that an
    async call never races the caller's own collectives on the same group."""
    if dist.get_world_size(group) <= 1:
        return {"algorithm": "none"}
    nbytes = tensor.numel() * _work_dtype(tensor.dtype, op).itemsize
    choice = _resolve(algorithm, group, topo, nbytes)
    if choice.get("algorithm") == "hierarchical":
        levels = topo.comms(group)  # the level sub-groups (new_group is a collective), made once and cached
        if "shm" in choice.get("inner", []):
            _node_shm(levels)
    return choice


def _node_shm(levels: list) -> None:
    """Sets up the shared-memory transport of this rank's innermost-level sub-group (a collective
    among its members, once; every rank sets up its own node's at the same point of the call)."""
    inner = levels[0]
    if inner.size > 1 and inner.native_ok and _backend_name(inner.pg) == "gloo":
        _shm.transport(inner.pg)


def _uses_group_collectives(choice: dict) -> bool:
    """gloo's/NCCL's own collectives (and the agreement check before them) are matched by issue order,
    unlike our tagged point-to-point messages: such a call must be issued from the caller's thread."""
    return choice.get("algorithm") == "native" or choice.get("outer") == "native"


def _resolve(algorithm: str, group, topo: Topology, nbytes: int) -> dict:
    if algorithm in ("recursive_doubling", "halving_doubling", "ring", "native"):
        return {"algorithm": algorithm}
    if algorithm == "shared_memory":
        if _shm.transport(group) is None:
            raise RuntimeError(f"{OPNAME}: algorithm='shared_memory' needs a gloo group whose ranks all run on "
                               f"one host with a shared, writable /dev/shm (and the native extension); this "
                               f"group's do not")
        return {"algorithm": "shared_memory"}
    # also checks that every rank passed the same topology, on the first call with it (per group): a rank
    # that later passes another one alone meets the others' messages under other tags, and the call times out
    # (no wrong sums) rather than raising (review finding; left as is)
    params = _load_params(group, topo)
    p = dist.get_world_size(group)
    native_outer = p == dist.get_world_size() or topo.num_levels == 1
    shm = _has_shm(group, topo)
    key = (algorithm, p, topo.sizes, nbytes, native_outer, shm)
    choice = params.choices.get(key)
    if choice is None:
        if len(params.choices) > 4096:  # many distinct sizes: start over rather than grow without bound
            params.choices.clear()
        choice = params.choices[key] = _resolve_with(params, algorithm, p, topo, nbytes, native_outer, shm)
    return choice


def _has_shm(group, topo: Topology) -> bool:
    """auto may use the shared-memory transport: one node (a topology of one level, as detected for
    ranks on one host) and every rank on one host with /dev/shm shared (checked by _shm.transport,
    None for other backends: a collective on the first call per group, after _load_params has
    checked the topology; a dict lookup after that, on every call)."""
    return topo.num_levels == 1 and _shm.transport(group) is not None


def _inner_shm_possible(group) -> bool:
    """The hierarchical algorithm may run its innermost level through shared memory: gloo, and the
    whole world (only there do the levels get sub-groups of their own, which segments need:
    Topology.comms)."""
    return _backend_name(group) == "gloo" and dist.get_world_size(group) == dist.get_world_size()


def _resolve_with(params: Params, algorithm: str, p: int, topo: Topology, nbytes: int, native_outer: bool,
                  shm: bool = False) -> dict:
    if algorithm == "hierarchical":
        if topo.num_levels == 1:
            # one level: hierarchical is the outermost all-reduce alone; pick it by the model
            _, outer, _ = _best_hier(params, topo.sizes, nbytes, native_outer)
            return {"algorithm": "hierarchical", "inner": [], "outer": outer}
        inner, outer, _ = _best_hier(params, topo.sizes, nbytes, native_outer)
        if native_outer and _segments(topo.sizes, nbytes) > 1:
            # explicit "hierarchical" on a large vector: the pipelined form (gloo's own all-reduce on the
            # outer sub-groups, overlapped with the inner levels), which measured 1.5x over gloo's flat
            # ring on 2 x 2 emulated nodes at 100 Mbit/s where p2p outer levels did not
            outer = "native"
        return {"algorithm": "hierarchical", "inner": inner, "outer": outer}
    choice, _ = _choose(params, p, topo.sizes, nbytes, native_outer, shm)
    return choice


_SCRATCH: dict = register({}, _STATE_LOCK)


def _scratch(group, x: torch.Tensor, p: int) -> torch.Tensor:
    """A receive buffer of x.numel() + p elements (the direct reduce-scatter and recursive halving pack
    p - 1 parts of up to ceil(m / p) elements in it), kept per group and reused (fresh pages cost a
    page fault each: ~10% of a 64 MiB all-reduce). One collective at a time runs per group (see
    _Runner)."""
    key = (group, x.dtype, x.device)
    need = x.numel() + p
    with _STATE_LOCK:
        buf = _SCRATCH.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=x.dtype, device=x.device)
            if x.numel() <= (256 << 20) // max(x.element_size(), 1):
                _SCRATCH[key] = buf
        return buf[:need]


_FLAT_COMMS: dict = register({}, _STATE_LOCK)


def _flat_comm(group) -> A.Comm:
    """The whole group in rank order, made once per group."""
    with _STATE_LOCK:
        comm = _FLAT_COMMS.get(group)
        if comm is None:
            comm = _FLAT_COMMS[group] = A.Comm(group, range(dist.get_world_size(group)), dist.get_rank(group),
                                               native_ok=True)
        return comm


def _check_agreement(group, signature: str, device: torch.device):
    """Raise on every rank unless every rank of `group` passed the same signature."""
    h = int.from_bytes(hashlib.blake2b(signature.encode(), digest_size=7).digest(), "little")  # < 2**56
    # gloo's own all-reduce of 2 elements: measured cheaper than any exchange of ours (2 elements over 4
    # ranks leave most of its ring's chunks empty; p2p messages cost ~2x its CPU on a loaded 2-core
    # machine). max(h) == min(h) == this rank's h on every rank iff all agree, so a mismatch fails
    # on every rank.
    on = device if _backend_name(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([h, -h], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = t.tolist()
    if hi != h or -neg_lo != h:
        raise RuntimeError(f"{OPNAME}: the ranks of the group disagree on numel, dtype or op "
                           f"(this rank: {signature}); every rank must pass the same")


def _run_choice(choice: dict, x: torch.Tensor, n: int, op: str, group, topo: Topology, dtype=None):
    """Runs the chosen algorithm on the working buffer x. `dtype`: the caller's dtype (x's when None),
    which the agreement check and the message tags carry: fp16 vs fp32 (both reduced in fp32) or int32
    vs uint8 under avg (both summed in int64) have one working dtype, and such ranks were not told apart
    (review finding: a uint8 rank got 500 wrapped to 244, no error)."""
    name = choice["algorithm"]
    if name == "none":
        return
    dtype = x.dtype if dtype is None else dtype
    try:
        if (name == "native" or choice.get("outer") == "native") and not choice.get("agreed"):
            # gloo aborts the whole process when a peer's message is longer than expected, so before
            # handing the vector to gloo's/NCCL's own all-reduce every rank checks (16 bytes, same size
            # everywhere) that all agree on numel, dtype and op: a mismatch becomes an error on every
            # rank, never a crash.
            _check_agreement(group, f"{n}|{dtype}|{op}", x.device)
        if name == "native":
            # gloo's/NCCL's own collective on the working buffer (fp32 for half types: rounded once)
            dist.all_reduce(x, op=_BASE_OP[op], group=group)
            return
        if name == "shared_memory":
            _run_shm(group, x, n, op, dtype)
            return
        _run_p2p(name, choice, x, n, op, group, topo, dtype)
    except RuntimeError as exc:  # gloo's own errors (DistBackendError is one) do not name our op
        if str(exc).startswith(OPNAME):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        what = "gloo's own all-reduce" if name == "native" else f"a point-to-point transfer of the {name} all-reduce"
        raise RuntimeError(
            f"{OPNAME}: {what} failed ({type(exc).__name__}: {first}). "
            f"Every rank must pass the same numel, dtype and op (this rank: numel={n}, dtype={dtype}, op={op}); "
            f"a rank that disagrees ends the call this way on every rank, and the group may be unusable "
            f"afterwards") from exc


def _run_shm(group, x: torch.Tensor, n: int, op: str, dtype):
    """Through the group's shared segment (made by _resolve in the caller's thread; cached). The
    segment carries the call's signature, so ranks that disagree fail in step, never mix data."""
    tr = _shm.transport(group)
    sig = f"{n}|{dtype}|{op}"
    if x.dtype in _shm.DTYPES:
        tr.all_reduce(x, n, op, dtype, sig)
    else:  # fp16/bf16 under max/min (reduced in their own type): exact through fp32
        w = x.float()
        tr.all_reduce(w, n, op, dtype, sig)
        x.copy_(w)


def _native_drops_nan(op: str, dtype: torch.dtype) -> bool:
    """gloo's own max/min drops a NaN that a later rank holds, and our algorithms keep it (torch.maximum),
    as the docstring promises: where the model chose gloo's all-reduce for the hierarchical algorithm's
    outer level (chosen per size, not per op), a ring runs it for these (review finding: a NaN lost at
    70,000 floats on 3 ranks)."""
    return op in ("max", "min") and dtype.is_floating_point


def _run_p2p(name: str, choice: dict, x: torch.Tensor, n: int, op: str, group, topo: Topology, dtype):
    """Our algorithms over point-to-point messages whose tags hash the call's signature: ranks that
    disagree never match each other's messages, so they time out instead of mixing data."""
    sig = f"{n}|{dtype}|{op}|{json.dumps(choice, sort_keys=True)}|{topo.sizes}|{topo.ranks}"
    piece = A.piece_elems(n * x.element_size(), x.element_size())
    ctx = A.Ctx(_REDUCE[op], piece, A.Tagger(sig), op, dtype, sig)
    tmp = _scratch(group, x, dist.get_world_size(group))
    if name == "hierarchical":
        levels = topo.comms(group)
        inner = list(choice.get("inner", []))
        outer = choice.get("outer", "ring")
        if outer == "native" and (not levels[-1].native_ok or _native_drops_nan(op, x.dtype)):
            outer = "ring"
        if any(h == "halving" and c.size & (c.size - 1) for h, c in zip(inner, levels)):
            inner = [("ring" if h == "halving" and c.size & (c.size - 1) else h) for h, c in zip(inner, levels)]
        A.hierarchical(levels, x, tmp, n, ctx, inner, outer, native_op=_BASE_OP[op])
        return
    A.FLAT[name](_flat_comm(group), x, tmp, 0, n, ctx)


# ================================================================================================
# Async: one worker thread per group keeps every rank's collectives in call order
# ================================================================================================
class AllReduceWork:
    """Handle of an async all_reduce, as dist.all_reduce's: .wait() (raises what the collective
    raised), .is_completed(), .get_future() (a torch.futures.Future of [tensor], the list torch's own
    Work futures hold, so `fut.value()[0]` code written for dist works unchanged), .result() (the
    tensor)."""

    def __init__(self, fut: Optional[torch.futures.Future], tensor: torch.Tensor):
        # fut None: already done (a call under torch.compile runs synchronously: a Future cannot be
        # made in a traced graph)
        self._fut = fut
        self._tensor = tensor

    def wait(self, timeout=None) -> bool:
        """Blocks until the all-reduce is done and raises what it raised. `timeout` (a timedelta or
        seconds, as dist's Work.wait takes): a RuntimeError when it is not done by then (the all-reduce
        goes on; wait again). It was ignored (review note)."""
        if self._fut is None:
            return True
        if timeout is not None and not self._fut.done():
            secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            deadline = time.monotonic() + secs
            while not self._fut.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{OPNAME}: wait() timed out after {secs:g} s; the all-reduce is still "
                                       f"running (every rank must call it)")
                time.sleep(min(left, 1e-3))
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut is None or self._fut.done()

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            done = torch.futures.Future()
            done.set_result([self._tensor])
            return done
        return self._fut.then(lambda f: [f.value()])

    def result(self) -> torch.Tensor:
        return self._tensor if self._fut is None else self._fut.wait()


class _Runner:
    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.pending = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="collectives.all_reduce", daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            item = self.q.get()
            if item is None:  # close(): the group was destroyed
                return
            self._run(*item)
            # nothing of the call stays referenced while the thread waits: the last call's closure held its
            # group, so a destroyed group outlived release_destroyed and the process aborted at exit (audit)
            del item

    def _run(self, fn, fut):
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(exc)
        finally:
            with self.lock:
                self.pending -= 1

    def submit(self, fn) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self.lock:
            self.pending += 1
        self.q.put((fn, fut))
        return fut

    def busy(self) -> bool:
        with self.lock:
            return self.pending > 0

    def close(self) -> None:
        """Ends the thread once the calls queued so far have run, and waits for that (a few seconds at
        most: the group is destroyed, so what is queued fails fast)."""
        self.q.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5.0)

    def drain(self) -> None:
        """Returns once every call submitted so far has run."""
        if self.busy():
            self.submit(lambda: None).wait()


# order -1: a destroyed group's runner ends before the level sub-groups its queued calls use go
_RUNNERS: dict = register({}, _STATE_LOCK, lambda runner: runner.close(), order=-1)


def _runner(group) -> _Runner:
    with _STATE_LOCK:
        r = _RUNNERS.get(group)
        if r is None:
            r = _RUNNERS[group] = _Runner()
        return r


def all_reduce(tensor, op="sum", group=None, *, topology=None, algorithm="auto", async_op=False):
    """Reduce `tensor` across the ranks of `group` in place (like dist.all_reduce).

    op: "sum", "avg", "max", "min", "prod" or a dist.ReduceOp. algorithm: "auto",
    "recursive_doubling", "halving_doubling", "ring", "hierarchical", "shared_memory" (gloo groups
    whose ranks all run on one host: through one /dev/shm segment) and "native" (dist.all_reduce
    itself). topology: a Topology or a list of level sizes (innermost first); default
    Topology.detect(group). Returns the tensor, or an AllReduceWork with .wait() when async_op=True.
    Every rank must call it with the same numel, dtype, op and algorithm; a rank that disagrees makes
    every rank fail (never a hang, never a wrong result): at once where the call's signature is compared
    first (shared memory, "native", so "auto" on one host), after the process group's timeout with the
    point-to-point algorithms. A process
    outside the group leaves its tensor unchanged (with a warning), as dist.all_reduce does. max/min
    with NaN: our algorithms propagate it (torch.maximum); gloo's own ("native", which auto may run)
    can drop it.
    """
    if torch.compiler.is_compiling():
        return _traced_all_reduce(tensor, op, group, topology, algorithm, async_op)
    return _all_reduce(tensor, op, group, topology, algorithm, async_op, agreed=False)


def _check_call(op, algorithm, async_op) -> str:
    """The checks of all_reduce's op, algorithm and async_op; returns the op's name."""
    op = _parse_op(op)
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"{OPNAME}: algorithm must be one of {', '.join(repr(a) for a in ALGORITHMS)}, "
                         f"got {algorithm!r}")
    if not isinstance(async_op, bool):
        raise TypeError(f"{OPNAME}: async_op must be a bool, got {type(async_op).__name__}")
    return op


def _all_reduce(tensor, op, group, topology, algorithm, async_op, agreed: bool):
    """all_reduce; agreed=True: the caller guarantees that every rank passes the same numel, dtype and
    op (DDP's buckets), so gloo's/NCCL's own all-reduce runs without the agreement check before it."""
    tensor = _check_tensor(tensor)
    op = _check_call(op, algorithm, async_op)
    group = _default_group(group)
    if dist.get_rank(group) < 0:
        # as dist.all_reduce: a process outside the group has nothing to do (its tensor is left as is)
        warnings.warn(f"{OPNAME}: this process (global rank {dist.get_rank()}) is not a member of the group; "
                      f"the tensor is left unchanged, as dist.all_reduce does", stacklevel=3)
        if not async_op:
            return tensor
        fut = torch.futures.Future()
        fut.set_result(tensor)
        return AllReduceWork(fut, tensor)
    needs_topo = algorithm in ("auto", "hierarchical") or topology is not None
    runner = _RUNNERS.get(group)
    # Topology detection, sub-groups and tuned parameters may issue collectives: here, in call order.
    topo = _topology_for(group, topology) if needs_topo else Topology([dist.get_world_size(group)])
    choice = _plan_call(tensor, op, group, topo, algorithm)
    if agreed:
        choice = dict(choice, agreed=True)  # a copy: plans may be shared (the tuned table's entries)

    def job():
        return _execute(tensor, op, group, topo, choice)

    if _uses_group_collectives(choice):
        # gloo's own all-reduce matches collectives by issue order: run it here, after the async calls
        # still in flight (our point-to-point algorithms), so every rank issues it at the same point
        if runner is not None:
            runner.drain()
        job()
        if async_op:
            done = torch.futures.Future()
            done.set_result(tensor)
            return AllReduceWork(done, tensor)
        return tensor
    if async_op:
        return AllReduceWork(_runner(group).submit(job), tensor)
    if runner is not None and runner.busy():
        # earlier async calls are still running: keep the order every rank issued them in
        return runner.submit(job).wait()
    return job()


# ================================================================================================
# Under torch.compile: torch.ops.pykernels.all_reduce_ (see collectives/_traced.py)
# ================================================================================================
@torch.library.custom_op("pykernels::all_reduce_", mutates_args=("tensor",))
def _all_reduce_op(tensor: torch.Tensor, op: str, group: str, algorithm: str, topology: list[int],
                   topology_ranks: list[int]) -> None:
    """collectives.all_reduce as a registered op (in place, synchronous): `group` is the process group's
    name, `topology` its level sizes ([] for none given) and `topology_ranks` their ranks ([]: in order)."""
    topo = Topology(topology, topology_ranks or None) if topology else None
    _all_reduce(tensor, op, _traced.group_of(group), topo, algorithm, False, agreed=False)


@_all_reduce_op.register_fake
@fake_on_one_device(_all_reduce_op)
def _(tensor, op, group, algorithm, topology, topology_ranks):
    return None


def _traced_all_reduce(tensor, op, group, topology, algorithm, async_op):
    """all_reduce while dynamo traces: the argument checks that need no data (here, so they raise where
    eager raises them), then the registered op. async_op=True runs synchronously there and returns a
    completed AllReduceWork."""
    if not isinstance(tensor, torch.Tensor):  # (dynamo hands numpy arrays in as tensors)
        raise TypeError(f"{OPNAME}: tensor must be a torch.Tensor (or a DLPack array), got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(_DTYPE_ERROR.format(tensor.dtype))
    if tensor.numel() > 0 and any(st == 0 and sz > 1 for sz, st in zip(tensor.shape, tensor.stride())):
        # an expanded view: eager refuses it (_check_tensor); traced, functionalization failed on the
        # in-place op without naming it (the fake tensor's strides say as much as eager's overlap check,
        # which takes an empty tensor as not overlapping)
        raise ValueError(_OVERLAP_ERROR)
    op = _check_call(op, algorithm, async_op)
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # a process outside the group: nothing to do, as eager
        return AllReduceWork(None, tensor) if async_op else tensor
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{OPNAME}: torch.distributed is not initialized (call dist.init_process_group first)")
    name = _traced.group_name(OPNAME, group)
    if topology is None:
        sizes, ranks = [], []
    elif isinstance(topology, Topology):
        sizes, ranks = list(topology.sizes), list(topology.ranks)
    elif isinstance(topology, (list, tuple)):
        if not topology:  # ([] is the op's "none given")
            raise ValueError("collectives.Topology: sizes must not be empty")
        for s in topology:  # the op takes ints; sizes and their product are checked where it runs
            if isinstance(s, bool) or not isinstance(s, int):
                raise TypeError(f"collectives.Topology: every level size must be an int, got {s!r}")
        sizes, ranks = list(topology), []
    else:
        raise TypeError(f"{OPNAME}: topology must be a collectives.Topology or a list of level sizes, "
                        f"got {type(topology).__name__}")
    torch.ops.pykernels.all_reduce_(tensor, op, name, algorithm, sizes, ranks)
    return AllReduceWork(None, tensor) if async_op else tensor


# ================================================================================================
# plan(): what auto runs, and why
# ================================================================================================
def plan(numel, dtype=torch.float32, group=None, topology=None, op="sum") -> str:
    """A human-readable account of what all_reduce(algorithm="auto") runs for `numel` elements of
    `dtype` on this group, and the model's predictions for every candidate. Collective on first use
    per group (topology detection and the broadcast of the tuned parameters), like all_reduce."""
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral):  # (NumPy ints too; audit finding)
        raise TypeError(f"collectives.plan: numel must be an int >= 0, got {type(numel).__name__} {numel!r}")
    if numel < 0:
        raise ValueError(f"collectives.plan: numel must be an int >= 0, got {numel!r}")
    numel = int(numel)
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        raise TypeError(f"collectives.plan: dtype must be one of {', '.join(str(d) for d in _DTYPES)}, got {dtype!r}")
    op = _parse_op(op, "collectives.plan")
    group = _default_group(group, "collectives.plan", member=True)
    p = dist.get_world_size(group)
    topo = _topology_for(group, topology)
    wdt = _work_dtype(dtype, op)
    nbytes = numel * torch.empty((), dtype=wdt).element_size()
    lines = [f"all_reduce of {numel} x {dtype} ({_fmt_bytes(nbytes)} on the wire as {wdt}), op={op}, "
             f"{p} rank(s), backend {_backend_name(group)}, topology {topo!r}"
             + (f" [{topo.note}]" if topo.note else "")]
    if p == 1:
        return "\n".join(lines + ["runs: nothing", "why: a group of one rank has nothing to exchange"])
    params = _load_params(group, topo)
    native_outer = p == dist.get_world_size() or topo.num_levels == 1
    shm = _has_shm(group, topo)
    choice, why = _choose(params, p, topo.sizes, nbytes, native_outer, shm)
    if choice.get("outer") == "native" and _native_drops_nan(op, wdt):
        choice, why = {**choice, "outer": "ring"}, why + "; its outer level as a ring: gloo's own max/min drops NaN"
    lines.append(f"runs: {_describe(choice, topo)}")
    lines.append(f"why: {why}")
    lines.append("model (alpha s/round, beta s/byte, gamma s/byte): " + "; ".join(
        f"level {i} (size {s}): alpha={a * 1e6:.1f}us, 1/beta={1 / b / 1e9:.2f} GB/s"
        for i, (s, (a, b)) in enumerate(zip(topo.sizes, params.levels))) +
        f"; flat: alpha={params.flat[0] * 1e6:.1f}us, 1/beta={1 / params.flat[1] / 1e9:.2f} GB/s; "
        f"native: {params.native[0] * 1e6:.1f}us + n/{1 / params.native[1] / 1e9:.2f} GB/s; "
        + "".join(f"native on level {i}: " + ("priced as our ring; " if ln is None else
                  f"{ln[0] * 1e6:.1f}us + n/{1 / ln[1] / 1e9:.2f} GB/s; ")
                  for i, ln in enumerate(params.level_native)) +
        f"1/gamma={1 / params.gamma / 1e9:.2f} GB/s")
    cands = _candidates(params, p, topo.sizes, nbytes, native_outer, shm)
    lines.append("shared-memory transport: " + ("available (every rank on this host)" if shm else
                 "not used (ranks on more than one host or node, no shared /dev/shm, or not gloo)"))
    lines.append("predicted: " + ", ".join(f"{_describe(c, topo)} {t * 1e3:.3f} ms"
                                           for _, (c, t) in sorted(cands.items(), key=lambda kv: kv[1][1])))
    if params.table:
        lines.append("tuned table: " + ", ".join(f"{_fmt_bytes(b)}->{c['algorithm']}" for b, c in params.table))
    return "\n".join(lines)


def _describe(choice: dict, topo: Topology) -> str:
    name = choice["algorithm"]
    if name == "hierarchical":
        inner = ", ".join(f"level {i} (x{s}) {h} reduce-scatter/all-gather"
                          for i, (s, h) in enumerate(zip(topo.sizes, choice.get("inner", []))))
        piped = (" (pipelined: up to 8 segments of >= 1 MiB, each segment's outer all-reduce async while "
                 "the inner levels work on its neighbours)") if choice.get("outer") == "native" and inner else ""
        return f"hierarchical[{inner}{'; ' if inner else ''}outer x{topo.sizes[-1]} {choice.get('outer')}{piped}]"
    if name == "native":
        return "native (dist.all_reduce)"
    if name == "shared_memory":
        return "shared_memory (one /dev/shm segment: copy in, reduce 1/p each, copy out)"
    return name


# ================================================================================================
# tune(): measure alpha/beta per level, gamma, native, and the best algorithm per size (collective)
# ================================================================================================
def _clock(dev: torch.device) -> float:
    """perf_counter once the work queued on dev is done: NCCL's collectives and CUDA's kernels return
    before they finish, so a time taken without the sync would be the launch's."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _sync_max(values, group, dev: torch.device) -> list:
    # on dev: a group made with backend "nccl" has no CPU backend (a CPU tensor raised; review finding)
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _pingpong(comm: A.Comm, nbytes: int, reps: int, dev: torch.device) -> float:
    """Median seconds of one two-way exchange of nbytes with the partner (member XOR 1), with every
    pair of the level exchanging at the same time (so link sharing is part of the measurement)."""
    peer = comm.me ^ 1
    if comm.size == 1 or peer >= comm.size:
        return 0.0
    n = max(1, nbytes // 4)
    x, y = torch.ones(n, device=dev), torch.empty(n, device=dev)
    # pieces as a call of nbytes cuts a whole-vector exchange (recursive doubling's); the ring's transfers
    # of nbytes / p take fewer: the fitted alpha/beta are a model, and tune()'s races decide in the end
    ctx = A.Ctx(_REDUCE["sum"], A.piece_elems(nbytes, 4), A.Tagger(f"tune|{nbytes}"))
    times = []
    for _ in range(reps + 1):
        t0 = _clock(dev)
        A._step(comm, ctx, ctx.tg.next(), [(peer, x, 0, n)], [(peer, y, 0, n)])
        times.append(_clock(dev) - t0)
    return statistics.median(times[1:])


# Ours is kept within 5% of native: "native" as auto runs it carries the agreement check (a 2-element
# gloo all-reduce before the data, and the ranks fall out of step between the two) that dist.all_reduce
# does not, and in steady use it measured 0.88-0.93x of dist.all_reduce at 16-64 MiB where the ring
# measured 1.02-1.05x (4 ranks / 2 cores, 2026-12-02), yet a tuning race of 5-10 repeats put them
# within a few percent of each other either way. A margin the other way (5% for ours) had kept native
# at 4 and 16 MiB, 0.74-0.94x of dist.all_reduce (bench run of 2026-12-02 00:56).
_TUNE_MARGIN = -0.05

# tune() times each candidate as calls back to back after an untimed one (no barrier between), the
# way a training loop calls it and nccl-tests times it. A barrier before each timed call measured the
# barrier: the first collective after one starts with every rank in step, which made gloo's own
# all-reduce of 4 MiB ~1.3x faster than the same call after any other collective (4 ranks / 2 cores:
# 6.2 ms after a barrier, 6.9 ms back to back), so native was picked there and ran 0.78-0.89x of
# gloo's own in steady use, where the ring ran 1.05x (2026-12-02).
_STEADY_CALLS = 2


def _beats_native(mat: torch.Tensor, i: int) -> bool:
    """Row i is at least as fast as row 0 (native), give or take the margin, on the median time AND on
    the median of its per-repeat ratio to native (load that drifts during tuning cancels out of each pair)."""
    med = mat.median(dim=1).values
    rel = (mat[i] / mat[0]).median().item()
    return med[i].item() <= (1 - _TUNE_MARGIN) * med[0].item() and rel <= 1 - _TUNE_MARGIN


def _pick_tuned(names: list, first: torch.Tensor, race) -> int:
    """tune()'s choice at one size: the index into names (names[0] is "native"). first: per-repeat
    times of every candidate (one row each); race(names): a new race of those candidates.
    Every candidate runs a second race and the choice is made on both races' repeats pooled: ours
    replaces gloo's own (native: also what an untuned auto falls back to) only if it is the fastest of
    ours on the pooled median and no more than the margin slower than native there (see _TUNE_MARGIN).
    One lucky race is not enough, and one unlucky one (a neighbour's burst of load) must
    not decide either way. Both races hold every candidate because picking the best of ours from one
    race and confirming it against native alone kept the winner's luck: halving-doubling, ~1.0x of
    gloo in the bench's own rows, was picked at 16 and 64 KiB and measured 0.83-0.93x as auto
    (bench run of 2026-12-01 21:54); a first race that alone missed the margin kept gloo's own at
    1 MiB, 0.80x, where the ring measured 1.13-1.28x."""
    if len(names) < 2:
        return 0
    pooled = torch.cat([first, race(list(names))], dim=1)
    med = pooled.median(dim=1).values
    best = min(range(1, len(names)), key=lambda i: med[i].item())
    return best if _beats_native(pooled, best) else 0


def tune(group=None, topology=None, sizes=None, *, reps: int = 3, verbose: bool = False, store: bool = True) -> Params:
    """Collective: every rank of `group` calls it. Measures alpha/beta of every topology level (all
    pairs exchanging at once), gamma, gloo's own all-reduce, and for each size in `sizes` (bytes of
    float32; default 4 KiB..64 MiB by 4x) the fastest of native and the model's best two or three
    algorithms and the ring (ours only when it is at least as fast as native over two races pooled).
    The max over ranks is kept, so every rank gets the same Params; they go into the autotune cache
    (pykernels.autotune, op "all_reduce") and are used by algorithm="auto" from then on. A cache rank 0
    cannot write is an OSError there, after the parameters are in use in this process."""
    group = _default_group(group, "collectives.all_reduce.tune", member=True)
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"collectives.all_reduce.tune: expected 'reps' to be an int >= 1, got {reps!r}")
    runner = _RUNNERS.get(group)
    if runner is not None:
        # the group's async calls still queued finish first: tune's calls run on this thread, and two
        # threads must never drive one group's shared segment (or interleave its messages) at once
        runner.drain()
    p = dist.get_world_size(group)
    topo = _topology_for(group, topology)
    backend = _backend_name(group)
    sizes = [4 << 10 << (2 * k) for k in range(8)] if sizes is None else [int(s) for s in sizes]
    dev = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    if p == 1:
        return Params.defaults(backend, topo.num_levels)
    import pykernels.autotune as at

    if not at._enabled():
        # PYKERNELS_AUTOTUNE=0 turns tuning off (API.md): nothing measured or stored (it was; review
        # finding), what auto uses now is returned
        warnings.warn("collectives.all_reduce.tune: PYKERNELS_AUTOTUNE=0 turns tuning off; nothing was measured",
                      stacklevel=2)
        return _load_params(group, topo)
    levels = topo.comms(group)
    small, big = 8, 4 << 20
    meas = []
    for comm in levels:
        dist.barrier(group=group)
        ts = _pingpong(comm, small, 20, dev)
        dist.barrier(group=group)
        tb = _pingpong(comm, big, reps, dev)
        meas += [ts, tb]
    # gloo's own all-reduce on each level's sub-groups (all groups of the level at once)
    for comm in levels:
        for nb in (small, big):
            if comm.size > 1 and comm.native_ok:
                t = torch.ones(max(1, nb // 4), device=dev)
                dist.all_reduce(t, group=comm.pg)
                dist.barrier(group=group)
                nt = []
                for _ in range(reps if nb == big else 10):
                    t0 = _clock(dev)
                    dist.all_reduce(t, group=comm.pg)
                    nt.append(_clock(dev) - t0)
                meas.append(statistics.median(nt))
            else:
                dist.barrier(group=group)
                meas.append(0.0)
    # flat: the whole group in its own order (pairs may cross the slowest link)
    flat_comm = A.Comm(group, range(p), dist.get_rank(group), native_ok=True)
    dist.barrier(group=group)
    ts = _pingpong(flat_comm, small, 20, dev)
    dist.barrier(group=group)
    tb = _pingpong(flat_comm, big, reps, dev)
    meas += [ts, tb]
    # gamma: a local reduction of 4 MiB of fp32
    a, b = torch.ones(big // 4, device=dev), torch.ones(big // 4, device=dev)
    gt = []
    for _ in range(5):
        t0 = _clock(dev)
        a.add_(b)
        gt.append(_clock(dev) - t0)
    meas.append(statistics.median(gt[1:]))
    # native at two sizes
    for nb in (4 << 10, big):
        t = torch.ones(nb // 4, device=dev)
        dist.all_reduce(t, group=group)
        dist.barrier(group=group)
        nt = []
        for _ in range(reps):
            t0 = _clock(dev)
            dist.all_reduce(t, group=group)
            nt.append(_clock(dev) - t0)
        meas.append(statistics.median(nt))
    meas = _sync_max(meas, group, dev)

    def ab(ts, tb):
        alpha = max(ts, 1e-7)
        beta = max((tb - ts) / (big - small), 1e-13)
        return alpha, beta

    L = len(levels)
    lv = [ab(meas[2 * i], meas[2 * i + 1]) for i in range(L)]
    lnat = []
    for i, comm in enumerate(levels):
        ts, tb = meas[2 * L + 2 * i], meas[2 * L + 2 * i + 1]
        lnat.append(ab(ts, tb) if comm.size > 1 and comm.native_ok and tb > 0 else None)
    k = 4 * L
    fl = ab(meas[k], meas[k + 1])
    flat = (max(fl[0], max(a for a, _ in lv)), max(fl[1], max(b for _, b in lv)))
    gamma = max(meas[k + 2] / big, 1e-13)
    n_small, n_big = meas[-2], meas[-1]
    nb_beta = max((n_big - n_small) / (big - (4 << 10)), 1e-13)
    native = (max(n_small - (4 << 10) * nb_beta, 1e-7), nb_beta)
    params = Params(lv, flat, native, gamma, source=f"tuned {time.strftime('%Y-%m-%d %H:%M')}", level_native=lnat)
    params.inner_shm = _inner_shm_possible(group)
    if params.inner_shm and len(levels) > 1:
        _node_shm(levels)

    # the measured table: native and the model's best (all of them up to 4 MiB, where a try is cheap:
    # the model's ranking of the flat algorithms was measured wrong on loaded machines, e.g. the ring
    # 1.3x gloo at 256 KiB left out; two above), head to head at each size
    native_outer = p == dist.get_world_size() or topo.num_levels == 1
    shm = _has_shm(group, topo)
    params.shm_raced = shm
    table = []
    for nbytes in sizes:
        cands = _candidates(params, p, topo.sizes, nbytes, native_outer, shm)
        ours = sorted((k for k in cands if k not in ("native", "hierarchical_pipelined", "shared_memory")),
                      key=lambda k: cands[k][1])[:4 if nbytes <= (4 << 20) else 2]
        if "ring" not in ours:
            # the bandwidth-optimal flat algorithm always runs: the model ranked it below hierarchical
            # and halving-doubling at 16 MiB on 4 ranks / 2 cores, where it measured 1.00x of gloo to
            # their 0.47x and 0.92x
            ours.append("ring")
        names = (["native"] + ours + (["shared_memory"] if shm else [])
                 + (["hierarchical_pipelined"] if "hierarchical_pipelined" in cands else []))
        # zeros summed: the values never change, and a sum takes every candidate as chosen (floating max
        # and min run a ring where a candidate's outer level is gloo's own: _native_drops_nan)
        x = torch.zeros(max(1, nbytes // 4), device=dev)
        # small sizes are cheap: more repeats there (the machines these run on are noisy)
        r = max(reps * 5, 15) if nbytes <= (1 << 20) else (max(reps * 3, 9) if nbytes < (16 << 20) else max(reps, 5))

        def race(names):
            """Per-repeat times (every rank's slowest time per call) of each candidate, one row per
            candidate; the order rotates every repeat; the first repeat is a warm-up. A time is that of
            _STEADY_CALLS calls back to back after an untimed one, per call (see _STEADY_CALLS)."""
            times = {k: [] for k in names}
            for rep in range(r + 1):
                for k in names[rep % len(names):] + names[:rep % len(names)]:
                    dist.barrier(group=group)
                    _run_choice(cands[k][0], x, x.numel(), "sum", group, topo)
                    t0 = _clock(dev)
                    for _ in range(_STEADY_CALLS):
                        _run_choice(cands[k][0], x, x.numel(), "sum", group, topo)
                    times[k].append((_clock(dev) - t0) / _STEADY_CALLS)
            mat = torch.tensor([times[k][1:] for k in names], dtype=torch.float64, device=dev)
            if p > 1:
                dist.all_reduce(mat, op=dist.ReduceOp.MAX, group=group)
            return mat.cpu()

        first = race(names)
        best = _pick_tuned(names, first, race)
        med = first.median(dim=1).values.tolist()
        table.append((nbytes, cands[names[best]][0]))
        if verbose and dist.get_rank(group) == 0:
            print(f"tune all_reduce {_fmt_bytes(nbytes)}: " + ", ".join(f"{k} {m * 1e3:.3f} ms" for k, m in zip(names, med))
                  + f" -> {names[best]}", flush=True)
    params.table = table
    with _STATE_LOCK:
        _PARAMS[(group, topo)] = params
    if store:
        # rank 0 stores; its outcome goes to every rank, so all of them return or all raise (the others
        # returned while rank 0 raised; and a failure was only printed before: `generate --ops allreduce`
        # counted the shape and exited 0; review and audit findings)
        error = None
        if dist.get_rank(group) == 0:
            try:
                import pykernels.autotune as at

                at._store(_cache_device(backend), at._entry_key("all_reduce", "cuda" if backend == "nccl" else "cpu",
                                                                _cache_key(group, topo, backend)),
                          {"backend": "cuda" if backend == "nccl" else "cpu",
                           "config": {"params": json.loads(params.to_json())},
                           "time_s": 0.0, "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
            except (OSError, RuntimeError) as exc:  # (RuntimeError: no home directory for the cache)
                error = exc
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=dev)
        dist.broadcast(failed, src=dist.get_global_rank(group, 0), group=group)
        if int(failed.item()):
            # the parameters hold in memory (set above) on every rank
            raise OSError(f"collectives.all_reduce tune: "
                          + (f"{error}" if error is not None else "rank 0 could not write the cache file (its error says why)")
                          + "; the tuned parameters hold in memory for this process only") from error
    return params


# ================================================================================================
# DDP
# ================================================================================================
def ddp_comm_hook(state, bucket) -> torch.futures.Future:
    """For DistributedDataParallel.register_comm_hook(state, collectives.ddp_comm_hook): averages each
    gradient bucket with collectives.all_reduce (async, so it overlaps the rest of backward), as DDP's
    default hook does. state: None (the DDP's default group), a ProcessGroup, or a dict with any of
    "group", "topology", "algorithm". DDP makes every rank's buckets alike (it checks the parameters'
    shapes across ranks and takes rank 0's bucket order), so gloo's own all-reduce runs here without
    the agreement check all_reduce makes before it (one small collective per bucket: ~1 ms on 4 ranks
    of the 2-core dev machine)."""
    group, topology, algorithm = None, None, "auto"
    if isinstance(state, dict):
        group, topology, algorithm = state.get("group"), state.get("topology"), state.get("algorithm", "auto")
    elif state is not None:
        group = state
    work = _all_reduce(bucket.buffer(), "avg", group, topology, algorithm, async_op=True, agreed=True)
    return work._fut  # DDP wants a Future of the bucket's tensor itself (not get_future()'s [tensor])


# ================================================================================================
# The autotuner knows the op (the measurement itself is collective: see tune()).
# ================================================================================================
def _quiet_teardown():
    """Leave together: a barrier first, so no rank tears its gloo pairs down while a peer still
    talks to it (a rare abort at exit otherwise)."""
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a failed run still tears down
        pass
    dist.destroy_process_group()


def _tune_worker(rank, world, init, sizes, out=None):
    from datetime import timedelta

    if out is not None:  # `generate --out FILE` in the parent
        import pykernels.autotune as at

        at._OUT_OVERRIDE = out
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        tune(sizes=sizes, verbose=True, store=True)
    finally:
        _quiet_teardown()


def _tune_local(world: int, sizes=None):
    import tempfile

    import torch.multiprocessing as mp

    try:
        import pykernels.autotune as at

        out = at._OUT_OVERRIDE
    except Exception:  # noqa: BLE001
        out = None
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_tune_worker, args=(world, f"file://{d}/init", sizes, out), nprocs=world,
                           start_method="spawn")
    if out is not None:
        at.clear_memory_cache()


def _register_tunable():
    try:
        import pykernels.autotune as at
    except Exception:  # noqa: BLE001 - collectives works without pykernels' autotuner
        return

    def generate(sizes):
        # tune() needs every rank of a process group at once. Inside an initialized group (torchrun)
        # it measures that group; from the single-process CLI it spawns a local gloo group of
        # COLLECTIVES_TUNE_WORLD ranks (default 4) on loopback and tunes that. Either way the result
        # (one entry: the group's model parameters) is in the cache when this returns; a failure raises
        # (the CLI said "tuned 0 shape(s)" and exited 0 whether it tuned or failed; review finding).
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() < 2:
                raise ValueError("a group of one rank has no all-reduce to tune")
            tune(sizes=sizes, verbose=True)
            return 1
        raw = os.environ.get("COLLECTIVES_TUNE_WORLD", "4")
        try:
            world = int(raw)
        except ValueError:
            world = 0
        if world < 2:
            raise ValueError(f"COLLECTIVES_TUNE_WORLD must be an int >= 2 (the ranks of the local gloo group "
                             f"to tune), got {raw!r}")
        _tune_local(world, sizes)
        return 1

    def check(*args, **kwargs):
        # tune("all_reduce", t) measured nothing and cached an empty entry (review finding)
        raise ValueError("pykernels.autotune.tune: all_reduce is tuned on every rank of a process group at once: "
                         "call collectives.all_reduce.tune(...) on each rank, or run `python -m pykernels.autotune "
                         "generate --ops allreduce` (a local gloo group)")

    at.register(at.Tunable(
        op="all_reduce", backend="cpu", group="allreduce", check=check,
        make_key=lambda *a, **k: {},
        default=lambda key: {"params": None},
        candidates=lambda key: [],
        run=lambda config, *a, **k: None,
        generate=generate,
    ))


_register_tunable()


# `collectives.all_reduce` is this function once the package is imported; let it carry the extras too.
all_reduce.tune = tune
all_reduce.plan = plan
all_reduce.Topology = Topology

# DDP checks the hook's return annotation (a string under `from __future__ import annotations`).
ddp_comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
