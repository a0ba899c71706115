"""The compiled ops (csrc/binding/binding.cpp), as typed Python functions: the one module that calls
``torch.ops.attn_cuda``. _extension.py loads the library and gives the ops their fake implementations;
_kernels.py builds the autograd Functions from these. The namespace is looked up at every call, so stand-ins
put there (tests/kernel_standins.py) take the place of the kernels.

The tiled forward leaves a statistic per query row that its backward takes back, in one of two encodings
the score and dtype decide (``stat_is_log``): RowStat is the one place that reads or writes it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .score import ScorePolicy

LOG2E = math.log2(math.e)


def _lib():
    return torch.ops.attn_cuda


def load_library(path: str) -> None:
    torch.ops.load_library(path)


def loaded() -> bool:
    """Whether the ops are registered (the prebuilt library loaded, or a JIT build)."""
    return hasattr(_lib(), "fwd")


def head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims the loaded library compiled the tiled kernels for, for dtype."""
    return tuple(_lib().head_dims(dtype))


def sweep_head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims the linear form's sweep runs for dtype."""
    return tuple(_lib().sweep_head_dims(dtype))


def chunked_head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims the linear form's chunked (Hopper) kernels run for dtype on this device."""
    return tuple(_lib().chunked_head_dims(dtype))


def decode_head_dims(dtype: torch.dtype) -> tuple[int, ...]:
    """The head dims cosine's decode kernel takes for dtype."""
    return tuple(_lib().decode_head_dims(dtype))


def chunked_image_bytes(head_dim: int, second: bool) -> int:
    """Bytes of one chunk's state image on the chunked kernels (csrc's chunked_image_bytes)."""
    return _lib().chunked_image_bytes(head_dim, second)


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


class RowStat(NamedTuple):
    """Each query row's statistic, as the tiled forward writes it and the backward takes it: raw (B, H, rows
    padded to 4), fp32. Under a fixed shift (a score whose logits are bounded in advance: cosine of unit rows
    shifts by its scale) it is 1 / l, l the sum of the row's shifted weights; under a running max it is log2
    of the unshifted sum of exp(x). A row that sees no key has l = 0: 1 / l reads 0, the log +-inf. The
    encoding is asked of the library only when the statistic is read (never on the training path, which
    hands it back as it is)."""

    raw: torch.Tensor
    rows: int
    policy: ScorePolicy
    dtype: torch.dtype  # the inputs' dtype of the call that wrote it
    has_bias: bool = False

    def is_log(self) -> bool:
        return is_log(self.policy, self.dtype, self.has_bias)

    def sums(self, log2_shift=0.0) -> torch.Tensor:
        """l per row (B, H, rows), 0 for a row that sees no key. Under a fixed shift the kernels' own (the
        same for every call of the score, so sums of calls add as they are; log2_shift is not applied);
        under a running max the unshifted sum over 2^log2_shift (a float, or a tensor per row), which the
        caller picks to keep it finite."""
        if self.is_log():
            return torch.exp2(self._log2_sums() - log2_shift)
        return self._fixed_sums()

    def part_sums(self, dim: int = 0) -> torch.Tensor:
        """sums() of rows whose keys were split into parts along ``dim`` (a call's parts stacked), on one scale
        across the parts: under a running max each row's over its largest part's."""
        if not self.is_log():
            return self._fixed_sums()
        log2 = self._log2_sums()
        return torch.exp2(log2 - log2.amax(dim).clamp_min(torch.finfo(torch.float32).min))

    def _fixed_sums(self) -> torch.Tensor:
        stat = self.raw[..., :self.rows]
        return torch.where(stat > 0, stat.reciprocal(), 0)

    def _log2_sums(self) -> torch.Tensor:
        stat = self.raw[..., :self.rows]
        return torch.where(torch.isinf(stat), float("-inf"), stat)

    @classmethod
    def of_sums(cls, sums: torch.Tensor, policy: ScorePolicy, dtype: torch.dtype, log2_shift=0.0) -> RowStat:
        """The statistic of rows whose weights sum to ``sums`` (B, H, rows), sums as ``sums(log2_shift)`` reads
        them: what the backward takes for rows whose output and l were put together elsewhere (the blocks of a
        ring, say)."""
        b, h, rows = sums.shape
        stat = cls(sums.new_zeros(b, h, _pad4(rows), dtype=torch.float32), rows, policy, dtype)
        stat.raw[..., :rows] = torch.log2(sums) + log2_shift if stat.is_log() else sums.reciprocal()
        return stat


def is_log(policy: ScorePolicy, dtype: torch.dtype, has_bias: bool = False) -> bool:
    """Whether the tiled forward keeps a running row max (its RowStat is a log2 sum) for this score, inputs'
    dtype and bias, rather than a fixed shift."""
    return _lib().stat_is_log(policy.kind, policy.scale, policy.qk_norm, policy.coef, policy.normalize_rows,
                              has_bias, dtype)


