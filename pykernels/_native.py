"""Loading the native modules and crossing the Python/C++ boundary.

The native modules never see torch: Python passes data pointers, element counts, dtype codes and
stream handles. This file is the only place that knows the module names and the dtype codes
(mirrored in csrc/common/pk_common.h).
"""
from __future__ import annotations

import importlib
import os
import platform
from functools import lru_cache
from typing import Optional

import torch

# Must match pk::DType in csrc/common/pk_common.h.
DTYPE_CODES = {
    torch.bool: 0, torch.uint8: 1, torch.int8: 2, torch.int16: 3, torch.uint16: 4, torch.int32: 5,
    torch.uint32: 6, torch.int64: 7, torch.uint64: 8, torch.float16: 9, torch.bfloat16: 10,
    torch.float32: 11, torch.float64: 12,
}


# Environment switches (PYKERNELS_AUTOTUNE, TRITON_INTERPRET, and PYKERNELS_DISABLE_AVX2 for qmatmul's route
# choice) are read on every op call, so that flipping one within a process takes effect. The native modules
# read the SIMD switches (PYKERNELS_DISABLE_AVX2/AVX512/AMX) once each, at their first use: set those before
# the process starts (an autotune entry keyed under a switch flipped later was timed on the old tier). os.environ.get of an unset name raises and
# catches a KeyError inside (~1 us, several times per call); os.environ keeps its variables in a dict of
# encoded names (kept in step by os.environ[...] = and del, as monkeypatch.setenv uses), read directly.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS: dict = {}


def getenv(name: str) -> Optional[str]:
    """os.environ.get(name), without the exception an unset name costs."""
    if _ENV_DATA is None or not hasattr(os.environ, "encodekey"):
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    value = _ENV_DATA.get(key)
    return None if value is None else os.environ.decodevalue(value)


def env_reader(names: tuple):
    """A function returning the values of `names` at once as os.environ stores them (encoded bytes on
    POSIX, None when unset): for memo keys, which only compare them (~0.2 us for five, against ~0.2 us
    each through getenv, which decodes)."""
    if _ENV_DATA is None or not hasattr(os.environ, "encodekey"):
        return lambda: tuple(os.environ.get(n) for n in names)
    keys = tuple(os.environ.encodekey(n) for n in names)
    get = _ENV_DATA.get
    return lambda: tuple(map(get, keys))


def finite_real(x) -> bool:
    """math.isfinite of a real number, False (not an OverflowError) for an int too large for a float."""
    import math

    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def type_name(x) -> str:
    """The name an error message gives x's type: module-qualified outside the builtins, so numpy's bool
    (named "bool" in numpy 2) does not read as "expected a bool ..., got bool"."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES[dtype]


# Whether this process was forked after `import pykernels`. Each native module notices a fork after it
# was loaded itself (pk_threads.h: its threads then leave torch's OpenMP team, which hangs in such a
# child); one first loaded in the child is told here (a child whose parent had sorted nothing hung in its
# first sort; review finding).
_FORKED = False


def _note_fork():
    global _FORKED
    _FORKED = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_note_fork)


@lru_cache(maxsize=None)
def _load(name: str):
    try:
        mod = importlib.import_module(f"pykernels.{name}")
    except ImportError as exc:  # not built, or built for another platform
        return None, f"pykernels.{name} is not built ({exc})"
    if _FORKED and hasattr(mod, "mark_forked"):
        mod.mark_forked()
    return mod, None


def zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, with a CPU tensor zeroed by our own threads: torch's fill of a large one runs on its
    OpenMP team, which hangs in a child forked after the parent used it (hash tables made or grown there
    hung; review finding)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return zero_(torch.empty(shape, dtype=dtype, device="cpu"))  # (not torch's default device)


def zero_(t: torch.Tensor) -> torch.Tensor:
    """t.zero_() of our own buffers (no autograd bookkeeping), a contiguous CPU one by our own threads (see
    zeros) from torch's parallel grain on (32K elements, whatever their size)."""
    if t.device.type == "cpu" and t.is_contiguous() and t.numel() >= (1 << 15):
        cpu_module("runtime").zero_bytes(t.data_ptr(), t.numel() * t.element_size(), torch.get_num_threads())
    else:
        t.zero_()
    return t


