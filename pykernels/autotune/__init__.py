"""Autotuning: each op declares its config space; `tune()` measures it on this device and caches the best.

How an op takes part (see pykernels/sort for a full example):

    autotune.register(autotune.Tunable(
        op="sort_keys", group="sort", backend="cpu",
        make_key=lambda keys, **kw: {"dtype": str(keys.dtype), "n": autotune.bucket(keys.numel())},
        default=lambda key: {"digit_bits": 8, "threads": 0},
        candidates=lambda key: [{"digit_bits": b, "threads": 0} for b in (8, 11)],
        run=lambda config, keys, **kw: _sort_keys_impl(keys, config=config, **kw),
        examples=lambda sizes: [((torch.randint(0, 2**31, (n,)),), {}) for n in sizes or [1 << 20]],
    ))

and at call time `pykernels._backend.dispatch()` asks `config_for(op, backend, key, device)`.

Cache: one JSON file per device (CPU model and core count, or GPU name and capability) and versions
(library, torch, triton, CUDA: in the file's name, and in a metadata block checked on load: a mismatch or
a corrupt file is ignored with a warning), so environments sharing the directory keep their own files. Lookup order: memory, the user cache (PYKERNELS_CACHE_DIR, default
~/.cache/pykernels), then the file shipped in pykernels/autotune/shipped/. Writes are atomic (temp
file + rename under a file lock), so several processes can tune at once.

PYKERNELS_AUTOTUNE=0 ignores every cache (heuristic defaults only). The default is always one of the
candidates, and a non-default config is kept only if it beats the default by MIN_GAIN when re-measured
head to head, so a tuned config is never slower than the untuned default on the shape it was tuned for.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import json
import math
import numbers
import operator
import os
import platform
import re
import stat
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import _native

__all__ = ["Tunable", "register", "tune", "cache_file", "config_for", "lookup", "bucket", "registered",
           "device_id", "measure", "load_cache_file", "clear_memory_cache"]

CACHE_FORMAT = 1
MIN_GAIN = 0.03  # a tuned config must beat the default by 3% head to head to replace it
_LOCK = threading.RLock()
MAX_CACHE_FILE_BYTES = 64 << 20  # a cache of ~100K entries; past it a file is not one of ours


def _new_lock_after_fork():
    # a store running in another thread when the process forked left _LOCK held in the child forever
    global _LOCK
    _LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


# ----------------------------------------------------------------------------------------------
# What an op declares
# ----------------------------------------------------------------------------------------------
@dataclass
class Tunable:
    op: str                                    # name of the op (torch.ops.pykernels.<op>)
    backend: str                               # "cpu" | "cuda" | "triton"
    make_key: Callable[..., dict]              # (*args, **kwargs) -> key dict (dtypes, static dims, buckets)
    default: Callable[[dict], dict]            # key -> heuristic config (always a candidate)
    candidates: Callable[[dict], list]         # key -> list of configs to measure
    run: Callable[..., Any]                    # run(config, *args, **kwargs): the op with that config
    examples: Callable[[Optional[list]], list] = lambda sizes: []  # sizes -> [(args, kwargs)] for `generate`
    group: str = ""                            # CLI name: sort, hash, qgemm, attention, allreduce
    # (args, kwargs) -> fresh (args, kwargs) for each run, made before it, untimed (an emptied scratch table)
    setup: Optional[Callable[..., tuple]] = None
    teardown: Optional[Callable[..., Any]] = None  # (args, kwargs) -> None, when tune() is done with them
    # check(*args, backend=..., **kwargs): the op's own argument checks, run by tune() before anything
    # is measured (its error, nothing cached). `run` calls the backends directly, past those checks: an
    # argument the op rejects reached the kernels (review finding: segfaults, SIGFPE, configs cached
    # under keys of another problem). Usually the public op itself, called once on the example.
    check: Optional[Callable[..., Any]] = None
    # An op tuned on every rank of a process group at once (all_reduce): `generate` calls this instead of
    # examples + tune(); sizes -> how many shapes it tuned and stored (raises when it could not).
    generate: Optional[Callable[[Optional[list]], int]] = None

    def __post_init__(self):
        if not self.group:
            self.group = self.op


_REGISTRY: dict[tuple[str, str], Tunable] = {}


def register(tunable: Tunable) -> Tunable:
    _REGISTRY[(tunable.op, tunable.backend)] = tunable
    _CONFIG_MEMO.clear()
    return tunable


def registered(group: Optional[str] = None) -> list[Tunable]:
    _import_ops()
    return [t for t in _REGISTRY.values() if group is None or t.group == group]


def _import_ops():
    import pykernels  # noqa: F401  (importing the package registers every op's tunables)
    with contextlib.suppress(ImportError):
        import collectives  # noqa: F401


def bucket(n: int) -> int:
    """Power-of-two bucket of a dynamic size: configs are shared by sizes within a factor of 2."""
    try:
        n = operator.index(n)
    except TypeError:  # (bucket(inf) was an OverflowError, bucket(2.5) silently 2's; audit finding)
        raise TypeError(f"pykernels.autotune.bucket: expected an int size, got {type(n).__name__} {n!r}") from None
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# Devices and files
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # read once: every op's dispatch asks for the device id
def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _cores() -> int:
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_CPU = torch.device("cpu")


def device_id(device=None) -> str:
    """A file-name-safe id of the device that measurements belong to."""
    if device is None or device == _CPU:  # every CPU op's dispatch: skip the conversion (~1 us)
        return _cpu_device_id()
    device = torch.device(device)
    if device.type == "cuda":
        try:
            idx = device.index if device.index is not None else torch.cuda.current_device()
            return _cuda_device_id(idx)
        except AssertionError:  # (torch's "not compiled with CUDA enabled" came through; audit finding)
            raise RuntimeError(f"pykernels.autotune: no CUDA device for {device} (torch.cuda.is_available() is "
                               f"False)") from None
    return _cpu_device_id()


def _safe(raw: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw).strip("_")


@functools.lru_cache(maxsize=None)  # every op's dispatch asks: compute once per device
def _cpu_device_id() -> str:
    return _safe(f"cpu-{_cpu_model()}-{_cores()}c-{_cpu_features()}")


def _cpu_features() -> str:
    """The instruction sets the CPU kernels run here (as the native modules found them at load, switches
    included): one model name and core count can hide different CPUs (a VM's generic "AMD EPYC" is Zen 2,
    3 or 4), and a config measured with one set can be invalid or slower with another (audit: a qmatmul
    config tuned without AVX-512 ran 1.7x slower than the default where AVX-512 runs)."""
    try:
        runtime = _native.cpu_module("runtime")
    except RuntimeError:  # no native build: nothing it could have measured either
        return "nonative"
    tier = "avx512" if runtime.cpu_has_avx512() else "avx2" if runtime.cpu_has_avx2() else "portable"
    with contextlib.suppress(RuntimeError, AttributeError):
        if _native.cpu_module("qgemm").cpu_has_amx_bf16():
            tier += "-amx"
    return tier


@functools.lru_cache(maxsize=None)
def _cuda_device_id(idx: int) -> str:
    major, minor = torch.cuda.get_device_capability(idx)
    return _safe(f"cuda-{torch.cuda.get_device_name(idx)}-sm{major}{minor}")


@functools.lru_cache(maxsize=None)
def _triton_version() -> Optional[str]:
    # the installed distribution's version, without importing triton (0.35 s of every process's first op);
    # ROCm and nightly torch ship the `triton` package as pytorch-triton(-rocm) (review finding)
    for dist_name in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _metadata(device) -> dict:
    triton_version = _triton_version()
    from pykernels import __version__

    return {"format": CACHE_FORMAT, "device": device_id(device), "pykernels": __version__,
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "hip": torch.version.hip}


def _user_dir() -> Path:
    # (~ expanded: a literal "~" directory under each working directory kept processes apart; review finding)
    return Path(os.environ.get("PYKERNELS_CACHE_DIR") or Path.home() / ".cache" / "pykernels").expanduser()


_OUT_OVERRIDE: Optional[Path] = None  # set by `generate --out FILE`
_OUT_OWNER: Optional[str] = None  # the device whose entries FILE holds (a file holds one device's cache)


def cache_file(device=None) -> Path:
    """Where this device's user cache lives (PYKERNELS_CACHE_DIR moves it). Under `generate --out FILE`,
    FILE for the first device tuned and <FILE stem>.<device id><suffix> beside it for any other: one
    file for all would keep only the last device's entries (each file carries one device's metadata)."""
    global _OUT_OWNER
    if _OUT_OVERRIDE is not None:
        dev = device_id(device)
        if _OUT_OWNER is None:
            _OUT_OWNER = dev
        if dev == _OUT_OWNER:
            return _OUT_OVERRIDE
        return _OUT_OVERRIDE.with_name(f"{_OUT_OVERRIDE.stem}.{dev}{_OUT_OVERRIDE.suffix}")
    return _user_dir() / f"{device_id(device)}.{_versions_tag(device)}.json"


def _versions_tag(device) -> str:
    """The versions a cache file's entries were measured with (its metadata but the device), in its name:
    environments that share the cache dir (two virtualenvs, torch upgraded and rolled back) each keep their
    own file. With one file per device, each one's first store rewrote it without the other's entries
    (review finding: two environments tuning in turn deleted each other's entries)."""
    meta = _metadata(device)
    parts = [f"v{meta['format']}", f"pykernels{meta['pykernels']}", f"torch{meta['torch']}"]
    parts += [f"{k}{meta[k]}" for k in ("triton", "cuda", "hip") if meta.get(k)]
    return _safe("-".join(parts))


def _shipped_file(device=None) -> Path:
    return Path(__file__).parent / "shipped" / f"{device_id(device)}.json"


def _valid_entry(entry) -> bool:
    """The shape every reader relies on: {"config": {...}, "time_s": number, ...}. Whether the config
    is one the op can run is config_for's check (it knows the op's own configs)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        return False
    t = entry.get("time_s", 0.0)
    # a time that orders: lookup() picks the backend with the least (NaN compared as neither; audit), and a
    # float (an integer of 300 digits compared below inf but overflowed float(); review finding)
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return False
    try:
        return 0 <= float(t) < math.inf
    except OverflowError:
        return False


def read_cache_json(path: Path):
    """The parsed JSON of a cache file, read only where it is a regular file of at most MAX_CACHE_FILE_BYTES
    (a FIFO hung the first op, and every thread behind the lookup lock; a link to /dev/zero read until
    memory ran out: audit finding). Raises OSError or ValueError."""
    # O_NONBLOCK: opening a FIFO to read blocks until a writer comes (it means nothing for regular files)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # (of the descriptor read below: no race with a rename)
            raise ValueError("not a regular file")
        fh = open(fd, "rb")
    except BaseException:
        os.close(fd)  # (a directory: open(fd) raised and leaked it; review finding)
        raise
    with fh:
        raw = fh.read(MAX_CACHE_FILE_BYTES + 1)
    if len(raw) > MAX_CACHE_FILE_BYTES:
        raise ValueError(f"past the {MAX_CACHE_FILE_BYTES} bytes a cache file may have")
    return json.loads(raw.decode("utf-8"))


def load_cache_file(path: Path, device=None, check_metadata: bool = True) -> dict:
    """Entries of a cache file; {} (with a warning) when missing, corrupt or made by other versions.
    Malformed entries (a hand-edited or damaged file) are dropped with a warning."""
    path = Path(path)
    try:
        if not path.exists():  # (raises where the directory cannot be searched)
            return {}
        data = read_cache_json(path)
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError: ValueError
        warnings.warn(f"pykernels.autotune: ignoring corrupt cache file {path}: {exc}", stacklevel=3)
        return {}
    return _cache_entries(data, path, device, check_metadata, stacklevel=4)


def _cache_entries(data, path: Path, device, check_metadata: bool = True, stacklevel: int = 3) -> dict:
    """load_cache_file's checks of a file's parsed JSON `data`: its valid entries, {} (with a warning) when
    it is not a cache or was made by other versions."""
    try:
        meta, entries = data["metadata"], data["entries"]
        if not isinstance(meta, dict) or not isinstance(entries, dict):
            raise ValueError("metadata or entries is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"pykernels.autotune: ignoring corrupt cache file {path}: {exc}", stacklevel=stacklevel)
        return {}
    bad = [k for k, e in entries.items() if not _valid_entry(e)]
    if bad:
        warnings.warn(f"pykernels.autotune: ignoring {len(bad)} invalid entr{'y' if len(bad) == 1 else 'ies'} of "
                      f"cache file {path} (e.g. {bad[0]!r})", stacklevel=stacklevel)
        entries = {k: e for k, e in entries.items() if k not in bad}
    if check_metadata:
        want = _metadata(device)
        diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
        if diff:
            warnings.warn(f"pykernels.autotune: ignoring cache file {path} made for other versions: "
                          + ", ".join(f"{k}: {a!r} != {b!r}" for k, (a, b) in diff.items()), stacklevel=stacklevel)
            return {}
    return entries


_MEMORY: dict[str, dict] = {}  # device id -> entries (user cache over shipped cache)


def _entries(device) -> dict:
    dev = device_id(device)
    found = _MEMORY.get(dev)
    if found is not None:  # loaded: no lock (one held by a store or a load must not stall every op's lookup)
        return found
    with _LOCK:
        if dev not in _MEMORY:
            merged = dict(load_cache_file(_shipped_file(device), device))
            try:
                merged.update(load_cache_file(cache_file(device), device))
            except (OSError, RuntimeError) as exc:
                # no home directory (Path.home() raises), a cache dir this user cannot enter: the ops run
                # on their heuristic configs (every op raised on its first call; audit finding)
                warnings.warn(f"pykernels.autotune: cannot use the cache directory: {exc} "
                              f"(PYKERNELS_CACHE_DIR moves it)", stacklevel=3)
            _MEMORY[dev] = merged
        return _MEMORY[dev]


def clear_memory_cache():
    """Forget what was loaded (the next lookup re-reads the files)."""
    global _GENERATION
    with _LOCK:
        _MEMORY.clear()
        _CONFIG_MEMO.clear()
        _GENERATION += 1


def _entry_key(op: str, backend: str, key: dict) -> str:
    """The stored key of (op, backend, key), with the environment switches set now (see _SWITCHES): a config
    measured with a SIMD tier switched off belongs to that setting, not to the default one (audit: one
    tuned under PYKERNELS_DISABLE_AVX512=1 was reused, silently, with AVX-512 back on)."""
    ekey = f"{op}|{backend}|{json.dumps(key, sort_keys=True, default=str)}"
    on = [n for n, value in zip(_SWITCHES, switches()) if _switch_on(n, value)]
    if on:
        ekey += "|" + ",".join(f"{n}=1" for n in on)
    return ekey


def _switch_on(name: str, value: Optional[str]) -> bool:
    """Whether a switch's value changes what runs: the native code reads PYKERNELS_DISABLE_* set when it
    starts with '1' (pk_common.h), TRITON_INTERPRET when it is "1" (_triton_util.interpreting): "0" split the
    cache in two while changing nothing (audit finding)."""
    if not value:
        return False
    if isinstance(value, bytes):  # (switches() gives os.environ's raw values)
        value = value.decode("utf-8", "replace")
    return value == "1" if name == "TRITON_INTERPRET" else value.startswith("1")


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # beside the file written (a symlinked cache: its target), so every name of one file takes one lock
        fh = open(str(path.resolve()) + ".lock", "w")
    except OSError as exc:  # (a bare NotADirectoryError named nothing; review finding)
        raise OSError(f"pykernels.autotune: could not write the cache file {path}: {exc} "
                      f"(PYKERNELS_CACHE_DIR moves the cache)") from exc
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_UMASK = os.umask(0)  # read once, at import (setting it to read it races with threads creating files)
os.umask(_UMASK)


def _store(device, ekey: str, entry: dict) -> Path:
    path = cache_file(device)
    # Only the file lock while waiting for another process's store (under _LOCK, every thread's first
    # lookup of a shape waited with it: an op stalled 12 s behind a tune(); audit finding). Threads of this
    # process exclude each other through it too: flock locks on separate descriptors do.
    with _file_lock(path):
        target = path.resolve()  # a symlinked cache file: write its target, keep the link
        current = _entries_to_keep(path, target, device)
        current[ekey] = entry
        text = _bounded_json(device, current, ekey)
        fd, tmp = tempfile.mkstemp(dir=str(target.parent), prefix=target.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600: a shared or installed cache must be readable
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise OSError(f"pykernels.autotune: could not write the cache file {path}: {exc}") from exc
        _remember(device, ekey, entry)
    return path


def _entries_to_keep(path: Path, target: Path, device) -> dict:
    """The entries a store keeps: the file's own. A file that exists but cannot be read as a cache (damaged,
    or past MAX_CACHE_FILE_BYTES) is moved aside to <name>.bad, not overwritten with the one new entry: every
    entry tuned before was lost that way (audit finding)."""
    if not path.exists():
        return {}
    try:
        data = read_cache_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no entries object")
    except (OSError, ValueError, RecursionError) as exc:
        if not target.is_file():  # a directory or a FIFO there: the write's own error (or replace) follows
            return {}
        bad = target.with_name(target.name + ".bad")
        with contextlib.suppress(OSError):
            os.replace(target, bad)
            warnings.warn(f"pykernels.autotune: cache file {path} could not be read ({exc}); moved to {bad}",
                          stacklevel=4)
        return {}
    return _cache_entries(data, path, device)  # (the text read once: parsed above)


def _bounded_json(device, entries: dict, keep: str) -> str:
    """The cache file's text (compact JSON), within MAX_CACHE_FILE_BYTES: past it the entries tuned longest
    ago are dropped (never `keep`, the one being stored). A file that grew past the cap was refused when read
    and then replaced by a single entry (audit finding)."""
    meta = _metadata(device)
    text = json.dumps({"metadata": meta, "entries": entries}, sort_keys=True, separators=(",", ":"))
    if len(text) <= MAX_CACHE_FILE_BYTES:
        return text
    per_entry = len(text) / max(len(entries), 1)
    room = max(1, int(0.9 * MAX_CACHE_FILE_BYTES / per_entry))  # 10% below the cap: not trimmed at every store
    oldest_first = sorted((k for k in entries if k != keep), key=lambda k: str(entries[k].get("tuned_at", "")))
    kept = {k: entries[k] for k in oldest_first[len(oldest_first) - (room - 1):]} if room > 1 else {}
    kept[keep] = entries[keep]
    warnings.warn(f"pykernels.autotune: the cache file reached {MAX_CACHE_FILE_BYTES} bytes; dropped the "
                  f"{len(entries) - len(kept)} entries tuned longest ago", stacklevel=4)
    return json.dumps({"metadata": meta, "entries": kept}, sort_keys=True, separators=(",", ":"))


def _remember(device, ekey: str, entry: dict):
    """entry in this process's entries of the device (every memoized config re-derived)."""
    global _GENERATION
    with _LOCK:
        _entries(device)[ekey] = entry
        _CONFIG_MEMO.clear()
        _GENERATION += 1


