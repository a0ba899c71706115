"""The public attention functions: validation, shape canonicalisation and backend dispatch.

Layering (as FlashAttention does it): csrc kernels -> torch ops + autograd.Function (_cuda.py) ->
these functions. The references (reference.py) are plain differentiable PyTorch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import reference
from .score import ScorePolicy, cosine_policy, exp_policy, poly_policy

BACKENDS = ("auto", "torch", "cuda")
FORMS = ("auto", "quadratic", "linear")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The kernels compute logits and weights in fp32 whatever the inputs (fp32 accumulators, fp32 scores).
KERNEL_SCORE_DTYPE = torch.float32


def _kernels():
    """The CUDA extension module, or the reason it cannot be used."""
    try:
        from . import _cuda
    except ImportError as e:  # pragma: no cover - only when the package is broken
        return None, f"attention_cuda._cuda failed to import: {e}"
    return _cuda, _cuda.unavailable_reason()


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA kernels can run here, else why not (and how to fix it)."""
    return _kernels()[1]


@dataclass
class _Call:
    """Inputs in canonical form: q (B, H, I, D), k/v (B, Hkv, J, D), mask (B, J), bias (B, H, I, J)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    merged: bool

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        return out[:, 0] if self.merged else out


def _canonicalize(q, k, v, mask=None, bias=None) -> _Call:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k, v: expected the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")

    merged = q.dim() == 3
    if merged:  # (b*h, n, d) for all three: each batch-head is its own sequence
        if k.dim() != 3 or k.shape[0] != q.shape[0]:
            raise ValueError(f"k: with merged q of shape {tuple(q.shape)} expected (b*h, j, d) = "
                             f"({q.shape[0]}, j, {q.shape[-1]}), got {tuple(k.shape)}")
        q, k, v = q[:, None], k[:, None], v[:, None]
    elif q.dim() == 4:
        if k.dim() == 3:  # one KV head shared by every query head
            k, v = k[:, None], v[:, None]
        if k.dim() != 4:
            raise ValueError(f"k: expected (b, h_kv, j, d) or (b, j, d), got {tuple(k.shape)}")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k: batch {k.shape[0]} does not match q's batch {q.shape[0]}")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"k: h_kv={k.shape[1]} must divide the {q.shape[1]} query heads")
    else:
        raise ValueError(f"q: expected (b, h, i, d) or merged (b*h, i, d), got shape {tuple(q.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: head dim {k.shape[-1]} does not match q's {q.shape[-1]}")
    b, h, i, d = q.shape
    j = k.shape[2]
    if i < 1 or j < 1 or d < 1:
        raise ValueError(f"q, k: expected non-empty sequences and head dim, got i={i}, j={j}, d={d}")

    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError("mask: expected a bool tensor (True = keep), got "
                             + (str(mask.dtype) if isinstance(mask, torch.Tensor) else type(mask).__name__))
        if tuple(mask.shape) != (b, j):
            raise ValueError(f"mask: expected shape (batch, j) = ({b}, {j}), got {tuple(mask.shape)}")
        if mask.device != q.device:
            raise ValueError(f"mask: expected device {q.device}, got {mask.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise ValueError("attn_bias: expected a floating-point tensor")
        if bias.device != q.device:
            raise ValueError(f"attn_bias: expected device {q.device}, got {bias.device}")
        want, given = "(b*h, i, j)" if merged else "(h, i, j) or (b, h, i, j)", tuple(bias.shape)
        if bias.dim() == 3:
            bias = bias[:, None] if merged else bias[None]
        try:
            if bias.dim() != 4:
                raise RuntimeError
            bias = bias.expand(b, h, i, j)
        except RuntimeError:
            raise ValueError(f"attn_bias: expected {want} broadcastable to (b={b}, h={h}, i={i}, j={j}), "
                             f"got {given}") from None
    return _Call(q, k, v, mask, bias, merged)


def _use_cuda(call: _Call, causal: bool, policy: ScorePolicy, backend: str, unsupported: str | None) -> bool:
    """Resolve the backend: "cuda" must work or raise, "auto" takes the kernel when it can."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    kernels, reason = _kernels()
    if reason is None and not call.q.is_cuda:
        reason = f"inputs are on {call.q.device}, the kernels run on CUDA devices"
    if reason is None:
        reason = unsupported or kernels.unsupported_reason(call.q, call.k, call.v, call.mask, call.bias,
                                                           causal, policy)
    if backend == "cuda" and reason is not None:
        raise NotImplementedError(f'backend="cuda": {reason}')
    return reason is None


def _attend(call: _Call, causal: bool, policy: ScorePolicy, backend: str, *, unsupported: str | None = None,
            dropout: float = 0.0, linear: bool = False) -> torch.Tensor:
    """Run on the kernels when the backend resolves to them, else on the matching reference, once the
    policy's logits and weights are known to fit the dtype that backend computes them in."""
    on_kernels = _use_cuda(call, causal, policy, backend, unsupported)
    policy.check_range(KERNEL_SCORE_DTYPE if on_kernels else reference.score_dtype(call.q.dtype, linear))
    if on_kernels:
        kernels = _kernels()[0]
        if linear:
            out = kernels.linear_attention(call.q, call.k, call.v, call.mask, causal, policy)
        else:
            out = kernels.attention(call.q, call.k, call.v, call.mask, call.bias, causal, policy)
    elif linear:
        out = reference.fastmax_linear(call.q, call.k, call.v, call.mask, causal, policy)
    else:
        out = reference.quadratic(call.q, call.k, call.v, call.mask, call.bias, causal, policy, dropout)
    return call.restore(out)


