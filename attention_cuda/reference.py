"""Pure-PyTorch references for every attention family (backend="torch").

All functions take canonical shapes: q (B, H, I, D), k and v (B, Hkv, J, D) with H % Hkv == 0,
mask None or bool (B, J) (True = keep), bias None or broadcastable to (B, H, I, J) (cast to q's
dtype, the logits' dtype). ``causal`` is bottom-right aligned: query t sees keys s <= t + J - I.

A non-finite q, k or v entry reaches only the rows that read it (its own query row, or the rows that
see its key); masked keys reach no row whatever they hold (see _finite_inputs).

``quadratic`` materialises the (I, J) weights and serves every family. ``fastmax_linear`` is the
O(N)-memory form of the polynomial family: f(q.k) factorises through feature maps, so the keys
collapse into fixed-size moments that are carried from chunk to chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .score import NORM_EPS, ScorePolicy


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + D/2}) of x (B, H, T, D) by position-dependent angles (T, D/2).

    Computed in fp32 (float64 rows in float64) so that under bf16 autocast the relative-position property
    holds to fp32 precision, then cast back (as RoPE's kernels, attn_cuda::rope_split, do).
    """
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int):
    """The fused projection's rows (B, T, (heads + 2 kv_heads) D) as q (B, heads, T, D), k and v
    (B, kv_heads, T, D): strided views, no copy."""
    b, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    return tuple(x.view(b, t, -1, d).transpose(1, 2)
                 for x in qkv.split((heads * d, kv_heads * d, kv_heads * d), dim=-1))


def rotary_qkv(qkv, cos, sin, heads: int, kv_heads: int):
    """q, k rotated by RoPE and v, from the fused projection's rows (functional.rotary_qkv's contract)."""
    q, k, v = split_qkv(qkv, heads, kv_heads)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, J, D) -> (B, H, J, D): query head h reads kv head h // (H / Hkv)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def scale_rows(x: torch.Tensor, norm: float | None) -> torch.Tensor:
    return x if norm is None else F.normalize(x, dim=-1, eps=NORM_EPS) * norm


def visibility(i: int, j: int, mask: torch.Tensor | None, causal: bool, device) -> torch.Tensor | None:
    """Bool (B|1, 1, I, J) of the (query, key) pairs that take part, or None when all do."""
    keep = None
    if causal:
        t = torch.arange(i, device=device)[:, None]
        s = torch.arange(j, device=device)[None, :]
        keep = (s <= t + (j - i))[None, None]
    if mask is not None:
        m = mask[:, None, None, :]
        keep = m if keep is None else keep & m
    return keep


def _finite_inputs(q, k, v, mask, causal: bool):
    """q, k, v with non-finite entries and masked keys set to 0, and the bool (B, H, I, 1) rows that
    read a non-finite entry: their own q row, or a kept key they see (whatever its weight).

    The math gives invisible pairs a weight of 0, but 0 * NaN is NaN: in the forward (A V) and in the
    backward (dX K, A^T dO, and the elementwise chain of a NaN row), one garbage key would reach every
    row and every gradient. So the math runs on finite inputs only and _mark_rows makes the rows that
    read garbage NaN afterwards. Masked keys are zeroed whatever they hold: padded slots may carry huge
    finite garbage too, whose features overflow (k (x) k in the linear form).
    """
    i, j = q.shape[2], k.shape[2]
    # detached: isfinite is abs() != inf underneath, and an abs under autograd would save its input
    q_ok, k_ok, v_ok = (torch.isfinite(x.detach()) for x in (q, k, v))
    bad_key = ~(k_ok & v_ok).all(-1)  # (B, Hkv, J)
    if mask is not None:
        bad_key = bad_key & mask[:, None]
        k_ok, v_ok = k_ok & mask[:, None, :, None], v_ok & mask[:, None, :, None]
    # A row sees a bad key iff the first one lies within its last visible key (all keys without causal).
    first = torch.where(bad_key, torch.arange(j, device=k.device), j).amin(-1, keepdim=True)  # j: none
    last = torch.arange(i, device=q.device) + (j - i) if causal else j - 1
    rows = expand_kv((first <= last)[..., None], q.shape[1]) | ~q_ok.all(-1, keepdim=True)
    return torch.where(q_ok, q, 0.0), torch.where(k_ok, k, 0.0), torch.where(v_ok, v, 0.0), rows


