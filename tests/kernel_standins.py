"""Stand-ins for the ops that fastmax's linear form runs on the chunked kernels (attn_cuda::lin_rows, lin_state,
lin_read, lin_out, lin_g, lin_grad, and fwd and bwd on its diagonal blocks): float64 PyTorch on any device that
follows each op's contract as csrc/binding/binding.cpp and csrc/linear/params.h state it, so that the Python
glue around them (attention_cuda._kernels._LinearAttention, and its exchange between the ranks of a context
group) runs on a CPU; for cosine's decode kernel (attn_cuda::decode), the glue that routes a decode step
to it (attention_cuda.functional, plan, _kernels.decode); and RoPE's passes (attn_cuda::rope_split,
rope_merge) under _kernels.rotary_qkv.

They check the glue, not the kernels: nothing is rounded to fp16/bf16, no size limit is enforced (chunks of
any multiple of 8 rows, say), and an image is the state itself at its scale, (B, Hkv, images, F, D + 16) with
F = 1 + D + D^2 unpacked features in the rows' dtype, as the kernels' bytes are (B, Hkv, images, bytes) uint8
of elements in that dtype (swizzled, packed features). An image holds its elements below
attention_cuda._kernels._image_max of the rows' dtype, as the glue promises (fp16's 2^14), or the op fails.
Their outputs take the ops' dtypes (fp32 sums, the inputs' dtype for rows), and g's scale is the kernels'
power of two, different from rank to rank, so a glue that mixes up scales or dtypes shows.
"""
import torch

from attention_cuda import _kernels
from attention_cuda.reference import apply_rope

OPS = ("lin_rows", "lin_state", "lin_read", "lin_out", "lin_g", "lin_grad", "fwd", "bwd", "decode", "rope_split",
       "rope_merge")


def install(setattr_=setattr) -> None:
    """Put the stand-ins in torch.ops.attn_cuda (``setattr_``: a monkeypatch's, to undo it after a test)."""
    for name in OPS:
        setattr_(torch.ops.attn_cuda, name, globals()[name])


def _natural(x):
    """Chunk-major (B, chunks, H, L, W) -> natural rows (B, H, chunks * L, W)."""
    return x.transpose(1, 2).flatten(2, 3)


def _bthd(x):
    """(B, H, N, D) over (B, N, H, D) memory, the layout the forward kernels write their outputs in."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _chunk_major(x, chunk):
    """Natural rows (B, H, n_pad, W) -> chunk-major (B, n_pad / chunk, H, chunk, W)."""
    return x.unflatten(2, (x.shape[2] // chunk, chunk)).transpose(1, 2).contiguous()


def _features(x, second):
    """phi(x') of rows x' = [x, e, 0 ...] (D + 16 wide, e: the row's flag): [e, x, x (x) x] (without second, no
    x (x) x), float64. phi(x'_t) . (c * phi(u'_s)) = e_t e_s (c0 + c1 z + c2 z^2), z = x_t . u_s."""
    d = x.shape[-1] - 16
    x = x.double()
    feats = [x[..., d:d + 1], x[..., :d]]
    if second:
        feats.append((x[..., :d, None] * x[..., None, :d]).flatten(-2))
    return torch.cat(feats, -1)


def _coefficients(coef, d, second, device):
    """c per feature, float64: c0 on e, c1 on x, c2 on x (x) x."""
    sizes = (1, d, d * d) if second else (1, d)
    return torch.cat([torch.full((n,), c, dtype=torch.float64, device=device) for n, c in zip(sizes, coef)])


def lin_rows(x, mask, mu, shift, n_pad, width, chunk):
    b, h, n, d = x.shape
    t = torch.arange(n_pad, device=x.device) - shift  # the natural row of each chunk row
    keep = ((t >= 0) & (t < n))[None, None, :, None]
    src = t.clamp(0, n - 1)
    if mask is not None:
        keep = keep & mask[:, None, src, None]
    rows = x[:, :, src].double()
    if mu is not None:
        rows = rows - mu[:, :, None, :].double()
    rows = torch.where(keep, rows, 0.0)
    if width > d:
        rows = torch.cat([rows, keep.expand(b, h, n_pad, 1).double(), rows.new_zeros(b, h, n_pad, width - d - 1)], -1)
    return _chunk_major(rows, chunk).to(x.dtype)


def lin_state(x, w, heads, causal, reverse, second, coef, scale):
    assert x.is_contiguous() and w.is_contiguous() and w.shape == x.shape, "lin_state: x and w contiguous, alike"
    b, chunks, hx, rows, dp = x.shape
    phi = _features(x, second) * _coefficients(coef, dp - 16, second, x.device)
    # Each chunk's moments, the heads of a kv head summed: (B, chunks, Hkv, F, W).
    per_chunk = (phi.transpose(-1, -2) @ w.double()).unflatten(2, (hx // heads, heads)).sum(3)
    if not causal:
        states = per_chunk.sum(1, keepdim=True)
    else:
        upto = per_chunk.flip(1) if reverse else per_chunk
        states = upto.cumsum(1) - upto  # the chunks before (after, with reverse) each one
        states = states.flip(1) if reverse else states
    return _image((states * scale.double()).transpose(1, 2), x.dtype)


def _image(state, dtype):
    """A state at its scale (B, Hkv, images, F, W) as an image: its elements in dtype, as bytes."""
    state = _in_range(state.to(dtype), dtype)
    return state.flatten(3).contiguous().view(torch.uint8)


def _in_range(image, dtype):
    image_max = _kernels._image_max(dtype)
    assert image_max is None or image.abs().max() <= image_max, f"an image beyond {image_max}: {image.abs().max()}"
    return image


def _state(image, dtype, features, width):
    """An image's state at its scale, float64 (B, Hkv, images, F, W)."""
    return _in_range(image.view(dtype), dtype).unflatten(3, (features, width)).double()


