#!/usr/bin/env bash
# One call on the lent GPU machine: install carried wheels, build the kernels, run the GPU tests, a
# compute-sanitizer pass on a small case, and a quick timing against SDPA. Logs go to $OUT (or ./out).
#
#   bash scripts/gpu_check.sh                       # everything
#   ATTN_DTYPES=bf16 ATTN_HEADDIMS=64 bash scripts/gpu_check.sh    # a narrowed development build
#   STEPS="build timing" bash scripts/gpu_check.sh  # a subset of: wheels build tests sanitizer timing profile
#                                                     suite bench throughput context compare ddp
#   TESTS="tests/test_cuda_kernels.py -k layouts"   # what pytest runs (default: every GPU test)
#   PROFILE_SOURCE=1 STEPS="build profile"          # also per-instruction stall counts (ncu_source.csv)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
STEPS=${STEPS:-wheels build tests sanitizer timing}
TESTS=${TESTS:-tests}
export PYTHONUNBUFFERED=1
status=0
step() { [[ " $STEPS " == *" $1 "* ]]; }
say() { echo "== $(date +%T) $*"; }

if step wheels && [ -d .carry/whl ]; then
  say "wheels"
  python3 -m pip install -q --no-index --find-links .carry/whl wandb flash-linear-attention > "$OUT/wheels.log" 2>&1 \
    || echo "wheel install failed (see wheels.log)"
fi

if step build; then
  say "build (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} ATTN_DTYPES=${ATTN_DTYPES:-all} ATTN_HEADDIMS=${ATTN_HEADDIMS:-all})"
  # From scratch: a machine kept warm between calls keeps the last call's objects, which can be newer
  # than the sources copied in (their times are kept), so an incremental build may keep stale kernels.
  rm -rf build attention_cuda/_C*.so
  # The lent H200's CXX (/opt/gcc/bin/g++, a wrapper) built an extension with no libstdc++.so among its
  # libraries, in which a TORCH_CHECK message that formats a number crashed the process (segfault)
  # instead of raising; the system g++ links libstdc++.so and the errors raise (bench/NOTES.md run 23).
  [ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
  # ptxas -v: its register and spill lines, and its remarks on serialised wgmmas (C7515 and the like),
  # appear only with it; build.log then holds them for the grep below.
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} \
    NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -Xptxas=-v" python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
  if [ $? -ne 0 ]; then
    grep -m 20 -iE "error|undefined" "$OUT/build.log"
    echo "BUILD FAILED (build.log)"
    exit 1
  fi
  # setup.py installs pure Python when the kernels fail to compile, and exits 0.
  if ! ls attention_cuda/_C*.so > /dev/null 2>&1; then
    grep -m 20 -E "error" "$OUT/build.log"
    echo "BUILD FAILED: no attention_cuda/_C (build.log)"
    exit 1
  fi
  grep -E "ptxas (warning|error)|C751[0-9]" "$OUT/build.log" | sort | uniq -c | head -20
  # Nonzero spills, each with its kernel (ptxas names the function on the line before its counts).
  awk '/Function properties for/ { f = $NF } / [1-9][0-9]* bytes spill/ { print f ":" $0 }' "$OUT/build.log" \
    | (c++filt 2>/dev/null || cat) | sort | uniq -c | head -40
fi

if step tests; then
  say "pytest -m gpu $TESTS"
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors --timeout=300 --tb=short -rfE $TESTS > "$OUT/pytest.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | cut -c1-220 | head -40
  tail -n 1 "$OUT/pytest.log"
fi

if step sanitizer; then
  # Every kernel family and flag once, small; without the caching allocator so that any access past
  # a tensor's end is outside an allocation.
  case='
