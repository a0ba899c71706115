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
import math
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
    if mask is not None:
        # Padded slots may hold garbage, and the tensor cores multiply a masked key's zero weight into its
        # K and V rows (0 * NaN = NaN): zeroed rows keep it out of every product, forward and backward.
        # A copy of k and v, paid only by calls with a mask.
        keep = mask[:, None, :, None]
        k, v = torch.where(keep, k, 0), torch.where(keep, v, 0)
    if bias is not None:
        bias = bias.to(dtype)
    return _Attention.apply(q, k, v, mask, bias, causal, policy.kind, policy.scale, policy.qk_norm,
                            policy.a0, policy.a1, policy.a2, policy.normalize_rows)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, causal, kind, scale, qk_norm, a0, a1, a2, normalize):
        out, stat, rq, rk, kn = torch.ops.attn_cuda.fwd(q, k, v, mask, bias, causal, kind, scale, qk_norm,
                                                        a0, a1, a2, normalize)
        # Under the qk norm the kernels read the unit keys kn (k / |k| in k's dtype), the backward too.
        ctx.save_for_backward(q, kn if qk_norm is not None else k, v, mask, bias, out, stat, rq, rk)
        ctx.args = (causal, kind, scale, qk_norm, a0, a1, a2, normalize)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, bias, out, stat, rq, rk = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[4]
        dq, dk, dv, dbias = torch.ops.attn_cuda.bwd(dout, q, k, v, mask, bias, out, stat, rq, rk, *ctx.args,
                                                    bias_grad)
        return dq, dk, dv, None, dbias if bias_grad else None, *([None] * 8)


LINEAR_CHUNK = 128  # rows per chunk of the sweep (linear.cuh): kLinChunk in csrc/params.h
# Rows per chunk of the Hopper chunked form (lin_sm90.cuh; 0: always the sweep). Longer chunks cost more
# diagonal blocks on the tiled kernel (N L / 2 pairs) and less state (an image of O(D^3) per chunk):
# bench/NOTES.md run 22 measured L = 512 and 1024 at b4 h8 N16384 d64.
CHUNKED_ROWS = 1024


def _chunked_form(dtype, d) -> bool:
    """Whether the moments run on the chunked kernels, CHUNKED_ROWS rows per chunk (sm_90a builds on an
    H100/H200, fp16 and bf16, d64 and d128), rather than on the sweep, LINEAR_CHUNK rows per chunk."""
    return bool(CHUNKED_ROWS) and d in torch.ops.attn_cuda.chunked_head_dims(dtype)


