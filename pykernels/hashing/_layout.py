"""Python side of the table layout (csrc/hash/hash_layout.h): dtype <-> bit conversions, sizes, primes.

The native code only sees key bit patterns of 4 or 8 bytes and value bit patterns of 4 or 8 bytes:
values of 1-2 bytes are widened to 4 here (and narrowed back on the way out), floats travel as their
bits. So a float value of -0.0 or NaN comes back bit-exact.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np
import torch

from ..errors import check_dtype

_CPU = torch.device("cpu")

KEY_DTYPES = (torch.int32, torch.int64, torch.uint32, torch.uint64)
VALUE_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16, torch.bfloat16,
                torch.int32, torch.uint32, torch.float32, torch.int64, torch.uint64, torch.float64,
                torch.complex32, torch.complex64) + tuple(  # values travel as bits: any 1-8 byte dtype
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                "float8_e8m0fnu") if hasattr(torch, n))

# Bit-carrier dtype of a 4- or 8-byte pattern.
_BITS = {4: torch.int32, 8: torch.int64}
# Reserved key patterns inside the slot array (see hash_layout.h), as signed bit patterns.
EMPTY_BITS = -1
TOMB_BITS = -2

DEFAULT_SEED = 0x2545F4914F6CDD1D  # any constant: the layout only needs every user of a table to agree


@functools.lru_cache(maxsize=None)
def _has_inf(d: torch.dtype) -> bool:
    """Whether the floating dtype d represents inf (the float8 formats without it saturate or give NaN)."""
    return math.isinf(float(torch.tensor(math.inf, dtype=d)))


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def as_dtype(op: str, arg: str, d) -> torch.dtype:
    if isinstance(d, str):
        d = getattr(torch, d, None)
    if not isinstance(d, torch.dtype):
        raise TypeError(f"pykernels.{op}: expected a torch.dtype for '{arg}', got {d!r}")
    return d


def key_bytes(key_dtype: torch.dtype) -> int:
    return key_dtype.itemsize


def value_slot_bytes(value_dtype) -> int:
    """Bytes of the value field in a slot: 1-4 byte values use 4, 8-byte values 8, no value 0."""
    if value_dtype is None:
        return 0
    return 8 if value_dtype.itemsize == 8 else 4


def slot_bytes(kb: int, vb: int) -> int:
    if vb == 0:
        return kb
    if kb == 4 and vb == 4:
        return 8
    return 16


def key_bits(t: torch.Tensor) -> torch.Tensor:
    """Contiguous 1-D bit view (int32/int64) of a key tensor (never a copy of the caller's memory
    that we then write to: native code only reads keys)."""
    if t.dim() != 1:  # (a reshape of a 1-D tensor costs ~1.4 us of a ~25 us small lookup)
        t = t.reshape(-1)
    if not t.is_contiguous():
        t = t.contiguous()
    bits = _BITS[t.element_size()]
    return t if t.dtype == bits else t.view(bits)


def shaped_like(out: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A per-key result (1-D, one element per key) in the shape of `keys`: the result itself for 1-D
    keys (a view to the same shape cost ~2.5 us, two of them a tenth of a small lookup)."""
    return out if keys.dim() == 1 else out.view(keys.shape)


def bits_to_keys(bits: torch.Tensor, key_dtype: torch.dtype) -> torch.Tensor:
    return bits.view(key_dtype)


def value_bits(v: torch.Tensor) -> torch.Tensor:
    """Values as 4- or 8-byte bit patterns (1-2 byte values widened)."""
    size = v.dtype.itemsize
    if v.dim() == 1 and v.is_contiguous() and size in (4, 8) and _no_lazy_bits(v):
        bits = _BITS[size]  # the common call: the values themselves, or a view (~0.5 us, not ~3)
        return v if v.dtype == bits else v.view(bits)
    v = v.resolve_conj().resolve_neg().reshape(-1)  # a lazy conj/neg view cannot be reinterpreted as bits
    if not v.is_contiguous():
        v = v.contiguous()
    size = v.element_size()
    if size in (4, 8):
        return v.view(_BITS[size])
    if size == 2:
        return v.view(torch.int16).to(torch.int32)
    return v.view(torch.uint8).to(torch.int32)


