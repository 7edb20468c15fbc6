"""Quantized GEMMs (issue #5): weight-only W1..W8 x float activations (Marlin-style on GPU, AVX-512 VNNI
or AVX2 integer dot products on CPU) and arbitrary-precision bit-serial bipolar-INT products (act_bits).

    qw = pykernels.quantize(weight, bits=4, group_size=128, scheme="asym")   # weight [N, K] like nn.Linear
    y  = pykernels.qmatmul(x, qw, bias=None, act_bits=None)                   # y = x @ W.T (+ bias)
    layer = pykernels.QuantLinear.from_linear(linear, bits=4, group_size=128)
    model = pykernels.quantize_model(model, bits=4, group_size=128, exclude=["lm_head"])

Formats and layouts: pykernels/quant/_format.py. Kernels: csrc/qgemm/qgemm_cpu.cpp (CPU),
csrc/qgemm/qgemm.cu (CUDA/HIP), pykernels/quant/_triton.py (Triton). The op is registered as torch.ops.pykernels.qmatmul.
"""
from __future__ import annotations

import fnmatch
import numbers
import operator
import warnings
from typing import Iterable, Optional

import numpy as np
import torch
from torch import nn

from .. import autotune
from .._backend import autocast_floats
from .._native import as_tensor
from . import _format as F
from ._ops import qmatmul_op, register_tunables

