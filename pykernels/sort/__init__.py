"""Onesweep-style LSD radix sort (issue #3): drop-ins for torch.sort / torch.argsort with stable=True,
plus CUB-style keys-only, key-value and segmented sorts.

    values, indices = pykernels.sort(x, dim=-1, descending=False)      # == torch.sort(x, stable=True)
    idx = pykernels.argsort(x)                                           # == torch.argsort(x, stable=True)
    keys = pykernels.sort_keys(k, begin_bit=0, end_bit=None)             # 1-D keys only: the fastest path
    keys, vals = pykernels.sort_pairs(k, v)                              # payload of any dtype, stable
    keys, vals = pykernels.segmented_sort(k, offsets, v)                 # each k[offsets[i]:offsets[i+1]]

Backends: "cpu" (csrc/sort/sort_cpu.cpp: one histogram read for all digits, then one write-combined
scatter per 8- or 11-bit digit, trivial passes skipped; from 32K keys on two or more threads (256K on
one; below 256K not keys spanning at most 16 bits), 32- and 64-bit keys whose top byte spreads them
are split by the top byte of their span into 256 buckets first (by its top 11 bits into 2048 where the
top byte clusters them; unless one bucket past L2 size would hold more than 1/8 of the keys, all one value), each
then sorted inside the cache:
LSD passes, or for 64-bit keys spanning 2^32 or more a second split and insertion sorts of the small
parts; rows and runs of equal segments of 2-1024 keys: 4-8 rows at a time, one per SIMD lane, through
Batcher's sorting network, csrc/sort/sort_rows_simd.h; along an inner dim, the strided rows where they
lie), "cuda" (csrc/sort/sort.cu: Onesweep proper),
"triton" (pykernels/sort/_triton.py: the same pipeline in Triton). With backend="auto", CPU sort/argsort
and full-width sort_keys of up to TORCH_BELOW (1024 to 5120 by dtype) elements are torch.sort's own (a call's fixed cost
decides there; not unsigned 16/32/64-bit keys). Every op is a
torch.library custom op (torch.ops.pykernels.<name>) with a fake implementation, so torch.compile(fullgraph=True) works.

Key dtypes: bool, uint8, int8, int16, uint16, int32, uint32, int64, uint64, float16, bfloat16, float32,
float64. Floats sort as torch does: NaN after +inf, -0.0 equal to +0.0 (so stable indices match
torch.sort exactly) and the output keys keep their exact input bits.
"""
from __future__ import annotations

import functools
import operator
import os
import warnings
from typing import Optional, Tuple

import torch

from .. import _memory, _native, autotune
from .._backend import (dispatch, eager_direct as _eager, eager_plain, fake_on_one_device, functorch_autograd,
                        select_backend, vmapped_first)
from ..errors import check_dtype, check_ndim, check_same_device

__all__ = ["sort", "argsort", "sort_keys", "sort_pairs", "segmented_sort", "KEY_DTYPES"]

KEY_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
              torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KEY_BITS = {d: (8 if d == torch.bool else torch.empty((), dtype=d).element_size() * 8) for d in KEY_DTYPES}
MAX_CPU_KEYS = (1 << 32) - 1
_DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in KEY_DTYPES}  # the autotune keys' dtype names

# Up to this many elements, sort/argsort/sort_keys of a CPU tensor with backend="auto" call torch.sort
# itself (stable; what these ops are defined to equal): there a call's fixed cost decides. Ours, on the
# lean path (_lean_cpu_rows), is ~16 us (checks, config, two output tensors, the native call) against
# ~7 us for torch.sort of 16 keys. Measured on the 2-core Zen 2 (2026-12-04, one process, best of 5,
# sort / argsort of random keys, torch.sort's time / ours, lean native path): int32 0.41/0.50 at 64,
# 0.53/0.61 at 512, 0.82/0.95 at 1024, 1.45/1.76 at 1536; float32 0.99/1.01 at 1024; bfloat16 and uint8
# 1.17-1.41 at 1024 (and 2.3x at 2000 with every dtype). Not for uint16/32/64, which torch's CPU sort does
# not order reliably. PYKERNELS_SORT_TORCH_BELOW sets it (0: never; the test suite sets 0 so that every
# test runs the native paths, and checks this route on its own). backend="cpu" always runs the native sort.
def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"pykernels.sort: environment variable {name} must be an integer, got {text!r}") from None


# Per dtype where torch.sort stays faster past 1024 (2-core Zen 4, 2026-12-06, 2 threads, best of 7, torch's
# time / ours at 1025 / 1536 / 2048 elements: float64 0.55 / 0.63 / 0.71, 0.88 at 5120 and 1.52 at 6144;
# bool 0.64 / 0.81 / 1.05; float32 0.83 / 0.97 / 1.28; int32 and int64 0.88 / 1.07-1.12; int16 0.92 / 1.19;
# float16 1.07 at 1025; audit finding). PYKERNELS_SORT_TORCH_BELOW, when set, is the cutoff of every dtype.
_TORCH_BELOW_BY_DTYPE = {torch.float64: 5120, torch.bool: 2048, torch.float32: 1536, torch.int64: 1280,
                         torch.int32: 1280}
TORCH_BELOW = _env_int("PYKERNELS_SORT_TORCH_BELOW", -1) if "PYKERNELS_SORT_TORCH_BELOW" in os.environ else None
_TORCH_UNRELIABLE = (torch.uint16, torch.uint32, torch.uint64)


def _torch_below(dtype: torch.dtype) -> int:
    """The cutoff for keys of `dtype` (see TORCH_BELOW)."""
    return TORCH_BELOW if TORCH_BELOW is not None else _TORCH_BELOW_BY_DTYPE.get(dtype, 1024)


def _torch_sorts(x: torch.Tensor, backend: str) -> bool:
    """Whether this eager call is small enough that torch.sort runs it (see TORCH_BELOW). Only contiguous
    input: torch.sort's outputs keep the input's memory order, ours are contiguous, and the layout must
    not change at TORCH_BELOW (a view(-1) of a small transposed input's sort raised; review finding). Not empty ones: torch.sort walks every row of a (2**40, 0) tensor (an
    hour) where ours returns at once (audit finding)."""
    return (0 < x.numel() <= _torch_below(x.dtype) and backend == "auto" and x.device.type == "cpu"
            and x.dtype not in _TORCH_UNRELIABLE and (x.dim() <= 1 or x.is_contiguous()))