def lin_read(x, g, image, heads, second, r1_cols, scale):
    b, chunks, hx, rows, dp = x.shape
    assert x.is_contiguous() and image.is_contiguous() and image.shape[2] in (chunks, 1), "lin_read: image, x"
    phi = _features(x, second)
    state = _state(image, x.dtype, phi.shape[-1], dp)
    s = (state.transpose(1, 2) / scale.double()).repeat_interleave(heads, dim=2)  # (B, images, H, F, W)
    r1 = torch.empty(0, dtype=torch.float32, device=x.device)
    if r1_cols > 0:
        r1 = phi @ s
        r1[..., r1_cols:] = 0
        r1 = r1.float()
    r2 = torch.empty(0, dtype=torch.float32, device=x.device)
    if g is not None:
        d = dp - 16
        m = g.double() @ s.transpose(-1, -2)  # S g per row: (B, chunks, H, L, F)
        xd = x.double()[..., :d]
        r2 = m[..., 1:d + 1]
        if second:
            m2 = m[..., d + 1:].unflatten(-1, (d, d))
            r2 = r2 + ((m2 + m2.transpose(-1, -2)) @ xd[..., None])[..., 0]
        r2 = r2.float()
    return r1, r2


def lin_out(y, o, stat, mu, shift, n, dtype):
    b, chunks, h, rows, dp = y.shape
    d = dp - 16
    y = y.double()
    if o is None:
        o, ld = y.new_zeros(b, chunks, h, rows, d), y.new_zeros(b, chunks, h, rows)
    else:
        assert o.transpose(1, 2).is_contiguous(), "o in fwd's layout, (B * chunks, H, L, D) over (B * chunks, L, H, D)"
        o, stat = o.reshape(b, chunks, h, rows, d).double(), stat.view(b, chunks, h, rows).double()
        ld = torch.where(stat > 0, 1 / stat, 0.0)
    lm = y[..., d]
    total = lm + ld
    inv = torch.where(total > 0, 1 / total, 0.0)
    out = (y[..., :d] + mu[:, None, :, None, :].double() * lm[..., None] + o * ld[..., None]) * inv[..., None]
    return _bthd(_natural(out)[:, :, shift:shift + n].to(dtype)), inv.float()


def lin_g(dout, out, inv_l, mu, cmax, shift):
    b, h, n, d = dout.shape
    chunks, rows = inv_l.shape[1], inv_l.shape[3]
    dout, out = dout.double(), out.double()
    inv = _natural(inv_l[..., None]).double()[:, :, shift:shift + n]  # (B, H, n, 1)
    delta = (dout * (out - mu[:, :, None, :].double())).sum(-1, keepdim=True)
    gmax = (inv * torch.maximum(dout.abs().amax(-1, keepdim=True), delta.abs())).max()
    # The kernels' scale: the smallest power of two at or above gmax * cmax, over 2^14.
    mantissa, exponent = torch.frexp((gmax * cmax.double()).clamp_min(torch.finfo(torch.float32).tiny))
    scale = torch.ldexp(torch.ones_like(mantissa), exponent - (mantissa == 0.5).long() - 14)
    g = torch.cat([dout, -delta, dout.new_zeros(b, h, n, 15)], -1) * inv / scale
    g = torch.nn.functional.pad(g, (0, 0, shift, chunks * rows - n - shift))
    return _chunk_major(g, rows).to(dout.dtype), scale.float().reshape(1)


def lin_grad(acc, scale, diag, shift, n, dim, dtype):
    b, chunks, h, rows, _ = acc.shape
    out = _natural(acc.double())[:, :, shift:shift + n, :dim] * scale.double()
    if diag is not None:
        out = out + _natural(diag.view(b, chunks, h, rows, dim).double())[:, :, shift:shift + n]
    return out.to(dtype)


