"""bench/tables.py: the results tables in README.md and docs/*.md equal what the committed result files
give, so a number in the docs cannot drift from its file; and the script refuses, naming the file, to
write a table from data that is not there."""
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_tables():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


tables = _load_tables()
INPUTS = tables.inputs(ROOT)


def test_committed_docs_equal_the_generated_tables(capsys):
    # On failure the captured stderr holds the diff; the fix is `python bench/tables.py` and a commit.
    assert tables.run(ROOT, check=True) == 0, capsys.readouterr().err


def test_the_script_runs_from_the_command_line():
    done = subprocess.run([sys.executable, "bench/tables.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_table_is_placed_and_reads_files():
    placed = set()
    for doc in tables.documents(ROOT):
        placed.update(tables.render(doc, ROOT)[1])
    assert placed == set(tables.TABLES)
    assert "bench/results_seeds.json" in INPUTS and "bench/compare/results.json" in INPUTS


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the documents and bench/ to break."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "bench", tmp_path / "bench", ignore=shutil.ignore_patterns("*.png", "*.txt"))
    return tmp_path


def _docs(root: Path) -> dict:
    return {p: p.read_text() for p in tables.documents(root)}


@pytest.mark.parametrize("rel", INPUTS)
def test_a_missing_result_file_fails_loudly_and_writes_nothing(tree, rel, capsys):
    (tree / rel).unlink()
    # Make every document stale first, so a partial write would show.
    readme = tree / "README.md"
    readme.write_text(readme.read_text().replace("| 4,096 |", "| 4,095 |", 1))
    before = _docs(tree)
    for args in (["--check"], []):
        assert tables.main([*args, "--root", str(tree)]) == 2
        err = capsys.readouterr().err
        assert rel in err and "missing" in err
    assert _docs(tree) == before


def test_a_result_file_of_another_shape_is_named(tree, capsys):
    path = tree / "bench" / "compare" / "results.json"
    data = json.loads(path.read_text())
    del data["runs"][0]["final_val_bpc"]
    path.write_text(json.dumps(data))
    assert tables.main(["--check", "--root", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "bench/compare/results.json" in err and "final_val_bpc" in err


def test_a_measurement_the_file_lacks_is_named(tree, capsys):
    path = tree / "bench" / "results_seeds.json"
    data = json.loads(path.read_text())
    data["measurements"] = [m for m in data["measurements"]
                            if not (m["impl"] == "cudnn" and m["seq_len"] == 8192 and m["pass"] == "fwd+bwd")]
    path.write_text(json.dumps(data))
    assert tables.main(["--check", "--root", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "bench/results_seeds.json" in err and "impl=cudnn" in err and "seq_len=8192" in err


def test_a_drifted_number_is_reported_then_regenerated(tree, capsys):
    readme = tree / "README.md"
    text = readme.read_text()
    start = text.index("<!-- table:cosine-headline -->")
    row = text.index("| 8,192 |", start)
    ratio = re.search(r"\d\.\d\d", text[row:]).group()  # the row's first ratio, drifted to 9.99
    readme.write_text(text[:row] + text[row:].replace(ratio, "9.99", 1))
    assert tables.main(["--check", "--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert "README.md" in err and "9.99" in err and ratio in err
    assert tables.main(["--root", str(tree)]) == 0
    assert readme.read_text() == text
    assert tables.main(["--check", "--root", str(tree)]) == 0


@pytest.mark.parametrize("mangle, message", [
    (lambda t: t + "\n<!-- table:no-such-table -->\n<!-- /table -->\n", "unknown table 'no-such-table'"),
    (lambda t: t.replace("<!-- /table -->", "", 1), "has no"),
    (lambda t: t + "\n<!-- /table -->\n", "out of place"),
    (lambda t: (lambda i: t[:i] + t[i:].replace("<!-- table:fastmax-causal -->", "", 1).replace("<!-- /table -->", "", 1))(
        t.index("<!-- table:fastmax-causal -->")), "placed in no document"),
])
def test_bad_markers_are_refused(tree, mangle, message, capsys):
    readme = tree / "README.md"
    readme.write_text(mangle(readme.read_text()))
    assert tables.main(["--check", "--root", str(tree)]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# The documents around the tables: their links resolve, and so do the decision records code cites.

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


DOCS = [ROOT / "README.md", ROOT / "bench" / "NOTES.md", ROOT / "bench" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench" / "notes").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = [_slug(line.lstrip("#")) for line in dest.read_text().split("\n") if line.startswith("#")]
            if anchor not in headings:
                broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to nothing: {broken}"


def test_decision_records_cited_in_code_exist():
    cited = set()
    for ext in ("py", "sh", "cu", "cuh", "h", "cpp", "md"):
        for path in ROOT.rglob(f"*.{ext}"):
            parts = path.relative_to(ROOT).parts
            if any(part.startswith(".") or part in ("wandb", "out", "build") for part in parts):
                continue  # not the project's sources
            cited.update(re.findall(r"bench/notes/(run-\d+\.md|[a-z]+\.md)", path.read_text(errors="replace")))
    missing = sorted(name for name in cited if not (ROOT / "bench" / "notes" / name).is_file())
    assert cited and not missing, f"cited but not in bench/notes/: {missing}"


def test_notes_index_lists_every_record():
    index = (ROOT / "bench" / "NOTES.md").read_text()
    records = sorted(p.name for p in (ROOT / "bench" / "notes").glob("*.md"))
    assert records and all(f"notes/{name}" in index for name in records)
