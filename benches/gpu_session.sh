#!/usr/bin/env bash
# One call on a lent GPU machine (no network; python3 there has torch, pytest and hypothesis):
# install the carried wheel, run the CUDA tests and the whole suite, then the training-step
# bench on the GPU. Logs and JSON go to $OUT; a summary is printed last.
#
# Here:    .venv/bin/maturin build --release -o .wheels      (an abi3 wheel, git-ignored)
# There:   bash benches/gpu_session.sh                          (device tool: carry [".wheels"])
#
# Each part has its own time limit, so that one hang does not eat the call's 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benches/out/gpu}"
PY="${PY:-python3}"
mkdir -p "$OUT"
summary=()
part() { # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log")")")
    return $rc
}

{
    nvidia-smi
    "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    df -hT .
    nproc
    free -g
} >"$OUT/machine.txt" 2>&1

wheel=$(ls .wheels/ssdtier-*.whl 2>/dev/null | head -n 1)
if [ -z "$wheel" ]; then
    echo "gpu_session: no wheel in .wheels/ (build one here and carry .wheels)" >&2
    exit 2
fi
part install 120 "$PY" -m pip install --no-deps --no-index --force-reinstall "$wheel" || {
    cat "$OUT/install.log"
    exit 1
}
# The installed wheel, not the source tree, must be what the tests import.
part import 60 "$PY" -c "import ssdtier, ssdtier._native as n; print(ssdtier.__file__)"

part test_cuda 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_io_errors.py -k cuda -v
part pytest_all 300 "$PY" -m pytest -q -p no:cacheprovider -x
part train_step_cuda 240 "$PY" benches/train_step.py --device cuda --skip-per-tensor --json "$OUT/train_step_cuda.json"
part train_step_cuda_big 300 "$PY" benches/train_step.py --device cuda --skip-per-tensor \
    --layers 12 --d-model 1024 --seq 1024 --batch 8 --heads 16 --arena 2GiB --json "$OUT/train_step_cuda_big.json"

echo "== gpu_session summary (logs in $OUT) =="
printf '%s\n' "${summary[@]}"
