"""A byte-level GPT: token embedding, pre-norm transformer blocks with RoPE attention (optionally after a
short causal convolution, for associative recall), tied output head.

RMSNorm rather than LayerNorm: the model has no biases anywhere, and without its bias LayerNorm differs
from RMSNorm only by re-centring, which modern LMs (LLaMA, OLMo-2) found they can drop; it is also one
reduction cheaper per call.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_cuda import score_policy
from model.attention import (FAMILIES, CausalSelfAttention, attention_flops_per_token, decode_cache, layer_window,
                             rope_tables, score_options)
from model.context_parallel import ContextParallel

VOCAB_SIZE = 256  # bytes
ATTENTIONS = tuple(FAMILIES)
SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def check_fields(cfg) -> None:
    """What holds for every field of a config: a value among its choices, and no inf or NaN in a float
    (an `lr = 1e999` in a config file reads as inf and would otherwise fail only mid-training)."""
    for f in fields(cfg):
        value, choices = getattr(cfg, f.name), f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name}: expected one of {choices}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name}: expected a finite number, got {value}")


def option(default, help: str, choices: tuple | None = None):
    """A config field with the description (and the allowed values) that train.py --help shows and that
    __post_init__ checks: each field's meaning is written once, here."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class GPTConfig:
    n_layer: int = option(8, "transformer blocks")
    n_head: int = option(8, "query heads per block")
    n_kv_head: int | None = option(None, "key/value heads (grouped KV; 1 = multi-query); None = n_head")
    n_embd: int = option(512, "model width; the head dim is n_embd / n_head")
    seq_len: int = option(8192, "context length in bytes")
    dropout: float = option(0.0, "dropout on embeddings and residual branches")
    attention: str = option("softmax", "attention family", ATTENTIONS)
    use_cuda_kernel: bool | None = option(None, "cosine/fastmax on attention_cuda's CUDA kernels (true) or its "
                                                "PyTorch reference (false); None (auto) = the kernels where the run "
                                                "is on CUDA and they load (built, or JIT-built on first use), else "
                                                "the reference, said at start-up")
    cosine_sdpa: bool = option(False, "cosine on PyTorch SDPA over l2-normalised q and k (the same function, "
                                      "a baseline for our kernels) instead of attention_cuda")
    sdpa_backend: str = option("auto", "the backend of attention run on SDPA (softmax; cosine with cosine_sdpa); "
                                       "auto = PyTorch's pick", SDPA_BACKENDS)
    cosine_scale: float = option(10.0, "cosine: the fixed logit scale applied to l2norm(q).l2norm(k)")
    fastmax_p: int = option(2, "fastmax: polynomial degree", (1, 2))
    fastmax_a0: float = option(1.0, "fastmax: f(x) = a0 + a1 x + a2 x^2")
    fastmax_a1: float = option(1.0, "fastmax: f(x) = a0 + a1 x + a2 x^2")
    fastmax_a2: float = option(0.5, "fastmax: f(x) = a0 + a1 x + a2 x^2 (p = 2)")
    fastmax_temperature: float | None = option(None, "fastmax: x = q.k / temperature; None = sqrt(head_dim)")
    fastmax_normalize: bool = option(False, "fastmax: scale each q and k row to norm fastmax_lim first")
    fastmax_lim: float = option(1.0, "fastmax: the row norm with fastmax_normalize")
    rope_base: float = option(10000.0, "RoPE frequency base")
    short_conv: int = option(0, "kernel size of a causal depthwise convolution ahead of each block's attention, "
                                "as in Zoology's recall models: it hands each position its predecessors; 0 = none")
    swa_window: int = option(0, "Based's hybrid (Arora et al. 2024): the blocks of odd index (1, 3, ...) run "
                                "causal softmax over the last swa_window positions (the query and the swa_window - 1 "
                                "before it) in place of the attention family; the even ones keep it. Fastmax's weights "
                                "cannot concentrate (f(x) >= a0/2 for every key), so it learns local byte statistics "
                                "poorly: small exact softmax windows (Based: 64) do the local work and leave the "
                                "family the long range. 0 = none")

    def __post_init__(self):
        check_fields(self)
        for name in ("n_layer", "n_head", "n_embd", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head: expected a positive divisor of n_head={self.n_head}, got {self.n_kv_head}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd: expected a multiple of n_head={self.n_head} with an even head dim "
                             f"(RoPE rotates pairs), got {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout}")
        if self.use_cuda_kernel is None and self.on_sdpa:
            self.use_cuda_kernel = False  # attention on SDPA: nothing for auto to choose
        if self.use_cuda_kernel and self.attention == "softmax":
            raise ValueError("use_cuda_kernel: softmax always runs on PyTorch's fused SDPA kernels; "
                             "the flag selects our kernels for attention='cosine' or 'fastmax'")
        if self.cosine_sdpa and (self.attention != "cosine" or self.use_cuda_kernel):
            raise ValueError("cosine_sdpa: runs attention='cosine' on SDPA, so it takes neither another attention "
                             f"(got {self.attention!r}) nor use_cuda_kernel")
        if self.sdpa_backend != "auto" and not self.on_sdpa:
            raise ValueError(f"sdpa_backend: {self.sdpa_backend!r} applies to attention run on SDPA (softmax, or "
                             "cosine with cosine_sdpa)")
        if not self.cosine_scale > 0:
            raise ValueError(f"cosine_scale: expected > 0, got {self.cosine_scale}")
        if not self.rope_base > 1:
            raise ValueError(f"rope_base: expected > 1, got {self.rope_base}")
        if self.short_conv < 0 or self.short_conv == 1:
            raise ValueError(f"short_conv: expected 0 (none) or a kernel size of at least 2, got {self.short_conv}")
        if self.swa_window < 0:
            raise ValueError(f"swa_window: expected 0 (none) or a window of at least 1 position, got {self.swa_window}")
        if self.swa_window and self.n_layer < 2:
            raise ValueError(f"swa_window: windows the blocks of odd index, so it needs n_layer >= 2, "
                             f"got n_layer={self.n_layer}")
        if self.fastmax_temperature is None:
            self.fastmax_temperature = math.sqrt(self.head_dim)
        if self.attention == "fastmax":
            try:
                score_policy("fastmax", **score_options(self))
            except ValueError as err:
                raise ValueError(f"fastmax_*: {err}") from None

    @property
    def on_sdpa(self) -> bool:
        """Whether the attention runs on PyTorch's SDPA (softmax, or cosine with cosine_sdpa), not attention_cuda."""
        return self.attention == "softmax" or self.cosine_sdpa

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    """Scale rows to unit RMS, then by a gain, in fp32 (so bf16 activations do not lose the statistic).
    F.rms_norm is one fused kernel each way on CUDA, where the same formula in elementwise ops took six
    passes over fp32 copies of the residual stream forward and more backward (docs/training.md)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), self.weight.shape, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class ShortConv(nn.Module):
    """A residual branch that mixes each channel over the last short_conv positions (causal, depthwise).

    Zoology's models (Arora et al. 2023) all have one ahead of their sequence mixer. Associative recall needs
    each value to carry the key before it; attention alone must first discover a previous-token head for that,
    and a 2-layer GPT without this branch stays at guessing among the values in context for thousands of steps.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.n_embd)
        self.conv = nn.Conv1d(cfg.n_embd, cfg.n_embd, cfg.short_conv, groups=cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        """x (B, T, C); with a cache, the positions before x are the cached ones rather than zeros."""
        h = self.norm(x).transpose(1, 2)
        width = self.conv.kernel_size[0] - 1
        h = F.pad(h, (width, 0)) if cache is None else cache.extend(h, width)  # left only: causal
        return self.conv(h).transpose(1, 2)


class ConvCache:
    """A short convolution's last inputs for decoding; zeros before the first, as in training's padding."""

    def __init__(self):
        self.past = None

    def extend(self, h: torch.Tensor, width: int) -> torch.Tensor:
        """h (B, C, T) with the width cached inputs before it; keeps the last width for the next call, in
        the same memory after the first (a CUDA graph replays a step on it)."""
        past = h.new_zeros(*h.shape[:2], width) if self.past is None else self.past
        h = torch.cat([past, h], dim=-1)
        if self.past is None:
            self.past = h[..., h.shape[-1] - width:].clone()
        else:
            self.past.copy_(h[..., h.shape[-1] - width:])
        return h


class Block(nn.Module):
    """One transformer block; ``layer``, its index, picks its attention (layer_window: with swa_window, the odd
    blocks run sliding-window softmax)."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.conv = ShortConv(cfg) if cfg.short_conv else None
        self.attn_norm = RMSNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None,
                position: torch.Tensor | None = None, context: ContextParallel | None = None) -> torch.Tensor:
        if self.conv is not None:
            x = x + self.conv(x, None if cache is None else cache.conv)
        x = x + self.attn(self.attn_norm(x), cos, sin, None if cache is None else cache.attn, position, context)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class LayerCache:
    attn: object  # model.attention's KVCache or MomentsCache
    conv: ConvCache


class DecodeCache:
    """What decoding keeps between steps (GPT.new_cache): per block its attention's cache (softmax and
    cosine: the keys and values of the last seq_len positions; fastmax: the moments of every key; a
    sliding-window block, swa_window's: the keys and values of the last swa_window positions) and its
    short convolution's inputs; the position of the next byte, on the host (pos, for checks) and on the
    device (position, which a step reads, so that it launches the same work at every position); and the
    RoPE rows of the positions it takes, 0 .. positions - 1."""

    def __init__(self, cfg: GPTConfig, positions: int):
        if positions < 1:
            raise ValueError(f"positions: expected >= 1 (the prompt's bytes plus those to generate), got {positions}")
        self.layers = [LayerCache(decode_cache(cfg, layer_window(cfg, i)), ConvCache()) for i in range(cfg.n_layer)]
        self.pos, self.positions = 0, positions
        self.rope = rope_tables(positions, cfg.head_dim, cfg.rope_base)
        self.position = torch.zeros(1, dtype=torch.long)

    def to(self, device: torch.device) -> DecodeCache:
        self.rope, self.position = tuple(x.to(device) for x in self.rope), self.position.to(device)
        return self

    def nbytes(self) -> int:
        """Bytes of the layers' decoding state (keys and values, or moments, and the convolution's inputs):
        seq_len-sized for softmax and cosine, swa_window-sized for a sliding-window block, one size at every
        context for fastmax."""
        return sum(x.nbytes for layer in self.layers for part in (layer.attn, layer.conv)
                   for x in vars(part).values() if isinstance(x, torch.Tensor))

    def check_room(self, t: int) -> None:
        """Refuse t more bytes where the cache has no room for them (ValueError)."""
        if self.pos > 0 and t != 1:
            raise ValueError(f"idx: after the prefill a cache takes one byte per call, got {t}")
        if self.pos + t > self.positions:
            raise ValueError(f"idx: position {self.pos + t - 1} is past the cache's {self.positions} positions "
                             "(new_cache(positions))")


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the byte's input and output embeddings are one matrix
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.context = None  # set_context_group's
        self.apply(self._init_weights)
        # GPT-2: every block adds two residual branches, so their output projections start smaller to
        # keep the residual stream's variance independent of depth.
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once (the tied embedding is one matrix)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, dtype: torch.dtype) -> int:
        """Training FLOPs per token, training in dtype on the model's device: 6·N for the weights (forward
        2·N, backward 4·N) plus attention."""
        return 6 * self.num_params() + attention_flops_per_token(self.cfg, self.wte.weight.device, dtype)

    def new_cache(self, positions: int | None = None) -> DecodeCache:
        """An empty decoding cache for up to ``positions`` bytes, prompt and generated (default seq_len)."""
        return DecodeCache(self.cfg, self.cfg.seq_len if positions is None else positions).to(self.wte.weight.device)

    def set_context_group(self, group) -> None:
        """From now on a forward without a cache runs on this rank's slice of each sequence, its attention
        reaching the other slices over the process group, and returns the logits of the slice and this rank's
        share of the loss (ContextParallel.loss). Every rank of the group must run the same forwards and
        backwards; the caller sums the parameter gradients over the group. None: the whole sequence again.
        Decoding (a forward with a cache) always runs on one process, on the whole sequence. Call it on the
        model on its device (softmax's ring runs on CUDA only: ValueError elsewhere)."""
        self.context = None if group is None else ContextParallel(self.cfg, group, self.wte.weight.device)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean",
                cache: DecodeCache | None = None):
        """logits (B, T, 256) and the loss in nats: mean over tokens, or per token (B, T) with
        reduction="none" (for evaluation by position); the loss is None without targets. Under a context
        group (set_context_group) the logits are the rank's slice's and the loss its share.

        With a cache (new_cache(positions)), idx continues what the cache has seen: first a prefill of up to seq_len
        bytes, then one byte per call. Past seq_len bytes each step attends to the last seq_len positions.
        """
        t = idx.shape[1]
        pos = 0 if cache is None else cache.pos
        if t > self.cfg.seq_len:
            raise ValueError(f"idx: sequence length {t} exceeds the model's seq_len={self.cfg.seq_len}")
        if cache is not None:
            cache.check_room(t)
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction: expected 'mean' or 'none', got {reduction!r}")
        context = self.context if cache is None else None
        if context is not None:
            idx, positions = context.shard(idx)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        elif cache is None:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        elif pos == 0:  # the prefill
            cos, sin = (x[:t] for x in cache.rope)
        else:  # a step: its row by the device position, the same launch at every position
            cos, sin = (x.index_select(0, cache.position) for x in cache.rope)
        x = self.drop(self.wte(idx))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, *((None, None) if cache is None else (cache.layers[i], cache.position)), context)
        if cache is not None:
            cache.pos += t
            cache.position += t
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        if context is not None:
            return logits, context.loss(logits, targets, reduction)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
        return logits, loss.view_as(targets) if reduction == "none" else loss

    def stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None,
               use_cache: bool = True, use_graph: bool | None = None) -> Iterator[torch.Tensor]:
        """Yield max_new_tokens sampled bytes after idx (B, T), one (B, 1) tensor at a time.

        With the cache (the default) the last seq_len bytes of idx are a prefill and each new byte is one
        step over the cached keys and values; past seq_len bytes a step attends to the last seq_len positions
        whose states were computed with their own earlier context. Without it each byte runs the model over
        the last seq_len bytes afresh (the same bytes up to seq_len; past it, the window is re-encoded).
        Call model.eval() first so dropout is off. ``generator`` keeps sampling off the global RNG, so
        drawing a sample mid-training does not change the run. ``use_graph``: after GRAPH_AFTER eager steps,
        replay one recorded as a CUDA graph (CapturedStep), which a step's launches would otherwise dominate;
        None = on CUDA with the cache.
        """
        check_sampling(temperature, top_k, top_p)  # here, not at the first byte: the generator below is lazy
        if idx.ndim != 2 or idx.shape[1] == 0:
            raise ValueError(f"idx: expected (batch, at least one byte), got shape {tuple(idx.shape)}")
        graphable = use_cache and idx.device.type == "cuda"
        if use_graph is None:
            use_graph = graphable
        if use_graph and not graphable:
            raise ValueError(f"use_graph: replays the cache's step on CUDA, got use_cache={use_cache} and idx on "
                             f"{idx.device}")

        def draw(idx):
            inputs = idx[:, -self.cfg.seq_len:]
            cache = self.new_cache(inputs.shape[1] + max_new_tokens) if use_cache else None
            step = None
            for n in range(max_new_tokens):  # n = 0: the prefill
                with torch.no_grad():
                    if use_graph and n == GRAPH_AFTER + 1:
                        step = CapturedStep(self, cache, idx.shape[0])
                    logits = self(inputs, cache=cache)[0] if step is None else step(inputs)
                next_byte = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
                idx = torch.cat([idx, next_byte], dim=1)
                inputs = next_byte if use_cache else idx[:, -self.cfg.seq_len:]
                yield next_byte
        return draw(idx)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None,
                 use_cache: bool = True, use_graph: bool | None = None) -> torch.Tensor:
        """idx (B, T) with max_new_tokens sampled bytes appended (stream's, all at once)."""
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, generator, use_cache, use_graph))
        return torch.cat([idx, *new], dim=1)


