"""Pure-PyTorch references for every attention family (backend="torch").

All functions take canonical shapes: q (B, H, I, D), k and v (B, Hkv, J, D) with H % Hkv == 0,
mask None or bool (B, J) (True = keep), bias None or broadcastable to (B, H, I, J).
``causal`` is bottom-right aligned: query t sees keys s <= t + J - I.

``quadratic`` materialises the (I, J) weights and serves every family. ``fastmax_linear`` is the
O(N)-memory form of the polynomial family: f(q.k) factorises through feature maps, so the keys
collapse into fixed-size moments that are carried from chunk to chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .score import NORM_EPS, ScorePolicy


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


def _safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, with rows whose weights sum to zero (no visible key) giving zeros, not NaN."""
    ok = den > 0
    return num / torch.where(ok, den, torch.ones_like(den)) * ok


def quadratic(q, k, v, mask, bias, causal: bool, policy: ScorePolicy, dropout: float = 0.0):
    heads, i, j = q.shape[1], q.shape[2], k.shape[2]
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    q, k = scale_rows(q, policy.qk_norm), scale_rows(k, policy.qk_norm)
    x = policy.scale * (q @ k.transpose(-1, -2))
    if bias is not None:
        x = x + bias
    keep = visibility(i, j, mask, causal, q.device)
    if policy.kind == "poly":
        a = policy.a0 + x * (policy.a1 + policy.a2 * x)
    elif policy.kind == "cosine":
        # exp(x - scale) / l is a softmax; subtracting the row max instead of `scale` gives the same
        # P and stays finite for any bias or unnormalised q/k. The max is a constant for autograd.
        if keep is not None:
            x = x.masked_fill(~keep, float("-inf"))
        m = x.detach().amax(dim=-1, keepdim=True)
        a = torch.exp(x - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    else:  # exp: no normalisation, so no shift is allowed either
        a = torch.exp(x)
    if keep is not None:
        a = a.masked_fill(~keep, 0.0)
    if policy.normalize_rows:
        a = _safe_divide(a, a.sum(dim=-1, keepdim=True))
    if dropout > 0:
        a = F.dropout(a, p=dropout)
    return a @ v


def poly_features(x: torch.Tensor, policy: ScorePolicy, query: bool) -> torch.Tensor:
    """Feature map phi with f(q.k) = phi_q(q) . phi_k(k) for f(x) = a0 + a1 x + a2 x^2.

    phi_k(k) = [1, k, k_a k_b (a <= b)]; phi_q(q) = [a0, a1 q, a2 w_ab q_a q_b] with w = 2 off the
    diagonal, so the symmetric k (x) k block is stored once: D(D+1)/2 columns instead of D^2.
    """
    feats = [torch.ones_like(x[..., :1]), x]
    if policy.a2 != 0:
        a, b = torch.triu_indices(x.shape[-1], x.shape[-1], device=x.device)
        feats.append(x[..., a] * x[..., b])
    if query:
        feats[0] = feats[0] * policy.a0
        feats[1] = feats[1] * policy.a1
        if policy.a2 != 0:
            feats[2] = feats[2] * (policy.a2 * torch.where(a == b, 1.0, 2.0).to(x.dtype))
    return torch.cat(feats, dim=-1)


def fastmax_linear(q, k, v, mask, causal: bool, policy: ScorePolicy, chunk: int = 64):
    """Fastmax in O(N) memory: moments of phi_k(k) [v, 1]^T, carried in fp32 from chunk to chunk.

    Queries are processed ``chunk`` rows at a time. For a chunk, keys that every query in it may see
    live in the running moment S; the few keys that only some of its queries see (the causal
    diagonal band) are done quadratically. Grouped KV heads share one moment per kv head.
    """
    if policy.kind != "poly":
        raise ValueError(f"policy: the linear form is for the polynomial family, got {policy.kind!r}")
    out_dtype = q.dtype
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    bsz, heads, i, d = q.shape
    hkv, j = k.shape[1], k.shape[2]
    group = heads // hkv
    q = scale_rows(q.to(work), policy.qk_norm) * policy.scale
    k = scale_rows(k.to(work), policy.qk_norm)
    v1 = torch.cat([v.to(work), torch.ones_like(v[..., :1], dtype=work)], dim=-1)  # [v, 1]: l rides along
    if mask is not None:
        v1 = v1 * mask[:, None, :, None].to(work)
    q = q.reshape(bsz, hkv, group, i, d)
    f = lambda x: policy.a0 + x * (policy.a1 + policy.a2 * x)  # noqa: E731

    def moment(lo, hi):  # sum over keys [lo, hi) of phi_k(k_s) [v_s, 1]^T, per kv head
        phi = poly_features(k[:, :, lo:hi], policy, query=False)
        return (phi.transpose(-1, -2) @ v1[:, :, lo:hi]).unsqueeze(2)

    outs = []
    if not causal:
        state = sum(moment(lo, min(lo + chunk, j)) for lo in range(0, j, chunk))
        for t0 in range(0, i, chunk):
            outs.append(poly_features(q[:, :, :, t0:t0 + chunk], policy, query=True) @ state)
    else:
        offset = j - i  # bottom-right alignment: query t sees keys s <= t + offset
        state, done = 0, 0
        for t0 in range(0, i, chunk):
            t1 = min(t0 + chunk, i)
            lo = min(max(t0 + offset + 1, 0), j)  # keys < lo are visible to every query of the chunk
            hi = min(max(t1 + offset, 0), j)      # keys in [lo, hi) are visible to some of them
            if lo > done:
                state = state + moment(done, lo)
                done = lo
            qc = q[:, :, :, t0:t1]
            o = poly_features(qc, policy, query=True) @ state if done > 0 else 0
            if hi > lo:
                t = torch.arange(t0, t1, device=q.device)[:, None]
                s = torch.arange(lo, hi, device=q.device)[None, :]
                a = f(qc @ k[:, :, lo:hi].unsqueeze(2).transpose(-1, -2)) * (s <= t + offset)
                o = o + a @ v1[:, :, lo:hi].unsqueeze(2)
            if not torch.is_tensor(o):  # no key visible to any query of this chunk
                o = torch.zeros(*qc.shape[:-1], d + 1, dtype=work, device=q.device)
            outs.append(o)
    o = torch.cat(outs, dim=3).reshape(bsz, heads, i, d + 1)
    return _safe_divide(o[..., :d], o[..., d:]).to(out_dtype)
