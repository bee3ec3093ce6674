#!/usr/bin/env bash
# Issue 25's GPU checks in one shot, for a machine with one H100/H200, a CUDA torch (2.11+),
# triton, transformers and einops, and no internet. Its timeouts add up to 570 s (90 + 360 + 60 + 60), plus the
# install, inside the device tool's 600 s per call; the throughput rows, the issue's bars, come before the
# gated-delta and KDA parity checks, so a run cut short loses those last:
#   1. install hybridpar over the machine's torch (no dependency is touched);
#   2. fla-core from a wheel that travels with the tree (.whl/, see docs/gpu.md), if present;
#   3. parity: the fused Mamba path vs the pure-PyTorch core, float32, 1e-4 (gpu_parity.py, at most 90 s);
#   4. throughput: every row of gpu_throughput.py, within --budget-s 300 (bf16 rows on the pure core if 3 failed);
#   5. parity: the fused gated delta rule vs the pure core, float32, 1e-4 (gdn_parity.py, at most 60 s);
#   6. parity: Kimi Delta Attention on FLA's chunk_kda vs the pure core, float32, 1e-4 (kda_parity.py, at most 60 s).
# 5 and 6 are not yet timed on a GPU.
# Usage: bash benchmarks/run_on_gpu.sh [results directory, default benchmarks/results]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-benchmarks/results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . ; then
    echo "run_on_gpu: pip install --no-deps -e . failed (old setuptools?); using PYTHONPATH=src instead"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
if compgen -G ".whl/fla_core-*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps .whl/fla_core-*.whl || echo "run_on_gpu: fla-core did not install"
fi
"$PY" -c "from hybridpar.models.mamba.fused_op import fla_status; print('fused Mamba kernels:', fla_status())"
"$PY" -c "from hybridpar.models.linear.gdn_fused import fla_rule_status; print('fused gated delta rule:', fla_rule_status())"
"$PY" -c "from hybridpar.models.linear.kda_fused import fla_kda_status; print('fused KDA rule:', fla_kda_status())"

status=0
kernel=auto
if ! timeout 90 "$PY" benchmarks/gpu_parity.py --out "$RESULTS"; then
    status=1
    kernel=pure  # the fused path failed its parity check: time the bf16 rows on the pure-PyTorch core
    echo "run_on_gpu: gpu_parity failed; the bf16 throughput rows run with --mamba-kernel pure"
fi
timeout 360 "$PY" benchmarks/gpu_throughput.py --budget-s 300 --out "$RESULTS" --mamba-kernel "$kernel" || status=1
timeout 60 "$PY" benchmarks/gdn_parity.py --out "$RESULTS" || status=1  # no GDN row in the throughput table
timeout 60 "$PY" benchmarks/kda_parity.py --out "$RESULTS" || status=1  # nor a KDA row
exit $status