# Eager decode steps before stream records one (CapturedStep): they load what a step calls, which capture cannot.
GRAPH_AFTER = 2


class CapturedStep:
    """A decode step recorded once as a CUDA graph and replayed, as gpt-fast does: a step is a few hundred
    small kernels, and launching them one by one costs more than running them at batch 1
    (bench/notes/run-34.md). A cache's step launches the same work at every position (DecodeCache), so
    one recording serves every later step. Record it under the autocast it is to run in, after the prefill
    and an eager step or two, which load what the step calls (capture cannot); each call is then one step,
    like model(idx, cache=cache), returning logits in a buffer the next call overwrites. CUDA only."""

    def __init__(self, model: GPT, cache: DecodeCache, batch: int):
        self.cache = cache
        self.idx = torch.zeros(batch, 1, dtype=torch.long, device=cache.position.device)
        self.graph = torch.cuda.CUDAGraph()
        pos = cache.pos
        # Autocast's cache of cast weights lives until its context ends, which the replays may outlast (a
        # caller consuming stream's bytes in several contexts): recorded without it, the casts are the
        # graph's own kernels and outputs.
        autocast = (torch.autocast("cuda", torch.get_autocast_dtype("cuda"), cache_enabled=False)
                    if torch.is_autocast_enabled("cuda") else contextlib.nullcontext())
        with autocast, torch.cuda.graph(self.graph):
            self.logits, _ = model(self.idx, cache=cache)
        cache.pos = pos  # recording ran the step's Python (its host bookkeeping too), not its kernels

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        self.cache.check_room(1)
        self.idx.copy_(idx)
        self.graph.replay()
        self.cache.pos += 1
        return self.logits


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature}")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= VOCAB_SIZE):
        raise ValueError(f"top_k: expected None or an int in [1, {VOCAB_SIZE}], got {top_k}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One byte per row of logits (B, 256), (B, 1): drawn at temperature from the top_k most likely bytes
    and, within those, from the smallest set whose probability reaches top_p (nucleus sampling; the most
    likely byte always stays)."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the more likely bytes
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)