import torch
from attention_cuda import Tuning, cosine_sim_attention, exp_attention, fastmax_attention, rotary_qkv
torch.manual_seed(0)
for dt, d in ((torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 32)):
    qkv = torch.randn(2, 70, (4 + 2 * 2) * d, device="cuda", dtype=dt, requires_grad=True)
    angles = torch.randn(70, d // 2, device="cuda")
    rq, rk, rv = rotary_qkv(qkv, angles.cos(), angles.sin(), heads=4, kv_heads=2, backend="cuda")
    torch.autograd.grad(rq.float().sum() + 2 * rk.float().sum() + 3 * rv.float().sum(), qkv)
    q = torch.randn(2, 4, 70, d, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(2, 2, 150, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    bias = torch.randn(4, 70, 150, device="cuda", dtype=dt, requires_grad=True)
    mask = torch.rand(2, 150, device="cuda") > 0.3
    outs = [cosine_sim_attention(q, k, v, causal=True, mask=mask, attn_bias=bias, backend="cuda"),
            cosine_sim_attention(q, k, v, backend="cuda"),
            exp_attention(q, k, v, scale=0.1, mask=mask, backend="cuda"),
            fastmax_attention(q, k, v, causal=True, normalize=True, form="quadratic", backend="cuda")]
    if dt != torch.float32:  # the linear form (fp16/bf16): 150 keys make two chunks of moments, on the
        for rows in (0, 128):  # sweep and (sm_90a) on the chunked kernels
            tuning = Tuning(chunked_rows=rows)
            outs += [fastmax_attention(q, k, v, causal=True, form="linear", backend="cuda", tuning=tuning),
                     fastmax_attention(q, k, v, mask=mask, temperature=8.0, form="linear", backend="cuda",
                                       tuning=tuning)]
    torch.autograd.grad(sum(o.float().sum() for o in outs), (q, k, v, bias))
    with torch.no_grad():  # one query row a head, forward only: the decode kernel
        cosine_sim_attention(q[:, :, :1].detach(), k.detach(), v.detach(), mask=mask, backend="cuda")
torch.cuda.synchronize()
print("sanitizer case ran")
'
  for tool in memcheck racecheck; do
    say "compute-sanitizer --tool $tool"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 9 \
      --kernel-name kns=attn python3 -c "$case" > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitizer case ran|Error" "$OUT/sanitizer_$tool.log" | sort | uniq -c | head -8
    [ $rc -ne 0 ] && { echo "$tool: exit $rc"; status=1; }
  done
fi

if step timing; then
  say "timing (bf16 unless noted; ms, median of CUDA-event timings; sdpa = flash on l2-normalised q, k)"
  python3 - <<'EOF' 2>&1 | tee "$OUT/timing.txt"
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from attention_cuda import cosine_sim_attention


def bench(fn, reps=10):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def case(b, h, n, d, causal, dtype=torch.bfloat16, baseline=SDPBackend.FLASH_ATTENTION):
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, n, d, device="cuda", dtype=dtype)

    def ours():
        return cosine_sim_attention(q, k, v, causal=causal, backend="cuda")

    def sdpa():
        with sdpa_kernel(baseline):
            return F.scaled_dot_product_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v,
                                                  is_causal=causal, scale=10.0)

    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    for name, fn in (("fwd", lambda f: f()), ("fwd+bwd", lambda f: torch.autograd.grad(f(), (q, k, v), dout))):
        with torch.no_grad() if name == "fwd" else torch.enable_grad():
            t_ours, t_base = bench(lambda: fn(ours)), bench(lambda: fn(sdpa))
        mult = 1 if name == "fwd" else 3.5
        print(f"{str(dtype)[6:]:>8} b{b} h{h} n{n:<6} d{d:<4} {'causal' if causal else '      '} {name:<8}"
              f" ours {t_ours:7.3f} ms ({mult * flops / t_ours / 1e9:4.0f} TF)  {baseline.name.lower()[:5]}"
              f" {t_base:7.3f} ms  ratio {t_ours / t_base:5.2f}")


for n in (4096, 8192, 16384):
    for causal in (False, True):
        case(4, 8, n, 64, causal)
for causal in (False, True):
    case(1, 32, 4096, 128, causal)
case(4, 8, 8192, 64, False, torch.float16)
case(4, 8, 8192, 64, False, torch.float32, SDPBackend.EFFICIENT_ATTENTION)
EOF
fi
if step profile; then
  # Hardware counters of the launches of one bf16 case per kernel (b4 h8 n8192 d64 forward and
  # backward, b1 h32 n4096 d128 forward): throughput, pipe use and why warps stall; then every
  # kernel's time in back-to-back calls, and the SASS instruction mix of the Hopper kernels (HGMMA/HMMA,
  # MUFU, LDGSTS/UTMALDG).
  case='
import torch
from attention_cuda import cosine_sim_attention
q, k, v = (torch.randn(4, 8, 8192, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.autograd.grad(cosine_sim_attention(q, k, v, backend="cuda"), (q, k, v), torch.randn_like(q))
q, k, v = (torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
cosine_sim_attention(q, k, v, backend="cuda")
torch.cuda.synchronize()
'
  say "ncu"
  kernels='regex:fwd_kernel|fwd_sm90|bwd_kernel|bwd_sm90|rnorm'
  ncu --clock-control none -k "$kernels" --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section InstructionStats python3 -c "$case" \
    > "$OUT/ncu_sections.txt" 2>&1
  ncu --clock-control none -k "$kernels" \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 -c "$case" > "$OUT/ncu_stalls.txt" 2>&1
  grep -E "attn::|Throughput|Pipe|Issue|Warp Cycles|Eligible|Bank|Duration|Executed Ipc" "$OUT/ncu_sections.txt" | cut -c1-150 | head -90
  grep -E "attn::|stalled" "$OUT/ncu_stalls.txt" | awk '$NF+0 > 0.05 || /attn::/' | cut -c1-150 | head -80
  if [ -n "${PROFILE_SOURCE:-}" ]; then
    # Where the warps stall, per SASS instruction (one launch of each kernel): $OUT/ncu_source.csv.
    say "ncu source counters"
    ncu --clock-control none -k "$kernels" -c 3 --section SourceCounters -f -o "$OUT/src" python3 -c "$case" \
      > /dev/null 2>&1
    ncu -i "$OUT/src.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source.csv" 2>&1
    rm -f "$OUT/src.ncu-rep"
    wc -l "$OUT/ncu_source.csv"
  fi
  say "kernel times, 5 fwd+bwd calls back to back (PyTorch profiler: ncu's times of short kernels are not usable here)"
  python3 - <<'PY' 2>&1 | grep -E "attn::|elementwise" | cut -c1-60,100-175
import torch
from torch.profiler import ProfilerActivity, profile
from attention_cuda import cosine_sim_attention
q, k, v = (torch.randn(4, 8, 8192, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn_like(q)
for _ in range(3):
    cosine_sim_attention(q, k, v, backend="cuda").backward(g)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        cosine_sim_attention(q, k, v, backend="cuda").backward(g)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
PY
  say "SASS instruction mix"
  for so in attention_cuda/_C*.so; do cuobjdump --dump-sass "$so"; done > "$OUT/sass.txt" 2>&1
  awk '/Function :/ {f=$3} /HGMMA|HMMA|MUFU.EX2|LDGSTS|UTMALDG|BAR.SYNC|SYNCS/ {
         match($0, /(HGMMA|HMMA|MUFU.EX2|LDGSTS|UTMALDG|BAR.SYNC|SYNCS)[.A-Z0-9_]*/); n[f" "substr($0, RSTART, RLENGTH)]++ }
       END {for (k in n) print n[k], k}' "$OUT/sass.txt" | grep -E "fwd_sm90|bwd_sm90" | sort -k2 | cut -c1-200 | head -40
fi
if step suite; then
  # The CPU-side suite (model, training, data, references) on the GPU machine: bf16 autocast paths
  # and CUDA devices are what it meets there.
  say "pytest -m 'not gpu'"
  python3 -m pytest -q -m "not gpu" -p no:cacheprovider --tb=short -rfE tests > "$OUT/suite.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | cut -c1-220 | head -20
  tail -n 1 "$OUT/suite.log"
fi

if step bench; then
  # The committed benchmark results: BENCH lists benchmark.py presets (each writes bench_<preset>.txt/.json).
  for preset in ${BENCH:-seeds}; do
    say "benchmark.py --preset $preset"
    python3 benchmark.py --preset "$preset" ${BENCH_ARGS:-} --json "$OUT/results_$preset.json" > "$OUT/bench_$preset.txt" 2>&1 \
      || { echo "benchmark $preset failed"; status=1; }
    tail -n 40 "$OUT/bench_$preset.txt"
  done
fi
# Training-level runs (configs/base, bf16): the numbers bench/ keeps for the long-context issue.
DATA=${DATA:-.carry/data/enwik8-first4mb}
if step throughput; then
  say "throughput.py ${THROUGHPUT_ARGS:-}"
  # shellcheck disable=SC2086
  python3 scripts/throughput.py --out "$OUT/throughput" ${THROUGHPUT_ARGS:-} > "$OUT/throughput.log" 2>&1 || status=1
  tail -n 12 "$OUT/throughput.log"
fi
if step context; then
  say "context_limit.py ${CONTEXT_ARGS:-}"
  # shellcheck disable=SC2086
  python3 scripts/context_limit.py --out "$OUT/context_limit" ${CONTEXT_ARGS:-} > "$OUT/context_limit.log" 2>&1 || status=1
  tail -n 12 "$OUT/context_limit.log"
fi
if step compare; then
  say "compare.py ${COMPARE_ARGS:-}"
  # shellcheck disable=SC2086
  python3 compare.py --data-path "$DATA" --wandb-mode offline --out "$OUT/compare" ${COMPARE_ARGS:-} \
    > "$OUT/compare.log" 2>&1 || status=1
  tail -n 25 "$OUT/compare.log"
fi
if step ddp; then
  # Data-parallel scaling: the same global batch (2 micro-steps of 8 x 8192) on 1 GPU and on 2.
  say "DDP: tokens/s on 1 and 2 GPUs (configs/base, seq 8192, cosine on our kernel)"
  common="--config configs/base --seq_len 8192 --batch_size 8 --grad_accum_steps 2 --max_iters 30 --warmup_iters 2
    --eval_interval 1000 --ckpt_interval 1000 --final_eval_max_windows 2 --sample_tokens 0 --use-cuda-kernel
    --data-path $DATA --wandb-mode disabled --out_dir out/ddp"
  # shellcheck disable=SC2086
  python3 train.py $common --run_name gpus1 > "$OUT/ddp_1gpu.log" 2>&1 || status=1
  # shellcheck disable=SC2086
  torchrun --standalone --nproc_per_node=2 train.py $common --run_name gpus2 > "$OUT/ddp_2gpu.log" 2>&1 || status=1
  python3 - <<'EOF'
import json, statistics
rate = {}
for n in (1, 2):
    rows = [json.loads(line) for line in open(f"out/ddp/gpus{n}/metrics.jsonl")]
    rate[n] = statistics.median(r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r and r["step"] > 5)
    print(f"{n} GPU(s): {rate[n]:,.0f} tokens/s (median over steps 6-30)")
print(f"scaling: {rate[2] / rate[1]:.2f}x")
EOF
fi
say "done (status $status)"
exit $status