def _enabled() -> bool:
    # "0" is the documented switch; "false"/"off"/"no" read the same (a user tried them: tuning stayed on)
    value = _native.getenv("PYKERNELS_AUTOTUNE")
    return value is None or value.strip().lower() not in ("0", "false", "off", "no")


# ----------------------------------------------------------------------------------------------
# Lookups used by dispatch
# ----------------------------------------------------------------------------------------------
def lookup(op: str, key: dict, device, backend: Optional[str] = None) -> Optional[dict]:
    """The cached entry for (op, key) on this device ({"backend", "config", ...}) or None.
    Without `backend`, the fastest tuned backend for this key."""
    if not _enabled():
        return None
    entries = _entries(device)
    if backend is not None:
        return entries.get(_entry_key(op, backend, key))
    # (an entry tuned against another default than its op's current one does not choose the backend either:
    # config_for would run that backend's untimed new default; review finding)
    found = [e for b in ("cuda", "triton", "cpu") for e in [entries.get(_entry_key(op, b, key))]
             if e and (_REGISTRY.get((op, b)) is None or _same_default(_REGISTRY[(op, b)], key, e))]
    return min(found, key=lambda e: e.get("time_s", math.inf)) if found else None


_CONFIG_MEMO: dict = {}  # (op, backend, frozen key, device id, enabled, switches) -> config; cleared on every store
# and when full (audit: qmatmul's key holds N and K exactly, so a process quantizing ever new weight shapes
# grew it ~1 KiB per shape without end; the ops' own plan caches have the same bound)
MAX_CONFIG_MEMO = 4096
_GENERATION = 0  # bumped by every store and every clear_memory_cache()
# The environment switches that ops' default configs read (SIMD tiers, the Triton interpreter). They are
# part of every memo of a config, so that a default made under one setting is not reused under another
# (a test that disabled AVX-512 left qmatmul's no-AVX-512 default, bf16 "dequant_mm", to later AMX calls).
_SWITCHES = ("PYKERNELS_DISABLE_AVX2", "PYKERNELS_DISABLE_AVX512", "PYKERNELS_DISABLE_AMX", "TRITON_INTERPRET")


