"""Context parallelism: one sequence split across the ranks of a process group, each rank holding q (B, H, T, D)
and k, v (B, Hkv, T, D) of its own slice, T = its length.

Cosine-sim runs as ring attention: K/V blocks travel from rank to rank and each rank adds their share to its
queries' sums. Fastmax never moves K/V: its linear form needs only the fixed-size moments state of the keys
before a slice, a prefix sum of the ranks' states (as LASP does). Both run on the pure-PyTorch reference or on
our kernels (``backend``). Softmax runs on PyTorch's own context-parallel SDPA (its ring attention), the
baseline's like for like. docs/context_parallel.md says how, and what the GPUs still have to show.

Layout: the sequence is cut into chunks of equal length. In plain order rank r holds chunk r of W; in
zigzag order it holds chunks r and 2W-1-r of 2W, so that under causal attention every rank does the same
work (its early chunk sees few keys, its late one many). shard_sequence gives a rank's slice of a batch and
the positions it holds (RoPE's rows); the attention functions read the same layout from the group.
"""
from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.distributed as dist
import torch.distributed.tensor.experimental._attention as torch_cp
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_cuda import cuda_unavailable_reason
from attention_cuda._kernels import linear_attention
from attention_cuda.plan import TUNING, Tuning, chunked_path, kernels_reason, linear_kernels_reason, run_dtype
from attention_cuda.reference import chunk_rows, expand_kv, key_moment, safe_divide, scale_rows, score_dtype
from attention_cuda.score import cosine_policy, poly_policy
from model.attention import kernel_backend


def _chunks(rank: int, world_size: int, zigzag: bool) -> tuple[int, ...]:
    """The chunks rank holds, ascending: its slice is their concatenation, so its positions increase."""
    return (rank, 2 * world_size - 1 - rank) if zigzag else (rank,)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, zigzag: bool = False):
    """Rank's slice of x (B, T, ...) along T and the positions (T / world_size,) it holds, for RoPE: its
    rows are cos[positions], sin[positions] (in plain order a start offset of positions[0])."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    chunks = 2 * world_size if zigzag else world_size
    if x.dim() < 2 or x.shape[1] % chunks:
        raise ValueError(f"x: expected (B, T, ...) with T divisible by {chunks} (the chunks of world_size="
                         f"{world_size}{' in zigzag order' if zigzag else ''}), got shape {tuple(x.shape)}")
    size = x.shape[1] // chunks
    positions = torch.cat([torch.arange(c * size, (c + 1) * size, device=x.device)
                           for c in _chunks(rank, world_size, zigzag)])
    return x[:, positions], positions


def _check_slices(q, k, v, zigzag: bool) -> None:
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


LOG2E = math.log2(math.e)


def _kernel_options(scale: float):
    """attn_cuda's score options (kind, scale, qk_norm, coef, normalize) for rows the ring made unit itself."""
    return "cosine", scale, None, (0.0, 0.0, 0.0), True


def cosine_block_cuda(q, k, v, scale: float, diagonal: bool):
    """cosine_block on our tiled forward kernel (q, k, v in fp16/bf16/fp32 on a GPU; num, den in fp32). Its
    output is the block's num / den and its row statistic gives den: 1 / den under a fixed shift of scale
    (the reference's), or log2 of the unshifted sum, sum_s exp(scale q.k_s), under a running max, which
    the shift of scale brings to the reference's."""
    ops = torch.ops.attn_cuda
    options = _kernel_options(scale)
    out, stat = ops.fwd(q, k, v, None, None, diagonal, *options)[:2]
    stat = stat[..., :q.shape[2], None]
    log = ops.stat_is_log(*options, False, q.dtype)
    den = torch.exp2(stat - scale * LOG2E) if log else stat.reciprocal()
    return out.float() * den, den


