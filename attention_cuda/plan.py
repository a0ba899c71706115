"""Which code runs an attention call, and why: resolved once per call, then executed by functional.py.

A Plan names the backend (our CUDA kernels or the PyTorch reference), fastmax's form (quadratic or
linear) and, on the kernels, the path that carries the linear form's moments, with the reason for each
choice. The measured choices come from one table, TUNING, each entry with the file that measured it;
a caller that wants other values (a probe, a test) passes its own Tuning rather than patching globals.

The layers, top down: functional.py (validation, canonical shapes, this plan) -> _kernels.py (the
autograd Functions over the ops) -> _ops.py (the compiled ops as typed functions) -> csrc/; _extension.py
loads the compiled ops.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from . import _extension, build
from .crossovers import FROM_KEYS, SOURCES
from .reference import score_dtype as score_dtype_of_reference
from .score import ScorePolicy

BACKENDS = ("auto", "torch", "cuda")
FORMS = ("auto", "quadratic", "linear")
# The kernels compute logits and weights in fp32 whatever the inputs (fp32 accumulators, fp32 scores).
KERNEL_SCORE_DTYPE = torch.float32
LINEAR_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# Splitting a forward-only call's keys (split_keys): about this many blocks per SM, each over at least
# SPLIT_MIN_KEYS keys (a part's fixed cost: its launch share, Q tile and merge, against streaming K and V);
# query blocks counted in tiles of QUERY_TILE rows (the forward kernels' 128 to 192).
SPLIT_BLOCKS_PER_SM = 2
SPLIT_MIN_KEYS = 512
QUERY_TILE = 128
# Cosine's decode kernel (_kernels.decode) weighs each key by exp(x - bound) in fp32, never rounded to the inputs'
# dtype: the logits of unit rows (l2norm_qk, or the caller's promise without it, as check_range takes it) lie
# within bound = |scale| of zero, so it keeps no running max while the smallest weight, e^(-2 bound), is a
# normal fp32 number (csrc/binding's attn_decode checks the same).
DECODE_MAX_BOUND = -math.log(torch.finfo(torch.float32).tiny) / 2


@dataclass(frozen=True)
class Tuning:
    """Choices measured on the kernels. ``from_keys[path][direction]`` maps a head dim to the key count from
    which fastmax's linear form (p = 2) beat the tiled quadratic form on that moments path ("sweep",
    "chunked"), for forward-only calls ("fwd") and for training ("fwd+bwd"): the generated
    crossovers.FROM_KEYS. ``chunked_rows`` is the chunk of the Hopper chunked kernels (0: always the
    sweep). The sweep's chunk is no choice: its kernels are compiled for build.LINEAR_CHUNK rows."""

    from_keys: dict = field(default_factory=lambda: FROM_KEYS)
    chunked_rows: int = 1024


TUNING = Tuning()
# Where each value of TUNING was measured (p = 2, causal, bf16, b4 h8, H200).
PROVENANCE = {
    "from_keys": "scripts/crossovers.py from " + ", ".join(f for files in SOURCES.values() for f in files),
    # Longer chunks cost more diagonal blocks on the tiled kernel (N L / 2 pairs), shorter ones more
    # state (an image of O(D^3) per chunk).
    "chunked_rows": "python scripts/probes/chunk_rows.py -> bench/runs/2026-11-22_s17_chunk-rows.txt "
                    "(bench/notes/run-22.md)",
}


@dataclass(frozen=True)
class Plan:
    """How one call runs. backend: "cuda" or "torch"; form: "quadratic" or "linear"; path: "reference",
    "tiled" (the quadratic kernels), "split" (the tiled forward over parts of the keys, merged: see
    key_splits), "decode" (cosine's decode kernel: one query row, forward only; see decodes), "sweep" or
    "chunked" (the linear form's moments on the kernels); chunk: rows per chunk of the linear form; splits:
    parts of the keys on the split path (else 1: the decode kernel splits its keys itself, into as many
    parts as fill the GPU); run_dtype: what the inputs are cast to (autocast's dtype on the kernels, as for
    SDPA); score_dtype: what logits and weights are computed in; why: a line per decision, each a tuple of
    parts that str() joins. Joined only when read: under torch.compile with dynamic shapes a key count is
    symbolic, and tracing cannot format it into a string."""

    backend: str
    form: str
    path: str
    chunk: int | None
    run_dtype: torch.dtype
    score_dtype: torch.dtype
    why: tuple[tuple, ...]
    splits: int = 1

    def __str__(self) -> str:
        return f"{self.backend}/{self.form}/{self.path}: " + "; ".join("".join(map(str, line)) for line in self.why)


