"""The foundation: native modules, the backend switch, the thread pool, and the autotune cache."""
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import pykernels
import pykernels.autotune as at
from pykernels import _backend

ROOT = Path(__file__).resolve().parent.parent


def test_backends_report_every_backend_with_a_reason():
    b = pykernels.backends()
    assert set(b) == {"cpu", "cuda", "triton"}
    assert b["cpu"].available, b["cpu"].reason
    for status in b.values():
        assert isinstance(status.reason, str) and status.reason
    if not torch.cuda.is_available():
        assert not b["cuda"].available


def test_cpu_module_reads_and_copies_on_several_threads():
    from pykernels import _cpu_runtime as rt

    for n in (0, 1, 7, 1001, 1 << 20):
        x = torch.randint(0, 1 << 40, (n,), dtype=torch.int64)
        for threads in (1, 2, 3, 8):
            assert rt.read_sum(x.data_ptr(), n * 8, threads) == int(x.sum()) % (1 << 64)
            y = torch.zeros_like(x)
            rt.copy_bytes(y.data_ptr(), x.data_ptr(), n * 8, threads)
            assert torch.equal(x, y)


def test_fma_peak_is_a_rate_of_this_machine():
    """The bench's compute limit: positive with AVX2 (one core of any AVX2 CPU does a few GFLOP/s at least;
    more threads never measure less than half of one: the best of 3 trials each), 0 without."""
    from pykernels import _cpu_runtime as rt

    if not rt.cpu_has_avx2():
        assert rt.fma_peak_gflops(1) == 0.0
        return
    one, two = rt.fma_peak_gflops(1), rt.fma_peak_gflops(2)
    assert 1.0 < one < 1e4 and two > 0.5 * one


def test_portable_path_without_avx2_in_a_fresh_process():
    code = ("from pykernels import _cpu_runtime as rt; import torch; x = torch.arange(12345, dtype=torch.int64);"
            "assert not rt.cpu_has_avx2(); assert rt.read_sum(x.data_ptr(), x.numel() * 8, 2) == int(x.sum());"
            "assert rt.fma_peak_gflops(2) == 0.0")
    env = dict(os.environ, PYKERNELS_DISABLE_AVX2="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


def test_avx512_tier_can_be_turned_off_in_a_fresh_process():
    code = ("from pykernels import _cpu_runtime as rt; import pykernels;"
            "assert not rt.cpu_has_avx512(); assert 'AVX-512' not in pykernels.backends()['cpu'].reason")
    env = dict(os.environ, PYKERNELS_DISABLE_AVX512="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cuda_module_imports_without_a_driver_and_fails_cleanly():
    mod = pytest.importorskip("pykernels._cuda_runtime", reason="built without nvcc")
    n, why = mod.device_count()
    assert n == 0 and why
    with pytest.raises(RuntimeError, match="no CUDA device"):
        mod.fill_u32(0, 16, 1, 0)


@pytest.mark.gpu
def test_cuda_module_launches_a_kernel():
    from pykernels import _cuda_runtime as mod

    out = torch.zeros(1000, dtype=torch.int32, device="cuda")
    mod.fill_u32(out.data_ptr(), out.numel(), 7, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert bool((out == 7).all())


def test_select_backend_errors_name_the_op():
    cpu = torch.device("cpu")
    assert _backend.select_backend("sort", cpu, "auto") == "cpu"
    with pytest.raises(ValueError, match="pykernels.sort: expected backend"):
        _backend.select_backend("sort", cpu, "gpu")
    with pytest.raises(RuntimeError, match="pykernels.sort: backend 'cuda'"):
        _backend.select_backend("sort", cpu, "cuda")
    with pytest.raises(RuntimeError, match="not implemented for this op"):
        _backend.select_backend("sort", cpu, "triton", supported=("cpu",))


# ---------------------------------------------------------------------------------------------
# Autotuning, with an op made for the test: its configs sleep for known times.
# ---------------------------------------------------------------------------------------------
SLEEP = {"fast": 0.004, "default": 0.012, "slow": 0.02}


def _register_sleepy(op="test_sleepy", default="default", cands=("fast", "slow")):
    return at.register(at.Tunable(
        op=op, backend="cpu", group="test",
        make_key=lambda x: {"dtype": str(x.dtype), "n": at.bucket(x.numel())},
        default=lambda key: {"kind": default},
        candidates=lambda key: [{"kind": c} for c in cands],
        run=lambda config, x: time.sleep(SLEEP[config["kind"]]),
    ))


def test_bucket():
    assert [at.bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [0, 1, 2, 4, 1024, 1024, 2048]


def test_tune_picks_the_fastest_and_caches_it(tmp_cache):
    _register_sleepy()
    x = torch.zeros(1000)
    cfg = at.tune("test_sleepy", x, budget_s=0.05)
    assert cfg == {"kind": "fast"}
    path = at.cache_file()
    assert path.exists() and path.parent == tmp_cache
    data = json.loads(path.read_text())
    assert data["metadata"]["torch"] == torch.__version__
    (entry,) = data["entries"].values()
    assert entry["time_s"] < entry["default_time_s"]
    # Same bucket -> same config; another bucket -> the heuristic default.
    assert at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 1024}, "cpu") == {"kind": "fast"}
    assert at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 4096}, "cpu") == {"kind": "default"}


def test_tuned_config_is_never_slower_than_the_default(tmp_cache):
    _register_sleepy(op="test_sleepy_slow", cands=("slow",))
    assert at.tune("test_sleepy_slow", torch.zeros(10), budget_s=0.05) == {"kind": "default"}


def test_autotune_off_uses_heuristics(tmp_cache, monkeypatch):
    _register_sleepy()
    at.tune("test_sleepy", torch.zeros(1000), budget_s=0.05)
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "0")
    assert at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 1024}, "cpu") == {"kind": "default"}
    # tuning itself is off too: nothing measured or written, the heuristic comes back
    before = at.cache_file().read_bytes()
    with pytest.warns(UserWarning, match="PYKERNELS_AUTOTUNE=0 turns tuning off"):
        assert at.tune("test_sleepy", torch.zeros(5000), budget_s=0.05) == {"kind": "default"}
    assert at.cache_file().read_bytes() == before
    out = subprocess.run([sys.executable, "-m", "pykernels.autotune", "generate", "--ops", "sort"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, PYKERNELS_AUTOTUNE="0"))
    assert out.returncode == 2 and "turns tuning off" in out.stderr
    for spelled in ("false", "OFF", "no"):  # (tuning stayed on: only "0" was read)
        monkeypatch.setenv("PYKERNELS_AUTOTUNE", spelled)
        assert at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 1024}, "cpu") == {"kind": "default"}
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "1")
    assert at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 1024}, "cpu") != {"kind": "default"}


