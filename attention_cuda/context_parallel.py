"""Context parallelism for cosine-sim and fastmax: one sequence split across the ranks of a process group,
each rank holding q (B, H, T, D) and k, v (B, Hkv, T, D) of its own slice, T = its length (as flash-linear-
attention keeps its context-parallel ops beside its kernels).

Cosine-sim runs as ring attention: K/V blocks travel from rank to rank and each rank adds their share to its
queries' sums. Fastmax never moves K/V: its linear form needs only the fixed-size moments state of the keys
before a slice, a prefix sum of the ranks' states (as LASP does). Both run on the pure-PyTorch reference or on
our kernels, as plan.resolve decides from ``backend`` (the functional API's "auto", "torch", "cuda").
docs/context_parallel.md says how, and what the GPUs still have to show.

Layout: the sequence is cut into chunks of equal length. In plain order rank r holds chunk r of W; in
zigzag order it holds chunks r and 2W-1-r of 2W, so that under causal attention every rank does the same
work (its early chunk sees few keys, its late one many): rank_chunks says which, for the caller that shards
the sequence and for the attention alike.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import _ops
from ._kernels import linear_attention
from .plan import Tuning, resolve
from .reference import chunk_rows, expand_kv, key_moment, safe_divide, scale_rows
from .score import cosine_policy, fastmax_policy


def rank_chunks(rank: int, world_size: int, zigzag: bool) -> tuple[int, ...]:
    """The chunks rank holds, ascending: its slice is their concatenation, so its positions increase."""
    return (rank, 2 * world_size - 1 - rank) if zigzag else (rank,)


def check_slices(q, k, v, zigzag: bool) -> None:
    """ValueError unless q (B, H, T, D) and k, v (B, Hkv, T, D) are a rank's slices (T even in zigzag order)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q, k, v: expected q (B, H, T, D) and k, v (B, Hkv, T, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (t, d) or h % k.shape[1]:
        raise ValueError(f"k, v: expected (B={b}, Hkv, T={t}, D={d}) with Hkv dividing H={h}, got {tuple(k.shape)}")
    if zigzag and t % 2:
        raise ValueError(f"q: zigzag order holds two chunks per rank, so the slice length must be even, got T={t}")


class _Transfer:
    """Tensors on their way in. The outgoing ones are held too: the sends read them until they complete."""

    def __init__(self, works, sent, received):
        self.works, self.sent, self.received = works, sent, received

    def wait(self):
        for work in self.works:
            work.wait()
        return self.received


class _Ring:
    """The ranks of a group in a ring: each sends to the next one and receives from the previous one."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensors, tag: int) -> _Transfer:
        """Start sending tensors to the next rank and receiving the previous rank's (of the same shapes).
        Returns at once, so the caller computes while they travel. A ring of one hands them to itself."""
        if self.size == 1:
            return _Transfer([], tensors, tensors)
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = ([dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in sent]
               + [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in received])
        return _Transfer(dist.batch_isend_irecv(ops), sent, received)


def cosine_block(q, k, v, scale: float, diagonal: bool):
    """One block's share of cosine attention: num = sum_s a_ts v_s and den = sum_s a_ts, a_ts = exp(scale
    q_t.k_s - scale), for unit rows q (B, H, I, D) and k, v (B, Hkv, J, D). With ``diagonal`` q and k are the
    same positions and query t sees keys s <= t only.

    Unit rows bound every logit by scale, so every block takes the same shift and the blocks' shares add
    up to the row's sums with no running max to reconcile.
    """
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    x = scale * (q @ k.transpose(-1, -2)) - scale
    if diagonal:
        x = x.masked_fill(torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    a = torch.exp(x)
    return a @ v, a.sum(-1, keepdim=True)


def cosine_block_backward(q, k, v, out, den, d_out, scale: float, diagonal: bool):
    """dq, dk, dv of one block's share (cosine_block's), given the rows' final output and denominator over
    all blocks and the gradient of the output, as the kernels' backward takes O and 1/l: out = num / den
    sends d_out / den to the block's num and -(d_out . out) / den to its den."""
    d_num = d_out / den
    d_den = -(d_out * out).sum(-1, keepdim=True) / den
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        num, block_den = cosine_block(q, k, v, scale, diagonal)
    return torch.autograd.grad((num, block_den), (q, k, v), (d_num, d_den))


