"""Multi-query associative recall (MQAR) in bytes: a synthetic probe of looking things up in the context.

MQAR is the task of Zoology (Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient
Language Models", arXiv:2312.04927), the standard test where linear attentions lag softmax: a sequence first
lists key-value pairs, then asks for the values of some of its keys, and the model must find each one.

Format. A sequence is seq_len + 1 bytes (0-255, the model's vocabulary, as for enwik8), read as a window:
inputs x = seq[:-1], targets y = seq[1:].

    k1 v1 k2 v2 ... kP vP  0 0 kC vC 0 0 0 0 kA vA 0 kB vB 0 0 ... 0
    \\___ 2 * pairs ___/  \\___ queries at random places in the rest, filler around them ___/

- `pairs` keys, distinct, drawn from KEY_BYTES (1-127), each followed by its value, drawn from VALUE_BYTES
  (128-255). Values are drawn independently (two keys may share one), so no value can be ruled out by
  elimination and chance accuracy is exactly 1 / 128.
- `queries` of those keys (distinct, in random order), each followed by its value again, at uniformly random
  non-overlapping places in the rest of the sequence; every other byte there is the filler FILLER (0).
  Zoology draws the gaps before the queries from a power law; uniform places spread the distance between a
  pair and its query over the whole context, which is what a sweep of context lengths asks about.
- The targets are IGNORE_INDEX (-100, cross_entropy's default ignore_index) everywhere but at the position
  of a query's key, whose target is that key's value: the loss and the accuracy are over the answers alone.
  Keys, values and filler are disjoint alphabets, so a key byte after the pairs is always a question.

So 2 * pairs + 2 * queries <= seq_len + 1, queries <= pairs, and pairs <= 127 (distinct keys).

Streams. Training batch k of rank r is drawn by a generator seeded with (seed, r, k) (SeededSampler, as
RandomWindowSampler's windows): the state is one counter and a resume draws bit-identical batches. The val
and test splits are fixed sets of EVAL_SEQUENCES sequences: sequence i of a split is drawn by a generator of
its own, seeded with (EVAL_SEED, split, i), independent of the run's seed and batch size. So every run with
the same (seq_len, pairs, queries) is scored on the same sequences, as every enwik8 run is on the same val
bytes, and no training stream can draw them (EVAL_SEED is above the seeds train.py takes).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from data.batches import SeededSampler, check_int

FILLER = 0
KEY_BYTES = np.arange(1, 128)
VALUE_BYTES = np.arange(128, 256)
IGNORE_INDEX = -100  # F.cross_entropy's default: these targets add nothing to the loss
EVAL_SEQUENCES = 1024  # per eval split: an accuracy's standard error is at most 1.6 points (0.4 at 16 queries)
EVAL_SEED = 2**32  # above every seed train.py takes (< 2**32): no training stream draws an eval sequence
EVAL_SPLITS = {"val": 1, "test": 2}


@dataclass
class RecallTask:
    """The shape of the sequences: seq_len inputs holding `pairs` key-value pairs and `queries` questions
    (None = one per pair)."""

    seq_len: int
    pairs: int
    queries: int | None = None

    def __post_init__(self):
        if self.queries is None:
            self.queries = self.pairs
        for name in ("seq_len", "pairs", "queries"):
            check_int(name, getattr(self, name))
        if self.pairs > len(KEY_BYTES):
            raise ValueError(f"pairs: expected at most {len(KEY_BYTES)} (the keys are distinct bytes "
                             f"{KEY_BYTES[0]}-{KEY_BYTES[-1]}), got {self.pairs}")
        if self.queries > self.pairs:
            raise ValueError(f"queries: expected at most pairs={self.pairs} (each asks a different key), "
                             f"got {self.queries}")
        need = 2 * self.pairs + 2 * self.queries
        if need > self.seq_len + 1:
            raise ValueError(f"pairs: {self.pairs} pairs and {self.queries} queries take 2 * {self.pairs} + "
                             f"2 * {self.queries} = {need} bytes, more than the seq_len + 1 = {self.seq_len + 1} "
                             f"of a sequence; expected seq_len >= {need - 1}, or fewer pairs or queries")

    def draw(self, rng: np.random.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 (rows, seq_len), inputs and targets (IGNORE_INDEX but at the answers)."""
        p, q, n = self.pairs, self.queries, self.seq_len + 1
        keys = rng.permuted(np.tile(KEY_BYTES, (rows, 1)), axis=1)[:, :p]
        values = rng.choice(VALUE_BYTES, size=(rows, p))
        asked = rng.permuted(np.tile(np.arange(p), (rows, 1)), axis=1)[:, :q]  # which pairs, in asking order
        # The q two-byte query slots, uniform over all their non-overlapping placements in the free = n - 2p
        # bytes after the pairs: q distinct sorted offsets in [0, free - q), the j-th moved right by j to make
        # room for the values of the j queries before it (one placement per set of offsets, and back).
        free = n - 2 * p
        offsets = np.sort(rng.random((rows, free - q)).argsort(axis=1)[:, :q], axis=1)
        starts = 2 * p + offsets + np.arange(q)
        row = np.arange(rows)[:, None]
        seq = np.full((rows, n), FILLER, dtype=np.int64)
        seq[:, 0:2 * p:2], seq[:, 1:2 * p:2] = keys, values
        answers = np.take_along_axis(values, asked, axis=1)
        seq[row, starts] = np.take_along_axis(keys, asked, axis=1)
        seq[row, starts + 1] = answers
        targets = np.full((rows, n - 1), IGNORE_INDEX, dtype=np.int64)
        targets[row, starts] = answers  # y[i] = seq[i + 1]: the value after the query key at i
        return torch.from_numpy(seq[:, :-1].copy()), torch.from_numpy(targets)

    def eval_batches(self, split: str, batch_size: int,
                     max_sequences: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) batches of the first max_sequences sequences of the val or test split (all EVAL_SEQUENCES
        of them when None or more); the last batch may be smaller."""
        if split not in EVAL_SPLITS:
            raise ValueError(f"split: expected one of {tuple(EVAL_SPLITS)}, got {split!r}")
        check_int("batch_size", batch_size)
        if max_sequences is not None:
            check_int("max_sequences", max_sequences)
        n = min(max_sequences or EVAL_SEQUENCES, EVAL_SEQUENCES)
        return self._eval_batches(EVAL_SPLITS[split], batch_size, n)

    def _eval_batches(self, split_id: int, batch_size: int, n: int):
        for first in range(0, n, batch_size):
            seeds = [np.random.SeedSequence(EVAL_SEED, spawn_key=(split_id, i))
                     for i in range(first, min(first + batch_size, n))]
            rows = [self.draw(np.random.default_rng(seed), 1) for seed in seeds]
            yield torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])

    def fingerprint(self, seed: int) -> dict:
        """What a checkpoint records of its data: the settings, and the sha256 of the first training and val
        sequences, so that a resume refuses a generator whose output has changed since."""
        digest = hashlib.sha256()
        for x, y in (RecallSampler(self, 1, seed).next_batch(), next(self.eval_batches("val", 1, 1))):
            digest.update(x.numpy().tobytes())
            digest.update(y.numpy().tobytes())
        return {"task": "recall", "seq_len": self.seq_len, "pairs": self.pairs, "queries": self.queries,
                "seed": seed, "sha256": digest.hexdigest()}


class RecallSampler(SeededSampler):
    """Training batches of fresh recall sequences: batch k of rank r is a function of (seed, r, k)."""

    def __init__(self, task: RecallTask, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        super().__init__(batch_size, seed, rank, world_size)
        self.task = task

    def _draw(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.task.draw(rng, self.batch_size)


def score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, answers), 0-dim tensors: how many answers (targets != IGNORE_INDEX) the argmax of logits
    (..., 256) gets right, and how many answers there are. Counts rather than a ratio, so that batches and
    ranks add up exactly."""
    answered = targets != IGNORE_INDEX
    correct = (logits.argmax(-1) == targets) & answered
    return correct.sum(), answered.sum()