def cosine_block_backward_cuda(q, k, v, out, den, d_out, scale: float, diagonal: bool):
    """cosine_block_backward on our backward kernel, which given the whole row's output and statistic
    computes exactly one block's share (its weights normalised by the whole row's sum)."""
    ops = torch.ops.attn_cuda
    options = _kernel_options(scale)
    b, h, i, _ = q.shape
    stat = den.new_zeros(b, h, -(-i // 4) * 4)  # the kernels' rows, padded to 4
    log = ops.stat_is_log(*options, False, q.dtype)
    stat[..., :i] = (torch.log2(den) + scale * LOG2E if log else den.reciprocal())[..., 0]
    empty = stat.new_empty(0)
    return ops.bwd(d_out.to(q.dtype), q, k, v, None, None, out.to(q.dtype), stat, empty, empty, diagonal,
                   *options, False)[:3]


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
        mine = _chunks(ring.rank, ring.size, zigzag)
        chunk = q.shape[2] // len(mine)
        acc = torch.promote_types(q.dtype, torch.float32)  # sums over the ring's blocks, whatever the blocks' dtype
        num, den = q.new_zeros(q.shape, dtype=acc), q.new_zeros(*q.shape[:-1], 1, dtype=acc)
        kv = (k, v)
        for step in range(ring.size):
            theirs = _chunks((ring.rank - step) % ring.size, ring.size, zigzag)
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
        mine = _chunks(ring.rank, ring.size, zigzag)
        chunk = q.shape[2] // len(mine)
        acc = torch.promote_types(q.dtype, torch.float32)  # as the forward's: the partial sums travel in it too
        dq = q.new_zeros(q.shape, dtype=acc)
        kv, partial = (k, v), None
        for step in range(ring.size):
            theirs = _chunks((ring.rank - step) % ring.size, ring.size, zigzag)
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
                          backend: str = "torch"):
    """cosine_sim_attention(q, k, v, causal=causal, scale=scale) of the whole sequence, for this rank's
    slice of it: q (B, H, T, D), k, v (B, Hkv, T, D) at the positions shard_sequence gives the rank in the
    group's layout (None: the default group). Every rank of the group must call it, and run its backward.

    ``backend`` picks the per-block compute (BLOCKS): "torch" computes in fp32 (fp64 for fp64 inputs),
    "cuda" (our kernels; fp16, bf16 or fp32 on a GPU) in the inputs' dtype; the sums over blocks are fp32.
    """
    _check_slices(q, k, v, zigzag)
    if backend not in BLOCKS:
        raise ValueError(f"backend: expected one of {tuple(BLOCKS)}, got {backend!r}")
    # kernels_reason also loads the ops, which a process that has not called the kernels yet lacks.
    reason = kernels_reason(q.device, q.dtype, q.shape[-1]) if backend == "cuda" else None
    if reason is not None:
        raise ValueError(f"backend: 'cuda' cannot run these inputs: {reason}")
    work = torch.promote_types(q.dtype, torch.float32) if backend == "torch" else q.dtype
    cosine_policy(scale, True).check_range(torch.promote_types(work, torch.float32))
    ring = _Ring(dist.group.WORLD if group is None else group)
    # Normalised once, outside the ring: autograd takes the gradient through the norm, the ring sees unit rows.
    qn, kn = (scale_rows(x.to(torch.promote_types(x.dtype, torch.float32)), 1.0).to(work) for x in (q, k))
    out = _CosineRing.apply(qn, kn, v.to(work), ring, causal, float(scale), zigzag, BLOCKS[backend])
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


FASTMAX_BACKENDS = ("torch", "cuda")


def _kernels_reason(device: torch.device, dtype: torch.dtype, d: int, tuning: Tuning) -> str | None:
    """None when the chunked linear-form kernels run a slice of head dim d in dtype on device, else why not."""
    reason = kernels_reason(device, dtype, d) or linear_kernels_reason(dtype, d, tuning)
    if reason is None and not chunked_path(dtype, d, tuning):
        reason = (f"the ranks trade the chunked kernels' state images, which an sm_90a build runs on Hopper at "
                  f"head dims 64 and 128 with tuning.chunked_rows > 0; here (head dim {d}, chunked_rows "
                  f"{tuning.chunked_rows}) the linear form would run on the sweep, whose state never leaves the kernel")
    return reason


def fastmax_context_parallel(q, k, v, group=None, *, causal: bool, p: int = 2, a0: float = 1.0, a1: float = 1.0,
                             a2: float = 0.5, temperature: float = 1.0, normalize: bool = False, lim: float = 1.0,
                             zigzag: bool = False, backend: str = "torch", tuning: Tuning | None = None):
    """fastmax_attention(q, k, v, causal=causal, ...) of the whole sequence, for this rank's slice of it
    (shapes and layout as cosine_ring_attention's; its options are fastmax_attention's). Only states travel,
    whatever the length: no K or V leaves its rank. Every rank of the group must call it, and run its backward.

    ``backend="torch"``: each chunk of the slice reads the moments of the keys before it (all keys without
    causal), summed from the ranks' states (fp32, fp64 for fp64 inputs), and adds its own causal block,
    quadratically: numerators and denominators add.

    ``backend="cuda"``: the slice runs in fastmax's linear form on our chunked kernels (Hopper, head dims 64
    and 128, fp16 or bf16: autocast's dtype under autocast, else the inputs', in which the output comes back,
    as from fastmax_attention), in chunks of ``tuning``'s chunked_rows (plan.TUNING's when None); the sum of the
    state images of the earlier ranks' keys (all other ranks' without causal) is folded into every chunk's state
    before its queries read it, and in the backward the sum of the moments of the gradients that those ranks'
    queries send back is folded into every chunk's reverse state before its keys read it
    (attention_cuda._kernels._LinearAttention). Linear in the slice's length; the other ranks cost an elementwise
    pass over the slice's state images per direction and no read of their own, whatever the group's size. Plain
    order only.
    """
    _check_slices(q, k, v, zigzag)
    if backend not in FASTMAX_BACKENDS:
        raise ValueError(f"backend: expected one of {FASTMAX_BACKENDS}, got {backend!r}")
    policy = poly_policy(p, a0, a1, a2, temperature, normalize, lim)
    work = score_dtype(q.dtype, linear=True)
    policy.check_range(work)  # the kernels' scores are fp32 too
    group = dist.group.WORLD if group is None else group
    if backend == "cuda":
        if zigzag:
            raise ValueError("zigzag: fastmax on the kernels takes plain order, where a rank's slice is one run of the "
                             "sequence and reads one state per other rank; got zigzag=True")
        tuning = TUNING if tuning is None else tuning
        dtype = run_dtype(q.dtype, True)
        reason = _kernels_reason(q.device, dtype, q.shape[-1], tuning)
        if reason is not None:
            raise ValueError(f"backend: 'cuda' runs fastmax on the chunked linear-form kernels: {reason}")
        return linear_attention(q, k, v, None, causal, policy, dtype, tuning.chunked_rows, True,
                                _RankStates(group, causal))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = len(_chunks(rank, world, zigzag))
    b, h, t, d = q.shape
    hkv, size = k.shape[1], t // n
    qw = q.to(work).reshape(b, hkv, h // hkv, t, d)  # grouped heads read their kv head's state
    kw, vw = k.to(work), v.to(work)
    keep = torch.ones(b, 1, size, 1, dtype=torch.bool, device=q.device)
    spans = [slice(i * size, (i + 1) * size) for i in range(n)]
    states = torch.stack([key_moment(kw[:, :, s], vw[:, :, s], keep, policy) for s in spans])

    ids = torch.tensor([c for r in range(world) for c in _chunks(r, world, zigzag)], device=q.device)
    sees = ids[None, :] < ids[:, None] if causal else torch.ones(len(ids), len(ids), dtype=torch.bool,
                                                                 device=q.device)
    seen = _SeenStates.apply(states, group, sees, slice(rank * n, (rank + 1) * n))
    band = size if causal else 0  # without causal the states hold the chunk's own keys already
    y = torch.cat([chunk_rows(qw[..., s, :], kw[:, :, s][:, :, :band], vw[:, :, s][:, :, :band], keep[:, :, :band],
                              state, 0, 0, 0, policy) for s, state in zip(spans, seen)], dim=-2)
    return safe_divide(y[..., :d], y[..., d:]).reshape(b, h, t, d).to(q.dtype)


# The SDPA kernels PyTorch's context parallelism sends round its ring (its DTensor handler takes their ops), by
# sdpa_backend. Not "math": that is SDPA spelled in ordinary ops, which DTensor cannot run on sequence shards. Not
# "efficient" either: under the ring it failed its 2-GPU test against float64 (bf16 and fp16, session 37;
# docs/context_parallel.md), where flash and cuDNN pass.
RING_BACKENDS = {"auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION],
                 "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}
# Those kernels are CUDA's: on a CPU SDPA runs an op of its own, which PyTorch's ring does not take.
RING_DEVICE = "cuda"
# How the ring moves K/V: "alltoall" passes each block to the next rank, one step at a time, as cosine's ring does
# ("allgather", PyTorch's default, gathers all W blocks at once on every rank).
RING_ROTATION = "alltoall"


def softmax_mesh(group, device: torch.device) -> DeviceMesh:
    """The 1-D DeviceMesh of group's ranks (on device's type) that softmax_context_parallel takes, with PyTorch's
    context-parallel SDPA switched on. That switch is PyTorch's and process-wide: from now on SDPA on any DTensor
    sharded along the sequence runs as its ring, and only softmax_context_parallel makes such tensors here.

    The public torch.distributed.tensor.experimental.context_parallel() is a with-block that shards given buffers
    itself and patches F.scaled_dot_product_attention while it lasts, forward and backward; the model shards its
    own slices and calls SDPA on DTensors, so it takes the switch beneath that (private, as are the options below;
    the same in torch 2.11 and 2.13)."""
    # PyTorch's ring balances causal work by head-tail order: rank r holds chunks r and 2W-1-r, which is our
    # zigzag (its mesh rank is our group rank: the mesh is the group's own).
    torch_cp._cp_options.enable_load_balance = True
    torch_cp.set_rotate_method(RING_ROTATION)
    torch_cp._enable_context_parallel_dispatcher()
    return DeviceMesh.from_group(group, device.type)


def softmax_context_parallel(q, k, v, mesh: DeviceMesh, *, backend: str = "auto"):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True) of the whole sequence, for this rank's slice of it
    in zigzag order (shard_sequence's; shapes as cosine_ring_attention's), on PyTorch's context-parallel SDPA over
    ``mesh`` (softmax_mesh's): a ring that passes K/V blocks from rank to rank and merges each block's output by
    its log-sum-exp, in fp32. ``backend`` is SDPA's (RING_BACKENDS; "auto": PyTorch's pick among them). Every
    rank of the mesh must call it, and run its backward."""
    _check_slices(q, k, v, zigzag=True)
    if backend not in RING_BACKENDS:
        raise ValueError(f"backend: PyTorch's ring runs SDPA's fused kernels, expected one of {tuple(RING_BACKENDS)}, "
                         f"got {backend!r}")
    # Grouped heads expanded first: SDPA's cuDNN kernel takes none (enable_gqa is flash's and math's).
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    q, k, v = (DTensor.from_local(x, mesh, [Shard(2)], run_check=False) for x in (q, k, v))
    with sdpa_kernel(RING_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).to_local()


def context_zigzag(cfg, size: int) -> bool:
    """Whether a model of cfg (a GPTConfig) splits its sequences over ``size`` ranks in zigzag order, or
    ValueError naming what cannot run context-parallel. The one place that decides what a model's context
    parallelism supports, for the model and for train.py's --context-parallel alike."""
    if cfg.attention == "softmax" and cfg.sdpa_backend not in RING_BACKENDS:
        raise ValueError(f"sdpa_backend: softmax across ranks runs on PyTorch's context-parallel SDPA, whose ring "
                         f"takes SDPA's flash and cuDNN kernels; expected one of {tuple(RING_BACKENDS)}, "
                         f"got {cfg.sdpa_backend!r}")
    if cfg.cosine_sdpa:
        raise ValueError("cosine_sdpa: context parallelism computes cosine's blocks on our kernels or the PyTorch "
                         "reference, not on SDPA; leave cosine_sdpa off")
    if cfg.swa_window:
        raise ValueError("swa_window: the ring passes whole slices of keys to every rank and implements no "
                         "sliding window, so the windowed blocks cannot run context-parallel; expected 0, "
                         f"got {cfg.swa_window}")
    if cfg.short_conv:
        raise ValueError(f"short_conv: a slice's first positions would need the previous rank's last inputs, which "
                         f"context parallelism does not pass; expected 0, got {cfg.short_conv}")
    # Causal cosine and softmax are quadratic: in plain order the last rank's queries see every key, the first
    # rank's only its own, so zigzag balances the ring (and is PyTorch's head-tail order, which its softmax ring
    # takes). Fastmax is linear: each chunk reads one state and does its own band, the same work wherever it
    # sits, and plain order sends one state per rank rather than two (and is the order its kernels take).
    zigzag = cfg.attention != "fastmax"
    chunks = 2 * size if zigzag else size
    if cfg.seq_len % chunks:
        raise ValueError(f"seq_len: context parallelism over {size} ranks cuts each sequence into {chunks} chunks "
                         f"({'zigzag order, ' if zigzag else ''}{cfg.attention}), expected a multiple of {chunks}, "
                         f"got {cfg.seq_len}")
    return zigzag


def context_device_problem(cfg, device: torch.device) -> str | None:
    """Why a model of cfg cannot run context-parallel on device, or None: what context_zigzag cannot tell from
    the config alone, for ContextParallel and for train.py (which asks before it starts any process group)."""
    if cfg.attention == "softmax" and device.type != RING_DEVICE:
        return (f"device: softmax across ranks runs on PyTorch's context-parallel SDPA, whose ring takes SDPA's "
                f"flash and cuDNN kernels, on {RING_DEVICE}; got {device}")
    return None


class ContextParallel:
    """A model's place in a context-parallel group: the slice of each sequence this rank holds, attention
    over the group's ranks, and this rank's share of the loss. ``device``: the model's."""

    def __init__(self, cfg, group, device: torch.device):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.zigzag = context_zigzag(cfg, self.size)
        problem = context_device_problem(cfg, device)
        if problem is not None:
            raise ValueError(problem)
        backend = kernel_backend(cfg)
        if backend == "auto":  # use_cuda_kernel None: a model built outside train.py, which settles it at start-up
            backend = "cuda" if device.type == "cuda" and cuda_unavailable_reason() is None else "torch"
        if cfg.attention == "softmax":
            self.attend = functools.partial(softmax_context_parallel, mesh=softmax_mesh(group, device),
                                            backend=cfg.sdpa_backend)
        elif cfg.attention == "cosine":
            self.attend = functools.partial(cosine_ring_attention, group=group, causal=True, scale=cfg.cosine_scale,
                                            zigzag=True, backend=backend)
        else:
            self.attend = functools.partial(fastmax_context_parallel, group=group, causal=True, zigzag=False,
                                            p=cfg.fastmax_p, a0=cfg.fastmax_a0, a1=cfg.fastmax_a1, a2=cfg.fastmax_a2,
                                            temperature=cfg.fastmax_temperature, normalize=cfg.fastmax_normalize,
                                            lim=cfg.fastmax_lim, backend=backend)

    def shard(self, x: torch.Tensor):
        """This rank's slice of x (B, T, ...) and its positions."""
        return shard_sequence(x, self.rank, self.size, zigzag=self.zigzag)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        """This rank's share of the loss of the whole targets (B, T), given the logits of its slice: "mean",
        the summed cross-entropy of its slice's targets over the count of all targets, so that the shares
        add up over the group to the whole mean and their gradients to its gradient; "none", the per-token
        loss (B, T) of the whole sequence, the same on every rank, for evaluation by position (no gradient:
        training takes the mean)."""
        mine, positions = self.shard(targets)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mine.flatten(), reduction="none").view_as(mine)
        if reduction == "mean":
            # Every rank holds the whole targets, so the count needs no exchange (-100: cross_entropy's ignore_index).
            return loss.sum() / targets.ne(-100).sum()
        whole = loss.detach().new_zeros(targets.shape).index_copy(1, positions, loss.detach())
        dist.all_reduce(whole, group=self.group)
        return whole