def cosine_block_cuda(q, k, v, scale: float, diagonal: bool):
    """cosine_block on our tiled forward kernel (q, k, v in fp16/bf16/fp32 on a GPU; num, den in fp32). Its
    output is the block's num / den and its row statistic gives den, on the reference's shift of scale."""
    f = _ops.fwd(q, k, v, mask=None, bias=None, causal=diagonal, policy=_unit_rows(scale))
    den = f.stat.sums(scale * _ops.LOG2E)[..., None]
    return f.out.float() * den, den


def cosine_block_backward_cuda(q, k, v, out, den, d_out, scale: float, diagonal: bool):
    """cosine_block_backward on our backward kernel, which given the whole row's output and statistic
    computes exactly one block's share (its weights normalised by the whole row's sum)."""
    stat = _ops.RowStat.of_sums(den[..., 0], _unit_rows(scale), q.dtype, scale * _ops.LOG2E)
    return _ops.bwd(d_out.to(q.dtype), q, k, v, mask=None, bias=None, out=out.to(q.dtype), stat=stat,
                    causal=diagonal, bias_grad=False)[:3]


def _unit_rows(scale: float):
    """Cosine's score for rows the ring made unit itself: no qk norm left for the kernels to apply."""
    return cosine_policy(scale, False)


# The per-block compute by backend: (forward, backward) with cosine_block's and cosine_block_backward's contracts.
BLOCKS = {"torch": (cosine_block, cosine_block_backward), "cuda": (cosine_block_cuda, cosine_block_backward_cuda)}


def _pieces(mine: tuple[int, ...], theirs: tuple[int, ...], causal: bool, chunk: int):
    """(query rows, key rows, diagonal) of the parts of a block that my queries see: my chunks against
    theirs, chunk rows each. The chunks of a slice ascend, so on my own block causal by index within the
    slice is causal by position, and of another block the chunks a query chunk sees whole are a prefix."""
    if not causal or mine == theirs:
        return [(slice(None), slice(None), causal)]
    pieces, start = [], 0
    for seen, run in itertools.groupby(sum(b < a for b in theirs) for a in mine):
        stop = start + len(list(run))
        if seen:  # a later rank's chunks are skipped outright: no work, not masked work
            pieces.append((slice(start * chunk, stop * chunk), slice(0, seen * chunk), False))
        start = stop
    return pieces


