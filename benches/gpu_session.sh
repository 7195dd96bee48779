#!/usr/bin/env bash
# A lent GPU machine (no network; python3 there has torch, pytest and hypothesis), in calls of
# under 10 minutes each: the parts named as arguments run in order (none named: all of them).
# Logs, JSON and Markdown go to $OUT; machine.txt and a summary come with every call.
#
# Here:    .venv/bin/maturin build --release -o .wheels      (an abi3 wheel, git-ignored)
#          (optional, for the torchtune mode; its offloading module is loaded alone):
#          .venv/bin/pip download --no-deps -d .wheels/extra torchtune==0.6.1 torchao==0.17.0 psutil
# There (device tool: carry [".wheels"]), calls in this order of importance, each starting with
# the cheap install, since a fresh machine has none (30 device-minutes a session in all):
#   bash benches/gpu_session.sh install import info test_cuda pytest_all          # 5-8 min
#   bash benches/gpu_session.sh install bench_1b                                  # ~9 min
#   bash benches/gpu_session.sh install test_compile bench_quick cufile           # ~7 min
#   bash benches/gpu_session.sh install fit                                       # ~9 min
#
# The lent machines run gVisor (kernel 4.4): io_uring or O_DIRECT may be refused there, and then
# the store says so and uses its POSIX engine; `info` and machine.txt record what was found.
#
# Parts: install (pip install of the carried wheels), import (the installed wheel, not the source
# tree, is what tests import), info (ssdtier info: io_uring, O_DIRECT, CUDA, GDS), test_cuda
# (all but torch.compile's), pytest_all, test_compile (torch.compile on CUDA, CUDA graphs),
# cufile (benches/cufile_bandwidth.py: fio, the store and cuFile on this disk), bench_quick
# (benches/gpu_step.py --quick), bench_1b (the 1B GPT, every mode side by side, ssdtier_cufile
# last), fit (the largest micro-batch of each mode);
# on request only: train_step_cuda, train_step_cuda_big (benches/train_step.py --device cuda).
# Each part has its own time limit, cut to what is left of SESSION_S (default 570) seconds, so
# that one hang does not eat the call's 10 minutes and the summary is still printed.
set -uo pipefail
cd "$(dirname "$0")/.."
ALL=(install import info test_cuda pytest_all test_compile bench_quick bench_1b cufile fit)
KNOWN=" ${ALL[*]} train_step_cuda train_step_cuda_big "
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=("${ALL[@]}")
for p in "${parts[@]}"; do
    if [[ "$KNOWN" != *" $p "* ]]; then
        echo "gpu_session: unknown part '$p'; parts:$KNOWN" >&2
        exit 2
    fi
done

OUT="${OUT:-benches/out/gpu}"
PY="${PY:-python3}"
SESSION_S="${SESSION_S:-570}"
mkdir -p "$OUT"
summary=()
ran_cuda=()
limit() { # a part's own limit, cut to the session's time left (less 5 s for the summary)
    local left=$((SESSION_S - SECONDS - 5))
    echo $(($1 < left ? $1 : left))
}
part() { # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    if [ "$secs" -lt 20 ]; then
        summary+=("$(printf '%-22s skipped: %ss left of SESSION_S=%s' "$name" "$secs" "$SESSION_S")")
        return 124
    fi
    local t0=$SECONDS
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log")")")
    return $rc
}

{
    nvidia-smi
    "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    df -hT . /tmp
    lsblk -d -o NAME,ROTA,SIZE,MODEL 2>/dev/null
    command -v fio >/dev/null && fio --version || echo "fio: not installed"
    nproc
    free -g
} >"$OUT/machine.txt" 2>&1

per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90) # one hang costs 90 s, not the part

for p in "${parts[@]}"; do
    case "$p" in
    install)
        wheel=$(ls .wheels/ssdtier-*.whl 2>/dev/null | head -n 1)
        if [ -z "$wheel" ]; then
            echo "gpu_session: no wheel in .wheels/ (build one here and carry .wheels)" >&2
            exit 2
        fi
        extra=(.wheels/extra/*.whl)
        [ -e "${extra[0]}" ] || extra=()
        part install "$(limit 120)" "$PY" -m pip install --no-deps --no-index --force-reinstall "$wheel" ${extra[@]+"${extra[@]}"} || {
            cat "$OUT/install.log"
            exit 1
        }
        ;;
    import)
        part import "$(limit 60)" "$PY" -c "import ssdtier, ssdtier._native as n; print(ssdtier.__file__)"
        ;;
    info)
        part info "$(limit 60)" "$PY" -m ssdtier info benches/out
        ;;
    cufile)
        part cufile "$(limit 300)" "$PY" benches/cufile_bandwidth.py --json "$OUT/cufile_bandwidth.json"
        ;;
    test_cuda)
        # The torch.compile tests (cold Inductor builds, minutes) are test_compile's.
        part test_cuda "$(limit 180)" "$PY" -m pytest -q -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} \
            tests/test_cuda.py tests/test_io_errors.py -k "cuda and not torch_compile" -v
        ran_cuda=(--ignore=tests/test_cuda.py) # pytest_all need not run them again
        ;;
    test_compile)
        part test_compile "$(limit 300)" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k torch_compile -v
        ;;
    pytest_all)
        par=()
        "$PY" -c "import xdist" 2>/dev/null && par=(-n 8) # pytest-xdist is there: 8 workers
        part pytest_all "$(limit 420)" "$PY" -m pytest -q -p no:cacheprovider -x ${par[@]+"${par[@]}"} ${ran_cuda[@]+"${ran_cuda[@]}"}
        ;;
    bench_quick | bench_1b | fit)
        # The bench stops starting modes at --budget-s; the rest of the limit is for the last one.
        case "$p" in
        bench_quick) secs=$(limit 180) args=(--quick) margin=40 ;;
        bench_1b) secs=$(limit 560) args=() margin=80 ;;
        fit) secs=$(limit 560) args=(--fit) margin=80 ;;
        esac
        part "$p" "$secs" "$PY" benches/gpu_step.py ${args[@]+"${args[@]}"} --budget-s $((secs > margin + 10 ? secs - margin : 10)) \
            --json "$OUT/gpu_step_$p.json" --md "$OUT/gpu_step_$p.md"
        ;;
    train_step_cuda)
        part train_step_cuda "$(limit 240)" "$PY" benches/train_step.py --device cuda --skip-per-tensor \
            --json "$OUT/train_step_cuda.json"
        ;;
    train_step_cuda_big)
        part train_step_cuda_big "$(limit 300)" "$PY" benches/train_step.py --device cuda --skip-per-tensor \
            --layers 12 --d-model 1024 --seq 1024 --batch 8 --heads 16 --arena 2GiB \
            --json "$OUT/train_step_cuda_big.json"
        ;;
    esac
done

echo "== gpu_session summary (logs in $OUT) =="
printf '%s\n' "${summary[@]}"
