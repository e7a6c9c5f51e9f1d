#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("GPU"), on a machine with CUDA and a torch that sees it:
#   scripts/gpu_bench.sh [args for python -m tiered_ckpt.bench.gpu]
# Runs from a clone without installing it. Wheels in ./.whl (for a machine that cannot reach an index: what
# the package needs and the machine lacks, e.g. crc32c) are unpacked to a private folder first. Writes the
# report and its JSON to $OUT (default ./gpu-bench-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-bench-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/tiered_ckpt-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/tiered_ckpt-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
df -h /dev/shm | tail -1
nproc
SHM=/dev/shm
if [ "$(df --output=avail -B1G /dev/shm | tail -1)" -lt 24 ]; then  # too small for the training loop's buffers
    SHM=/tmp/tiered_ckpt-shm
    mkdir -p $SHM && { mountpoint -q $SHM || mount -t tmpfs -o size=48g tmpfs $SHM; } || {
        echo "/dev/shm has under 24 GiB free and no tmpfs could be mounted at $SHM (it needs root): the memory" \
             "tier would be measured on disk; free /dev/shm or run as root" >&2; exit 1; }
    echo "memory tier on $SHM"
fi
# A staging buffer that CUDA refuses to pin must leave no error behind for the next kernel to report
SHM=$SHM $PY - <<'EOF'
import os, tempfile, torch
from pathlib import Path
from tiered_ckpt.save import mapped
print("torch", torch.__version__, "cudart binds cudaGetLastError:", hasattr(torch.cuda.cudart(), "cudaGetLastError"),
      "loaded cudart:", mapped._loaded_cudart())
with tempfile.TemporaryDirectory(dir=os.environ["SHM"]) as d:
    parts = mapped.MappedParts(Path(d), 256 << 20, 64 << 20, pin=True)
    print("mapped buffer pinned:", parts.pinned)
    again = mapped._register(parts.tensor.data_ptr(), 256 << 20)  # already registered: refused
    x = torch.ones(1 << 20, device="cuda")
    print("second registration refused:", not again, "; a kernel after it:", float((x * 2).sum()))
    del parts
EOF
$PY -m tiered_ckpt.bench.gpu --shm "$SHM" --json "$@" | tee "$OUT/gpu.json"
$PY -c "import json, sys; from tiered_ckpt.bench.gpu import report; print(report(json.load(open(sys.argv[1]))))" \
    "$OUT/gpu.json" | tee "$OUT/gpu.md"