def bits_to_values(bits: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
    if bits.dtype == value_dtype:  # int32/int64 values: the bits are the values
        return bits
    size = value_dtype.itemsize
    if size in (4, 8):
        return bits.view(value_dtype)
    if size == 2:
        return bits.to(torch.int16).view(value_dtype)
    return bits.to(torch.uint8).view(value_dtype)


def scalar_bits(op: str, value, value_dtype: torch.dtype) -> int:
    """The slot bit pattern (as an unsigned Python int) of a scalar given in the value dtype.

    The scalar must be representable in the value dtype: torch would wrap 2**70 or -1 into an integer
    dtype, or truncate 3.7 to 3, silently. Integer (and bool) dtypes take integral numbers within
    their range; float dtypes take any real number whose magnitude they can hold (rounding to the
    nearest representable value, as storing a float does; inf and NaN are values too)."""
    if type(value) is int and value == 0:  # find()'s default: +0 and 0.0 are all-zero bits in every dtype
        return 0
    # a default is a constant of the caller's code: its bits are worked out once (~17 us). Floats are
    # keyed by their hex form (-0.0 == 0.0 as dict keys, but their bits differ); NaNs are not kept.
    memo = None
    if type(value) is int:
        memo = (value_dtype, value)
    elif type(value) is float and value == value:
        memo = (value_dtype, value.hex())
    if memo is not None:
        bits = _SCALAR_BITS.get(memo)
        if bits is not None:
            return bits
    bits = _scalar_bits(op, value, value_dtype)
    if memo is not None and len(_SCALAR_BITS) < 1024:
        _SCALAR_BITS[memo] = bits
    return bits


_SCALAR_BITS: dict = {}  # (value dtype, int or float.hex()) -> scalar_bits of plain ints and floats

# Each integer value dtype's range as Python numbers, worked out once here (eagerly): what find() checks a
# default against while torch.compile traces it, where scalar_bits' tensor round trip cannot run.
_INT_RANGE = {d: ((0, 1) if d == torch.bool else (torch.iinfo(d).min, torch.iinfo(d).max))
              for d in VALUE_DTYPES if not (d.is_floating_point or d.is_complex)}


def check_constant_default(op: str, value, value_dtype: torch.dtype):
    """A constant find() default under torch.compile (a Python number) checked as scalar_bits checks it, in plain
    Python (traceable): an integer within an integer dtype's range (integral floats too); any real
    number for a float dtype. Returns it as a Python number. (Under torch.compile the default had been
    filled in unchecked: -1 became 255 in a uint8 table, 7 True in a bool one; audit finding.)"""
    where = f"pykernels.{op}: expected 'default'"
    if isinstance(value, (bool, np.bool_, np.integer)):
        value = int(value)
    elif isinstance(value, np.floating):
        value = float(value)
    if not isinstance(value, (int, float)):
        raise TypeError(f"{where} to be a real number, under torch.compile a Python int or float (dynamo "
                        f"traces numpy scalars and tensors as tensors, whose value cannot be checked), got "
                        f"{type(value).__name__}")
    if value_dtype in _INT_RANGE:
        if isinstance(value, float):  # (comparisons only: dynamo traces no math.isfinite on a float input)
            if value != value or value in (math.inf, -math.inf) or value != int(value):
                raise ValueError(f"{where} to be an integer for the {dtype_name(value_dtype)} values of this "
                                 f"table, got {value!r} (it would be truncated)")
            value = int(value)
        lo, hi = _INT_RANGE[value_dtype]
        if not lo <= value <= hi:
            raise ValueError(f"{where} within the range of {dtype_name(value_dtype)} [{lo}, {hi}], got {value!r}")
        return value
    # (a float default beyond a float dtype's range: inf, as storing it would give; eager refuses it, but
    # a float argument of a compiled function is traced as a tensor, whose value cannot be compared here)
    return value


def _scalar_bits(op: str, value, value_dtype: torch.dtype) -> int:
    where = f"pykernels.{op}: expected 'default'"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where} to be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, (bool, np.bool_)):
        value = int(value)
    if value_dtype.is_complex and isinstance(value, numbers.Complex):
        c = complex(value)
        t = torch.tensor(c, dtype=value_dtype).reshape(1)
        back = complex(t[0])
        if (math.isinf(back.real) and not math.isinf(c.real)) or (math.isinf(back.imag) and not math.isinf(c.imag)):
            raise ValueError(f"{where} within the range of {dtype_name(value_dtype)}, got {value!r}")
        return int(value_bits(t)[0]) & 0xFFFFFFFFFFFFFFFF
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{where} to be a real number (the table holds {dtype_name(value_dtype)} values), got "
                        f"{type(value).__name__} {value!r}")
    if value_dtype.is_floating_point:
        try:
            as_float = float(value)
            t = torch.tensor(as_float, dtype=value_dtype).reshape(1)
            back = float(t[0])
            # beyond the dtype's range: inf where it has one (a value that rounds to its max, as 65519 in
            # float16, is stored as torch stores it); the float8 formats without inf saturate, turn it into
            # NaN, or (e8m0, unsigned) drop the sign instead, so each of those counts too
            overflow = (math.isinf(back) != math.isinf(as_float)
                        or (math.isnan(back) and not math.isnan(as_float))
                        or (not _has_inf(value_dtype) and math.isfinite(as_float) and abs(as_float) > torch.finfo(value_dtype).max)
                        or (back != 0.0 and as_float != 0.0 and (back < 0.0) != (as_float < 0.0)))
        except OverflowError:  # an int beyond float64
            overflow = True
        if overflow:
            raise ValueError(f"{where} within the range of {dtype_name(value_dtype)}, got {value!r}")
    else:
        if isinstance(value, numbers.Integral):
            as_int = int(value)
        elif math.isfinite(value) and float(value).is_integer():
            as_int = int(value)
        else:
            raise ValueError(f"{where} to be an integer for the {dtype_name(value_dtype)} values of this "
                             f"table, got {value!r} (it would be truncated)")
        lo, hi = (0, 1) if value_dtype == torch.bool else (torch.iinfo(value_dtype).min, torch.iinfo(value_dtype).max)
        if not lo <= as_int <= hi:
            raise ValueError(f"{where} within the range of {dtype_name(value_dtype)} [{lo}, {hi}], got {value!r}")
        t = torch.tensor(as_int, dtype=value_dtype).reshape(1)
    b = int(value_bits(t)[0])
    return b & 0xFFFFFFFFFFFFFFFF


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (bases 2..41)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.lru_cache(maxsize=4096)
def next_prime(n: int) -> int:
    """The least prime >= n. Memoized: the Miller-Rabin tests of the candidates took ~7 us of a small
    table's ~30 us constructor, on every table of that size."""
    n = max(2, int(n))
    while not is_prime(n):
        n += 1
    return n


