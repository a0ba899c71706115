"""scripts/sass_compare.py (what "SASS unchanged" is checked with): kernel by kernel, and ptxas's lines."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_compare.py"


def dump(out: Path, kernels: dict, ptxas: str) -> Path:
    (out / "sass").mkdir(parents=True)
    for (tu, arch), body in kernels.items():
        (out / "sass" / f"{tu}.{arch}.sass").write_text(body)
    (out / "ptxas.txt").write_text(ptxas)
    return out


def compare(a: Path, b: Path) -> str:
    return subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True,
                          check=True).stdout


def test_identical_different_and_missing_kernels_are_told_apart(tmp_path):
    base = dump(tmp_path / "a", {("f16_hd64", "sm_90a"): "Function : k1\nHMMA\n\nFunction : k2\nEXIT\n\n"},
                "f16_hd64 sm_90a k1 Used 90 registers\n")
    same = dump(tmp_path / "b", {("f16_hd64", "sm_90a"): "Function : k1\nHMMA\n\nFunction : k2\nEXIT\n\n"},
                "f16_hd64 sm_90a k1 Used 90 registers\n")
    assert "identical 2, different 0, only in" in compare(base, same) and "ptxas.txt: 1 lines vs 1, identical" in \
        compare(base, same)
    other = dump(tmp_path / "c", {("f16_hd64", "sm_90a"): "Function : k1\nHGMMA\n\nFunction : k3\nEXIT\n\n"},
                 "f16_hd64 sm_90a k1 Used 96 registers\n")
    report = compare(base, other)
    assert "identical 0, different 1" in report
    assert "DIFFERENT f16_hd64 sm_90a k1" in report and "ONLY IN A f16_hd64 sm_90a k2" in report
    assert "ONLY IN B f16_hd64 sm_90a k3" in report and "+f16_hd64 sm_90a k1 Used 96 registers" in report
