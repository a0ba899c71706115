"""Batches from one split (a 1-D uint8 array): random windows for training, fixed windows for evaluation.

A window of seq_len inputs x = data[s : s + seq_len] has targets y = data[s + 1 : s + seq_len + 1]. Samplers
only ever see their own split's array, so no window crosses a split boundary.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch


def check_int(name: str, value, least: int = 1) -> None:
    """ValueError naming the argument unless value is an int >= least (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name}: expected {'a positive int' if least == 1 else f'an int >= {least}'}, got {value!r}")


def check_split_array(data, name: str = "data") -> None:
    """ValueError naming the argument unless data is one split: a 1-D uint8 numpy array."""
    if not isinstance(data, np.ndarray) or data.ndim != 1 or data.dtype != np.uint8:
        if isinstance(data, np.ndarray):
            described = f"{data.dtype} array of shape {data.shape}"
        else:
            described = type(data).__name__
        raise ValueError(f"{name}: expected a 1-D uint8 numpy array (one split), got {described}")


def _check_split(data, seq_len) -> None:
    check_split_array(data)
    check_int("seq_len", seq_len)
    if seq_len + 1 > len(data):
        raise ValueError(f"seq_len={seq_len} needs windows of seq_len + 1 = {seq_len + 1:,} bytes, "
                         f"but the split has only {len(data):,} bytes")


def gather_windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(starts), seq_len) int64: the windows data[start : start + seq_len + 1]."""
    windows = torch.from_numpy(data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class SeededSampler:
    """Training batches where batch k of rank r is drawn by a generator seeded with (seed, r, k).

    So the stream is a function of the batch count alone: the state is one counter, a resumed run draws
    bit-identical batches, ranks draw independent streams, and every rank can restore from the state rank 0
    saved. A subclass says what one batch is (_draw).
    """

    def __init__(self, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        check_int("batch_size", batch_size)
        check_int("world_size", world_size)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank: expected an int in [0, world_size={world_size}), got {rank!r}")
        self.batch_size, self.seed, self.rank = batch_size, seed, rank
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 tensors of shape (batch_size, seq_len), the inputs and their targets."""
        seeds = np.random.SeedSequence(self.seed, spawn_key=(self.rank, self.batches_drawn))
        self.batches_drawn += 1
        return self._draw(np.random.default_rng(seeds))

    def _draw(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"state['seed']={state['seed']} does not match this sampler's seed={self.seed}: "
                             "resuming with another seed would not reproduce the interrupted run")
        self.batches_drawn = int(state["batches_drawn"])


class RandomWindowSampler(SeededSampler):
    """Training batches of windows drawn uniformly at random from one split; y is x shifted left by one byte."""

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        _check_split(data, seq_len)
        super().__init__(batch_size, seed, rank, world_size)
        self.data, self.seq_len = data, seq_len

    def _draw(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # The last valid start leaves room for the final target: start + seq_len < len(data).
        starts = rng.integers(0, len(self.data) - self.seq_len, size=self.batch_size)
        return gather_windows(self.data, starts, self.seq_len)


def _eval_plan(data: np.ndarray, seq_len: int, max_windows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Window starts, and per window the first position it scores (earlier ones belong to another window)."""
    _check_split(data, seq_len)
    if max_windows is not None:
        check_int("max_windows", max_windows)
    n_targets = len(data) - 1
    n_full, tail = divmod(n_targets, seq_len)
    if max_windows is None or max_windows >= n_full + (tail > 0):
        starts = np.arange(n_full) * seq_len
        score_from = np.zeros(n_full, dtype=np.int64)
        if tail:
            # Right-aligned to the split's end; it overlaps the previous window, so score only new targets.
            starts = np.append(starts, n_targets - seq_len)
            score_from = np.append(score_from, seq_len - tail)
        return starts, score_from
    # Here max_windows <= n_full, so spacing the starts evenly keeps them at least seq_len apart: no overlap.
    starts = np.arange(max_windows) * (n_targets - seq_len) // max(max_windows - 1, 1)
    return starts, np.zeros(max_windows, dtype=np.int64)


def num_eval_targets(data: np.ndarray, seq_len: int, max_windows: int | None = None) -> int:
    """How many target bytes eval_windows scores: len(data) - 1 when it covers the whole split."""
    _, score_from = _eval_plan(data, seq_len, max_windows)
    return int((seq_len - score_from).sum())


def eval_windows(data: np.ndarray, seq_len: int, batch_size: int,
                 max_windows: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Deterministic (x, y, score_mask) batches over one split; the last batch may be smaller.

    Without max_windows the windows tile the split: non-overlapping windows of seq_len targets, the last one
    right-aligned to the end of the split with score_mask scoring only the targets no earlier window scored.
    So every byte of the split but the first (which is only ever context) is scored exactly once, and the
    mean loss over score_mask is the split's loss. With max_windows, that many non-overlapping windows are
    spaced evenly over the split, all positions scored: a cheap, repeatable estimate for periodic evals.

    Context resets at each window start: position j of a window predicts its target from j + 1 bytes of
    context, which is what a bpc-by-position curve over these windows measures.
    x, y: int64 (b, seq_len); score_mask: bool (b, seq_len).
    """
    starts, score_from = _eval_plan(data, seq_len, max_windows)
    check_int("batch_size", batch_size)
    return _eval_batches(data, starts, score_from, seq_len, batch_size)


def _eval_batches(data, starts, score_from, seq_len, batch_size):
    positions = np.arange(seq_len)
    for i in range(0, len(starts), batch_size):
        x, y = gather_windows(data, starts[i:i + batch_size], seq_len)
        yield x, y, torch.from_numpy(positions >= score_from[i:i + batch_size, None])
