"""Loading the compiled ops: the extension that setup.py built (``attention_cuda._C``), else a JIT build
of ``csrc/`` on first use (``torch.utils.cpp_extension.load``, cached under a name made from a hash of the
sources, so an edit rebuilds and an unchanged tree reuses the build). The ops (``attn_cuda::fwd``, ``bwd``,
``decode``, the linear form's, RoPE's ``rope_split`` and ``rope_merge``) are defined in
csrc/binding/binding.cpp; here they also get fake implementations, so that torch.compile traces through them
without running them. What is compiled is build.py's list.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from . import _ops, build

HEAD_DIMS = build.HEAD_DIMS
DTYPES = tuple(getattr(torch, d.torch) for d in build.DTYPES)

_UNSET = object()
_reason = _UNSET      # None once the ops are loaded, else why they cannot be
# What the loaded extension says of itself, read once: plans and fakes then stay plain Python, which
# torch.compile traces through without calling an op.
_head_dims = {}       # dtype -> head dims compiled into the loaded extension
_sweep = {}           # dtype -> those of them the linear form's sweep is built for
_chunked = {}         # dtype -> those the chunked linear-form kernels run on this device
_decode = {}          # dtype -> those cosine's decode kernel takes
_image_bytes = {}     # (head dim, second order) -> bytes of a chunk's state image (csrc's chunked_image_bytes)


def _pad4(n):
    return (n + 3) // 4 * 4


def _arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST, else the current device's architecture (9.0a on Hopper: the wgmma kernels)."""
    major, minor = torch.cuda.get_device_capability()
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or f"{major}.{minor}{'a' if (major, minor) == (9, 0) else ''}"


def _jit_build() -> None:
    from torch.utils import cpp_extension

    arch = _arch_list()
    name = f"attention_cuda_{build.source_digest(arch)[:16]}"  # a hash of the sources: an edit rebuilds
    sources = build.sources(Path(cpp_extension._get_build_directory(name, verbose=False)) / "gen")
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in sources],
                           extra_include_paths=[str(d) for d in build.include_dirs()], extra_cflags=["-O3", *build.defines()],
                           extra_cuda_cflags=build.nvcc_flags(arch), is_python_module=False)
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
            _ops.load_library(prebuilt.origin)
        except OSError as e:
            problems.append(f"the prebuilt extension {prebuilt.origin} does not load ({e}); ")
    if not _ops.loaded():
        try:
            _jit_build()
        except Exception as e:  # noqa: BLE001 - any build failure becomes the reason, not a crash
            return (f"{''.join(problems)}the extension failed to build: {_first_error_line(e)}; for the full "
                    "log run `python -c 'import attention_cuda._extension as e; e._jit_build()'`, or install it "
                    "with `pip install --no-build-isolation -e .` on a machine with nvcc")
    for dt in DTYPES:
        _head_dims[dt], _sweep[dt] = _ops.head_dims(dt), _ops.sweep_head_dims(dt)
        _chunked[dt], _decode[dt] = _ops.chunked_head_dims(dt), _ops.decode_head_dims(dt)
        _image_bytes.update({(d, second): _ops.chunked_image_bytes(d, second)
                             for d in _chunked[dt] for second in (False, True)})
    _register_fakes()
    return None


# A constant once known: under torch.compile the first call (which loads the ops, or fails to) runs
# outside the trace instead of being traced through the loader.
@torch.compiler.assume_constant_result
def unavailable_reason() -> str | None:
    """None when the kernels are loaded and a CUDA device exists, else why not and how to fix it."""
    global _reason
    if _reason is _UNSET:
        _reason = _load()
    return _reason


def compiled_head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims this build compiled for dtype (the ops must be loaded)."""
    return _head_dims.get(dtype, ())


def sweep_head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims the linear form's sweep runs for dtype (the ops must be loaded)."""
    return _sweep.get(dtype, ())


def chunked_head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims the linear form's chunked (Hopper) kernels run for dtype here: none without the ops."""
    return () if unavailable_reason() is not None else _chunked.get(dtype, ())


def decode_head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims cosine's decode kernel runs for dtype (the ops must be loaded)."""
    return _decode.get(dtype, ())


def _register_fakes() -> None:
    """Shapes and dtypes of the ops' outputs (they must match csrc/binding/binding.cpp), for torch.compile."""

    @torch.library.register_fake("attn_cuda::fwd")
    def _fwd(q, k, v, mask, bias, causal, kind, scale, qk_norm, coef, normalize):
        b, h, i, d = q.shape
        f32 = dict(dtype=torch.float32, device=q.device)
        norms = qk_norm is not None
        return (q.new_empty((b, i, h, d)).transpose(1, 2), torch.empty((b, h, _pad4(i)), **f32),
                torch.empty((b, h, _pad4(i)) if norms else (0,), **f32),
                torch.empty((b, k.shape[1], _pad4(k.shape[2])) if norms else (0,), **f32),
                k.new_empty(k.shape if norms else (0,)))

    @torch.library.register_fake("attn_cuda::decode")
    def _decode(q, k, v, mask, scale, qk_norm, splits):
        return q.new_empty(q.shape)

    @torch.library.register_fake("attn_cuda::rope_split")
    def _rope_split(qkv, cos, sin, heads, kv_heads):
        b, t, width = qkv.shape
        d = width // (heads + 2 * kv_heads)
        return qkv.new_empty((b, heads, t, d)), qkv.new_empty((b, kv_heads, t, d))

    @torch.library.register_fake("attn_cuda::rope_merge")
    def _rope_merge(dq, dk, dv, cos, sin):
        b, h, t, d = dq.shape
        return dq.new_empty((b, t, (h + 2 * dk.shape[1]) * d))

    @torch.library.register_fake("attn_cuda::linear")
    def _linear(ux, uw, rx, rg, upd_heads, rd_heads, causal, reverse, second, cu, cr, r1_tiles, want_r2):
        f32 = dict(dtype=torch.float32, device=rx.device)
        return (torch.empty(rx.shape if r1_tiles > 0 else (0,), **f32),
                torch.empty((*rx.shape[:-1], rx.shape[-1] - 16) if want_r2 else (0,), **f32))

    @torch.library.register_fake("attn_cuda::lin_state")
    def _lin_state(x, w, heads, causal, reverse, second, coef, scale):
        b, chunks, hx, _, dp = x.shape
        return x.new_empty((b, hx // heads, chunks if causal else 1, _image_bytes[dp - 16, second]), dtype=torch.uint8)

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
        return y.new_empty((b, n, h, dp - 16), dtype=dtype).transpose(1, 2), y.new_empty((b, chunks, h, rows))

    @torch.library.register_fake("attn_cuda::lin_g")
    def _lin_g(dout, out, inv_l, mu, cmax, shift):
        b, h, _, d = dout.shape
        return dout.new_empty((*inv_l.shape, d + 16)), inv_l.new_empty((1,))

    @torch.library.register_fake("attn_cuda::lin_grad")
    def _lin_grad(acc, scale, diag, shift, n, dim, dtype):
        return acc.new_empty((acc.shape[0], acc.shape[2], n, dim), dtype=dtype)

    @torch.library.register_fake("attn_cuda::bwd")
    def _bwd(dout, q, k, v, mask, bias, out, stat, rq, rk, causal, kind, scale, qk_norm, coef, normalize,
             bias_grad):
        b, h, i, d = q.shape
        dbias = q.new_empty((b, h, i, k.shape[2]) if bias_grad else (0,))
        return q.new_empty((b, h, i, d)), k.new_empty(k.shape), v.new_empty(v.shape), dbias
