"""collectives.ring_attention / token_ring_attention / shard_sequence / unshard_sequence (issue #6).

Oracle: single-process full attention in float64 (explicit softmax, GQA heads expanded), sharded with
the layout under test. Ranks are real gloo process groups (world sizes 1-4; a schedule bug can pass at
2 and fail at 3), spawned once per world size and reused by every case (spawning is slow on 2 cores);
each group has a 30 s timeout so a schedule bug fails instead of hanging.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pykernels
from collectives import ring_attention, shard_sequence, token_ring_attention, unshard_sequence

pytestmark = pytest.mark.distributed

FNS = {"ring": ring_attention, "token": token_ring_attention}
TOL = {  # (atol, rtol) vs the float64 oracle, forward / gradients
    torch.float64: ((1e-10, 1e-9), (1e-9, 1e-8)),
    torch.float32: ((2e-5, 1e-4), (1e-4, 1e-3)),
    torch.float16: ((3e-3, 3e-3), (1e-2, 1e-2)),
    torch.bfloat16: ((2e-2, 2e-2), (6e-2, 5e-2)),
}


# ------------------------------------------------------------------------------------------ oracle
def oracle(q, k, v, causal, scale):
    """Full attention in float64; returns (out, lse) differentiable in q, k, v."""
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.matmul(q, ke.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.softmax(s, -1), ve), lse


def make_inputs(seed, b, h, hkv, s, d, dtype, kind="randn"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
    do = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    if kind == "equal":  # uniform attention, ties everywhere
        q, k = torch.ones_like(q), torch.ones_like(k)
    elif kind == "large":  # logits in the hundreds: a naive log(exp+exp) merge overflows
        q = q * 12.0
    # the dtype under test is the truth: the oracle sees exactly the rounded values
    return [t.to(dtype) for t in (q, k, v, do)]


def assert_close(name, got, want, tol, ctx):
    atol, rtol = tol
    got = got.detach().cpu()
    err = (got.double() - want).abs()
    bound = atol + rtol * want.abs()
    if not bool((err <= bound).all()) or not bool(torch.isfinite(got).all()):
        raise AssertionError(f"{ctx}: {name} max abs err {err.max().item():.3g} (atol {atol}, rtol {rtol})")


# ------------------------------------------------------------------------------- worker processes
def _worker(rank, world, init_file, inq, outq, backend="gloo"):
    torch.set_num_threads(1)  # up to 4 ranks on 2 cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    while True:
        msg = inq.get()
        if msg is None:
            break
        name, kwargs = msg
        try:
            outq.put((rank, "ok", globals()[name](rank, world, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            outq.put((rank, "err", (type(exc).__name__, str(exc), traceback.format_exc())))
    dist.destroy_process_group()


class Pool:
    """`world` spawned ranks (gloo; nccl: one GPU each) that run named case functions of this module
    on request."""

    def __init__(self, world, backend="gloo"):
        self.world = world
        ctx = mp.get_context("spawn")
        fd, self.init_file = tempfile.mkstemp(prefix="pk_ring_pg_")
        os.close(fd)
        os.unlink(self.init_file)  # the file store creates it
        self.outq = ctx.Queue()
        self.inqs = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, self.init_file, self.inqs[r], self.outq, backend),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run_raw(self, name, timeout=90, **kwargs):
        for q in self.inqs:
            q.put((name, kwargs))
        res = [None] * self.world
        for _ in range(self.world):
            try:
                rank, status, payload = self.outq.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"{name}{kwargs}: no answer from some rank within {timeout} s (hang)")
            res[rank] = (status, payload)
        return res

    def run(self, name, **kwargs):
        res = self.run_raw(name, **kwargs)
        errs = [f"rank {r}: {p[0]}: {p[1]}\n{p[2]}" for r, (st, p) in enumerate(res) if st == "err"]
        if errs:
            raise AssertionError("\n".join(errs))
        return [p for _, p in res]

    def close(self):
        for q in self.inqs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def pool(request):
    p = Pool(request.param)
    yield p
    p.close()


@pytest.fixture(scope="module")
def pool3():
    p = Pool(3)
    yield p
    p.close()


# ---------------------------------------------------------------------------- cases (on each rank)
def case_bench_check(rank, world):
    """The ring benchmark's answer check (bench/suite_ring_attention._check): the real op passes, an
    output 0.1% off (or a dk 0.1% off) fails naming what differs."""
    from bench import suite_ring_attention as S
    from collectives import ring_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 4 * world, 8, generator=gen) for _ in range(4))
    shard = lambda t: shard_sequence(t, layout="zigzag").contiguous()  # noqa: E731
    ql, kl, vl, dol = (shard(t) for t in (q, k, v, do))
    ref = S._reference(q, k, v, do, True, False, True, torch.device("cpu"))

    def scaled_out(*a, **kw):
        return ring_attention(*a, **kw) * 1.001

    def scaled_dk(qg, kg, vg, **kw):
        return ring_attention(qg, kg + (kg - kg.detach()) * 0.001, vg, **kw)  # forward unchanged

    return [S._check(fn, ql, kl, vl, dol, True, True, ref, shard, torch.float32)
            for fn in (ring_attention, scaled_out, scaled_dk)]


def case_attention(rank, world, *, fn, layout, causal, configs, chunk=3, seed=0, scale=None,
                   kind="randn", noncontig=False, piece_bytes=None, force_math=False, subgroup=None,
                   device="cpu", lse_grad=False, compile_backend=None):
    """Every config: forward out + LSE and dq/dk/dv of this rank's shard vs the float64 oracle.
    subgroup: run on a process group of these global ranks only (the others just take part in
    creating it), which checks that group ranks and global ranks are never confused. compile_backend:
    the op (and the shard/unshard around it) through torch.compile(fullgraph=True) with that backend."""
    from collectives import _attention_block as block
    from collectives import _attention_comm as comm

    group = None
    if subgroup is not None:
        group = dist.new_group(subgroup)
        if rank not in subgroup:
            return True
        rank, world = dist.get_rank(group), len(subgroup)

    old_piece, old_fused = comm.PIECE_BYTES, block._CPU_FUSED_DTYPES
    if piece_bytes:
        comm.PIECE_BYTES = piece_bytes
    if force_math:  # the path GPUs take without a fused kernel: exact fp32 math, query-chunked
        block._CPU_FUSED_DTYPES = ()
    try:
        for cfg_i, (dtype_name, b, h, hkv, d) in enumerate(configs):
            dtype = getattr(torch, dtype_name)
            per = 2 * world if layout == "zigzag" else world
            s = per * chunk
            q, k, v, do = make_inputs(seed + cfg_i, b, h, hkv, s, d, dtype, kind)
            sc = 1.0 / math.sqrt(d) if scale is None else scale
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            ref, ref_lse = oracle(q64, k64, v64, causal, sc)
            # lse_grad: the loss also depends on the LSE (as through flash_attention's lse)
            dl = torch.randn(ref_lse.shape, generator=torch.Generator().manual_seed(seed + 99)) if lse_grad else None
            if lse_grad == "lse_only":  # no gradient through out: dO = 0 on every row
                do = torch.zeros_like(do)
            elif lse_grad == "tiny_do":  # |D| / max|dO| huge: a stand-in O would overflow fp16
                do = do * 1e-6
            elif lse_grad == "rank0":  # only rank 0's loss uses its LSE: the other ranks' dlse is None
                mark = shard_sequence(torch.arange(s, dtype=torch.float64), group=group, layout=layout, dim=0)
                owned = unshard_sequence(torch.full_like(mark, float(rank == 0)), group=group, layout=layout, dim=0)
                dl = dl * owned
            if lse_grad:
                torch.autograd.backward([ref, ref_lse], [do.double(), dl.double()])
            else:
                ref.backward(do.double())
            shard = lambda t: shard_sequence(t, group=group, layout=layout).detach()  # noqa: E731
            call = FNS[fn]
            if compile_backend is not None:
                torch._dynamo.reset()
                call = torch.compile(call, fullgraph=True, backend=compile_backend)
                shard = torch.compile(shard, fullgraph=True, backend=compile_backend)
            ql, kl, vl = (shard(t).to(device) for t in (q, k, v))
            if noncontig:  # [B, S, H, D] storage seen as [B, H, S, D]
                ql, kl, vl = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (ql, kl, vl))
                assert not ql.is_contiguous()
            keep = [t.clone() for t in (ql, kl, vl)]
            ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
            out, lse = call(ql, kl, vl, causal=causal, scale=scale, layout=layout, return_lse=True, group=group)
            if lse_grad and (lse_grad != "rank0" or rank == 0):
                torch.autograd.backward([out, lse], [shard(do).to(device), shard(dl).to(device=device, dtype=lse.dtype)])
            else:
                out.backward(shard(do).to(device))
            assert out.device.type == device, out.device
            ctx = f"{fn} W={world} rank {rank} {layout} causal={causal} {dtype_name} H={h} Hkv={hkv} {kind}"
            assert out.dtype == dtype and out.shape == ql.shape, ctx
            assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), ctx
            ftol, gtol = TOL[dtype]
            assert_close("out", out, shard(ref.detach()), ftol, ctx)
            assert_close("lse", lse, shard(ref_lse.detach()), (ftol[0] * 5, ftol[1]), ctx)
            for name, got, want in (("dq", ql.grad, q64.grad), ("dk", kl.grad, k64.grad), ("dv", vl.grad, v64.grad)):
                assert got.dtype == dtype, ctx
                assert_close(name, got, shard(want), gtol, ctx)
            for a, b_ in zip(keep, (ql, kl, vl)):  # inputs never modified
                assert torch.equal(a, b_.detach()), ctx
    finally:
        comm.PIECE_BYTES, block._CPU_FUSED_DTYPES = old_piece, old_fused
    return True


def case_bad_shard(rank, world, *, fn, what):
    """One rank gets bad input; every rank must raise (and then the group must still work)."""
    s = 2 * world * 2
    b, h, d = 1, 2, 4
    q = torch.randn(b, h, s // world, d)
    k, v = q.clone(), q.clone()
    bad_rank = world - 1
    if rank == bad_rank:
        if what == "length":
            q = torch.randn(b, h, s // world + 2, d)
            k, v = q.clone(), q.clone()
        elif what == "dtype":
            q, k, v = q.double(), k.double(), v.double()
        elif what == "heads":
            k, v = k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1)
        elif what == "meta":  # a device gloo cannot move: a clear error everywhere, not a hang
            q, k, v = (t.to("meta") for t in (q, k, v))
        elif what == "headdim0":  # fuzz finding: ZeroDivisionError on this rank, a timeout on the others
            q, k, v = (t[..., :0] for t in (q, k, v))
        elif what == "sparse":  # review finding: failed in the schedule, the other ranks timing out
            q = q.to_sparse()
        elif what == "grad":  # one rank would run backward, the others not: a hang in its schedule
            q = q.requires_grad_()
    call = FNS[fn]
    if what == "op" and rank == bad_rank:  # review finding: ring on some ranks, TokenRing on others hung
        call = FNS["token" if fn == "ring" else "ring"]
    try:
        call(q, k, v, causal=True)
    except (ValueError, TypeError) as exc:
        kind = type(exc).__name__
        msg = str(exc)
    else:
        raise AssertionError("no error raised")
    # the group is still usable afterwards
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    return kind, msg


def case_shard_roundtrip(rank, world, *, layout, dim, length, compile_backend=None):
    if compile_backend is not None:
        torch._dynamo.reset()
        compiled = {f: torch.compile(f, fullgraph=True, backend=compile_backend)
                    for f in (shard_sequence, unshard_sequence)}
        shard_sequence_, unshard_sequence_ = compiled[shard_sequence], compiled[unshard_sequence]
    else:
        shard_sequence_, unshard_sequence_ = shard_sequence, unshard_sequence
    gen = torch.Generator().manual_seed(5)
    shape = [2, 3, 4, 5]
    shape[dim] = length
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    g = torch.randn(*shape, generator=gen, dtype=torch.float64)
    xx = x.clone().requires_grad_()
    local = shard_sequence_(xx, layout=layout, dim=dim)
    n = 2 * world if layout == "zigzag" else world
    c = length // n
    chunks = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
    want = torch.cat([x.narrow(dim, i * c, c) for i in chunks], dim=dim)
    assert torch.equal(local.detach(), want)
    full = unshard_sequence_(local, layout=layout, dim=dim - x.dim())  # negative dim accepted
    assert torch.equal(full.detach(), x)
    (full * g).sum().backward()
    # unshard(shard(x)) is the identity, so is its gradient (x is treated as replicated)
    assert torch.equal(xx.grad, g)
    assert torch.equal(x, xx.detach())
    return True


def case_compiled_bad_input_on_one_rank(rank, world, *, what):
    """Under torch.compile(fullgraph=True) the last rank passes a bad argument: every rank raises (the bad
    one its own error, the others the cross-rank one), none waits for the group's timeout (review finding:
    raised while that rank traced, the others waited in the op's cross-rank check)."""
    bad = rank == world - 1
    q = torch.randn(1, 2, 4, 8)
    torch._dynamo.reset()
    if what == "unshard":
        f = torch.compile(lambda x: unshard_sequence(x, layout="zigzag", dim=0), fullgraph=True, backend="eager")
        args, kw = (torch.randn(3 if bad else 4, 3),), {}
    elif what in ("pair", "pair_length"):  # TokenRing's (group, second group) pair
        f = torch.compile(lambda a, g: token_ring_attention(a, a, a, group=g), fullgraph=True, backend="eager")
        good = (dist.group.WORLD, dist.group.WORLD)
        wrong = (dist.group.WORLD, "not a group") if what == "pair" else (dist.group.WORLD,) * 3
        args, kw = (q, wrong if bad else good), {}
    else:
        f = torch.compile(lambda a, **kw: ring_attention(a, a, a, layout="contiguous", **kw), fullgraph=True,
                          backend="eager")
        args, kw = {"shape": ((q[0] if bad else q,), {}), "causal": ((q,), {"causal": 1 if bad else True}),
                    "dtype": ((q.long() if bad else q,), {}), "scale": ((q,), {"scale": "x" if bad else 0.5})}[what]
    t0 = time.monotonic()
    try:
        f(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - reported
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def case_group_checks(rank, world):
    """The second group TokenRing makes has the user's group's timeout (30 s here; new_group's default
    of 30 min held the other ranks that long after one rank failed mid-schedule), and a 'group' that is
    no process group is a TypeError naming the op (review findings)."""
    from collectives import _attention_comm as comm
    from collectives.topology import _group_timeout

    q = torch.randn(1, 2, 4, 4)
    token_ring_attention(q, q, q)
    out = {"user": _group_timeout(dist.group.WORLD).total_seconds(),
           "second": _group_timeout(comm._SECOND[dist.group.WORLD]).total_seconds()}
    for name, fn in FNS.items():
        for bad in ([0, 1], "world"):
            try:
                fn(q, q, q, group=bad)
            except TypeError as exc:
                out[f"{name} {bad!r}"] = str(exc)
    return out


def case_group_member_and_mismatch_messages(rank, world):
    """A process outside a sub-group is told it is not a member (it got "expected a process group, got int
    -100"); ranks that pass another scale or layout see them as passed (raw bits and indices were shown),
    and a dtype that differs alone is a TypeError (audit findings)."""
    out = {}
    sub = dist.new_group([0])  # (every rank takes part; the others get new_group's non-member value)
    q = torch.randn(1, 2, 4, 4)
    for name, fn in FNS.items():
        if rank != 0:
            try:
                fn(q, q, q, group=sub)
            except RuntimeError as exc:
                out[f"{name} member"] = str(exc)
        else:
            out[f"{name} member"] = "not a member (rank 0 is one)"
        for what, kw in (("scale", dict(scale=0.5 if rank else 0.25)),
                         ("layout", dict(layout="zigzag" if rank else "contiguous")),
                         ("dtype", dict(dtype=torch.float64 if rank else torch.float32))):
            dtype = kw.pop("dtype", torch.float32)
            x = q.to(dtype)
            try:
                fn(x, x, x, **kw)
            except (TypeError, ValueError) as exc:
                out[f"{name} {what}"] = (type(exc).__name__, str(exc))
    return out


def case_token_ring_half_gradients_as_accurate_as_ring(rank, world):
    """Peaked (nearly one-hot) attention in fp16/bf16: TokenRing's dq is as accurate as Ring's. It rebuilt a
    rounded stand-in O from the row deltas it sends, and dP - D cancels almost entirely in such rows: its dq
    was 3-5x noisier, ~1e-3 where the true one was ~1e-9 (audit finding)."""
    res = {}
    for dtype in (torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(5)
        q, k, v, do = (torch.randn(1, 2, 8 * world, 16, generator=g).to(dtype) for _ in range(4))
        q = (q.float() * 100).to(dtype)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref, _ = oracle(q64, k64, v64, True, 0.25)
        ref.backward(do.double())
        sh = lambda t: shard_sequence(t, layout="zigzag").detach()  # noqa: E731
        want = sh(q64.grad)
        errs = []
        for fn in (ring_attention, token_ring_attention):
            ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
            fn(ql, kl, vl, causal=True, scale=0.25).backward(sh(do))
            errs.append(float((ql.grad.double() - want).abs().max()))
        res[str(dtype)] = errs
    return res


def case_shard_backward_mismatch(rank, world, *, what):
    """x differs between ranks (against shard_sequence's contract): the backward raises on every rank
    instead of aborting one process in gloo's all-gather and corrupting the others' gradients (review)."""
    length = 2 * world * (2 if (what == "length" and rank == 0) else 1)
    dtype = torch.float64 if (what == "dtype" and rank == 0) else torch.float32
    x = torch.randn(1, 2, length, 4, dtype=dtype, requires_grad=True)
    local = shard_sequence(x, layout="zigzag")
    try:
        local.sum().backward()
    except (TypeError if what == "dtype" else ValueError) as exc:  # (a dtype alone: TypeError)
        msg = str(exc)
    else:
        raise AssertionError("no error raised")
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works
    assert t.item() == world
    return msg


def case_shard_errors(rank, world):
    out = {}
    x = torch.randn(1, 2, 2 * world + 1, 4)
    for layout in ("zigzag", "contiguous"):
        try:
            shard_sequence(x, layout=layout)
        except ValueError as exc:
            out[layout] = str(exc)
    try:
        shard_sequence(torch.randn(1, 2, 4 * world, 4), layout="diagonal")
    except ValueError as exc:
        out["layout"] = str(exc)
    # unshard with a different shard length on one rank: every rank raises
    local = torch.randn(1, 2, 4 if rank else 6, 4)
    try:
        unshard_sequence(local, layout="contiguous")
    except ValueError as exc:
        out["unshard"] = str(exc)
    local = torch.randn(1, 2, 3, 4)
    try:
        unshard_sequence(local, layout="zigzag")
    except ValueError as exc:
        out["unshard_odd"] = str(exc)
    # shards that differ only past the 8th dim (fuzz finding: gloo aborted the process)
    local = torch.zeros([1] * 8 + [4 if rank else 6])
    try:
        unshard_sequence(local, layout="contiguous", dim=0)
    except ValueError as exc:
        out["unshard_9d"] = str(exc)
    # integer shards of different dtypes (review finding: every non-float dtype had one code, so int64 vs
    # int32 aborted the process in gloo and uint8 vs int8 mixed bytes silently)
    for key, dtypes in (("unshard_int", (torch.int64, torch.int32)), ("unshard_bytes", (torch.uint8, torch.int8))):
        try:
            unshard_sequence(torch.ones(1, 2, 4, 4, dtype=dtypes[rank % 2]), layout="contiguous")
        except TypeError as exc:  # (a dtype alone: TypeError, as the contract has it for a dtype)
            out[key] = str(exc)
    # a sparse tensor on every rank (audit finding: aten's own as_strided error, naming neither)
    for key, f in (("shard_sparse", shard_sequence), ("unshard_sparse", unshard_sequence)):
        try:
            f(torch.randn(1, 2, 4 * world, 4).to_sparse(), layout="contiguous")
        except ValueError as exc:
            out[key] = str(exc)
    return out


def case_negated_views(rank, world):
    """q, k, v given as lazily negated views (only a bit says their memory is negated; the kernels read
    raw memory): the attention of the values they stand for (review finding: that of -q)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (shard_sequence(torch.randn(1, 2, 4 * world, 8, generator=g), layout="zigzag").contiguous()
               for _ in range(3))
    worst = 0.0
    for fn in (ring_attention, token_ring_attention):
        want = fn(-q, -k, -v, causal=True)
        got = fn(torch._neg_view(q), torch._neg_view(k), torch._neg_view(v), causal=True)
        worst = max(worst, float((got - want).abs().max()))
    return worst


def case_attention_errors(rank, world, *, fn):
    out = {}
    q = torch.randn(1, 2, 3, 4)
    for key, call in {
        "odd_zigzag": lambda: FNS[fn](q, q, q, layout="zigzag"),
        "layout": lambda: FNS[fn](q, q, q, layout="striped"),
        "dtype": lambda: FNS[fn](q.int(), q.int(), q.int(), layout="contiguous"),
        "mixed": lambda: FNS[fn](q, q.double(), q, layout="contiguous"),
        "ndim": lambda: FNS[fn](q[0], q[0], q[0], layout="contiguous"),
        "gqa": lambda: FNS[fn](torch.randn(1, 3, 4, 4), q[:, :, :1].expand(1, 2, 4, 4), q[:, :, :1].expand(1, 2, 4, 4)),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            out[key] = (type(exc).__name__, str(exc))
    return out


def case_lse_matches_and_equal_inputs(rank, world, *, fn):
    """Ring and TokenRing agree with each other bit-for-bit-ish on the same shards."""
    q, k, v, _ = make_inputs(11, 1, 4, 2, 4 * world, 8, torch.float32)
    sh = lambda t: shard_sequence(t, layout="zigzag")  # noqa: E731
    a, la = ring_attention(sh(q), sh(k), sh(v), causal=True, return_lse=True)
    b, lb = token_ring_attention(sh(q), sh(k), sh(v), causal=True, return_lse=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(la, lb, atol=1e-6, rtol=1e-5)
    return True


def case_inf_values_as_flash_attention(rank, world, *, fn, layout, causal):
    """An inf in V gives inf in the output entries that read it, as flash_attention on the full sequence
    (merging partials computed out_a - w * (out_a - out_b): inf - inf = NaN on the ranks whose own block
    held it; review finding)."""
    import pykernels

    q, k, v, _ = make_inputs(23, 1, 4, 2, 4 * world, 8, torch.float32)
    v[0, 0, 0, 3], v[0, 1, 1, 5] = float("inf"), float("-inf")  # position 0/1: on rank 0 in either layout
    ref = pykernels.flash_attention(q, k, v, causal=causal)
    sh = lambda x: shard_sequence(x, layout=layout)  # noqa: E731
    got, want = FNS[fn](sh(q), sh(k), sh(v), causal=causal, layout=layout), sh(ref)
    assert torch.equal(torch.isposinf(got), torch.isposinf(want)) and torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert not torch.isnan(got).any() and not torch.isnan(want).any()
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=2e-5, rtol=1e-4)
    return int(torch.isinf(got).sum())


def case_token_ring_group_pairs_that_differ(rank, world, *, what):
    """TokenRing's (group, second group) pair: one rank passing a bad pair, or ranks that disagree on
    whether (or which) second group they pass, raise on every rank at once (the pair was checked on its
    own rank only, and a rank that passed none made its own alone: the others waited until the timeout;
    review finding)."""
    other = dist.new_group(list(range(world)), timeout=timedelta(seconds=30))
    third = dist.new_group(list(range(world)), timeout=timedelta(seconds=30))
    mine = {"bad_second": (None, 1), "bad_length": (dist.group.WORLD, other, other),
            "pair_and_none": dist.group.WORLD, "two_groups": (dist.group.WORLD, third)}[what]
    group = mine if rank == world - 1 else (dist.group.WORLD, other)
    q = torch.randn(1, 2, 4, 4)
    t0 = time.monotonic()
    try:
        token_ring_attention(q, q, q, group=group)
    except (TypeError, ValueError) as exc:
        msg = f"{type(exc).__name__}: {exc}"
    else:
        raise AssertionError("no error raised")
    took = time.monotonic() - t0
    assert token_ring_attention(q, q, q, group=(dist.group.WORLD, other)).shape == q.shape  # the group still works
    for g in (other, third):
        dist.destroy_process_group(g)
    return msg, took


def case_nan_propagates(rank, world, *, fn, layout, causal):
    """A NaN in q, k or v makes every output row that reads it NaN, as pykernels.flash_attention does
    on the full sequence (aten's fused CPU kernels alone return 0 for a NaN query row). Rows that do
    not read it may still be NaN where flash_attention's are (its fused kernels multiply masked-out
    probabilities, 0, by the NaN value), never elsewhere; their finite values match the clean inputs."""
    import pykernels

    out = {}
    for where in ("q", "k", "v"):
        q, k, v, _ = make_inputs(21, 1, 4, 2, 4 * world, 8, torch.float32)
        t = {"q": q, "k": k, "v": v}[where]
        t[0, 1, 3, 2] = float("nan")  # head 1 (kv head 1: query heads 2, 3), position 3, column 2
        n, g = q.shape[2], q.shape[1] // k.shape[1]
        vis = torch.ones(n, n).tril() if causal else torch.ones(n, n)
        kv_nan = (torch.isnan(k) | torch.isnan(v)).any(-1).repeat_interleave(g, 1).float()
        reads = torch.isnan(q).any(-1) | ((vis @ kv_nan.unsqueeze(-1)).squeeze(-1) > 0)  # [B, H, S]
        ref = pykernels.flash_attention(q, k, v, causal=causal)
        clean = pykernels.flash_attention(*(x.nan_to_num(0.0) for x in (q, k, v)), causal=causal)
        sh = lambda x: shard_sequence(x, layout=layout)  # noqa: E731
        got = FNS[fn](sh(q), sh(k), sh(v), causal=causal, layout=layout)
        got_nan, reads_l = torch.isnan(got).any(-1), sh(reads.unsqueeze(-1)).squeeze(-1)
        assert bool(got_nan[reads_l].all()), (where, got_nan, reads_l)
        assert not bool((got_nan & ~torch.isnan(sh(ref)).any(-1)).any()), (where, got_nan)
        torch.testing.assert_close(got[~got_nan], sh(clean)[~got_nan], atol=2e-5, rtol=1e-4)
        out[where] = int(reads_l.sum())
    return out



def case_token_ring_groups_destroyed(rank, world, *, cycles):
    """new_group -> token_ring_attention (forward and backward) -> destroy, again and again, on the
    whole world and (3+ ranks) on a sub-group: TokenRing's second group goes with its group, so the
    groups and fds a rank holds stay flat (it had stayed registered with torch: +1 group, 5 fds and 3
    threads per cycle, out of fds at ulimit 1024 after ~200 cycles; audit). Every next second group of
    the same ranks must connect: destroying them with torch's name for them (ranks + the count of groups
    held) let the next one take a destroyed one's name and store keys and fail to connect or hang. Every
    other cycle rank 0 releases at once while the others still hold theirs a while."""
    from collectives import _group_state

    _group_state.release_destroyed()
    base = len(dist.distributed_c10d._world.pg_map)
    spare = dist.new_group(list(range(world)), timeout=timedelta(seconds=10))
    groups, fds = [], []
    q0 = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    for i in range(cycles):
        members = list(range(world)) if world < 3 or i % 3 else list(range(1, world))
        g = dist.new_group(members, timeout=timedelta(seconds=10))
        if rank in members:
            q = q0.clone().requires_grad_(True)
            out = token_ring_attention(q, q, q, causal=True, group=g)
            out.sum().backward()
            assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
            dist.destroy_process_group(g)
        if i % 2:
            if rank == 0:
                _group_state.note_use(spare)  # spare's first use releases g's second group on rank 0 only
                _group_state._SEEN.pop(spare)
            else:
                time.sleep(0.2)
        groups.append(len(dist.distributed_c10d._world.pg_map))
        fds.append(len(os.listdir("/proc/self/fd")))
    dist.destroy_process_group(spare)
    _group_state.release_destroyed()
    return base, groups, fds, len(dist.distributed_c10d._world.pg_map)


# ------------------------------------------------------------------------------------------- tests
CONFIGS = [("float32", 2, 4, 4, 8), ("float32", 1, 4, 1, 8),   # MHA, MQA
           ("bfloat16", 1, 4, 4, 16), ("bfloat16", 2, 6, 2, 8)]  # MHA, GQA 3:1


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("fn", ["ring", "token"])
def test_matches_float64_oracle(pool, fn, layout, causal):
    pool.run("case_attention", fn=fn, layout=layout, causal=causal, configs=CONFIGS)


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_wrong_size_shard_on_one_rank_errors_everywhere(pool, fn):
    if pool.world == 1:
        pytest.skip("needs two ranks")
    for what, exc in (("length", "ValueError"), ("dtype", "ValueError"), ("heads", "ValueError"),
                      ("meta", "ValueError"), ("headdim0", "ValueError"), ("sparse", "ValueError"),
                      ("grad", "ValueError"), ("op", "ValueError")):
        res = pool.run("case_bad_shard", fn=fn, what=what)
        kinds = {kind for kind, _ in res}
        # the bad rank sees its own error (dtype: TypeError is not raised locally since float64 is a
        # valid dtype; the mismatch is a ValueError everywhere); the others see the cross-rank error
        assert kinds <= {"ValueError", "TypeError"}, res
        own = f"collectives.{'ring' if fn == 'ring' else 'token_ring'}_attention"
        other = f"collectives.{'token_ring' if fn == 'ring' else 'ring'}_attention"
        assert all(own in m for _, m in (res[:-1] if what == "op" else res)), res
        assert what != "op" or (other in res[-1][1] and all("token_ring=" in m for _, m in res)), res
        assert any("every rank" in m or "rank(s)" in m for _, m in res), res


def test_bench_answer_check_fails_a_wrong_output_or_gradient(pool):
    for ok, out_off, grad_off in pool.run("case_bench_check"):
        assert ok is None
        assert out_off.startswith("out: relative error")
        assert grad_off.startswith("dk: relative error"), grad_off


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_roundtrip_and_gradient(pool, layout):
    n = 2 * pool.world if layout == "zigzag" else pool.world
    for dim, length in ((2, 3 * n), (0, n), (3, 0)):
        pool.run("case_shard_roundtrip", layout=layout, dim=dim, length=length)


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_compiled_fullgraph_matches_float64_oracle(pool, fn):
    """torch.compile(fullgraph=True) of the public calls (API.md): dynamo traces them into
    torch.ops.pykernels.ring_attention / shard_sequence (a graph break fails fullgraph), aot_autograd
    takes the registered backward, and the answers and gradients are the eager ones'."""
    for causal, backend, lse_grad in ((True, "aot_eager", True), (False, "eager", False)):
        pool.run("case_attention", fn=fn, layout="zigzag", causal=causal, configs=CONFIGS[1:3],
                 compile_backend=backend, lse_grad=lse_grad)
    pool.run("case_attention", fn=fn, layout="contiguous", causal=True, configs=CONFIGS[3:],
             compile_backend="inductor")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_compiled_shard_unshard_roundtrip_and_gradient(pool, layout):
    n = 2 * pool.world if layout == "zigzag" else pool.world
    pool.run("case_shard_roundtrip", layout=layout, dim=2, length=3 * n, compile_backend="aot_eager")


@pytest.mark.parametrize("what", ["shape", "causal", "dtype", "scale", "unshard", "pair", "pair_length"])
def test_compiled_bad_input_on_one_rank_raises_on_every_rank(pool, what):
    if pool.world == 1:
        pytest.skip("needs two ranks")
    res = pool.run("case_compiled_bad_input_on_one_rank", what=what)
    for rank, (kind, msg, secs) in enumerate(res):
        assert kind in ("TypeError", "ValueError"), (rank, kind, msg)
        assert "collectives." in msg and secs < 20, (rank, msg, secs)
        if rank < pool.world - 1:
            assert "of the group got invalid input" in msg, (rank, msg)


def test_group_checks_and_second_group_timeout(pool):
    if pool.world == 1:
        pytest.skip("needs two ranks")
    for out in pool.run("case_group_checks"):
        assert out["second"] == out["user"] == 30.0, out
        for name in ("ring", "token"):
            for bad in ([0, 1], "world"):
                assert f"collectives.{'ring' if name == 'ring' else 'token_ring'}_attention: expected" in out[f"{name} {bad!r}"]



def test_group_member_and_mismatch_messages(pool):
    if pool.world == 1:
        pytest.skip("needs two ranks")
    for rank, out in enumerate(pool.run("case_group_member_and_mismatch_messages")):
        for name in FNS:
            assert "not a member" in out[f"{name} member"], out
            kind, msg = out[f"{name} scale"]
            assert kind == "ValueError" and "scale=0.25" in msg and "scale=0.5" in msg, msg
            kind, msg = out[f"{name} layout"]
            assert "layout='contiguous'" in msg and "layout='zigzag'" in msg, msg
            kind, msg = out[f"{name} dtype"]
            assert kind == "TypeError" and "dtype=" in msg, (kind, msg)


def test_token_ring_half_gradients_as_accurate_as_ring(pool):
    if pool.world == 1:
        pytest.skip("needs two ranks")
    for res in pool.run("case_token_ring_half_gradients_as_accurate_as_ring"):
        for dtype, (ring_err, token_err) in res.items():
            assert token_err <= 1.5 * ring_err + 1e-6, (dtype, ring_err, token_err)


def test_token_ring_second_groups_destroyed_with_their_group(pool):
    if pool.world == 1:
        pytest.skip("needs two ranks")
    for rank, (base, groups, fds, end) in enumerate(pool.run("case_token_ring_groups_destroyed", cycles=8,
                                                              timeout=60)):
        # a destroyed group's second group is held until the next group's first use (rank 0: at once,
        # every other cycle; a sub-group's non-member: only the sub-group itself): no growth
        assert max(groups) <= base + 2, (rank, base, groups)
        assert fds[-1] <= fds[1] + 2, (rank, fds)
        assert end == base, (rank, base, end)


def test_shard_backward_with_ranks_that_disagree_raises_everywhere(pool):
    if pool.world == 1:
        pytest.skip("needs two ranks")
    for what in ("length", "dtype"):
        for msg in pool.run("case_shard_backward_mismatch", what=what):
            assert "collectives.shard_sequence (backward)" in msg, msg


def test_shard_errors(pool):
    res = pool.run("case_shard_errors")
    for out in res:
        assert "multiple of" in out["zigzag"] and "collectives.shard_sequence" in out["zigzag"]
        if pool.world > 1:
            assert "multiple of" in out["contiguous"]
            assert "collectives.unshard_sequence" in out["unshard"]
            assert "collectives.unshard_sequence" in out["unshard_9d"]
            assert "dtype=int64" in out["unshard_int"] and "dtype=int32" in out["unshard_int"]
            assert "dtype=uint8" in out["unshard_bytes"] and "dtype=int8" in out["unshard_bytes"]
        assert "layout" in out["layout"]
        assert "even" in out["unshard_odd"]
        for key, op in (("shard_sparse", "shard_sequence"), ("unshard_sparse", "unshard_sequence")):
            assert f"collectives.{op}: expected 'x' to be a dense" in out[key] or \
                f"collectives.{op}: expected 'local' to be a dense" in out[key], out[key]


def test_negated_views_give_the_attention_of_their_values(pool):
    assert pool.run("case_negated_views") == [0.0] * pool.world


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_argument_errors(pool3, fn):
    for out in pool3.run("case_attention_errors", fn=fn):
        assert set(out) == {"odd_zigzag", "layout", "dtype", "mixed", "ndim", "gqa"}, out
        assert out["dtype"][0] == "TypeError" and out["mixed"][0] == "TypeError"
        assert out["odd_zigzag"][0] == "ValueError" and "2*world_size" in out["odd_zigzag"][1]


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_more_dtypes_scale_adversarial_noncontiguous(pool3, fn):
    # float16 and float64 (tight tolerance), an explicit scale, non-contiguous shards, tiny pieces
    pool3.run("case_attention", fn=fn, layout="zigzag", causal=True, scale=0.2, noncontig=True,
              configs=[("float64", 1, 2, 1, 8), ("float16", 1, 4, 2, 8)], piece_bytes=64)
    for kind in ("equal", "large"):
        pool3.run("case_attention", fn=fn, layout="zigzag", causal=True, kind=kind,
                  configs=[("float32", 1, 2, 2, 8), ("float64", 1, 2, 1, 4)])
    pool3.run("case_attention", fn=fn, layout="contiguous", causal=True, chunk=1,
              configs=[("float64", 1, 2, 2, 4)])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fn", ["ring", "token"])
def test_gradient_through_the_lse(pool3, fn, causal):
    """A loss that uses the LSE too: dq/dk/dv must include its gradient (dS = P * (dP - (D - dlse)))."""
    for layout in ("zigzag", "contiguous"):
        pool3.run("case_attention", fn=fn, layout=layout, causal=causal, lse_grad=True,
                  configs=[("float32", 1, 4, 2, 8), ("float64", 1, 2, 2, 4)])
    # rows a stand-in O cannot carry D for; and ranks that differ in whether their LSE has a gradient at all
    # (TokenRing's fp16 backward sends O and dlse with the queries: every rank must send the same bundle)
    for mode in ("lse_only", "tiny_do", "rank0"):
        pool3.run("case_attention", fn=fn, layout="zigzag", causal=causal, lse_grad=mode,
                  configs=[("float32", 1, 4, 2, 8), ("float16", 1, 4, 2, 8), ("bfloat16", 1, 2, 2, 8)])


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_math_fallback_path(pool3, fn):
    pool3.run("case_attention", fn=fn, layout="zigzag", causal=True, force_math=True,
              configs=[("float32", 1, 4, 2, 8), ("bfloat16", 1, 4, 4, 8)])


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_subgroup(pool, fn):
    if pool.world < 3:
        pytest.skip("needs three ranks")
    sub = list(range(1, pool.world))  # group rank i = global rank i+1
    pool.run("case_attention", fn=fn, layout="zigzag", causal=True, subgroup=sub,
             configs=[("float32", 1, 4, 2, 8)])


def test_ring_and_token_ring_agree(pool3):
    pool3.run("case_lse_matches_and_equal_inputs", fn="ring")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fn", ["ring", "token"])
def test_nan_rows_propagate_like_flash_attention(pool3, fn, causal):
    for layout in ("zigzag", "contiguous"):
        counts = pool3.run("case_nan_propagates", fn=fn, layout=layout, causal=causal)
        for where in ("q", "k", "v"):  # the NaN reached some output row (on some rank)
            assert sum(c[where] for c in counts) > 0, (where, counts)


@pytest.mark.parametrize("fn", ["ring", "token"])
@pytest.mark.parametrize("causal", [False, True])
def test_inf_values_give_inf_like_flash_attention(pool3, fn, causal):
    for layout in ("zigzag", "contiguous"):
        assert sum(pool3.run("case_inf_values_as_flash_attention", fn=fn, layout=layout, causal=causal)) > 0


@pytest.mark.parametrize("what", ["bad_second", "bad_length", "pair_and_none", "two_groups"])
def test_token_ring_group_pairs_that_differ_raise_on_every_rank(pool3, what):
    results = pool3.run("case_token_ring_group_pairs_that_differ", what=what)
    for rank, (msg, took) in enumerate(results):
        assert "collectives.token_ring_attention" in msg and took < 10, (rank, msg, took)
    if what in ("pair_and_none", "two_groups"):
        assert all("same shard shape and arguments" in m and "back=" in m for m, _ in results), results


# --------------------------------------------------------------------- single process, no dist init
@pytest.mark.parametrize("kind", ["numpy", "numpy_readonly", "numpy_reversed", "dlpack"])
def test_numpy_and_dlpack_inputs(kind):
    """API.md: numpy / DLPack arrays are accepted wherever a tensor is; results are torch tensors."""
    import numpy as np

    class DLPackOnly:  # speaks only DLPack, like a cupy array
        def __init__(self, t):
            self._t = t

        def __dlpack__(self, *args, **kwargs):
            return self._t.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self._t.__dlpack_device__()

    def conv(t):
        if kind == "dlpack":
            return DLPackOnly(t)
        a = t.numpy()
        if kind == "numpy_readonly":
            a.flags.writeable = False
        elif kind == "numpy_reversed":  # negative strides: torch.from_dlpack would abort on them
            a = np.flip(np.flip(a, 2).copy(), 2)
            assert any(st < 0 for st in a.strides)
        return a

    q, k, v, _ = make_inputs(4, 1, 4, 2, 8, 8, torch.float32)
    for name, fn in FNS.items():
        want, want_lse = fn(q, k, v, causal=True, return_lse=True)
        out, lse = fn(conv(q), conv(k), conv(v), causal=True, return_lse=True)
        assert type(out) is torch.Tensor and type(lse) is torch.Tensor, name
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    local = shard_sequence(conv(q), layout="zigzag")
    assert type(local) is torch.Tensor and torch.equal(local, shard_sequence(q, layout="zigzag"))
    full = unshard_sequence(conv(q), layout="zigzag")
    assert type(full) is torch.Tensor and torch.equal(full, q)
    with pytest.raises(TypeError, match="collectives.shard_sequence: expected 'x'"):
        shard_sequence([[1.0, 2.0]])
    with pytest.raises(TypeError, match="collectives.unshard_sequence: expected 'local'"):
        unshard_sequence("abc")
    with pytest.raises(TypeError, match="collectives.ring_attention: expected 'k'"):
        ring_attention(q, object(), v)


@pytest.mark.parametrize("name", ["ring", "token"])
def test_scale_and_flag_errors_as_flash_attention(name):
    # an infinite or float32-overflowing scale gave all-NaN outputs; causal="no" ran a causal mask
    fn = FNS[name]
    q = torch.randn(1, 2, 8, 16)
    for bad in (float("inf"), float("nan"), 1e39, 0.0, -1.0, 10 ** 400):  # 10**400: an OverflowError before
        with pytest.raises(ValueError, match="'scale'"):
            fn(q, q, q, scale=bad)
        if bad not in (0.0, -1.0):  # flash_attention takes any finite scale
            with pytest.raises(ValueError, match="'scale'"):
                pykernels.flash_attention(q, q, q, scale=bad)
    sparse = q.to_sparse()  # failed inside the schedule with an error naming no op (review finding)
    with pytest.raises(ValueError, match=f"collectives.{'ring' if name == 'ring' else 'token_ring'}_attention: "
                                         f"expected 'q' to be a dense"):
        fn(sparse, q, q)
    # a group given without torch.distributed: a clear error, not "Default process group ..." (review)
    with pytest.raises(RuntimeError, match="'group' was given but torch.distributed is not initialized"):
        fn(q, q, q, group=object())
    with pytest.raises(TypeError, match="'scale'"):
        fn(q, q, q, scale="0.5")
    for flag in ("causal", "return_lse"):
        with pytest.raises(TypeError, match=f"expected '{flag}' to be a bool"):
            fn(q, q, q, **{flag: "no"})
    empty = torch.randn(1, 0, 8, 16, requires_grad=True)  # no heads: empty results, as flash_attention
    o0, l0 = fn(empty, empty, empty, causal=True, return_lse=True)
    (o0.sum() + l0.sum()).backward()
    assert o0.shape == (1, 0, 8, 16) and l0.shape == (1, 0, 8) and empty.grad.shape == empty.shape
    out, lse = fn(q, q, q, causal=np.bool_(True), return_lse=np.bool_(True), scale=np.float32(0.25))
    ref, ref_lse = pykernels.flash_attention(q, q, q, causal=True, return_lse=True, scale=0.25)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_world_of_one_without_process_group(fn):
    assert not dist.is_initialized()
    q, k, v, do = make_inputs(3, 2, 4, 2, 10, 8, torch.float32)
    ref, ref_lse = oracle(q.double(), k.double(), v.double(), True, 1 / math.sqrt(8))
    out, lse = FNS[fn](q, k, v, causal=True, layout="contiguous", return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    # zero-length sequence
    e = torch.empty(1, 2, 0, 4, requires_grad=True)
    out = FNS[fn](e, e, e, causal=True)
    assert out.shape == (1, 2, 0, 4)
    out.sum().backward()
    assert e.grad.shape == e.shape
    # zero heads, also on the math path GPUs take without a fused kernel (it divided by Hkv = 0; audit finding)
    from collectives import _attention_block as block

    z = torch.randn(1, 0, 4, 8, dtype=torch.float64)
    for fused in (block._CPU_FUSED_DTYPES, ()):
        old, block._CPU_FUSED_DTYPES = block._CPU_FUSED_DTYPES, fused
        try:
            assert FNS[fn](z, z, z).shape == z.shape
        finally:
            block._CPU_FUSED_DTYPES = old


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_double_backward_is_an_error_not_zeros(fn):
    """create_graph=True (a gradient penalty): the backward is not itself differentiable, so a second
    backward raises, as flash_attention's does (review finding: it returned gradients without a graph,
    and the second-order term came out as zeros)."""
    q, k, v, _ = make_inputs(1, 1, 1, 1, 4, 3, torch.float64)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = FNS[fn](q, k, v, causal=True, layout="contiguous")
    gq, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    assert gq.requires_grad  # still part of a graph, which ends in the error below
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gq.pow(2).sum().backward()


def test_gpu_block_path_only_falls_back_for_unsupported_blocks(monkeypatch):
    """On CUDA, a block goes to the math path only when it is outside the Triton kernels' documented
    limits (checked up front) or the op is not implemented; any other error (a CUDA OOM, a bug) from
    the kernel propagates instead of silently running the O(S^2) math."""
    from collectives import _attention_block as block

    def oom(*args):
        raise RuntimeError("CUDA out of memory")

    def missing(*args):
        raise NotImplementedError("no kernel")

    monkeypatch.setattr(block, "_triton_state", {})
    with pytest.raises(RuntimeError, match="out of memory"):
        block._triton_call("fwd", oom, 1)
    with pytest.raises(ValueError, match="real error"):
        block._triton_call("fwd", lambda *a: (_ for _ in ()).throw(ValueError("real error")))
    assert block._triton_call("bwd", missing) is None and block._triton_state["bwd"] is False
    assert not block._triton_takes("bwd", torch.empty(1, 1, 4, 8), torch.empty(1, 1, 4, 8))  # disabled now
    for shape, dtype in (((1, 1, 4, 8), torch.float64), ((1, 1, 4, 512), torch.float32),
                         ((1, 70000, 1, 8), torch.float32)):
        t = torch.empty(shape, dtype=dtype, device="meta")
        assert not block._triton_takes("fwd", t, t), (shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["ring", "token"])
def test_gpu_world_of_one_nccl(fn, tmp_path):
    """On a GPU machine: NCCL group of one, CUDA tensors, forward and backward against the oracle."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        torch.cuda.set_device(0)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, do = make_inputs(7, 2, 8, 2, 256, 64, dtype)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            ref, ref_lse = oracle(q64, k64, v64, True, 0.125)
            ref.backward(do.double())
            sh = lambda t: shard_sequence(t.cuda(), layout="zigzag").detach()  # noqa: E731
            ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
            out, lse = FNS[fn](ql, kl, vl, causal=True, return_lse=True)
            out.backward(sh(do))
            ftol, gtol = TOL[dtype]
            for name, got, want, tol in (("out", out, ref, ftol), ("lse", lse, ref_lse, ftol),
                                         ("dq", ql.grad, q64.grad, gtol), ("dk", kl.grad, k64.grad, gtol),
                                         ("dv", vl.grad, v64.grad, gtol)):
                assert got.is_cuda
                assert_close(name, got.cpu(), want.detach(), tol, f"{fn} cuda {dtype}")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ schedule properties (no ranks)
from hypothesis import example, given, settings, strategies as st  # noqa: E402

from collectives import _attention_block as blk  # noqa: E402
import importlib  # noqa: E402

ra = importlib.import_module("collectives.ring_attention")  # the module (the package exports the function)


def _positions(layout, w, r, c):
    """Global positions of rank r's shard, chunks of c tokens."""
    chunks = [r] if layout == "contiguous" else [r, 2 * w - 1 - r]
    return [i * c + t for i in chunks for t in range(c)]


@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 9), c=st.integers(1, 3), layout=st.sampled_from(["zigzag", "contiguous"]),
       causal=st.booleans())
