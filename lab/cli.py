"""Helpers for the scripts that drive train.py (compare.py, scripts/): their own options first, then
train.py's flags after ``--``."""
from __future__ import annotations

import argparse
import math

import torch


def split_train_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the driver's own arguments, the train.py flags after --)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def refuse_train_flags(parser: argparse.ArgumentParser, extra: list[str], fields, why: str) -> None:
    """parser.error for a train.py flag in extra that sets one of fields, which the driver sets itself."""
    for flag in extra:
        name = flag[2:].split("=")[0].replace("-", "_") if flag.startswith("--") else None
        if name in fields:
            parser.error(f"{flag.split('=')[0]} after --: {parser.prog} {why}")


def out_of_memory(err: torch.OutOfMemoryError) -> dict:
    """A measuring script's record of a configuration that did not fit."""
    return {"ok": False, "reason": "out of memory", "detail": str(err).splitlines()[0][:300]}


def choice_list(parser: argparse.ArgumentParser, flag: str, text: str, choices) -> list[str]:
    """text's comma-separated items, or parser.error naming the ones not among choices."""
    values = text.split(",")
    unknown = [v for v in values if v not in choices]
    if unknown:
        parser.error(f"{flag}: expected a comma list of {', '.join(choices)}, got {', '.join(map(repr, unknown))}")
    return values


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """parser.error for the first of the named options that is set (not None) and not > 0."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')}: expected > 0, got {value}")




def _ints(text: str, least: int) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < least:
        raise ValueError(text)
    return values


def int_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive ints."""
    return _ints(text, 1)


def index_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of indices (ints from 0), such as GPUs'."""
    return _ints(text, 0)


int_list.__name__ = "comma-separated positive int"  # what argparse names in "invalid ... value"
index_list.__name__ = "comma-separated index"


def fmt(value, spec: str) -> str:
    """value formatted for a report's table, or a dash where there is none (None, or a NaN: no measurement)."""
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
