"""The all-reduce algorithms of collectives.all_reduce, written over point-to-point messages only.

Every algorithm works in place on a flat, contiguous working buffer `x` (the caller converts dtypes and
layouts) and talks through a `Comm`: a process group plus the ordered list of its ranks that take part.
References (cost terms in ../shared/ALGORITHMS.md):
  - recursive doubling, recursive halving-doubling and the non-power-of-two fold:
    Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH",
    IJHPCA 2005 (sections 4.1 and 4.2);
  - the ring: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", JPDC 2009 (what NCCL and Horovod run);
  - hierarchical: reduce-scatter inside the innermost groups, recurse outward, all-reduce the shard at
    the outermost level, all-gather back down (Horovod's hierarchical all-reduce; the 3-level Frontier
    scheme of the ZeRO++ hierarchical-partitioning paper).

Messages: each transfer is cut into pieces of 1-4 MiB (`piece_elems`) that are all posted at once, and each
received piece is reduced as soon as it lands, so sends, receives and the reduction overlap (one large
two-way exchange on gloo runs at about half speed; see FIELD_NOTES). Receives are posted before the
sends they answer and, in halving-doubling, the ring and the fold, before their round starts (`Round`): gloo's tcp
transport is a rendezvous (a message leaves only once the peer has announced the matching receive; a
send that finds no announcement announces itself and waits), so a late receive costs a round trip and
a thread wake-up per message (halving-doubling at 4 KiB-1 MiB on 4 ranks: 0.5-0.7x of gloo before,
0.8-1.0x after).

Tags: every message carries tag = signature(21 bits) | round(10 bits). The signature hashes (numel,
dtype, op, algorithm), so ranks that disagree about the call never match each other's messages: they
time out with the process group's timeout (an error on every rank) instead of delivering a message of
the wrong length, which gloo answers by aborting the whole process. Two different calls share a tag
with probability 2^-21. The pieces of one transfer share its round's tag: a round moves at most one
transfer per ordered pair of members, its pieces are posted in the same order on both sides, and
messages of one (peer, tag) match in posting order (gloo's tcp transport queues them per slot; NCCL
ignores tags and matches every peer's messages in order).
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch
import torch.distributed as dist

from . import _shm

import os as _os

# Pieces of a quarter of the vector, between 1 MiB and 4 MiB (`piece_elems`). Pieces let sends,
# receives and reductions overlap (FIELD_NOTES: one big two-way exchange on gloo runs at half speed), but
# each costs a rendezvous, two thread wake-ups and Python calls (~20 us of CPU per message measured on
# 4 ranks / 2 cores): with 4 MiB instead of 1 MiB pieces the ring's CPU per 16-64 MiB call fell ~8%
# (4 interleaved runs), to gloo's own. COLLECTIVES_PIECE_BYTES (> 0) fixes the piece size instead.
PIECE_BYTES = int(_os.environ.get("COLLECTIVES_PIECE_BYTES", 0))
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 1 << 20, 4 << 20
MAX_PIECES = 512          # pieces per transfer at most (bounds the requests in flight)
MAX_ROUNDS = 1024         # 10 bits of the tag
SIGNATURE_BITS = 21       # the rest of a non-negative 32-bit tag


def piece_elems(nbytes: int, element_size: int) -> int:
    """Elements per piece for a call that reduces `nbytes` in all."""
    b = PIECE_BYTES if PIECE_BYTES > 0 else min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, nbytes // 4))
    return max(1, b // element_size)


class Comm:
    """`ranks[k]` is the rank in `pg` of member k; this process is member `me`."""

    __slots__ = ("pg", "ranks", "me", "size", "coalesce", "native_ok")

    def __init__(self, pg, ranks, me: int, native_ok: bool = False):
        self.pg = pg
        self.ranks = list(ranks)
        self.me = me
        self.size = len(self.ranks)
        # NCCL needs the sends and receives of one step in one group call (else two ranks that both
        # send first can deadlock); gloo's send/recv are independent, and cheapest called directly.
        try:
            name = dist.get_backend(pg)
        except Exception:  # noqa: BLE001 - a backend we do not know: use the general path
            name = "unknown"
        self.coalesce = name != "gloo"
        # native_ok: `pg` holds exactly these members in this order, so dist.all_reduce on it is the
        # same collective (a level sub-group, or the whole group).
        self.native_ok = native_ok

    def sub(self, members: list[int], me: int) -> "Comm":
        c = Comm.__new__(Comm)
        c.pg, c.ranks, c.me, c.size = self.pg, [self.ranks[m] for m in members], me, len(members)
        c.coalesce, c.native_ok = self.coalesce, False
        return c

    def post(self, sends, recvs):
        """sends/recvs: lists of (member, tensor, tag). Returns (send works, recv works)."""
        if self.coalesce:
            ops = [dist.P2POp(dist.isend, t, group=self.pg, tag=tag, group_peer=self.ranks[m]) for m, t, tag in sends]
            ops += [dist.P2POp(dist.irecv, t, group=self.pg, tag=tag, group_peer=self.ranks[m]) for m, t, tag in recvs]
            if not ops:
                return [], []
            works = dist.batch_isend_irecv(ops)
            if len(works) == len(ops):
                return works[:len(sends)], works[len(sends):]
            # NCCL coalesces the whole batch into one work: every receive is then "done" only when the
            # batch is, so waiting on any of them waits on all
            return [], [_AllOf(works)] * len(recvs)
        # receives first: gloo's tcp transport sends a message only once the peer has announced the
        # matching receive (else it announces the send and waits for that notice: a round trip more)
        rw = [self.pg.recv([t], self.ranks[m], tag) for m, t, tag in recvs]
        sw = [self.pg.send([t], self.ranks[m], tag) for m, t, tag in sends]
        return sw, rw


class _AllOf:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True


class Tagger:
    """Round numbers advance identically on every rank (ranks that sit out a phase skip its rounds)."""

    def __init__(self, signature: str):
        self.sig = (zlib.crc32(signature.encode()) & ((1 << SIGNATURE_BITS) - 1)) << 10
        self.round = 0

    def next(self) -> int:
        r = self.round
        self.round += 1
        return r

    def skip(self, n: int):
        self.round += n

    def tag(self, rnd: int) -> int:
        return self.sig | (rnd % MAX_ROUNDS)


def split(lo: int, hi: int, k: int) -> list[int]:
    """k + 1 offsets cutting [lo, hi) into k parts whose sizes differ by at most one (uneven splits:
    the first (hi - lo) % k parts get one more element; parts may be empty)."""
    n = hi - lo
    q, r = divmod(n, k)
    out = [lo]
    for j in range(k):
        out.append(out[-1] + q + (1 if j < r else 0))
    return out


def pieces(lo: int, hi: int, piece: int) -> list[tuple[int, int]]:
    """[lo, hi) in pieces of `piece` elements (at most MAX_PIECES; an empty range is one empty piece,
    so that even an empty transfer is a message: a rank that disagrees then times out)."""
    n = hi - lo
    if n <= 0:
        return [(lo, lo)]
    piece = max(piece, -(-n // MAX_PIECES))
    return [(a, min(a + piece, hi)) for a in range(lo, hi, piece)]


def _wait(works):
    for w in works:
        w.wait()


class Ctx:
    """What every algorithm needs: the reduction, the piece size and the tagger."""

    def __init__(self, red: Callable, piece: int, tagger: Tagger, op: str = None, dtype=None, sig: str = ""):
        self.red = red          # red(dst, src): dst <- dst (op) src, in place
        self.piece = piece      # elements per piece
        self.tg = tagger
        # the call's op name, caller's dtype and signature: what the shared-memory inner level needs
        # (None: that level runs the direct reduce-scatter instead)
        self.op, self.dtype, self.sig = op, dtype, sig


class Round:
    """The receives of one round, posted as early as the algorithm allows: on gloo at once (its tcp
    transport is a rendezvous: the peer's data leaves only after our receive-ready notice reaches it, so
    a receive posted when the round starts costs a round trip per message), on NCCL together with the
    round's first sends (a receive alone in a group call would block the sends queued behind it).
    recvs: [(member, view, tag)]; meta: anything per receive, handed back by `arrived`."""

    __slots__ = ("comm", "recvs", "meta", "works")

    def __init__(self, comm: Comm, recvs, meta):
        self.comm, self.recvs, self.meta = comm, recvs, meta
        self.works = None if comm.coalesce else comm.post([], recvs)[1]

    def send(self, sends) -> list:
        if self.works is None:
            sw, self.works = self.comm.post(sends, self.recvs)
            return sw
        return self.comm.post(sends, [])[0] if sends else []

    def arrived(self):
        """Yields (view, meta) of each receive once it completed, in posting order."""
        if self.works is None:
            self.send([])
        for w, (_, view, _), m in zip(self.works, self.recvs, self.meta):
            w.wait()
            yield view, m


def _piece_recvs(ctx: Ctx, member: int, buf, lo: int, hi: int, rnd: int, shift: int = 0):
    """Receives of [lo, hi) in pieces into buf[lo + shift: hi + shift]; meta = (a, b) in x's indexing."""
    recvs, meta = [], []
    for a, b in pieces(lo, hi, ctx.piece):
        recvs.append((member, buf[a + shift:b + shift], ctx.tg.tag(rnd)))
        meta.append((a, b))
    return recvs, meta


