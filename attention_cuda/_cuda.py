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


def _jit_build() -> None:
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for f in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(f.relative_to(CSRC).as_posix().encode() + b"\0" + f.read_bytes())
    sources = [CSRC / "binding.cpp", CSRC / "aux.cu", *sorted((CSRC / "inst").glob("*.cu"))]
    cpp_extension.load(name=f"attention_cuda_{digest.hexdigest()[:16]}", sources=[str(s) for s in sources],
                       extra_cflags=["-O3"], extra_cuda_cflags=(CSRC / "nvcc_flags.txt").read_text().split(),
                       is_python_module=False)


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

    @torch.library.register_fake("attn_cuda::bwd")
    def _bwd(dout, q, k, v, mask, bias, out, stat, rq, rk, causal, kind, scale, qk_norm, a0, a1, a2,
             normalize, bias_grad):
        b, h, i, d = q.shape
        dbias = q.new_empty((b, h, i, k.shape[2]) if bias_grad else (0,))
        return q.new_empty((b, h, i, d)), k.new_empty(k.shape), v.new_empty(v.shape), dbias