def _mark_rows(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """NaN in ``rows`` of out. Added rather than assigned, so that an upstream gradient there (NaN,
    when the loss read these rows) still flows back, while a zero one leaves the other rows alone."""
    return out + torch.where(rows, float("nan"), 0.0).to(out.dtype)


def score_dtype(dtype: torch.dtype, linear: bool) -> torch.dtype:
    """The dtype logits and weights are computed in for inputs of ``dtype``: the inputs' own in the
    quadratic form, fp32 (fp64 for fp64 inputs) in the linear form, whose moments sum over many keys."""
    return dtype if not linear or dtype == torch.float64 else torch.float32


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, with rows whose weights sum to zero (no visible key) giving zeros, not NaN."""
    ok = den > 0
    return num / torch.where(ok, den, torch.ones_like(den)) * ok


def quadratic(q, k, v, mask, bias, causal: bool, policy: ScorePolicy, dropout: float = 0.0):
    q, k, v, poisoned = _finite_inputs(q, k, v, mask, causal)
    heads, i, j = q.shape[1], q.shape[2], k.shape[2]
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    q, k = scale_rows(q, policy.qk_norm), scale_rows(k, policy.qk_norm)
    x = policy.scale * (q @ k.transpose(-1, -2))
    if bias is not None:
        x = x + bias.to(x.dtype)
    keep = visibility(i, j, mask, causal, q.device)
    if keep is not None:
        # Invisible logits are replaced before f, not only their weights after: a weight that overflows
        # there (exp(x), x^2) would meet their zero gradient in the backward, and 0 * inf is NaN.
        # exp(-inf) = 0 drops them outright; fastmax's weights are zeroed below.
        x = x.masked_fill(~keep, 0.0 if policy.kind == "fastmax" else float("-inf"))
    if policy.kind == "fastmax":
        a = policy.a0 + x * (policy.a1 + policy.a2 * x)
        if keep is not None:
            a = a.masked_fill(~keep, 0.0)
    elif policy.kind == "cosine":
        # exp(x - scale) / l is a softmax; subtracting the row max instead of `scale` gives the same
        # P and stays finite for any bias or unnormalised q/k. The max is a constant for autograd.
        m = x.detach().amax(dim=-1, keepdim=True)
        a = torch.exp(x - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    else:  # exp: no normalisation, so no shift is allowed either
        a = torch.exp(x)
    if policy.normalize_rows:
        a = safe_divide(a, a.sum(dim=-1, keepdim=True))
    if dropout > 0:
        a = F.dropout(a, p=dropout)
    return _mark_rows(a @ v, poisoned)


def poly_features(x: torch.Tensor, policy: ScorePolicy, query: bool) -> torch.Tensor:
    """Feature map phi with f(q.k) = phi_q(q) . phi_k(k) for f(x) = a0 + a1 x + a2 x^2.

    phi_k(k) = [1, k, k_a k_b (a <= b)]; phi_q(q) = [a0, a1 q, a2 w_ab q_a q_b] with w = 2 off the
    diagonal, so the symmetric k (x) k block is stored once: D(D+1)/2 columns instead of D^2.
    """
    feats = [torch.ones_like(x[..., :1]), x]
    if policy.a2 != 0:
        a, b = torch.triu_indices(x.shape[-1], x.shape[-1], device=x.device)
        # index_select, not x[..., a]: its backward is an index_add, ~9x faster on GPU than the
        # accumulating index_put that advanced indexing differentiates into (measured on an H200).
        feats.append(x.index_select(-1, a) * x.index_select(-1, b))
    if query:
        feats[0] = feats[0] * policy.a0
        feats[1] = feats[1] * policy.a1
        if policy.a2 != 0:
            feats[2] = feats[2] * (policy.a2 * torch.where(a == b, 1.0, 2.0).to(x.dtype))
    return torch.cat(feats, dim=-1)


def _num_features(d: int, policy: ScorePolicy) -> int:
    """Columns of poly_features: 1 + D, plus the D(D+1)/2 products when a2 != 0."""
    return 1 + d + (d * (d + 1) // 2 if policy.a2 != 0 else 0)


def _query_chunks(i: int, j: int, causal: bool, chunk: int):
    """Yield (t0, t1, k0, lo, hi) for each chunk of queries [t0, t1).

    Keys < lo are visible to every query of the chunk, so they live in the running moment; keys
    [k0, lo) join the moment at this chunk; keys [lo, hi) are visible to only some of its queries
    (the causal diagonal band) and are done quadratically. The forward and both backward sweeps walk
    these same boundaries, so the backward differentiates exactly the sums the forward took.
    """
    offset = j - i  # bottom-right alignment: query t sees keys s <= t + offset
    lo = 0
    for t0 in range(0, i, chunk):
        t1 = min(t0 + chunk, i)
        k0 = lo
        lo, hi = (min(max(t0 + offset + 1, 0), j), min(max(t1 + offset, 0), j)) if causal else (j, j)
        yield t0, t1, k0, lo, hi


def _query_rows(q, policy):
    return scale_rows(q, policy.qk_norm) * policy.scale


def _key_rows(k, v, keep, policy):
    """Scaled keys and [v, 1] rows (the 1 makes l ride along with the numerator), zero at masked keys."""
    v1 = torch.where(keep, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1), 0.0)
    return scale_rows(k, policy.qk_norm), v1


def key_moment(k, v, keep, policy):
    """sum over the given keys of phi_k(k_s) [v_s, 1]^T: (B, Hkv, F, D+1)."""
    ks, v1 = _key_rows(k, v, keep, policy)
    return poly_features(ks, policy, query=False).transpose(-1, -2) @ v1


MOMENT_KEYS = 1024  # keys per step of moments(): its features take (B, Hkv, MOMENT_KEYS, F) at a time


def moments(k: torch.Tensor, v: torch.Tensor, policy: ScorePolicy) -> torch.Tensor:
    """fp32 sum over the keys of phi_k(k_s) [v_s, 1]^T, (B, Hkv, F, D+1): all that a query after them needs.
    Summed over runs of MOMENT_KEYS keys, so that a long prefill never holds every key's features (F = 2145
    floats per key and head at D = 64); fp32 under autocast too, which would round the products to bf16."""
    b, hkv, j, d = k.shape
    state = k.new_zeros(b, hkv, _num_features(d, policy), d + 1, dtype=torch.float32)
    with torch.autocast(k.device.type, enabled=False):
        for s in range(0, j, MOMENT_KEYS):
            ks, vs = k[:, :, s:s + MOMENT_KEYS].float(), v[:, :, s:s + MOMENT_KEYS].float()
            state += key_moment(ks, vs, torch.ones_like(ks[..., :1], dtype=torch.bool), policy)
    return state


def read_moments(q: torch.Tensor, state: torch.Tensor, policy: ScorePolicy) -> torch.Tensor:
    """Every query of q (B, H, T, D) against the keys summed in state (moments'), in fp32 (under autocast too),
    returned in q's dtype."""
    b, h, t, d = q.shape
    hkv = state.shape[1]
    with torch.autocast(q.device.type, enabled=False):
        phi = poly_features(_query_rows(q.float(), policy), policy, query=True)
        y = phi.view(b, hkv, h // hkv, t, -1) @ state.unsqueeze(2)  # (B, Hkv, G, T, D+1): [num, l]
    return safe_divide(y[..., :-1], y[..., -1:]).reshape(b, h, t, d).to(q.dtype)


def chunk_rows(q, k, v, keep, state, t0, lo, offset, policy):
    """Y = [num, l] of queries [t0, t0 + n) (B, Hkv, G, n, D+1), from the moment ``state`` of the keys
    they all see plus the band of keys [lo, lo + m) given as k, v, keep (empty when there is none)."""
    qs = _query_rows(q, policy)
    y = poly_features(qs, policy, query=True) @ state.unsqueeze(2)
    ks, v1 = _key_rows(k, v, keep, policy)
    t = torch.arange(t0, t0 + q.shape[-2], device=q.device)[:, None]
    s = torch.arange(lo, lo + k.shape[-2], device=q.device)[None, :]
    seen = s <= t + offset
    x = torch.where(seen, qs @ ks.unsqueeze(2).transpose(-1, -2), 0.0)  # as in quadratic: no inf * 0
    a = torch.where(seen, policy.a0 + x * (policy.a1 + policy.a2 * x), 0.0)
    return y + a @ v1.unsqueeze(2)


def _leaf(x):
    return x.detach().requires_grad_()


def _key_keep(mask, bsz, j, device):
    """Bool (B, 1, J, 1) of the kept [v, 1] rows: a masked key drops out of both num and l."""
    if mask is None:
        return torch.ones(bsz, 1, j, 1, dtype=torch.bool, device=device)
    return mask[:, None, :, None]


def _key_slices(lo, hi, chunk):
    """Keys [lo, hi) ``chunk`` at a time, so that phi_k never holds more than ``chunk`` rows (the first
    causal chunk with I << J, or the non-causal moment, takes nearly all keys at once)."""
    return (slice(s0, min(s0 + chunk, hi)) for s0 in range(lo, hi, chunk))


def _moment(k, v, keep, lo, hi, policy, chunk):
    """sum over keys [lo, hi) of phi_k(k_s) [v_s, 1]^T: (B, Hkv, F, D+1), or 0 when the range is empty."""
    return sum(key_moment(k[:, :, s], v[:, :, s], keep[:, :, s], policy)
               for s in _key_slices(lo, hi, chunk))


class _FastmaxLinear(torch.autograd.Function):
    """Linear-form fastmax whose backward recomputes chunk by chunk instead of keeping autograd's
    per-chunk feature maps and moments (N x F and F x (D+1) per chunk: >100 GB at N=8192, D=64).

    Saved: q, k, v as given, the mask, the output and the row sums l, all O(N D). Backward, with
    Y = [num, l] and O = num / l: dY = [dO, -(dO . O)] / l. A query sweep rebuilds the running
    moment S and differentiates each chunk's Y locally (S held constant: that gives dq and the
    band's dk, dv). A key sweep, last query chunk first, accumulates R = sum of phi_q(q)^T dY over
    the query chunks whose S holds a key, which is the gradient of the moment; each key's share
    phi_k(k_s) [v_s, 1]^T is differentiated locally against R.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, policy, chunk):
        work = score_dtype(q.dtype, linear=True)
        bsz, heads, i, d = q.shape
        hkv, j = k.shape[1], k.shape[2]
        qw = q.to(work).reshape(bsz, hkv, heads // hkv, i, d)  # grouped heads share their kv head's moment
        kw, vw, keep = k.to(work), v.to(work), _key_keep(mask, bsz, j, q.device)
        y = qw.new_empty(*qw.shape[:-1], d + 1)
        state = qw.new_zeros(bsz, hkv, _num_features(d, policy), d + 1)
        for t0, t1, k0, lo, hi in _query_chunks(i, j, causal, chunk):
            state = state + _moment(kw, vw, keep, k0, lo, policy, chunk)
            y[..., t0:t1, :] = chunk_rows(qw[..., t0:t1, :], kw[:, :, lo:hi], vw[:, :, lo:hi],
                                           keep[:, :, lo:hi], state, t0, lo, j - i, policy)
        l = y[..., d].clone()  # a copy, so that saving it does not keep all of y alive
        out = safe_divide(y[..., :d], l[..., None]).reshape(bsz, heads, i, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, out, l)
        ctx.causal, ctx.policy, ctx.chunk = causal, policy, chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, mask, out, l = ctx.saved_tensors
        causal, policy, chunk = ctx.causal, ctx.policy, ctx.chunk
        work = l.dtype
        bsz, heads, i, d = q.shape
        hkv, j = k.shape[1], k.shape[2]
        group = heads // hkv
        qw = q.detach().to(work).reshape(bsz, hkv, group, i, d)
        kw, vw, keep = k.detach().to(work), v.detach().to(work), _key_keep(mask, bsz, j, q.device)
        d_out = d_out.to(work).reshape(bsz, hkv, group, i, d)
        delta = (d_out * out.to(work).reshape(bsz, hkv, group, i, d)).sum(-1, keepdim=True)
        # Rows with l == 0 (no visible key, or all weights zero) output constant zeros: no gradient.
        dy = safe_divide(torch.cat([d_out, -delta], dim=-1), l[..., None])
        dq, dk, dv = torch.zeros_like(qw), torch.zeros_like(kw), torch.zeros_like(vw)

        state = qw.new_zeros(bsz, hkv, _num_features(d, policy), d + 1)
        for t0, t1, k0, lo, hi in _query_chunks(i, j, causal, chunk):
            state = state + _moment(kw, vw, keep, k0, lo, policy, chunk)
            qc, kb, vb = (_leaf(x) for x in (qw[..., t0:t1, :], kw[:, :, lo:hi], vw[:, :, lo:hi]))
            with torch.enable_grad():
                y = chunk_rows(qc, kb, vb, keep[:, :, lo:hi], state, t0, lo, j - i, policy)
            gq, gk, gv = torch.autograd.grad(y, (qc, kb, vb), dy[..., t0:t1, :])
            dq[..., t0:t1, :] = gq
            dk[:, :, lo:hi] += gk  # the band's keys; summing over the group happened in the broadcast
            dv[:, :, lo:hi] += gv

        r = torch.zeros_like(state)
        for t0, t1, k0, lo, _ in reversed(list(_query_chunks(i, j, causal, chunk))):
            phi = poly_features(_query_rows(qw[..., t0:t1, :], policy), policy, query=True)
            r += phi.flatten(2, 3).transpose(-1, -2) @ dy[..., t0:t1, :].flatten(2, 3)  # over the group too
            for s in _key_slices(k0, lo, chunk):  # keys [k0, lo) are in S for this chunk and every later one
                kc, vc = _leaf(kw[:, :, s]), _leaf(vw[:, :, s])
                with torch.enable_grad():
                    m = key_moment(kc, vc, keep[:, :, s], policy)
                gk, gv = torch.autograd.grad(m, (kc, vc), r)
                dk[:, :, s] += gk
                dv[:, :, s] += gv
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def fastmax_linear(q, k, v, mask, causal: bool, policy: ScorePolicy, chunk: int = 64):
    """Fastmax in O(N) memory: moments of phi_k(k) [v, 1]^T, carried in fp32 from chunk to chunk.

    Queries are processed ``chunk`` rows at a time. For a chunk, keys that every query in it may see
    live in the running moment S; the few keys that only some of its queries see (the causal
    diagonal band) are done quadratically. Grouped KV heads share one moment per kv head. The
    backward recomputes S chunk by chunk, so autograd keeps only O(N D) (see _FastmaxLinear).
    A key's features enter every later moment, so a non-finite one is kept out (_finite_inputs).
    """
    if policy.kind != "fastmax":
        raise ValueError(f"policy: the linear form is for the fastmax family, got {policy.kind!r}")
    if chunk < 1:
        raise ValueError(f"chunk: expected a positive number of rows, got {chunk}")
    q, k, v, poisoned = _finite_inputs(q, k, v, mask, causal)
    return _mark_rows(_FastmaxLinear.apply(q, k, v, mask, causal, policy, chunk), poisoned)


def attention_weights(q: torch.Tensor, k: torch.Tensor, policy: ScorePolicy, *, start: int, key_start: int = 0,
                      window: int = 0) -> torch.Tensor:
    """The normalised causal weights (..., n, J) in fp32 of queries q (..., n, D) at positions start ..
    start + n - 1 over keys k (..., J, D) at positions key_start .. key_start + J - 1 (the same heads: expand
    grouped KV heads first). Query t sees the keys s <= t, and with a window > 0 only s > t - window; the
    others get weight 0. Every query must see at least one of the given keys.

    The policy's math as quadratic does it: q and k scaled to norm qk_norm when it is
    set, x = scale q.k; "fastmax": f(x) = a0 + a1 x + a2 x^2 divided by its row sum; "cosine" (and
    softmax: a cosine policy without qk_norm, scale 1 / sqrt(D)): softmax(x)."""
    if policy.kind not in ("cosine", "fastmax") or not policy.normalize_rows:
        raise ValueError(f"policy: expected a row-normalised cosine/softmax or fastmax policy, got {policy.kind!r}")
    if window < 0:
        raise ValueError(f"window: expected >= 0 (0 = none), got {window}")
    with torch.autocast(q.device.type, enabled=False):
        q, k = (scale_rows(x.float(), policy.qk_norm) for x in (q, k))
        x = (q @ k.transpose(-1, -2)).mul_(policy.scale)
        t = torch.arange(start, start + q.shape[-2], device=q.device)[:, None]
        s = torch.arange(key_start, key_start + k.shape[-2], device=q.device)[None, :]
        hidden = s > t
        if window:
            hidden |= s <= t - window
        if policy.kind == "fastmax":
            a = x.mul(policy.a2).add_(policy.a1).mul_(x).add_(policy.a0).masked_fill_(hidden, 0.0)
            del x
            total = a.sum(dim=-1, keepdim=True)  # f >= 0: a zero row sum means a row of zeros, left as such
            return a.div_(torch.where(total > 0, total, 1.0))  # reference.safe_divide, in place
        return torch.softmax(x.masked_fill_(hidden, float("-inf")), dim=-1)