def _piece_sends(ctx: Ctx, member: int, x, lo: int, hi: int, rnd: int):
    return [(member, x[a:b], ctx.tg.tag(rnd)) for a, b in pieces(lo, hi, ctx.piece)]


# ------------------------------------------------------------------------------------------------
# Building blocks: one step of exchange, with reduction of each piece as it arrives
# ------------------------------------------------------------------------------------------------
def _step(comm: Comm, ctx: Ctx, rnd: int, sends, recvs, reduce_into=None):
    """sends: [(member, tensor_view_1d, lo, hi)] sent in pieces; recvs: [(member, buf, lo, hi)]
    received in pieces into buf[lo:hi]; if reduce_into is given, reduce_into[a:b] op= buf[a:b] for each
    received piece as soon as it arrives. Returns after everything completed."""
    s_list, r_list, r_meta = [], [], []
    for m, t, lo, hi in sends:
        for a, b in pieces(lo, hi, ctx.piece):
            s_list.append((m, t[a:b], ctx.tg.tag(rnd)))
    for m, buf, lo, hi in recvs:
        for a, b in pieces(lo, hi, ctx.piece):
            r_list.append((m, buf[a:b], ctx.tg.tag(rnd)))
            r_meta.append((a, b))
    sw, rw = comm.post(s_list, r_list)
    for w, (a, b), (_, buf, _) in zip(rw, r_meta, r_list):
        w.wait()
        if reduce_into is not None and b > a:
            ctx.red(reduce_into[a:b], buf)
    _wait(sw)