def run_dtype(dtype: torch.dtype, on_kernels: bool) -> torch.dtype:
    """The dtype a call runs in: on the kernels, autocast's when it is on (as for SDPA), else the inputs'."""
    if on_kernels and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return dtype


def _extension_reason(device: torch.device, dtype: torch.dtype, arg: str) -> str | None:
    """Why the compiled ops cannot take tensors of this device and dtype (named ``arg`` in the message), if so."""
    reason = _extension.unavailable_reason()
    if reason is not None:
        return reason
    if device.type != "cuda":
        return f"{arg}: inputs are on {device}, the kernels run on CUDA devices"
    if dtype not in _extension.DTYPES:
        return f"{arg}: dtype {dtype} is not supported by the kernels (float16, bfloat16, float32)"
    return None


def kernels_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the kernels take inputs of this device, dtype and head dim, else why not."""
    dtype = run_dtype(dtype, True)
    reason = _extension_reason(device, dtype, "q")
    if reason is not None:
        return reason
    if head_dim not in _extension.HEAD_DIMS:
        return f"q: head dim {head_dim} is not supported by the kernels (one of {_extension.HEAD_DIMS})"
    compiled = _extension.compiled_head_dims(dtype)
    if head_dim not in compiled:
        return (f"q: head dim {head_dim} is not compiled for {dtype} in this build (compiled: {compiled}); "
                "rebuild without ATTN_HEADDIMS / ATTN_DTYPES")
    return None


def reference_reason(backend: str, kernels_cannot) -> str | None:
    """Why a call with a valid ``backend`` runs on the PyTorch reference, or None where it runs on our kernels:
    "torch" asks for the reference; "auto" takes it where ``kernels_cannot()`` gives a reason the kernels cannot
    run the call; "cuda" raises NotImplementedError with that reason instead."""
    reason = "backend='torch' asked for" if backend == "torch" else kernels_cannot()
    if reason is not None and backend == "cuda":
        raise NotImplementedError(f'backend="cuda": {reason}')
    return reason


def rope_kernels_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when RoPE's kernels (attn_cuda::rope_split, rope_merge) take rows of this device, dtype and head
    dim, else why not."""
    reason = _extension_reason(device, dtype, "qkv")
    if reason is not None:
        return reason
    if head_dim % 16:
        return f"qkv: head dim {head_dim} is not a multiple of 16, as RoPE's kernels take it"
    return None


def linear_kernels_reason(dtype: torch.dtype, head_dim: int, tuning: Tuning) -> str | None:
    """None when the linear form's kernels run q of this dtype and head dim, on the path chunked_path picks, else
    why not (the kernels must run the call: kernels_reason)."""
    dtype = run_dtype(dtype, True)
    if dtype not in LINEAR_KERNEL_DTYPES:
        return f"q: the linear-form kernels take float16 and bfloat16, got {dtype} (use form='quadratic')"
    if not chunked_path(dtype, head_dim, tuning) and head_dim not in _extension.sweep_head_dims(dtype):
        return (f"q: no linear-form kernel runs head dim {head_dim} here (the sweep's head dims: "
                f"{_extension.sweep_head_dims(dtype)}, the chunked kernels': {_extension.chunked_head_dims(dtype)}; "
                "use form='quadratic')")
    return None


def chunked_path(dtype: torch.dtype, head_dim: int, tuning: Tuning) -> bool:
    """Whether the linear form's moments run on the chunked kernels (sm_90a builds on Hopper, fp16 and
    bf16, d64 and d128) rather than on the sweep."""
    return bool(tuning.chunked_rows) and head_dim in _extension.chunked_head_dims(run_dtype(dtype, True))


