#!/usr/bin/env bash
# Builds the FlashAttention-3 baseline of benchmark.py (`--impls fa3`) where no FA3 wheel can be installed:
# only its Hopper kernels for bf16 at head dims 64 and 128 (forward and backward, no split, paged, local,
# softcap, varlen or GQA packing), against torch's stable ABI, so that a build made with one torch (>= 2.9)
# loads in another. The kernels need no torch and compile on a machine without a GPU.
#
#   bash bench/fa3_build.sh FLASH_ATTENTION_DIR CUTLASS_DIR OUT_DIR
#   PYTHONPATH=OUT_DIR python benchmark.py --impls ours,cudnn,fa3 ...
#
# FLASH_ATTENTION_DIR: a checkout of Dao-AILab/flash-attention (its hopper/ directory is used); CUTLASS_DIR:
# NVIDIA/cutlass at the commit that checkout pins as csrc/cutlass. PYTHON (default python3) must import torch;
# NVCC (default nvcc) must target sm_90a; CUDA_HOME (default /usr/local/cuda) holds its headers and static
# runtime. Session 46 built flash-attention 0251105 with CUTLASS 7127592, nvcc 13.0 and torch 2.14, and ran it
# under torch 2.11 (bench/notes/run-45.md).
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: bash bench/fa3_build.sh FLASH_ATTENTION_DIR CUTLASS_DIR OUT_DIR" >&2
  exit 2
fi
SRC=$(cd "$1/hopper" && pwd) || { echo "FLASH_ATTENTION_DIR: no hopper/ directory in $1" >&2; exit 2; }
CUTLASS=$(cd "$2/include" && pwd) || { echo "CUTLASS_DIR: no include/ directory in $2" >&2; exit 2; }
OUT=$3
PYTHON=${PYTHON:-python3}
NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-2}
[ -f "$SRC/flash_api_stable.cpp" ] || { echo "$SRC has no flash_api_stable.cpp (an older FA3)" >&2; exit 2; }

DISABLED="SPLIT PAGEDKV APPENDKV LOCAL SOFTCAP PACKGQA FP16 FP8 VARLEN CLUSTER HDIM96 HDIM192 HDIM256 SM8x
          HDIMDIFF64 HDIMDIFF192"
FEATURES=$(for f in $DISABLED; do printf -- "-DFLASHATTENTION_DISABLE_%s " "$f"; done)
# torch's extension flags for nvcc, and FA3's own (hopper/setup.py)
NVCC_FLAGS="-O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr --expt-extended-lambda
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__ -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DCUTLASS_ENABLE_GDC_FOR_SM90
  -DCUTLASS_DEBUG_TRACE_LEVEL=0 -DNDEBUG -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC"
SOURCES="flash_prepare_scheduler.cu instantiations/flash_bwd_hdim64_bf16_sm90.cu
  instantiations/flash_bwd_hdim128_bf16_sm90.cu instantiations/flash_fwd_hdim64_bf16_sm90.cu
  instantiations/flash_fwd_hdim128_bf16_sm90.cu"

OBJ="$OUT/obj"
mkdir -p "$OBJ" "$OUT/flash_attn_3"
export SRC CUTLASS OBJ NVCC NVCC_FLAGS FEATURES
compile() {  # skipped where an object newer than its source is there (a rerun after a failed link)
  local obj
  obj="$OBJ/$(basename "$1" .cu).o"
  [ "$obj" -nt "$SRC/$1" ] && return 0
  # shellcheck disable=SC2086
  "$NVCC" $NVCC_FLAGS $FEATURES -I"$SRC" -I"$CUTLASS" -c "$SRC/$1" -o "$obj.tmp" && mv "$obj.tmp" "$obj"
}
export -f compile
echo "compiling $(echo $SOURCES | wc -w) kernel files, $JOBS at a time (minutes each)"
printf "%s\n" $SOURCES | xargs -P "$JOBS" -I{} bash -c 'compile {}'

TORCH=$("$PYTHON" -c "import os, torch; print(os.path.dirname(torch.__file__))")
PYINC=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -f "$CUDA_HOME/include/cuda_runtime_api.h" ] \
  || { echo "CUDA_HOME=$CUDA_HOME has no CUDA headers: set CUDA_HOME" >&2; exit 2; }
# shellcheck disable=SC2086
g++ -O3 -std=c++17 -fPIC -DPy_LIMITED_API=0x03090000 -DTORCH_TARGET_VERSION=0x0209000000000000 $FEATURES \
  -DNDEBUG -I"$SRC" -I"$CUTLASS" -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include" -I"$PYINC" \
  -I"$CUDA_HOME/include" -c "$SRC/flash_api_stable.cpp" -o "$OBJ/flash_api_stable.o" 2> "$OBJ/api.log" \
  || { cat "$OBJ/api.log" >&2; exit 1; }
# torch's libraries resolve by soname against the torch that imports the module
g++ -shared -o "$OUT/flash_attn_3/_C.abi3.so" "$OBJ"/*.o -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lpthread \
  -L"$TORCH/lib" -ltorch -ltorch_cpu -ltorch_cuda -lc10 -lc10_cuda

cp "$SRC/flash_attn_interface.py" "$OUT/"
cp "$SRC/flash_attn_3/__init__.py" "$OUT/flash_attn_3/"
"$PYTHON" - "$OUT" "$DISABLED" "$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'PY'
import os, sys
out, disabled, commit = sys.argv[1], sys.argv[2].split(), sys.argv[3]
flags = {f"FLASHATTENTION_DISABLE_{f}": True for f in disabled}
flags.update({f"FLASHATTENTION_DISABLE_{f}": False for f in ("BACKWARD", "HDIM64", "HDIM128")})
flags["FLASHATTENTION_ENABLE_VCOLMAJOR"] = False
with open(os.path.join(out, "flash_attn_config.py"), "w") as f:
    f.write(f"# the build flags of bench/fa3_build.sh\nCONFIG = {{'build_flags': {flags!r}}}\n")
meta = os.path.join(out, f"flash_attn_3-3.0.0+{commit}.dist-info")
os.makedirs(meta, exist_ok=True)
with open(os.path.join(meta, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: flash_attn_3\nVersion: 3.0.0+{commit}\n")
PY
echo "built $OUT (PYTHONPATH=$OUT)"