# ------------------------------------------------------------------------------------------------
# The MPICH fold for non-powers of two (Thakur et al. 2005, 4.1): with p' = 2^floor(lg p) and
# r = p - p', among the first 2r members the even one sends its vector to the odd one and sits out;
# the core algorithm runs over p' members; the result goes back to the members that sat out.
# ------------------------------------------------------------------------------------------------
def with_fold(core: Callable, core_rounds: Callable[[int], int]):
    def run(comm: Comm, x: torch.Tensor, tmp: torch.Tensor, lo: int, hi: int, ctx: Ctx):
        p, i = comm.size, comm.me
        if p == 1:
            return
        p2 = 1 << (p.bit_length() - 1)
        r = p - p2
        if r == 0:
            core(comm, x, tmp, lo, hi, ctx)
            return
        r_in = ctx.tg.next()
        if i < 2 * r and i % 2 == 0:
            # the result's receive is posted before the vector leaves (it can only arrive after the
            # partner has all of it, so x is no longer being sent by then)
            ctx.tg.skip(core_rounds(p2))
            back = Round(comm, *_piece_recvs(ctx, i + 1, x, lo, hi, ctx.tg.next()))
            sw = comm.post(_piece_sends(ctx, i + 1, x, lo, hi, r_in), [])[0]
            for _ in back.arrived():
                pass
            _wait(sw)
            return
        if i < 2 * r:
            _step(comm, ctx, r_in, [], [(i - 1, tmp, lo, hi)], reduce_into=x)
            vi = i // 2
        else:
            vi = i - r
        members = [2 * v + 1 if v < r else v + r for v in range(p2)]
        core(comm.sub(members, vi), x, tmp, lo, hi, ctx)
        r_out = ctx.tg.next()
        if i < 2 * r:
            _step(comm, ctx, r_out, [(i - 1, x, lo, hi)], [])
    return run


def _lg(p: int) -> int:
    return p.bit_length() - 1


