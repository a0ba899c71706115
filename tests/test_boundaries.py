"""The library's boundary, read from the source: code outside attention_cuda uses its public API only (what the
package exports, and attention_cuda.context_parallel), and one module calls the compiled ops.

tests/ and scripts/probes/ are left out of the first rule: they test and probe the kernels' internals."""
import ast
import subprocess
from pathlib import Path

import attention_cuda

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "attention_cuda"
PUBLIC_MODULES = {"attention_cuda", "attention_cuda.context_parallel"}
INTERNAL_USERS = ("tests/", "scripts/probes/")


def python_files():
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
    return [ROOT / line for line in tracked.stdout.split()]


def is_submodule(name: str) -> bool:
    return (LIBRARY / f"{name}.py").is_file() or (LIBRARY / name / "__init__.py").is_file()


def library_modules_used(tree: ast.AST) -> set[str]:
    """Every attention_cuda module a file imports or reaches by attribute (attention_cuda._kernels.x)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names if a.name.split(".")[0] == "attention_cuda"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "attention_cuda":
            used.add(node.module)
            if node.module == "attention_cuda":  # a name the package does not export that is a module is one
                used |= {f"attention_cuda.{a.name}" for a in node.names
                         if a.name not in attention_cuda.__all__ and is_submodule(a.name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "attention_cuda" and node.attr not in attention_cuda.__all__ \
                and is_submodule(node.attr):
            used.add(f"attention_cuda.{node.attr}")
    return used


def test_no_module_outside_the_library_imports_its_private_modules():
    outside = [f for f in python_files() if LIBRARY not in f.parents
               and not f.relative_to(ROOT).as_posix().startswith(INTERNAL_USERS)]
    assert len(outside) > 20  # the walk sees the product: model/, lab/, study/, scripts, train.py, ...
    crossings = {f"{f.relative_to(ROOT)}: {module}" for f in outside
                 for module in library_modules_used(ast.parse(f.read_text(), str(f))) - PUBLIC_MODULES}
    assert not crossings, "private attention_cuda modules used outside the library:\n" + "\n".join(sorted(crossings))


def test_the_walk_sees_each_way_of_reaching_a_private_module():
    source = ("import attention_cuda._kernels\nfrom attention_cuda.plan import resolve\n"
              "from attention_cuda import _ops, plan, cosine_sim_attention\nimport attention_cuda\n"
              "attention_cuda.reference.quadratic\n")
    assert library_modules_used(ast.parse(source)) == {
        "attention_cuda._kernels", "attention_cuda.plan", "attention_cuda", "attention_cuda._ops",
        "attention_cuda.reference"}  # `plan` from the package is its exported function


def test_only_the_ops_module_calls_the_compiled_ops():
    callers = [f.relative_to(ROOT).as_posix() for f in python_files()
               if not f.relative_to(ROOT).as_posix().startswith("tests/") and "torch.ops.attn_cuda" in f.read_text()]
    assert callers == ["attention_cuda/_ops.py"]