switches = _native.env_reader(_SWITCHES)
switches.__doc__ = """The values of the environment switches default configs depend on (see _SWITCHES), as stored
in os.environ (for memo keys: compared, not read)."""
# what a memo of config_for depends on in the environment: PYKERNELS_AUTOTUNE and the switches
_memo_env = _native.env_reader(("PYKERNELS_AUTOTUNE",) + _SWITCHES)


def generation() -> int:
    """Changes whenever this process stores a tuned entry or forgets the loaded cache files: a config
    derived from config_for() and kept by a caller is stale once it differs."""
    return _GENERATION


_SCALARS = (int, float, str, bool, type(None))


def _freeze(value):
    if type(value) is dict and all(type(v) in _SCALARS for v in value.values()):
        return tuple(sorted(value.items()))  # the flat keys every op builds: the common case, fast
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _memo_key(key: dict):
    """The key as a memo key, cheaply: its items in the op's own order when they are hashable (each op
    builds its keys in one order; another order would only be a second memo entry of the same config),
    else frozen. ~0.3 us against ~1.4 for sorting them, on every op's call path."""
    items = tuple(key.items())
    try:
        hash(items)
    except TypeError:
        return _freeze(key)
    return items


def _same_config(a: dict, b: dict) -> bool:
    """a == b with every value of the same type too: 16.0 == 16 and True == 1 in Python, and a cached
    {"BLOCK_M": 16.0} (a hand-edited file, another tool) passed as one of the candidates and crashed the
    Triton kernels it was handed to, which take ints (review finding)."""
    return a.keys() == b.keys() and all(type(v) is type(b[k]) and v == b[k] for k, v in a.items())