def _block(q, k, v, mask, scale, coef):
    """A diagonal block's num and l: causal, the mask's keys only, f(z) = c0 + c1 z + c2 z^2 of z = scale q.k."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    z = scale * q @ k.transpose(-1, -2)
    rows = q.shape[2]
    seen = torch.ones(rows, rows, dtype=torch.bool, device=q.device).tril() & mask[:, None, None, :]
    a = torch.where(seen, coef[0] + z * (coef[1] + coef[2] * z), 0.0)
    return a @ v, a.sum(-1, keepdim=True)


def fwd(q, k, v, mask, bias, causal, kind, scale, qk_norm, coef, normalize):
    assert (bias, causal, kind, qk_norm, normalize) == (None, True, "fastmax", None, True), "the diagonal blocks' call"
    num, l = _block(q.double(), k.double(), v.double(), mask, scale, coef)
    out = torch.where(l > 0, num / l, 0.0)
    stat = torch.where(l > 0, 1 / l, 0.0)[..., 0]
    stat = torch.nn.functional.pad(stat, (0, -stat.shape[-1] % 4)).float()  # rows padded to 4
    empty = stat.new_empty(0)
    return _bthd(out.to(q.dtype)), stat, empty, empty, q.new_empty(0)


def bwd(dout, q, k, v, mask, bias, out, stat, rq, rk, causal, kind, scale, qk_norm, coef, normalize, bias_grad):
    """A block's share of the gradients given the whole row's O and 1/l (stat): O = num / l sends dO / l to the
    block's num and -(dO . O) / l to its l."""
    assert (bias, causal, kind, qk_norm, normalize, bias_grad) == (None, True, "fastmax", None, True, False)
    inv = stat[..., :q.shape[2], None].double()
    dout = dout.double()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        num, l = _block(*leaves, mask, scale, coef)
    grads = torch.autograd.grad((num, l), leaves, (dout * inv, -(dout * out.double()).sum(-1, keepdim=True) * inv))
    return (*(x.to(q.dtype) for x in grads), q.new_empty(0))


def decode(q, k, v, mask, scale, qk_norm, splits):
    """One query row per head over the keys the mask keeps, weights exp(x - |scale| n^2) of rows scaled to norm
    n = qk_norm first (None: given as unit rows, n = 1), the output in q's dtype. A masked key's K and V rows
    are never read (zeros here); the parts the kernel splits the keys into add up to these sums."""
    assert q.shape[2] == 1 and splits >= 0, "decode: one query row per head; splits >= 0"
    b, h, _, d = q.shape
    keep = torch.ones(b, k.shape[2], dtype=torch.bool, device=q.device) if mask is None else mask
    k, v = (torch.where(keep[:, None, :, None], x, 0.0).double().repeat_interleave(h // x.shape[1], dim=1)
            for x in (k, v))
    n, rows = (1.0, q.double()) if qk_norm is None else (qk_norm, torch.nn.functional.normalize(q.double(), dim=-1))
    if qk_norm is not None:
        rows, k = rows * n, torch.nn.functional.normalize(k, dim=-1) * n
    w = torch.where(keep[:, None, None, :], torch.exp(scale * rows @ k.transpose(-1, -2) - abs(scale) * n * n), 0.0)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ v) / den, 0.0).to(q.dtype)


def _rotate(x, cos, sin, sign):
    """x (B, H, T, D) rotated by RoPE's angles (cos, sin: (T, D/2)) in float64; sign -1 rotates back."""
    return apply_rope(x.double(), cos.double(), sign * sin.double())


def rope_split(qkv, cos, sin, heads, kv_heads):
    """q (B, heads, T, D), k (B, kv_heads, T, D) rotated, contiguous, in qkv's dtype; cos, sin fp32 (T, D/2)."""
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    b, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    assert d % 16 == 0 and tuple(cos.shape) == (t, d // 2), "rope_split: D a multiple of 16, cos (T, D/2)"
    rows = qkv.view(b, t, -1, d).transpose(1, 2)
    return tuple(_rotate(x, cos, sin, 1).to(qkv.dtype).contiguous()
                 for x in (rows[:, :heads], rows[:, heads:heads + kv_heads]))


def rope_merge(dq, dk, dv, cos, sin):
    """(B, T, (heads + 2 kv_heads) D): dq and dk rotated back, dv as it is, in the projection's layout."""
    assert dq.dtype == dk.dtype == dv.dtype and cos.dtype == torch.float32
    b, h, t, d = dq.shape
    heads = torch.cat([_rotate(dq, cos, sin, -1), _rotate(dk, cos, sin, -1), dv.double()], dim=1)
    return heads.transpose(1, 2).reshape(b, t, -1).to(dq.dtype)
