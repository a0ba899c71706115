"""The CUDA kernels as differentiable torch ops: one autograd.Function per form (the tiled quadratic
kernels, and fastmax's linear form over them), RoPE's passes around them, and the forward-only paths (split
keys, cosine's decode kernel), taking what plan.resolve decided.

Precision: fp16/bf16 inputs run on tensor cores with fp32 accumulation and fp32 softmax statistics,
as FlashAttention does. fp32 inputs run as TF32 (operands rounded to a 10-bit mantissa, fp32
accumulation): the same precision as a PyTorch fp32 matmul with ``allow_tf32=True``.
"""
from __future__ import annotations

import dataclasses

import torch

from . import _ops
from .reference import scale_rows, split_qkv
from .score import ScorePolicy


def attention(q, k, v, mask, bias, causal: bool, policy: ScorePolicy, dtype: torch.dtype) -> torch.Tensor:
    """O = sum_s A_ts v_s / l_t on the tiled kernels, in dtype; differentiable w.r.t. q, k, v and attn_bias.

    q (B, H, I, D), k and v (B, Hkv, J, D) with any strides, mask None or bool (B, J) (True = keep),
    bias None or (B, H, I, J) (an expanded view is fine; another dtype is cast to dtype).
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = _zero_masked(k, v, mask)
    if bias is not None:
        bias = bias.to(dtype)
    return _Attention.apply(q, k, v, mask, bias, causal, policy)


def _zero_masked(k, v, mask):
    """k, v with the rows the mask hides zeroed. Padded slots may hold garbage, and the tensor cores multiply
    a masked key's zero weight into its K and V rows (0 * NaN = NaN): zeroed rows keep it out of every
    product, forward and backward. A copy of k and v, paid only by calls with a mask."""
    if mask is None:
        return k, v
    keep = mask[:, None, :, None]
    return torch.where(keep, k, 0), torch.where(keep, v, 0)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, causal, policy):
        f = _ops.fwd(q, k, v, mask=mask, bias=bias, causal=causal, policy=policy)
        # Under the qk norm the kernels read the unit keys kn (k / |k| in k's dtype), the backward too.
        ctx.save_for_backward(q, f.kn if policy.qk_norm is not None else k, v, mask, bias, f.out, f.stat.raw, f.rq,
                              f.rk)
        ctx.causal, ctx.stat = causal, f.stat._replace(raw=None)
        return f.out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, bias, out, stat, rq, rk = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[4]
        dq, dk, dv, dbias = _ops.bwd(dout, q, k, v, mask=mask, bias=bias, out=out, stat=ctx.stat._replace(raw=stat),
                                     rq=rq, rk=rk, causal=ctx.causal, bias_grad=bias_grad)
        return dq, dk, dv, None, dbias if bias_grad else None, None, None


def rotary_qkv(qkv, cos, sin, heads: int, kv_heads: int):
    """q and k rotated by RoPE in one pass over the fused projection's rows (attn_cuda::rope_split), the
    kernels' layout, and v as a strided view of them; backward, one pass (attn_cuda::rope_merge) writes the
    projection's gradient. cos, sin (T, D/2) in fp32."""
    return _RotaryQKV.apply(qkv, cos.float().contiguous(), sin.float().contiguous(), heads, kv_heads)


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, kv_heads):
        q, k = _ops.rope_split(qkv, cos, sin, heads, kv_heads)
        ctx.save_for_backward(cos, sin)
        return q, k, split_qkv(qkv, heads, kv_heads)[2]

    @staticmethod
    def backward(ctx, dq, dk, dv):  # an unused output's gradient comes as zeros (materialize_grads)
        cos, sin = ctx.saved_tensors
        return _ops.rope_merge(dq, dk, dv, cos, sin), None, None, None, None