def test_second_process_reuses_the_cache(tmp_cache):
    _register_sleepy()
    at.tune("test_sleepy", torch.zeros(1000), budget_s=0.05)
    code = ("import pykernels.autotune as at;"
            "e = at.lookup('test_sleepy', {'dtype': 'torch.float32', 'n': 1024}, 'cpu', 'cpu');"
            "print(e['config']['kind'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=dict(os.environ, PYKERNELS_CACHE_DIR=str(tmp_cache)))
    assert out.stdout.strip() == "fast"


def test_corrupt_or_foreign_cache_is_ignored_with_a_warning(tmp_cache):
    _register_sleepy()
    path = at.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{ not json")
    with pytest.warns(UserWarning, match="corrupt"):
        assert at.lookup("test_sleepy", {"n": 1}, "cpu", "cpu") is None
    at.clear_memory_cache()
    meta = dict(at._metadata("cpu"), torch="0.0.1")
    path.write_text(json.dumps({"metadata": meta, "entries": {"x|cpu|{}": {"config": {}}}}))
    with pytest.warns(UserWarning, match="other versions"):
        assert at.lookup("test_sleepy", {"n": 1}, "cpu", "cpu") is None
    at.clear_memory_cache()
    # tuning over a corrupt file replaces it with a valid one
    path.write_text("garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at.tune("test_sleepy", torch.zeros(1000), budget_s=0.05)
    assert json.loads(path.read_text())["entries"]


@pytest.mark.parametrize("bad", [{"metadata": None}, {"entry": "x"}, {"entry": {"time_s": 1}},
                                 {"config": None}, {"config": [1, 2]}, {"config": {"threads": "x"}},
                                 {"config": {"grain": None}}, {"config": {"digit_bits": 2 ** 31}},
                                 {"config": {"threads": 2 ** 40}}, {"nested": True},
                                 # the default's values, one of them of another type (16.0 == 16 and
                                 # True == 1 in Python: they passed as the op's own config; review finding)
                                 {"default_with": {"grain": float(1 << 15)}}, {"default_with": {"nt": -1.0}},
                                 {"default_with": {"threads": False}}])
def test_damaged_cache_entries_fall_back_to_the_default(tmp_cache, bad):
    """Valid JSON with bad contents (fuzz finding: every sort call raised): structurally wrong entries are
    dropped when the file loads, configs that are not one of the op's own configs when looked up; the op
    runs its default and is right."""
    x = torch.randint(-1000, 1000, (3000,), dtype=torch.int32)
    path = at.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = {"dtype": "int32", "n": at.bucket(x.numel())}
    ek = at._entry_key("sort_keys", "cpu", key)
    if "default_with" in bad:
        default = dict(at._REGISTRY[("sort_keys", "cpu")].default(key))
        assert all(k in default and default[k] == v for k, v in bad["default_with"].items())
        bad = {"config": {**default, **bad["default_with"]}}
    entry = bad.get("entry", {"config": bad.get("config", {}), "time_s": 0.001})
    data = {"metadata": bad["metadata"] if "metadata" in bad else at._metadata(None), "entries": {ek: entry}}
    path.write_text("[" * 100000 if bad.get("nested") else json.dumps(data))
    at.clear_memory_cache()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert torch.equal(pykernels.sort_keys(x), torch.sort(x).values)
    assert any("pykernels.autotune: ignoring" in str(w.message) for w in got), [str(w.message) for w in got]


def test_a_config_tuned_with_a_simd_switch_set_stays_with_that_switch(tmp_cache, monkeypatch):
    """A config measured with a SIMD tier switched off is stored under a key naming the switch, so it is
    not reused once the tier is back (audit: a qmatmul config tuned under PYKERNELS_DISABLE_AVX512=1 ran
    1.7x slower than the default with AVX-512 on, silently); the device id names the CPU's instruction
    sets (one model name, "AMD EPYC", covers CPUs with and without AVX-512)."""
    from pykernels import _native

    rt = _native.cpu_module("runtime")
    tier = "avx512" if rt.cpu_has_avx512() else "avx2" if rt.cpu_has_avx2() else "portable"
    assert at.device_id().split("-")[-1] in (tier, "amx") and tier in at.device_id()
    key = {"dtype": "int32", "n": at.bucket(3000)}
    tunable = at._REGISTRY[("sort_keys", "cpu")]
    default = dict(tunable.default(key))
    other = next(dict(c) for c in tunable.candidates(key) if dict(c) != default)
    plain = at._entry_key("sort_keys", "cpu", key)
    monkeypatch.setenv("PYKERNELS_DISABLE_AVX512", "1")
    switched = at._entry_key("sort_keys", "cpu", key)
    assert switched != plain and "PYKERNELS_DISABLE_AVX512=1" in switched
    at._store(None, switched, {"backend": "cpu", "config": other, "time_s": 1e-6})
    assert at.config_for("sort_keys", "cpu", key, None) == other
    monkeypatch.delenv("PYKERNELS_DISABLE_AVX512")
    assert at._entry_key("sort_keys", "cpu", key) == plain
    assert at.config_for("sort_keys", "cpu", key, None) == default


def test_tune_keeps_its_result_in_memory_when_the_cache_cannot_be_written(tmp_path, monkeypatch):
    """An unwritable cache (PYKERNELS_CACHE_DIR a file here) made tune() raise and throw away what it had
    measured (audit finding): it still raises, and the config holds for this process."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("PYKERNELS_CACHE_DIR", str(blocker))
    at.clear_memory_cache()
    try:
        x = torch.randint(-1000, 1000, (3000,), dtype=torch.int32)
        with pytest.raises(OSError, match="could not write the cache file.*holds in memory for this process only"):
            at.tune("sort_keys", x, budget_s=0.01)
        key = at._REGISTRY[("sort_keys", "cpu")].make_key(x)
        assert at.lookup("sort_keys", key, None, "cpu")["config"] in (
            [dict(at._REGISTRY[("sort_keys", "cpu")].default(key))]
            + [dict(c) for c in at._REGISTRY[("sort_keys", "cpu")].candidates(key)])
        assert torch.equal(pykernels.sort_keys(x), torch.sort(x).values)
    finally:
        at.clear_memory_cache()


@pytest.mark.parametrize("time_s", [float("nan"), -1.0, float("inf")])
def test_cache_entries_whose_time_does_not_order_are_dropped(tmp_cache, time_s):
    """lookup() picks the backend whose entry has the least time_s: a NaN compares as neither less nor
    more, so such an entry made the choice depend on the order of the backends (audit)."""
    path = at.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    ek = at._entry_key("sort_keys", "cpu", {"dtype": "int32", "n": 4096})
    path.write_text(json.dumps({"metadata": at._metadata(None),
                                "entries": {ek: {"backend": "cpu", "config": {"threads": 1}, "time_s": time_s}}}))
    with pytest.warns(UserWarning, match="ignoring 1 invalid entry"):
        assert at.load_cache_file(path) == {}


@pytest.mark.parametrize("config", [{"threads": 1e30}, {"threads": "x"}, {"digit_bits": 8}])
def test_cached_config_of_an_op_without_a_tunable_is_ignored(tmp_cache, config):
    """segmented_sort has no CPU tunable, so no cached CPU config of it can come from tune(): one in the
    file (hand-edited) is ignored with a warning, and the op runs its default (a float thread count raised
    a TypeError from the native call before; audit finding)."""
    keys = torch.randint(0, 2 ** 31 - 1, (70000,), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    offsets = torch.tensor([0, 30000, 70000])
    path = at.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    ek = at._entry_key("segmented_sort", "cpu", {"dtype": "int32", "n": at.bucket(keys.numel()), "segments": 2})
    path.write_text(json.dumps({"metadata": at._metadata(None),
                                "entries": {ek: {"backend": "cpu", "config": config, "time_s": 1e-4}}}))
    at.clear_memory_cache()
    assert ("segmented_sort", "cpu") not in at._REGISTRY
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = pykernels.segmented_sort(keys, offsets, None)
    got_keys = out[0] if isinstance(out, tuple) else out
    want = torch.cat([torch.sort(keys[:30000]).values, torch.sort(keys[30000:]).values])
    assert torch.equal(got_keys, want)
    assert any("no tunable there" in str(w.message) for w in got), [str(w.message) for w in got]


def test_tune_stores_readable_files_through_symlinks_and_reports_unwritable_caches(tmp_cache):
    _register_sleepy()
    real = tmp_cache / "real.json"
    path = at.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    real.write_text("{}")
    path.symlink_to(real)
    at.tune("test_sleepy", torch.zeros(1000), budget_s=0.05)
    assert path.is_symlink() and json.loads(real.read_text())["entries"]  # the link's target got the entry
    # the lock is the target's: two names of one file lock each other out (audit)
    assert Path(str(real) + ".lock").exists() and not Path(str(path) + ".lock").exists()
    assert real.stat().st_mode & 0o044 == 0o044 & ~_umask()  # readable by others as the umask allows
    path.unlink()
    path.mkdir()  # a directory where the file should be: a clear error, no temp file left behind
    at.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError, match="pykernels.autotune: could not write the cache file"):
            at.tune("test_sleepy", torch.zeros(1000), budget_s=0.05)
    assert not list(tmp_cache.glob("*.tmp"))


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_a_table_sees_a_retuned_key():
    """A HashMap caches its configs; storing a new config under an existing key must reach it (fuzz
    finding: only new keys did)."""
    t = pykernels.HashMap(1000)
    k = torch.arange(500)
    t.insert(k, k)
    g0 = at.generation()
    t.find(k)
    at.clear_memory_cache()
    assert at.generation() != g0
    assert t._config_cache["hash_find"][0] != t._tune_state()


def test_concurrent_tuning_processes_keep_every_entry(tmp_cache):
    # Two processes store different keys into the same file at once: both entries survive (file lock).
    code = ("import sys, time, torch, pykernels.autotune as at\n"
            "at.register(at.Tunable(op='test_conc', backend='cpu', make_key=lambda x: {'n': x.numel()},"
            " default=lambda k: {'v': 0}, candidates=lambda k: [{'v': 1}], run=lambda c, x: time.sleep(0.001)))\n"
            "for i in range(20):\n"
            "    at.tune('test_conc', torch.zeros(int(sys.argv[1]) + i * 2), budget_s=0.001)\n")
    env = dict(os.environ, PYKERNELS_CACHE_DIR=str(tmp_cache))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(s)], cwd=ROOT, env=env) for s in (1, 2)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entries = json.loads(at.cache_file().read_text())["entries"]
    assert len([k for k in entries if k.startswith("test_conc|")]) == 40


def test_generate_out_file_keeps_each_devices_entries(tmp_cache, monkeypatch):
    # `generate --out FILE` on a GPU machine tunes CPU and GPU ops: one file (one device's metadata) kept
    # only the last device's entries; the others now go beside it, named by their device
    real = at.device_id
    monkeypatch.setattr(at, "device_id", lambda d=None: real("cpu") if d is None or torch.device(d).type == "cpu"
                        else "cuda-FAKE-sm90")
    monkeypatch.setattr(at, "_metadata", lambda d=None: {"device": at.device_id(d)})
    out = tmp_cache / "out.json"
    monkeypatch.setattr(at, "_OUT_OVERRIDE", out)
    monkeypatch.setattr(at, "_OUT_OWNER", None)
    entry = {"backend": "cpu", "config": {"a": 1}, "time_s": 1.0}
    at._store("cpu", "op|cpu|{}", entry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        at._store(torch.device("meta"), "op|cuda|{}", dict(entry, backend="cuda"))
        at._store("cpu", "op2|cpu|{}", entry)
    assert sorted(json.loads(out.read_text())["entries"]) == ["op2|cpu|{}", "op|cpu|{}"]
    gpu = tmp_cache / "out.cuda-FAKE-sm90.json"
    assert at.cache_file(torch.device("meta")) == gpu
    assert list(json.loads(gpu.read_text())["entries"]) == ["op|cuda|{}"]
    at.clear_memory_cache()


def test_cli_show(tmp_cache):
    _register_sleepy()
    at.tune("test_sleepy", torch.zeros(1000), budget_s=0.05)
    out = subprocess.run([sys.executable, "-m", "pykernels.autotune", "show", str(at.cache_file())],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert "test_sleepy" in out.stdout and '"kind": "fast"' in out.stdout


def test_tune_unknown_op_is_a_clear_error():
    with pytest.raises(ValueError, match="no tunable op 'nope'"):
        at.tune("nope", torch.zeros(3))
    # an op tunable only elsewhere says where, instead of listing itself among the "known ops"
    import pykernels.sort  # noqa: F401 - registers the sort family's tunables

    if ("segmented_sort", "cpu") not in at._REGISTRY:
        with pytest.raises(ValueError, match="'segmented_sort' is not tunable with backend 'auto' on cpu"):
            at.tune("segmented_sort", torch.zeros(3))


def test_tune_examples_are_checked_and_keyed_as_dispatch_keys_them(tmp_cache):
    from pykernels.sort import _key

    # empty examples, unknown or out-of-range keyword arguments: clear errors naming tune or the op (the op's
    # own error where the op refuses the example, as the op gives it)
    with pytest.raises(ValueError, match="autotune.tune: the example arguments of 'sort' are empty"):
        at.tune("sort", torch.empty(0, 5))
    with pytest.raises(TypeError, match="autotune.tune: 'sort_keys' does not take these arguments.*dim"):
        at.tune("sort_keys", torch.arange(10), dim=0)
    with pytest.raises(ValueError, match=r"pykernels.argsort: expected 'dim' in \[-2, 1\].*got 5"):
        at.tune("argsort", torch.zeros(4, 5), dim=5)
    with pytest.raises(ValueError, match=r"'dim' in \[-1, 0\].*got 1"):
        at.tune("sort", torch.zeros(5), dim=1)
    with pytest.raises(TypeError, match="pykernels.sort_pairs: expected a torch.Tensor .* for 'values'"):
        at.tune("sort_pairs", torch.arange(10))  # no values
    # numpy examples are taken as the ops take them
    assert isinstance(at.tune("sort_keys", np.arange(1000, dtype=np.int32)[::-1].copy(), budget_s=0.02), dict)
    # sort along dim 0 is keyed by the rows dispatch sorts (the dim moved last), not the last dim's
    x = torch.randint(0, 100, (64, 3))
    make_key = at._REGISTRY[("sort", "cpu")].make_key
    assert make_key(x, dim=0) == _key("sort", x.movedim(0, -1).contiguous(), rows=at.bucket(3))
    assert make_key(x, dim=0) != make_key(x) and make_key(x, dim=np.int64(-2)) == make_key(x, dim=0)
    at.tune("sort", x, dim=0, budget_s=0.02)
    entries = json.loads(at.cache_file().read_text())["entries"]
    assert at._entry_key("sort", "cpu", make_key(x, dim=0)) in entries, list(entries)


def test_getenv_follows_os_environ(monkeypatch):
    """pykernels._native.getenv reads os.environ's own dict (an unset name costs no KeyError): it must
    see what os.environ.get sees after setenv, a change and delenv (monkeypatch uses os.environ)."""
    from pykernels._native import getenv

    name = "PYKERNELS_TEST_GETENV_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None
    for value in ("1", "0", "", "caf\u00e9"):
        monkeypatch.setenv(name, value)
        assert getenv(name) == os.environ.get(name) == value
    monkeypatch.delenv(name)
    assert getenv(name) is None


def test_tune_checks_the_example_as_the_op_does(tmp_cache):
    """Review findings: tune() ran the kernels on arguments the op rejects (a 4-element payload for 4M
    keys segfaulted, GQA heads that do not divide crashed with SIGFPE, an x of the wrong K was measured and
    cached under the real key), and on an expanded (stride 0) example as is. Now the op's own error comes
    out and nothing is cached; the expanded example is sorted as the op sorts it."""
    import pykernels

    qw = pykernels.quantize(torch.randn(16, 256), 4, 128)
    bad = [
        (ValueError, "sort_pairs: expected 'values' of length", ("sort_pairs", torch.arange(1 << 16), torch.arange(4))),
        (ValueError, "multiple of the key/value heads", ("flash_attention", torch.randn(1, 2, 16, 8),
                                                         torch.randn(1, 4, 16, 8), torch.randn(1, 4, 16, 8))),
        (ValueError, r"qmatmul: expected 'x' of shape \[\.\.\., 256\]", ("qmatmul", torch.randn(1, 512), qw)),
        (TypeError, "qmatmul: expected 'x' of dtype", ("qmatmul", torch.randn(1, 256).double(), qw)),
        (ValueError, "sort_keys: expected 'keys' with 1 dimension", ("sort_keys", torch.randn(64, 64))),
    ]
    for exc, msg, args in bad:
        with pytest.raises(exc, match=msg):
            at.tune(*args, budget_s=0.01)
    assert not at.cache_file().exists()
    keys = torch.tensor([5]).expand(1 << 16)
    cfg = at.tune("sort_keys", keys, budget_s=0.01)
    assert isinstance(cfg, dict) and torch.equal(pykernels.sort_keys(keys), torch.full((1 << 16,), 5))
    with pytest.raises(ValueError, match="collectives.all_reduce.tune"):
        at.tune("all_reduce", torch.zeros(8))


def test_backends_follow_triton_interpret(monkeypatch):
    """Review finding: a status asked for before TRITON_INTERPRET=1 was set stayed "no GPU for triton"."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = _backend.backends()["triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.backends()["triton"].available
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _backend.backends()["triton"] == before


def test_autotune_cli_rejects_bad_arguments_cleanly(tmp_path):
    """Review findings: --sizes 1e30 ended in a traceback, --ops "" and --backends bogus tuned nothing
    and exited 0, a hand-edited non-numeric default_time_s crashed `show`, and an uncreatable cache dir
    gave a bare NotADirectoryError."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYKERNELS_CACHE_DIR=str(tmp_path / "cache"))
    for argv, msg in ((["--ops", "sort", "--sizes", "1e30"], "--sizes: expected sizes in"),
                      (["--ops", ""], "unknown --ops"), (["--ops", "sort", "--backends", "bogus"], "--backends")):
        r = subprocess.run([sys.executable, "-m", "pykernels.autotune", "generate", *argv], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"metadata": {"format": 1}, "entries": {
        'sort_keys|cpu|{"n": 1}': {"config": {"threads": 1}, "time_s": 0.001, "default_time_s": "fast"}}}))
    r = subprocess.run([sys.executable, "-m", "pykernels.autotune", "show", str(bad)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "afile").write_text("")
    env["PYKERNELS_CACHE_DIR"] = str(tmp_path / "afile" / "sub")
    r = subprocess.run([sys.executable, "-c", "import torch, pykernels.autotune as at; "
                        "at.tune('sort_keys', torch.arange(5000, dtype=torch.int32), budget_s=0.01)"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "pykernels.autotune: could not write the cache file" in r.stderr, r.stderr


def test_numpy_field_views_and_unsupported_dtypes():
    """Review findings: a field of a structured array (strides not a multiple of its item size) was refused
    with torch's ValueError; a str array gave torch's TypeError without the op's name."""
    import pykernels

    rec = np.zeros(5, dtype=[("a", np.int8), ("b", np.float32)])
    rec["b"] = [3.0, -1.0, 2.0, 0.5, -7.0]
    assert pykernels.sort(rec["b"]).values.tolist() == [-7.0, -1.0, 0.5, 2.0, 3.0]
    assert rec["b"].tolist() == [3.0, -1.0, 2.0, 0.5, -7.0]
    with pytest.raises(TypeError, match="pykernels.sort: cannot take 'input'"):
        pykernels.sort(np.array(["b", "a"]))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs (more threads than CPUs take the pool)")
def test_native_ops_run_on_torchs_openmp_threads():
    """Our parallel jobs run on the OpenMP threads torch already has (its workers spin-wait after each torch
    op; a pool of our own shared the cores with them and took ~2x as long after any torch op): sorting,
    a hash insert and find, and a qmatmul after a torch op start no thread of their own. With
    PYKERNELS_CPU_THREADS=pool they do (each module's pool starts its worker), which shows the count sees
    them; both give the same results."""
    code = r"""
import os, torch, pykernels
torch.set_num_threads(2)
a = torch.randn(1 << 22); a.add_(1.0)  # torch's OpenMP team exists from here
before = len(os.listdir("/proc/self/task"))
x = torch.randint(0, 1 << 30, (1 << 20,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
v = pykernels.sort(x).values
k = x[:100000].long()
t = pykernels.HashMap(1 << 18); t.insert(k, k); f = t.find(k)[0]
qw = pykernels.quantize(torch.randn(256, 512, generator=torch.Generator().manual_seed(1)), bits=4, group_size=128)
y = pykernels.qmatmul(torch.ones(64, 512), qw)
ok = torch.equal(v, torch.sort(x).values) and torch.equal(f, k)
print(len(os.listdir("/proc/self/task")) - before, ok, float(y.double().sum()))
"""
    runs = {}
    for mode in ("omp", "pool"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYKERNELS_CPU_THREADS=mode)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        new_threads, ok, ysum = out.stdout.split()
        assert ok == "True", mode
        runs[mode] = (int(new_threads), float(ysum))
    assert runs["omp"][0] == 0 and runs["pool"][0] > 0, runs
    assert runs["omp"][1] == runs["pool"][1], runs  # every tid's share ran, whoever ran it


def test_ops_run_in_a_forked_child():
    """A process forked after the native thread pools started (multiprocessing's default start method
    on Linux) runs the native ops (sort, hash tables, qmatmul, the attention decode kernel): the child starts fresh pools (it has none of the parent's worker threads;
    every op with 2+ threads waited for them forever; review finding). Sizes keep torch's own ops
    below its parallel grain and the child compares with numpy: torch's OpenMP regions hang in a child
    forked after the parent ran one (libgomp is not fork-safe; torch's limitation, not ours)."""
    import subprocess
    import sys

    code = r'''
import os, signal, sys, numpy as np, torch, pykernels
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
keys = torch.randint(0, 1 << 40, (1 << 20,), generator=g)
x = torch.randn(1 << 20, generator=g)
qw = pykernels.quantize(torch.randn(256, 512, generator=g), bits=4, group_size=128)
a = torch.randn(64, 512, generator=g)
few = keys[: 30000].clone()
from pykernels.attention import _cpu
qd = torch.randn(1, 8, 1, 64, generator=g)
kd, vd = torch.randn(2, 1, 2, 2048, 64, generator=g).unbind(0)
def run():
    t = pykernels.HashMap(1 << 16)
    t.insert(few, few)
    return [pykernels.sort_keys(keys).numpy().copy(), pykernels.sort(x)[0].numpy().copy(),
            t.find(few)[0].numpy().copy(), pykernels.qmatmul(a, qw).numpy().copy(),
            _cpu.decode_forward(qd, kd, vd, False, 0.125, 2, 1)[0].numpy().copy()]  # split over 2 threads
ref = run()
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a hang ends the child (SIGALRM), which the parent reports
    out = run()
    os._exit(0 if all(np.array_equal(o, r) for o, r in zip(out, ref)) else 3)
_, st = os.waitpid(pid, 0)
sys.exit(0 if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0 else (100 + (os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st))))
'''
    proc = subprocess.run([sys.executable, "-c", code], timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_forked_child_loads_modules_and_makes_tables_on_its_own_threads():
    """A child forked after the parent ran torch's parallel ops: a native module it loads first (the parent
    never sorted: _cpu_sort was not loaded) is told of the fork, and hash tables made, grown and cleared
    there zero their memory on our threads, not torch's OpenMP team (both hung in such a child; review
    finding). (erase ends with a torch op on the batch, find(default=) too: those need
    torch.set_num_threads(1) in such a child, as torch's own ops do; README.)"""
    import subprocess
    import sys

    code = r'''
import os, signal, sys, numpy as np, torch, pykernels
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
x = torch.randn(1 << 20, generator=g)
(x * 2).sum()  # torch's OpenMP team runs from here
keys = torch.randperm(1 << 21, generator=g) * 7919 + 13  # distinct
t0 = pykernels.HashMap(1 << 16); t0.insert(keys[:1000], keys[:1000])  # the parent uses a table, never sorts
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a hang ends the child (SIGALRM), which the parent reports
    ok = np.array_equal(pykernels.sort(x).values.numpy(), np.sort(x.numpy()))
    t = pykernels.HashMap(1 << 20)  # made, then grown past 2M slots
    t.insert(keys, keys)
    ok &= len(t) == 1 << 21 and bool(t.contains(keys).numpy().all())
    bf = pykernels.BloomFilter(1 << 24, 4); bf.add(keys[:100000]); bf.clear()
    t.clear()
    ok &= len(t) == 0 and not t.contains(keys[:100000]).numpy().any()
    os._exit(0 if ok else 3)
_, st = os.waitpid(pid, 0)
sys.exit(0 if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0 else (100 + (os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st))))
'''
    proc = subprocess.run([sys.executable, "-c", code], timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_config_memo_keeps_no_answer_that_a_store_overtook(monkeypatch):
    """config_for reads the cache, then memoizes: a tune() store in between (another thread) cleared the
    memo and bumped the generation, and the older answer written after it was served from then on
    (review finding). It is now returned once but not memoized."""
    import pykernels.autotune as at

    real_lookup = at.lookup

    def lookup_overtaken(*args, **kwargs):
        entry = real_lookup(*args, **kwargs)
        at.clear_memory_cache()  # what a concurrent store does to the memo and the generation
        return entry

    at.clear_memory_cache()
    monkeypatch.setattr(at, "lookup", lookup_overtaken)
    at.config_for("sort_keys", "cpu", {"probe": 1}, torch.device("cpu"))
    assert not at._CONFIG_MEMO
    monkeypatch.setattr(at, "lookup", real_lookup)
    at.config_for("sort_keys", "cpu", {"probe": 1}, torch.device("cpu"))
    assert len(at._CONFIG_MEMO) == 1  # undisturbed: memoized


def test_config_memo_is_bounded(monkeypatch):
    """Audit: the memo of config_for never shrank (qmatmul keys hold N and K exactly: ~1 KiB per weight
    shape a process ever saw). At MAX_CONFIG_MEMO entries it starts over; answers stay the same."""
    import pykernels.autotune as at

    at.clear_memory_cache()
    monkeypatch.setattr(at, "MAX_CONFIG_MEMO", 16)
    first = at.config_for("sort_keys", "cpu", {"probe": 0}, torch.device("cpu"))
    for i in range(100):
        at.config_for("sort_keys", "cpu", {"probe": i}, torch.device("cpu"))
        assert len(at._CONFIG_MEMO) <= 16
    assert at.config_for("sort_keys", "cpu", {"probe": 0}, torch.device("cpu")) == first
    at.clear_memory_cache()


def test_a_worker_thread_the_os_refuses_gives_a_clear_error_and_the_pool_stays_usable():
    """With the address space nearly used up, starting a CPU worker thread fails: the error said only
    "Resource temporarily unavailable" (audit finding); now it names pykernels and what to do, and once
    the limit is lifted the same op runs (the workers already started are kept)."""
    script = r"""
import os, resource, torch, pykernels
x = torch.randint(0, 1 << 30, (1 << 20,), dtype=torch.int32)
pykernels.sort(x)
vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
torch.set_num_threads(3000)
try:
    pykernels.sort(x)
    print("ran")
except RuntimeError as exc:
    print("error:", exc)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
torch.set_num_threads(2)
print("after:", torch.equal(pykernels.sort(x).values, torch.sort(x).values))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    if lines[0] == "ran":
        pytest.skip("this machine started 3000 threads within the limit")
    assert lines[0].startswith("error: pykernels: could not start CPU worker thread"), out.stdout
    assert lines[-1] == "after: True", out.stdout


@pytest.mark.distributed
def test_autotune_cli_counts_the_all_reduce_and_fails_clearly(tmp_path):
    """generate --ops allreduce tunes across a spawned gloo group: the shape it stored is counted, and a
    group it cannot make is a failure with exit status 1 (it said "tuned 0 shape(s)" and exited 0 either
    way; review finding)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYKERNELS_CACHE_DIR=str(tmp_path / "cache"))
    for world, code, out in (("abc", 1, "tuned 0 shape(s)"), ("1", 1, "tuned 0 shape(s)"), ("2", 0, "tuned 1 shape(s)")):
        r = subprocess.run([sys.executable, "-m", "pykernels.autotune", "generate", "--ops", "allreduce", "--sizes",
                            "4096"], env=dict(env, COLLECTIVES_TUNE_WORLD=world), capture_output=True, text=True,
                           timeout=240)
        assert r.returncode == code and out in r.stdout, (world, r.stdout, r.stderr[-2000:])
        if code:
            assert "COLLECTIVES_TUNE_WORLD must be an int >= 2" in r.stderr
    assert any((tmp_path / "cache").glob("*.json"))
    # a cache it cannot write: a failure too (it printed the error and counted the shape as stored)
    (tmp_path / "file").write_text("")
    r = subprocess.run([sys.executable, "-m", "pykernels.autotune", "generate", "--ops", "allreduce", "--sizes",
                        "4096"], env=dict(env, COLLECTIVES_TUNE_WORLD="2", PYKERNELS_CACHE_DIR=str(tmp_path / "file" / "c")),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 1 and "tuned 0 shape(s)" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "could not write the cache file" in r.stdout + r.stderr


def test_tune_checks_examples_as_the_op_and_keys_them_as_the_op(tmp_cache):
    """tune() runs the op's own checks before keying the example (bare errors came from the key function:
    "not enough values to unpack", "'NoneType' object has no attribute ..."), names unknown keyword
    arguments, and keys a numpy or 0-d-tensor act_bits as qmatmul looks it up (the entry was stored under
    "tensor(2)" and never found); a tuned partial bit range of sort_keys is its own key (its config made
    full-width sorts of the shape 3-4.7x slower). Review findings."""
    import numpy as np

    from pykernels import autotune as at

    qw = pykernels.quantize(torch.randn(8, 128), bits=4, group_size=128)
    with pytest.raises(ValueError, match=r"pykernels.qmatmul: expected 'x' of shape \[\.\.\., 128\]"):
        at.tune("qmatmul", torch.randn(1, 64), qw, budget_s=0.01)
    with pytest.raises(ValueError, match="pykernels.flash_attention: expected 'q' with 4 dimensions"):
        at.tune("flash_attention", torch.randn(1, 2, 3), torch.randn(1, 2, 3), torch.randn(1, 2, 3), budget_s=0.01)
    with pytest.raises(TypeError, match="pykernels.sort_pairs: expected a torch.Tensor"):
        at.tune("sort_pairs", torch.arange(100), None, budget_s=0.01)
    with pytest.raises(TypeError, match="pykernels.autotune.tune: 'flash_attention' does not take these arguments"):
        q = torch.randn(1, 2, 4, 8)
        at.tune("flash_attention", q, q, q, bogus=1, budget_s=0.01)
    qb = pykernels.quantize(torch.randn(64, 128), bits=2, group_size=128, scheme="bipolar")
    x = torch.randn(1, 128)
    for act_bits in (np.int64(2), torch.tensor(2)):
        at.clear_memory_cache()
        at.tune("qmatmul", x, qb, act_bits=act_bits, budget_s=0.01)
        entries = at.load_cache_file(at.cache_file())
        assert [k for k in entries if k.startswith("qmatmul|")] == [
            'qmatmul|cpu|{"K": 128, "M": 1, "N": 64, "act_bits": 2, "bits": 2, "dtype": "float32", "group": 128}']
    keys = torch.randint(0, 2 ** 31, (1 << 16,), dtype=torch.int32)
    at.tune("sort_keys", keys, end_bit=8, budget_s=0.01)
    entries = at.load_cache_file(at.cache_file())
    assert 'sort_keys|cpu|{"bits": "0-8", "dtype": "int32", "n": 65536}' in entries
    assert not any(k.startswith("sort_keys|cpu|{\"dtype\"") for k in entries)  # the full-width key untouched
    from pykernels.sort import _key, _bit_range_key

    assert _bit_range_key(keys, 0, 32) == {} and _bit_range_key(keys, 0, None) == {}
    assert at.config_for("sort_keys", "cpu", _key("sort_keys", keys, bits="0-8"), None) is not None


def test_hash_insert_tuning_follows_the_tables_current_size(tmp_cache, monkeypatch):
    """hash_insert is timed on an empty table of the example table's CURRENT capacity (a table grown since
    an earlier tune was timed as its old scratch table), and an example with more keys than such a table
    holds is refused (they were left out, timing nothing). Review finding."""
    from pykernels import autotune as at
    from pykernels.hashing import _tune as HT

    made, real = [], HT._empty_like
    monkeypatch.setattr(HT, "_empty_like", lambda table, window: made.append(table.capacity) or real(table, window))
    cleared, real_setup = [], HT._empty_scratch
    monkeypatch.setattr(at._REGISTRY[("hash_insert", "cpu")], "setup",
                        lambda a, kw: cleared.append(1) or real_setup(a, kw))
    t = pykernels.HashMap(1 << 10)
    k = torch.arange(500)
    t.insert(k, k)
    at.tune("hash_insert", t, k, budget_s=0.01)
    k2 = torch.arange(200_000) * 7
    t.insert(k2, k2)
    at.tune("hash_insert", t, k2, budget_s=0.01)
    assert made[-1] == t.capacity
    # emptied before every run, untimed (its clear() was timed with the insert), and dropped after the tune
    # (a scratch table as large as the user's stayed as long as the table did; audit findings)
    assert len(cleared) > 2 and t not in HT._SCRATCH
    with pytest.raises(ValueError, match="tune on a table sized for them"):
        at.tune("hash_insert", pykernels.HashMap(100), torch.arange(1000), budget_s=0.01)


def test_table_config_memo_sees_a_store_that_lands_during_its_lookup(tmp_cache, monkeypatch):
    """A table memoizes its tuned config under the autotune state read before its lookup: a config stored
    while the lookup ran is picked up by the next call (memoized under the state after it, the table ran
    the old config until some later store; review finding, forced here at that point)."""
    import sys as _sys

    T = _sys.modules["pykernels.hashing._tables"]
    t = pykernels.HashMap(1 << 14)
    key = {"slot_bytes": t._sb, "table_bytes": at.bucket(t.capacity * t._sb)}

    def store(cfg):
        for op in ("hash_find", "hash_insert"):
            at._store(None, at._entry_key(op, "cpu", key), {"backend": "cpu", "config": cfg, "time_s": 1e-6})

    old, new = {"prefetch": 1, "threads": 1}, {"prefetch": 48, "threads": 1}
    store(old)
    t._config_cache.clear()
    assert t._config("hash_find") == old
    real, fired = T._backend.dispatch, []

    def dispatch(*a, **k):
        r = real(*a, **k)
        if not fired:
            fired.append(1)
            store(new)  # another thread's store, right after this lookup read the cache
        return r

    monkeypatch.setattr(T._backend, "dispatch", dispatch)
    t._config_cache.clear()
    t._config("hash_find")
    monkeypatch.setattr(T._backend, "dispatch", real)
    assert fired and t._config("hash_find") == new


def test_environments_sharing_the_cache_dir_keep_their_own_entries(tmp_cache, monkeypatch):
    """Two environments (other torch, triton or pykernels versions) tuning into one cache dir keep their
    own files: with one file per device, each one's store rewrote it without the other's entries (review
    finding)."""
    x = torch.randint(0, 2 ** 31, (4096,), dtype=torch.int32)
    at.tune("sort_keys", x, budget_s=0.01)
    mine = at.cache_file()
    real = at._metadata
    monkeypatch.setattr(at, "_metadata", lambda device: dict(real(device), torch="0.0.1"))
    at.clear_memory_cache()
    other = at.cache_file()
    assert other != mine and "torch0.0.1" in other.name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no foreign file to warn about
        at.tune("sort_keys", torch.randint(0, 2 ** 31, (70000,), dtype=torch.int32), budget_s=0.01)
    monkeypatch.setattr(at, "_metadata", real)
    at.clear_memory_cache()
    assert at.cache_file() == mine
    assert at.lookup("sort_keys", {"dtype": "int32", "n": at.bucket(4096)}, "cpu", "cpu") is not None
    assert list(at.load_cache_file(other, check_metadata=False)) == [
        'sort_keys|cpu|{"dtype": "int32", "n": ' + str(at.bucket(70000)) + "}"]


def test_triton_launchers_make_their_inputs_device_current(monkeypatch):
    """Audit: Triton launches on the current CUDA device (and its stream) and accepts another GPU's
    pointers, so a tensor on cuda:1 with cuda:0 current ran on GPU 0. Every launcher of the op families'
    Triton kernels runs with its first tensor's device current; CPU tensors (the interpreter) untouched."""
    pytest.importorskip("triton")
    import contextlib
    import types

    from pykernels import _triton_util as U
    from pykernels.attention import _triton as attention_triton
    from pykernels.quant import _triton as quant_triton
    from pykernels.sort import _triton as sort_triton

    for launcher in (attention_triton.forward, attention_triton.backward, quant_triton.qmatmul,
                     sort_triton.radix_sort_encoded):
        assert getattr(launcher, "__wrapped__", None) is not None, launcher.__name__
    entered = []

    @contextlib.contextmanager
    def fake_device(dev):
        entered.append(torch.device(dev))
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    seen = []
    launch = U.launches_on_input_device(lambda t, *a: seen.append(a) or "done")
    assert launch(types.SimpleNamespace(device=torch.device("cuda", 1)), 7) == "done"
    assert entered == [torch.device("cuda", 1)] and seen == [(7,)]
    assert launch(torch.zeros(1), 8) == "done" and entered == [torch.device("cuda", 1)]


def test_a_tuned_backend_replaces_the_preferred_one_only_where_that_one_was_tuned_too(tmp_cache, monkeypatch):
    """On a GPU, `auto` takes the fastest tuned backend for a key only where the preferred backend (the
    first of the op's preference) has an entry for it too: an entry of another backend alone was never
    measured against it (review finding: tuning Triton alone moved qmatmul's M=1 calls off the ~3x faster
    CUDA kernel). A GPU faked in-process: backends, device id and the entries in memory."""
    from pykernels import _backend

    ok = _backend.BackendStatus(True, "faked")
    monkeypatch.setattr(_backend, "backends", lambda: {"cpu": ok, "cuda": ok, "triton": ok})
    monkeypatch.setattr(at, "_cuda_device_id", lambda idx: "fake-gpu")
    monkeypatch.setattr(at, "_entries", lambda device, _mem={}: _mem)
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "1")
    dev = torch.device("cuda", 0)
    key = {"m": 1}

    def chosen():
        return _backend.dispatch("test_pref", dev, "auto", key, preference=("cuda", "triton"))[0]

    assert chosen() == "cuda"
    entries = at._entries(dev)
    entries[at._entry_key("test_pref", "triton", key)] = {"backend": "triton", "config": {}, "time_s": 1e-3}
    assert chosen() == "cuda"  # Triton alone: never measured against the CUDA kernel
    entries[at._entry_key("test_pref", "cuda", key)] = {"backend": "cuda", "config": {}, "time_s": 2e-3}
    assert chosen() == "triton"  # both tuned: the faster
    entries[at._entry_key("test_pref", "cuda", key)] = {"backend": "cuda", "config": {}, "time_s": 0.5e-3}
    assert chosen() == "cuda"


def test_autotune_budget_cache_dir_and_times_are_checked(tmp_cache, monkeypatch, tmp_path):
    """budget_s / --budget must be finite seconds > 0 (-5, nan, inf ran); "~" in PYKERNELS_CACHE_DIR is the
    home directory; a 400-digit integer time is a damaged entry, and `show` prints it as "-" (review
    findings)."""
    for bad in (-5, 0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="pykernels.autotune.tune: expected 'budget_s'"):
            at.tune("sort_keys", torch.zeros(10), budget_s=bad)
    for bad in ("-5", "nan", "inf", "x"):
        out = subprocess.run([sys.executable, "-m", "pykernels.autotune", "generate", "--budget", bad],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2 and "--budget" in out.stderr, (bad, out.stderr[-300:])
    monkeypatch.setenv("PYKERNELS_CACHE_DIR", "~/pk-cache-test")
    assert at.cache_file().is_relative_to(Path.home() / "pk-cache-test")
    assert not at._valid_entry({"config": {}, "time_s": 10 ** 400})  # (past float's range)
    assert at._valid_entry({"config": {}, "time_s": 10 ** 3})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"metadata": {}, "entries": {"a|b|c": {"config": {}, "time_s": 10 ** 400,
                                                                        "default_time_s": True}}}))
    out = subprocess.run([sys.executable, "-m", "pykernels.autotune", "show", str(path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-500:]


def test_a_cache_path_that_is_not_a_regular_file_is_ignored(tmp_cache):
    """A FIFO at the cache path hung the first op forever (and every thread behind the lookup lock); a link
    to /dev/zero read until memory ran out. Both are a corrupt cache now: a warning and the heuristics
    (audit finding)."""
    _register_sleepy()
    path = at.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    with pytest.warns(UserWarning, match="not a regular file"):
        assert at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 1024}, "cpu") == {"kind": "default"}
    out = subprocess.run([sys.executable, "-m", "pykernels.autotune", "show"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYKERNELS_CACHE_DIR=str(tmp_cache)))
    assert out.returncode == 1 and "not a regular file" in out.stderr
    at.clear_memory_cache()
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.warns(UserWarning, match="not a regular file"):
        assert at.lookup("test_sleepy", {"n": 1}, "cpu", "cpu") is None


def test_an_entry_tuned_against_another_default_gives_way_to_todays_default(tmp_cache):
    """A tuned config beat the default it was measured with; once the op's heuristic default changes (the
    cache file's name keeps the package version), the new default runs until the op is tuned again
    (audit finding)."""
    _register_sleepy()
    at.tune("test_sleepy", torch.zeros(1000), budget_s=0.05)
    key = {"dtype": "torch.float32", "n": 1024}
    assert at.config_for("test_sleepy", "cpu", key, "cpu") == {"kind": "fast"}
    _register_sleepy(default="slow", cands=("fast", "default"))  # a later version's heuristic
    at.clear_memory_cache()
    assert at.config_for("test_sleepy", "cpu", key, "cpu") == {"kind": "slow"}
    assert at.lookup("test_sleepy", key, "cpu") is None  # nor does it choose the backend (dispatch's lookup)
    _register_sleepy()
    at.clear_memory_cache()
    assert at.config_for("test_sleepy", "cpu", key, "cpu") == {"kind": "fast"}


def test_a_store_waiting_for_another_process_does_not_stall_lookups(tmp_cache):
    """tune() waiting for another process's lock on the cache file held the process-wide lookup lock too:
    every other thread's first lookup of a shape waited with it (12 s behind a 15 s lock; audit finding)."""
    import fcntl
    import threading

    _register_sleepy()
    at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 1}, "cpu")  # the (empty) cache loaded
    path = at.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path.resolve()) + ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # (another descriptor: excludes this process's stores too)
        release = threading.Timer(5.0, fcntl.flock, (held, fcntl.LOCK_UN))  # (the old code waited for this)
        release.start()
        t = threading.Thread(target=at._store, args=("cpu", "test_sleepy|cpu|x", {"config": {}, "time_s": 1.0}))
        t.start()
        try:
            time.sleep(0.5)
            assert t.is_alive()  # waiting for the file lock
            start = time.perf_counter()
            assert at.config_for("test_sleepy", "cpu", {"dtype": "torch.float32", "n": 2048}, "cpu") == {"kind": "default"}
            took = time.perf_counter() - start
        finally:
            release.join()
            t.join(60)
    assert took < 2.0, took


