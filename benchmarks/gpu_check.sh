#!/usr/bin/env bash
# Run benchmarks/gpu_check.py from a plain working tree (no install needed).
#
# The repository maps folders to subpackages (statemachine/ is cadence.statemachine,
# and so on). Where the package is not installed, a temporary folder holding
# cadence/<name> -> <repo>/<name> links is put first on PYTHONPATH. Results go to
# $OUT/gpu_check.json (rewritten after every stage) and the log to $OUT/gpu_check.log.
#
#   OUT=/tmp/gpuout bash benchmarks/gpu_check.sh --dry-run   # CPU, tiny, end to end
#   bash benchmarks/gpu_check.sh                              # on the GPU machine
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/gpu_check_out}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"

NAMESPACE="$(mktemp -d "${TMPDIR:-/tmp}/cadence-namespace.XXXXXX")"
trap 'rm -rf "$NAMESPACE"' EXIT
mkdir -p "$NAMESPACE/cadence"
for part in statemachine actors gpu spec; do
    ln -s "$REPO/$part" "$NAMESPACE/cadence/$part"
done

export PYTHONPATH="$NAMESPACE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export OUT

cd "$REPO"
"$PYTHON" -c "import cadence.gpu.runner, cadence.statemachine.scheduler; print('cadence imports from', cadence.gpu.runner.__file__)"
"$PYTHON" benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
