"""The bf16dot attention kernels (AVX-512 BF16) on CPUs without those instructions, through a test build
that replaces the intrinsics with scalar versions (tests/avx512_emulation/avx512_emu.h, -DPK_EMULATE_AVX512).

test_attention.py's bf16dot tests skip where the CPU lacks AVX-512 BF16, and CI's machines may lack it
(an AVX2-only EPYC ran CI on 2026-12-05): the kernels' own logic (K/V packing, 6-row tiles, the causal and
S_q != S_k masks, strides, the tiny-value checks, the backward's groups shared by several threads) would go
untested there. Here the same tests run in a subprocess with the emulated module in place of
pykernels._cpu_attention. Where the CPU has the instructions the real kernels run in test_attention.py and
this file skips.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from pykernels import _native
from pykernels.attention import _cpu

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "attention" / "attention_cpu.cpp"
EMULATION = Path(__file__).resolve().parent / "avx512_emulation"

# the build (~30 s) and the inner runs, within one limit of their own (the suite's is 600 s per test)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _compiler():
    """The compiler command (a CXX such as "ccache g++" kept whole), or None."""
    for name in (os.environ.get("CXX"), sysconfig.get_config_var("CXX"), "c++", "g++"):
        words = shlex.split(name) if name else []
        if words and shutil.which(words[0]):
            return words
    return None


@pytest.fixture(scope="module")
def emulated_module(tmp_path_factory):
    if _cpu.bf16dot_available():
        pytest.skip("this CPU has AVX-512 BF16: test_attention.py runs the real bf16dot kernels")
    if not _native.IS_X86 or not _native.cpu_module("runtime").cpu_has_avx2():
        pytest.skip("the emulation build targets x86-64 with AVX2 (the kernels' AVX2 parts stay native)")
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    import pybind11

    out = tmp_path_factory.mktemp("avx512_emulated")
    so = out / f"_cpu_attention{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = [*cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread",
           "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mpopcnt", "-DPK_EMULATE_AVX512",
           f"-I{EMULATION}", f"-I{ROOT / 'csrc' / 'common'}", f"-I{pybind11.get_include()}",
           f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(so)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"the emulation build failed:\n{build.stderr[-6000:]}"
    # A pytest plugin, loaded before the tests import pykernels: the emulated module stands in for
    # pykernels._cpu_attention (pykernels._native imports it by that name).
    (out / "pk_avx512_emulated.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("pykernels._cpu_attention", {str(so)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["pykernels._cpu_attention"] = module
        """))
    return out


def _pytest(plugin_dir: Path, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_dir), str(ROOT)]))
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "pk_avx512_emulated", "-p", "no:cacheprovider",
                           "-q", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _counts(summary: str) -> dict:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}


def test_the_emulated_module_is_the_one_tests_use(emulated_module):
    probe = emulated_module / "test_probe.py"
    probe.write_text(textwrap.dedent(f"""
        import pykernels
        from pykernels.attention import _cpu
        from pykernels import _native

        def test_probe():
            assert _native.cpu_module("attention").__file__.startswith({str(emulated_module)!r})
            assert _cpu.bf16dot_available()
        """))
    run = _pytest(emulated_module, str(probe), f"--rootdir={ROOT}")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_bf16dot_tests_pass_on_the_emulated_kernels(emulated_module):
    """Every bf16dot test of test_attention.py (forward and backward against the float64 oracle and SDPA,
    1-3 threads including groups shared by threads, strides, rows without keys, NaN/inf, tiny values, the
    default dispatch) on the emulated kernels; none may skip (they skip only without the kernels)."""
    run = _pytest(emulated_module, "tests/test_attention.py", "-k", "bf16dot and not off_without_avx512")
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    counts = _counts(run.stdout.strip().splitlines()[-1])
    assert counts.get("passed", 0) >= 100 and not counts.get("skipped") and not counts.get("failed"), tail