@functools.lru_cache(maxsize=None)
def _backends_supported():
    """Backends this op family implements in this build (cpu always; cuda/triton when present). cuda is
    listed also where no CUDA device can run at all: auto never picks it there, and backend='cuda' gets the
    reason (CPU tensors, a CPU-only torch) instead of "not implemented for this op" (audit finding). (The torch
    build is read, not torch.cuda.is_available(), which would start the CUDA driver before a fork.)"""
    out = ["cpu"]
    if _native.module_status("_cuda_sort")[0] is not None or not (torch.version.cuda or torch.version.hip):
        out.append("cuda")
    out.append("triton")
    return tuple(out)


def _threads(config: dict) -> int:
    t = int(config.get("threads", 0) or 0)
    return t if t > 0 else torch.get_num_threads()


def _key(op: str, keys: torch.Tensor, **extra) -> dict:
    return {"dtype": _DTYPE_NAMES[keys.dtype], "n": autotune.bucket(keys.numel()), **extra}


def _bit_range_key(keys: torch.Tensor, begin_bit: int, end_bit: Optional[int]) -> dict:
    """The key's part for a sort of some of the keys' bits: a config tuned on a few digits is not one for
    all of them (review finding: tuned on end_bit=8, its 11-bit single pass ran every full-width sort of
    the shape 3-4.7x slower), so a partial range is its own key; the full range adds nothing."""
    end = keys.element_size() * 8 if end_bit is None else int(end_bit)
    if int(begin_bit) == 0 and end >= keys.element_size() * 8:
        return {}
    return {"bits": f"{int(begin_bit)}-{end}"}


def _default_config(key: dict) -> dict:
    """Heuristic CPU config. digit_bits=0 and wc=-1 leave the digit width and the store kind to the
    engine (csrc/sort/sort_cpu.cpp, radix_sort_typed), which knows the thread count and what the keys
    carry: on one thread while keys + payload fit in 16 MiB, 8-bit digits with plain stores; otherwise
    write-combining lines with 11-bit digits for >= 32-bit keys past 64K keys. Every torch thread, but
    at least 32K keys per thread (waking a pool thread costs more than sorting fewer keys). Measured on
    the 2-core Zen 2 (values + indices, the LSD engine's keys: 1-2 byte keys, integers of a narrow span),
    two threads against one at 64K-200K keys: 1.0-1.05x for uint8 at 64K, 1.3-1.8x for the others and for
    every key at 100K-200K (the 128K grain before kept 200K keys on one thread; an older measurement of
    1.2-7x for one thread at 64K keys was on another machine and engine). At 50K keys a second thread
    gained 1.3x for 2-8 byte keys and lost 2% for 1-byte ones; the autotuner tries 16K and 128K.
    nt=-1: streaming stores where they paid (the LSD engine's write-combining lines; the MSD split's
    only into 2048 buckets: plain stores into 256, see split_scatter). msd_bits=0 leaves the MSD
    split's digit (8 or 11 bits, 32-bit keys) to the engine too: 8 unless a sample shows the top byte
    clusters the keys."""
    return {"digit_bits": 0, "wc": -1, "threads": 0, "nt": -1, "grain": 1 << 15, "msd": -1, "msd_bits": 0}


# ---------------------------------------------------------------------------------------------
# CPU backend
# ---------------------------------------------------------------------------------------------
def _cpu():
    return _native.cpu_module("sort")


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _cpu_too_long(op: str, n: int):
    """The native sorts count in 32 bits: at most MAX_CPU_KEYS keys per row or segment. Refused here, naming
    the op, before any output is allocated (the native refusal named "sort" for argsort, sort_keys and
    segmented_sort; review finding)."""
    if n > MAX_CPU_KEYS:
        raise ValueError(f"pykernels.{op}: the CPU backend sorts at most 2^32 - 1 keys per call, row or segment, "
                         f"got {n}")


def _cpu_sort_1d(keys: torch.Tensor, *, want_keys=True, want_idx=False, payload=None, descending=False,
                 begin_bit=0, end_bit=None, config=None, want_stats=False, out=None, op="sort"):
    """Sorts a contiguous 1-D CPU tensor. Returns (keys or None, int64 indices or None, payload or None,
    stats dict if want_stats else None). out: (keys, indices) contiguous tensors of n elements that
    overlap nothing else, written in place (the caller checked them)."""
    config = config or {}
    n = keys.numel()
    _cpu_too_long(op, n)
    if out is not None:
        out_k, out_i = out
    else:
        out_k = _memory.empty_output(keys.shape, keys.dtype) if want_keys else None
        out_i = _memory.empty_output((n,), torch.int64) if want_idx else None
    out_p = _memory.empty_output(payload.shape, payload.dtype) if payload is not None else None
    stats = _cpu().sort(keys.data_ptr() if n else 0, n, _native.dtype_code(keys.dtype), _ptr(out_k), _ptr(out_i),
                        _ptr(payload), _ptr(out_p), payload.element_size() if payload is not None else 0,
                        bool(descending), int(begin_bit), -1 if end_bit is None else int(end_bit),
                        int(config.get("digit_bits", 0)), _threads(config), int(config.get("nt", -1)),
                        64, int(config.get("grain", 1 << 15)), bool(want_stats), int(config.get("wc", -1)),
                        int(config.get("msd", -1)), int(config.get("msd_bits", 0)), bool(config.get("in_order", True)))
    return out_k, out_i, out_p, stats


def _cpu_segmented(keys: torch.Tensor, offsets: Optional[torch.Tensor], nseg: int, row_len: int, *,
                   want_keys=True, want_idx=False, payload=None, descending=False, config=None, inner=1,
                   op="sort"):
    """inner > 1: rows of row_len keys `inner` elements apart (a dim other than the last of a contiguous
    tensor). Outputs come in the keys' shape."""
    config = config or {}
    _cpu_too_long(op, row_len)
    if offsets is not None and keys.numel() > MAX_CPU_KEYS and offsets.numel() > 1:
        _cpu_too_long(op, int((offsets[1:] - offsets[:-1]).max()))
    out_k = _memory.empty_output(keys.shape, keys.dtype) if want_keys else None
    out_i = _memory.empty_output(keys.shape, torch.int64) if want_idx else None
    out_p = _memory.empty_output(payload.shape, payload.dtype) if payload is not None else None
    if keys.numel():
        _cpu().segmented(keys.data_ptr(), _native.dtype_code(keys.dtype), _ptr(offsets), nseg, row_len, _ptr(out_k),
                         _ptr(out_i), _ptr(payload), _ptr(out_p),
                         payload.element_size() if payload is not None else 0, bool(descending), _threads(config),
                         int(config.get("digit_bits", 0)), int(config.get("nt", -1)), inner)
    return out_k, out_i, out_p