# ------------------------------------------------------------------------------------------------
# Recursive doubling: lg p rounds, the whole vector exchanged with member XOR 2^k each round.
# ------------------------------------------------------------------------------------------------
def _rd_core(comm: Comm, x, tmp, lo, hi, ctx: Ctx):
    """lg p rounds; round k exchanges the whole vector with member XOR 2^k and reduces it in place.
    Each round's receives are posted with (just before) its sends, not ahead of the round: measured
    on 4 ranks / 2 cores, receives for every round posted up front cost ~10% more CPU (the pending
    receives keep gloo's I/O thread busier) for no gain in time; halving-doubling and the ring, whose
    rounds are bigger, do gain from it."""
    p, i = comm.size, comm.me
    # Both members of a pair reduce (lower member's part) op (upper member's part), in that order: max/min
    # of -0.0 and +0.0 or of two NaNs, and the sum of NaNs of other signs, depend on the operand order,
    # and each member taking its own first left ranks with different bits (the sign of a zero, a NaN;
    # review finding). Integer ops do not depend on it.
    ordered = x.is_floating_point()
    mask = 1
    while mask < p:
        peer = i ^ mask
        upper = ordered and bool(i & mask)
        # x is still being sent while its pieces come in: a piece is reduced in place once its own send
        # is done too (they finish as fast as the receives on a symmetric exchange), so no copy back
        rnd = ctx.tg.next()
        sends = _piece_sends(ctx, peer, x, lo, hi, rnd)
        recvs, _ = _piece_recvs(ctx, peer, tmp, lo, hi, rnd)
        sw, rw = comm.post(sends, recvs)
        for (_, xs, _), (_, ts, _), s, r in zip(sends, recvs, sw or [None] * len(rw), rw):
            r.wait()
            if s is not None:
                s.wait()
            if ts.numel():
                if upper:  # the peer's part first, then ours: the bits the peer computes
                    ctx.red(ts, xs)
                    xs.copy_(ts)
                else:
                    ctx.red(xs, ts)
        mask <<= 1


recursive_doubling = with_fold(_rd_core, _lg)


