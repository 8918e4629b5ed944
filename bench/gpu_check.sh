#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA device and PyTorch + Triton installed:
#   bash bench/gpu_check.sh OUT_DIR [bench.gpu options...]
# 1. the Triton kernels compiled for the device against their torch references (the kernel tests' Triton cases,
#    which run interpreted on a CPU-only machine) and the engine on CUDA against transformers + peft (the oracle
#    tests marked gpu); 2. `python -m bench.gpu` (kernel bandwidth, launch-setting sweep, engine base vs LoRA).
# Logs and the bench JSON go to OUT_DIR. The C++ CPU kernels are not built (LORAPLEX_CPU_KERNELS=0).
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [bench.gpu options...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 LORAPLEX_CPU_KERNELS=0 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/device.txt"
$python -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$out/device.txt"
timeout "${TEST_TIMEOUT:-300}" $python -m pytest -q -p no:cacheprovider -o addopts="-ra" \
  tests/test_paged_attention.py tests/test_lora_kernels.py tests/test_oracle.py tests/test_lora_oracle.py \
  tests/test_decode_graphs.py tests/test_triton_launch.py \
  -k "triton or cuda" 2>&1 | tee "$out/tests.log"
tests=$?
timeout "${BENCH_TIMEOUT:-330}" $python -m bench.gpu --json "$out/gpu.json" "$@" 2>&1 | tee "$out/bench.log"
bench=$?
echo "gpu_check: tests exit $tests, bench exit $bench"
exit $((tests || bench))
