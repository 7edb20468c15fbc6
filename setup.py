"""Build of pykernels' native modules: plain pybind11 + nvcc/hipcc, no torch C++ headers.

Layout convention (one op family per folder, so adding an op never edits this file):
  csrc/<family>/*.cpp (except *_cuda_bind.cpp)  -> pykernels._cpu_<family>    (always built)
  csrc/<family>/*.cu + *_cuda_bind.cpp          -> pykernels._cuda_<family>   (when nvcc is found)
The CPU module is compiled for baseline x86-64; AVX2 kernels carry PK_TARGET_AVX2 and are picked at
run time (csrc/common/pk_common.h). The CUDA module links the static CUDA runtime, so it imports on a
machine without a driver and reports "no CUDA device" when called.

Environment:
  PYKERNELS_BUILD_CUDA=0|1   skip / require the CUDA modules (default: build when nvcc is found)
  PYKERNELS_CUDA_ARCHS=80;90 SM architectures (default 80;90)
  PYKERNELS_BUILD_HIP=1      build the GPU modules with hipcc for AMD (PYKERNELS_HIP_ARCHS=gfx90a)
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
COMMON = CSRC / "common"
CXX_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
if os.uname().machine in ("x86_64", "AMD64"):
    CXX_FLAGS.append("-march=x86-64")  # baseline ISA; AVX2 paths are chosen at run time


def find_cuda_home():
    """CUDA_HOME/CUDA_PATH first; nvcc on PATH may be a wrapper script, so ask nvcc for its TOP."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and (Path(os.environ[var]) / "bin" / "nvcc").exists():
            return Path(os.environ[var])
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "x.cu"], capture_output=True, text=True).stderr
        for line in out.splitlines():
            if "TOP=" in line:
                return Path(line.split("TOP=", 1)[1].strip()).resolve()
    except OSError:
        pass
    return Path(nvcc).resolve().parent.parent


def gpu_build_mode():
    if os.environ.get("PYKERNELS_BUILD_HIP") == "1":
        return "hip"
    flag = os.environ.get("PYKERNELS_BUILD_CUDA")
    if flag == "0":
        return None
    if find_cuda_home() is None:
        if flag == "1":
            sys.exit("PYKERNELS_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return None
    return "cuda"


def families():
    return sorted(p.name for p in CSRC.iterdir() if p.is_dir() and p.name != "common")


class GpuExtension(Pybind11Extension):
    """A pybind11 extension whose .cu sources are compiled by nvcc (or hipcc) first."""

    def __init__(self, name, cpp_sources, gpu_sources, mode, headers=()):
        super().__init__(name, cpp_sources, include_dirs=[str(COMMON)], extra_compile_args=CXX_FLAGS,
                         cxx_std=17, depends=list(headers))
        self.gpu_sources = gpu_sources
        self.mode = mode


class BuildExt(build_ext):
    def build_extension(self, ext):
        if isinstance(ext, GpuExtension):
            self._compile_gpu(ext)
        super().build_extension(ext)

    def _compile_gpu(self, ext):
        objects = []
        tmp = Path(self.build_temp) / ext.name
        tmp.mkdir(parents=True, exist_ok=True)
        if ext.mode == "cuda":
            home = find_cuda_home()
            nvcc = str(home / "bin" / "nvcc")
            archs = os.environ.get("PYKERNELS_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
            base = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-lineinfo",
                    f"-I{COMMON}", *gencode]
            ext.include_dirs.append(str(home / "include"))
            ext.library_dirs.extend([str(home / "lib64"), str(home / "lib64" / "stubs")])
            ext.libraries.extend(["cudart_static", "dl", "rt", "pthread"])
        else:
            hipcc = shutil.which("hipcc") or "/usr/bin/hipcc"
            archs = os.environ.get("PYKERNELS_HIP_ARCHS", "gfx90a").split(";")
            base = [hipcc, "-O3", "-std=c++17", "-fPIC", "-DPK_BUILD_HIP", f"-I{COMMON}",
                    *[f"--offload-arch={a}" for a in archs]]
            ext.define_macros.append(("__HIP_PLATFORM_AMD__", "1"))
            ext.define_macros.append(("PK_BUILD_HIP", "1"))
            ext.libraries.append("amdhip64")
        for src in ext.gpu_sources:
            obj = tmp / (Path(src).stem + ".o")
            if not obj.exists() or obj.stat().st_mtime < max(Path(s).stat().st_mtime for s in [src, *ext.depends]):
                cmd = [*base, "-c", "-x", "cu" if ext.mode == "cuda" else "hip", src, "-o", str(obj)]
                print(" ".join(cmd))
                env = dict(os.environ, HIP_PLATFORM="amd") if ext.mode == "hip" else None
                subprocess.check_call(cmd, env=env)
            objects.append(str(obj))
        ext.extra_objects.extend(objects)


def extensions():
    exts = []
    mode = gpu_build_mode()
    for fam in families():
        folder = CSRC / fam
        cpp = sorted(str(p.relative_to(ROOT)) for p in folder.glob("*.cpp"))
        # headers: an edit to one rebuilds the family (setuptools only compares the sources otherwise)
        headers = sorted(str(p.relative_to(ROOT)) for p in [*folder.glob("*.h"), *COMMON.glob("*.h")])
        cpu_sources = [s for s in cpp if not s.endswith("_cuda_bind.cpp")]
        if cpu_sources:
            exts.append(Pybind11Extension(f"pykernels._cpu_{fam}", cpu_sources, include_dirs=[str(COMMON)],
                                          extra_compile_args=CXX_FLAGS, cxx_std=17, depends=headers))
        cu = sorted(str(p) for p in folder.glob("*.cu"))
        bind = [s for s in cpp if s.endswith("_cuda_bind.cpp")]
        if mode and cu and bind:
            exts.append(GpuExtension(f"pykernels._cuda_{fam}", bind, cu, mode, headers))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