# ------------------------------------------------------------------------------------------------
# Recursive halving-doubling (Rabenseifner): reduce-scatter by recursive halving, then all-gather by
# recursive doubling; p' parts, member j ends the reduce-scatter owning part j.
# ------------------------------------------------------------------------------------------------
def _hd_core(comm: Comm, x, tmp, lo, hi, ctx: Ctx):
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling. The all-gather's
    receives are posted before the reduce-scatter starts (they land in parts of x this member has sent
    and will not touch again, and only after the peer has received them), the reduce-scatter's all at
    its start: no round waits for a receive-ready notice."""
    off = split(lo, hi, comm.size)
    pre = _doubling_ag_rounds(comm, x, off, ctx)
    halving_reduce_scatter(comm, x, tmp, off, ctx)
    doubling_all_gather(comm, x, off, comm.me, ctx, pre)


halving_doubling = with_fold(_hd_core, lambda p: 2 * _lg(p))


# ------------------------------------------------------------------------------------------------
# Reduce-scatter / all-gather building blocks over `parts` (offsets, one part per member).
# Each returns / takes `own`: the index of the part this member holds reduced.
# ------------------------------------------------------------------------------------------------
def ring_reduce_scatter(comm: Comm, x, tmp, off, ctx: Ctx) -> int:
    """p - 1 steps; at step s member i sends part (i - s) and receives part (i - s - 1), which it
    reduces and sends on at step s + 1. Pipelined per piece: a piece goes on as soon as it is reduced."""
    p, i = comm.size, comm.me
    if p == 1:
        return 0
    nxt, prv = (i + 1) % p, (i - 1) % p
    rounds = [ctx.tg.next() for _ in range(p - 1)]
    recvs, meta = [], []
    for s in range(p - 1):
        part = (i - s - 1) % p
        r, m = _piece_recvs(ctx, prv, tmp, off[part], off[part + 1], rounds[s])
        recvs += r
        meta += [(s, a, b) for a, b in m]
    first = _piece_sends(ctx, nxt, x, off[i], off[i + 1], rounds[0])
    sw, rw = comm.post(first, recvs)
    sends = list(sw)
    for w, (s, a, b) in zip(rw, meta):
        w.wait()
        if b > a:
            ctx.red(x[a:b], tmp[a:b])
        if s + 1 < p - 1:
            more, _ = comm.post([(nxt, x[a:b], ctx.tg.tag(rounds[s + 1]))], [])
            sends.extend(more)
    _wait(sends)
    return (i + 1) % p


def _ring_ag_post(comm: Comm, x, off, own: int, ctx: Ctx):
    """The receives of ring_all_gather, posted now: (rounds, Round)."""
    p, i = comm.size, comm.me
    prv = (i - 1) % p
    rounds = [ctx.tg.next() for _ in range(p - 1)]
    shift = own - (i + 1)  # parts relative to the ring position (own == i + 1 after ring RS)
    recvs, meta = [], []
    for s in range(p - 1):
        part = (i - s + shift) % p
        r, m = _piece_recvs(ctx, prv, x, off[part], off[part + 1], rounds[s])
        recvs += r
        meta += [s] * len(m)
    return rounds, Round(comm, recvs, meta)


def ring_all_gather(comm: Comm, x, off, own: int, ctx: Ctx, pre=None):
    """p - 1 steps; each received piece is forwarded to the next member at once. `pre`: the receives,
    when the caller posted them earlier (_ring_ag_post)."""
    p, i = comm.size, comm.me
    if p == 1:
        return
    nxt = (i + 1) % p
    rounds, got = pre if pre is not None else _ring_ag_post(comm, x, off, own, ctx)
    sends = got.send(_piece_sends(ctx, nxt, x, off[own], off[own + 1], rounds[0]))
    for view, s in got.arrived():
        if s + 1 < p - 1:
            sends += comm.post([(nxt, view, ctx.tg.tag(rounds[s + 1]))], [])[0]
    _wait(sends)


def direct_reduce_scatter(comm: Comm, x, tmp, off, ctx: Ctx) -> int:
    """One step: member j receives part j from every other member (all-to-all plus a local reduction:
    1 latency instead of p - 1; the right choice inside a node, where links do not contend)."""
    p, i = comm.size, comm.me
    if p == 1:
        return 0
    rnd = ctx.tg.next()
    mine_lo, mine_hi = off[i], off[i + 1]
    n = mine_hi - mine_lo
    # the p - 1 incoming parts land side by side in tmp (the caller's reused scratch, sized numel + p:
    # (p - 1) * ceil(m / p) <= m + p - 2), so no fresh pages per call
    need = (p - 1) * max(n, 0)
    scratch = tmp if tmp.numel() >= need else torch.empty(need, dtype=x.dtype, device=x.device)
    sends, recvs = [], []
    order = [(i + d) % p for d in range(1, p)]  # stagger peers so that not everyone hits member 0 first
    for j in order:
        sends.append((j, x, off[j], off[j + 1]))
    for idx, j in enumerate(reversed(order)):
        recvs.append((j, scratch[idx * n:(idx + 1) * n], 0, n))
    _step(comm, ctx, rnd, sends, recvs, reduce_into=x[mine_lo:mine_hi])  # each part reduced as it arrives
    return i


def direct_all_gather(comm: Comm, x, off, own: int, ctx: Ctx):
    p, i = comm.size, comm.me
    if p == 1:
        return
    rnd = ctx.tg.next()
    # member j owns part (j + own - i) % p (the same shift for every member: ring or direct layout)
    shift = own - i
    order = [(i + d) % p for d in range(1, p)]
    sends = [(j, x, off[own], off[own + 1]) for j in order]
    recvs = [(j, x, off[(j + shift) % p], off[(j + shift) % p + 1]) for j in reversed(order)]
    _step(comm, ctx, rnd, sends, recvs)


def _halving_plan(p: int, i: int) -> list:
    """[(peer, keep, give)] per round of recursive halving, in parts: member i ends owning part i."""
    plan, plo, phi, mask = [], 0, p, p >> 1
    while mask:
        mid = (plo + phi) // 2
        keep, give = ((mid, phi), (plo, mid)) if i & mask else ((plo, mid), (mid, phi))
        plan.append((i ^ mask, keep, give))
        plo, phi = keep
        mask >>= 1
    return plan


def halving_reduce_scatter(comm: Comm, x, tmp, off, ctx: Ctx) -> int:
    """Recursive halving (power-of-two sizes): lg p steps, member j ends owning part j. Every round's
    receive is posted at the start, each into its own region of tmp (the kept halves shrink: p - 1
    parts in all). A round's sends (the half given away) are never touched again, so only the end
    waits for them."""
    p, i = comm.size, comm.me
    plan = _halving_plan(p, i)
    rounds = [ctx.tg.next() for _ in plan]
    total = sum(off[keep[1]] - off[keep[0]] for _, keep, _ in plan)
    buf = tmp if tmp.numel() >= total else torch.empty(total, dtype=x.dtype, device=x.device)
    got, base = [], 0
    for (peer, keep, _), rnd in zip(plan, rounds):
        a0, b0 = off[keep[0]], off[keep[1]]
        got.append(Round(comm, *_piece_recvs(ctx, peer, buf, a0, b0, rnd, base - a0)))
        base += b0 - a0
    sends = []
    for (peer, _, give), rnd, g in zip(plan, rounds, got):
        sends += g.send(_piece_sends(ctx, peer, x, off[give[0]], off[give[1]], rnd))
        for view, (a, b) in g.arrived():
            if b > a:
                ctx.red(x[a:b], view)
    _wait(sends)
    return i


def _doubling_ag_rounds(comm: Comm, x, off, ctx: Ctx) -> list:
    """The receives of the recursive-doubling all-gather, posted now: [(peer, own block, round, Round)]."""
    p, i = comm.size, comm.me
    out, lo_p, hi_p, mask = [], i, i + 1, 1
    while mask < p:
        peer = i ^ mask
        # the peer's block of parts has the same width, on the other side of this mask bit
        other = (lo_p - mask, hi_p - mask) if i & mask else (lo_p + mask, hi_p + mask)
        rnd = ctx.tg.next()
        out.append((peer, (lo_p, hi_p), rnd, Round(comm, *_piece_recvs(ctx, peer, x, off[other[0]], off[other[1]], rnd))))
        lo_p, hi_p = min(lo_p, other[0]), max(hi_p, other[1])
        mask <<= 1
    return out


def doubling_all_gather(comm: Comm, x, off, own: int, ctx: Ctx, pre=None):
    """Recursive doubling all-gather after halving_reduce_scatter (member j owns part j); `pre`: its
    receives, when the caller posted them earlier (_doubling_ag_rounds)."""
    sends = []
    for peer, (lo_p, hi_p), rnd, got in (pre if pre is not None else _doubling_ag_rounds(comm, x, off, ctx)):
        sends += got.send(_piece_sends(ctx, peer, x, off[lo_p], off[hi_p], rnd))
        for _ in got.arrived():
            pass
    _wait(sends)


def ring(comm: Comm, x, tmp, lo, hi, ctx: Ctx):
    """Ring all-reduce: ring reduce-scatter then ring all-gather, any p, neighbours only."""
    if comm.size == 1:
        return
    off = split(lo, hi, comm.size)
    # the all-gather's receives go out first: each lands in a part this member has finished with (its
    # last use there is a send, which the data's arrival proves complete)
    pre = _ring_ag_post(comm, x, off, (comm.me + 1) % comm.size, ctx)
    own = ring_reduce_scatter(comm, x, tmp, off, ctx)
    ring_all_gather(comm, x, off, own, ctx, pre)


def native(comm: Comm, x, tmp, lo, hi, ctx: Ctx, op=None):
    """gloo's/NCCL's own dist.all_reduce on the same members (only where comm.pg is exactly them)."""
    if comm.size == 1:
        return
    if not comm.native_ok:
        raise RuntimeError("collectives.all_reduce: 'native' needs a process group holding exactly this "
                           "level's members")
    dist.all_reduce(x[lo:hi], op=op, group=comm.pg)


def _node_shm(comm: Comm, x, ctx: Ctx):
    """The shared-memory transport of this level's sub-group (set up by all_reduce before the call,
    collectives/_shm.py), or None: then the level runs the direct reduce-scatter. Every member of
    the sub-group gets the same answer (the transport exists on all of them or on none; x's dtype and
    the call's op are the same on every rank that agrees on the call)."""
    if not comm.native_ok or ctx.op is None or x.device.type != "cpu" or x.dtype not in _shm.DTYPES:
        return None
    tr = _shm.transport_if_ready(comm.pg)
    return tr if tr is not None and tr.p == comm.size else None


def _pg_parts(comm: Comm, off):
    """The parts of `off` (member i owns [off[i], off[i+1]), i in the topology's order) by the rank
    in comm.pg that owns each (new_group orders its ranks by global rank, which a Topology's `ranks`
    may permute): (begin, end) lists indexed by pg rank."""
    begin, end = [0] * comm.size, [0] * comm.size
    for i, r in enumerate(comm.ranks):
        begin[r], end[r] = off[i], off[i + 1]
    return begin, end


def shm_reduce_scatter(comm: Comm, x, tmp, off, ctx: Ctx) -> int:
    """The innermost level (one node) through its shared segment: each member copies the others' parts
    in and reduces its own (one copy each way instead of TCP over loopback). Takes the tag round the
    direct reduce-scatter would, so nodes where it falls back stay in step with the rest."""
    tr = _node_shm(comm, x, ctx)
    if tr is None:
        return direct_reduce_scatter(comm, x, tmp, off, ctx)
    ctx.tg.skip(1)
    tr.reduce_scatter(x, _pg_parts(comm, off), ctx.op, ctx.dtype, ctx.sig)
    return comm.me


def shm_all_gather(comm: Comm, x, off, own: int, ctx: Ctx):
    tr = _node_shm(comm, x, ctx)
    if tr is None or own != comm.me:
        return direct_all_gather(comm, x, off, own, ctx)
    ctx.tg.skip(1)
    tr.all_gather(x, _pg_parts(comm, off), ctx.dtype, ctx.sig)


FLAT = {"recursive_doubling": recursive_doubling, "halving_doubling": halving_doubling, "ring": ring}
REDUCE_SCATTER = {"shm": (shm_reduce_scatter, shm_all_gather),
                  "direct": (direct_reduce_scatter, direct_all_gather),
                  "ring": (ring_reduce_scatter, ring_all_gather),
                  "halving": (halving_reduce_scatter, doubling_all_gather)}


SEGMENT_BYTES = 1 << 20   # pipelined hierarchical: segments of at least this size ...
MAX_SEGMENTS = 8          # ... and at most this many


def _inner_down(levels, inner, x, tmp, lo, hi, ctx):
    stack = []
    for comm, how in zip(levels[:-1], inner):
        if comm.size == 1:
            continue
        rs, ag = REDUCE_SCATTER[how]
        off = split(lo, hi, comm.size)
        own = rs(comm, x, tmp, off, ctx)
        stack.append((comm, ag, off, own))
        lo, hi = off[own], off[own + 1]
    return lo, hi, stack


def _inner_up(stack, x, ctx):
    for comm, ag, off, own in reversed(stack):
        ag(comm, x, off, own, ctx)


def hierarchical(levels: list[Comm], x, tmp, n: int, ctx: Ctx, inner: list[str], outer: str,
                 native_op=None):
    """Per level (innermost first) reduce-scatter the current range among that level's members and keep
    this member's part, all-reduce the remaining shard over the outermost level, then all-gather back
    down level by level. `inner[l]` names level l's reduce-scatter ("direct", "ring", "halving");
    `outer` the outermost all-reduce (a FLAT name or "native").

    With a native outer level and a large vector, the vector is cut into segments and pipelined: the
    outer all-reduce of segment k runs asynchronously (in gloo's/NCCL's own thread, on the outer
    sub-group) while this thread reduce-scatters segment k + 1 and all-gathers segment k - 1 inside
    the node, so the slow outer link never waits for the inner phases (Horovod/BlueConnect-style
    overlap of the levels)."""
    top = levels[-1]
    seg_count = 1
    if outer == "native" and top.size > 1 and top.native_ok:
        seg_count = max(1, min(MAX_SEGMENTS, (n * x.element_size()) // SEGMENT_BYTES))
    if seg_count > 1:
        segs = split(0, n, seg_count)
        pending = []  # (work, stack) of segments whose outer all-reduce is in flight
        for k in range(seg_count):
            lo, hi, stack = _inner_down(levels, inner, x, tmp, segs[k], segs[k + 1], ctx)
            work = dist.all_reduce(x[lo:hi], op=native_op, group=top.pg, async_op=True)
            pending.append((work, stack))
            if len(pending) > 1:
                w, st = pending.pop(0)
                w.wait()
                _inner_up(st, x, ctx)
        for w, st in pending:
            w.wait()
            _inner_up(st, x, ctx)
        return
    lo, hi, stack = _inner_down(levels, inner, x, tmp, 0, n, ctx)
    if outer == "native":
        native(top, x, tmp, lo, hi, ctx, op=native_op)
    else:
        FLAT[outer](top, x, tmp, lo, hi, ctx)
    _inner_up(stack, x, ctx)
