"""The CUDA kernels as differentiable torch ops.

Loading: the extension that setup.py built (``attention_cuda._C``), else a JIT build of ``csrc/`` on
first use (``torch.utils.cpp_extension.load``, cached under a name made from a hash of the sources, so
an edit rebuilds and an unchanged tree reuses the build). The ops ``attn_cuda::fwd`` and
``attn_cuda::bwd`` are defined in csrc/binding.cpp; here they get fake implementations (torch.compile
traces through them without running them) and one autograd.Function ties them together.

Precision: fp16/bf16 inputs run on tensor cores with fp32 accumulation and fp32 softmax statistics,
as FlashAttention does. fp32 inputs run as TF32 (operands rounded to a 10-bit mantissa, fp32
accumulation): the same precision as a PyTorch fp32 matmul with ``allow_tf32=True``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import torch

from .score import ScorePolicy

CSRC = Path(__file__).parent / "csrc"
HEAD_DIMS = (16, 32, 64, 96, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_UNSET = object()
_reason = _UNSET      # None once the ops are loaded, else why they cannot be
_head_dims = {}       # dtype -> head dims compiled into the loaded extension


def _pad4(n):
    return (n + 3) // 4 * 4


def _arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST, else the current device's architecture (9.0a on Hopper: the wgmma kernels)."""
    major, minor = torch.cuda.get_device_capability()
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or f"{major}.{minor}{'a' if (major, minor) == (9, 0) else ''}"


def _jit_build() -> None:
    from torch.utils import cpp_extension

    arch = _arch_list()
    digest = hashlib.sha256(arch.encode())
    for f in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(f.relative_to(CSRC).as_posix().encode() + b"\0" + f.read_bytes())
    sources = [CSRC / "binding.cpp", CSRC / "aux.cu", *sorted((CSRC / "inst").glob("*.cu"))]
    flags = (CSRC / "nvcc_flags.txt").read_text().split() + (["-DATTN_SM90A"] if "9.0a" in arch else [])
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        cpp_extension.load(name=f"attention_cuda_{digest.hexdigest()[:16]}", sources=[str(s) for s in sources],
                           extra_cflags=["-O3"], extra_cuda_cflags=flags, is_python_module=False)
    finally:
        if saved is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def _first_error_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [type(e).__name__])[0]


def _load() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    prebuilt = importlib.util.find_spec(f"{__package__}._C")
    problems = []
    if prebuilt is not None:
        try:
            torch.ops.load_library(prebuilt.origin)
        except OSError as e:
            problems.append(f"the prebuilt extension {prebuilt.origin} does not load ({e}); ")
    if not hasattr(torch.ops.attn_cuda, "fwd"):
        try:
            _jit_build()
        except Exception as e:  # noqa: BLE001 - any build failure becomes the reason, not a crash
            return (f"{''.join(problems)}the extension failed to build: {_first_error_line(e)}; for the full "
                    "log run `python -c 'import attention_cuda._cuda as c; c._jit_build()'`, or install it "
                    "with `pip install --no-build-isolation -e .` on a machine with nvcc")
    for dt in DTYPES:
        _head_dims[dt] = tuple(torch.ops.attn_cuda.head_dims(dt))
    _register_fakes()
    return None


def unavailable_reason() -> str | None:
    """None when the kernels are loaded and a CUDA device exists, else why not and how to fix it."""
    global _reason
    if _reason is _UNSET:
        _reason = _load()
    return _reason


def unsupported_reason(q, k, v, mask, bias, causal, policy: ScorePolicy) -> str | None:
    """None if the kernels take this call, else why (the functional layer raises it or falls back).

    Takes what functional._canonicalize produced, which already checked shapes, devices, the mask and
    the bias against each other; what is left are the kernels' own limits.
    """
    reason = unavailable_reason()
    if reason is not None:
        return reason
    dtype = _run_dtype(q)
    if dtype not in DTYPES:
        return f"q: dtype {dtype} is not supported by the kernels (float16, bfloat16, float32)"
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        return f"q: head dim {d} is not supported by the kernels (one of {HEAD_DIMS})"
    if d not in _head_dims[dtype]:
        return (f"q: head dim {d} is not compiled for {dtype} in this build (compiled: {_head_dims[dtype]}); "
                "rebuild without ATTN_HEADDIMS / ATTN_DTYPES")
    return None


