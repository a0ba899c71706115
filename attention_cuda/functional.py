"""The public attention functions: validation, canonical shapes, then the plan (plan.py) and its execution.

Layering (as FlashAttention does it): csrc kernels -> torch ops (_ops.py, loaded by _extension.py) ->
autograd.Functions (_kernels.py) -> these functions. The references (reference.py) are plain differentiable PyTorch.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from . import _extension, _kernels, reference
from .plan import BACKENDS, Plan, Tuning, reference_reason, resolve, rope_kernels_reason
from .score import ScorePolicy, cosine_policy, exp_policy, fastmax_policy

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA kernels can run here, else why not (and how to fix it)."""
    return _extension.unavailable_reason()


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


def _plan(call: _Call, causal: bool, policy: ScorePolicy, backend: str, form: str = "quadratic",
          dropout: float = 0.0, tuning: Tuning | None = None) -> Plan:
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (call.q, call.k, call.v))
    splittable = None if causal or needs_grad or call.bias is not None else (
        call.q.shape[0] * call.q.shape[1], call.q.shape[2])
    return resolve(device=call.q.device, dtype=call.q.dtype, head_dim=call.q.shape[-1], keys=call.k.shape[2],
                   policy=policy, backend=backend, form=form, dropout=dropout, tuning=tuning, splittable=splittable,
                   forward_only=not needs_grad)


def _run(plan: Plan, call: _Call, causal: bool, policy: ScorePolicy, dropout: float = 0.0) -> torch.Tensor:
    """Execute the plan: the kernels or the reference, in its form."""
    q, k, v, mask = call.q, call.k, call.v, call.mask
    if plan.backend == "cuda" and plan.form == "linear":
        out = _kernels.linear_attention(q, k, v, mask, causal, policy, plan.run_dtype, plan.chunk,
                                        plan.path == "chunked")
    elif plan.path == "split":
        out = _kernels.split_keys(q, k, v, mask, policy, plan.run_dtype, plan.splits)
    elif plan.path == "decode":
        out = _kernels.decode(q, k, v, mask, policy, plan.run_dtype)
    elif plan.backend == "cuda":
        out = _kernels.attention(q, k, v, mask, call.bias, causal, policy, plan.run_dtype)
    elif plan.form == "linear":
        out = reference.fastmax_linear(q, k, v, mask, causal, policy)
    else:
        out = reference.quadratic(q, k, v, mask, call.bias, causal, policy, dropout)
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
    policy = cosine_policy(scale, l2norm_qk)
    return _run(_plan(call, causal, policy, backend), call, causal, policy)


def exp_attention(q, k, v, *, scale=8.0, causal=False, mask=None, backend="auto"):
    """sum_s exp(scale * q.k_s) v_s with no normalisation (the seeds' "custom attention").

    Nothing bounds the logits: exp overflows once scale * q.k exceeds ~88 in fp32, ~11 in fp16, in the
    weights' dtype (q's on the reference, fp32 on the kernels). A ``scale`` at which even q.k = 1
    overflows it raises ValueError before any work; so does, after the call, an output that overflowed
    on finite q, k and v (at the default scale, randn rows of head dim 16 already do). q, k or v that
    hold inf or NaN give NaN in the rows that read them, as in the other families. Under torch.compile
    the output is not checked.
    """
    call = _canonicalize(q, k, v, mask)
    policy = exp_policy(scale)
    plan = _plan(call, causal, policy, backend)
    out = _run(plan, call, causal, policy)
    # The check reads the output back to the host, a sync that would break a torch.compile graph.
    if not torch.compiler.is_compiling():
        _refuse_overflow(out, call, policy, plan.score_dtype)
    return out


def _refuse_overflow(out: torch.Tensor, call: _Call, policy: ScorePolicy, score_dtype: torch.dtype) -> None:
    """Raise ValueError if exp's output holds inf or NaN while q, k and v are finite: its weights overflowed.

    Unlike the other families' (ScorePolicy.check_range), exp's largest logit depends on the data, so the
    overflow can only be seen after the call. The common case costs one reduction over the output and a
    read of its result (a sync on CUDA); the inputs are read only when it fails. Inputs holding inf or NaN
    anywhere, masked keys included, skip the check: their NaN cannot be told from an overflow.
    """
    if torch.isfinite(out).all():
        return
    if not all(torch.isfinite(t).all() for t in (call.q, call.k, call.v)):
        return  # garbage in: the rows that read it are NaN, as documented
    bad = int((~torch.isfinite(out)).sum())
    limit = torch.finfo(score_dtype).max
    raise ValueError(f"scale: {policy.scale:g} overflows {score_dtype} on these inputs: {bad} of {out.numel()} "
                     f"outputs are not finite, as exp(scale * q.k) passes the dtype's max {limit:g} once the "
                     f"logit exceeds {math.log(limit):.1f}; pass a smaller scale, or l2-normalise q and k, "
                     f"which bounds every logit by |scale|")