# ---------------------------------------------------------------------------------------------
# Backend-neutral implementations (called by the custom ops)
# ---------------------------------------------------------------------------------------------
def _rows_sort(op: str, x: torch.Tensor, dim: int, descending: bool, backend: str, want_keys: bool, out=None):
    """sort/argsort along `dim`: the dim goes last, rows are sorted (a 2-D tensor sorted along its last dim
    is a segmented sort with equal segments), and the result is moved back. out: the caller's (values,
    indices), already shaped like x, contiguous and overlapping nothing: the CPU sort of a single row
    writes them directly (no fresh pages to fault in, no copy); other paths ignore it."""
    if x.dim() == 0 or x.numel() == 0 or x.shape[dim] == 1:
        # Nothing to sort, but the backend is still validated and resolved as for any other shape, so
        # backend="nvidia" or an unavailable backend is the same error whatever the input's shape.
        select_backend(op, x.device, backend, supported=_backends_supported())
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    if x.numel() == 0:
        return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                torch.empty(x.shape, dtype=torch.int64, device=x.device))
    if x.shape[dim] == 1:  # rows of one element, each its own sorted row: (1M, 1) along dim 1 took 30 ms as
        # 1M one-key segments of the native row sort, torch.sort 11 ms
        return (x.clone(memory_format=torch.contiguous_format),
                torch.zeros(x.shape, dtype=torch.int64, device=x.device))
    last = dim == x.dim() - 1
    if x.device.type == "cpu" and _strided_rows_apply(x, dim):
        strided = _strided_rows_sort(op, x, dim, descending, backend, want_keys)
        if strided is not None:
            return strided
    xt = x if last else x.movedim(dim, -1)
    shape = xt.shape
    n = shape[-1]
    xc = xt.contiguous()
    rows = xc.numel() // n
    flat = xc.view(-1)
    chosen, config = dispatch(op, x.device, backend, _key(op, xc, rows=autotune.bucket(rows)),
                              supported=_backends_supported())
    if chosen == "cpu":
        if rows == 1:
            direct = out is not None and last and want_keys
            vals, idx, _, _ = _cpu_sort_1d(flat, want_keys=want_keys, want_idx=True, descending=descending,
                                           config=config, out=(out[0].view(-1), out[1].view(-1)) if direct else None,
                                           op=op)
            if direct:
                return out
        else:
            vals, idx, _ = _cpu_segmented(flat, None, rows, n, want_keys=want_keys, want_idx=True,
                                          descending=descending, config=config, op=op)
    elif chosen == "cuda":
        from . import _cuda
        vals, idx = _cuda.sort_rows(flat.view(rows, n), descending, want_keys, config=config)
    else:
        from . import _triton
        vals, idx = _triton.sort_rows(flat.view(rows, n), descending, want_keys, op=op)

    def back(t):  # to the caller's layout; skipped when already there (reshapes cost ~5 us a call)
        if t.dim() != len(shape) or t.shape != shape:
            t = _memory.not_a_view(t, shape)  # (in place on it allowed, as on torch.sort's)
        return t if last else t.movedim(-1, dim).contiguous()
    idx = back(idx)
    vals = back(vals) if want_keys else None
    return vals, idx


_KEY_DTYPE_SET = frozenset(KEY_DTYPES)
_CPU = torch.device("cpu")
_CPU_ONLY = ("cpu",)  # what dispatch may choose for CPU tensors here (the lean path's supported list)


def _lean_cpu_rows(op: str, x, dim, descending, stable, backend, want_keys: bool):
    """sort/argsort of the most common call with the few checks it needs: a plain contiguous CPU tensor,
    in eager mode, sorted along its last dim, every argument of the exact type the general path would
    accept (so the checks reduce to type tests). Returns (values or None, indices), or None for any
    other call, which takes the general path (checks with their errors, other dims, layouts, backends,
    autograd, out=). Same results as that path: the same torch.sort route up to TORCH_BELOW, the same
    dispatch (key and config) and native calls above it.
    Why: the general path spent ~30 us of Python around a 1.7 us kernel for 16 keys and ~45 us around
    15 us for 2000 (generic checks, dispatch, torch.Size allocations, reshapes), so below ~2000 keys
    torch.sort was the faster call."""
    if not (type(x) is torch.Tensor and type(dim) is int and type(descending) is bool and x.is_cpu
            and (stable is None or type(stable) is bool) and (backend == "auto" or backend == "cpu")):
        return None
    if not eager_plain(x):  # first: torch.compile must not trace the tests below (is_conj breaks its graph)
        return None
    if x.is_nested:  # strided and "contiguous", but without sizes: the general path's checks refuse it
        return None
    nd = x.dim()
    if (nd == 0 or (dim != -1 and dim != nd - 1) or x.dtype not in _KEY_DTYPE_SET or x.layout != torch.strided
            or not x.is_contiguous() or x.is_conj() or x.is_neg()):  # (is_contiguous raises for sparse CSR)
        return None
    numel = x.numel()
    if numel == 0:
        return None
    if backend == "auto" and numel <= _torch_below(x.dtype) and x.dtype not in _TORCH_UNRELIABLE:
        if want_keys:
            return torch.sort(x, descending=descending, stable=True)
        return None, torch.argsort(x, descending=descending, stable=True)
    x = _canonical_bools(x)
    n = x.shape[-1]
    if n == 1:  # rows of one key (see _rows_sort)
        return (x.clone() if want_keys else None), torch.zeros(x.shape, dtype=torch.int64)
    rows = numel // n
    _, config = dispatch(op, _CPU, backend, _key(op, x, rows=autotune.bucket(rows)), supported=_CPU_ONLY)
    if rows == 1:
        _cpu_too_long(op, n)  # before the outputs are made
        ok = _memory.empty_output(x.shape, x.dtype) if want_keys else None
        oi = _memory.empty_output(x.shape, torch.int64)
        _cpu_sort_1d(x, want_keys=want_keys, want_idx=True, descending=descending, config=config, out=(ok, oi),
                     op=op)
        return ok, oi
    ok, oi, _ = _cpu_segmented(x, None, rows, n, want_keys=want_keys, want_idx=True, descending=descending,
                               config=config, op=op)
    return ok, oi


def _strided_rows_sort(op: str, x: torch.Tensor, dim: int, descending: bool, backend: str, want_keys: bool):
    """A CPU sort along a dim other than the last, of at most ROW_BATCH_MAX keys: the rows are sorted where
    they lie, `inner` elements apart, by the lanes' sorting network (csrc/sort/sort_rows_simd.h), with
    outputs in x's layout. The general path moves the dim last and back (three transposing copies, two
    thirds of the time of a (16, 100000) int64 sort along dim 0). None when another backend is chosen."""
    xc = x.contiguous()
    rows = xc.numel() // xc.shape[dim]
    chosen, config = dispatch(op, x.device, backend, _key(op, xc, rows=autotune.bucket(rows)),
                              supported=_backends_supported())
    if chosen != "cpu":
        return None
    return _cpu_strided_rows(op, xc, dim, descending, want_keys, config)


