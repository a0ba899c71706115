"""scripts/crossovers.py: the plan's crossover table is what its committed results give, by its rule."""
import importlib.util
import json

from helpers import REPO

spec = importlib.util.spec_from_file_location("crossovers", REPO / "scripts" / "crossovers.py")
crossovers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crossovers)


def test_the_committed_table_is_what_its_sources_give():
    assert crossovers.main(["--check"]) == 0


def test_a_crossover_is_where_the_linear_form_wins_from_on_by_more_than_a_near_tie(tmp_path):
    """d64: linear wins from 8192 on (a near-tie at 4096 stays quadratic); d128: it wins at 4096, loses at 8192,
    wins from 16384 on, so from 16384; d32 never wins; the forward and training directions apart."""
    ratios = {64: {2048: 1.5, 4096: 0.98, 8192: 0.9, 16384: 0.5}, 128: {4096: 0.9, 8192: 1.1, 16384: 0.8},
              32: {4096: 1.2, 8192: 1.01}}
    rows = [{"family": "fastmax", "causal": True, "pass": direction, "dim_head": d, "seq_len": n, "impl": impl,
             "ms": (ratio if impl == "ours-linear" else 1.0) * (2 if direction == "fwd" else 1)}
            for d, by_len in ratios.items() for n, ratio in by_len.items() for impl in ("ours-quadratic", "ours-linear")
            for direction in ("fwd", "fwd+bwd")]
    rows[0] = {**rows[0], "ms": None}  # a run that did not happen is no measurement
    (tmp_path / "r.json").write_text(json.dumps({"measurements": rows}))
    table = crossovers.crossovers(["r.json"], root=tmp_path)
    assert table == {"fwd": {64: 8192, 128: 16384}, "fwd+bwd": {64: 8192, 128: 16384}}
