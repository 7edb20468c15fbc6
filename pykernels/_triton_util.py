"""Triton helpers shared by the op families' kernels: compiled or interpreted, decided at launch time,
and the combine functions our kernels pass to tl.reduce / tl.associative_scan.

`triton.jit` decides when a function is decorated whether it is compiled or interpreted
(TRITON_INTERPRET=1), and the @jit helpers of triton.language.standard (tl.zeros, tl.sum, tl.min,
tl.cumsum, ...) are decorated when triton is first imported. A process that sets TRITON_INTERPRET=1
after importing triton (a test session, a notebook) would otherwise get kernels that cannot run on CPU
tensors. So our kernels are plain functions wrapped by `kernel()` when launched, and call only Triton
builtins (tl.full, tl.reduce, tl.associative_scan, tl.histogram, ...) with the combine functions below.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction


def interpreting() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launches_on_input_device(launcher):
    """Decorator for a function that launches Triton kernels on the tensors of its first argument's device.

    Triton launches on the CURRENT CUDA device and that device's current stream, and accepts pointers to
    another GPU's memory: with a tensor on cuda:1 while cuda:0 is current, a kernel ran on GPU 0 (an
    illegal address without peer access; with it, unordered against the producers on cuda:1's stream).
    The launcher runs with its input's device current (audit; the native modules do the same in
    pk::GpuScope)."""
    @functools.wraps(launcher)
    def run(first, *args, **kwargs):
        guard = torch.cuda.device(first.device) if first.device.type == "cuda" else contextlib.nullcontext()
        with guard:
            return launcher(first, *args, **kwargs)
    return run


@functools.lru_cache(maxsize=None)
def _wrap(fn, interpret: bool):
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return JITFunction(fn)


def kernel(fn):
    """The launchable Triton kernel for plain function `fn`: interpreted under TRITON_INTERPRET=1, else
    compiled (one wrapper per mode, so compiled kernels keep their cache)."""
    return _wrap(fn, interpreting())


# Combine functions for tl.reduce(x, axis, ADD) (= tl.sum), tl.associative_scan(x, axis, ADD) (= tl.cumsum),
# MAX and MIN: triton.language.standard's own. Passed to the builtins they work in compiled kernels, and the
# interpreter recognizes exactly these objects and reduces/scans with numpy (any other combine function
# runs element by element in Python, orders of magnitude slower).
ADD = tl.standard._sum_combine
MAX = tl.standard._elementwise_max
MIN = tl.standard._elementwise_min