def _strided_rows_apply(x: torch.Tensor, dim: int) -> bool:
    """Whether a CPU sort/argsort of x along `dim` sorts the rows where they lie (_strided_rows_sort)."""
    return dim != x.dim() - 1 and 2 <= x.shape[dim] <= _cpu().ROW_BATCH_MAX


def _cpu_strided_rows(op: str, xc: torch.Tensor, dim: int, descending: bool, want_keys: bool, config: dict):
    """The CPU kernel call of _strided_rows_sort (and of the autotuner's timed run of the same path)."""
    n = xc.shape[dim]
    inner = xc.numel() // (xc.shape[: dim + 1].numel())
    vals, idx, _ = _cpu_segmented(xc, None, xc.numel() // n, n, want_keys=want_keys, want_idx=True,
                                  descending=descending, config=config, inner=inner, op=op)
    return vals, idx


def _sort_1d_any(op: str, keys: torch.Tensor, values: Optional[torch.Tensor], descending: bool, begin_bit: int,
                 end_bit: Optional[int], backend: str):
    kc = keys.contiguous()
    vc = values.contiguous() if values is not None else None
    chosen, config = dispatch(op, keys.device, backend,
                              _key(op, kc, **({"value_bytes": vc.element_size()} if vc is not None else {}),
                                   **_bit_range_key(kc, begin_bit, end_bit)),
                              supported=_backends_supported())
    if chosen == "cpu":
        k, _, v, _ = _cpu_sort_1d(kc, payload=vc, descending=descending, begin_bit=begin_bit, end_bit=end_bit,
                                  config=config, op=op)
        return k, v
    if chosen == "cuda":
        from . import _cuda
        return _cuda.sort_1d(kc, vc, descending, begin_bit, end_bit, config=config)
    from . import _triton
    return _triton.sort_1d(kc, vc, descending, begin_bit, end_bit, op=op)


# ---------------------------------------------------------------------------------------------
# torch.library registration: pykernels::sort, argsort, sort_keys, sort_pairs, segmented_sort(_pairs)
# ---------------------------------------------------------------------------------------------

def _op_checks(op: str, keys, values=None, *, one_d=False, bits=None, offsets=None, backend="auto"):
    """The checks of the public functions, for the registered ops called directly (torch.ops.pykernels.*):
    they reach the kernels with whatever they are given, and values shorter than the keys were read and
    written past their end (review finding: a segfault). The public functions check before calling.
    Returns the keys to sort (bools as bytes 0/1: _canonical_bools)."""
    check_dtype(op, "keys", keys, KEY_DTYPES)
    if one_d:
        check_ndim(op, "keys", keys, 1)
    if values is not None:
        check_ndim(op, "values", values, 1)
        if values.numel() != keys.numel():
            raise ValueError(f"pykernels.{op}: expected 'values' of length {keys.numel()} (as 'keys'), "
                             f"got {values.numel()}")
        check_same_device(op, keys=keys, values=values)
    if bits is not None:
        _check_bits(op, keys, bits[0], None if bits[1] == -1 else bits[1])  # -1: the op's None
    if offsets is not None:
        check_dtype(op, "offsets", offsets, (torch.int64, torch.int32))
        check_ndim(op, "offsets", offsets, 1)
        if offsets.numel() == 0:
            raise ValueError(f"pykernels.{op}: expected at least one offset (nseg + 1 values), got an empty tensor")
        check_same_device(op, keys=keys, offsets=offsets)
    _check_backend(op, backend)
    return _canonical_bools(keys)

