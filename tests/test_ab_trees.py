"""bench/ab_trees.py on the CPU: its case syntax, its argument errors, and that a tree without built kernels
is refused (not JIT-compiled) in the worker and reported with the tree's name by the parent."""
import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ab_trees.py"


def _load():
    spec = importlib.util.spec_from_file_location("ab_trees", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ab = _load()


def test_case_syntax():
    assert ab.parse_case("fastmax:2:4:1024:128:causal") == dict(family="fastmax", b=2, h=4, n=1024, d=128, causal=True)
    assert ab.case_name(ab.parse_case("cosine:4:8:16384:64:full")) == "cos b4 h8 d64 n16384 full"
    for bad in ("softmax:1:1:64:64:full", "cosine:1:1:64:64", "cosine:1:x:64:64:full", "cosine:1:1:64:64:both"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected family:batch:heads:seq_len:dim_head|must be integers"):
            ab.parse_case(bad)


def test_default_cases_parse():
    assert len([ab.parse_case(c) for c in ab.DEFAULT_CASES.split(",")]) == 7


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_argument_errors(tmp_path):
    one = _run(f"a={ROOT}")
    assert one.returncode == 2 and "give two or more trees" in one.stderr
    missing = _run(f"a={ROOT}", f"b={tmp_path}")
    assert missing.returncode == 2 and f"tree 'b={tmp_path}'" in missing.stderr
    cases = _run(f"a={ROOT}", f"b={ROOT}", "--cases", "cosine:1:1:64")
    assert cases.returncode == 2 and "--cases" in cases.stderr
    rounds = _run(f"a={ROOT}", f"b={ROOT}", "--rounds", "0")
    assert rounds.returncode == 2 and "--rounds" in rounds.stderr


def test_tree_without_kernels_is_refused(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "attention_cuda").mkdir(parents=True)
    worker = _run("--worker", tmp_path / "a", cwd=tmp_path / "a")
    assert worker.returncode != 0 and "no built kernels" in worker.stderr
    parent = _run(f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}", "--rounds", "1")
    assert parent.returncode != 0 and "tree a, round 0" in parent.stderr and "no built kernels" in parent.stderr
