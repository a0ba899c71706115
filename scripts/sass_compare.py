"""Per-kernel comparison of two scripts/sass.sh outputs: python3 scripts/sass_compare.py BASE_OUT OTHER_OUT.
Keys are (TU, arch, kernel); prints counts, then each kernel that differs or is in one only, then ptxas.txt's diff."""
import difflib
import sys
from pathlib import Path


def kernels(out):
    ks = {}
    for f in sorted(Path(out, "sass").glob("*.sass")):
        tu, arch = f.stem.rsplit(".", 1)
        for block in f.read_text().split("Function : ")[1:]:
            name, _, body = block.partition("\n")
            ks[(tu, arch, name)] = body
    return ks


a, b = kernels(sys.argv[1]), kernels(sys.argv[2])
same = [k for k in a if k in b and a[k] == b[k]]
diff = [k for k in a if k in b and a[k] != b[k]]
only_a, only_b = [k for k in a if k not in b], [k for k in b if k not in a]
print(f"kernels: {len(a)} vs {len(b)}; identical {len(same)}, different {len(diff)}, "
      f"only in {sys.argv[1]} {len(only_a)}, only in {sys.argv[2]} {len(only_b)}")
for k in diff:
    print("DIFFERENT", *k)
for k in only_a:
    print("ONLY IN A", *k)
for k in only_b:
    print("ONLY IN B", *k)
pa, pb = (Path(o, "ptxas.txt").read_text().splitlines() for o in sys.argv[1:3])
d = list(difflib.unified_diff(pa, pb, "A/ptxas.txt", "B/ptxas.txt", lineterm="", n=0))
print(f"ptxas.txt: {len(pa)} lines vs {len(pb)}, " + ("identical" if not d else "differ:"))
print("\n".join(d))