def split_keys(q, k, v, mask, policy: ScorePolicy, dtype: torch.dtype, splits: int) -> torch.Tensor:
    """The forward alone (no autograd) over about ``splits`` parts of the keys, merged: flash-decoding, for
    calls whose query blocks alone would leave most SMs idle (plan.key_splits). Same contract as
    ``attention`` without bias or causal: every query sees every key the mask keeps.

    For each batch row the parts of ``size`` keys are one call, folded into the batch as strided views
    (no copy), and the remainder another. A part's output is normalised by its own weight sum l_s; the
    merge weighs it by l_s, its RowStat's sum (under a running max each row's sums over the largest part's).
    Rows without normalisation (exp) simply add.
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = _zero_masked(k, v, mask)
    b, h, i, d = q.shape
    j = k.shape[2]
    size = -(-j // (splits * 128)) * 128  # whole key tiles
    full = j // size
    rows = []
    for n in range(b):
        parts = [(full, k[n, :, :full * size].unflatten(1, (full, size)).transpose(0, 1),
                  v[n, :, :full * size].unflatten(1, (full, size)).transpose(0, 1),
                  None if mask is None else mask[n, :full * size].view(full, size))]
        if full * size < j:
            parts.append((1, k[n:n + 1, :, full * size:], v[n:n + 1, :, full * size:],
                          None if mask is None else mask[n:n + 1, full * size:]))
        calls = [_ops.fwd(q[n:n + 1].expand(count, h, i, d), kp, vp, mask=mp, bias=None, causal=False, policy=policy)
                 for count, kp, vp, mp in parts]
        out = torch.cat([c.out for c in calls]).float()
        if not policy.normalize_rows:
            rows.append(out.sum(0))
            continue
        # A part whose keys the mask hides all has l = 0 and weighs nothing; a row no part lets see a key is
        # zeros, as the kernels give it.
        stat = calls[0].stat._replace(raw=torch.cat([c.stat.raw for c in calls]))
        weight = stat.part_sums(0)
        total = weight.sum(0)[..., None]
        rows.append(torch.where(total > 0, (out * weight[..., None]).sum(0) / total, 0))
    return torch.stack(rows).to(dtype)


def decode(q, k, v, mask, policy: ScorePolicy, dtype: torch.dtype) -> torch.Tensor:
    """Cosine over one query row per head, q (B, H, 1, D), on the decode kernel (attn_cuda::decode, forward
    only, no autograd): a decode step over a key cache. Same contract as ``attention`` without bias or causal.

    The kernel reads the mask as a predicate, never loading a masked key's K and V rows, so garbage behind
    the mask needs no zeroing copy (as ``_zero_masked`` makes for the tiled kernels), and weighs each key by
    exp(x - |scale|) of unit rows with no running max (plan.decodes says where that holds). It splits the
    keys into as many parts as fill the GPU, one block each, and adds up the parts' sums.
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return _ops.decode(q, k, v, mask, policy)


def linear_attention(q, k, v, mask, causal: bool, policy: ScorePolicy, dtype: torch.dtype, chunk: int,
                     chunked: bool, exchange=None) -> torch.Tensor:
    """Fastmax in its linear form on the kernels: moments carried over chunks of ``chunk`` rows (fp32) on
    the chunked kernels or the sweep, each chunk's own causal block on the tiled quadratic kernel. Same
    contract as ``attention``; more keys than one chunk holds (plan.resolve sees to it).

    The moments cost O(D^3) per token (p = 2) and no N: it wins over the quadratic form at long N.
    The temperature rides in the coefficients (f(s x) = a0 + a1 s x + a2 s^2 x^2); normalisation, when
    asked for, is differentiable PyTorch in front of the op.

    ``exchange``: these rows are one rank's slice of a sequence split over a context group, whose other
    ranks' keys these queries see too (model.context_parallel's _RankStates; None: a single process). It
    needs the chunked kernels, whose state images are what the ranks exchange (see _LinearAttention).
    """
    if exchange is not None and not chunked:
        raise ValueError("exchange: the ranks exchange the chunked kernels' state images; the sweep keeps its "
                         "state in registers, so expected chunked=True")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if policy.qk_norm is not None:
        q, k = (scale_rows(x.float(), policy.qk_norm).to(dtype) for x in (q, k))
    # Causal calls align bottom-right: query t sits at key position t + j - i. In chunk rows, queries
    # start at j - i when there are more keys, and the first i - j queries see placeholder keys when
    # there are fewer (masked, so those queries see none).
    front = k.shape[2] - q.shape[2] if causal else 0
    mask = None if mask is None else mask.contiguous()
    # The kernels see rows normalised already: the diagonal blocks' policy has no qk norm.
    return _LinearAttention.apply(q, k, v, mask, causal, dataclasses.replace(policy, qk_norm=None),
                                  max(front, 0), max(-front, 0), chunk, chunked, exchange)