def cosine_sim_attention(q, k, v, *, causal=False, mask=None, attn_bias=None, scale=10.0,
                         l2norm_qk=True, backend="auto"):
    """softmax(scale * l2norm(q) l2norm(k)^T + attn_bias) v, computed as exp(x - scale) / l.

    Unit-norm q and k bound every logit by ``scale``, so without ``attn_bias`` the kernels need no
    running row max. ``l2norm_qk=False`` means q and k are already normalised by the caller.
    A ``scale`` whose logits overflow the dtype they are computed in (q's on the reference, fp32 on
    the kernels) raises ValueError. ``attn_bias`` of another dtype is cast to q's (to autocast's, when
    it is on, on the kernels); its gradient comes back in its own dtype.
    """
    call = _canonicalize(q, k, v, mask, attn_bias)
    return _attend(call, causal, cosine_policy(scale, l2norm_qk), backend)


def exp_attention(q, k, v, *, scale=8.0, causal=False, mask=None, backend="auto"):
    """sum_s exp(scale * q.k_s) v_s with no normalisation (the seeds' "custom attention").

    Nothing bounds the logits: exp overflows (inf) once scale * q.k exceeds ~88 in fp32, ~11 in fp16.
    A ``scale`` at which even q.k = 1 overflows the weights' dtype (q's on the reference, fp32 on
    the kernels) raises ValueError.
    """
    call = _canonicalize(q, k, v, mask)
    return _attend(call, causal, exp_policy(scale), backend)


def fastmax_flops_crossover(dim_head: int, p: int) -> int:
    """Key count above which the linear form needs fewer FLOPs than the quadratic one.

    Quadratic: ~4·J·D per query (q.k and the weighted sum). Linear: ~4·F·(D+1) per token with
    F = 1 + D (+ D(D+1)/2) features, so linear wins once J exceeds about F.
    """
    return 1 + dim_head + (dim_head * (dim_head + 1) // 2 if p == 2 else 0)


def fastmax_linear_from(dim_head: int, p: int, on_kernels: bool, dtype=torch.bfloat16) -> float:
    """Key count from which form="auto" runs fastmax's linear form: on the kernels the crossover
    measured per head dim (p = 2; p = 1 is not measured, so never) for the kernels that run dtype
    there, else the FLOPs crossover."""
    if on_kernels:
        from ._cuda import linear_from_keys
        return linear_from_keys(dim_head, dtype) if p == 2 else math.inf
    return fastmax_flops_crossover(dim_head, p) + 1


def fastmax_attention(q, k, v, *, causal=False, mask=None, p=2, a0=1.0, a1=1.0, a2=0.5,
                      temperature=1.0, normalize=False, lim=1.0, dropout=0.0, backend="auto",
                      form="auto"):
    """Polynomial attention: weights f(x) = a0 + a1 x (+ a2 x^2) of x = q.k / temperature, row-normalised.

    ``normalize=True`` scales each q and k row to norm ``lim`` first (row by row, so under ``causal``
    no future token can change a past output). Coefficients that let f go negative on reachable
    logits are rejected, and so is a ``temperature`` whose weights overflow the dtype they are computed
    in (q's on the quadratic reference, fp32 or fp64 on the linear one, fp32 on the kernels): f of the largest
    reachable logit, lim**2 / temperature with ``normalize``, else (nothing bounds them) the logit of
    q.k = 1, must be finite. ``dropout`` drops normalised weights (quadratic form only; the kernels and
    the linear form do not implement it). ``form``: "quadratic" materialises weights tile by tile,
    "linear" carries moments of k (O(N) time and memory); "auto" takes the form that was faster on
    the kernels at this head dim and key count (p = 2 only; p = 1 stays quadratic there), and without
    them the reference's form with fewer FLOPs.
    """
    call = _canonicalize(q, k, v, mask)
    policy = poly_policy(p, a0, a1, a2, temperature, normalize, lim)
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout}")
    if dropout > 0 and form == "linear":
        raise NotImplementedError("dropout: the linear form cannot drop individual weights; "
                                  "use form='quadratic' or dropout=0")
    no_dropout = "dropout: the kernels do not implement dropout (use dropout=0 or backend='torch')"
    unsupported = no_dropout if dropout > 0 else None
    if form == "auto":  # dropout exists only in the quadratic form
        on_kernels = backend != "torch" and _use_cuda(call, causal, policy, "auto", unsupported)
        linear = call.k.shape[2] >= fastmax_linear_from(call.q.shape[-1], p, on_kernels, call.q.dtype)
        if on_kernels:  # the linear-form kernels take fp16 and bf16 only
            linear = linear and _kernels()[0].linear_unsupported_reason(call.q) is None
        form = "linear" if linear and dropout == 0 else "quadratic"
    if form == "linear" and unsupported is None:
        kernels = _kernels()[0]
        unsupported = kernels.linear_unsupported_reason(call.q) if kernels else None
    return _attend(call, causal, policy, backend, unsupported=unsupported, dropout=dropout,
                   linear=form == "linear")
