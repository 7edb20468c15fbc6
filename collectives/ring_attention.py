"""Sequence-parallel attention over a process group: Ring attention and TokenRing attention (issue #6),
and the helpers that cut a sequence into per-rank shards and put it back together.

Layouts (the sequence dim is cut into equal chunks):
  - "contiguous": W chunks, rank r holds chunk r.
  - "zigzag": 2W chunks, rank r holds chunks r and 2W-1-r, concatenated in that order. With a causal
    mask every (Q rank, K/V rank) pair then costs the same half block (ring-flash-attention's zigzag):
        K/V rank == Q rank: the local causal block (the two local chunks are in order),
        K/V rank <  Q rank: all local queries x the first half of the K/V shard,
        K/V rank >  Q rank: the second half of the queries x all of the K/V shard.

Ring (Liu et al., "Ring Attention with Blockwise Transformers"): K/V travel one hop per step while the
local queries are computed against the visiting block; the next block is already in flight
(batch_isend_irecv) during the compute. Backward (ring style): dQ accumulates locally, dK/dV (fp32)
travel with their K/V and take one extra hop home; every block uses the global out/lse saved by the
forward, so P = exp(S - lse) is exact per block.

TokenRing (Wang et al., 2024): K/V stay; Q moves one hop per step and each block's partial
(out, lse) goes straight back to the Q's owner, on a second process group, so the two directions are
in flight at the same time. See `token_ring_attention` for the schedule and our backward.

Partials are merged in fp32 (fp64 for fp64 inputs) with the stable form
  out = out_a - sigmoid(lse_b - lse_a)(out_a - out_b),  lse = lse_a - logsigmoid(lse_a - lse_b).
"""
from __future__ import annotations

import contextlib
import numbers
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import _attention_block as blk
from . import _attention_comm as comm
from . import _traced
from pykernels import _native
from pykernels._backend import autocast_floats, autocast_off_if, fake_on_one_device
from pykernels.attention import backward_follows

_LAYOUTS = comm.LAYOUTS
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Message tags (one range each, see _attention_comm.post).
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 1, 2, 3, 4
_TAG_Q = 10          # + index of the tensor in the travelling bundle
_TAG_P = 20          # + index of the tensor in the returning partial


# ----------------------------------------------------------------------------------------- schedule
def _blocks(q_rank: int, kv_rank: int, s: int, causal: bool, layout: str):
    """The (query rows, key rows, causal?) blocks that the local shard of `q_rank` must compute against
    the shard of `kv_rank` (rows are positions in the local shards, each of length s)."""
    full = slice(0, s)
    if not causal:
        return [(full, full, False)]
    if q_rank == kv_rank:
        return [(full, full, True)]
    if layout == "contiguous":
        return [(full, full, False)] if kv_rank < q_rank else []
    half = s // 2
    if kv_rank < q_rank:
        return [(full, slice(0, half), False)]
    return [(slice(half, s), full, False)]


def _rows_needed(q_rank: int, kv_rank: int, s: int, causal: bool, layout: str) -> slice:
    """Query rows of q_rank's shard that kv_rank's shard touches: a suffix (all, second half, none)."""
    b = _blocks(q_rank, kv_rank, s, causal, layout)
    if not b:
        return slice(s, s)
    return slice(min(x[0].start for x in b), s)


def _shift(rows: slice, base: slice) -> slice:
    # rows, a sub-suffix of base, as a slice into a tensor that holds only base's rows
    return slice(rows.start - base.start, rows.stop - base.start)


# ------------------------------------------------------------------------------------------ checks
def _as_tensor(x, op: str, arg: str):
    """A numpy / DLPack input as a torch tensor (API.md: accepted wherever a tensor is; shared without
    a copy where possible, see pykernels._native.as_tensor). Anything it cannot convert is returned as
    is, so the argument checks raise the TypeError on every rank together (a local raise here would
    leave the other ranks waiting in the ring)."""
    if isinstance(x, torch.Tensor):
        # a lazy neg/conj view (torch._neg_view, .conj()): only a bit says its memory is negated, and the
        # kernels read raw memory: resolved here (a no-op without the bit; review finding: a contiguous
        # negated q gave the attention of -q). Other layouts go on to the checks, on every rank alike.
        return x.resolve_conj().resolve_neg() if x.layout == torch.strided and not x.is_nested else x
    try:
        return _native.as_tensor(x, op, arg)
    except TypeError:
        return x