class _CosineRing(torch.autograd.Function):
    """Ring attention over unit q, k. Forward: the K/V block at hand is sent on while this rank adds its
    share, W steps. Backward: the K/V blocks go round again, each followed by its dK/dV partial sum, which
    every rank adds its queries' share to and passes on, until after W steps it reaches the block's owner."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, causal: bool, scale: float, zigzag: bool, block):
        mine = rank_chunks(ring.rank, ring.size, zigzag)
        chunk = q.shape[2] // len(mine)
        acc = torch.promote_types(q.dtype, torch.float32)  # sums over the ring's blocks, whatever the blocks' dtype
        num, den = q.new_zeros(q.shape, dtype=acc), q.new_zeros(*q.shape[:-1], 1, dtype=acc)
        kv = (k, v)
        for step in range(ring.size):
            theirs = rank_chunks((ring.rank - step) % ring.size, ring.size, zigzag)
            incoming = ring.shift(kv, tag=0) if step < ring.size - 1 else None
            for rows, keys, diagonal in _pieces(mine, theirs, causal, chunk):
                n, d = block[0](q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], scale, diagonal)
                num[:, :, rows] += n
                den[:, :, rows] += d
            if incoming is not None:
                kv = incoming.wait()
        out = num / den  # den > 0: exp is positive, and every query sees at least its own key
        ctx.save_for_backward(q, k, v, out, den)
        ctx.ring, ctx.args = ring, (causal, scale, zigzag, block)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, den = ctx.saved_tensors
        ring, (causal, scale, zigzag, block) = ctx.ring, ctx.args
        mine = rank_chunks(ring.rank, ring.size, zigzag)
        chunk = q.shape[2] // len(mine)
        acc = torch.promote_types(q.dtype, torch.float32)  # as the forward's: the partial sums travel in it too
        dq = q.new_zeros(q.shape, dtype=acc)
        kv, partial = (k, v), None
        for step in range(ring.size):
            theirs = rank_chunks((ring.rank - step) % ring.size, ring.size, zigzag)
            incoming = ring.shift(kv, tag=0) if step < ring.size - 1 else None
            dk, dv = (x.new_zeros(x.shape, dtype=acc) for x in (k, v))
            for rows, keys, diagonal in _pieces(mine, theirs, causal, chunk):
                gq, gk, gv = block[1](q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out[:, :, rows],
                                      den[:, :, rows], d_out[:, :, rows], scale, diagonal)
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
            # The block's partial sum from the ranks before: sent after their compute, so it had ours to arrive.
            if partial is not None:
                before_k, before_v = partial.wait()
                dk += before_k
                dv += before_v
            partial = ring.shift((dk, dv), tag=1)
            if incoming is not None:
                kv = incoming.wait()
        dk, dv = partial.wait()  # our own block's, back from its last visitor
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def cosine_ring_attention(q, k, v, group=None, *, causal: bool, scale: float = 10.0, zigzag: bool = False,
                          backend: str = "auto"):
    """cosine_sim_attention(q, k, v, causal=causal, scale=scale) of the whole sequence, for this rank's
    slice of it: q (B, H, T, D), k, v (B, Hkv, T, D) at the positions of the rank's rank_chunks in the group
    (None: the default group). Every rank of the group must call it, and run its backward.

    ``backend`` picks the per-block compute (BLOCKS) as cosine_sim_attention's does: "torch" computes in fp32
    (fp64 for fp64 inputs), "cuda" (our kernels; fp16, bf16 or fp32 on a GPU) in the inputs' dtype (autocast's
    under autocast), "auto" the kernels where they run; the sums over blocks are fp32.
    """
    check_slices(q, k, v, zigzag)
    plan = resolve(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], keys=k.shape[2],
                   policy=cosine_policy(scale, True), backend=backend)
    work = plan.run_dtype if plan.backend == "cuda" else torch.promote_types(q.dtype, torch.float32)
    ring = _Ring(dist.group.WORLD if group is None else group)
    # Normalised once, outside the ring: autograd takes the gradient through the norm, the ring sees unit rows.
    qn, kn = (scale_rows(x.to(torch.promote_types(x.dtype, torch.float32)), 1.0).to(work) for x in (q, k))
    out = _CosineRing.apply(qn, kn, v.to(work), ring, causal, float(scale), zigzag, BLOCKS[plan.backend])
    return out.to(q.dtype)


def _gather(tensors, group, ranks) -> _Transfer:
    """Start an all_gather of each of tensors over group; the transfer brings, for each of ``ranks`` (ranks
    of the group), that rank's tensors as a tuple."""
    sent = [t.contiguous() for t in tensors]
    parts = [[torch.empty_like(t) for _ in range(dist.get_world_size(group))] for t in sent]
    works = [dist.all_gather(p, t, group=group, async_op=True) for p, t in zip(parts, sent)]
    return _Transfer(works, sent, [tuple(p[r] for p in parts) for r in ranks])


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x, concatenated along dim 0 in rank order."""
    parts = _gather([x], group, range(dist.get_world_size(group))).wait()  # a tuple of one per rank
    return torch.cat([part[0] for part in parts])


class _SeenStates(torch.autograd.Function):
    """For each of this rank's chunks, the sum of the states of the chunks it sees whole.

    ``states`` (n, ...) holds this rank's n chunk states; ``sees`` (C, C) says which chunk (in all_gather
    order: rank by rank, each rank's chunks in turn) sees which, and ``mine`` which rows are this rank's.
    One all_gather rather than a scan from rank to rank: a scan passes W-1 times through every rank in
    turn, one after the other, while an all_gather is one collective whose W states of a few MB are cheap;
    and any layout (zigzag too) is just another ``sees``. Backward is the adjoint: a chunk's state gets the
    gradients of the chunks that saw it, from an all_gather of them.
    """

    @staticmethod
    def forward(ctx, states, group, sees: torch.Tensor, mine: slice):
        ctx.group, ctx.sees, ctx.mine = group, sees, mine
        return torch.tensordot(sees[mine].to(states.dtype), _all_gather(states, group), dims=1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        seen_by = ctx.sees[:, ctx.mine].T.to(grad.dtype)
        return torch.tensordot(seen_by, _all_gather(grad, ctx.group), dims=1), None, None, None


class _RankStates:
    """A rank's exchange with the other ranks of its context group, in plain order, for fastmax's linear form on
    the kernels (the ``exchange`` of attention_cuda._kernels.linear_attention, which says what travels): the
    values' mean they agree on, and the state images they trade. All_gathers, as _SeenStates' are, for the same
    reasons (one collective; each image whole, a few MB); every rank then sums the images it needs and folds the
    sum into its own chunks' states, which its reads take anyway (_LinearAttention)."""

    def __init__(self, group, causal: bool):
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        others = [r for r in range(size) if r != rank]
        # Under causal a rank's queries see the earlier ranks' keys and its keys are seen by the later ranks' queries.
        self.seen = [r for r in others if r < rank or not causal]
        self.seen_by = [r for r in others if r > rank or not causal]

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def states(self, image: torch.Tensor, scale: torch.Tensor) -> _Transfer:
        """Start sending the state of this rank's keys, (image, scale); the transfer brings the (image, scale) of
        each rank whose keys this rank's queries see."""
        return _gather((image, scale), self.group, self.seen)

    def gradients(self, image: torch.Tensor, scale: torch.Tensor, g_scale: torch.Tensor) -> _Transfer:
        """Start sending the moments of this rank's queries' gradients, (image, scale, g's scale); the transfer
        brings those of each rank whose queries saw this rank's keys."""
        return _gather((image, scale, g_scale), self.group, self.seen_by)