@torch.library.custom_op("pykernels::sort", mutates_args=())
def _sort_op(x: torch.Tensor, dim: int, descending: bool, backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    x = _op_checks("sort", x, backend=backend)
    return _rows_sort("sort", x, _norm_dim("sort", x, dim), descending, backend, True)


@_sort_op.register_fake
@fake_on_one_device(_sort_op)
def _(x, dim, descending, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty(x.shape, dtype=torch.int64, device=x.device)


def _sort_setup_context(ctx, inputs, output):
    x, dim, _, _ = inputs
    ctx.dim = dim
    ctx.save_for_backward(output[1])


def _sort_backward(ctx, grad_values, grad_indices):
    """As torch.sort's derivative: values[..., j, ...] = x[..., indices[j], ...], so each upstream gradient
    goes back to the position its value came from (a permutation: scatter, no accumulation needed).
    Written with differentiable torch ops, so double backward works too."""
    indices, = ctx.saved_tensors
    if grad_values is None:
        return None, None, None, None
    if indices.dim() == 0:
        return grad_values.clone(), None, None, None
    grad_input = torch.zeros(indices.shape, dtype=grad_values.dtype, device=grad_values.device)
    return grad_input.scatter(ctx.dim, indices, grad_values), None, None, None


_sort_op.register_autograd(_sort_backward, setup_context=_sort_setup_context)
_sort_call = functorch_autograd("sort", _sort_setup_context, _sort_backward)


@torch.library.custom_op("pykernels::argsort", mutates_args=())
def _argsort_op(x: torch.Tensor, dim: int, descending: bool, backend: str) -> torch.Tensor:
    x = _op_checks("argsort", x, backend=backend)
    return _rows_sort("argsort", x, _norm_dim("argsort", x, dim), descending, backend, False)[1]


@_argsort_op.register_fake
@fake_on_one_device(_argsort_op)
def _(x, dim, descending, backend):
    return torch.empty(x.shape, dtype=torch.int64, device=x.device)


def _vmapped_rows(op: str, x: torch.Tensor, in_dim: int, dim, n: int):
    """x with its vmapped dim first, and the dim to sort along in it: one sample's dim (checked on a
    sample-shaped meta tensor, as the op checks it) shifted past the vmapped dim. None for samples of one
    element per sample (0-d): nothing to sort."""
    x = vmapped_first(x, in_dim, n)
    d = _norm_dim(op, torch.empty(x.shape[1:], device="meta"), dim)
    return x, (None if x.dim() == 1 else d + 1)


# Batching rules (torch.vmap, and vmap of grad): the vmapped dim becomes one more batch dim of the rows
# sorted, so the batch is one call, not torch's per-sample fallback (one call per sample, and refused for a
# batch of 0). Each sample's rows are sorted along its own dim, as a loop would.
@_sort_op.register_vmap
def _(info, in_dims, x, dim, descending, backend):
    x, d = _vmapped_rows("sort", x, in_dims[0], dim, info.batch_size)
    if d is None:  # 0-d samples: each is its own sorted row
        return (x.clone(), torch.zeros(x.shape, dtype=torch.int64, device=x.device)), (0, 0)
    return _sort_op(x, d, descending, backend), (0, 0)


@_argsort_op.register_vmap
def _(info, in_dims, x, dim, descending, backend):
    x, d = _vmapped_rows("argsort", x, in_dims[0], dim, info.batch_size)
    if d is None:
        return torch.zeros(x.shape, dtype=torch.int64, device=x.device), 0
    return _argsort_op(x, d, descending, backend), 0


@torch.library.custom_op("pykernels::sort_keys", mutates_args=())
def _sort_keys_op(keys: torch.Tensor, descending: bool, begin_bit: int, end_bit: int, backend: str) -> torch.Tensor:
    keys = _op_checks("sort_keys", keys, one_d=True, bits=(begin_bit, end_bit), backend=backend)
    return _sort_1d_any("sort_keys", keys, None, descending, begin_bit, None if end_bit == -1 else end_bit, backend)[0]


@_sort_keys_op.register_fake
@fake_on_one_device(_sort_keys_op)
def _(keys, descending, begin_bit, end_bit, backend):
    return torch.empty_like(keys, memory_format=torch.contiguous_format)


@torch.library.custom_op("pykernels::sort_pairs", mutates_args=())
def _sort_pairs_op(keys: torch.Tensor, values: torch.Tensor, descending: bool, begin_bit: int, end_bit: int,
                   backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    keys = _op_checks("sort_pairs", keys, values, one_d=True, bits=(begin_bit, end_bit), backend=backend)
    return _sort_1d_any("sort_pairs", keys, values, descending, begin_bit, None if end_bit == -1 else end_bit, backend)


@_sort_pairs_op.register_fake
@fake_on_one_device(_sort_pairs_op)
def _(keys, values, descending, begin_bit, end_bit, backend):
    return torch.empty_like(keys, memory_format=torch.contiguous_format), \
        torch.empty_like(values, memory_format=torch.contiguous_format)


def _check_offsets(op: str, offsets: torch.Tensor, n: int):
    """Value checks of 'offsets'. They read the tensor's data, so they run inside the custom op (on real
    tensors), never in the traced public function: torch.compile(fullgraph=True) cannot trace them."""
    if offsets.device.type == "meta":
        raise RuntimeError(f"pykernels.{op}: no backend runs on the meta device (the offsets' values decide "
                           f"the result)")
    if offsets.device.type == "cpu" and offsets.dtype == torch.int64 and offsets.is_contiguous():
        bad = not _cpu().nondecreasing(_ptr(offsets), offsets.numel())  # (one thread: see the native doc)
    else:
        bad = offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any())
    if bad:
        raise ValueError(f"pykernels.{op}: expected non-decreasing 'offsets'")
    # non-decreasing: the ends are the min and max (two reductions fewer: with 125K segments, 1M keys, each
    # took ~0.1 ms alone and up to 8 ms on the loaded 2-core Zen 4, as long as the sort itself)
    lo, hi = int(offsets[0]), int(offsets[-1])
    if lo < 0 or hi > n:
        raise ValueError(f"pykernels.{op}: expected 'offsets' within [0, {n}], got values in [{lo}, {hi}]")


def _segmented_impl(keys, offsets, values, descending, backend):
    _check_offsets("segmented_sort", offsets, keys.numel())
    kc = keys.contiguous()
    vc = values.contiguous() if values is not None else None
    nseg = offsets.numel() - 1
    chosen, config = dispatch("segmented_sort", keys.device, backend,
                              _key("segmented_sort", kc, segments=autotune.bucket(max(nseg, 0))),
                              supported=_backends_supported())
    if nseg <= 0 or kc.numel() == 0:
        return kc.clone(), (vc.clone() if vc is not None else None)
    if chosen == "cpu":
        off = offsets.to(device="cpu", dtype=torch.int64).contiguous()
        k, _, v = _cpu_segmented(kc, off, nseg, 0, payload=vc, descending=descending, config=config,
                                 op="segmented_sort")
    elif chosen == "cuda":
        from . import _cuda
        k, v = _cuda.segmented(kc, offsets, vc, descending, config=config)
    else:
        from . import _triton
        k, v = _triton.segmented(kc, offsets, vc, descending)
    # Keys outside every segment stay where they are (as CUB leaves them; we copy them through).
    first, last = int(offsets[0]), int(offsets[-1])
    if first > 0:
        k[:first] = kc[:first]
        if v is not None:
            v[:first] = vc[:first]
    if last < kc.numel():
        k[last:] = kc[last:]
        if v is not None:
            v[last:] = vc[last:]
    return k, v


@torch.library.custom_op("pykernels::segmented_sort", mutates_args=())
def _segmented_keys_op(keys: torch.Tensor, offsets: torch.Tensor, descending: bool, backend: str) -> torch.Tensor:
    keys = _op_checks("segmented_sort", keys, one_d=True, offsets=offsets, backend=backend)
    return _segmented_impl(keys, offsets, None, descending, backend)[0]


@_segmented_keys_op.register_fake
@fake_on_one_device(_segmented_keys_op)
def _(keys, offsets, descending, backend):
    return torch.empty_like(keys, memory_format=torch.contiguous_format)


@torch.library.custom_op("pykernels::segmented_sort_pairs", mutates_args=())
def _segmented_pairs_op(keys: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, descending: bool,
                        backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    keys = _op_checks("segmented_sort_pairs", keys, values, one_d=True, offsets=offsets, backend=backend)
    return _segmented_impl(keys, offsets, values, descending, backend)


@_segmented_pairs_op.register_fake
@fake_on_one_device(_segmented_pairs_op)
def _(keys, offsets, values, descending, backend):
    return torch.empty_like(keys, memory_format=torch.contiguous_format), \
        torch.empty_like(values, memory_format=torch.contiguous_format)


# Batching rules of the 1-D sorts (torch.vmap): the samples, each of n keys, are the segments of one
# segmented sort of all of them (one call; torch's fallback called the op per sample and refused a batch
# of 0). A sort of some bits only (segmented_sort sorts whole keys) and segments that leave keys out
# (those would fall between two samples' segments and be sorted) run per sample, as a loop would.
def _vmapped_1d(op: str, n: int, in_dims, keys, values=None, offsets=None, bits=None, backend="auto"):
    """keys, values and offsets (in_dims: their vmapped dims, in that order; more are ignored) with the
    vmapped dim first, after the op's checks on one sample's shapes."""
    batched = [vmapped_first(t, d, n) for t, d in zip((keys, values, offsets), in_dims)]
    sample = [None if t is None else torch.empty(t.shape[1:], dtype=t.dtype, device="meta") for t in batched]
    _op_checks(op, sample[0], sample[1], one_d=True, bits=bits, offsets=sample[2], backend=backend)
    return batched


def _per_sample(op, *batched):
    """op over the samples of the batched tensors (dim 0), stacked; a batch of 0: the shapes and dtypes of
    op's outputs for one sample (of zeros, so valid offsets) with a dim of 0 first."""
    outs = [op(*(t[i] for t in batched)) for i in range(batched[0].shape[0])]
    if not outs:
        one = op(*(torch.zeros(t.shape[1:], dtype=t.dtype, device=t.device) for t in batched))
        return tuple(o.new_empty((0, *o.shape)) for o in one) if isinstance(one, tuple) else one.new_empty((0, *one.shape))
    return tuple(torch.stack(o) for o in zip(*outs)) if isinstance(outs[0], tuple) else torch.stack(outs)


def _sample_offsets(keys: torch.Tensor, offsets: Optional[torch.Tensor] = None):
    """The offsets of one segmented sort of every sample of keys [N, n]: each sample's own offsets [N, m + 1]
    (default: one segment, the whole sample) moved to its place; None when a sample's segments leave keys
    out (then the samples must be sorted one by one)."""
    nb, n = keys.shape
    shift = torch.arange(nb, device=keys.device, dtype=torch.int64).unsqueeze(1) * n
    if offsets is None:
        offsets = torch.tensor([[0, n]], device=keys.device).expand(nb, 2)
    elif offsets.shape[0] and bool((offsets[:, 0] != 0).any() or (offsets[:, -1] != n).any()):
        return None
    return torch.cat(((offsets[:, :-1].to(torch.int64) + shift).reshape(-1),
                      torch.tensor([nb * n], device=keys.device)))


def _full_width(keys: torch.Tensor, begin_bit: int, end_bit: int) -> bool:
    return begin_bit == 0 and end_bit in (-1, _KEY_BITS[keys.dtype])


@_sort_keys_op.register_vmap
def _(info, in_dims, keys, descending, begin_bit, end_bit, backend):
    x, _, _ = _vmapped_1d("sort_keys", info.batch_size, in_dims, keys, bits=(begin_bit, end_bit), backend=backend)
    if not _full_width(x, begin_bit, end_bit):
        return _per_sample(lambda k: _sort_keys_op(k, descending, begin_bit, end_bit, backend), x), 0
    return _segmented_keys_op(x.reshape(-1), _sample_offsets(x), descending, backend).view(x.shape), 0


@_sort_pairs_op.register_vmap
def _(info, in_dims, keys, values, descending, begin_bit, end_bit, backend):
    x, v, _ = _vmapped_1d("sort_pairs", info.batch_size, in_dims, keys, values, bits=(begin_bit, end_bit),
                          backend=backend)
    if not _full_width(x, begin_bit, end_bit):
        return _per_sample(lambda k, p: _sort_pairs_op(k, p, descending, begin_bit, end_bit, backend), x, v), (0, 0)
    k, p = _segmented_pairs_op(x.reshape(-1), _sample_offsets(x), v.reshape(-1), descending, backend)
    return (k.view(x.shape), p.view(v.shape)), (0, 0)


def _vmapped_segments(op: str, info, in_dims, keys, offsets, values, backend):
    """keys, offsets, values with the vmapped dim first, and one segmented sort's offsets for all samples
    (None: see _sample_offsets), after the op's checks on one sample."""
    dims = (in_dims[0], in_dims[2] if values is not None else None, in_dims[1])
    x, v, off = _vmapped_1d(op, info.batch_size, dims, keys, values, offsets, backend=backend)
    return x, off, v, _sample_offsets(x, off)


@_segmented_keys_op.register_vmap
def _(info, in_dims, keys, offsets, descending, backend):
    x, off, _, flat = _vmapped_segments("segmented_sort", info, in_dims, keys, offsets, None, backend)
    if flat is None:
        return _per_sample(lambda k, o: _segmented_keys_op(k, o, descending, backend), x, off), 0
    return _segmented_keys_op(x.reshape(-1), flat, descending, backend).view(x.shape), 0


@_segmented_pairs_op.register_vmap
def _(info, in_dims, keys, offsets, values, descending, backend):
    x, off, v, flat = _vmapped_segments("segmented_sort_pairs", info, in_dims, keys, offsets, values, backend)
    if flat is None:
        return _per_sample(lambda k, o, p: _segmented_pairs_op(k, o, p, descending, backend), x, off, v), (0, 0)
    k, p = _segmented_pairs_op(x.reshape(-1), flat, v.reshape(-1), descending, backend)
    return (k.view(x.shape), p.view(v.shape)), (0, 0)


# ---------------------------------------------------------------------------------------------
# Public API (checks here, work in the custom ops)
# ---------------------------------------------------------------------------------------------
def _check_keys(op: str, arg: str, t) -> torch.Tensor:
    t = _native.as_tensor(t, op, arg)
    check_dtype(op, arg, t, KEY_DTYPES)
    return _canonical_bools(t)


def _canonical_bools(t: torch.Tensor) -> torch.Tensor:
    """Bool keys as bytes 0/1. A bool's byte may hold any nonzero value (a uint8 tensor viewed as bool), all
    of them True to torch; the radix codecs sort the raw byte (2 came after 1: equal keys out of input order;
    audit finding). Sorted values then hold 1 where the input held another true byte (equal to it as bools)."""
    if t.dtype != torch.bool or t.numel() == 0 or t.is_meta:
        return t
    return t.view(torch.uint8).ne(0)


def _check_flag(op: str, arg: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"pykernels.{op}: expected a bool for '{arg}', got {_native.type_name(v)}")
    return v


def _norm_dim(op: str, x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
        raise TypeError(f"pykernels.{op}: expected an int for 'dim', got {type(dim).__name__}")
    try:
        dim = operator.index(dim)  # numpy integers too, as torch.sort takes them
    except TypeError:  # (an array of several: numpy's message named no op; audit finding)
        raise TypeError(f"pykernels.{op}: expected an int for 'dim', got {type(dim).__name__} {dim!r:.80}") from None
    nd = max(x.dim(), 1)  # a 0-d tensor takes dim 0 or -1, as in torch
    if not -nd <= dim < nd:
        raise ValueError(f"pykernels.{op}: expected 'dim' in [{-nd}, {nd - 1}] for a tensor of shape "
                         f"{tuple(x.shape)}, got {dim}")
    return dim % nd if x.dim() else 0


def _check_bits(op: str, keys: torch.Tensor, begin_bit, end_bit) -> Tuple[int, int]:
    bits = _KEY_BITS[keys.dtype]
    for name, v in (("begin_bit", begin_bit), ("end_bit", end_bit)):
        if (v is not None or name == "begin_bit") and (isinstance(v, bool) or not hasattr(type(v), "__index__")):
            raise TypeError(f"pykernels.{op}: expected an int for '{name}', got {type(v).__name__}")
    begin_bit = operator.index(begin_bit)  # numpy integers too, as for 'dim'
    end = bits if end_bit is None else operator.index(end_bit)
    if not 0 <= begin_bit <= end <= bits:
        raise ValueError(f"pykernels.{op}: expected 0 <= begin_bit <= end_bit <= {bits} for {keys.dtype} keys, "
                         f"got begin_bit={begin_bit}, end_bit={end_bit}")
    return begin_bit, end


def _check_backend(op: str, backend) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"pykernels.{op}: expected a str for 'backend', got {type(backend).__name__}")
    return backend


def sort(input, dim: int = -1, descending: bool = False, stable: bool = True, *, out=None, backend: str = "auto"):
    """Stable sort along `dim`, a drop-in for ``torch.sort(input, dim, descending, stable=True)``:
    returns ``torch.return_types.sort(values, indices)`` with int64 indices identical to torch's.
    ``stable=False`` is accepted (a stable result is a valid unstable one). ``out=(values, indices)``
    receives the result as in torch."""
    if out is None:
        lean = _lean_cpu_rows("sort", input, dim, descending, stable, backend, True)
        if lean is not None:
            return lean if type(lean) is torch.return_types.sort else torch.return_types.sort(lean)
    x = _check_keys("sort", "input", input)
    d = _norm_dim("sort", x, dim)
    _check_flag("sort", "descending", descending)
    if stable is not None:
        _check_flag("sort", "stable", stable)
    backend = _check_backend("sort", backend)
    if out is not None:
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)):
            raise TypeError("pykernels.sort: expected 'out' to be a (values, indices) pair of tensors")
        ov, oi = out
        if ov.dtype != x.dtype or oi.dtype != torch.int64:
            raise TypeError(f"pykernels.sort: expected 'out' of dtypes ({x.dtype}, torch.int64), "
                            f"got ({ov.dtype}, {oi.dtype})")
        check_same_device("sort", input=x, out_values=ov, out_indices=oi)
        if torch.is_grad_enabled() and (x.requires_grad or ov.requires_grad or oi.requires_grad):
            raise RuntimeError("pykernels.sort: functions with out=... arguments don't support automatic "
                               "differentiation, but one of the arguments requires grad (as torch.sort)")
    if _eager(x, op="sort"):
        if _torch_sorts(x, backend):
            # torch.return_types.sort, as from every other route (torch's out= gives its sort_out type)
            return torch.return_types.sort(torch.sort(x, dim=d, descending=descending, stable=True, out=out))
        direct = None
        if out is not None and _writable_in_place(x, ov, oi):
            direct = (ov, oi)
        values, indices = _rows_sort("sort", x, d, descending, backend, True, out=direct)
        if direct is not None:  # written through their pointers: tell autograd they changed, as copy_ would
            torch.autograd.graph.increment_version(direct)
    else:
        values, indices = _sort_call(x, d, descending, backend)
    if out is not None and values is not ov:
        _resize_output(ov, values.shape).copy_(values)
        _resize_output(oi, indices.shape).copy_(indices)
        values, indices = ov, oi
    return torch.return_types.sort((values, indices))


def _resize_output(t: torch.Tensor, shape) -> torch.Tensor:
    """t resized to shape as torch's out= ops do: silently when empty, else with torch's warning; not at
    all when it has the shape already (a resize_ of a compiled graph's input stopped
    torch.compile(fullgraph=True), and resize_ refuses a tensor that requires grad: review findings)."""
    if tuple(t.shape) == tuple(shape):
        return t
    if t.numel():
        warnings.warn(f"An output with one or more elements was resized since it had shape {list(t.shape)}, which "
                      f"does not match the required output shape {list(shape)}. This behavior is deprecated, and in "
                      f"a future PyTorch release outputs will not be resized unless they have zero elements. You "
                      f"can explicitly reuse an out tensor t by resizing it, inplace, to zero elements with "
                      f"t.resize_(0).", UserWarning, stacklevel=3)
    return t.resize_(shape)


def _bytes_of(t: torch.Tensor) -> tuple:
    """[first, last + 1) byte addresses a strided tensor can touch."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # torch strides are >= 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _writable_in_place(x: torch.Tensor, ov: torch.Tensor, oi: torch.Tensor) -> bool:
    """out= tensors a CPU sort may write directly: no autograd, contiguous once shaped like x, and no byte
    shared with the input or each other (two storages can still overlap: numpy or DLPack views of one
    buffer); else the result is computed aside and copied, as before."""
    if x.device.type != "cpu" or x.requires_grad or ov.requires_grad or oi.requires_grad:
        return False
    if ov.is_neg() or oi.is_neg() or ov.is_conj():
        return False  # a lazily negated (conjugated) view: the kernel's raw writes would come back negated
    if x.dim() == 0 or x.numel() == 0:
        return False
    if (ov.is_inference() or oi.is_inference()) and not torch.is_inference_mode_enabled():
        return False  # the copy path raises torch's own error for this
    for t in (ov, oi):
        if t.numel() == 0:  # empty outs are resized silently, as torch does
            t.resize_(x.shape)
    if ov.shape != x.shape or oi.shape != x.shape or not (ov.is_contiguous() and oi.is_contiguous()):
        return False  # wrong shapes: the copy path resizes them (with torch's warning)
    spans = sorted(_bytes_of(t) for t in (x, ov, oi))
    return all(spans[k][1] <= spans[k + 1][0] for k in range(2))


def argsort(input, dim: int = -1, descending: bool = False, stable: bool = True, *, backend: str = "auto"):
    """Stable argsort, a drop-in for ``torch.argsort(input, dim, descending, stable=True)``."""
    lean = _lean_cpu_rows("argsort", input, dim, descending, stable, backend, False)
    if lean is not None:
        return lean[1]
    x = _check_keys("argsort", "input", input)
    d = _norm_dim("argsort", x, dim)
    _check_flag("argsort", "descending", descending)
    if stable is not None:
        _check_flag("argsort", "stable", stable)
    backend = _check_backend("argsort", backend)
    if _eager(x, op="argsort"):
        if _torch_sorts(x, backend):
            return torch.argsort(x, dim=d, descending=descending, stable=True)
        return _rows_sort("argsort", x, d, descending, backend, False)[1]
    return torch.ops.pykernels.argsort(x, d, descending, backend)


def _check_values(op: str, v: torch.Tensor) -> None:
    """Any payload dtype moves as bytes, except a quantized tensor: its scale and zero point do not travel
    with its bytes (review finding: a quint8 payload came back without a quantizer, and its dequantize()
    hit an internal assert of torch's)."""
    if v.is_quantized:
        raise TypeError(f"pykernels.{op}: expected 'values' of a non-quantized dtype, got a quantized {v.dtype} "
                        f"tensor: pass values.int_repr() and quantize the result again, or gather values with "
                        f"the indices of pykernels.argsort")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _permutation(k: torch.Tensor, descending: bool, b: int, e: int, backend: str) -> torch.Tensor:
    """The stable sorting permutation of 1-D keys (on bits [b, e)). Outputs that need a gradient are the
    inputs gathered by it, which autograd differentiates as torch.sort's values: the keys-only and pairs
    kernels return no permutation for an autograd formula of their own (their outputs required grad and
    failed in backward; review finding)."""
    return sort_pairs(k.detach(), torch.arange(k.numel(), device=k.device), descending=descending,
                      begin_bit=b, end_bit=e, backend=backend)[1]


def sort_keys(keys, *, descending: bool = False, begin_bit: int = 0, end_bit: Optional[int] = None,
              backend: str = "auto") -> torch.Tensor:
    """Sorts 1-D keys alone (no indices: the fastest path). ``begin_bit``/``end_bit`` sort on that bit
    range of the order-preserving transformed key only (like CUB), stably."""
    k = _check_keys("sort_keys", "keys", keys)
    check_ndim("sort_keys", "keys", k, 1)
    _check_flag("sort_keys", "descending", descending)
    b, e = _check_bits("sort_keys", k, begin_bit, end_bit)
    backend = _check_backend("sort_keys", backend)
    if _needs_grad(k):
        return k[_permutation(k, descending, b, e, backend)]
    if _eager(k, op="sort_keys"):
        if b == 0 and e == _KEY_BITS[k.dtype] and _torch_sorts(k, backend):
            return torch.sort(k, descending=descending, stable=True).values
        return _sort_1d_any("sort_keys", k, None, descending, b, e, backend)[0]
    return torch.ops.pykernels.sort_keys(k, descending, b, e, backend)


def sort_pairs(keys, values, *, descending: bool = False, begin_bit: int = 0, end_bit: Optional[int] = None,
               backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorts 1-D keys and moves ``values`` (same length, any dtype) with them, stably."""
    k = _check_keys("sort_pairs", "keys", keys)
    v = _native.as_tensor(values, "sort_pairs", "values")
    check_ndim("sort_pairs", "keys", k, 1)
    check_ndim("sort_pairs", "values", v, 1)
    _check_values("sort_pairs", v)
    if v.numel() != k.numel():
        raise ValueError(f"pykernels.sort_pairs: expected 'values' of length {k.numel()} (as 'keys'), "
                         f"got {v.numel()}")
    check_same_device("sort_pairs", keys=k, values=v)
    _check_flag("sort_pairs", "descending", descending)
    b, e = _check_bits("sort_pairs", k, begin_bit, end_bit)
    backend = _check_backend("sort_pairs", backend)
    if _needs_grad(k, v):
        perm = _permutation(k, descending, b, e, backend)
        return k[perm], v[perm]
    if _eager(k, v, op="sort_pairs"):
        return tuple(_sort_1d_any("sort_pairs", k, v, descending, b, e, backend))
    return tuple(torch.ops.pykernels.sort_pairs(k, v, descending, b, e, backend))


def segmented_sort(keys, offsets, values=None, *, descending: bool = False,
                   backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sorts each ``keys[offsets[i]:offsets[i+1]]`` independently (stably), moving ``values`` along.
    ``offsets``: 1-D integer tensor of non-decreasing positions in [0, len(keys)]. Keys outside every
    segment are copied through. Returns (keys, values), values None when none were given."""
    op = "segmented_sort"
    k = _check_keys(op, "keys", keys)
    check_ndim(op, "keys", k, 1)
    off = _native.as_tensor(offsets, op, "offsets")
    check_dtype(op, "offsets", off, (torch.int32, torch.int64, torch.uint32, torch.int16, torch.uint8, torch.int8,
                                     torch.uint16, torch.uint64))
    check_ndim(op, "offsets", off, 1)
    _check_flag(op, "descending", descending)
    v = None
    if values is not None:
        v = _native.as_tensor(values, op, "values")
        check_ndim(op, "values", v, 1)
        _check_values(op, v)
        if v.numel() != k.numel():
            raise ValueError(f"pykernels.{op}: expected 'values' of length {k.numel()} (as 'keys'), got {v.numel()}")
    check_same_device(op, keys=k, offsets=off, values=v)
    if off.numel() == 0:
        raise ValueError(f"pykernels.{op}: expected at least one offset (nseg + 1 values), got an empty tensor")
    if off.dtype == torch.uint64:  # values >= 2**63 would wrap negative: saturate, so the range check names them
        off64 = off.view(torch.int64)
        huge = off64 < 0
        if (not torch.compiler.is_compiling() and off.device.type != "meta"
                and not torch._C._len_torch_dispatch_stack() and bool(huge.any())):  # (FakeTensorMode: no values)
            # named as given (the saturated value printed as 2**63 - 1; review finding)
            first = int(off64[huge][0]) + (1 << 64)
            raise ValueError(f"pykernels.{op}: expected 'offsets' within [0, {k.numel()}], got {first}")
        off64 = torch.where(huge, torch.iinfo(torch.int64).max, off64)
    else:
        off64 = off.to(torch.int64)  # its values are checked inside the custom op (_check_offsets)
    backend = _check_backend(op, backend)
    if _needs_grad(k, v):  # see _permutation; keys outside every segment keep their place in it
        _, perm = segmented_sort(k.detach(), off64, torch.arange(k.numel(), device=k.device),
                                 descending=descending, backend=backend)
        return k[perm], (v[perm] if v is not None else None)
    if _eager(k, off64, v, op="segmented_sort"):
        return _segmented_impl(k, off64, v, descending, backend)
    if v is None:
        return torch.ops.pykernels.segmented_sort(k, off64, descending, backend), None
    return tuple(torch.ops.pykernels.segmented_sort_pairs(k, off64, v, descending, backend))


from . import _tune  # noqa: E402,F401  (registers the autotune Tunables)
