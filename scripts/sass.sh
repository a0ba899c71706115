#!/bin/bash
# The SASS of every kernel of a tree's attention_cuda build, without a GPU: each translation unit of its build
# list (build.py: sources(), include_dirs(), nvcc_flags("8.0;9.0a")) compiled with nvcc for sm_80 and sm_90a, as
# setup.py's default TORCH_CUDA_ARCH_LIST builds them, with torch's COMMON_NVCC_FLAGS; then one file per (TU,
# arch) of its kernels' SASS with their encodings (addresses and anonymous-namespace hashes stripped), and
# ptxas -v's register and spill lines in ptxas.txt. Two trees' outputs compare kernel by kernel with
# scripts/sass_compare.py: what "SASS unchanged" means in bench/NOTES.md.
#
#   bash scripts/sass.sh TREE OUT        # TREE holds attention_cuda/ (e.g. `git archive BASE | tar -x -C /tmp/base`)
#   python3 scripts/sass_compare.py BASE_OUT OUT
#
# Needs nvcc and cuobjdump. Without a CUDA toolkit's cuobjdump (the CPU machine has nvcc alone):
#   pip install --target /tmp/cuda-tools nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, then
#   CUDA_TOOLS=/tmp/cuda-tools/nvidia/cu13/bin bash scripts/sass.sh ...
# About 25 minutes on 2 cores for the full build (JOBS parallel compiles, default 2).
set -euo pipefail
export PATH=${CUDA_TOOLS:+$CUDA_TOOLS:}$PATH
TREE=$(realpath "$1"); OUT=$(realpath -m "$2"); JOBS=${JOBS:-2}
mkdir -p "$OUT/obj" "$OUT/log" "$OUT/sass"
python3 - "$TREE" "$OUT" > "$OUT/commands.txt" <<'EOF'
import importlib.util, shlex, sys
from pathlib import Path
tree, out = Path(sys.argv[1]), Path(sys.argv[2])
spec = importlib.util.spec_from_file_location("b", tree / "attention_cuda" / "build.py")
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
common = ['-D__CUDA_NO_HALF_OPERATORS__', '-D__CUDA_NO_HALF_CONVERSIONS__', '-D__CUDA_NO_BFLOAT16_CONVERSIONS__',
          '-D__CUDA_NO_HALF2_OPERATORS__', '--expt-relaxed-constexpr', '-std=c++17']
inc = [f"-I{d}" for d in b.include_dirs(tree / "attention_cuda" / "csrc")]
for src in b.sources(out / "gen", tree / "attention_cuda" / "csrc"):
    if src.suffix != ".cu":
        continue  # binding.cpp: host code only
    cmd = ["nvcc", "-c", *common, *inc, *b.nvcc_flags("8.0;9.0a", tree / "attention_cuda" / "csrc"),
           "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           str(src), "-o", str(out / "obj" / (src.stem + ".o"))]
    print(f"{' '.join(map(shlex.quote, cmd))} > {out}/log/{src.stem}.txt 2>&1")
EOF
xargs -P "$JOBS" -I{} -d '\n' bash -c '{} || { echo "FAILED: {}" >&2; exit 255; }' < "$OUT/commands.txt"
# One file per (TU, arch): its kernels sorted by name, each with its SASS and encodings (control codes too);
# instruction addresses and the per-TU hash of anonymous namespaces (it follows the file's path) dropped.
for o in "$OUT"/obj/*.o; do
  cuobjdump --dump-sass "$o" | python3 -c '
import re, sys
out, tu = sys.argv[1], sys.argv[2]
kernels, arch, name = {}, None, None
for ln in sys.stdin:
    m = re.match(r"\s*arch = (sm_\w+)", ln)
    if m:
        arch, name = m.group(1), None
        continue
    ln = re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}(?=\d)", "ANON", ln)
    m = re.match(r"\s*Function : (\S+)", ln)
    if m:
        name = m.group(1)
        kernels.setdefault(arch, {})[name] = []
        continue
    ln = re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).strip()
    if name and ln:
        kernels[arch][name].append(ln)
for arch, ks in kernels.items():
    with open(f"{out}/{tu}.{arch}.sass", "w") as f:
        for name in sorted(ks):
            f.write(f"Function : {name}\n" + "\n".join(ks[name]) + "\n\n")' "$OUT/sass" "$(basename "$o" .o)"
done
# ptxas -v: each function's "Used N registers" and spill lines, per TU and arch, sorted.
python3 - "$OUT" > "$OUT/ptxas.txt" <<'EOF2'
import re, sys
from pathlib import Path
rows = []
for f in sorted(Path(sys.argv[1], "log").glob("*.txt")):
    fn = arch = None
    for ln in f.read_text().splitlines():
        m = re.search(r"Compiling entry function '([^']*)' for '([^']*)'", ln)
        if m:
            fn, arch = m.groups()
        elif fn and re.search(r"Used \d+ registers|bytes spill", ln):
            name = re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}(?=\d)", "ANON", fn)
            rows.append(f"{f.stem} {arch} {name} {ln.split(':', 1)[-1].strip()}")
print("\n".join(sorted(rows)))
EOF2
echo "kernels: $(cat "$OUT"/sass/*.sass | grep -c "^Function :")"