def special_words(nw: int) -> int:
    """Length (int64 words) of a table's `special` tensor: 4 for the reserved key patterns, then the
    overflow filter, one byte per window (hash_layout.h special_words)."""
    return 4 + (nw + 7) // 8


def windows_for(capacity: int, window: int, op: str = "HashMap") -> int:
    """A prime number of windows holding at least `capacity` slots (prime: every double-hashing
    step is coprime with it, so a probe visits every window once)."""
    nw = next_prime(math.ceil(max(1, capacity) / window))
    if nw >= 1 << 32:
        raise ValueError(f"pykernels.{op}: capacity {capacity} is too large (at most {((1 << 32) - 5) * window} slots)")
    return nw


# ---- a pure-Python mirror of the probe sequence (tests and the numba device API use it) ----
M64 = 0xFFFFFFFFFFFFFFFF


def fmix64(k: int) -> int:
    k &= M64
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    k ^= k >> 33
    return k


def probe_start(key_bits_u64: int, seed: int, nw: int):
    """(first window, step, overflow-filter tag bit) of a key, as hash_layout.h probe_start."""
    h = fmix64((key_bits_u64 ^ seed) & M64)
    return ((h >> 32) * nw) >> 32, 1 + (((h & 0xFFFFFFFF) * (nw - 1)) >> 32), 1 << (h & 7)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether tensors on `a` may be used with a table on `b`: the same (type, index), a missing index
    being the current one ("cuda" as the current GPU; tables store theirs resolved, _tables._device)
    and the CPU's only index 0."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        cur = torch.cuda.current_device() if (a.index is None or b.index is None) else 0
        return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)
    return (a.index or 0) == (b.index or 0)


def _no_lazy_bits(t: torch.Tensor) -> bool:
    """Neither a lazy conj nor a lazy neg view (their memory is not their value), in eager code (dynamo
    cannot trace is_conj: compiled calls take the general path, whose resolve_conj/neg it traces)."""
    return not (torch.compiler.is_compiling() or t.is_conj() or t.is_neg())


def check_keys(op: str, keys, key_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if (type(keys) is torch.Tensor and keys.dtype == key_dtype and keys.is_cpu and device == _CPU
            and keys.layout == torch.strided and not keys.is_nested and _no_lazy_bits(keys)):
        return keys  # the common call, as as_tensor and the checks below would pass it (~1 us, not ~6)
    from .._native import as_tensor

    keys = as_tensor(keys, op, "keys")
    check_dtype(op, "keys", keys, (key_dtype,))
    if not same_device(keys.device, device):
        raise RuntimeError(f"pykernels.{op}: expected 'keys' on the table's device {device}, got {keys.device}")
    return keys


def check_values(op: str, values, value_dtype: torch.dtype, keys: torch.Tensor, arg: str = "values") -> torch.Tensor:
    if (type(values) is torch.Tensor and values.dtype == value_dtype and values.is_cpu and keys.is_cpu
            and values.shape == keys.shape and values.layout == torch.strided
            and not values.is_nested and _no_lazy_bits(values)):
        return values  # the common call, as the checks below would pass it
    from .._native import as_tensor

    values = as_tensor(values, op, arg)
    check_dtype(op, arg, values, (value_dtype,))
    if not same_device(values.device, keys.device):
        raise RuntimeError(f"pykernels.{op}: expected '{arg}' on {keys.device} like 'keys', got {values.device}")
    if values.shape != keys.shape:
        raise ValueError(f"pykernels.{op}: expected '{arg}' of the shape of 'keys' {tuple(keys.shape)}, "
                         f"got {tuple(values.shape)}")
    return values