class _LinearAttention(torch.autograd.Function):
    """y = [num, l] = moments of the chunks before (_moments) + the chunk's own causal block
    (attn_cuda::fwd, whose saved 1/l and output give its num and l back); out = num / l.

    The moments take chunk-major rows [x, 1, 0 ... 0] (attn_cuda::lin_rows; the 1 carries the constant
    and first-order terms) and their outputs come back to natural rows in one pass each (lin_out,
    lin_grad). Backward, with g = [dO, -(dO . O)] / l: dq from the same moments read against g (R2), dk
    and dv from the moments of psi(q) g^T carried in reverse (R1 and R2 with the keys), and the diagonal
    blocks from attn_cuda::bwd, which given the final O and 1/l computes exactly their share. The moments
    take the values shifted by their mean mu (lin_out adds mu l back), and g's last column as
    -(dO . (O - mu)) / l (see backward).

    With an exchange (one rank's slice of a sequence; linear_attention) the other ranks' keys add to y
    before lin_out, so that out and 1/l are the whole row's, which is all the backward's pieces need to
    give their exact share. They add through the state: the moments of the keys a chunk sees are those of
    this rank's chunks before it plus those of every key of the ranks it sees, so the incoming states (the
    earlier ranks': the exclusive prefix) are summed into one image and folded into every chunk's image
    (_folded) before the chunks read their state (R1), and dq reads the same folded state against g (R2).
    Backward, its reverse: the later ranks' gradient moments, summed, are folded into every chunk's
    reverse state before the keys read it (R1: dv, R2: dk). So the other ranks cost one elementwise pass
    over the local images per direction and no read of their own. What goes out is the state over all
    of this rank's rows: the causal state's last chunk (first, in reverse) plus that chunk's own rows
    (_whole), one chunk's lin_state rather than all of them again. The ranks agree on one mu (the mean
    over all their keys), so that every image holds the same v - mu; g's scale is each rank's own, so a
    returned image is brought to this rank's in the sum (both powers of two). No K or V leaves its rank.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, policy, shift_q, shift_k, chunk, chunked, exchange):
        coefs, scale = policy.coef, policy.scale
        b, h, i, d = q.shape
        hkv, j = k.shape[1], k.shape[2]
        n_pad = -(-max(i + shift_q, j + shift_k) // chunk) * chunk
        qc = _ops.lin_rows(q, None, None, shift_q, n_pad, d + 16, chunk)
        # Masked keys are zero rows in k too, not only in [v, 1]: the dk/dv moments read every key's
        # features, and a zero row reads nothing (dv = 0 there, as the mask says).
        kc = _ops.lin_rows(k, mask, None, shift_k, n_pad, d + 16, chunk)
        # The backward's dq and dk sum phi(k_s) (dO . v_s - dO . O) / l over keys, as the moments of [v, 1]
        # read against g = [dO, -dO . O] / l: two sums, each rounded (g and the moments enter the tensor
        # cores in fp16/bf16), that cancel down to the spread of v. Values with a common offset (real
        # activations have one) make both parts large and the rounding of each shows. The weights sum
        # to 1, so any constant mu may come off both: v_s - mu and O - mu, with mu the mean value of the
        # visible keys per (batch, kv head). The forward's moments take the same v - mu, so that the
        # backward can read their state again; the diagonal blocks keep v as given.
        mu = _value_mean(v, mask, exchange)
        mu_h = mu.repeat_interleave(h // hkv, dim=1).contiguous()
        vs = _ops.lin_rows(v, mask, mu, shift_k, n_pad, d + 16, chunk)
        cr = [coefs[0], coefs[1] * scale, coefs[2] * scale * scale]  # the query side's, temperature included
        second, group = coefs[2] != 0, h // hkv
        state, seen = None, None
        if exchange is not None:
            # This rank's keys' state per chunk (of the chunks before it; of all of them without causal), and
            # from it the state of all its keys for the ranks whose queries see them: sent while the diagonal
            # blocks run.
            state = _state(kc, vs, 1, causal, False, second, cr)
            incoming = exchange.states(*(_whole(state, kc, vs, 1, False, second, cr) if causal else state))
        vc, keep_c, diag = None, None, (None, None)
        if causal:
            vc = _ops.lin_rows(v, mask, None, shift_k, n_pad, d, chunk)
            keep = torch.ones(b, j, dtype=torch.bool, device=q.device) if mask is None else mask
            keep_c = torch.nn.functional.pad(keep, (shift_k, n_pad - j - shift_k)).view(-1, chunk)
            f = _ops.fwd(*_diagonal(qc, kc, vc), mask=keep_c, bias=None, causal=True, policy=policy)
            diag = (f.out, f.stat.raw)
        if exchange is not None:
            # The keys of the ranks these queries see, in every chunk's state: its read gives the whole row's y.
            seen = _summed_image(incoming.wait(), qc.dtype)
            state = _folded(state, seen, qc.dtype)
        y, _, state = _moments(chunked, kc, vs, qc, None, 1, group, causal, False, second, [1.0, 1.0, 1.0], cr, d + 1,
                               state)
        # The backward's dq reads this state again. Kept where its image is at most twice the rows saved
        # anyway (d64: 504 bytes per key and head, against 480), else made again there, and then the other
        # ranks' summed image (one, whatever the group's size) is kept to be folded in again.
        rows_bytes = sum(x.numel() * x.element_size() for x in (qc, kc, vs))
        if state is not None and state[0].numel() > 2 * rows_bytes:
            state = None
        ctx.seen = seen if state is None else None
        out, inv_l = _ops.lin_out(y, *diag, mu_h, shift_q, i, q.dtype)
        ctx.save_for_backward(mask, qc, kc, vc, vs, keep_c, out, inv_l, mu_h, *(state or (None, None)))
        ctx.args = (causal, policy, cr, shift_q, shift_k, j, chunked)
        ctx.exchange = exchange
        return out

    @staticmethod
    def backward(ctx, dout):
        mask, qc, kc, vc, vs, keep_c, out, inv_l, mu_h, *state = ctx.saved_tensors
        causal, policy, cr, shift_q, shift_k, j, chunked = ctx.args
        coefs = policy.coef
        b, h, i, d = out.shape
        hkv, chunk = kc.shape[2], qc.shape[3]
        n_pad = qc.shape[1] * chunk
        group, second = h // hkv, coefs[2] != 0
        # g = dO / l shrinks with the sequence, and from a causal row with few keys to one with many by
        # orders of magnitude. The sweeps take it over a power of two (exact) that puts the largest
        # product the reverse sweep rounds to the input dtype, g q_a (or g itself), near 2^14: the small
        # rows' products stay above fp16's subnormals (2^-14, where digits are lost) and all below its
        # max (65504). The coefficients are applied later, in fp32.
        qmax = torch.linalg.vector_norm(qc[..., :d], float("inf"), dtype=torch.float32)
        cmax = qmax.clamp_min(1.0).reshape(1)
        g, gscale = _ops.lin_g(dout, out, inv_l, mu_h, cmax, shift_q)
        state = None if state[0] is None else tuple(state)
        if ctx.seen is not None:
            state = _folded(_state(kc, vs, 1, causal, False, second, cr), ctx.seen, kc.dtype)
        dq = _moments(chunked, kc, vs, qc, g, 1, group, causal, False, second, [1.0, 1.0, 1.0], cr, 0, state)[1]
        # An image made here is freed once read, before dk's is made (both at once cost 1.5 GiB at d128).
        del state
        reverse = None
        if ctx.exchange is not None:
            # The moments of psi(q) g^T per chunk (of the chunks after it; of all of them without causal), and from
            # them those over all this rank's rows, for the ranks whose keys these queries saw: sent while the
            # diagonal blocks run.
            reverse = _state(qc, g, group, causal, True, second, cr)
            returned = ctx.exchange.gradients(*(_whole(reverse, qc, g, group, True, second, cr) if causal else reverse),
                                              gscale)
        diag = (None, None, None)
        if causal:
            rows = (b * n_pad // chunk, h, chunk, d)
            dout_c, out_c = (_ops.lin_rows(x, None, None, shift_q, n_pad, d, chunk).view(rows) for x in (dout, out))
            stat = _ops.RowStat(inv_l.view(rows[:3]), chunk, policy, out.dtype)  # lin_out's 1 / l: a fixed shift
            diag = _ops.bwd(dout_c, *_diagonal(qc, kc, vc), mask=keep_c, bias=None, out=out_c, stat=stat, causal=True,
                           bias_grad=False)[:3]
            del dout_c, out_c  # freed before dk's image and reads: the backward's peak stays where it was
        if ctx.exchange is not None:
            # (image, scale, g's scale) of each rank whose queries saw these keys. Its g is over its own scale: read
            # at scale * ours / theirs (powers of two, exact), an image gives its moments over our g's scale. In
            # every chunk's reverse state, so that the keys' reads give their whole dk and dv.
            seen_by = _summed_image([(image, image_scale * gscale / their_gscale)
                                     for image, image_scale, their_gscale in returned.wait()], kc.dtype)
            reverse = _folded(reverse, seen_by, kc.dtype)
        dv, dk = _moments(chunked, qc, g, kc, vs, group, 1, causal, True, second, cr, [1.0, 1.0, 1.0], d, reverse)[:2]
        return (_ops.lin_grad(dq, gscale, diag[0], shift_q, i, d, out.dtype),
                _ops.lin_grad(dk, gscale, diag[1], shift_k, j, d, out.dtype),
                _ops.lin_grad(dv, gscale, diag[2], shift_k, j, d, out.dtype), *([None] * 8))


def _value_mean(v, mask, exchange=None):
    """The mean value of the keys the mask keeps, per (batch, kv head): fp32 (B, Hkv, D). Any constant
    would do (see _LinearAttention), so non-finite entries are left out rather than let one garbage value
    reach every row through it; masked ones are selected away, not multiplied by 0 (0 * NaN is NaN).
    With an exchange, over every rank's keys: the ranks' states must all hold the same v - mu."""
    keep = torch.isfinite(v)
    if mask is not None:
        keep = keep & mask[:, None, :, None]
    sums, counts = torch.where(keep, v, 0).sum(2, dtype=torch.float32), keep.sum(2, dtype=torch.float32)
    if exchange is not None:
        sums, counts = exchange.total(torch.stack([sums, counts]))
    return sums / counts.clamp_min(1)


def _diagonal(qc, kc, vc):
    """The chunks as sequences of their own, (B * chunks, heads, L, D): the diagonal blocks (vc may be
    D wide already)."""
    d = qc.shape[-1] - 16
    return tuple(x.view(-1, *x.shape[2:])[..., :d] for x in (qc, kc, vc))



def _moments(chunked, ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, r1_cols, state=None):
    """R1 = psi(rx) S (its first r1_cols columns) and, given rg, R2 = d psi(rx) . S rg, with S the moments
    of phi(ux) uw^T over the visible chunks (before each chunk; after it with reverse; all when not causal).
    cu and cr: the coefficients on ux's and rx's side. On the sweep, or (chunked) on the chunked kernels:
    lin_state writes S per chunk, lin_read reads every chunk at once. Returns (R1, R2, state), state =
    (S's image, its scale) on the chunked kernels (None on the sweep): a later call with the same ux, uw
    and flags may pass it back rather than have it computed again."""
    if not chunked:
        r1_tiles = -(-r1_cols // 16)
        return (*_ops.linear(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, r1_tiles, rg is not None), None)
    if state is None:
        state = _state(ux, uw, upd, causal, reverse, second, [a * b for a, b in zip(cu, cr)])
    return (*_ops.lin_read(rx, rg, state[0], rd, second, r1_cols, state[1]), state)


def _state(ux, uw, upd, causal, reverse, second, coef):
    """(S's image, its scale) on the chunked kernels: the moments of phi(ux) uw^T as _moments describes them,
    coef both sides' coefficients multiplied."""
    scale = _image_scale(ux, uw, upd, coef)
    return _ops.lin_state(ux, uw, upd, causal, reverse, second, coef, scale), scale


def _image_max(dtype: torch.dtype) -> float | None:
    """The magnitude below which an image of dtype holds its state, or None where any scale would do: fp16
    images are held below 2^14 (its max is 65504); bf16 has fp32's range, and its images take scale 1. The
    one place that says which images are bounded, for _image_scale and _summed_image alike."""
    return 2.0 ** 14 if dtype == torch.float16 else None


def _image_scale(ux, uw, upd, coef):
    """The power of two the chunked kernels store S at (one fp32 on the device): under _image_max by a bound
    on |S| (rows x max |phi| x max |w|), else 1."""
    image_max = _image_max(ux.dtype)
    if image_max is None:
        return torch.ones(1, device=ux.device)
    rows = ux.shape[1] * ux.shape[3] * upd
    bound = (ux.abs().amax().float().clamp_min(1.0) ** 2 * uw.abs().amax().float()
             * (rows * max(abs(coef[0]), abs(coef[1]), 2 * abs(coef[2]))))
    return torch.exp2(torch.floor(torch.log2(image_max / bound.clamp_min(1e-30)))).reshape(1)


def _summed_image(images, dtype: torch.dtype):
    """(image, scale): the sum of the states of ``images`` as one image, written over the first one's bytes, such
    that lin_read of it gives the sum of lin_read of each; None for no images. ``images``: pairs (image, scale) of
    lin_state's images in dtype, each at a power-of-two scale of its own; the others one image each (B, Hkv, 1,
    bytes), the first one too or one per chunk (B, Hkv, chunks, bytes), to every one of which the others then add
    (_folded).

    An image is its state times the coefficients times its scale, element by element in dtype (the rows'),
    every element written (the tiles' padding as zeros), and the swizzle is the same in every image:
    so images add elementwise once they are at one scale. Each is brought to the common scale (a power of two
    over its own: exact), the others are summed in fp32 and added to the first in one pass over it, which rounds
    to dtype once and writes in place: no copy of the first, which as a causal state is the rank's largest image
    (264 MB a layer at 65,536 rows, d64, 8 kv heads). Under _image_max an image is below it at its own scale, so
    the sum of the states is below (its max) x sum_s 1 / scale_s: the common scale is the largest power of two at
    most 1 / sum_s 1 / scale_s, which keeps the sum below the max as well. Without a bound it is 1, as
    _image_scale's. One image alone comes back as it was.

    A scale may be infinite: a rank whose gradient is all zeros has g's least scale, and its image (zeros)
    comes at an infinite scale relative to another rank's g. It adds nothing (a factor of 0), and alone reads as
    zeros; the clamp keeps the common scale finite when no image's is."""
    if len(images) < 2:
        return images[0] if images else None
    (first, first_scale), others = images[0], images[1:]
    scales = torch.cat([scale for _, scale in images])
    if _image_max(dtype) is None:
        common = torch.ones(1, device=scales.device)
    else:
        common = torch.exp2(torch.floor(-torch.log2(scales.reciprocal().sum()))).clamp(max=2.0 ** 126).reshape(1)
    total = sum(image.view(dtype).float() * (common / scale) for image, scale in others)
    torch.addcmul(total, first.view(dtype), common / first_scale, out=first.view(dtype))
    return first, common


def _folded(state, image, dtype: torch.dtype):
    """state, (image, scale) of lin_state's images (one per chunk, or one), with the state of ``image`` (one, or
    None for none) added to every one of them, in place (_summed_image): the other ranks' rows folded into this
    rank's chunks' states, whose reads then give the whole rows'. One elementwise pass over state's image instead
    of a read of ``image`` by every row; the sum is rounded to the images' dtype once more than the reads apart."""
    return state if image is None else _summed_image([state, image], dtype)


def _whole(state, ux, uw, upd, reverse, second, coef):
    """(image, scale) of the state over all the rows of ux, uw, given their causal state per chunk (image, scale;
    of the chunks before each, after each with reverse, as _state makes it): the last chunk's (the first's, with
    reverse) plus that chunk's own rows', from _state over that one chunk. A chunk's work where _state over all
    the rows would redo every chunk's."""
    end = slice(0, 1) if reverse else slice(-1, None)
    own = _state(ux[:, end].contiguous(), uw[:, end].contiguous(), upd, False, False, second, coef)
    return _summed_image([own, (state[0][:, :, end], state[1])], ux.dtype)