def test_a_cache_path_that_is_a_directory_leaks_no_descriptor(tmp_cache):
    """Loading a cache whose path is a directory closes its descriptor (open(fd) raised and leaked it; review
    finding)."""
    path = at.cache_file()
    path.mkdir(parents=True)
    before = len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(20):
            assert at.load_cache_file(path) == {}
    assert len(os.listdir("/proc/self/fd")) <= before


def test_autotune_helpers_check_their_arguments():
    """bucket(inf) was an OverflowError and bucket(2.5) silently 2's; measure(repeats=0) raised statistics'
    error and measure(warmup=2**63) never returned (audit findings)."""
    assert at.bucket(1000) == 1024 and at.bucket(np.int64(3)) == 4 and at.bucket(0) == 0
    for bad in (float("inf"), 2.5, "8"):
        with pytest.raises(TypeError, match="pykernels.autotune.bucket: expected an int"):
            at.bucket(bad)
    for kw in ({"repeats": 0}, {"warmup": 2 ** 63}, {"warmup": -1}, {"repeats": 2.5}):
        with pytest.raises(ValueError, match="pykernels.autotune.measure: expected"):
            at.measure(lambda: None, **kw)
    assert at.measure(lambda: None, repeats=1) >= 0


def test_cache_dir_that_cannot_be_used_leaves_the_ops_running(tmp_cache, monkeypatch):
    """No home directory (Path.home() raises) or a cache dir this user cannot search (exists() raises): the
    ops run on their heuristic configs with a warning; every op raised on its first call (audit finding)."""
    import pathlib

    from pykernels import autotune as at

    x = torch.randint(0, 1000, (5000,), dtype=torch.int32)
    monkeypatch.delenv("PYKERNELS_CACHE_DIR")
    monkeypatch.setattr(pathlib.Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(
        RuntimeError("Could not determine home directory."))))
    at.clear_memory_cache()
    with pytest.warns(UserWarning, match="cannot use the cache directory: Could not determine home directory"):
        assert torch.equal(pykernels.sort(x).values, torch.sort(x).values)
    monkeypatch.setenv("PYKERNELS_CACHE_DIR", str(tmp_cache))
    real_exists = pathlib.Path.exists

    def exists(self, *a, **kw):
        if str(self).startswith(str(tmp_cache)):
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "exists", exists)
    at.clear_memory_cache()
    with pytest.warns(UserWarning, match="Permission denied"):
        assert torch.equal(pykernels.sort(x).values, torch.sort(x).values)