def fastmax_context_parallel(q, k, v, group=None, *, causal: bool, p: int = 2, a0: float = 1.0, a1: float = 1.0,
                             a2: float = 0.5, temperature: float = 1.0, normalize: bool = False, lim: float = 1.0,
                             zigzag: bool = False, backend: str = "auto", tuning: Tuning | None = None):
    """fastmax_attention(q, k, v, causal=causal, ...) of the whole sequence, for this rank's slice of it
    (shapes and layout as cosine_ring_attention's; its options are fastmax_attention's). Only states travel,
    whatever the length: no K or V leaves its rank. Every rank of the group must call it, and run its backward.

    ``backend="torch"``: each chunk of the slice reads the moments of the keys before it (all keys without
    causal), summed from the ranks' states (fp32, fp64 for fp64 inputs), and adds its own causal block,
    quadratically: numerators and denominators add.

    ``backend="cuda"`` ("auto": where plan.resolve finds the kernels can): the slice runs in fastmax's linear
    form on our chunked kernels (Hopper, head dims 64 and 128, fp16 or bf16: autocast's dtype under autocast,
    else the inputs', in which the output comes back, as from fastmax_attention), in chunks of ``tuning``'s
    chunked_rows (plan.TUNING's when None); the sum of the
    state images of the earlier ranks' keys (all other ranks' without causal) is folded into every chunk's state
    before its queries read it, and in the backward the sum of the moments of the gradients that those ranks'
    queries send back is folded into every chunk's reverse state before its keys read it
    (attention_cuda._kernels._LinearAttention). Linear in the slice's length; the other ranks cost an elementwise
    pass over the slice's state images per direction and no read of their own, whatever the group's size. Plain
    order only.
    """
    check_slices(q, k, v, zigzag)
    if zigzag and backend == "cuda":
        raise ValueError("zigzag: fastmax on the kernels takes plain order, where a rank's slice is one run of the "
                         "sequence and reads one state per other rank; got zigzag=True")
    policy = fastmax_policy(p, a0, a1, a2, temperature, normalize, lim)
    plan = resolve(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], keys=k.shape[2], policy=policy,
                   backend="torch" if zigzag else backend, form="linear", tuning=tuning, exchange=True)
    group = dist.group.WORLD if group is None else group
    if plan.backend == "cuda":
        return linear_attention(q, k, v, None, causal, policy, plan.run_dtype, plan.chunk, True,
                                _RankStates(group, causal))
    work = plan.score_dtype
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = len(rank_chunks(rank, world, zigzag))
    b, h, t, d = q.shape
    hkv, size = k.shape[1], t // n
    qw = q.to(work).reshape(b, hkv, h // hkv, t, d)  # grouped heads read their kv head's state
    kw, vw = k.to(work), v.to(work)
    keep = torch.ones(b, 1, size, 1, dtype=torch.bool, device=q.device)
    spans = [slice(i * size, (i + 1) * size) for i in range(n)]
    states = torch.stack([key_moment(kw[:, :, s], vw[:, :, s], keep, policy) for s in spans])

    ids = torch.tensor([c for r in range(world) for c in rank_chunks(r, world, zigzag)], device=q.device)
    sees = ids[None, :] < ids[:, None] if causal else torch.ones(len(ids), len(ids), dtype=torch.bool,
                                                                 device=q.device)
    seen = _SeenStates.apply(states, group, sees, slice(rank * n, (rank + 1) * n))
    band = size if causal else 0  # without causal the states hold the chunk's own keys already
    y = torch.cat([chunk_rows(qw[..., s, :], kw[:, :, s][:, :, :band], vw[:, :, s][:, :, :band], keep[:, :, :band],
                              state, 0, 0, 0, policy) for s, state in zip(spans, seen)], dim=-2)
    return safe_divide(y[..., :d], y[..., d:]).reshape(b, h, t, d).to(q.dtype)