def _validate(op: str, q, k, v, causal, scale, layout, return_lse, grp: comm.Group,
              needs_grad: Optional[bool] = None, more_checks=None, prior_error=None, backward: bool = False,
              back_group=None) -> float:
    """Local checks, then one small all-gather so that bad input on any rank (or shards of different
    shapes) raises on every rank instead of leaving the others waiting in the ring. needs_grad: whether a
    backward follows (None: from autograd's state, as an eager call sees it); more_checks(): further
    local checks, run after these (the backward op's); prior_error: this rank's error found before (while
    tracing), raised on every rank. The op (ring or TokenRing) and the pass (forward or backward) must
    agree too: a rank in token_ring_attention while the others ran ring_attention waited in mismatched
    sends until the process group's timeout (review finding). back_group: TokenRing's second group as
    the caller passed it (None: its own, made after these checks); every rank must pass the same one
    (a rank that passed none made its own alone: both waited until the timeout; review finding)."""
    err = None
    fields = {}
    try:
        if prior_error is not None:
            raise prior_error
        back = 0 if back_group is None else _back_group_code(op, back_group, grp)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: expected '{name}' to be a torch.Tensor (or a numpy/DLPack array), "
                                f"got {type(t).__name__}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.layout != torch.strided:  # sparse: failed inside the schedule, the other ranks waiting (review)
                raise ValueError(f"{op}: expected '{name}' to be a dense (strided) tensor, got {t.layout}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype not in _DTYPES:
                raise TypeError(f"{op}: expected '{name}' of dtype float16, bfloat16, float32 or float64, "
                                f"got {str(t.dtype).replace('torch.', '')}")
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"{op}: expected q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{op}: expected '{name}' of shape [B, H, S_local, D], got {tuple(t.shape)}")
        if not (q.device == k.device == v.device):
            raise RuntimeError(f"{op}: expected q, k, v on one device, got {q.device}, {k.device}, {v.device}")
        if q.device.type not in ("cpu", "cuda"):  # meta, xla, ...: gloo/NCCL cannot move them
            raise ValueError(f"{op}: expected q, k, v on a CPU or CUDA device, got {q.device}")
        if k.shape != v.shape:
            raise ValueError(f"{op}: expected 'k' and 'v' of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        b, h, s, d = q.shape
        if d < 1:
            raise ValueError(f"{op}: expected head dim D >= 1, got {d}")
        if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
            raise ValueError(f"{op}: expected 'k'/'v' of shape [{b}, Hkv, {s}, {d}] to match 'q' "
                             f"{tuple(q.shape)}, got {tuple(k.shape)}")
        if (h % k.shape[1] != 0) if k.shape[1] else h != 0:  # no heads at all: empty, as flash_attention
            raise ValueError(f"{op}: expected the number of q heads ({h}) to be a multiple of the number of "
                             f"k/v heads ({k.shape[1]})")
        if layout not in _LAYOUTS:
            raise ValueError(f"{op}: expected 'layout' in {_LAYOUTS}, got {layout!r}")
        if layout == "zigzag" and s % 2 != 0:
            raise ValueError(f"{op}: layout 'zigzag' needs an even local length (two chunks per rank), "
                             f"got S_local={s}; the full length must be a multiple of 2*world_size")
        for name, flag in (("causal", causal), ("return_lse", return_lse)):
            # as pykernels.flash_attention: bool(flag) would make causal="no" silently causal
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{op}: expected '{name}' to be a bool, got {type(flag).__name__} {flag!r}")
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
                raise TypeError(f"{op}: expected 'scale' to be a real number or None, got {type(scale).__name__}")
            if not (_native.finite_real(scale) and float(scale) > 0):
                raise ValueError(f"{op}: expected 'scale' to be a finite float > 0 or None, got {scale!r}")
            if q.dtype != torch.float64 and float(scale) > torch.finfo(torch.float32).max:
                raise ValueError(f"{op}: expected 'scale' within float32's range for {q.dtype} inputs "
                                 f"(the blocks compute in float32), got {scale!r}")
        fields = dict(B=b, H=h, Hkv=k.shape[1], S_local=s, D=d, dtype=comm.dtype_code(q.dtype),
                      causal=int(bool(causal)), layout=_LAYOUTS.index(layout),
                      scale=comm.float_bits(blk.default_scale(d, scale)),
                      # every rank must run the backward schedule, or none: a rank whose inputs need no
                      # gradient left the others waiting in theirs until the timeout (review)
                      grad=int(_needs_grad(q, k, v) if needs_grad is None else needs_grad),
                      token_ring=int(op == "collectives.token_ring_attention"), backward=int(bool(backward)),
                      back=back)
        if more_checks is not None:
            more_checks()
    except (TypeError, ValueError, RuntimeError) as exc:
        err = exc
    dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    names = ("B", "H", "Hkv", "S_local", "D", "dtype", "causal", "layout", "scale", "grad", "token_ring", "backward",
             "back")
    comm.check_across_ranks(op, grp, err, {n: fields.get(n, 0) for n in names}, dev)
    return blk.default_scale(q.shape[-1], scale)


def _back_group_code(op: str, back_group, grp: comm.Group) -> int:
    """A number every rank that passed the same second group gets (its name's hash, > 0); raises where
    the group is not over grp's ranks in grp's order (the partials go back to a rank by its number)."""
    try:
        same = dist.get_world_size(back_group) == grp.world and dist.get_rank(back_group) == grp.rank
    except (RuntimeError, ValueError):  # (torch raises for a group this rank is not in)
        same = False
    if not same:
        raise ValueError(f"{op}: expected the second group of the pair 'group' over the first one's ranks in "
                         f"its order (this rank is {grp.rank} of {grp.world} there)")
    return 1 + comm.shape_hash((back_group.group_name,))


def _needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


# ------------------------------------------------------------------------------------------- ring
def _ring_forward(q, k, v, scale, causal, layout, grp: comm.Group):
    w, r, s = grp.world, grp.rank, q.shape[2]
    acc = blk.acc_dtype(q.dtype)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    out_acc = lse_acc = None
    for step in range(w):
        works = None
        if step + 1 < w:  # the next block is in flight while this one is computed
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            works = comm.post(grp, [(k_cur, r + 1, _TAG_K), (v_cur, r + 1, _TAG_V)],
                              [(k_next, r - 1, _TAG_K), (v_next, r - 1, _TAG_V)])
        src = (r - step) % w
        for rows, krows, diag in _blocks(r, src, s, causal, layout):
            o, l = blk.block_forward(q[:, :, rows], k_cur[:, :, krows], v_cur[:, :, krows], scale, diag)
            if out_acc is None:  # step 0 (own K/V) always covers every query row
                out_acc, lse_acc = o.to(acc), l
            else:
                blk.merge_into(out_acc, lse_acc, o, l, rows)
        if works is not None:
            comm.wait(works)
            k_cur, v_cur = k_next, v_next
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(do, q, k, v, out, lse, scale, causal, layout, grp: comm.Group, delta=None):
    """delta: D = rowsum(dO * O) - dlse when the LSE has a gradient (see _with_lse_grad); then the
    blocks take it instead of O."""
    w, r, s = grp.world, grp.rank, q.shape[2]
    acc = blk.acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    d_works = None
    dk_in = dv_in = None
    for step in range(w):
        kv_works = None
        if step + 1 < w:
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            kv_works = comm.post(grp, [(k_cur, r + 1, _TAG_K), (v_cur, r + 1, _TAG_V)],
                                 [(k_next, r - 1, _TAG_K), (v_next, r - 1, _TAG_V)])
        src = (r - step) % w
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for rows, krows, diag in _blocks(r, src, s, causal, layout):
            gq, gk, gv = blk.block_backward(do[:, :, rows], q[:, :, rows], k_cur[:, :, krows],
                                            v_cur[:, :, krows], None if delta is not None else out[:, :, rows],
                                            lse[:, :, rows], scale, diag,
                                            delta=None if delta is None else delta[:, :, rows])
            dq[:, :, rows] += gq
            dk[:, :, krows] += gk
            dv[:, :, krows] += gv
        if d_works is not None:  # what the earlier holders of this K/V block accumulated
            comm.wait(d_works)
            dk += dk_in
            dv += dv_in
        if w > 1:
            # dK/dV travel with their block (one step behind it); after the last step one more hop
            # brings every rank its own block's total.
            dk_in, dv_in = torch.empty_like(dk), torch.empty_like(dv)
            d_works = comm.post(grp, [(dk, r + 1, _TAG_DK), (dv, r + 1, _TAG_DV)],
                                [(dk_in, r - 1, _TAG_DK), (dv_in, r - 1, _TAG_DV)])
        if kv_works is not None:
            comm.wait(kv_works)
            k_cur, v_cur = k_next, v_next
    if w > 1:
        comm.wait(d_works)
        dk, dv = dk_in, dv_in
    return dq, dk, dv


def _with_lse_grad(dout, dlse, out):
    """(dO, D) for a backward whose LSE output has a gradient. lse_i = logsumexp_j S_ij, so
    dlse_i / dS_ij = P_ij and dS = P * (dP - D) + P * dlse = P * (dP - (D - dlse)): the LSE's
    gradient only shifts FlashAttention-2's row term D = rowsum(dO * O). Returns (dO, None) when
    there is none (D then comes from O as usual); a missing dO (only the LSE used) is zeros."""
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        return dout, None
    return dout, blk.row_delta(dout, out) - dlse.to(blk.acc_dtype(dout.dtype))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, grp):
        # a backward follows where an input needs a gradient: the blocks' forward must then be one whose lse
        # the backward kernels accept (backward_follows: not the CPU decode kernel; review finding)
        with torch.no_grad(), backward_follows(any(ctx.needs_input_grad[:3])):
            out, lse = _ring_forward(q, k, v, scale, causal, layout, grp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, layout, grp)
        ctx.set_materialize_grads(False)  # an unused LSE gives dlse None, not zeros to subtract
        return out, lse

    @staticmethod
    @once_differentiable  # a double backward (create_graph=True) raises instead of giving zeros
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            dout, delta = _with_lse_grad(dout, dlse, out)
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args, delta=delta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: Optional[float] = None, group=None, layout: str = "zigzag",
                   return_lse: bool = False):
    """Ring attention over the ranks of `group` (default: the default group; without an initialized
    torch.distributed, a world of one).

    q [B, H, S_local, D], k/v [B, Hkv, S_local, D] (H % Hkv == 0, GQA/MQA): this rank's shard of the
    sequence, laid out as `layout` says ("zigzag" or "contiguous", see the module doc). Returns this
    rank's shard of softmax(q k^T * scale [+ causal mask over global positions]) v, in q's dtype, and
    with return_lse=True also the LSE [B, H, S_local] (fp32; fp64 for fp64 inputs; natural log).
    Differentiable in q, k, v through out and the LSE (as pykernels.flash_attention); every rank
    must run backward (it communicates).

    Per step each rank computes its queries against the visiting K/V block while the next block is in
    flight; backward circulates dK/dV with their K/V (fp32) and uses the global out/lse. Inputs that
    are bad on any rank raise on every rank. Works over gloo (CPU tensors) and NCCL (CUDA tensors)."""
    op = "collectives.ring_attention"
    if torch.compiler.is_compiling():
        if torch._C._is_any_autocast_enabled():  # (as flash_attention's and SDPA's)
            q, k, v = autocast_floats(q, k, v)
        return _traced_attention(op, False, q, k, v, causal, scale, group, None, layout, return_lse)
    q, k, v = (_as_tensor(t, op, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    autocast = torch._C._is_any_autocast_enabled()
    if autocast:  # (as flash_attention's and SDPA's; then off: the blocks compute in fp32)
        q, k, v = autocast_floats(q, k, v)
    grp = comm.Group(op, group)
    scale = _validate(op, q, k, v, causal, scale, layout, return_lse, grp)
    with autocast_off_if(autocast):
        out, lse = _RingAttention.apply(q, k, v, scale, bool(causal), layout, grp)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------- token ring
def _token_ring_run(bundle: List[torch.Tensor], compute, partial_spec, on_own_partial, s: int,
                    causal: bool, layout: str, grp: comm.Group, pg_back):
    """The TokenRing schedule, shared by forward and backward.

    `bundle`: this rank's query-side tensors (seq dim 2) that travel; Q moves one hop per step towards
    the *lower* rank (r -> r-1), so at step t rank r holds the bundle of rank j = r+t. With the zigzag
    causal layout the holders after the wrap (W-1, W-2, ... > j) need only the second half of j's
    queries, and so do all later holders: the bundle shrinks to that half once and is never sent whole
    again (only the needed half of Q is sent).
    `compute(j, held, held_rows)` -> list of partial tensors for rows `_rows_needed(j, r)` of j (or
    None when j's queries do not touch our K/V). The partial goes straight back to j on `pg_back`
    (a distance-t send), while our own partial computed by rank r-t comes in from the other side;
    `on_own_partial(rows, tensors)` folds each one in. Q (on grp.pg) and partials (on pg_back) are in
    flight in opposite directions at the same time, both overlapping the next block's compute."""
    w, r = grp.world, grp.rank
    held = bundle
    held_rows = slice(0, s)
    back_works, back_in = None, None
    for t in range(w):
        j = (r + t) % w
        q_works = None
        if t + 1 < w:
            j_next = (r + 1 + t) % w  # what rank r+1 holds now and hands to us
            send_rows = _rows_needed(j, r - 1 if r > 0 else w - 1, s, causal, layout)
            recv_rows = _rows_needed(j_next, r, s, causal, layout)
            sends = [(x[:, :, _shift(send_rows, held_rows)].contiguous(), r - 1, _TAG_Q + i)
                     for i, x in enumerate(held)]
            nxt = [torch.empty(x.shape[:2] + (recv_rows.stop - recv_rows.start,) + x.shape[3:],
                               dtype=x.dtype, device=x.device) for x in bundle]
            q_works = comm.post(grp, sends, [(x, r + 1, _TAG_Q + i) for i, x in enumerate(nxt)])
        parts = compute(j, held, held_rows)
        if back_works is not None:  # our partial from the previous step's holder
            comm.wait(back_works)
            on_own_partial(*back_in)
            back_works = back_in = None
        if t == 0:
            if parts is not None:
                on_own_partial(slice(0, s), parts)
        else:
            src = (r - t) % w  # holds our queries at step t
            own_rows = _rows_needed(r, src, s, causal, layout)
            sends = [(p.contiguous(), j, _TAG_P + i) for i, p in enumerate(parts or [])]
            inc = [torch.empty(shape, dtype=dt, device=bundle[0].device)
                   for shape, dt in partial_spec(own_rows.stop - own_rows.start)]
            back_works = comm.post(grp, sends, [(x, src, _TAG_P + i) for i, x in enumerate(inc)],
                                   pg=pg_back)
            if own_rows.stop > own_rows.start:
                back_in = (own_rows, inc)
            else:
                back_in = (own_rows, None)
        if q_works is not None:
            comm.wait(q_works)
            held, held_rows = nxt, recv_rows
    if back_works is not None:  # the last return
        comm.wait(back_works)
        on_own_partial(*back_in)


def _token_forward(q, k, v, scale, causal, layout, grp, pg_back):
    r, s = grp.rank, q.shape[2]
    acc = blk.acc_dtype(q.dtype)
    b, h, _, d = q.shape
    state = {"out": None, "lse": None}

    def compute(j, held, held_rows):
        (qj,) = held
        blocks = _blocks(j, r, s, causal, layout)
        if not blocks:
            return None
        (rows, krows, diag), = blocks  # one block per pair in every layout
        o, l = blk.block_forward(qj[:, :, _shift(rows, held_rows)], k[:, :, krows], v[:, :, krows],
                                 scale, diag)
        return [o, l]

    def spec(n):
        return [((b, h, n, d), q.dtype), ((b, h, n), acc)]

    def on_own(rows, parts):
        if parts is None:
            return
        o, l = parts
        if state["out"] is None:  # step 0: own K/V covers every row
            state["out"], state["lse"] = o.to(acc), l.to(acc)
        else:
            blk.merge_into(state["out"], state["lse"], o, l.to(acc), rows)

    _token_ring_run([q.contiguous()], compute, spec, on_own, s, causal, layout, grp, pg_back)
    return state["out"].to(q.dtype), state["lse"]


def _token_sends_out(q: torch.Tensor) -> bool:
    """Whether the TokenRing backward sends O with the queries (fp16 on CPU) instead of D = rowsum(dO * O).

    D is one number per row against head_dim, but a block given D alone has no O for the kernel: float32/64
    rebuild one from D (out_standin, exact to rounding), fp16/bf16 cannot (a rounded stand-in left dQ 3-5x
    noisier than Ring's) and pass D as an LSE gradient instead. bf16 takes that at full speed (the bf16dot
    kernel), fp16 on CPU does not (aten's fused backward takes no LSE gradient: B=1 H=8 S=512 D=64, one
    thread, 20 ms a block with O, 52 ms with D), so fp16 on CPU sends O. The same on every rank: dtype and
    device are checked to agree."""
    return q.device.type == "cpu" and q.dtype == torch.float16


def _token_backward(do, q, k, v, out, lse, scale, causal, layout, grp, pg_back, dlse=None):
    """dlse: the LSE output's gradient or None (then every rank passes None or zeros of lse's shape)."""
    r, s = grp.rank, q.shape[2]
    acc = blk.acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    sends_out = _token_sends_out(q)

    def compute(j, held, held_rows):
        blocks = _blocks(j, r, s, causal, layout)
        if not blocks:
            return None
        (rows, krows, diag), = blocks
        sl = _shift(rows, held_rows)
        if sends_out:
            qj, doj, outj, lsej, dlsej = (x[:, :, sl] for x in held)
            if bool(dlsej.any()):  # the LSE has a gradient: it shifts D (see _with_lse_grad)
                outj, deltaj = None, blk.row_delta(doj, outj) - dlsej
            else:
                deltaj = None
        else:
            qj, doj, deltaj, lsej = (x[:, :, sl] for x in held)
            outj = None
        gq, gk, gv = blk.block_backward(doj, qj, k[:, :, krows], v[:, :, krows], outj, lsej, scale, diag,
                                        delta=deltaj)
        dk[:, :, krows] += gk  # K/V never move: their gradients accumulate here, no traffic
        dv[:, :, krows] += gv
        return [gq]

    def spec(n):
        return [((q.shape[0], q.shape[1], n, q.shape[3]), acc)]

    def on_own(rows, parts):
        if parts is not None:
            dq[:, :, rows] += parts[0]

    if sends_out:  # O and the LSE's gradient (zeros when it has none) travel with the queries
        dlse = torch.zeros_like(lse) if dlse is None else dlse.to(lse.dtype)
        bundle = [q.contiguous(), do.contiguous(), out.contiguous(), lse.contiguous(), dlse.contiguous()]
    else:
        # D = rowsum(dO * O) travels instead of O: one number per row instead of head_dim
        # (minus dlse when the LSE has a gradient, see _with_lse_grad)
        _, delta = _with_lse_grad(do, dlse, out)
        if delta is None:
            delta = blk.row_delta(do, out)
        bundle = [q.contiguous(), do.contiguous(), delta.contiguous(), lse.contiguous()]
    _token_ring_run(bundle, compute, spec, on_own, s, causal, layout, grp, pg_back)
    return dq, dk, dv


class _TokenRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, grp, pg_back):
        with torch.no_grad(), backward_follows(any(ctx.needs_input_grad[:3])):  # as _RingAttention
            out, lse = _token_forward(q, k, v, scale, causal, layout, grp, pg_back)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, layout, grp, pg_back)
        ctx.set_materialize_grads(False)  # an unused LSE gives dlse None, not zeros to subtract
        return out, lse

    @staticmethod
    @once_differentiable  # a double backward (create_graph=True) raises instead of giving zeros
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            dout = torch.zeros_like(out) if dout is None else dout
            dq, dk, dv = _token_backward(dout, q, k, v, out, lse, *ctx.args, dlse=dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def token_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                         scale: Optional[float] = None, group=None, layout: str = "zigzag",
                         return_lse: bool = False):
    """TokenRing attention: same contract as `ring_attention` (shards, layouts, GQA, return_lse,
    differentiable), different schedule.

    Forward (TokenRing, Wang et al. 2024): K/V never move. At step t rank r holds the queries of rank
    j = r+t (Q moves one hop per step, r -> r-1, on `group`; the direction does not matter without a
    mask, and with the zigzag causal mask it is the one that lets Q shrink, see below), computes them against its own K/V and
    sends that partial (out in the input dtype, lse in fp32) straight back to j on a second process
    group, while receiving its own partial from rank r-t; both directions are in flight together and
    overlap the next block's compute. Causal + zigzag: each pair costs half a block, and once a Q has
    passed rank 0 only its second half is still needed, so only that half travels on (and only that
    half's partials return). Per step and direction that is about half of Ring's bytes for MHA
    (Q vs K+V); with GQA ratio > 2, Ring sends fewer bytes.

    Backward (ours; TokenRing's paper has none): the same schedule, BurstAttention-style. The bundle
    (q, dO, and per row the global lse and D = rowsum(dO * O), both fp32; halved like Q in the zigzag
    causal case) travels r -> r-1; each holder computes the block's gradients with the global lse/D
    (P = exp(S - lse), dS = P * (dP - D)), keeps dK/dV of its own K/V locally (fp32, no traffic at all
    for dK/dV), and sends the block's dQ partial (fp32) straight back to the queries' owner on the
    second group, which sums its partials in fp32. Sending D instead of O keeps the Q-side traffic at
    about 2x Q (Ring's backward sends K, V, dK, dV one way: about 4x Q for MHA in fp32).

    `group` may also be a pair (group_q, group_back) of process groups over the same ranks; by default
    the second group is created once per group (every rank of the group must make its first call
    together)."""
    op = "collectives.token_ring_attention"
    pg_back, pair_error = None, ""
    if isinstance(group, (tuple, list)):
        # a bad pair is raised on every rank by _validate (the compiled path: by the op), as "<class>:<message>"
        pair = group
        group = pair[0] if len(pair) else None
        if len(pair) != 2:
            pair_error = (f"ValueError:{op}: expected 'group' to be a process group or a pair of them, got a "
                          f"{type(pair).__name__} of {len(pair)}")
        elif not isinstance(pair[1], dist.ProcessGroup):
            pair_error = (f"TypeError:{op}: expected the second of the pair 'group' to be a torch.distributed "
                          f"process group, got {type(pair[1]).__name__}")  # (no repr: dynamo may trace this)
        else:
            pg_back = pair[1]
    if torch.compiler.is_compiling():
        if torch._C._is_any_autocast_enabled():
            q, k, v = autocast_floats(q, k, v)
        return _traced_attention(op, True, q, k, v, causal, scale, group, pg_back, layout, return_lse,
                                 pair_error=pair_error)
    q, k, v = (_as_tensor(t, op, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    autocast = torch._C._is_any_autocast_enabled()
    if autocast:
        q, k, v = autocast_floats(q, k, v)
    grp = comm.Group(op, group)
    scale = _validate(op, q, k, v, causal, scale, layout, return_lse, grp, prior_error=_exception_of(pair_error),
                      back_group=pg_back)
    if grp.world > 1 and pg_back is None:
        pg_back = comm.second_group(grp)
    with autocast_off_if(autocast):
        out, lse = _TokenRingAttention.apply(q, k, v, scale, bool(causal), layout, grp, pg_back)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------ shard/unshard
def _chunk_owner(layout: str, w: int):
    """For each chunk index of the full sequence: (rank, position in that rank's shard)."""
    if layout == "contiguous":
        return [(i, 0) for i in range(w)]
    return [(i, 0) if i < w else (2 * w - 1 - i, 1) for i in range(2 * w)]


def _shard_chunks(layout: str, w: int, r: int):
    return [r] if layout == "contiguous" else [r, 2 * w - 1 - r]


def _check_layout(op, layout, x, dim, arg="x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected '{arg}' to be a torch.Tensor (or a numpy/DLPack array), "
                        f"got {type(x).__name__}")
    if x.layout != torch.strided or x.is_nested:  # (as_strided on a sparse tensor raised aten's own error)
        raise ValueError(f"{op}: expected '{arg}' to be a dense (strided) tensor, got "
                         f"{'a nested tensor' if x.is_nested else f'layout {x.layout}'}")
    if layout not in _LAYOUTS:
        raise ValueError(f"{op}: expected 'layout' in {_LAYOUTS}, got {layout!r}")
    # (a SymInt: an int passed into a compiled function becomes one once its value changed; review finding)
    if isinstance(dim, bool) or not isinstance(dim, (numbers.Integral, torch.SymInt)):  # 1.5, None, "2", True
        raise TypeError(f"{op}: expected an int 'dim', got {type(dim).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{op}: expected '{arg}' with at least one dimension to shard, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: expected 'dim' in [-{x.dim()}, {x.dim()}), got {dim} for shape {tuple(x.shape)}")
    return dim % x.dim()


def _local_of(full: torch.Tensor, layout: str, w: int, r: int, dim: int) -> torch.Tensor:
    n = w if layout == "contiguous" else 2 * w
    c = full.shape[dim] // n
    return torch.cat([full.narrow(dim, i * c, c) for i in _shard_chunks(layout, w, r)], dim=dim)


def _gather_full(local: torch.Tensor, layout: str, grp: comm.Group, dim: int) -> torch.Tensor:
    """All-gather of the shards, put back in sequence order."""
    w = grp.world
    if w == 1:
        return local.clone()
    src = local.contiguous()
    buf = torch.empty((w,) + tuple(src.shape), dtype=src.dtype, device=src.device)
    comm.all_gather_flat(buf.view(-1), src.view(-1), grp.pg)
    per = len(_shard_chunks(layout, w, 0))
    c = src.shape[dim] // per
    return torch.cat([buf[rank].narrow(dim, pos * c, c) for rank, pos in _chunk_owner(layout, w)], dim=dim)


class _Shard(torch.autograd.Function):
    # Forward: this rank's chunks of a tensor every rank holds whole. Backward: the full tensor is
    # treated as one tensor replicated on every rank, so its gradient gathers every rank's shard
    # gradient (then unshard(shard(x)) is the identity, gradients included).
    @staticmethod
    def forward(ctx, x, layout, grp, dim):
        ctx.args = (layout, grp, dim)
        return _local_of(x, layout, grp.world, grp.rank, dim)

    @staticmethod
    def backward(ctx, g):
        layout, grp, dim = ctx.args
        # the forward exchanged nothing, so an x that differed between ranks (against the contract)
        # shows only here: shard gradients of different shapes or dtypes raise on every rank instead
        # of aborting a process in gloo's all-gather and corrupting the others' gradients (review)
        _check_shards_agree("collectives.shard_sequence (backward)", grp, g, dim, layout)
        return _gather_full(g, layout, grp, dim), None, None, None


class _Unshard(torch.autograd.Function):
    # Forward: all-gather. Backward: the slice of the (replicated) full gradient that this rank holds.
    @staticmethod
    def forward(ctx, local, layout, grp, dim):
        ctx.args = (layout, grp, dim)
        return _gather_full(local, layout, grp, dim)

    @staticmethod
    def backward(ctx, g):
        layout, grp, dim = ctx.args
        return _local_of(g, layout, grp.world, grp.rank, dim), None, None, None


def shard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's shard of `x` (the whole tensor, the same on every rank) along `dim`, laid out as
    `layout` says. No communication in forward; differentiable (backward all-gathers the shard
    gradients, so x's gradient is complete on every rank). Raises ValueError when the length along
    `dim` is not a multiple of world_size ("contiguous") or 2*world_size ("zigzag")."""
    op = "collectives.shard_sequence"
    if torch.compiler.is_compiling():
        name, world = _traced_group(op, group)
        dim = _check_shard(op, x, layout, dim, world)
        return torch.ops.pykernels.shard_sequence(x, name, layout, dim, world)
    x = _as_tensor(x, op, "x")
    dim = _check_layout(op, layout, x, dim)
    grp = comm.Group(op, group)
    dim = _check_shard(op, x, layout, dim, grp.world)
    return _Shard.apply(x, layout, grp, dim)


def _check_shard(op: str, x, layout: str, dim, world: int) -> int:
    """The checks of shard_sequence's arguments; returns dim in [0, x.dim())."""
    dim = _check_layout(op, layout, x, dim)
    n = world if layout == "contiguous" else 2 * world
    if x.shape[dim] % n:
        raise ValueError(f"{op}: expected the length along dim {dim} ({x.shape[dim]}) to be a multiple of "
                         f"{n} ({'' if layout == 'contiguous' else '2*'}world_size, layout {layout!r}); "
                         f"pad the sequence (and mask the padding) or pick another length")
    return dim


def unshard_sequence(local: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's shard (all-gather, then the chunks in sequence order); the
    inverse of `shard_sequence`. Differentiable (backward takes this rank's slice of the gradient of
    the full tensor, which is treated as replicated). Shards of different shapes on different ranks
    raise ValueError on every rank."""
    op = "collectives.unshard_sequence"
    if torch.compiler.is_compiling():
        # a local error travels to the op, which raises it on every rank (as eager's check does; raised here,
        # it left the other ranks waiting in the op's; review finding)
        name, world = _traced_group(op, group)
        arg_error = _traced_unshard_error(op, local, layout, dim)
        if arg_error:
            layout, dim = "contiguous", 0
        return torch.ops.pykernels.unshard_sequence(local, name, layout, dim, world, arg_error)
    local = _as_tensor(local, op, "local")
    err = None
    try:
        dim = _check_unshard(op, local, layout, dim)
    except (TypeError, ValueError) as exc:
        err = exc
    grp = comm.Group(op, group)
    _check_shards_agree(op, grp, local, dim, layout, err)
    return _Unshard.apply(local, layout, grp, dim)


def _traced_unshard_error(op: str, local, layout, dim) -> str:
    """"" or "<exception class>:<message>" (see _traced_arg_error) for unshard_sequence's local checks.
    They are _check_unshard's, written out: calling it inside try/except and keeping str(exc) made the bad
    rank fail while dynamo traced, and the other ranks waited in the op until gloo's timeout (measured)."""
    if not isinstance(local, torch.Tensor):
        return f"TypeError:{op}: expected 'local' to be a torch.Tensor (or a numpy/DLPack array), got " \
               f"{type(local).__name__}"
    if local.dim() == 0 or not isinstance(layout, str) or layout not in _LAYOUTS:
        return f"ValueError:{op}: expected 'layout' in {_LAYOUTS} and 'local' with at least one dimension, " \
               f"got {layout!r} and {local.dim()} dimensions"
    if isinstance(dim, bool) or not isinstance(dim, int):
        return f"TypeError:{op}: expected an int 'dim', got {type(dim).__name__}"
    if not -local.dim() <= dim < local.dim():
        return f"ValueError:{op}: expected 'dim' in [-{local.dim()}, {local.dim()}), got {dim} for shape " \
               f"{tuple(local.shape)}"
    if layout == "zigzag" and local.shape[dim] % 2:
        return f"ValueError:{op}: layout 'zigzag' needs an even local length along dim {dim % local.dim()} " \
               f"(two chunks per rank), got {local.shape[dim]}"
    return ""


def _check_unshard(op: str, local, layout: str, dim) -> int:
    """The local checks of unshard_sequence's arguments; returns dim in [0, local.dim())."""
    dim = _check_layout(op, layout, local, dim, "local")
    if layout == "zigzag" and local.shape[dim] % 2:
        raise ValueError(f"{op}: layout 'zigzag' needs an even local length along dim {dim} (two "
                         f"chunks per rank), got {local.shape[dim]}")
    return dim


def _check_shards_agree(op: str, grp: comm.Group, local, dim, layout: str, err=None):
    """Every rank's shard has one shape and dtype (else ValueError on every rank): unequal shards would
    reach gloo's all-gather, which aborts the process on a size mismatch (fuzz finding)."""
    fields = {"ndim": local.dim() if err is None else 0, "dtype": comm.dtype_code(local.dtype) if err is None else 0}
    for i in range(8):
        fields[f"size{i}"] = local.shape[i] if err is None and i < local.dim() else -1
    # dims past the 8th: numel and a hash of the whole shape
    fields["numel"] = local.numel() if err is None else -1
    fields["shape_hash"] = comm.shape_hash(local.shape) if err is None else -1
    fields["dim"] = dim if err is None else -1
    fields["layout"] = _LAYOUTS.index(layout) if err is None else -1
    dev = local.device if isinstance(local, torch.Tensor) else torch.device("cpu")
    comm.check_across_ranks(op, grp, err, fields, dev)


# --------------------------------------------------------------------------- under torch.compile
# The public functions call these registered ops while dynamo traces (see collectives/_traced.py):
# torch.ops.pykernels.ring_attention (Ring and TokenRing), its backward, shard_sequence and
# unshard_sequence. They run the schedules above; groups travel as their names.
def _traced_attention(op: str, token_ring: bool, q, k, v, causal, scale, group, pg_back, layout, return_lse,
                      pair_error: str = ""):
    """ring_attention / token_ring_attention while dynamo traces: the op, whose implementation runs every
    check (across ranks) and the schedule on every rank. A flag, scale or layout this rank cannot even pass
    to the op travels to it as `arg_error` instead (raised here, it left the other ranks waiting in the op's
    cross-rank check; review finding), with stand-in values."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):  # (dynamo hands numpy arrays in as tensors)
            raise TypeError(f"{op}: expected '{name}' to be a torch.Tensor (or a numpy/DLPack array), "
                            f"got {type(t).__name__}")
    arg_error = pair_error or _traced_arg_error(op, causal, scale, layout, return_lse)
    if arg_error:
        causal, scale, layout = False, None, "contiguous"
    back = _traced.NO_GROUP if pg_back is None else _traced.group_name(op, pg_back)
    out, lse = torch.ops.pykernels.ring_attention(
        q, k, v, None if scale is None else float(scale), causal, layout, _traced.group_name(op, group), back,
        token_ring, _needs_grad(q, k, v), arg_error)
    return (out, lse) if return_lse is True else out


def _traced_arg_error(op: str, causal, scale, layout, return_lse) -> str:
    """"" or "<exception class>:<message>" for the arguments of ring_attention that the registered op's
    schema cannot carry as given (its value checks run where it runs)."""
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            return f"TypeError:{op}: expected '{name}' to be a bool, got {type(flag).__name__} {flag!r}"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return f"TypeError:{op}: expected 'scale' to be a real number or None, got {type(scale).__name__}"
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        return f"ValueError:{op}: expected 'layout' in {_LAYOUTS}, got {layout!r}"
    return ""


def _exception_of(arg_error: str) -> Optional[BaseException]:
    """The exception an `arg_error` string ("<class>:<message>", see _traced_arg_error) stands for."""
    if not arg_error:
        return None
    kind, _, message = arg_error.partition(":")
    return {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)(message)


def _traced_group(op: str, group):
    """(name, size) of `group` for a registered op's arguments, read while dynamo traces."""
    name = _traced.group_name(op, group)
    return name, 1 if name == _traced.NO_GROUP else dist.get_world_size(group)


def _groups(op: str, group: str, back_group: str):
    """(the Group, the second group passed or None) of a registered op's group names."""
    return comm.Group(op, _traced.group_of(group)), _traced.group_of(back_group)


def _second_group(grp: comm.Group, pg_back, token_ring: bool):
    """TokenRing's second group: the one passed, else its own, made after the checks across ranks (they
    must agree on which; see _validate) and once per group, so the forward and backward share it."""
    if token_ring and grp.world > 1 and pg_back is None:
        return comm.second_group(grp)
    return pg_back


@torch.library.custom_op("pykernels::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], causal: bool,
                       layout: str, group: str, back_group: str, token_ring: bool, needs_grad: bool,
                       arg_error: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ring_attention (token_ring False) or token_ring_attention over the group named
    `group` (TokenRing's partials return on `back_group`; "": its own second group). needs_grad: every
    rank's answer to "does a backward follow" (checked to agree across ranks). arg_error: an argument error
    found while tracing ("<class>:<message>"), raised here on every rank."""
    op = "collectives.token_ring_attention" if token_ring else "collectives.ring_attention"
    grp, pg_back = _groups(op, group, back_group)
    scale = _validate(op, q, k, v, causal, scale, layout, True, grp, needs_grad=needs_grad,
                      prior_error=_exception_of(arg_error), back_group=pg_back if token_ring else None)
    pg_back = _second_group(grp, pg_back, token_ring)
    with torch.no_grad(), backward_follows(needs_grad):
        if token_ring:
            out, lse = _token_forward(q, k, v, scale, causal, layout, grp, pg_back)
        else:
            out, lse = _ring_forward(q, k, v, scale, causal, layout, grp)
    return out.contiguous(), lse.contiguous()


@_ring_attention_op.register_fake
@fake_on_one_device(_ring_attention_op)
def _(q, k, v, scale, causal, layout, group, back_group, token_ring, needs_grad, arg_error=""):
    # never raises: bad input raises where the op runs, on every rank (raised while one rank traced, it left
    # the others waiting in the op); the shapes of such a call are placeholders
    acc = blk.acc_dtype(q.dtype) if q.dtype in _DTYPES else torch.float32
    return q.new_empty(q.shape), q.new_empty(q.shape[:3] if q.dim() >= 3 else q.shape[:-1], dtype=acc)


@torch.library.custom_op("pykernels::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor], q: torch.Tensor,
                                k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                scale: float, causal: bool, layout: str, group: str, back_group: str,
                                token_ring: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of torch.ops.pykernels.ring_attention, from the gradients of its out and lse (either
    may be None) and what its forward saved; `scale` the one the forward used."""
    op = "collectives.token_ring_attention" if token_ring else "collectives.ring_attention"
    grp, pg_back = _groups(op, group, back_group)

    def saved_and_grads_fit():  # what the forward would have made, and gradients of its shapes
        lse_shape = tuple(q.shape[:3])
        for name, t, shape, dtype in (("out", out, tuple(q.shape), q.dtype), ("dout", dout, tuple(q.shape), q.dtype),
                                      ("lse", lse, lse_shape, blk.acc_dtype(q.dtype)),
                                      ("dlse", dlse, lse_shape, blk.acc_dtype(q.dtype))):
            if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or t.device != q.device):
                raise ValueError(f"{op} (backward): expected '{name}' of shape {list(shape)} and dtype "
                                 f"{str(dtype).replace('torch.', '')} on {q.device}, got {list(t.shape)} "
                                 f"{str(t.dtype).replace('torch.', '')} on {t.device}")

    # every check on every rank (one small all-gather, as the forward's): a rank whose arguments are bad
    # raises, and so does every other rank, instead of waiting in the ring for it
    _validate(op, q, k, v, causal, scale, layout, True, grp, needs_grad=True, more_checks=saved_and_grads_fit,
              backward=True, back_group=pg_back if token_ring else None)
    pg_back = _second_group(grp, pg_back, token_ring)
    with torch.no_grad():
        if token_ring:
            dout = torch.zeros_like(out) if dout is None else dout
            dq, dk, dv = _token_backward(dout, q, k, v, out, lse, scale, causal, layout, grp, pg_back, dlse=dlse)
        else:
            dout, delta = _with_lse_grad(dout, dlse, out)
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, scale, causal, layout, grp, delta=delta)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous())


@_ring_attention_backward_op.register_fake
@fake_on_one_device(_ring_attention_backward_op)
def _(dout, dlse, q, k, v, out, lse, scale, causal, layout, group, back_group, token_ring):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup_context(ctx, inputs, output):
    q, k, v, scale, causal, layout, group, back_group, token_ring = inputs[:9]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (blk.default_scale(q.shape[-1], scale), causal, layout, group, back_group, token_ring)
    ctx.set_materialize_grads(False)  # an unused LSE gives dlse None, not zeros to subtract


def _ring_backward_formula(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.pykernels.ring_attention_backward(dout, dlse, q, k, v, out, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * 8


_ring_attention_op.register_autograd(_ring_backward_formula, setup_context=_ring_setup_context)


# `world` is an argument (the group's size, read while tracing) although the group knows it: the output
# shape depends on it, and a compiled graph (inductor's cache, shared by processes) is keyed by its
# arguments, not by what a group name means in the process that made it (as torch's functional
# all_gather_into_tensor takes group_size; a 1-rank graph was reused by 2 ranks without it).
def _group_of_size(op: str, group: str, world: int) -> comm.Group:
    grp = comm.Group(op, _traced.group_of(group))
    if grp.world != world:
        raise RuntimeError(f"{op}: the process group {group!r} has {grp.world} ranks, not the {world} this "
                           f"compiled call was traced with (a function compiled before "
                           f"dist.init_process_group: torch._dynamo.reset() after it)")
    return grp


@torch.library.custom_op("pykernels::shard_sequence", mutates_args=())
def _shard_op(x: torch.Tensor, group: str, layout: str, dim: int, world: int) -> torch.Tensor:
    """shard_sequence over the group named `group`, of `world` ranks."""
    op = "collectives.shard_sequence"
    dim = _check_shard(op, x, layout, dim, world)
    grp = _group_of_size(op, group, world)
    return _local_of(x, layout, grp.world, grp.rank, dim).contiguous()  # (the fake's strides: cat keeps
    # a channels_last input's; review finding)


@_shard_op.register_fake
@fake_on_one_device(_shard_op)
def _(x, group, layout, dim, world):
    dim = _check_shard("collectives.shard_sequence", x, layout, dim, world)
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


@torch.library.custom_op("pykernels::unshard_sequence", mutates_args=())
def _unshard_op(local: torch.Tensor, group: str, layout: str, dim: int, world: int,
                arg_error: str = "") -> torch.Tensor:
    """unshard_sequence over the group named `group`, of `world` ranks (a bad argument on any rank, one
    found while tracing (arg_error, see _traced_arg_error) included, or shards of different shapes or
    dtypes, raise on every rank)."""
    op = "collectives.unshard_sequence"
    err = _exception_of(arg_error)
    if err is None:
        try:
            dim = _check_unshard(op, local, layout, dim)
        except (TypeError, ValueError) as exc:
            err = exc
    grp = _group_of_size(op, group, world)
    _check_shards_agree(op, grp, local, dim, layout, err)
    return _gather_full(local, layout, grp, dim).contiguous()  # (a world of one: a clone, its input's strides)


@_unshard_op.register_fake
@fake_on_one_device(_unshard_op)
def _(local, group, layout, dim, world, arg_error=""):
    shape = list(local.shape)
    shape[dim if -local.dim() <= dim < local.dim() else 0] *= world  # (checked where the op runs)
    return local.new_empty(shape)


def _shard_setup_context(ctx, inputs, output):
    ctx.args = inputs[1:5]  # group, layout, dim, world


# as _Shard and _Unshard: each one's backward is the other
_shard_op.register_autograd(lambda ctx, g: (torch.ops.pykernels.unshard_sequence(g, *ctx.args),) + (None,) * 4,
                            setup_context=_shard_setup_context)
_unshard_op.register_autograd(lambda ctx, g: (torch.ops.pykernels.shard_sequence(g, *ctx.args),) + (None,) * 5,
                              setup_context=_shard_setup_context)