def fastmax_attention(q, k, v, *, causal=False, mask=None, p=2, a0=1.0, a1=1.0, a2=0.5,
                      temperature=1.0, normalize=False, lim=1.0, dropout=0.0, backend="auto",
                      form="auto", tuning: Tuning | None = None):
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
    them the reference's form with fewer FLOPs (plan.py says which, and why). ``tuning`` replaces the
    measured crossovers and chunk sizes (plan.TUNING).
    """
    call = _canonicalize(q, k, v, mask)
    policy = fastmax_policy(p, a0, a1, a2, temperature, normalize, lim)
    plan = _plan(call, causal, policy, backend, form, dropout, tuning)
    return _run(plan, call, causal, policy, dropout)


# Each family's public function and its policy constructor, whose parameters are the family's score options.
FAMILIES = {"cosine": (cosine_sim_attention, cosine_policy), "exp": (exp_attention, exp_policy),
            "fastmax": (fastmax_attention, fastmax_policy)}


def score_policy(family: str, **options) -> ScorePolicy:
    """The score policy (how logits become weights) of a call of the family's function ("cosine", "exp",
    "fastmax") with its score options given by name (cosine: scale, l2norm_qk; exp: scale; fastmax: p, a0, a1,
    a2, temperature, normalize, lim), each defaulting as in the function; checked as the function checks them.
    An option the family does not have raises ValueError."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {tuple(FAMILIES)}, got {family!r}")
    function, make_policy = FAMILIES[family]
    names = tuple(inspect.signature(make_policy).parameters)
    unknown = [name for name in options if name not in names]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a score option of {family!r}; its options are "
                         f"{', '.join(names)}")
    # The defaults are read from the function's signature, so that they are written once.
    defaults = inspect.signature(function).parameters
    return make_policy(**{name: options.get(name, defaults[name].default) for name in names})


def plan(family: str, *, device, dtype: torch.dtype, head_dim: int, keys: int, backend: str = "auto",
         form: str = "quadratic", dropout: float = 0.0, tuning: Tuning | None = None, **options) -> Plan:
    """The plan a call of the family's function would run, from the inputs' device, dtype, head dim and key
    count, with its score options as score_policy takes them: for FLOP counts, logs and probes."""
    return resolve(device=torch.device(device), dtype=dtype, head_dim=head_dim, keys=keys,
                   policy=score_policy(family, **options), backend=backend, form=form, dropout=dropout, tuning=tuning)


def rotary_qkv(qkv, cos, sin, *, heads: int, kv_heads: int, backend="auto"):
    """RoPE on a fused projection: qkv (B, T, (heads + 2 kv_heads) D) -> q (B, heads, T, D) and k
    (B, kv_heads, T, D), each pair (x_i, x_{i + D/2}) rotated by the angle whose cos and sin are row t of cos,
    sin (T, D/2), in fp32 and rounded to qkv's dtype, and v (B, kv_heads, T, D), a strided view of qkv.

    On the kernels (backend "cuda", or "auto" where they run: CUDA, fp16/bf16/fp32, D a multiple of 16) it is
    one pass each way, where the same math in PyTorch ops is about ten; q and k come contiguous, as the
    attention kernels read them. backend="cuda" where they cannot run raises NotImplementedError saying why.
    """
    if not isinstance(qkv, torch.Tensor) or not qkv.is_floating_point() or qkv.dim() != 3:
        raise ValueError("qkv: expected a floating-point tensor (B, T, (heads + 2 kv_heads) D), got "
                         + (f"shape {tuple(qkv.shape)}" if isinstance(qkv, torch.Tensor) else type(qkv).__name__))
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and heads > 0 and kv_heads > 0):
        raise ValueError(f"heads, kv_heads: expected positive ints, got {heads!r}, {kv_heads!r}")
    b, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    if d * (heads + 2 * kv_heads) != width or d % 2:
        raise ValueError(f"qkv: expected a last dim of (heads + 2 kv_heads) D = {heads + 2 * kv_heads} x D with D "
                         f"even, got {width}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != (t, d // 2) or table.device != qkv.device:
            raise ValueError(f"{name}: expected ({t}, {d // 2}) (T, D/2) on {qkv.device}, got "
                             + (f"{tuple(table.shape)} on {table.device}" if isinstance(table, torch.Tensor)
                                else type(table).__name__))
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if reference_reason(backend, lambda: rope_kernels_reason(qkv.device, qkv.dtype, d)) is None:
        return _kernels.rotary_qkv(qkv, cos, sin, heads, kv_heads)
    return reference.rotary_qkv(qkv, cos, sin, heads, kv_heads)


def fastmax_moments(k, v, *, p=2, a0=1.0, a1=1.0, a2=0.5, temperature=1.0, normalize=False, lim=1.0):
    """The state of fastmax's recurrent form: for k, v (B, Hkv, J, D), the fp32 sum over the J keys of
    phi(k_s) [v_s, 1]^T, (B, Hkv, F, D + 1) with F = 1 + D (+ D(D+1)/2 for p = 2).

    States add: the moments of two runs of keys are the sum of theirs, so a decoder adds each new key's
    and reads with fastmax_read in O(F·D) per query whatever the number of keys before it. The options
    are fastmax_attention's. PyTorch operations (no kernel).
    """
    if k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v: expected (B, Hkv, J, D) with the same B, Hkv and J, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    return reference.moments(k, v, fastmax_policy(p, a0, a1, a2, temperature, normalize, lim))


def fastmax_read(q, state, *, p=2, a0=1.0, a1=1.0, a2=0.5, temperature=1.0, normalize=False, lim=1.0):
    """fastmax_attention of q (B, H, T, D) over the keys whose moments state (fastmax_moments') holds, every
    query seeing every key, with the same options as made state."""
    policy = fastmax_policy(p, a0, a1, a2, temperature, normalize, lim)
    features = reference._num_features(q.shape[-1], policy)
    if (q.dim() != 4 or state.dim() != 4 or state.shape[0] != q.shape[0] or q.shape[1] % state.shape[1]
            or state.shape[2:] != (features, q.shape[-1] + 1)):
        raise ValueError(f"state: expected (B, Hkv, {features}, {q.shape[-1] + 1}) for q {tuple(q.shape)} "
                         f"(B, H, T, D) with H a multiple of Hkv, got {tuple(state.shape)}")
    return reference.read_moments(q, state, policy)
