#!/usr/bin/env bash
# One call of the study on a lent GPU machine, resumable across calls and machines: the runs finished in
# earlier calls travel in as a tarball, compare.py goes on from them for --time-limit seconds, and what is
# finished then travels back with the report: each run's result.json, which holds all the report reads (the
# summary of its metrics.jsonl, its evaluation.json), and its study.log; not the per-step metrics.jsonl nor the
# checkpoints, which would outgrow the 64 MiB a call may carry. A run the deadline cuts short starts again in
# the next call.
#
#   carry .carry (wheels, data) and run:
#   TIME_LIMIT=420 bash scripts/study_call.sh [compare.py options]
#   then, here: cp <files_at>/study.tgz bench/runs/study-progress.tgz (tracked, so it travels with the tree:
#   one copy, where a second in .carry would crowd the 64 MiB a call may carry)
#
# Environment: STUDY_TGZ (default bench/runs/study-progress.tgz), RUNS (default /tmp/runs), NAME (default study),
# TIME_LIMIT (seconds for compare.py, default 420), OUT (where the tarball and report go; default out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
RUNS=${RUNS:-/tmp/runs}
NAME=${NAME:-study}
STUDY_TGZ=${STUDY_TGZ:-bench/runs/study-progress.tgz}
mkdir -p "$OUT" "$RUNS/$NAME"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
say() { echo "== $(date +%T) $*"; }

if [ -d .carry/whl ]; then
  python3 -m pip install -q --no-index --find-links .carry/whl wandb > "$OUT/wheels.log" 2>&1 \
    || echo "wheel install failed (see wheels.log)"
fi
if ! ls attention_cuda/_C*.so > /dev/null 2>&1; then
  say "build"
  [ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} \
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
fi
if [ -f "$STUDY_TGZ" ]; then
  tar -xzf "$STUDY_TGZ" -C "$RUNS/$NAME"
  say "carried in: $(ls "$RUNS/$NAME" | wc -l) runs"
fi
say "compare.py $*"
# --wandb-mode offline: the lent machines reach no network, and the mode is part of every run's command, which
# must be the same in every call for the runs carried in to count.
python3 compare.py --runs-dir "$RUNS" --name "$NAME" --out "$OUT/report" --time-limit "${TIME_LIMIT:-420}" \
  --wandb-mode offline "$@" \
  > "$OUT/compare.log" 2>&1
code=$?
tail -n 30 "$OUT/compare.log"
# Finished runs only: a run without an ok result.json is run again from scratch by the next call.
(cd "$RUNS/$NAME" && grep -l '"status": "ok"' -- */result.json 2>/dev/null | xargs -r -n1 dirname \
  | while read -r run; do ls "$run"/result.json "$run"/study.log \
      "$run"/throughput.json "$run"/throughput.md 2>/dev/null; done) > "$OUT/carried.txt"
tar -czf "$OUT/study.tgz" -C "$RUNS/$NAME" -T "$OUT/carried.txt"
say "carried out: $(wc -l < "$OUT/carried.txt") files, $(du -h "$OUT/study.tgz" | cut -f1)"
exit $code
