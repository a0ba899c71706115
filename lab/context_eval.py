"""Does a model use long context? Two evaluations of a trained model on one split (a 1-D uint8 array).

same_target_losses: the same target bytes scored with different amounts of context. The split is cut into
consecutive long windows of `window` bytes; in each, the last `targets` target bytes are scored once per cut c,
every one of them predicted from between 3c/4 and c bytes of context (sub-windows of exactly c input bytes whose
last s = min(targets, c // 4) positions are scored, stepping by s). Unlike a bpc-by-position curve, whose long
positions are other bytes than its short ones, the cuts differ only in the context: a loss that keeps falling
as c grows is a model that uses the longer context.

sliding_bpc: every byte of the split scored once with at least seq_len - stride bytes of context (after the
first window), the literature's sliding-window evaluation.

Both run under torch.no_grad with the model in eval mode (its mode is restored after), batch their windows to
about tokens_per_batch tokens, and sum per-byte losses in float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from data.batches import check_int, check_split_array, gather_windows

TOKENS_PER_BATCH = 2**17


def _check_model_reach(model, length: int, arg: str) -> None:
    """A GPT refuses inputs longer than its seq_len: say so before any work, naming the argument."""
    model_len = getattr(getattr(model, "cfg", None), "seq_len", None)
    if model_len is not None and length > model_len:
        raise ValueError(f"{arg}: {length:,} input bytes exceed the model's seq_len={model_len:,} "
                         "(build it longer: model_from_checkpoint(..., seq_len=N))")


@dataclass(frozen=True)
class CutPlan:
    """One cut's sub-windows inside a long window of `window` input bytes (positions 0 .. window - 1, position p
    predicting the window's byte p + 1 from the p + 1 bytes up to it).

    Sub-window j takes input positions starts[j] .. starts[j] + cut - 1 and scores its last `scored` of them,
    the window positions scored_from[j] .. scored_from[j] + scored - 1; together they cover the window's last
    `targets` positions once, in order."""
    cut: int
    scored: int  # s = min(targets, cut // 4)
    starts: np.ndarray  # (targets // s,) int64, relative to the long window's start
    scored_from: np.ndarray  # (targets // s,) int64 window positions; = starts + cut - scored

    def context(self) -> tuple[int, int]:
        """(fewest, most) bytes of context any scored byte has: cut - scored + 1 and cut."""
        return self.cut - self.scored + 1, self.cut


def check_same_target(cuts, targets: int, window: int, block: int | None = None) -> None:
    """ValueError naming the argument (cuts, targets, window or block) unless the layout is valid: every cut
    an int in [4, window - targets], s = min(targets, cut // 4) dividing targets, block (when given) dividing
    targets."""
    check_int("targets", targets)
    check_int("window", window)
    if block is not None:
        check_int("block", block)
    if isinstance(cuts, (str, bytes)) or not hasattr(cuts, "__len__") or len(cuts) == 0:
        raise ValueError(f"cuts: expected a non-empty list of ints, got {cuts!r}")
    for c in cuts:
        check_int("cuts", c, least=4)
    if len(set(cuts)) != len(cuts):
        raise ValueError(f"cuts: expected distinct values, got {list(cuts)}")
    if window <= targets:
        raise ValueError(f"window: expected > targets={targets} (room for context before the scored bytes), "
                         f"got {window}")
    too_long = [c for c in cuts if c > window - targets]
    if too_long:
        raise ValueError(f"cuts: {too_long} exceed window - targets = {window - targets}: a cut's sub-windows "
                         f"must lie inside the long window (pass window >= max(cuts) + targets = "
                         f"{max(cuts) + targets})")
    for c in cuts:
        s = min(targets, c // 4)
        if targets % s:
            raise ValueError(f"targets: expected a multiple of s = min(targets, cut // 4) for every cut, the bytes "
                             f"each sub-window scores; cut {c} scores {s} and {targets} is not a multiple of it")
    if block is not None and targets % block:
        raise ValueError(f"block: expected a divisor of targets={targets}, got {block}")


def plan_cut(cut: int, targets: int, window: int) -> CutPlan:
    """The sub-windows of one cut (see CutPlan); ValueError as check_same_target's for a bad layout."""
    check_same_target([cut], targets, window)
    s = min(targets, cut // 4)
    scored_from = window - targets + s * np.arange(targets // s, dtype=np.int64)
    return CutPlan(cut, s, scored_from + s - cut, scored_from)


def _long_windows(split: np.ndarray, window: int, max_windows: int | None) -> int:
    """How many consecutive long windows (window + 1 bytes each) the split holds, capped at max_windows."""
    n = (len(split) - 1) // window
    if n < 1:
        raise ValueError(f"window: a long window needs window + 1 = {window + 1:,} bytes, the split has "
                         f"{len(split):,}")
    return n if max_windows is None else min(n, max_windows)


def _forward_losses(model, split: np.ndarray, starts: np.ndarray, length: int, device, autocast,
                    tokens_per_batch: int):
    """Yield (first, per-token loss (b, length) on the device) for batches of the windows
    split[start : start + length + 1], `first` the index into starts of the batch's first window."""
    batch = max(1, tokens_per_batch // length)
    for i in range(0, len(starts), batch):
        x, y = gather_windows(split, starts[i:i + batch], length)
        with autocast:
            _, loss = model(x.to(device), y.to(device), reduction="none")
        yield i, loss


def same_target_byte_losses(model, split: np.ndarray, cuts, targets: int, window: int, device, autocast,
                            max_windows: int | None = None, tokens_per_batch: int = TOKENS_PER_BATCH) -> np.ndarray:
    """Per-byte losses in nats, float64 (len(cuts), windows, targets): byte t of long window i under cut k is
    the loss of target window_start + window - targets + t + 1, predicted from between 3c/4 and c bytes.
    See same_target_losses."""
    check_split_array(split, "split")
    check_same_target(cuts, targets, window)
    check_int("tokens_per_batch", tokens_per_batch)
    if max_windows is not None:
        check_int("max_windows", max_windows)
    _check_model_reach(model, max(cuts), "cuts")
    n = _long_windows(split, window, max_windows)
    losses = np.empty((len(cuts), n, targets), dtype=np.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for k, cut in enumerate(cuts):
                plan = plan_cut(cut, targets, window)
                s, per_window = plan.scored, len(plan.starts)
                starts = (window * np.arange(n, dtype=np.int64)[:, None] + plan.starts).ravel()  # (window, j) order
                scored = np.empty((n * per_window, s), dtype=np.float64)  # row i * per_window + j: sub-window (i, j)
                for first, loss in _forward_losses(model, split, starts, cut, device, autocast, tokens_per_batch):
                    scored[first:first + len(loss)] = loss[:, cut - s:].double().cpu().numpy()
                losses[k] = scored.reshape(n, targets)
    finally:
        model.train(was_training)
    return losses


def same_target_losses(model, split: np.ndarray, cuts, targets: int, window: int, device, autocast,
                       max_windows: int | None = None, block: int = 64,
                       tokens_per_batch: int = TOKENS_PER_BATCH) -> dict:
    """The same target bytes scored with contexts cut to each of cuts.

    The split is cut into consecutive long windows of `window` input bytes (+1 for the last target), the first
    max_windows of them (all without); each long window's last `targets` target bytes are scored under every cut
    c (4 <= c <= window - targets), each from between 3c/4 and c bytes of context: sub-windows of exactly c input
    bytes, the last s = min(targets, c // 4) positions of each scored, stepping by s (so s must divide targets).
    Sub-windows are batched to about tokens_per_batch tokens. The model needs seq_len >= max(cuts).

    Returns {"cuts", "targets", "window", "windows" (long windows scored), "block", "block_loss" (per cut, per
    long window, the mean loss in nats of each of the targets // block consecutive blocks of scored bytes, in
    order), "bpc" (per cut, the mean over all scored bytes, in bits)}.
    """
    check_same_target(cuts, targets, window, block)
    losses = same_target_byte_losses(model, split, cuts, targets, window, device, autocast, max_windows,
                                     tokens_per_batch)
    _, n, _ = losses.shape
    blocks = losses.reshape(len(cuts), n, targets // block, block).mean(-1)
    return {"cuts": [int(c) for c in cuts], "targets": targets, "window": window, "windows": n, "block": block,
            "block_loss": blocks.tolist(), "bpc": (losses.mean(axis=(1, 2)) / math.log(2)).tolist()}


def plan_sliding(n_targets: int, seq_len: int, stride: int,
                 max_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(starts, score_from) of the sliding windows over n_targets targets (a split of n_targets + 1 bytes):
    window w takes input positions starts[w] .. starts[w] + seq_len - 1 and scores its positions score_from[w]
    .. seq_len - 1. Windows start at 0, stride, 2 * stride, ...; the first scores all seq_len positions, each
    later one its last stride. Past the last whole window, one more ends at the split's end and scores only the
    targets not yet scored (fewer than stride). So every target is scored once, each after the first window's
    with at least seq_len - stride bytes of context. With max_windows, only the first max_windows windows."""
    check_int("seq_len", seq_len)
    check_int("stride", stride)
    if stride > seq_len:
        raise ValueError(f"stride: expected <= seq_len={seq_len} (a larger one skips bytes), got {stride}")
    if max_windows is not None:
        check_int("max_windows", max_windows)
    if n_targets < seq_len:
        raise ValueError(f"seq_len: {seq_len:,} needs a split of seq_len + 1 = {seq_len + 1:,} bytes, the split has "
                         f"{n_targets + 1:,}")
    whole = (n_targets - seq_len) // stride + 1
    starts = stride * np.arange(whole, dtype=np.int64)
    score_from = np.full(whole, seq_len - stride, dtype=np.int64)
    score_from[0] = 0
    end = starts[-1] + seq_len  # the targets before it are scored
    if end < n_targets:
        starts = np.append(starts, n_targets - seq_len)
        score_from = np.append(score_from, seq_len - (n_targets - end))
    if max_windows is not None:
        starts, score_from = starts[:max_windows], score_from[:max_windows]
    return starts, score_from


def sliding_bpc(model, split: np.ndarray, seq_len: int, stride: int, device, autocast,
                max_windows: int | None = None, tokens_per_batch: int = TOKENS_PER_BATCH) -> dict:
    """The split's bpc under the sliding-window evaluation (plan_sliding's windows): every target byte scored
    once (the first max_windows windows' only, with max_windows), each after the first window's with at least
    seq_len - stride bytes of context. stride = seq_len is eval_windows' tiling (lab.steps.evaluate's loss).

    Returns {"seq_len", "stride", "windows", "bytes" (scored), "loss" (mean, nats), "bpc"}."""
    check_split_array(split, "split")
    check_int("tokens_per_batch", tokens_per_batch)
    starts, score_from = plan_sliding(len(split) - 1, seq_len, stride, max_windows)
    _check_model_reach(model, seq_len, "seq_len")
    positions = torch.arange(seq_len, device=device)
    score_from_t = torch.from_numpy(score_from).to(device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)  # counted from the masks, not from the plan
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for first, loss in _forward_losses(model, split, starts, seq_len, device, autocast, tokens_per_batch):
                keep = positions >= score_from_t[first:first + len(loss), None]
                total += torch.where(keep, loss.double(), 0.0).sum()
                count += keep.sum()
    finally:
        model.train(was_training)
    count = int(count)
    loss = total.item() / count
    return {"seq_len": seq_len, "stride": stride, "windows": len(starts), "bytes": count, "loss": loss,
            "bpc": loss / math.log(2)}