class Forward(NamedTuple):
    out: torch.Tensor   # (B, H, I, D) over (B, I, H, D) memory
    stat: RowStat
    rq: torch.Tensor    # under qk_norm, each q row's reciprocal norm (else empty)
    rk: torch.Tensor    # and each k row's
    kn: torch.Tensor    # under qk_norm, the unit keys in k's dtype, which the backward reads (else empty)


def fwd(q, k, v, *, mask, bias, causal: bool, policy: ScorePolicy) -> Forward:
    """The tiled forward: q (B, H, I, D), k, v (B, Hkv, J, D) in one dtype, mask None or bool (B, J) (True =
    keep; masked rows of k and v zeroed by the caller), bias None or (B, H, I, J)."""
    out, stat, rq, rk, kn = _lib().fwd(q, k, v, mask, bias, causal, policy.kind, policy.scale, policy.qk_norm,
                                       policy.coef, policy.normalize_rows)
    return Forward(out, RowStat(stat, q.shape[2], policy, q.dtype, bias is not None), rq, rk, kn)


def bwd(dout, q, k, v, *, mask, bias, out, stat: RowStat, rq=None, rk=None, causal: bool, bias_grad: bool):
    """(dq, dk, dv, dbias) of the tiled forward's call, given its output and statistic: k the unit keys
    under qk_norm (Forward.kn); dbias empty unless bias_grad. Given the whole row's out and statistic, the
    gradients of one block of its keys are that block's exact share."""
    policy, empty = stat.policy, stat.raw.new_empty(0)
    return _lib().bwd(dout, q, k, v, mask, bias, out, stat.raw, empty if rq is None else rq,
                      empty if rk is None else rk, causal, policy.kind, policy.scale, policy.qk_norm, policy.coef,
                      policy.normalize_rows, bias_grad)


def decode(q, k, v, mask, policy: ScorePolicy, splits: int = 0) -> torch.Tensor:
    """Cosine's decode kernel: q (B, H, 1, D) over the keys the mask keeps, forward only; splits 0: as many
    parts of the keys as fill the GPU."""
    return _lib().decode(q, k, v, mask, policy.scale, policy.qk_norm, splits)


def rope_split(qkv, cos, sin, heads: int, kv_heads: int):
    """qkv (B, T, (heads + 2 kv_heads) D) -> q (B, heads, T, D), k (B, kv_heads, T, D), rotated."""
    return _lib().rope_split(qkv, cos, sin, heads, kv_heads)


def rope_merge(dq, dk, dv, cos, sin):
    """The fused projection's gradient (B, T, (H + 2 Hkv) D) from those of rotated q, k and of v."""
    return _lib().rope_merge(dq, dk, dv, cos, sin)


# The linear form's ops (csrc/linear), in chunk-major rows (B, chunks, H, L, W) that lin_rows writes.

def lin_rows(x, mask, mu, shift: int, n_pad: int, width: int, chunk: int):
    """Natural rows x (B, H, N, D) to chunk-major rows [x - mu, 1, 0 ...] width wide, starting ``shift`` rows
    in, n_pad rows in all; rows the mask hides are zeros."""
    return _lib().lin_rows(x, mask, mu, shift, n_pad, width, chunk)


def linear(ux, uw, rx, rg, upd_heads: int, rd_heads: int, causal: bool, reverse: bool, second: bool, cu, cr,
           r1_tiles: int, want_r2: bool):
    """The sweep: the moments of phi(ux) uw^T carried over the chunks and read by rx (R1) and rg (R2)."""
    return _lib().linear(ux, uw, rx, rg, upd_heads, rd_heads, causal, reverse, second, cu, cr, r1_tiles, want_r2)


def lin_state(x, w, heads: int, causal: bool, reverse: bool, second: bool, coef, scale):
    """The chunked kernels' state images of phi(x) w^T per chunk (one without causal), stored at ``scale``."""
    return _lib().lin_state(x, w, heads, causal, reverse, second, coef, scale)


def lin_read(x, g, image, heads: int, second: bool, r1_cols: int, scale):
    """R1 = psi(x) S and, given g, R2, read from lin_state's images (stored at ``scale``)."""
    return _lib().lin_read(x, g, image, heads, second, r1_cols, scale)


def lin_out(y, o, stat, mu, shift: int, n: int, dtype: torch.dtype):
    """(out, 1 / l) in natural rows from the moments' y = [num, l] and the diagonal blocks' (o, their RowStat's
    raw 1 / l), mu added back."""
    return _lib().lin_out(y, o, stat, mu, shift, n, dtype)


def lin_g(dout, out, inv_l, mu, cmax, shift: int):
    """(g = [dO, -dO . (O - mu)] / l in chunk-major rows over a power of two, that power)."""
    return _lib().lin_g(dout, out, inv_l, mu, cmax, shift)


def lin_grad(acc, scale, diag, shift: int, n: int, dim: int, dtype: torch.dtype):
    """A gradient in natural rows from the moments' fp32 sums (over ``scale``) and the diagonal blocks'."""
    return _lib().lin_grad(acc, scale, diag, shift, n, dim, dtype)