def test_blocks_cover_the_mask_exactly_once(w, c, layout, causal):
    """Over all (q rank, kv rank) pairs the blocks cover every (query, key) pair the mask allows
    exactly once and nothing else; a diagonal block's own causal mask must match the global one."""
    s = c * (2 if layout == "zigzag" else 1)
    seen = {}
    for qr in range(w):
        qpos = _positions(layout, w, qr, c)
        for kr in range(w):
            kpos = _positions(layout, w, kr, c)
            for rows, krows, diag in ra._blocks(qr, kr, s, causal, layout):
                for i in range(rows.start, rows.stop):
                    for j in range(krows.start, krows.stop):
                        if diag and j - krows.start > i - rows.start:
                            continue
                        key = (qpos[i], kpos[j])
                        seen[key] = seen.get(key, 0) + 1
    n = w * s
    want = {(i, j) for i in range(n) for j in range(n) if not causal or j <= i}
    assert set(seen) == want and all(v == 1 for v in seen.values())


@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 12), layout=st.sampled_from(["zigzag", "contiguous"]), causal=st.booleans())
def test_token_ring_query_rows_only_shrink_along_the_ring(w, layout, causal):
    """TokenRing forwards only the rows the next holder needs: along Q's path j, j-1, ..., j+1 the
    needed rows must only shrink (else a holder would need rows it never received), and zigzag causal
    ranks after the wrap need exactly the second half."""
    s = 4
    for j in range(w):
        held = slice(0, s)
        for t in range(1, w):
            holder = (j - t) % w
            need = ra._rows_needed(j, holder, s, causal, layout)
            assert held.start <= need.start and need.stop == s
            if causal and layout == "zigzag":
                assert need == (slice(0, s) if holder < j else slice(s // 2, s))
            held = need


@settings(max_examples=100, deadline=None)
@given(a=st.floats(-1e4, 1e4), b=st.floats(-1e4, 1e4))
@example(a=9501.0, b=9499.9997)  # float32(b) = 9500.0: an oracle of the float64 values missed by 1.8e-4
def test_merge_is_stable_for_far_apart_lse(a, b):
    oa, ob = torch.full((1, 1, 1, 2), 1.0), torch.full((1, 1, 1, 2), -2.0)
    la, lb = torch.tensor([[[a]]]), torch.tensor([[[b]]])
    a, b = la.item(), lb.item()  # the oracle from the float32 values merged (near 1e4 they move by ~1e-3)
    o, l = blk.merge(oa, la, ob, lb)
    want_l = max(a, b) + math.log1p(math.exp(-abs(a - b)))
    wa = 1.0 / (1.0 + math.exp(min(700.0, b - a)))
    assert torch.isfinite(o).all() and torch.isfinite(l).all()
    assert abs(l.item() - want_l) <= 1e-3 * max(1.0, abs(want_l))
    assert abs(o[0, 0, 0, 0].item() - (wa * 1.0 + (1 - wa) * -2.0)) < 1e-4
    # a row that has seen nothing yet (lse = -inf) takes the other partial as is
    o, l = blk.merge(oa, torch.tensor([[[float("-inf")]]]), ob, lb)
    assert torch.equal(o, ob) and torch.equal(l, lb)


def test_merge_keeps_infinite_partials():
    """An infinite partial (an inf in V) stays infinite, with its sign, while its weight is a float32 number
    above 0 (flash_attention's probability of it is then too): out_a - w * (out_a - out_b) gave inf - inf =
    NaN (review finding); the finite column is as before."""
    oa, ob = torch.full((1, 1, 1, 2), 1.0), torch.full((1, 1, 1, 2), -2.0)
    inf = float("inf")
    for a, b in ((0.0, 17.0), (17.0, 0.0), (0.0, 80.0), (-3.0, -3.0)):
        la, lb = torch.tensor([[[a]]]), torch.tensor([[[b]]])
        o, _ = blk.merge(torch.tensor([[[[inf, 1.0]]]]), la, torch.tensor([[[[2.0, -2.0]]]]), lb)
        o2, _ = blk.merge(torch.tensor([[[[2.0, 1.0]]]]), lb, torch.tensor([[[[-inf, -2.0]]]]), la)
        assert o[0, 0, 0, 0] == inf and o2[0, 0, 0, 0] == -inf, (a, b)
        assert o[0, 0, 0, 1] == blk.merge(oa, la, ob, lb)[0][0, 0, 0, 0], (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_standin_reproduces_delta(dtype):
    """TokenRing's backward sends D = rowsum(dO * O) instead of O; the kernel gets a stand-in O'."""
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(2, 3, 7, 16, generator=gen)
    do[0, 0, 0] = 0.0                      # a row with no gradient
    do[0, 1] *= 1e-30 if dtype == torch.float32 else 1e-3   # tiny rows (dO^2 underflows in fp32)
    do[1, 0] *= 1e4                        # large rows
    o = torch.randn(2, 3, 7, 16, generator=gen)
    do, o = do.to(dtype), o.to(dtype)
    delta = blk.row_delta(do, o)
    o2 = blk.out_standin(do, delta)
    assert o2.dtype == dtype and torch.isfinite(o2).all()
    got = (do.double() * o2.double()).sum(-1)
    eps = torch.finfo(dtype).eps
    assert ((got - delta.double()).abs() <= delta.double().abs() * eps * 4 + 1e-300).all()
    assert torch.equal(o2[0, 0, 0], torch.zeros(16, dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["ring", "token"])
def test_gpu_nccl_several_ranks(fn):
    """On a machine with 2+ GPUs: NCCL ranks (one GPU each), CUDA tensors, against the oracle."""
    n = min(4, torch.cuda.device_count())
    if n < 2:
        pytest.skip(f"needs 2 GPUs, found {n}")
    p = Pool(n, backend="nccl")
    try:
        for layout, causal in (("zigzag", True), ("contiguous", False), ("contiguous", True)):
            p.run("case_attention", fn=fn, layout=layout, causal=causal, device="cuda", chunk=64,
                  configs=[("float32", 1, 8, 2, 64), ("bfloat16", 2, 8, 8, 64)])
    finally:
        p.close()


def test_shard_sequence_dim_must_be_an_int():
    """dim=1.5, None, "2" raised bare Python errors and True was taken as 1 (audit finding)."""
    x = torch.randn(2, 4, 8)
    for fn in (shard_sequence, unshard_sequence):
        for bad in (1.5, None, "2", True):
            with pytest.raises(TypeError, match="expected an int 'dim'"):
                fn(x, dim=bad)
        with pytest.raises(ValueError, match="0-d tensor"):
            fn(torch.tensor(1.0), dim=0)


@pytest.mark.parametrize("fn", ["ring", "token"])
def test_autocast_casts_the_inputs_as_flash_attention_does(fn):
    """Under torch.autocast the ring ops cast q, k, v as flash_attention and SDPA do (they returned float32,
    and q from an autocast layer with float32 k, v raised; review finding)."""
    assert not dist.is_initialized()
    q, k, v, _ = make_inputs(3, 2, 4, 2, 10, 8, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = FNS[fn](q.bfloat16(), k, v, causal=True, layout="contiguous", return_lse=True)
        ref, ref_lse = pykernels.flash_attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
