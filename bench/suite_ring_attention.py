"""Ring and TokenRing attention (issue #6): W ranks (gloo on CPU, NCCL on GPUs) against the same total
work in one process (torch SDPA on the full sequence), plus the bytes each rank sends per step in each
direction.

On CPU the W ranks share this machine's cores: the single process gets min(W, cores) threads and each
rank one, so the ratio shows the schedule's overhead (communication, merging, per-block kernels) rather
than a multi-node speed-up. Direction A is the main group (Ring: K/V and dK/dV to rank r+1; TokenRing:
Q to rank r-1), direction B TokenRing's second group (partials back to their owners).
Every rank's output (and dq/dk/dv) is checked first against its shard of the one-process answer (float64
on CPU); a case that differs on any rank becomes an error row and is not timed.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from datetime import timedelta

import torch

GROUP = "ring_attention"


def _configs(quick: bool, device: str):
    """(world sizes, list of case dicts)."""
    if device == "cuda":
        n = torch.cuda.device_count()
        worlds = [w for w in (1, 2, 4, 8) if w <= n]
        seqs = [4096] if quick else [4096, 16384]
        cases = [dict(b=1, h=16, hkv=hkv, s=s, d=128, dtype="bfloat16", causal=True, bwd=True)
                 for s in seqs for hkv in (16, 4)]
        return worlds, cases
    worlds = [2] if quick else [2, 3, 4]
    s = 384 if quick else 576  # a multiple of 2W for W = 2, 3, 4
    cases = [dict(b=1, h=8, hkv=8, s=s, d=64, dtype="float32", causal=True, bwd=True),   # MHA
             dict(b=1, h=8, hkv=2, s=s, d=64, dtype="float32", causal=True, bwd=False)]  # GQA 4:1
    return worlds, cases


def _count_bytes(fn, grp_main):
    """Bytes this rank sends during fn(), per process group (A: the main group, B: any other)."""
    from collectives import _attention_comm as comm

    counts = {"A": 0, "B": 0}
    real = comm.post

    def counting(grp, sends, recvs, pg=None):
        key = "A" if pg is None or pg is grp_main else "B"
        counts[key] += sum(t.numel() * t.element_size() for t, _, _ in sends)
        return real(grp, sends, recvs, pg)

    comm.post = counting
    try:
        fn()
    finally:
        comm.post = real
    return counts


# relative error ||ours - reference|| / ||reference|| allowed per input dtype (the reference is float64
# attention on CPU; on a GPU, SDPA in the input dtype: float64 scores of S=16K would not fit)
CHECK_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def _reference(q, k, v, do, causal, gqa, bwd, dev):
    """The one-process answer: (out, (dq, dk, dv) or None) of the full sequence."""
    import torch.nn.functional as F

    wide = torch.float64 if dev.type == "cpu" else q.dtype
    qr, kr, vr = (t.detach().to(wide).requires_grad_(bwd) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=gqa)
    if not bwd:
        return out.detach(), None
    out.backward(do.to(wide))
    return out.detach(), (qr.grad, kr.grad, vr.grad)


def _check(fn, ql, kl, vl, dol, causal, bwd, ref, shard, dtype):
    """None when this rank's output (and, with bwd, dq/dk/dv) match the reference's shard of the
    sequence within CHECK_TOL, else what differs."""
    tol = CHECK_TOL[str(dtype).replace("torch.", "")]
    qg, kg, vg = (t.detach().requires_grad_(bwd) for t in (ql, kl, vl))
    # (an exception propagates: caught on some ranks only, the others would wait in the next collective
    # until the group's timeout; the worker reports it as the world's error row)
    out = fn(qg, kg, vg, causal=causal)
    if bwd:
        out.backward(dol)
    ref_out, ref_grads = ref
    pairs = [("out", out.detach(), ref_out)]
    if bwd:
        pairs += [(n, g, r) for n, g, r in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), ref_grads)]
    for what, got, want in pairs:
        want = shard(want).to(torch.float64)
        rel = ((got.to(torch.float64) - want).norm() / want.norm().clamp_min(1e-30)).item()
        if not rel <= tol:
            return f"{what}: relative error {rel:.3g} to the one-process reference, at most {tol:g} expected"
    return None


def _measure(rank, world, dev, case, budget_s):
    import torch.distributed as dist
    import torch.nn.functional as F

    from collectives import ring_attention, shard_sequence, token_ring_attention

    dtype = getattr(torch, case["dtype"])
    b, h, hkv, s, d, causal = case["b"], case["h"], case["hkv"], case["s"], case["d"], case["causal"]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, hh, s, d, generator=gen).to(dtype=dtype, device=dev)
                   for hh in (h, hkv, hkv, h))
    shard = lambda t: shard_sequence(t, layout="zigzag").contiguous()  # noqa: E731
    ql, kl, vl, dol = (shard(t) for t in (q, k, v, do))
    cores = len(os.sched_getaffinity(0))
    base_threads = min(world, cores)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def ours_fn(fn, bwd):
        if not bwd:
            return lambda: fn(ql, kl, vl, causal=causal)
        qg, kg, vg = (t.detach().requires_grad_() for t in (ql, kl, vl))
        return lambda: fn(qg, kg, vg, causal=causal).backward(dol)

    def base_fn(bwd):
        if not bwd:
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != h)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        return lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                      enable_gqa=hkv != h).backward(do)

    def timed(fn, only_rank0):
        gc.collect()
        sync()
        t0 = time.perf_counter()
        if not only_rank0 or rank == 0:
            if only_rank0 and dev.type == "cpu":
                torch.set_num_threads(base_threads)
            fn()
            if only_rank0 and dev.type == "cpu":
                torch.set_num_threads(1)
        sync()
        return time.perf_counter() - t0

    rows = []
    modes = [False, True] if case["bwd"] else [False]
    ref = _reference(q, k, v, do, causal, hkv != h, case["bwd"], dev)
    for name, fn in (("ring", ring_attention), ("token_ring", token_ring_attention)):
        from collectives import _attention_comm as comm

        grp_main = comm.Group("bench", None).pg
        for bwd in modes:
            op = f"{name}_{'fwd_bwd' if bwd else 'fwd'}"
            # this rank's answer against the one-process reference first (a speed-up of a wrong answer
            # means nothing); every rank learns whether any rank's differed, so all skip the timing
            why = _check(fn, ql, kl, vl, dol, causal, bwd, ref, shard, dtype)
            # (on dev: a group made with backend "nccl" has no CPU backend, and a CPU tensor raised)
            bad = torch.tensor([0.0 if why is None else 1.0], device=dev)
            dist.all_reduce(bad)
            if bad.item() > 0:
                if rank == 0:
                    rows.append({"group": GROUP, "op": op, "label": f"W={world} S={s} {case['dtype']}",
                                 "error": f"ResultMismatch: {why or 'another rank differs from the reference'}"})
                continue
            ours, base = ours_fn(fn, bwd), base_fn(bwd)
            sent = _count_bytes(ours, grp_main)  # also the warm-up
            t_o = timed(ours, False)
            t_b = timed(base, True)
            reps = torch.tensor([max(3, min(6, int(budget_s / max(t_o + t_b, 1e-6))))], device=dev)
            dist.broadcast(reps, 0)
            to_, tb_ = [], []
            for _ in range(int(reps)):
                to_.append(timed(ours, False))
                tb_.append(timed(base, True))
            # bytes per forward step and direction: the busiest rank's count over the W-1 transfer steps of a
            # forward; a fwd+bwd case reports bytes per call (its backward's steps carry K/V and dK/dV, and
            # dK/dV go home at the end: a count over W-1 read as a step twice what any step sends; audit)
            counts = torch.tensor([sent["A"], sent["B"]], dtype=torch.float64, device=dev)
            mean = counts.clone()
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            dist.all_reduce(mean)
            steps = 1 if bwd else max(1, world - 1)
            per_a, per_b = (counts / steps).tolist()
            mean_a, mean_b = (mean / world / steps).tolist()
            per = "call" if bwd else "step"
            if rank == 0:
                t_ours, t_base = statistics.median(to_), statistics.median(tb_)
                flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (3.5 if bwd else 1.0)
                kind = "MHA" if hkv == h else f"GQA {h}:{hkv}"
                rows.append({
                    "group": GROUP, "op": op,
                    "label": (f"W={world} {kind} S={s} {case['dtype']}{' causal' if causal else ''} "
                              f"MiB/{per} A {per_a / 2**20:.2f} B {per_b / 2**20:.2f} (mean {mean_a / 2**20:.2f}/{mean_b / 2**20:.2f})"),
                    "size": float(s), "baseline": f"SDPA 1 process ({base_threads} thr)" if dev.type == "cpu"
                    else "SDPA 1 GPU",
                    "ours_s": t_ours, "baseline_s": t_base, "speedup": t_base / t_ours,
                    "ours_rate": flops / t_ours, "baseline_rate": flops / t_base, "unit": "FLOP",
                    "goal": None, "repeats": len(to_), "device": dev.type, "threads": 1, "world": world,
                    f"bytes_per_{per}_A": per_a, f"bytes_per_{per}_B": per_b,
                    f"mean_bytes_per_{per}_A": mean_a, f"mean_bytes_per_{per}_B": mean_b,
                    "notes": f"bytes/{per} (busiest rank; mean over ranks in mean_bytes_*): A = main group (Ring K/V, dK/dV; TokenRing Q side), "
                             "B = TokenRing partials", "gqa": f"{h}:{hkv}",
                })
    return rows


def _worker(rank, world, init_file, backend, device, cases, budget_s, outq):
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
        else:
            dev = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        rows = []
        for case in cases:
            rows += _measure(rank, world, dev, case, budget_s)
        dist.barrier()
        dist.destroy_process_group()
        outq.put((rank, rows, None))
    except Exception as exc:  # noqa: BLE001 - reported as an error row
        import traceback

        outq.put((rank, [], f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def rows(quick: bool, machine: dict, device: str = "cpu"):
    worlds, cases = _configs(quick, device)
    backend = "nccl" if device == "cuda" else "gloo"
    budget = 0.5 if quick else 1.0
    out = []
    ctx = mp.get_context("spawn")
    for world in worlds:
        fd, init_file = tempfile.mkstemp(prefix="pk_ring_bench_")
        os.close(fd)
        os.unlink(init_file)
        outq = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, backend, device, cases, budget, outq),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        got, errs = [], []
        try:
            for _ in range(world):
                rank, rws, err = outq.get(timeout=900)
                got += rws
                if err:
                    errs.append(f"rank {rank}: {err}")
        except queue.Empty:
            errs.append("timed out waiting for the ranks")
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
        out += got
        if errs:
            out.append({"group": GROUP, "op": f"W={world}", "label": "", "error": errs[0][:2000]})
    return out


if __name__ == "__main__":
    import sys

    for r in rows("--quick" in sys.argv, {}, "cuda" if "--gpu" in sys.argv else "cpu"):
        if "error" in r:
            print(r)
        else:
            print(f"{r['op']:18s} {r['label']:60s} ours {r['ours_s'] * 1e3:8.1f} ms  base "
                  f"{r['baseline_s'] * 1e3:8.1f} ms  {r['speedup']:.2f}x")