def test_a_store_keeps_what_it_cannot_read_and_bounds_the_file(tmp_cache, monkeypatch):
    """A cache file that cannot be read is moved aside, not replaced by the one new entry; past the size cap
    the entries tuned longest ago are dropped (a file that grew past it was read as corrupt and every entry
    went at the next store). Audit findings."""
    import json

    from pykernels import autotune as at

    dev = torch.device("cpu")
    path = at.cache_file(dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{ damaged")
    entry = lambda i: {"backend": "cpu", "config": {"x": i}, "time_s": 1.0, "tuned_at": f"2026-01-01T00:00:{i:02d}"}  # noqa: E731
    with pytest.warns(UserWarning, match="could not be read .* moved to .*json.bad"):
        at._store(dev, "op|cpu|k0", entry(0))
    assert path.with_name(path.name + ".bad").read_text() == "{ damaged"
    assert list(json.loads(path.read_text())["entries"]) == ["op|cpu|k0"]
    size_one = path.stat().st_size
    monkeypatch.setattr(at, "MAX_CACHE_FILE_BYTES", size_one + 3 * 120)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(1, 12):
            at._store(dev, f"op|cpu|k{i}", entry(i))
    kept = json.loads(path.read_text())["entries"]
    assert path.stat().st_size <= at.MAX_CACHE_FILE_BYTES and "op|cpu|k11" in kept and "op|cpu|k0" not in kept
    assert 1 < len(kept) < 12 and all(f"op|cpu|k{i}" in kept for i in range(12 - len(kept), 12))


def test_a_store_reads_the_cache_file_once(tmp_cache, monkeypatch):
    """A store parses the existing file once (it read and parsed it a second time to check its metadata and
    entries), keeps its valid entries, and drops the file's entries of other versions as before."""
    import json

    from pykernels import autotune as at

    dev = torch.device("cpu")
    entry = {"backend": "cpu", "config": {"x": 1}, "time_s": 1.0}
    at._store(dev, "op|cpu|k0", entry)
    reads = []
    real = at.read_cache_json
    monkeypatch.setattr(at, "read_cache_json", lambda p: (reads.append(p), real(p))[1])
    at._store(dev, "op|cpu|k1", entry)
    assert len(reads) == 1
    path = at.cache_file(dev)
    assert sorted(json.loads(path.read_text())["entries"]) == ["op|cpu|k0", "op|cpu|k1"]
    data = json.loads(path.read_text())
    data["metadata"]["torch"] = "0.0.0"  # another version's file: its entries are not kept
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="made for other versions"):
        at._store(dev, "op|cpu|k2", entry)
    assert list(json.loads(path.read_text())["entries"]) == ["op|cpu|k2"]


def test_first_op_does_not_import_triton_and_an_off_switch_keeps_the_key():
    """The cache's metadata reads triton's version without importing it (0.35 s of each process's first op);
    PYKERNELS_DISABLE_AVX512=0 (which changes nothing) keys entries as unset (it split the cache). Audit."""
    code = ("import sys, torch, pykernels\nfrom pykernels import autotune as at\n"
            "pykernels.sort_keys(torch.randn(5000)); print('triton' in sys.modules)\n"
            "print(at._entry_key('op', 'cpu', {'n': 1}))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYKERNELS_DISABLE_AVX512="0")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False", 'op|cpu|{"n":', '1}'], (r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-c", code], env=dict(env, PYKERNELS_DISABLE_AVX512="1"), capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.split()[-1] == "1}|PYKERNELS_DISABLE_AVX512=1", r.stdout