def _is_own_config(tunable: Tunable, key: dict, config: dict) -> bool:
    try:
        return (_same_config(config, dict(tunable.default(key)))
                or any(_same_config(config, dict(c)) for c in tunable.candidates(key)))
    except Exception:  # noqa: BLE001 - a key the tunable cannot even describe: not its config
        return False


def _same_default(tunable: Tunable, key: dict, entry: dict) -> bool:
    """Whether the entry was tuned against the op's default of today: a tuned config beat the default it
    was measured with, not necessarily a better one that a later version made the default (the cache file
    is named by the package version, which does not change with every heuristic; audit finding). Entries
    without the record (older files) count as current."""
    recorded = entry.get("default_config")
    if recorded is None:
        return True
    try:
        return isinstance(recorded, dict) and _same_config(recorded, dict(tunable.default(key)))
    except Exception:  # noqa: BLE001 - a key the tunable cannot describe: not current
        return False


def config_for(op: str, backend: str, key: dict, device) -> dict:
    """The config to run: tuned (cache) when there is one for this key, else the op's heuristic.
    Memoized per (op, backend, key, device): this sits on every op's call path."""
    memo_key = (op, backend, _memo_key(key), device_id(device), _memo_env())
    config = _CONFIG_MEMO.get(memo_key)
    if config is None:
        gen = _GENERATION  # a store between the lookup and the memo write below clears the memo first
        entry = lookup(op, key, device, backend)
        tunable = _REGISTRY.get((op, backend))
        config = dict(entry["config"]) if entry is not None else None
        if config is not None and (tunable is None or not _is_own_config(tunable, key, config)):
            # not a config tune() can produce for this key (a hand-edited or damaged cache, or one
            # from another build): the op might reject it, or worse, so the default runs. An op with no
            # tunable on this backend (segmented_sort on the CPU) has no config tune() could have stored:
            # its entry went unchecked into the op before (a float thread count raised; review finding)
            why = "it has no tunable there" if tunable is None else f"not one of its configs for {key}"
            warnings.warn(f"pykernels.autotune: ignoring cached config {config} of {op}/{backend}: {why}",
                          stacklevel=3)
            config = None
        if config is not None and not _same_default(tunable, key, entry):
            config = None  # measured against another default (the op's heuristic changed since): it runs
        if config is None:
            config = dict(tunable.default(key)) if tunable is not None else {}
        with _LOCK:
            # memoized only if no store came in since the lookup: else this (older) answer would stay in
            # the memo the store had just cleared, and every later call would get it (review finding)
            if _GENERATION == gen:
                if len(_CONFIG_MEMO) >= MAX_CONFIG_MEMO:  # a process seeing ever new shapes: start over
                    _CONFIG_MEMO.clear()
                _CONFIG_MEMO[memo_key] = config
    return dict(config)


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------
_L2_FLUSH: dict = {}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], device=None, *, warmup: int = 1, repeats: int = 5,
            budget_s: float = 1.0, prepare: Optional[Callable[[], Any]] = None) -> float:
    """Median seconds of fn(). CPU: wall clock. GPU: CUDA events with the L2 flushed before each run.
    `warmup` calls first (0 to 1000), then up to `repeats` timed ones (1 to 10**6; at least 3 unless
    fewer are asked for) until `budget_s` is spent. `prepare()`, if given, runs before every call, untimed."""
    for name, value, lo, hi in (("warmup", warmup, 0, 1000), ("repeats", repeats, 1, 10 ** 6)):
        # (repeats=0 raised statistics' error, warmup=2**63 never returned; audit finding)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
            raise ValueError(f"pykernels.autotune.measure: expected '{name}' an int in [{lo}, {hi}], got {value!r}")
    if not callable(fn):
        raise TypeError(f"pykernels.autotune.measure: expected a callable 'fn', got {type(fn).__name__}")
    if prepare is not None and not callable(prepare):
        raise TypeError(f"pykernels.autotune.measure: expected a callable 'prepare', got {type(prepare).__name__}")
    prepare = prepare or (lambda: None)
    device = torch.device(device) if device is not None else torch.device("cpu")
    for _ in range(warmup):
        prepare()
        fn()
    _sync(device)
    times = []
    start_all = time.perf_counter()
    for i in range(repeats):
        prepare()
        if device.type == "cuda":
            buf = _L2_FLUSH.setdefault(device, torch.empty(256 << 20, dtype=torch.uint8, device=device))
            buf.zero_()
            # the events go on `device`'s stream, where the ops launch (on their tensors' device); a bare
            # record() uses the current device's, which saw nothing between them for tensors on another GPU
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() - start_all > budget_s:
            break
    return statistics.median(times)


def _device_of(args, kwargs) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _time_config(tunable: Tunable, config: dict, args, kwargs, device, budget_s: float) -> float:
    if tunable.setup is None:
        return measure(lambda: tunable.run(config, *args, **kwargs), device, budget_s=budget_s)
    fresh = [(args, kwargs)]

    def prepare():  # untimed (inside the timed call, a 128 MiB scratch table's clear() was timed, not the insert)
        fresh[0] = tunable.setup(args, kwargs)

    def call():
        a, k = fresh[0]
        return tunable.run(config, *a, **k)
    return measure(call, device, budget_s=budget_s, prepare=prepare)


# what an op's make_key raises on examples it cannot take (wrong types, shapes, keyword arguments)
_EXAMPLE_ERRORS = (TypeError, ValueError, AttributeError, IndexError, RuntimeError)


def tune(op_name: str, *example_args, backend: str = "auto", budget_s: float = 0.5, verbose: bool = False,
         **kwargs) -> dict:
    """Measure every candidate config of `op_name` on these arguments, cache the best, return it.

    >>> cfg = pykernels.autotune.tune("sort_keys", torch.randint(0, 2**31, (1 << 22,)))
    """
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
        raise ValueError(f"pykernels.autotune.tune: expected 'budget_s' a finite number of seconds > 0, got {budget_s!r}")
    _import_ops()
    # numpy (or any DLPack / array-protocol) examples are taken as the ops themselves take them
    from pykernels import _native

    def as_example(a, name):
        if isinstance(a, np.generic):  # a numpy scalar (act_bits=np.int64(2)) is a number, as the ops take it
            return a.item()
        if isinstance(a, torch.Tensor) or not (hasattr(a, "__dlpack__") or hasattr(a, "__array_interface__")):
            return a
        return _native.as_tensor(a, "autotune.tune", name)

    example_args = tuple(as_example(a, f"argument {i}") for i, a in enumerate(example_args))
    kwargs = {k: as_example(v, k) for k, v in kwargs.items()}
    tensors = [a for a in list(example_args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if tensors and all(t.numel() == 0 for t in tensors):
        raise ValueError(f"pykernels.autotune.tune: the example arguments of {op_name!r} are empty; tune on "
                         f"inputs of the sizes the op will run on")
    device = _device_of(example_args, kwargs)
    if backend == "auto":
        from pykernels._backend import backends

        choices = [b for (op, b) in _REGISTRY if op == op_name]
        if device.type == "cpu":
            choices = [b for b in choices if b == "cpu"]
        else:
            choices = [b for b in choices if b != "cpu" and backends()[b]]
    else:
        choices = [backend]
    if not choices or any((op_name, b) not in _REGISTRY for b in choices):
        has = sorted(b for op, b in _REGISTRY if op == op_name)
        if has:  # the op is tunable, not with this backend or on this device
            raise ValueError(f"pykernels.autotune.tune: {op_name!r} is not tunable with backend {backend!r} on "
                             f"{device.type}; it is tunable with backend(s) {', '.join(has)}")
        known = sorted({op for op, _ in _REGISTRY})
        raise ValueError(f"pykernels.autotune.tune: no tunable op {op_name!r} (known ops: {', '.join(known)})")
    best_entry = None
    last_error = None
    store_error = None
    for b in choices:
        tunable = _REGISTRY[(op_name, b)]
        if tunable.check is not None:
            # first: bad examples get the op's own error, as is (make_key, run before, raised bare ones:
            # "not enough values to unpack", "'NoneType' object has no attribute ..."; review finding)
            try:
                inspect.signature(tunable.check).bind(*example_args, backend=b, **kwargs)
                tunable.check(*example_args, backend=b, **kwargs)
            except TypeError as exc:
                if "unexpected keyword argument" not in str(exc) and "positional argument" not in str(exc):
                    raise  # the op's own TypeError, as is
                raise TypeError(f"pykernels.autotune.tune: {op_name!r} does not take these arguments: {exc}") from None
        try:
            key = tunable.make_key(*example_args, **kwargs)
        except _EXAMPLE_ERRORS as exc:
            # the base class (a subclass such as UnicodeDecodeError may not take one message)
            kind = next(t for t in _EXAMPLE_ERRORS if isinstance(exc, t))
            raise kind(f"pykernels.autotune.tune: cannot tune {op_name!r} on these arguments: {exc}") from exc
        default = dict(tunable.default(key))
        if not _enabled():
            # PYKERNELS_AUTOTUNE=0 turns tuning off (API.md): nothing measured or written, the heuristic
            warnings.warn(f"pykernels.autotune.tune: PYKERNELS_AUTOTUNE=0 turns tuning off; {op_name!r} was not "
                          f"measured, its heuristic config is returned", stacklevel=2)
            return default
        configs = [default] + [dict(c) for c in tunable.candidates(key) if dict(c) != default]
        try:
            timed = []
            for cfg in configs:
                try:
                    t = _time_config(tunable, cfg, example_args, kwargs, device, budget_s)
                except Exception as exc:  # a config that cannot run here (too much shared memory, ...)
                    last_error = f"{type(exc).__name__}: {exc}"
                    if verbose:
                        print(f"  {op_name}/{b} {cfg}: failed: {exc}", file=sys.stderr)
                    continue
                timed.append((t, cfg))
                if verbose:
                    print(f"  {op_name}/{b} {cfg}: {t * 1e3:.3f} ms", file=sys.stderr)
            if not timed:
                continue
            t_best, best = min(timed, key=lambda tc: tc[0])
            t_default = next((t for t, c in timed if c == default), math.inf)
            if best != default and math.isfinite(t_default):
                # Confirm head to head, interleaved, so noise cannot make the tuned config slower.
                tb, td = [], []
                try:
                    for _ in range(3):
                        tb.append(_time_config(tunable, best, example_args, kwargs, device, budget_s / 2))
                        td.append(_time_config(tunable, default, example_args, kwargs, device, budget_s / 2))
                    t_best, t_default = statistics.median(tb), statistics.median(td)
                except Exception as exc:  # noqa: BLE001 - ran once, failed now (flaky): not confirmed
                    last_error = f"{type(exc).__name__}: {exc}"
                    t_best = math.inf
                if t_best > t_default * (1 - MIN_GAIN):
                    best, t_best = default, t_default
        finally:
            if tunable.teardown is not None:  # (a scratch table as large as the user's was kept)
                tunable.teardown(example_args, kwargs)
        entry = {"backend": b, "config": best, "time_s": t_best, "default_time_s": t_default,
                 "default_config": default, "candidates": len(configs),
                 "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        ekey = _entry_key(op_name, b, key)
        try:
            _store(device, ekey, entry)
        except OSError as exc:
            # an unwritable cache: what was measured holds for this process (it was thrown away with the
            # error; audit finding), and the error still comes, once every backend is tuned
            _remember(device, ekey, entry)
            store_error = exc
        if best_entry is None or t_best < best_entry["time_s"]:
            best_entry = entry
    if best_entry is None:
        raise RuntimeError(f"pykernels.autotune.tune: every config of {op_name!r} failed on {device}"
                           + (f" (the last: {last_error[:500]})" if last_error else ""))
    if store_error is not None:
        raise OSError(f"{store_error}; the tuned config holds in memory for this process only") from store_error
    return dict(best_entry["config"])
