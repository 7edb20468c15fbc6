"""Ahead-of-time compilation of every Triton kernel for a GPU that is not here (default sm_90).

Each Triton module of an op (a module named `_triton*.py` inside a pykernels sub-package) lists the
configs its autotuner may pick as `AOT_SPECS`: a list of `AotSpec`. The test suite compiles each one
with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`, runs Triton's bundled ptxas
with -v on the PTX to read registers and spills (the driver fills those in only when loading, and
there is no driver here), and fails on spills or on shared memory over the architecture's limit.
`fits(spec)` is the same check for pruning a config space at tune time.
"""
from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# Max dynamic shared memory per block (bytes): A100 163 KiB, H100/H200 227 KiB, B200 227 KiB.
SHARED_LIMIT = {80: 166912, 90: 232448, 100: 232448}


@dataclass(frozen=True)
class AotSpec:
    name: str                    # e.g. "sort.binning[BLOCK=4096]"
    fn: Any                      # the @triton.jit function
    signature: dict              # arg name -> Triton type ("*fp32", "i32", "constexpr", ...)
    constexprs: dict             # constexpr values
    num_warps: int = 4
    num_stages: int = 3

    def key(self):
        return (self.name, tuple(sorted(self.constexprs.items())), self.num_warps, self.num_stages)


@dataclass
class AotReport:
    spec: AotSpec
    arch: int
    registers: Optional[int] = None
    spill_stores: Optional[int] = None
    spill_loads: Optional[int] = None
    shared_bytes: Optional[int] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return (self.error is None and not self.spill_stores and not self.spill_loads
                and (self.shared_bytes or 0) <= SHARED_LIMIT.get(self.arch, SHARED_LIMIT[90]))

    def line(self) -> str:
        s = self.spec
        status = "ok" if self.ok else f"FAIL {self.error or ''}".strip()
        return (f"{s.name} warps={s.num_warps} stages={s.num_stages} {s.constexprs}: regs={self.registers} "
                f"spill_st={self.spill_stores} spill_ld={self.spill_loads} smem={self.shared_bytes} sm_{self.arch} {status}")


def _ptxas() -> Path:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # ptxas-blackwell is the newer one; it reads the PTX version that triton emits for every arch.
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return bin_dir / name
    raise RuntimeError("triton's bundled ptxas was not found")


def compile_spec(spec: AotSpec, arch: int = 90) -> AotReport:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = AotReport(spec, arch)
    try:
        src = ASTSource(spec.fn, signature=spec.signature, constexprs=spec.constexprs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    except Exception as exc:  # a compile error is a failed check, reported with the spec
        report.error = f"compile error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return report
    report.shared_bytes = int(kernel.metadata.shared)
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        res = subprocess.run([str(_ptxas()), "-v", f"--gpu-name={gpu}", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    out = res.stdout + res.stderr
    if res.returncode != 0:
        report.error = "ptxas: " + out.strip().splitlines()[-1]
        return report
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    if m:
        report.spill_stores, report.spill_loads = int(m.group(1)), int(m.group(2))
    m = re.search(r"Used (\d+) registers", out)
    if m:
        report.registers = int(m.group(1))
    return report


@functools.lru_cache(maxsize=None)
def _fits_cached(key, arch):
    spec = _SPEC_BY_KEY[key]
    return compile_spec(spec, arch).ok


_SPEC_BY_KEY: dict = {}


def fits(spec: AotSpec, arch: int = 90) -> bool:
    """True when the config compiles for `arch` without spills and within shared memory."""
    _SPEC_BY_KEY[spec.key()] = spec
    return _fits_cached(spec.key(), arch)


def aot_specs() -> list:
    """Every AotSpec declared by a `_triton*` module under pykernels (imports them)."""
    import pykernels

    specs = []
    root = Path(pykernels.__file__).parent
    for info in pkgutil.walk_packages([str(root)], prefix="pykernels."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf.startswith("_triton"):
            mod = importlib.import_module(info.name)
            specs.extend(getattr(mod, "AOT_SPECS", []))
    return specs
