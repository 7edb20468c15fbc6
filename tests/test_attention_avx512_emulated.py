"""The bf16dot attention kernels (AVX-512 BF16) on CPUs without those instructions, through a test build
that replaces the intrinsics with scalar versions (tests/avx512_emulation/avx512_emu.h, -DPK_EMULATE_AVX512).

test_attention.py's bf16dot tests skip where the CPU lacks AVX-512 BF16, and CI's machines may lack it
(an AVX2-only EPYC ran CI on 2026-12-05): the kernels' own logic (K/V packing, 6-row tiles, the causal and
S_q != S_k masks, strides, the tiny-value checks, the backward's groups shared by several threads) would go
untested there. Here the same tests run in a subprocess with the emulated module in place of
pykernels._cpu_attention. Where the CPU has the instructions the real kernels run in test_attention.py, and
this file checks the emulation itself: the emulated build against the real kernels, bit for bit.
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
    return _build_emulated(tmp_path_factory)


@pytest.fixture(scope="module")
def emulated_beside_real(tmp_path_factory):
    """The emulated build on a CPU that also runs the real kernels (to compare them)."""
    if not _cpu.bf16dot_available():
        pytest.skip("this CPU lacks AVX-512 BF16: no real kernels to compare the emulation with")
    return _build_emulated(tmp_path_factory)


def _build_emulated(tmp_path_factory):
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
    default dispatch) and every fma kernel test (its AVX-512 tier, which runs where bf16dot does) on the
    emulated kernels; none may skip (they skip only without the kernels)."""
    run = _pytest(emulated_module, "tests/test_attention.py", "-k",
                  "(bf16dot and not off_without_avx512) or (fma and not avx2_tier)")
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    counts = _counts(run.stdout.strip().splitlines()[-1])
    assert counts.get("passed", 0) >= 100 and not counts.get("skipped") and not counts.get("failed"), tail


_COMPARE = """
import sys, torch
from pykernels.attention import _cpu
torch.manual_seed(0)
results = []
for B, H, Hkv, Sq, Sk, D in ((1, 4, 2, 37, 53, 64), (2, 2, 2, 70, 70, 128), (1, 8, 1, 16, 200, 192),
                                     (1, 2, 2, 90, 31, 64)):
    for causal in (False, True):
        q = torch.randn(B, H, Sq, D).bfloat16()
        k = torch.randn(B, Hkv, Sk, D).bfloat16()
        v = torch.randn(B, Hkv, Sk, D).bfloat16()
        dout = torch.randn(B, H, Sq, D).bfloat16()
        for threads in (1, 2):
            out, lse = _cpu.bf16dot_forward(q, k, v, causal, D ** -0.5, threads)
            grads = _cpu.bf16dot_backward(dout, q, k, v, out, lse, causal, D ** -0.5, None, threads)
            results.append((out.clone(), lse.clone(), *(g.clone() for g in grads)))
            # the fma kernel's AVX-512 tier, fp32 and widened bf16
            for x in (q.float(), q):
                out, lse = _cpu.fma_forward(x, k.to(x.dtype), v.to(x.dtype), causal, D ** -0.5, threads)
                results.append((out.clone(), lse.clone()))
            # and its fp32 backward
            args = (dout.float(), q.float(), k.float(), v.float(), out.float(), lse, causal, D ** -0.5)
            results.append(tuple(g.clone() for g in _cpu.fma_backward(*args, None, threads)))
torch.save(results, sys.argv[1])
"""


def test_the_emulation_matches_the_real_kernels_bit_for_bit(emulated_beside_real, tmp_path):
    """On a CPU with AVX-512 BF16: the emulated build (what CI's AVX2-only machines test) gives the real
    kernels' bits, bf16dot forward and backward and the fma kernel's AVX-512 tier (forward and backward), over GQA, S_q != S_k, causal, head dims 64-192 and 1-2 threads; the
    emulation tests above are only as good as this agreement."""
    script = tmp_path / "compare.py"
    script.write_text(_COMPARE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(emulated_beside_real), str(ROOT)]))
    for name, plugin in (("emulated", "import pk_avx512_emulated; "), ("real", "")):
        # (the plugin puts the emulated module in place of pykernels._cpu_attention before pykernels loads)
        runner = plugin + "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        run = subprocess.run([sys.executable, "-c", runner, str(script), str(tmp_path / f"{name}.pt")], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
    import torch

    emulated, real = torch.load(tmp_path / "emulated.pt"), torch.load(tmp_path / "real.pt")
    assert len(emulated) == len(real) == 64
    for i, (a, b) in enumerate(zip(emulated, real)):
        names = ("dq", "dk", "dv") if len(a) == 3 else ("out", "lse", "dq", "dk", "dv")  # (3: the fma backward)
        for name, x, y in zip(names, a, b):
            assert torch.equal(x, y), (i, name, float((x.float() - y.float()).abs().max()))