def exchange_reason(dtype: torch.dtype, head_dim: int, tuning: Tuning) -> str | None:
    """Why the kernels cannot run fastmax's linear form on one rank's slice of a sequence split over a context
    group (attention_cuda.context_parallel), or None: the ranks trade the chunked kernels' state images."""
    if chunked_path(dtype, head_dim, tuning):
        return None
    return (f"the ranks trade the chunked kernels' state images, which an sm_90a build runs on Hopper with "
            f"tuning.chunked_rows > 0 (here at head dims {_extension.chunked_head_dims(run_dtype(dtype, True))}); "
            f"here (head dim {head_dim}, chunked_rows {tuning.chunked_rows}) the linear form would run on the sweep, "
            "whose state never leaves the kernel")


def fastmax_features(head_dim: int, p: int) -> int:
    """F, the feature count of fastmax's linear form: 1 + D (+ D(D+1)/2 for p = 2). The quadratic form
    costs ~4·J·D per query and the linear one ~4·F·(D+1) per token, so linear needs fewer FLOPs once the
    key count J exceeds about F."""
    return 1 + head_dim + (head_dim * (head_dim + 1) // 2 if p == 2 else 0)


def linear_from_keys(head_dim: int, p: int, dtype: torch.dtype, on_kernels: bool,
                     tuning: Tuning = TUNING, forward_only: bool = False) -> tuple[float, str]:
    """(the key count from which form="auto" takes the linear form, why): on the kernels the crossover
    measured for the path that would carry it and the call's direction (a forward-only call, such as an
    evaluation or a prefill, skips the backward that the linear form wins most on; p = 2 only: p = 1 is not
    measured, so never), on the reference the FLOPs crossover."""
    if not on_kernels:
        return fastmax_features(head_dim, p) + 1, "the reference's FLOPs crossover (keys > features)"
    if p != 2:
        return math.inf, "p = 1's crossover on the kernels is not measured"
    path = "chunked" if chunked_path(dtype, head_dim, tuning) else "sweep"
    direction = "fwd" if forward_only else "fwd+bwd"
    return (tuning.from_keys[path][direction].get(head_dim, math.inf),
            f"the {path} kernels' measured {direction} crossover ({PROVENANCE['from_keys']})")


def key_splits(sms: int, query_blocks: int, keys: int) -> int:
    """How many parts a forward-only call's keys are split into, flash-decoding style. A decode step (one
    query per head) would stream all its keys through a few SMs while the rest idle: when its query blocks
    (batch x heads x query tiles) occupy under half the SMs, enough parts for SPLIT_BLOCKS_PER_SM blocks
    an SM, each of at least SPLIT_MIN_KEYS keys; else 1 (split_keys pays a launch per batch row, which a
    call with that many blocks would not win back)."""
    if 2 * query_blocks >= sms:
        return 1
    return max(1, min(-(-SPLIT_BLOCKS_PER_SM * sms // query_blocks), keys // SPLIT_MIN_KEYS))


def decodes(policy: ScorePolicy, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a forward-only call of this policy, dtype and head dim with one query row per head runs on the
    decode kernel: cosine whose logits of unit rows stay within DECODE_MAX_BOUND of zero, at a head dim the
    kernel takes (the extension's decode_head_dims)."""
    if policy.kind != "cosine" or head_dim not in _extension.decode_head_dims(run_dtype(dtype, True)):
        return False
    return abs(policy.scale) * (1.0 if policy.qk_norm is None else policy.qk_norm ** 2) <= DECODE_MAX_BOUND


def resolve(*, device: torch.device, dtype: torch.dtype, head_dim: int, keys: int, policy: ScorePolicy,
            backend: str = "auto", form: str = "quadratic", dropout: float = 0.0,
            tuning: Tuning | None = None, splittable: tuple[int, int] | None = None,
            forward_only: bool = False, exchange: bool = False) -> Plan:
    """The plan for a call on inputs of this device, dtype and head dim, with ``keys`` keys.

    backend="cuda" must run on the kernels or raise NotImplementedError saying why; "auto" takes them
    when they can. form="auto" (fastmax) takes the linear form from linear_from_keys's key count. The
    policy's logits and weights are checked against the dtype the plan computes them in (ValueError).
    ``splittable``: (batch x heads, query rows) of a call whose keys may be split (forward only, not
    causal, no bias); None: they may not. With one query row, cosine takes the decode kernel instead.
    ``forward_only``: no gradient will be asked of the call, so form="auto" takes the forward's crossover.
    ``exchange``: the call is one rank's slice of a sequence split over a context group, whose ranks exchange
    the linear form's state (form="linear"): on the kernels it needs the chunked path, whatever the key count.
    """
    tuning = tuning or TUNING
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    if form != "quadratic" and policy.kind != "fastmax":
        raise ValueError(f"form: the linear form is for the fastmax family, got {policy.kind!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout}")
    if exchange and form != "linear":
        raise ValueError(f"form: the ranks exchange the linear form's state, expected 'linear', got {form!r}")
    if dropout > 0 and form == "linear":
        raise NotImplementedError("dropout: the linear form cannot drop individual weights; "
                                  "use form='quadratic' or dropout=0")
    why = []
    reason = reference_reason(backend, lambda: (
        "dropout: the kernels do not implement dropout (use dropout=0 or backend='torch')" if dropout > 0
        else kernels_reason(device, dtype, head_dim)
        or (linear_kernels_reason(dtype, head_dim, tuning) if form == "linear" else None)
        or (exchange_reason(dtype, head_dim, tuning) if exchange else None)))
    on_kernels = reason is None
    why.append(("our kernels",) if on_kernels else ("the PyTorch reference: ", reason))

    if form == "auto":
        start, basis = linear_from_keys(head_dim, round(policy.a2 != 0) + 1, dtype, on_kernels, tuning, forward_only)
        no_linear = linear_kernels_reason(dtype, head_dim, tuning) if on_kernels else None
        if no_linear is not None:
            form, note = "quadratic", (no_linear,)
        elif dropout > 0:
            form, note = "quadratic", ("dropout exists only in the quadratic form",)
        else:
            form = "linear" if keys >= start else "quadratic"
            note = (keys, " keys >= " if keys >= start else " keys < ", start, ", ", basis)
        why.append(("form ", form, ": ", *note))

    path, chunk = ("tiled" if on_kernels else "reference"), None
    if form == "linear" and on_kernels:
        chunked = chunked_path(dtype, head_dim, tuning)
        path, chunk = ("chunked", tuning.chunked_rows) if chunked else ("sweep", build.LINEAR_CHUNK)
        if keys <= chunk and not exchange:
            # All keys fit in one chunk: the tiled kernel does the whole call as one block, at I*J*D, below
            # the moments' cost. It also matters for precision: with one visible key the exact dq, dk are 0
            # and dv is dO, which the tiled kernels hit exactly (P = 1); moments rounded to fp16/bf16 miss.
            why.append(("the ", keys, " keys fit one ", path, " chunk: one tiled block"))
            form, path, chunk = "quadratic", "tiled", None
        else:
            why.append(("moments on the ", path, " kernels, ", chunk, " rows per chunk"))
    splits = 1
    if splittable is not None and path == "tiled":
        heads, rows = splittable
        if rows == 1 and decodes(policy, dtype, head_dim):
            # The tiled forward would pay a 128-row query tile for the one row, and a copy of K and V to zero
            # the masked keys' rows; the decode kernel streams the kept keys once, on CUDA cores.
            path = "decode"
            why.append(("one query row: the decode kernel, its keys split to fill the GPU",))
        else:
            blocks = heads * -(-rows // QUERY_TILE)
            splits = key_splits(_sm_count(device), blocks, keys)
            if splits > 1:
                path = "split"
                why.append(("keys in ", splits, " parts: ", blocks, " query blocks alone would leave SMs idle"))
    score_dtype = KERNEL_SCORE_DTYPE if on_kernels else score_dtype_of_reference(dtype, form == "linear")
    policy.check_range(score_dtype)
    return Plan("cuda" if on_kernels else "torch", form, path, chunk, run_dtype(dtype, on_kernels), score_dtype,
                tuple(why), splits)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