def _run_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the kernels run in: autocast's, when it is on (as for SDPA), else q's."""
    if q.is_floating_point() and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return q.dtype


def attention(q, k, v, mask, bias, causal: bool, policy: ScorePolicy) -> torch.Tensor:
    """O = sum_s A_ts v_s / l_t on the kernels; differentiable w.r.t. q, k, v and attn_bias.

    q (B, H, I, D), k and v (B, Hkv, J, D) with any strides, mask None or bool (B, J) (True = keep),
    bias None or (B, H, I, J) (an expanded view is fine; another dtype is cast to the inputs' dtype).
    """
    dtype = _run_dtype(q)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if bias is not None:
        bias = bias.to(dtype)
    return _Attention.apply(q, k, v, mask, bias, causal, policy.kind, policy.scale, policy.qk_norm,
                            policy.a0, policy.a1, policy.a2, policy.normalize_rows)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, causal, kind, scale, qk_norm, a0, a1, a2, normalize):
        out, stat, rq, rk = torch.ops.attn_cuda.fwd(q, k, v, mask, bias, causal, kind, scale, qk_norm,
                                                    a0, a1, a2, normalize)
        ctx.save_for_backward(q, k, v, mask, bias, out, stat, rq, rk)
        ctx.args = (causal, kind, scale, qk_norm, a0, a1, a2, normalize)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, bias, out, stat, rq, rk = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[4]
        dq, dk, dv, dbias = torch.ops.attn_cuda.bwd(dout, q, k, v, mask, bias, out, stat, rq, rk, *ctx.args,
                                                    bias_grad)
        return dq, dk, dv, None, dbias if bias_grad else None, *([None] * 8)


LINEAR_CHUNK = 128  # rows per chunk of the linear form: kLinChunk in csrc/params.h


def linear_unsupported_reason(q) -> str | None:
    """None if the linear-form kernel takes q's dtype and head dim, else why."""
    dtype = _run_dtype(q)
    if dtype not in (torch.float16, torch.bfloat16):
        return f"q: the linear-form kernels take float16 and bfloat16, got {dtype} (use form='quadratic')"
    return None


# Key counts from which the linear form's kernels beat the quadratic ones, per head dim: the smallest
# measured power of two where they were faster (p = 2, causal forward + backward, bf16, b4 h8, H200;
# bench/results_fastmax-linear.json, bench/runs/2026-11-21_s5_fastmax-crossover.json). p = 1 is not measured.
LINEAR_FROM_KEYS = {16: 16384, 32: 16384, 64: 32768, 96: 65536, 128: 131072}


def _extend(x: torch.Tensor) -> torch.Tensor:
    """Rows x' = [x, 1, 0 ... 0] (D + 16 columns): the 1 carries the constant and first-order features."""
    return torch.cat([x, torch.ones_like(x[..., :1]), x.new_zeros(*x.shape[:-1], 15)], dim=-1)


def _chunk_major(x: torch.Tensor, n_pad: int) -> torch.Tensor:
    """(B, H, N, W) -> (B, chunks, H, LINEAR_CHUNK, W), contiguous, rows past N zero."""
    b, h, n, w = x.shape
    x = torch.nn.functional.pad(x, (0, 0, 0, n_pad - n))
    return x.view(b, h, n_pad // LINEAR_CHUNK, LINEAR_CHUNK, w).transpose(1, 2).contiguous()


def linear_attention(q, k, v, mask, causal: bool, policy: ScorePolicy) -> torch.Tensor:
    """Fastmax in its linear form on the kernels: moments carried over chunks of 128 rows (fp32), each
    chunk's own causal block on the tiled quadratic kernel. Same contract as ``attention``.

    The moments cost O(D^3) per token (p = 2) and no N: it wins over the quadratic form at long N.
    Normalisation, the temperature and the [x, 1] extension are differentiable PyTorch around the op.
    """
    from .reference import scale_rows

    if k.shape[2] <= LINEAR_CHUNK:
        # All keys fit in one chunk: the tiled kernel does the whole call as one block, at I*J*D, below
        # the moments' cost, and rounded as the quadratic form. It also matters for precision: with one
        # visible key the exact dq, dk are 0 and dv is dO, which the tiled kernels (and PyTorch) hit
        # exactly (P = 1), so the FA rule leaves only its atol; moments rounded to fp16/bf16 miss by ulps.
        return attention(q, k, v, mask, None, causal, policy)
    dtype = _run_dtype(q)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    b, h, i, d = q.shape
    hkv, j = k.shape[1], k.shape[2]
    qs = (scale_rows(q.float(), policy.qk_norm) * policy.scale).to(dtype)
    ks = scale_rows(k.float(), policy.qk_norm).to(dtype)
    keep = torch.ones(b, j, dtype=torch.bool, device=q.device) if mask is None else mask
    front = 0
    if causal and i != j:  # bottom-right alignment: query t sits at key position t + j - i
        front = j - i
        if front > 0:  # queries start at key position j - i: rows before them are placeholders
            qs = torch.nn.functional.pad(qs, (0, 0, front, 0))
        else:  # the first i - j queries see no key: placeholder keys, masked
            ks, v = (torch.nn.functional.pad(x, (0, 0, -front, 0)) for x in (ks, v))
            keep = torch.nn.functional.pad(keep, (-front, 0), value=False)
    n_pad = -(-max(qs.shape[2], ks.shape[2]) // LINEAR_CHUNK) * LINEAR_CHUNK
    qc, kc = _chunk_major(_extend(qs), n_pad), _chunk_major(_extend(ks), n_pad)
    vc = _chunk_major(_extend(v) * keep[:, None, :, None].to(dtype), n_pad)
    keep_c = torch.nn.functional.pad(keep, (0, n_pad - keep.shape[1])).view(b * n_pad // LINEAR_CHUNK, LINEAR_CHUNK)
    out = _LinearAttention.apply(qc, kc, vc, keep_c, causal, (policy.a0, policy.a1, policy.a2))
    out = out.transpose(1, 2).reshape(b, h, n_pad, d)
    return out[:, :, max(front, 0):max(front, 0) + i]


class _LinearAttention(torch.autograd.Function):
    """y = [num, l] = moments of the chunks before (attn_cuda::linear) + the chunk's own causal block
    (attn_cuda::fwd, whose saved 1/l and output give its num and l back); out = num / l.

    Backward, with g = [dO, -(dO . O)] / l: dq from the same moments read against g (R2), dk and dv from
    the moments of psi(q) g^T carried in reverse (R1 and R2 with the keys), and the diagonal blocks from
    attn_cuda::bwd, which given the final O and 1/l computes exactly their share. The two sweeps take
    the values shifted by their mean mu, and g's last column as -(dO . (O - mu)) / l (see backward).
    """

    @staticmethod
    def forward(ctx, qc, kc, vc, keep_c, causal, coefs):
        b, nc, h, n, dp = qc.shape
        hkv, d, group = kc.shape[2], dp - 16, qc.shape[2] // kc.shape[2]
        second = coefs[2] != 0
        y, _ = torch.ops.attn_cuda.linear(kc, vc, qc, None, 1, group, causal, False, second, [1.0, 1.0, 1.0],
                                          list(coefs), dp // 16, False)
        num, l = y[..., :d], y[..., d]
        if causal:
            o_i, stat_i, _, _ = torch.ops.attn_cuda.fwd(*_diagonal(qc, kc, vc), keep_c, None, True, "poly", 1.0,
                                                        None, *coefs, True)
            l_i = torch.where(stat_i > 0, 1.0 / stat_i, 0.0).view(b, nc, h, n)
            num = num + o_i.float().view(b, nc, h, n, d) * l_i[..., None]
            l = l + l_i
        inv_l = torch.where(l > 0, 1.0 / l, 0.0)  # no visible key, or weights that sum to 0: output 0
        out = (num * inv_l[..., None]).to(qc.dtype)
        ctx.save_for_backward(qc, kc, vc, keep_c, out, inv_l)
        ctx.causal, ctx.coefs = causal, coefs
        return out

    @staticmethod
    def backward(ctx, dout):
        qc, kc, vc, keep_c, out, inv_l = ctx.saved_tensors
        causal, coefs = ctx.causal, ctx.coefs
        b, nc, h, n, dp = qc.shape
        d, group, second = dp - 16, qc.shape[2] // kc.shape[2], coefs[2] != 0
        dout = dout.contiguous()
        # The sweeps' dq and dk sum phi(k_s) (dO . v_s - dO . O) / l over keys, as the moments of [v, 1]
        # read against g = [dO, -dO . O] / l: two sums, each rounded (g and the moments enter the tensor
        # cores in fp16/bf16), that cancel down to the spread of v. Values with a common offset (real
        # activations have one) make both parts large and the rounding of each shows. The weights sum
        # to 1, so any constant mu may come off both: v_s - mu and O - mu, with mu the mean value of the
        # visible keys per (batch, kv head). The forward keeps v as given (no extra rounding there).
        keep1 = vc[..., d:d + 1]  # 1 at visible keys (the [v, 1] rows are zero elsewhere)
        mu = (vc[..., :d].sum((1, 3), keepdim=True, dtype=torch.float32)
              / keep1.sum((1, 3), keepdim=True, dtype=torch.float32).clamp_min(1.0))  # (B, 1, Hkv, 1, D)
        vs = vc.clone()
        vs[..., :d] = (vc[..., :d] - mu * keep1).to(vc.dtype)
        mu_q = mu.repeat_interleave(group, dim=2)  # per query head
        delta = (dout.float() * (out.float() - mu_q)).sum(-1, keepdim=True)
        g = torch.cat([dout.float(), -delta, dout.new_zeros(*dout.shape[:-1], 15, dtype=torch.float32)], dim=-1)
        g = g * inv_l[..., None]
        # g = dO / l shrinks with the sequence, and from a causal row with few keys to one with many by
        # orders of magnitude. The sweeps take it times a power of two (exact) that puts the largest
        # product the reverse sweep rounds to the input dtype, g c q, near 2^14: the small rows' products
        # stay above fp16's subnormals (2^-14, where digits are lost) and all below its max (65504).
        cmax = (abs(coefs[2]) * qc[..., :d].abs().amax().float()).clamp_min(max(1.0, abs(coefs[0]), abs(coefs[1])))
        scale = torch.exp2(torch.ceil(torch.log2((g.abs().amax() * cmax).clamp_min(torch.finfo(torch.float32).tiny)))
                           - 14)
        g = (g / scale).to(qc.dtype)
        _, dq = torch.ops.attn_cuda.linear(kc, vs, qc, g, 1, group, causal, False, second, [1.0, 1.0, 1.0],
                                           list(coefs), 0, True)
        dv, dk = torch.ops.attn_cuda.linear(qc, g, kc, vs, group, 1, causal, True, second, list(coefs),
                                            [1.0, 1.0, 1.0], d // 16, True)
        dq, dk, dv = dq * scale, dk * scale, dv[..., :d] * scale
        if causal:
            qi, ki, vi = _diagonal(qc, kc, vc)
            dqi, dki, dvi, _ = torch.ops.attn_cuda.bwd(
                dout.view(b * nc, h, n, d), qi, ki, vi, keep_c, None, out.view(b * nc, h, n, d),
                inv_l.view(b * nc, h, n).contiguous(), inv_l.new_empty(0), inv_l.new_empty(0), True, "poly", 1.0,
                None, *coefs, True, False)
            dq = dq + dqi.float().view(dq.shape)
            dk = dk + dki.float().view(dk.shape)
            dv = dv + dvi.float().view(dv.shape)
        pad = (0, 16)
        return (torch.nn.functional.pad(dq, pad).to(qc.dtype), torch.nn.functional.pad(dk, pad).to(kc.dtype),
                torch.nn.functional.pad(dv, pad).to(vc.dtype), None, None, None)


def _diagonal(qc, kc, vc):
    """The chunks as sequences of their own, (B * chunks, heads, LINEAR_CHUNK, D): the diagonal blocks."""
    d = qc.shape[-1] - 16
    return tuple(x.view(-1, *x.shape[2:])[..., :d] for x in (qc, kc, vc))


def _register_fakes() -> None:
    """Shapes and dtypes of the ops' outputs (they must match csrc/binding.cpp), for torch.compile."""

    @torch.library.register_fake("attn_cuda::fwd")
    def _fwd(q, k, v, mask, bias, causal, kind, scale, qk_norm, a0, a1, a2, normalize):
        b, h, i, d = q.shape
        f32 = dict(dtype=torch.float32, device=q.device)
        norms = qk_norm is not None
        return (q.new_empty((b, h, i, d)), torch.empty((b, h, _pad4(i)), **f32),
                torch.empty((b, h, _pad4(i)) if norms else (0,), **f32),
                torch.empty((b, k.shape[1], _pad4(k.shape[2])) if norms else (0,), **f32))

    @torch.library.register_fake("attn_cuda::linear")
    def _linear(ux, uw, rx, rg, upd_heads, rd_heads, causal, reverse, second, cu, cr, r1_tiles, want_r2):
        f32 = dict(dtype=torch.float32, device=rx.device)
        return (torch.empty(rx.shape if r1_tiles > 0 else (0,), **f32),
                torch.empty((*rx.shape[:-1], rx.shape[-1] - 16) if want_r2 else (0,), **f32))

    @torch.library.register_fake("attn_cuda::bwd")
    def _bwd(dout, q, k, v, mask, bias, out, stat, rq, rk, causal, kind, scale, qk_norm, a0, a1, a2,
             normalize, bias_grad):
        b, h, i, d = q.shape
        dbias = q.new_empty((b, h, i, k.shape[2]) if bias_grad else (0,))
        return q.new_empty((b, h, i, d)), k.new_empty(k.shape), v.new_empty(v.shape), dbias
