"""scripts/context_limit.py on CPU: the search, the memory cap, refusals, timeouts and bad arguments."""
import importlib.util
import json

import pytest

from helpers import REPO

spec = importlib.util.spec_from_file_location("context_limit", REPO / "scripts" / "context_limit.py")
context_limit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(context_limit)


@pytest.mark.parametrize("args, expected", [
    (["--variants", "cosine,linear"], "--variants: expected a comma list of softmax, softmax-cudnn, cosine"),
    (["--granularity", "0"], "--granularity: expected > 0, got 0"),
    (["--memory-cap-gib", "-1"], "--memory-cap-gib: expected > 0, got -1.0"),
    (["--start", "1536"], "--start: expected a multiple of --granularity=1024"),
    (["--start", "4096", "--max-seq-len", "2048"], "--start: expected <= --max-seq-len=2048"),
    (["--rel-tolerance", "1"], "--rel-tolerance: expected in [0, 1)"),
    (["--", "--seq-len=64"], "--seq-len after --: context_limit.py sets it for each attempt"),
])
def test_context_limit_bad_arguments_are_usage_errors(capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        context_limit.main(args)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("limit, max_seq_len", [(1000, 2**21), (1024, 2**21), (5000, 2**21), (300_000, 2**21),
                                                (2**20, 2**21), (10**9, 2**21), (10**9, 5120)])
def test_context_limit_search_brackets_the_limit(limit, max_seq_len):
    tried = []

    def fits(seq_len):
        tried.append(seq_len)
        return seq_len <= limit

    ok, bad = context_limit.search(fits, 1024, max_seq_len, 1024, 1 / 16)
    assert all(t % 1024 == 0 for t in tried) and len(set(tried)) == len(tried)
    if limit < 1024:
        assert (ok, bad, tried) == (None, 1024, [1024])
    elif limit >= max_seq_len:
        assert (ok, bad) == (max_seq_len, None) and tried[-1] == max_seq_len
    else:
        assert ok <= limit < bad and bad - ok <= max(1024, ok / 16)
        doubling = [1024 * 2**i for i in range(len(tried)) if 1024 * 2**i <= bad]
        assert tried[:len(doubling)] == doubling  # powers of 2 up to the first failure, then bisection


@pytest.mark.slow
def test_context_limit_finds_where_a_memory_cap_bites_and_reports_refusals(tmp_path):
    out = tmp_path / "context_limit"
    # The cosine reference holds T x T scores: at 2048 the tiny model's step raises peak RSS well under
    # 0.5 GiB (about 0.26 here), at 4096 well over (about 0.88).
    assert context_limit.main(["--device", "cpu", "--memory-cap-gib", "0.5", "--variants", "cosine,cosine-kernel",
                               "--start", "2048", "--granularity", "2048", "--max-seq-len", "4096", "--out", str(out),
                               "--", "--config", "configs/tiny_cpu", "--n_layer", "1", "--n_head", "2",
                               "--n_embd", "32"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    cosine = report["variants"]["cosine"]
    ok, failed = cosine["attempts"]
    assert (ok["seq_len"], ok["ok"], failed["seq_len"], failed["ok"], failed["reason"]) == (
        2048, True, 4096, False, "out of memory")
    assert ok["step_mem_gib"] <= 0.5 < failed["step_mem_gib"]
    assert (cosine["limit"], cosine["first_failure"]) == (2048, 4096)

    (refused,) = report["variants"]["cosine-kernel"]["attempts"]
    assert (refused["ok"], refused["reason"]) == (False, "refused") and "use_cuda_kernel" in refused["detail"]
    md = out.with_suffix(".md").read_text()
    assert f"| cosine | {cosine['limit']:,} |" in md and "| cosine-kernel | none |" in md
    assert report["model"] == {"n_layer": 1, "n_head": 2, "n_kv_head": 2, "n_embd": 32}


def test_context_limit_reports_timeouts_and_its_time_limit(tmp_path):
    timed = tmp_path / "timeout"
    assert context_limit.main(["--device", "cpu", "--variants", "softmax", "--timeout", "0.2", "--max-seq-len", "1024",
                               "--out", str(timed)]) == 0
    (tried,) = json.loads(timed.with_suffix(".json").read_text())["variants"]["softmax"]["attempts"]
    assert (tried["seq_len"], tried["ok"], tried["reason"]) == (1024, False, "timeout")

    stopped = tmp_path / "stopped"
    assert context_limit.main(["--device", "cpu", "--variants", "softmax,cosine", "--time-limit", "1e-9",
                               "--out", str(stopped)]) == 0
    variants = json.loads(stopped.with_suffix(".json").read_text())["variants"]
    assert all(v["attempts"] == [] and v["stopped"] == "search stopped by --time-limit" for v in variants.values())
    assert "| softmax | not searched |" in stopped.with_suffix(".md").read_text()