__all__ = ["quantize", "qmatmul", "QuantizedWeight", "QuantLinear", "quantize_model"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_codes(op: str, packed: torch.Tensor, bits: int) -> None:
    """Every code in `packed` fits in `bits` (an untrusted source: a state dict, an unpickled object)."""
    if packed.numel() and not packed.is_meta:  # (meta: no codes to read; review finding)
        top = int(packed.max()) if F.layout_bits(bits) == 8 else int(torch.maximum(packed & 0x0F, packed >> 4).max())
        if top >= 1 << bits:
            raise ValueError(f"pykernels.{op}: 'packed' holds code {top}, more than bits={bits} allows")


class QuantizedWeight:
    """A weight [N, K] quantized per group of `group_size` inputs, in the packed layouts of the kernels.

    Attributes: bits, group_size, scheme, shape (N, K), scales / offsets float32 [N, G] (w = s*u + m),
    zeros (asym: integer zero points; bipolar: the centre z of W = (s/2) W' + z; sym: None),
    packed (uint8 tile layout), planes (int64 bit planes for act_bits, made at quantize time for the
    bipolar scheme, on first use otherwise), code_sums int32 [N, G].

    Saving: torch.save(qw, f) loads back with torch.load(f) and its default weights_only=True, since
    importing pykernels registers this class with torch.serialization.add_safe_globals (its state is
    tensors, ints, str, torch.Size and torch.dtype, which weights_only already allows). Without
    importing pykernels first, save qw.state_dict() and rebuild with QuantizedWeight.from_state_dict.
    """

    def __init__(self, *, shape, bits: int, group_size: int, scheme: str, packed: torch.Tensor,
                 scales: torch.Tensor, offsets: torch.Tensor, code_sums: torch.Tensor,
                 planes: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32):
        self.shape = torch.Size(shape)
        self.bits, self.group_size, self.scheme = int(bits), int(group_size), str(scheme)
        # every kernel indexes these as dense row-major arrays: a strided tensor (a hand-built weight, a
        # state dict of views) gave wrong products without an error; contiguous() is free otherwise
        self.packed, self.scales, self.offsets, self.code_sums = (
            t.contiguous() if isinstance(t, torch.Tensor) else t for t in (packed, scales, offsets, code_sums))
        self.planes = planes.contiguous() if isinstance(planes, torch.Tensor) else planes
        self.dtype = dtype  # the dtype the weight had (dequantize() default)
        self._check("QuantizedWeight")

    def _check(self, op: str, codes: bool = False) -> None:
        """The parts agree with the metadata, as every kernel assumes (they index the buffers by shape, bits
        and group size alone): a state dict whose shape, bits or buffers did not match segfaulted in
        qmatmul or gave garbage without an error (audit finding). codes=True (an untrusted source: a
        state dict, an unpickled object) also checks every code fits in `bits`."""
        _check_format(op, self.bits, self.group_size, self.scheme)
        if not isinstance(self.shape, (tuple, list)) or len(self.shape) != 2:  # (torch.Size is a tuple)
            raise ValueError(f"pykernels.{op}: expected 'shape' (N, K), got {self.shape!r}")
        N, K = self.shape
        _, G = F.group_geometry(K, self.group_size)
        N4, Kp = F.round_up(max(N, 1), F.ROW_TILE), F.round_up(max(K, 1), F.K_BLOCK)
        want = {"packed": (torch.uint8, (N4 * Kp // (2 if F.layout_bits(self.bits) == 4 else 1),)),
                "scales": (torch.float32, (N, G)), "offsets": (torch.float32, (N, G)),
                "code_sums": (torch.int32, (N, G))}
        if self.planes is not None:
            want["planes"] = (torch.int64, (N4 * G * self.bits * F.plane_geometry(K, self.group_size)[2],))
        for name, (dt, shape) in want.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"pykernels.{op}: expected a tensor '{name}', got {type(t).__name__}")
            if t.dtype != dt or tuple(t.shape) != shape:
                raise ValueError(f"pykernels.{op}: '{name}' does not match shape={tuple(self.shape)}, "
                                 f"bits={self.bits}, group_size={self.group_size}: expected "
                                 f"{str(dt).replace('torch.', '')} {list(shape)}, got "
                                 f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}")
            if t.device != self.packed.device:
                raise ValueError(f"pykernels.{op}: '{name}' is on {t.device}, 'packed' on {self.packed.device}")
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"pykernels.{op}: expected a floating-point 'dtype', got {self.dtype!r}")
        if codes:
            _check_codes(op, self.packed, self.bits)

    def __setstate__(self, state):
        """torch.load / pickle: the same checks as a state dict (the file may not be what it claims)."""
        self.__dict__.update(state)
        self._check("QuantizedWeight (loaded)", codes=True)

    # -- introspection ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def zeros(self) -> Optional[torch.Tensor]:
        if self.scheme == "asym":
            # a constant (all-zero) group has s = 0 and m = 0: zero point 0
            safe = torch.where(self.scales > 0, self.scales, torch.ones_like(self.scales))
            return torch.round(-self.offsets / safe).to(torch.int32)
        if self.scheme == "bipolar":
            return self.offsets + self.scales * (((1 << self.bits) - 1) / 2)
        return None

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV reads: packed codes + scales + offsets."""
        return self.packed.numel() + self.scales.numel() * 4 + self.offsets.numel() * 4

    def __repr__(self):
        return (f"QuantizedWeight(shape={tuple(self.shape)}, bits={self.bits}, group_size={self.group_size}, "
                f"scheme={self.scheme!r}, device={self.device})")

    def codes(self) -> torch.Tensor:
        """The unsigned codes u, uint8 [N, K]."""
        N, K = self.shape
        return F.unpack_tiles(self.packed, self.bits, N, K)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The weight the kernels multiply by: scales * codes + offsets, [N, K]."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"pykernels.QuantizedWeight.dequantize: expected a floating-point dtype, got {dtype}")
        return F.dequantize_codes(self.codes(), self.scales, self.offsets, self.group_size,
                                  dtype or self.dtype)

    def ensure_planes(self) -> torch.Tensor:
        if self.planes is None:
            self.planes = F.pack_planes(self.codes(), self.bits, self.group_size)
        return self.planes

    def to(self, *args, **kwargs) -> "QuantizedWeight":
        """Moves every tensor to a device (dtype arguments only change dequantize()'s default dtype);
        copy=True copies the tensors even where they are already there (Tensor.to's copy)."""
        copy = kwargs.pop("copy", False)  # Tensor.to's keyword, which _parse_to does not take
        if not isinstance(copy, bool):
            raise TypeError(f"pykernels.QuantizedWeight.to: expected 'copy' to be a bool, got {type(copy).__name__}")
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("pykernels.QuantizedWeight.to: no CUDA device (this torch sees none)")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"pykernels.QuantizedWeight.to: expected a floating-point dtype (what dequantize() "
                            f"returns), got {str(dtype).replace('torch.', '')}")
        if device is not None or copy:
            mv = lambda t: t if t is None else t.to(device if device is not None else t.device, copy=copy)  # noqa: E731
        else:
            mv = lambda t: t  # noqa: E731
        return QuantizedWeight(shape=self.shape, bits=self.bits, group_size=self.group_size, scheme=self.scheme,
                               packed=mv(self.packed), scales=mv(self.scales), offsets=mv(self.offsets),
                               code_sums=mv(self.code_sums), planes=mv(self.planes),
                               dtype=dtype if dtype is not None else self.dtype)

    def cpu(self):
        return self.to("cpu")

    def cuda(self, device=None):
        return self.to(device or "cuda")

    # -- serialization ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Tensors and plain values only (loads with torch.load(weights_only=True))."""
        sd = {"packed": self.packed, "scales": self.scales, "offsets": self.offsets, "code_sums": self.code_sums,
              "shape": list(self.shape), "bits": self.bits, "group_size": self.group_size, "scheme": self.scheme,
              "dtype": str(self.dtype).replace("torch.", "")}
        if self.planes is not None:
            sd["planes"] = self.planes
        return sd

    @classmethod
    def from_state_dict(cls, sd: dict) -> "QuantizedWeight":
        op = "QuantizedWeight.from_state_dict"
        if not isinstance(sd, dict):
            raise TypeError(f"pykernels.{op}: expected a dict (QuantizedWeight.state_dict()), got {type(sd).__name__}")
        missing = [k for k in ("shape", "bits", "group_size", "scheme", "packed", "scales", "offsets", "code_sums")
                   if k not in sd]
        if missing:
            raise ValueError(f"pykernels.{op}: the state dict lacks {', '.join(missing)}")
        # the metadata checked before the constructor's int()/torch.Size(): bits 4.9 became 4, group_size
        # 32.7 became 32, and shape None or bits inf raised unrelated errors (audit finding)
        for name in ("bits", "group_size"):
            if not isinstance(_int_arg(sd[name]), int) or isinstance(sd[name], (bool, np.bool_)):
                raise TypeError(f"pykernels.{op}: expected an int '{name}', got {type(sd[name]).__name__} {sd[name]!r}")
        shape = sd["shape"]
        if isinstance(shape, (torch.Tensor, np.ndarray)) and shape.ndim == 1:  # (tensor-only checkpoint formats)
            shape = shape.tolist()
        if (not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2
                or not all(isinstance(_int_arg(n), int) and not isinstance(n, bool) and _int_arg(n) >= 0 for n in shape)):
            raise ValueError(f"pykernels.{op}: expected 'shape' (N, K) of two ints >= 0, got {shape!r}")
        dtype = getattr(torch, str(sd.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"pykernels.{op}: expected a floating-point 'dtype' name, got {sd.get('dtype')!r}")
        qw = cls(shape=shape, bits=sd["bits"], group_size=sd["group_size"], scheme=sd["scheme"],
                 packed=sd["packed"], scales=sd["scales"], offsets=sd["offsets"], code_sums=sd["code_sums"],
                 planes=sd.get("planes"), dtype=dtype)
        qw._check(op, codes=True)
        return qw

    load_state_dict = from_state_dict


# torch.load's weights_only unpickler (the default since torch 2.6) rebuilds only allow-listed classes.
torch.serialization.add_safe_globals([QuantizedWeight])


_MAX_LONE_GROUP = 4096  # a group_size above K is fine up to this (one shorter group per row)


def _int_arg(value):
    """An integer argument as a Python int: NumPy integers too, as the rest of the library takes them (they
    were refused with "expected bits in (2, 3, 4, 8) ..., got np.int64(4)"; review finding). Anything
    else (bools included) comes back as it is, for the check that follows to refuse."""
    if isinstance(value, (bool, np.bool_)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _check_format(op: str, bits, group_size, scheme):
    """Checks bits, group_size and scheme; returns (bits, group_size) as Python ints."""
    bits, group_size = _int_arg(bits), _int_arg(group_size)
    if scheme not in F.SCHEMES:
        raise ValueError(f"pykernels.{op}: expected scheme 'asym', 'sym' or 'bipolar', got {scheme!r}")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in F.allowed_bits(scheme):
        raise ValueError(f"pykernels.{op}: expected bits in {F.allowed_bits(scheme)} for scheme {scheme!r}, "
                         f"got {bits!r}")
    if not F.valid_group_size(group_size):
        raise ValueError(f"pykernels.{op}: expected group_size -1 or a positive multiple of 32 "
                         f"(32, 64, 128, ...), got {group_size!r}")
    return bits, group_size


def quantize(weight, bits: int = 4, group_size: int = 128, scheme: str = "asym") -> QuantizedWeight:
    """Round-to-nearest quantization of `weight` [N, K] (nn.Linear layout), per output row and group of
    `group_size` inputs (-1: one group per row; a last partial group is allowed); "bipolar" fits each
    group's scale and offset for least squared error first. See _format.py for the formulas of each
    scheme. The packed layouts the kernels read are made here, once."""
    w = as_tensor(weight, "quantize", "weight")
    bits, group_size = _check_format("quantize", bits, group_size, scheme)
    _check_weight(w, group_size)
    return _quantize(w, bits, group_size, scheme, with_planes=scheme == "bipolar")


_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_weight(w: torch.Tensor, group_size: int = -1) -> None:
    if w.dtype not in _WEIGHT_DTYPES:  # (float8 reached torch.isfinite's NotImplementedError; audit finding)
        raise TypeError(f"pykernels.quantize: expected a 'weight' of dtype float32, float16, bfloat16 or "
                        f"float64, got {str(w.dtype).replace('torch.', '')}")
    if w.dim() != 2:
        raise ValueError(f"pykernels.quantize: expected 'weight' of shape [N, K] (2 dimensions), got {tuple(w.shape)}")
    if w.device.type == "meta":
        raise ValueError("pykernels.quantize: expected a 'weight' with data, got a tensor on the meta device "
                         "(materialize the model first, e.g. with to_empty() and its checkpoint)")
    if group_size > max(w.shape[1], _MAX_LONE_GROUP):
        # the layouts pad every group to group_size: one group far longer than K would be mostly padding
        raise ValueError(f"pykernels.quantize: expected group_size at most the weight's K={w.shape[1]} (or "
                         f"{_MAX_LONE_GROUP}), got {group_size}; use -1 for one group per row")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("pykernels.quantize: 'weight' contains NaN or infinity")


def _quantize(w: torch.Tensor, bits: int, group_size: int, scheme: str, with_planes: bool) -> QuantizedWeight:
    """quantize() after its checks; `with_planes` also packs the bit planes only act_bits reads
    (QuantLinear without act_bits skips them: they are half again the packed codes' memory)."""
    codes, scales, offsets = F.quantize_codes(w, bits, group_size, scheme)
    if not (bool(torch.isfinite(scales).all()) and bool(torch.isfinite(offsets).all())):
        raise ValueError("pykernels.quantize: 'weight' has values too large for float32 scales and offsets "
                         f"(max |w| = {float(w.abs().max()):.3g}); scale the weight down first")
    planes = F.pack_planes(codes, bits, group_size) if with_planes else None
    return QuantizedWeight(shape=w.shape, bits=bits, group_size=group_size, scheme=scheme,
                           packed=F.pack_tiles(codes, bits), scales=scales.contiguous(),
                           offsets=offsets.contiguous(), code_sums=F.code_sums(codes, group_size),
                           planes=planes, dtype=w.dtype if w.dtype in _FLOATS else torch.float32)


def _check_act_bits(act_bits, op: str = "qmatmul"):
    if act_bits is None:
        return 0
    act_bits = _int_arg(act_bits)
    if not isinstance(act_bits, int) or isinstance(act_bits, bool) or not 1 <= act_bits <= 8:
        raise ValueError(f"pykernels.{op}: expected act_bits None or an int in 1..8, got {act_bits!r}")
    return act_bits


def _check_x(x: torch.Tensor, N: int, K: int, where: str = "") -> None:
    """The checks qmatmul and QuantLinear.forward share (the native kernels and x.reshape would
    otherwise raise torch's bare errors, or ValueError for a dtype). `where` names the caller in the
    message; the prefix stays "pykernels.qmatmul:", the op that runs."""
    if x.dtype not in _FLOATS:
        raise TypeError(f"pykernels.qmatmul: expected 'x' of dtype float32, bfloat16 or float16{where}, got "
                        f"{str(x.dtype).replace('torch.', '')}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"pykernels.qmatmul: expected 'x' of shape [..., {K}] for a weight of shape "
                         f"{(N, K)}{where}, got {tuple(x.shape)}")


def qmatmul(x, qw: QuantizedWeight, bias=None, *, act_bits: Optional[int] = None, backend: str = "auto"):
    """y = x @ W.T (+ bias) with W the quantized weight [N, K]; x [..., K] float32/bfloat16/float16,
    y [..., N] of x's dtype. act_bits in 1..8 also quantizes x per token (bipolar-INT, the token's scale
    and offset fitted for least squared error: _format.act_fit) and runs the bit-serial product (p x q
    one-bit GEMMs); a token holding NaN or +-inf has no quantization scale, and
    its whole output row is NaN on that path (the weight-only path gives what torch's matmul gives).

    Accuracy of the weight-only CPU path: on CPUs with AMX-BF16 (Sapphire Rapids and newer), bf16
    activations from M=9 on with codes of at most 4 bits take the AMX kernel (config impl "amx"); on other
    AVX-512 CPUs with BF16 dot products (Zen 4 and newer), from M=12 on, its twin on VDPBF16PS (config impl
    "bf16dot"): bf16 activations times the integer
    codes are exact products summed in fp32, so y is the exact product with the dequantized weight up to
    fp32 sums and the bf16 output rounding. On CPUs with AVX2 but not AVX-512, from M=9 on (config impl
    "sgemm"; bf16 activations from M=33 on where the CPU multiplies bf16 natively take "dequant_mm",
    below), y is the fp32 product with the dequantized weights (the same fp32 weights exactly, summed in
    fp32 by a blocked GEMM that dequantizes them into its packed panels; then one rounding to x's dtype).
    Elsewhere the native kernel (config impl "native"; without AVX2 "dequant_mm" from M=65 on) rounds the
    activations to int16
    per block (scale = the block's max|x| / 32767) to run integer dot products: blocks of 32 elements on AVX2 and portable CPUs, of
    one weight group (at most 2048 elements; 1024 with group_size=-1) on AVX-512 VNNI CPUs. Each x_k
    moves by at most 2^-16 of its block's max|x|, so y differs from the fp32 product with the
    dequantized weight by about 2-4e-5 of max|y| on typical data (~1e-4 with LLM outlier features).
    That error is weighted by s * |u - 2^(bits-1)| (the code's distance from the middle of its range),
    not by the weight: where an asym group's weights all lie on one side of zero, its zero weights sit
    2^(bits-1) steps from the middle, and large activations meeting them cost up to about
    2^(bits-1) * s * 2^-16 * max|x| each (a review case built for it, one positive weight per 32 and
    activations 100x larger on the zeros: 5.6e-3 of max|y| at M=1, 2e-7 through the fp32 routes).
    Rows with an element above 2^8 times the mean |x| of the others (huge outliers, whose int16 step
    would swallow the ordinary values when the outliers' weights are ~0) have their outliers (above 8
    times the mean) multiplied exactly in float64 and the rest through the int16 kernel (LLM.int8()'s
    decomposition), and rows holding a NaN or inf take the fp32 route (so an inf gives torch's inf, not
    NaN); a cheap per-row check (a few microseconds for 4096 elements) decides (the AMX path
    routes such rows the same way). The
    weights themselves are used exactly. The "dequant_mm" config dequantizes chunks of rows and hands
    them to torch's GEMM: in fp32 (the same weights, exactly), except for bf16 activations on CPUs that
    multiply bf16 natively (AVX512-BF16, where oneDNN's bf16 GEMM is ~2x the integer kernel), where the
    dequantized weights and the bias are rounded to bf16 as a bf16 nn.Linear holding them would be
    (sums in fp32; ~2^-9 of sum|x||w| per output). For an exact fp32 result use
    torch.nn.functional.linear(x.float(), qw.dequantize(torch.float32), bias). On the GPU the Triton
    kernel multiplies in the activations' dtype as Marlin does: fp16 activations meet fp16-rounded
    weights (a weight beyond fp16's 65504 would be inf; a weight below its normal range, 6e-5, keeps
    fewer bits), bf16 ones bf16-rounded weights, fp32 ones fp32 weights; every sum is fp32. The GPU
    kernels do not split outlier rows as the CPU does: per 32-element block they add s * sum(u * x) and
    m * sum(x), two terms that cancel for zero weights, so a row with an activation ~1e4x its others
    loses relative precision (~1e-3 at 3e4, none left at 1e9) and an inf activation gives NaN, not inf
    (review finding, by reading; a GPU run will measure it).

    Range: the AVX2/AVX-512 weight-only kernels sum in fp32 a term of the centred codes and an offset
    term that cancel for the group's middle code; with weights near fp32's top (~1e36 and up, times
    the sum of |x|) either term alone can overflow to inf/NaN where y itself fits (the portable tier
    sums in float64; audit finding, left as is: no trained weights come near). The asym offset is
    stored as m = -s * zero_point in fp32, so the zero-point code dequantizes to ~|m| * 2^-24, not
    exactly 0 (the Triton kernel's fused u * s + m gives 0 there, so 0 * an inf activation is NaN
    on the GPU and inf on the CPU)."""
    x = as_tensor(x, "qmatmul", "x")
    if torch._C._is_any_autocast_enabled():  # (as F.linear's under torch.autocast)
        (x,) = autocast_floats(x)
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"pykernels.qmatmul: expected a pykernels.QuantizedWeight for 'qw' "
                        f"(from pykernels.quantize), got {type(qw).__name__}")
    N, K = qw.shape
    _check_x(x, N, K)
    ab = _check_act_bits(act_bits)  # (the group-length limit of act_bits: qmatmul_op's buffer checks, every call)
    if bias is not None:
        bias = as_tensor(bias, "qmatmul", "bias")
        if bias.shape != (N,):
            raise ValueError(f"pykernels.qmatmul: expected 'bias' of shape ({N},), got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"pykernels.qmatmul: expected a floating-point 'bias', got {bias.dtype}")
    if x.device != qw.device or (bias is not None and bias.device != x.device):
        raise RuntimeError(f"pykernels.qmatmul: expected all tensors on one device, got 'x' on {x.device}, "
                           f"'qw' on {qw.device}" + (f", 'bias' on {bias.device}" if bias is not None else ""))
    planes = qw.ensure_planes() if ab else None
    return qmatmul_op(x, qw.packed, qw.scales, qw.offsets, planes, qw.code_sums if ab else None, bias,
                      N, K, qw.bits, qw.group_size, ab, backend)


def _empty_qweight(N: int, K: int, bits: int, group_size: int, scheme: str, with_planes: bool,
                   device=None) -> QuantizedWeight:
    """A QuantizedWeight of zeros with every buffer shaped as _quantize() would make it."""
    gsize, G, gw = F.plane_geometry(K, group_size)
    N4, Kp = F.round_up(max(N, 1), F.ROW_TILE), F.round_up(max(K, 1), F.K_BLOCK)
    width = 16 if F.layout_bits(bits) == 4 else 32
    packed = torch.zeros(N4 * (Kp // F.K_BLOCK) * width, dtype=torch.uint8, device=device)
    z = torch.zeros(N, G, dtype=torch.float32, device=device)
    planes = torch.zeros(N4 * G * bits * gw, dtype=torch.int64, device=device) if with_planes else None
    return QuantizedWeight(shape=(N, K), bits=bits, group_size=group_size, scheme=scheme, packed=packed,
                           scales=z, offsets=z.clone(), code_sums=torch.zeros(N, G, dtype=torch.int32, device=device),
                           planes=planes)


def _cast_of(fn, device):
    """What a Module._apply function does to floating-point tensors: an empty tensor of the target dtype
    and device when it casts them (.half(), .float(), .to(dtype)...), else None. Two probes of different
    dtypes: a cast maps both to one dtype, a device move keeps each its own (one float32 probe could not
    tell .float() from .cpu(), and .to(float64) hands a float64 probe back as it is)."""
    out64 = fn(torch.empty(0, dtype=torch.float64, device=device))
    out16 = fn(torch.empty(0, dtype=torch.float16, device=device))
    return out64 if out64.dtype == out16.dtype else None


class QuantLinear(nn.Module):
    """Drop-in for nn.Linear with a quantized weight. Buffers: packed, scales, offsets, code_sums (and
    planes when act_bits is set); bits/group_size/scheme travel in the state dict's extra state."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 4,
                 group_size: int = 128, scheme: str = "asym", act_bits: Optional[int] = None,
                 device=None, dtype=torch.float32):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            # (64.5 and -1 reached torch.zeros' own errors, or were taken; audit finding)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"pykernels.QuantLinear: expected an int for '{name}', got {type(v).__name__}")
            if v < 0:
                raise ValueError(f"pykernels.QuantLinear: expected '{name}' >= 0, got {v}")
        if not isinstance(dtype, torch.dtype) or dtype not in _FLOATS:  # (an int32 bias failed in forward with a message about 'bias')
            raise TypeError(f"pykernels.QuantLinear: expected a floating-point 'dtype' (float32, float16, "
                            f"bfloat16), got {dtype!r}")
        bits, group_size = _check_format("QuantLinear", bits, group_size, scheme)
        act_bits = _check_act_bits(act_bits, "QuantLinear") or None
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.bits, self.group_size, self.scheme, self.act_bits = bits, group_size, scheme, act_bits
        self.weight_dtype = dtype
        if device is not None:  # (torch's own errors, an AssertionError without CUDA; audit finding)
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise RuntimeError(f"pykernels.QuantLinear: expected a torch device for 'device', got {device!r} "
                                   f"({str(exc).splitlines()[0]})") from None
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(f"pykernels.QuantLinear: device {dev} was asked for, but torch sees no CUDA device")
        # Zero-filled buffers of the right shapes (no quantization pass), for load_state_dict().
        self._set_qweight(_empty_qweight(out_features, in_features, bits, group_size, scheme, bool(act_bits),
                                         device))
        if bias:
            # trainable, as nn.Linear's (and bitsandbytes' Linear4bit's): the weight is the frozen part
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    _QUANT_BUFFERS = ("packed", "scales", "offsets", "code_sums", "planes")

    def _apply(self, fn, recurse=True):
        """Module.to()/.half()/.cuda() and the like: the quantized format keeps its own dtypes (the kernels
        read scales and offsets as float32), so only device moves (and in-place ops such as
        share_memory_) reach those buffers; a floating-point cast changes the bias and what
        qweight.dequantize() returns."""
        order = list(self._buffers)
        quant = {k: self._buffers.pop(k) for k in self._QUANT_BUFFERS if k in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            for k, buf in quant.items():
                if buf is not None:
                    cast = _cast_of(fn, buf.device)
                    if cast is None:
                        buf = fn(buf)  # a device move, an in-place op (share_memory_) or nothing
                    else:
                        buf = buf.to(device=cast.device)
                        if k == "scales" and cast.dtype.is_floating_point:
                            self.weight_dtype = cast.dtype
                self._buffers[k] = buf
            for k in order:  # the original order (state_dict keys)
                self._buffers[k] = self._buffers.pop(k)
        return self

    def _set_qweight(self, qw: QuantizedWeight):
        self.register_buffer("packed", qw.packed)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("offsets", qw.offsets)
        self.register_buffer("code_sums", qw.code_sums)
        # Only act_bits reads the bit planes: without it they would be +50% memory that forward never
        # touches (a bipolar weight keeps none either; qweight's qmatmul(act_bits=...) makes them then).
        planes = qw.ensure_planes() if self.act_bits else None
        self.register_buffer("planes", planes)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K], made on each access: for code that reads `.weight` of its
        linear layers directly (nn.TransformerEncoderLayer's fast-path checks, dtype/device probes).
        forward never uses it."""
        return self.qweight.dequantize()

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(shape=(self.out_features, self.in_features), bits=self.bits,
                               group_size=self.group_size, scheme=self.scheme, packed=self.packed,
                               scales=self.scales, offsets=self.offsets, code_sums=self.code_sums,
                               planes=self.planes, dtype=self.weight_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, group_size: int = 128, scheme: str = "asym",
                    act_bits: Optional[int] = None) -> "QuantLinear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"pykernels.QuantLinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        bits, group_size = _check_format("QuantLinear.from_linear", bits, group_size, scheme)
        act_bits = _check_act_bits(act_bits, "QuantLinear.from_linear") or None
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.bits, layer.group_size, layer.scheme, layer.act_bits = bits, group_size, scheme, act_bits
        layer.weight_dtype = w.dtype if w.dtype in _FLOATS else torch.float32
        _check_weight(w, group_size)
        layer._set_qweight(_quantize(w, bits, group_size, scheme, with_planes=bool(act_bits)))
        if linear.bias is not None:
            # trainable where the Linear's was (it was frozen: a drop-in's bias stopped learning; review finding)
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        else:
            layer.register_parameter("bias", None)
        return layer

    def forward(self, x):
        N, K = self.out_features, self.in_features
        x = as_tensor(x, "qmatmul", "x")
        if torch._C._is_any_autocast_enabled():  # (as nn.Linear's under torch.autocast)
            (x,) = autocast_floats(x)
        _check_x(x, N, K, " (in pykernels.QuantLinear.forward)")
        # The buffers and the bias from the module's dicts: each attribute read goes through
        # Module.__getattr__, ~0.3 us apiece (~2 us of a 256 x 256 layer's ~15 us call). A parametrized
        # (or deleted) one is not in them: the attributes then, as before.
        bufs, params = self._buffers, self._parameters
        try:
            packed, scales, offsets, bias = bufs["packed"], bufs["scales"], bufs["offsets"], params["bias"]
            planes, code_sums = (bufs["planes"], bufs["code_sums"]) if self.act_bits else (None, None)
        except KeyError:
            packed, scales, offsets, bias = self.packed, self.scales, self.offsets, self.bias
            planes, code_sums = (self.planes, self.code_sums) if self.act_bits else (None, None)
        if x.device != packed.device:  # (a layer left on meta returned garbage for a CPU x; audit finding)
            raise RuntimeError(f"pykernels.QuantLinear.forward: expected 'x' on the layer's device "
                               f"{packed.device}, got {x.device}")
        # A float32 activation through a bf16 model (or the reverse) runs in the activation's dtype.
        return qmatmul_op(x, packed, scales, offsets, planes, code_sums, bias, N, K, self.bits,
                          self.group_size, self.act_bits or 0, "auto")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # State dicts saved before planes were act_bits-only carry them for every bipolar layer: drop
        # them where this layer keeps none (the extra state still checks the format matches).
        if self.planes is None:
            state_dict.pop(prefix + "planes", None)
        # A state dict saved for another format (bits, group size, scheme, shape) is refused before anything
        # is copied in, as torch's own size mismatches are: collected into load_state_dict's RuntimeError,
        # the layer as it was. (set_extra_state ran after the buffers were copied, and the code check below
        # named the codes rather than the format; audit finding.)
        extra = state_dict.get(prefix + "_extra_state")
        if extra is not None and extra != self.get_extra_state():
            error_msgs.append(f"pykernels.QuantLinear: state dict was saved for {extra}, this layer is "
                              f"{self.get_extra_state()}")
            return
        # codes past `bits` gave garbage outputs with no error (QuantizedWeight.from_state_dict and torch.load
        # refuse them; audit finding): checked before anything is copied in, so the layer stays as it was
        packed = state_dict.get(prefix + "packed")
        if isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8:
            try:
                _check_codes("QuantLinear.load_state_dict", packed, self.bits)
            except ValueError as exc:
                error_msgs.append(str(exc))
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def get_extra_state(self):
        return {"bits": self.bits, "group_size": self.group_size, "scheme": self.scheme,
                "act_bits": self.act_bits, "in_features": self.in_features, "out_features": self.out_features}

    def set_extra_state(self, state):
        mine = self.get_extra_state()
        if state != mine:
            raise ValueError(f"pykernels.QuantLinear: state dict was saved for {state}, this layer is {mine}")

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.bits}, group_size={self.group_size}, scheme={self.scheme!r}, act_bits={self.act_bits}")


def _matches(name: str, patterns) -> bool:
    return any(name == p or fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)


def quantize_model(model: nn.Module, bits: int = 4, group_size: int = 128, include: Optional[Iterable[str]] = None,
                   exclude: Optional[Iterable[str]] = None, *, scheme: str = "asym",
                   act_bits: Optional[int] = None) -> nn.Module:
    """Replaces (in place, and returns `model`; a bare nn.Linear comes back as its QuantLinear) every
    nn.Linear whose qualified name matches `include` (default: all) and not `exclude` by a QuantLinear
    (not nn.MultiheadAttention's out_proj, which attention reads as a plain weight, nor a subclass with a
    forward of its own such as a LoRA adapter: kept, with a warning). Names match
    exactly, as a prefix of a sub-module path, or as fnmatch patterns ("*.mlp.*"); a layer shared under
    several names is quantized only if all of them are selected. A layer whose K is not a multiple of
    group_size keeps per-group scales with a shorter last group."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"pykernels.quantize_model: expected an nn.Module 'model', got {type(model).__name__}")
    for name, names in (("include", include), ("exclude", exclude)):
        if names is not None and not isinstance(names, str) and not isinstance(names, Iterable):
            raise TypeError(f"pykernels.quantize_model: expected '{name}' as a name, a pattern or a list of them, "
                            f"got {type(names).__name__}")
    # lists: a generator or iterator would be used up by the first layer's match
    include = [include] if isinstance(include, str) else (None if include is None else list(include))
    exclude = [exclude] if isinstance(exclude, str) else list(exclude or [])
    for name, names in (("include", include or []), ("exclude", exclude)):
        for item in names:  # (None reached len() inside the matcher; audit finding)
            if not isinstance(item, str):
                raise TypeError(f"pykernels.quantize_model: expected every entry of '{name}' to be a name or a "
                                f"pattern (str), got {type(item).__name__}")
    bits, group_size = _check_format("quantize_model", bits, group_size, scheme)
    act_bits = _check_act_bits(act_bits, "quantize_model") or None
    # Every name of every Linear: a layer shared under several names is replaced under all of them, by
    # one QuantLinear, or kept under all of them when any of its names is excluded (or not included): a
    # tie is never split. Not quantized: NonDynamicallyQuantizableLinear, torch's mark for
    # nn.MultiheadAttention's out_proj (attention reads its .weight as a plain tensor).
    # Nor a subclass with a forward of its own (a LoRA adapter, a scaled Linear): a QuantLinear would drop
    # what its forward adds, silently (audit finding); it is kept, with a warning. (A parametrized Linear
    # keeps nn.Linear's forward.)
    linears = [(name, mod) for name, mod in model.named_modules(remove_duplicate=False)
               if isinstance(mod, nn.Linear) and not isinstance(mod, nn.modules.linear.NonDynamicallyQuantizableLinear)]
    kept = {id(mod) for name, mod in linears
            if not ((include is None or _matches(name, include)) and not _matches(name, exclude))}
    every_linear = [name for name, mod in model.named_modules(remove_duplicate=False) if isinstance(mod, nn.Linear)]
    unmatched = [p for p in include or [] if not any(_matches(name, [p]) for name in every_linear)]
    if unmatched:  # a misspelt name left the model unquantized without a word
        warnings.warn("pykernels.quantize_model: no nn.Linear matches these 'include' entries: "
                      + ", ".join(repr(p) for p in unmatched), stacklevel=2)
    own_forward = [(name, mod) for name, mod in linears
                   if id(mod) not in kept and type(mod).forward is not nn.Linear.forward]
    if own_forward:
        warnings.warn("pykernels.quantize_model: left as they are: nn.Linear subclasses with a forward of their own, "
                      "which a QuantLinear would not run: " + ", ".join(
                          f"{name or '(the model)'} ({type(mod).__name__})" for name, mod in own_forward[:8])
                      + (f" and {len(own_forward) - 8} more" if len(own_forward) > 8 else ""), stacklevel=2)
        kept |= {id(mod) for _, mod in own_forward}
    targets = [(name, mod) for name, mod in linears if id(mod) not in kept]
    # every layer quantized before any is swapped in: a layer that fails (inf weights) raised with the
    # layers before it already replaced, a half-quantized model (audit finding)
    made = {}
    for _, lin in targets:
        if id(lin) not in made:
            made[id(lin)] = QuantLinear.from_linear(lin, bits, group_size, scheme, act_bits)
    for name, lin in targets:
        q = made[id(lin)]
        if not name:  # the model is itself a Linear: its replacement is the result
            return q
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, q)
    return model


register_tunables(quantize)