def cpu_module(family: str):
    """The CPU module of an op family (csrc/<family>/*.cpp), or raise RuntimeError saying why not."""
    mod, why = _load(f"_cpu_{family}")
    if mod is None:
        raise RuntimeError(f"pykernels.{family}: the native CPU backend is not available: {why}. "
                           "Run `make build` (or `pip install .`).")
    return mod


IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


@lru_cache(maxsize=None)
def torch_bf16_gemm_native() -> bool:
    """Whether torch's (oneDNN's) bf16 GEMMs multiply bf16 natively on this CPU (AVX512-BF16; every AMX CPU
    has it), whatever our own tier flags say. Without it they convert to fp32 on the way and run far below
    fp32 (Zen 2, AVX2: a bf16 matmul 5.7x, aten's bf16 flash-attention backward 6-13x slower than fp32),
    so qmatmul's dequantize route and flash attention's backward multiply in fp32 there. (False off x86.)"""
    return bool(cpu_module("qgemm").cpu_has_bf16_dot())


def cuda_module(family: str):
    """The CUDA/HIP module of an op family, or raise RuntimeError saying why not."""
    mod, why = _load(f"_cuda_{family}")
    if mod is None:
        raise RuntimeError(f"pykernels.{family}: the native CUDA backend is not available: {why}")
    return mod


def module_status(name: str):
    """(module or None, reason) without raising; used by pykernels.backends()."""
    return _load(name)


def as_tensor(x, op: str, arg: str) -> torch.Tensor:
    """Accepts a dense torch.Tensor or anything speaking DLPack / the array protocol (numpy, cupy)."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_nested:
            raise ValueError(f"pykernels.{op}: expected '{arg}' to be a dense (strided) tensor, got "
                             f"{'a nested tensor' if x.is_nested else f'layout {x.layout}'}")
        # A lazy conj/neg view keeps its memory un-negated and only a bit says otherwise: contiguous()
        # keeps that bit, and the kernels read raw memory through data_ptr(). Resolved here (a no-op
        # without the bit), so every op sees the values the tensor stands for.
        return x.resolve_conj().resolve_neg()
    if torch.compiler.is_compiling():
        # dynamo traces a numpy array as a tensor and skips torch.from_dlpack (every op failed under
        # fullgraph with a numpy input; audit finding): torch.as_tensor it traces
        return torch.as_tensor(x)
    if any(s < 0 for s in getattr(x, "strides", None) or ()):
        # torch.from_dlpack aborts the interpreter on negative strides (torch 2.13): copy those first.
        import numpy as np

        x = np.ascontiguousarray(x)
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError):
            pass  # e.g. a read-only numpy array: fall through to a copy
    try:
        import numpy as np

        if isinstance(x, np.ndarray) or hasattr(x, "__array__"):
            x = np.asarray(x)
            if not x.dtype.isnative:  # big-endian data: torch takes native byte order only
                x = x.astype(x.dtype.newbyteorder("="))
            if any(s % x.itemsize for s in x.strides):
                # a field of a structured array: strides torch cannot express, so a copy (torch's own
                # ValueError did not name the op; review finding)
                x = np.ascontiguousarray(x)
            try:
                return torch.as_tensor(x)
            except (TypeError, ValueError) as exc:  # a dtype torch has no counterpart for (object, str...)
                raise TypeError(f"pykernels.{op}: cannot take '{arg}' ({type(x).__name__} of dtype {x.dtype}): "
                                f"{exc}") from exc
    except ImportError:
        pass
    raise TypeError(f"pykernels.{op}: expected a torch.Tensor (or a DLPack array) for '{arg}', "
                    f"got {type(x).__name__}")


def cuda_stream_handle(device: torch.device) -> int:
    """The raw cudaStream_t of torch's current stream on `device` (0 on CPU)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream
