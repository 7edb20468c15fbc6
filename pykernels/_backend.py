"""The one place that decides which backend runs an op, and with which config.

Every public op calls `dispatch(op, device, backend, key)`, which returns (backend_name, config):
  - backend: "cpu" (native C++), "cuda" (native CUDA/HIP), "triton", or "auto";
  - "auto": CPU tensors -> "cpu"; CUDA tensors -> the backend the autotune cache recorded for this
    key, else the op's first preference that can run here;
  - config: autotune cache (memory -> user dir -> shipped file) for this device and key, else the op's
    heuristic default (pykernels.autotune).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad as _forward_ad

from . import _native

BACKENDS = ("cpu", "cuda", "triton")
_BACKEND_NAMES = ("auto", *BACKENDS)
_CPU = torch.device("cpu")


def on_cpu(device: torch.device) -> bool:
    """device.type == "cpu", with the common case first: reading .type costs ~0.5 us a call."""
    return device == _CPU or device.type == "cpu"


@dataclass(frozen=True)
class BackendStatus:
    available: bool
    reason: str

    def __bool__(self):
        return self.available


@functools.lru_cache(maxsize=None)
def _cuda_status() -> BackendStatus:
    if not torch.cuda.is_available():
        why = "torch sees no CUDA device" if torch.version.cuda or torch.version.hip else \
            f"torch {torch.__version__} is a CPU-only build"
        return BackendStatus(False, why)
    mods = [n for n in _native_family_names() if n.startswith("_cuda_")]
    if not mods:
        return BackendStatus(False, "no native CUDA/HIP module was built (nvcc/hipcc not found at build time)")
    mod, why = _native.module_status(mods[0])
    if mod is None:
        return BackendStatus(False, why)
    return BackendStatus(True, f"{torch.cuda.get_device_name()} ({len(mods)} native GPU modules)")


def _triton_status() -> BackendStatus:
    # per value of TRITON_INTERPRET: a status computed before a test (or a user) set it stayed "no GPU
    # for triton (set TRITON_INTERPRET=1 ...)" for the rest of the process (review finding)
    return _triton_status_for(_native.getenv("TRITON_INTERPRET") == "1")


@functools.lru_cache(maxsize=None)
def _triton_status_for(interpret: bool) -> BackendStatus:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return BackendStatus(False, f"triton is not installed ({exc})")
    if interpret:
        return BackendStatus(True, f"triton {triton.__version__} under TRITON_INTERPRET=1 (CPU tensors)")
    if not torch.cuda.is_available():
        return BackendStatus(False, "no GPU for triton (set TRITON_INTERPRET=1 to run its kernels on CPU)")
    return BackendStatus(True, f"triton {triton.__version__} on {torch.cuda.get_device_name()}")


_triton_status.cache_clear = _triton_status_for.cache_clear  # (tests that monkeypatch the environment)


@functools.lru_cache(maxsize=None)
def _cpu_status() -> BackendStatus:
    mods = [n for n in _native_family_names() if n.startswith("_cpu_")]
    if not mods:
        return BackendStatus(False, "no native CPU module is built: run `make build`")
    broken = [why for n in mods for m, why in [_native.module_status(n)] if m is None]
    if broken:
        return BackendStatus(False, "; ".join(broken))
    simd = _cpu_simd_tier("_cpu_runtime" if "_cpu_runtime" in mods else mods[0])
    return BackendStatus(True, f"native C++ ({simd}, {torch.get_num_threads()} threads by default)")


def _cpu_simd_tier(modname: str) -> str:
    """The widest SIMD tier the native kernels use on this CPU (chosen at run time, see pk_common.h)."""
    mod, _ = _native.module_status(modname)
    if getattr(mod, "cpu_has_avx512", lambda: False)():
        return "AVX-512"
    if getattr(mod, "cpu_has_avx2", lambda: False)():
        return "AVX2"
    return "portable (no AVX2)"


def _native_family_names():
    import importlib.machinery
    import pathlib

    here = pathlib.Path(__file__).parent
    return sorted({p.name.split(".", 1)[0] for suffix in importlib.machinery.EXTENSION_SUFFIXES
                   for p in here.glob(f"_c*{suffix}")})


def backends() -> dict:
    """Which backends can run on this build and machine, and why not the others.

    >>> pykernels.backends()
    {'cpu': BackendStatus(available=True, reason='native C++ (AVX-512, 2 threads by default)'), ...}
    """
    return {"cpu": _cpu_status(), "cuda": _cuda_status(), "triton": _triton_status()}


def select_backend(op: str, device: torch.device, backend: str = "auto",
                   supported=BACKENDS, preference=("cuda", "triton")) -> str:
    """Resolve `backend` for an op whose tensors live on `device`. Raises RuntimeError when the
    requested backend cannot run here, naming the op and the reason."""
    if not isinstance(backend, str):  # (a numpy array of "cpu" compared equal to the names and got through)
        raise TypeError(f"pykernels.{op}: expected a str for 'backend', got {type(backend).__name__}")
    if backend not in _BACKEND_NAMES:
        raise ValueError(f"pykernels.{op}: expected backend 'auto', 'cpu', 'cuda' or 'triton', got {backend!r}")
    if backend == "auto":
        if on_cpu(device):
            backend = "cpu"
        elif torch.device(device).type == "meta":
            # not the GPU backends' reasons (review finding: "set TRITON_INTERPRET=1" was the hint here); the
            # public ops give meta outputs through their fakes, so this is reached only by ops whose result
            # depends on the data
            raise RuntimeError(f"pykernels.{op}: no backend computes on the meta device (no data)")
        else:
            for cand in preference:
                if cand in supported and backends()[cand]:
                    backend = cand
                    break
            else:
                raise RuntimeError(f"pykernels.{op}: no backend can run on {device}: "
                                   + "; ".join(f"{b}: {backends()[b].reason}" for b in preference))
    if backend not in supported:
        raise RuntimeError(f"pykernels.{op}: backend {backend!r} is not implemented for this op "
                           f"(available: {', '.join(supported)})")
    if backend == "cpu":
        if not on_cpu(device):
            raise RuntimeError(f"pykernels.{op}: backend 'cpu' needs CPU tensors, got {device}")
    elif backend == "cuda":
        if device.type != "cuda":
            raise RuntimeError(f"pykernels.{op}: backend 'cuda' needs CUDA tensors, got {device}; "
                               f"cuda: {backends()['cuda'].reason}")
        if not backends()["cuda"]:
            raise RuntimeError(f"pykernels.{op}: backend 'cuda' is not available: {backends()['cuda'].reason}")
    elif backend == "triton":
        if not backends()["triton"]:
            raise RuntimeError(f"pykernels.{op}: backend 'triton' is not available: {backends()['triton'].reason}")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"pykernels.{op}: backend 'triton' needs CUDA tensors "
                               "(or TRITON_INTERPRET=1 for CPU tensors)")
    return backend


@functools.lru_cache(maxsize=None)
def _autotune():
    """pykernels.autotune, imported on first use (it imports this module); a function-level import
    statement on every dispatch cost ~1 us of a small call's ~25 us."""
    from . import autotune
    return autotune


def dispatch(op: str, device: torch.device, backend: str = "auto", key: dict | None = None,
             supported=BACKENDS, preference=("cuda", "triton")):
    """(backend, config) for one call: the single decision point of every op."""
    autotune = _autotune()
    if backend == "auto" and key is not None and not on_cpu(device) and device.type == "cuda":
        cached = autotune.lookup(op, key, device)  # (the fastest tuned backend for this key)
        if cached is not None and cached.get("backend") in supported:
            # it replaces the preferred backend only where that one was tuned for the key too: an entry of
            # another backend alone was never measured against it (review finding: tuning Triton alone
            # moved qmatmul's M=1 calls off the ~3x faster CUDA kernel)
            preferred = select_backend(op, device, "auto", supported, preference)
            if cached["backend"] == preferred or autotune.lookup(op, key, device, backend=preferred) is not None:
                backend = cached["backend"]
    chosen = select_backend(op, device, backend, supported, preference)
    config = autotune.config_for(op, chosen, key or {}, device)
    return chosen, config


def _refuse_forward_ad(tensors, op: str):
    """The ops register reverse-mode derivatives only; forward mode (torch.func.jvp / jacfwd, forward_ad
    dual tensors) went through them with its tangents silently dropped: zero derivatives, no error
    (review finding). It is refused with a clear error, as torch's own CPU flash attention does."""
    dual = False
    if _forward_ad._current_level >= 0:
        try:
            dual = any(isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None
                       for t in tensors)
        except RuntimeError:  # a vmapped tensor (no batching rule for _unpack_dual): the stack below says
            pass
    nested = False
    if not dual and torch._C._are_functorch_transforms_active():
        from torch._functorch.pyfunctorch import coerce_cinterpreter, retrieve_all_functorch_interpreters

        jvp = torch._C._functorch.TransformType.Jvp
        if torch.compiler.is_dynamo_compiling():  # (not non-strict torch.export: real Python, stack readable)
            # dynamo cannot trace the whole interpreter stack (retrieve_all_functorch_interpreters: a
            # compiled vmap of any op failed under fullgraph; review finding), but it traces the innermost
            # interpreter: a Jvp there is refused, and one that is alone (level 1) leaves none; under a
            # deeper stack the outer levels, which may hold a Jvp, cannot be read
            inner = coerce_cinterpreter(torch._C._functorch.peek_interpreter_stack())
            dual, nested = inner.key() == jvp, inner.level() > 1
        else:
            dual = any(i.key() == jvp for i in retrieve_all_functorch_interpreters())
    if dual or nested:
        if nested and not dual:
            raise NotImplementedError(f"pykernels.{op}: inside torch.compile, nested torch.func transforms "
                                      f"around this op are not supported (whether one of them is forward-mode "
                                      f"AD cannot be read there); one vmap level is, and nested transforms "
                                      f"applied outside the compiled function are")
        raise NotImplementedError(f"pykernels.{op}: forward-mode AD (torch.func.jvp / jacfwd, forward_ad "
                                  f"dual tensors) is not supported; its tangents would be dropped. Use reverse "
                                  f"mode (backward, torch.func.grad / vjp / jacrev)")


def functorch_autograd(name, setup_context, backward):
    """The registered op torch.ops.pykernels.<name> as the public entries call it outside
    `eager_direct`, made to work under torch.func's reverse-mode transforms (grad, vjp, jacrev, and vmap
    over them).

    torch 2.13's `register_autograd` wraps the formulas in an autograd.Function without a
    `setup_context`, which torch.func refuses ("In order to use an autograd.Function with functorch
    transforms ... it must override the setup_context staticmethod": pytorch/pytorch#168393, fix not
    released). So while a functorch transform is active the call goes through an autograd.Function of
    the same setup_context and backward; its forward is the op (whose batching under vmap is torch's
    per-sample fallback), and its vmap rule is generated from those. Everywhere else: the op itself
    (plain autograd, torch.compile, fake tensors). Inside a torch.compile'd function, one vmap level of
    these ops traces (fullgraph too); grad / vjp / jacrev there hit pytorch#168393 in fake-tensor tracing,
    and nested transforms get eager_direct's error (without fullgraph both graph-break and run).
    backward=None: an op with no derivative (a backward kernel, called from another op's backward), which
    torch.func's first-order transforms still run."""

    def op(*args):  # looked up per call, as the entries did before (tests watch torch.ops)
        return getattr(torch.ops.pykernels, name)(*args)

    class _OpFunction(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*args):
            return op(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            if setup_context is not None:
                setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, *grads):
            if backward is None:
                raise NotImplementedError(f"pykernels.{name}: not differentiable (the derivative of a "
                                          f"backward kernel, i.e. a second derivative of its forward op, "
                                          f"is not implemented)")
            return backward(ctx, *grads)

    _OpFunction.__name__ = _OpFunction.__qualname__ = f"{name}_function"

    def call(*args):
        if torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
            return _OpFunction.apply(*args)
        return op(*args)

    return call


_AUTOCAST_DEVICE_TYPES = frozenset(("cpu", "cuda"))


def autocast_floats(*ts):
    """ts with each floating tensor (float64 excepted) cast to torch.autocast's dtype for its device type
    where autocast is on there, as autocast casts the inputs of F.linear and SDPA; anything else as it is.
    (The ops' eager fast paths call the kernels without the dispatcher, so its Autocast keys never see
    them: under autocast a QuantLinear returned float32 where nn.Linear returns bfloat16, and
    flash_attention refused q from an autocast layer with k, v from a float32 one; audit finding.) Callers
    check torch._C._is_any_autocast_enabled() first (~0.3 us)."""
    out = []
    for t in ts:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            dt = t.device.type
            if dt in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(dt):
                t = t.to(torch.get_autocast_dtype(dt))
        out.append(t)
    return out


@contextlib.contextmanager
def autocast_off():
    """torch.autocast off, on the device types where it is on, for the rest of an op whose inputs
    autocast_floats cast: the exact paths compute in float32 through torch.matmul, which autocast would run
    in bfloat16 (an lse error of 1e-2 instead of 2e-7; SDPA's internals are shielded alike; review finding)."""
    with contextlib.ExitStack() as stack:
        for dt in _AUTOCAST_DEVICE_TYPES:
            if torch.is_autocast_enabled(dt):
                stack.enter_context(torch.autocast(dt, enabled=False))
        yield


def autocast_off_if(on: bool):
    """autocast_off() where `on` (the op cast its inputs under autocast), else a no-op context."""
    return autocast_off() if on else contextlib.nullcontext()


def _traced_or_transformed() -> bool:
    """torch.compile tracing, torch.jit.trace (the eager fast paths call the native code through data
    pointers, which it would not record: a traced sort returned its uninitialized output; audit finding), a
    Python dispatch or torch-function mode, a functorch transform, or forward AD."""
    return bool(torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None
                or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active()
                or _forward_ad._current_level >= 0)


def vmapped_first(t, dim, n: int):
    """For a batching rule (torch.library register_vmap): t with its vmapped dim first, or, not vmapped
    (dim None), n expanded copies of it stacked first (no copy); None stays None."""
    if t is None:
        return None
    return t.unsqueeze(0).expand(n, *t.shape) if dim is None else t.movedim(dim, 0)


def eager_autograd(*tensors) -> bool:
    """True when a differentiable public call whose inputs require grad (where eager_direct said no) may run
    under its own torch.autograd.Function, of the registered op's setup_context and backward, instead of
    through the op: in eager mode (nothing traced or transformed, see _traced_or_transformed) with plain,
    non-meta tensors (nn.Parameter too: _PLAIN_TENSORS). The op stays the path of everything else
    (torch.compile, fake tensors, other subclasses, vmap and torch.func)."""
    if _traced_or_transformed():
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TENSORS or t.is_meta):
            return False
    return True


def eager_autograd_function(name: str, run, setup_context, backward, materialize_grads: bool = True):
    """The torch.autograd.Function an op's eager_autograd calls take: forward runs `run(*inputs)` (the
    registered op's implementation) and the op's own `setup_context`, backward is the op's `backward`; so
    results and gradients are the op's, without its layers (autograd wrapper, redispatch, dynamo's disable
    wrapper, its argument checks again: ~40-90 us a call). Old-style forward(ctx, ...): a separate
    setup_context costs an inspect.signature on every apply. `materialize_grads=False`: an output with no
    gradient gets None in backward, not zeros (backward must take None). `name`: the class's (its graph
    node is <name>Backward)."""

    def forward(ctx, *inputs):
        output = run(*inputs)
        setup_context(ctx, inputs, output)
        if not materialize_grads:
            ctx.set_materialize_grads(False)
        return output

    return type(name, (torch.autograd.Function,), {"__doc__": eager_autograd_function.__doc__,
                                                    "forward": staticmethod(forward),
                                                    "backward": staticmethod(backward)})


def eager_plain(t) -> bool:
    """eager_direct(t) for one tensor that never raises: also False where eager_direct would refuse
    forward-mode AD (a fast path's caller then takes its general path, whose refusal names the op)."""
    if _traced_or_transformed():
        return False
    return type(t) in _PLAIN_TENSORS and not (t.requires_grad and torch.is_grad_enabled())


def fake_on_one_device(opdef):
    """Decorates a registered op's fake: a call with some tensors on the meta device and others not is a
    RuntimeError naming the op. The dispatcher sends such a call to the fake (any meta argument picks the
    Meta kernel), which made its outputs on the first tensor's device: a QuantLinear left on meta returned
    uninitialized CPU memory for a CPU input, with no error (audit finding). Under FakeTensorMode the
    tensors report their real devices, so a traced call is unaffected."""
    name = opdef._qualname.replace("::", ".")

    def decorate(fake):
        @functools.wraps(fake)
        def checked(*args, **kwargs):
            devices = set()
            for a in itertools.chain(args, kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, torch.Tensor):
                        devices.add(t.device)
            if len(devices) > 1 and any(d.type == "meta" for d in devices):
                raise RuntimeError(f"{name}: expected all tensors on one device, got tensors on "
                                   f"{' and '.join(sorted(str(d) for d in devices))}")
            return fake(*args, **kwargs)

        return checked

    return decorate


def eager_direct(*tensors, op: str) -> bool:
    """True when a public call may run its implementation directly instead of through its registered
    torch.library op: the op's dispatch layers cost ~60-100 us a call (6x a 1K-element torch.sort).
    Not while torch.compile traces, nor under a Python dispatch or torch-function mode (fake tensors,
    make_fx, FlopCounter...) or a functorch transform (vmap), nor for tensor subclasses (nn.Parameter
    excepted: _PLAIN_TENSORS) or inputs that need autograd (requires_grad while grad mode is on): those
    go through the op, whose fake and autograd registrations handle them. `op`: the public name its errors give."""
    if _traced_or_transformed():
        _refuse_forward_ad(tensors, op)
        return False
    grad = torch.is_grad_enabled()  # with grad mode off nothing is recorded: requires_grad does not matter
    for t in tensors:  # a plain loop: a generator inside all() costs a frame per tensor on every op call
        # meta tensors too: the op's fake gives their outputs' shapes, as torch's own ops do on meta (a model
        # traced on the meta device; review finding: they raised, unless some input required grad)
        if t is not None and (type(t) not in _PLAIN_TENSORS or (grad and t.requires_grad) or t.is_meta):
            return False
    return True


# Tensors the fast paths take as they are: torch.Tensor, and nn.Parameter exactly (its torch function
# handling is disabled: it computes as a plain tensor). A QuantLinear's bias is a Parameter: every layer
# with a bias went through the registered op even under no_grad (M=1 K=N=128, one thread, 2-core Zen 4:
# 66.6 us against 16.4 us direct, a layer whose GEMV kernel takes ~2.5 us; F.linear 4.2 us).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