def _moments(chunked, ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, r1_cols, state=None):
    """R1 = psi(rx) S (its first r1_cols columns) and, given rg, R2 = d psi(rx) . S rg, with S the moments
    of phi(ux) uw^T over the visible chunks (before each chunk; after it with reverse; all when not causal).
    cu and cr: the coefficients on ux's and rx's side. On the sweep, or (chunked) on the chunked kernels:
    lin_state writes S per chunk, lin_read reads every chunk at once. Returns (R1, R2, state), state =
    (S's image, its scale) on the chunked kernels (None on the sweep): a later call with the same ux, uw
    and flags may pass it back rather than have it computed again."""
    ops = torch.ops.attn_cuda
    if not chunked:
        r1_tiles = -(-r1_cols // 16)
        return (*ops.linear(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, r1_tiles, rg is not None), None)
    if state is None:
        coef = [a * b for a, b in zip(cu, cr)]
        scale = _image_scale(ux, uw, upd, coef)
        state = (ops.lin_state(ux, uw, upd, causal, reverse, second, coef, scale), scale)
    return (*ops.lin_read(rx, rg, state[0], rd, second, r1_cols, state[1]), state)


def _image_scale(ux, uw, upd, coef):
    """The power of two the chunked kernels store S at (one fp32 on the device): fp16 images hold S below
    2^14 by a bound on |S| (rows x max |phi| x max |w|); bf16 has fp32's range and takes 1."""
    if ux.dtype != torch.float16:
        return torch.ones(1, device=ux.device)
    rows = ux.shape[1] * ux.shape[3] * upd
    bound = (ux.abs().amax().float().clamp_min(1.0) ** 2 * uw.abs().amax().float()
             * (rows * max(abs(coef[0]), abs(coef[1]), 2 * abs(coef[2]))))
    return torch.exp2(torch.floor(torch.log2(2.0 ** 14 / bound.clamp_min(1e-30)))).reshape(1)


def linear_unsupported_reason(q) -> str | None:
    """None if the linear-form kernel takes q's dtype and head dim, else why."""
    dtype = _run_dtype(q)
    if dtype not in (torch.float16, torch.bfloat16):
        return f"q: the linear-form kernels take float16 and bfloat16, got {dtype} (use form='quadratic')"
    return None


# Key counts from which the linear form's kernels beat the quadratic ones, per head dim: the smallest
# measured power of two where they were faster (p = 2, causal forward + backward, bf16, b4 h8, H200;
# bench/results_fastmax-linear.json, bench/runs/2026-11-21_s8_fastmax-crossover.json). Near-ties (within
# 3%: d64 at 16384, d96 at 32768) stay quadratic, which needs a quarter of the memory. p = 1 is not measured.
LINEAR_FROM_KEYS = {16: 8192, 32: 8192, 64: 32768, 96: 65536, 128: 65536}
# The same for the chunked kernels, where _chunked_form holds (bench/runs/2026-11-22_s18_fastmax.txt):
# d64 from 16384 (7.3 vs 10.2 ms; 3.7 vs 2.6 at 8192), d128 from 32768 (62.9 vs 80.6; 31.4 vs 20.1 at 16384).
CHUNKED_FROM_KEYS = {64: 16384, 128: 32768}


def linear_from_keys(d, dtype) -> float:
    """The key count from which fastmax's linear form beats the quadratic one on these kernels (p = 2)."""
    if unavailable_reason() is None and d in CHUNKED_FROM_KEYS and _chunked_form(dtype, d):
        return CHUNKED_FROM_KEYS[d]
    return LINEAR_FROM_KEYS.get(d, math.inf)


def linear_attention(q, k, v, mask, causal: bool, policy: ScorePolicy) -> torch.Tensor:
    """Fastmax in its linear form on the kernels: moments carried over chunks of rows (fp32), each
    chunk's own causal block on the tiled quadratic kernel. Same contract as ``attention``.

    The moments cost O(D^3) per token (p = 2) and no N: it wins over the quadratic form at long N.
    The temperature rides in the coefficients (f(s x) = a0 + a1 s x + a2 s^2 x^2); normalisation, when
    asked for, is differentiable PyTorch in front of the op.
    """
    from .reference import scale_rows

    dtype = _run_dtype(q)
    chunked = _chunked_form(dtype, q.shape[-1])
    chunk = CHUNKED_ROWS if chunked else LINEAR_CHUNK
    if k.shape[2] <= chunk:
        # All keys fit in one chunk: the tiled kernel does the whole call as one block, at I*J*D, below
        # the moments' cost, and rounded as the quadratic form. It also matters for precision: with one
        # visible key the exact dq, dk are 0 and dv is dO, which the tiled kernels (and PyTorch) hit
        # exactly (P = 1), so the FA rule leaves only its atol; moments rounded to fp16/bf16 miss by ulps.
        return attention(q, k, v, mask, None, causal, policy)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if policy.qk_norm is not None:
        q, k = (scale_rows(x.float(), policy.qk_norm).to(dtype) for x in (q, k))
    # Causal calls align bottom-right: query t sits at key position t + j - i. In chunk rows, queries
    # start at j - i when there are more keys, and the first i - j queries see placeholder keys when
    # there are fewer (masked, so those queries see none).
    front = k.shape[2] - q.shape[2] if causal else 0
    mask = None if mask is None else mask.contiguous()
    return _LinearAttention.apply(q, k, v, mask, causal, (policy.a0, policy.a1, policy.a2), policy.scale,
                                  max(front, 0), max(-front, 0), chunk, chunked)


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
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, coefs, scale, shift_q, shift_k, chunk, chunked):
        ops = torch.ops.attn_cuda
        b, h, i, d = q.shape
        hkv, j = k.shape[1], k.shape[2]
        n_pad = -(-max(i + shift_q, j + shift_k) // chunk) * chunk
        qc = ops.lin_rows(q, None, None, shift_q, n_pad, d + 16, chunk)
        # Masked keys are zero rows in k too, not only in [v, 1]: the dk/dv moments read every key's
        # features, and a zero row reads nothing (dv = 0 there, as the mask says).
        kc = ops.lin_rows(k, mask, None, shift_k, n_pad, d + 16, chunk)
        # The backward's dq and dk sum phi(k_s) (dO . v_s - dO . O) / l over keys, as the moments of [v, 1]
        # read against g = [dO, -dO . O] / l: two sums, each rounded (g and the moments enter the tensor
        # cores in fp16/bf16), that cancel down to the spread of v. Values with a common offset (real
        # activations have one) make both parts large and the rounding of each shows. The weights sum
        # to 1, so any constant mu may come off both: v_s - mu and O - mu, with mu the mean value of the
        # visible keys per (batch, kv head). The forward's moments take the same v - mu, so that the
        # backward can read their state again; the diagonal blocks keep v as given.
        mu = _value_mean(v, mask)
        mu_h = mu.repeat_interleave(h // hkv, dim=1).contiguous()
        vs = ops.lin_rows(v, mask, mu, shift_k, n_pad, d + 16, chunk)
        cr = [coefs[0], coefs[1] * scale, coefs[2] * scale * scale]  # the query side's, temperature included
        y, _, state = _moments(chunked, kc, vs, qc, None, 1, h // hkv, causal, False, coefs[2] != 0, [1.0, 1.0, 1.0],
                               cr, d + 1)
        # The backward's dq reads this state again. Kept where its image is at most twice the rows saved
        # anyway (d64: 504 bytes per key and head, against 480), else computed again there (d128: 2940
        # against 864).
        rows_bytes = sum(x.numel() * x.element_size() for x in (qc, kc, vs))
        if state is not None and state[0].numel() > 2 * rows_bytes:
            state = None
        vc, keep_c, diag = None, None, (None, None)
        if causal:
            vc = ops.lin_rows(v, mask, None, shift_k, n_pad, d, chunk)
            keep = torch.ones(b, j, dtype=torch.bool, device=q.device) if mask is None else mask
            keep_c = torch.nn.functional.pad(keep, (shift_k, n_pad - j - shift_k)).view(-1, chunk)
            diag = ops.fwd(*_diagonal(qc, kc, vc), keep_c, None, True, "poly", scale, None, *coefs, True)[:2]
        out, inv_l = ops.lin_out(y, *diag, mu_h, shift_q, i, q.dtype)
        ctx.save_for_backward(mask, qc, kc, vc, vs, keep_c, out, inv_l, mu_h, *(state or (None, None)))
        ctx.args = (causal, coefs, scale, cr, shift_q, shift_k, j, chunked)
        return out

    @staticmethod
    def backward(ctx, dout):
        ops = torch.ops.attn_cuda
        mask, qc, kc, vc, vs, keep_c, out, inv_l, mu_h, *state = ctx.saved_tensors
        causal, coefs, scale, cr, shift_q, shift_k, j, chunked = ctx.args
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
        g, gscale = ops.lin_g(dout, out, inv_l, mu_h, cmax, shift_q)
        state = None if state[0] is None else tuple(state)
        # [1] and [:2]: an image made here is freed once read (holding dq's through dk's costs 1.5 GiB at d128).
        dq = _moments(chunked, kc, vs, qc, g, 1, group, causal, False, second, [1.0, 1.0, 1.0], cr, 0, state)[1]
        dv, dk = _moments(chunked, qc, g, kc, vs, group, 1, causal, True, second, cr, [1.0, 1.0, 1.0], d)[:2]
        diag = (None, None, None)
        if causal:
            rows = (b * n_pad // chunk, h, chunk, d)
            dout_c, out_c = (ops.lin_rows(x, None, None, shift_q, n_pad, d, chunk).view(rows) for x in (dout, out))
            diag = ops.bwd(dout_c, *_diagonal(qc, kc, vc), keep_c, None, out_c, inv_l.view(rows[:3]),
                           inv_l.new_empty(0), inv_l.new_empty(0), True, "poly", scale, None, *coefs, True,
                           False)[:3]
        return (ops.lin_grad(dq, gscale, diag[0], shift_q, i, d, out.dtype),
                ops.lin_grad(dk, gscale, diag[1], shift_k, j, d, out.dtype),
                ops.lin_grad(dv, gscale, diag[2], shift_k, j, d, out.dtype), *([None] * 8))


def _value_mean(v, mask):
    """The mean value of the keys the mask keeps, per (batch, kv head): fp32 (B, Hkv, D). Any constant
    would do (see _LinearAttention), so non-finite entries are left out rather than let one garbage value
    reach every row through it; masked ones are selected away, not multiplied by 0 (0 * NaN is NaN)."""
    keep = torch.isfinite(v)
    if mask is not None:
        keep = keep & mask[:, None, :, None]
    return torch.where(keep, v, 0).sum(2, dtype=torch.float32) / keep.sum(2).clamp_min(1)


def _diagonal(qc, kc, vc):
    """The chunks as sequences of their own, (B * chunks, heads, L, D): the diagonal blocks (vc may be
    D wide already)."""
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
                torch.empty((b, k.shape[1], _pad4(k.shape[2])) if norms else (0,), **f32),
                k.new_empty(k.shape if norms else (0,)))

    @torch.library.register_fake("attn_cuda::linear")
    def _linear(ux, uw, rx, rg, upd_heads, rd_heads, causal, reverse, second, cu, cr, r1_tiles, want_r2):
        f32 = dict(dtype=torch.float32, device=rx.device)
        return (torch.empty(rx.shape if r1_tiles > 0 else (0,), **f32),
                torch.empty((*rx.shape[:-1], rx.shape[-1] - 16) if want_r2 else (0,), **f32))

    @torch.library.register_fake("attn_cuda::lin_state")
    def _lin_state(x, w, heads, causal, reverse, second, coef, scale):
        b, chunks, hx, _, dp = x.shape
        nb = (dp - 16) // 16
        groups = nb + 1 + (16 * nb * (nb + 1) // 2 if second else 0)
        image_bytes = (groups + 3) // 4 * ((dp - 8 + 31) // 32) * 64 * 64  # chunked_image_bytes in binding.cpp
        return x.new_empty((b, hx // heads, chunks if causal else 1, image_bytes), dtype=torch.uint8)

    @torch.library.register_fake("attn_cuda::lin_read")
    def _lin_read(x, g, image, heads, second, r1_cols, scale):
        f32 = dict(dtype=torch.float32, device=x.device)
        return (torch.empty(x.shape if r1_cols > 0 else (0,), **f32),
                torch.empty((*x.shape[:-1], x.shape[-1] - 16) if g is not None else (0,), **f32))

    @torch.library.register_fake("attn_cuda::lin_rows")
    def _lin_rows(x, mask, mu, shift, n_pad, width, chunk):
        b, h = x.shape[:2]
        return x.new_empty((b, n_pad // chunk, h, chunk, width))

    @torch.library.register_fake("attn_cuda::lin_out")
    def _lin_out(y, o, stat, mu, shift, n, dtype):
        b, chunks, h, rows, dp = y.shape
        return y.new_empty((b, h, n, dp - 16), dtype=dtype), y.new_empty((b, chunks, h, rows))

    @torch.library.register_fake("attn_cuda::lin_g")
    def _lin_g(dout, out, inv_l, mu, cmax, shift):
        b, h, _, d = dout.shape
        return dout.new_empty((*inv_l.shape, d + 16)), inv_l.new_empty((1,))

    @torch.library.register_fake("attn_cuda::lin_grad")
    def _lin_grad(acc, scale, diag, shift, n, dim, dtype):
        return acc.new_empty((acc.shape[0], acc.shape[2], n, dim), dtype=dtype)

    @torch.library.register_fake("attn_cuda::bwd")
    def _bwd(dout, q, k, v, mask, bias, out, stat, rq, rk, causal, kind, scale, qk_norm, a0, a1, a2,
             normalize, bias_grad):
        b, h, i, d = q.shape
        dbias = q.new_empty((b, h, i, k.shape[2]) if bias_grad else (0,))
        return q.new_empty((b, h, i, d)), k.new_empty(k.shape), v.new_empty(v.shape), dbias
