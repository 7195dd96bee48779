#!/usr/bin/env bash
# A lent GPU machine (no network; python3 there has torch, pytest, pytest-timeout, xdist, psutil):
# the parts named as arguments run in order, each under its own time limit, all within SESSION_S.
# A session has 15 device-minutes, a start included, and a machine stays warm 30 s after a call:
#
# Here:    .venv/bin/maturin build --release -o .wheels      (an abi3 wheel, git-ignored)
#          (optional, for the torchtune mode; its offloading module is loaded alone):
#          .venv/bin/pip download --no-deps -d .wheels/extra torchtune==0.6.1 torchao==0.17.0
#          bash benches/static_fio.sh                       (fio for the benches: none is there)
# There (device tool: carry [".wheels"]), back to back, in this order of need:
#   SESSION_S=350 bash benches/gpu_session.sh call1   # timeout_s 360: install import udev_shim info
#                                                     #   test_cuda test_compile cufile (cufile_probe if cuFile
#                                                     #   failed) pin_rate
#   SESSION_S=... bash benches/gpu_session.sh call3   # install fit: the device time left less 20 s (>= 330)
#   SESSION_S=... bash benches/gpu_session.sh call2   # install bench_1b (every mode), then with the time
#                                                     #   left bench_expandable (>= 300; 600 for both)
#   SESSION_S=... bash benches/gpu_session.sh call4   # install test_cuda rok: the planner's session, alone
#                                                     #   (the device time left less 20 s; >= 400, 700 for all)
#   SESSION_S=... bash benches/gpu_session.sh call5   # install import plan_trace test_cuda compile_peak rok:
#                                                     #   the next planner session (>= 420, 800 for all)
#   SESSION_S=... bash benches/gpu_session.sh call6   # install import rok_targets: a first call of 590 (the
#                                                     #   judge with ssdtier on compiled blocks, and the
#                                                     #   targets' batches)
#   SESSION_S=... bash benches/gpu_session.sh call7   # install test_cuda test_graphs compile_peak rok_wide: the
#                                                     #   second, with what is left (>= 240)
#   SESSION_S=... bash benches/gpu_session.sh call8   # install plan_trace test_cuda rok_long: call6's
#                                                     #   second, with what is left (>= 240)
#   SESSION_S=... bash benches/gpu_session.sh call9   # install rok_fit: a first call of 590 (ssdtier on blocks
#                                                     #   compiled at 0.2, at the targets' batches), then call8
# A session (15 device-minutes, the start included) fits call1 and one of call2, call3, or call4
# alone.
# If call1 fails on something fixable, fix it and run call1 again first.
#
# Out: $OUT/summary.txt and $OUT/gpu_session.tgz (every log, JSON and Markdown), rewritten after
# each part, since the device tool brings back at most 8 files. Failed parts' log tails are
# printed too. io_uring or O_DIRECT may be refused (gVisor): the store then uses its POSIX engine
# and `info` says so.
#
# Parts: install (the carried wheels), import (the installed wheel, not the source tree, is what
# tests import), info (ssdtier info: io_uring, O_DIRECT, CUDA, GDS), test_cuda (all but
# torch.compile's), test_compile, test_graphs (CUDA graphs: reduce-overhead with copies out held
# back), pytest_all, bench_quick (benches/gpu_step.py --quick), cufile
# (benches/cufile_bandwidth.py: fio, the store and cuFile on this disk), bench_1b, fit (the
# largest micro-batch of keep, adaptive and checkpoint), pin_rate (benches/pin_rate.py: how fast a host arena is
# pinned, and whether faulting it in first, over threads or in huge pages, is faster; a store's
# open without and with host.huge_pages),
# bench_expandable (its keep, adaptive and checkpoint with the allocator's
# expandable segments: the reserved memory a second stream's pool adds), rok (`ssdtier bench rok`, the judge,
# on the 1.3B GPT: every mode side by side, the dominance table, then --fit; rok.csv, rok.png and
# rok.json in the archive's rok/); on request only: bench_wide
# (8 blocks of width 4096: how much adaptive mode offloads with more compute per byte),
# train_step_cuda, train_step_cuda_big,
# rok_wide and rok_long (`bench rok --wide`: 8 blocks of width 4096; `--long`: seq 16384, SDPA;
# keep, checkpointing and ssdtier side by side: where offloading should carry more),
# rok_targets (rok's 1.3B GPT: keep, checkpointing every block, compile at budgets 0.5 and 0.2,
# ssdtier eager and on blocks compiled at 0.5; then --fit of keep, ssdtier, ssdtier on compile and
# checkpointing at the batches of the targets), rok_fit (the same --fit of ssdtier, eager and on
# blocks compiled at 0.2),
# plan_trace (benches/plan_trace.py: adaptive mode step by step, fixed budgets and "auto" at
# batches past keep's), compile_peak (benches/compile_peak.py: peaks eager, compiled whole and
# block by block, with and without ssdtier),
# cufile_probe (which files cuFile takes on this disk, and with which settings; skipped after a
# cufile part in which cuFile worked), udev_shim (benches/cufile_udev_shim.sh: the udev entry
# cuFile needs, on a VM without udevd).
set -uo pipefail
cd "$(dirname "$0")/.."
ALL=(install import info test_cuda bench_quick cufile bench_1b test_compile pytest_all fit)
KNOWN=" ${ALL[*]} test_graphs pin_rate bench_expandable bench_wide rok rok_targets rok_fit rok_wide rok_long plan_trace compile_peak train_step_cuda train_step_cuda_big cufile_probe udev_shim "
parts=()
for a in "$@"; do
    case "$a" in
    call1) parts+=(install import udev_shim info test_cuda test_compile cufile cufile_probe pin_rate) ;;
    call2) parts+=(install bench_1b bench_expandable) ;;
    call3) parts+=(install fit) ;;
    call4) parts+=(install import test_cuda rok) ;;
    call5) parts+=(install import plan_trace test_cuda compile_peak rok) ;;
    call6) parts+=(install import rok_targets) ;;
    call7) parts+=(install test_cuda test_graphs compile_peak rok_wide) ;;
    call8) parts+=(install plan_trace test_cuda rok_long) ;;
    call9) parts+=(install rok_fit) ;;
    *) parts+=("$a") ;;
    esac
done
[ ${#parts[@]} -eq 0 ] && parts=("${ALL[@]}")
for p in "${parts[@]}"; do
    if [[ "$KNOWN" != *" $p "* ]]; then
        echo "gpu_session: unknown part '$p'; parts:$KNOWN or call1, call2, call3, call4, call5, call6, call7, call8, call9" >&2
        exit 2
    fi
done

OUT="${OUT:-benches/out/gpu}"
LOGS="${LOGS:-$(mktemp -d /tmp/gpu_session.XXXXXX)}" # packed into $OUT after each part
PY="${PY:-python3}"
SESSION_S="${SESSION_S:-300}"
PACK_S="${PACK_S:-30}"
if [ -x .wheels/bin/fio ] && ! command -v fio >/dev/null; then
    export PATH="$PWD/.wheels/bin:$PATH"
fi
mkdir -p "$OUT" "$LOGS"
summary=()
failed=()
ran_cuda=()
pack() {
    printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
    tar -czf "$OUT/gpu_session.tgz" -C "$LOGS" .
}
limit() { # a part's own limit, cut to the session's time left (less 5 s for the summary)
    local left=$((SESSION_S - SECONDS - 5))
    echo $(($1 < left ? $1 : left))
}
big_gpu() { # over 100 GB of memory (an H200): the parts' batches are sized to it
    local mib
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    [ "${mib:-0}" -gt 100000 ] 2>/dev/null
}
part() { # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    if [ "$secs" -lt 20 ]; then
        summary+=("$(printf '%-22s skipped: %ss left of SESSION_S=%s' "$name" "$secs" "$SESSION_S")")
        pack
        return 124
    fi
    local t0=$SECONDS
    # Packed every PACK_S seconds meanwhile: a call cut short by the device's time still brings this log.
    (
        trap 'kill $nap 2>/dev/null; exit 0' TERM
        while :; do
            sleep "$PACK_S" &
            nap=$!
            wait $nap
            tar -czf "$LOGS.tgz" -C "$LOGS" . && mv -f "$LOGS.tgz" "$OUT/gpu_session.tgz"
        done
    ) >/dev/null 2>&1 &
    local packer=$!
    timeout -k 10 "$secs" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    kill "$packer" 2>/dev/null
    wait "$packer" 2>/dev/null
    summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$LOGS/$name.log")")")
    [ $rc -ne 0 ] && failed+=("$name")
    pack
    return $rc
}

{
    nvidia-smi
    "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    uname -a
    df -hT . /tmp
    lsblk -d -o NAME,ROTA,SIZE,MODEL 2>/dev/null
    command -v fio >/dev/null && fio --version || echo "fio: not installed"
    nproc
    free -g
} >"$LOGS/machine.txt" 2>&1

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
        part install "$(limit 60)" "$PY" -m pip install -q --no-deps --no-index --force-reinstall "$wheel" ${extra[@]+"${extra[@]}"} || {
            cat "$LOGS/install.log"
            exit 1
        }
        part wheel_check "$(limit 30)" "$PY" benches/_wheel_check.py || { # a stale wheel: stop now
            cat "$LOGS/wheel_check.log"
            exit 1
        }
        ;;
    import)
        part import "$(limit 30)" "$PY" -c "import ssdtier, ssdtier._native as n; print(ssdtier.__file__)"
        ;;
    info)
        part info "$(limit 45)" "$PY" -m ssdtier info benches/out
        ;;
    test_cuda)
        # The torch.compile tests (cold Inductor builds, minutes) are test_compile's.
        part test_cuda "$(limit 150)" "$PY" -m pytest -q -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} \
            tests/test_cuda.py tests/test_io_errors.py -k "cuda and not torch_compile" -v -rfEs --tb=short
        ran_cuda=(--ignore=tests/test_cuda.py) # pytest_all need not run them again
        ;;
    test_compile)
        part test_compile "$(limit 240)" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k torch_compile -v -rfEs --tb=short -o log_level=WARNING
        ;;
    test_graphs)
        # CUDA graphs: reduce-overhead with copies out held back (test_cuda has the capture by hand).
        part test_graphs "$(limit 180)" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
            -k "cuda_graphs" -v -rfEs --tb=short -o log_level=WARNING
        ;;
    pytest_all)
        par=()
        "$PY" -c "import xdist" 2>/dev/null && par=(-n 8) # pytest-xdist is there: 8 workers
        part pytest_all "$(limit 300)" "$PY" -m pytest -q -p no:cacheprovider --maxfail 5 -rfE --tb=short \
            ${per_test[@]+"${per_test[@]}"} ${par[@]+"${par[@]}"} ${ran_cuda[@]+"${ran_cuda[@]}"}
        ;;
    cufile)
        part cufile "$(limit 75)" "$PY" benches/cufile_bandwidth.py --size 1GiB --repeats 2 --timeout-s 30 \
            --json "$LOGS/cufile_bandwidth.json"
        ;;
    pin_rate)
        part pin_rate "$(limit 90)" "$PY" benches/pin_rate.py --size 2GiB --dir benches/out --json "$LOGS/pin_rate.json"
        ;;
    udev_shim)
        part udev_shim "$(limit 20)" bash benches/cufile_udev_shim.sh benches/out
        ;;
    cufile_probe)
        if [ -s "$LOGS/cufile_bandwidth.json" ] && "$PY" -c 'import json, sys
parts = json.load(open(sys.argv[1])).get("parts", {})
sys.exit(0 if (parts.get("cufile") or {}).get("status") == "ok" else 1)' "$LOGS/cufile_bandwidth.json"; then
            summary+=("$(printf '%-22s skipped: cuFile worked in the cufile part' cufile_probe)")
            pack
            continue
        fi
        part cufile_probe "$(limit 90)" "$PY" benches/cufile_probe.py benches/out/cufile-probe \
            --json "$LOGS/cufile_probe.json"
        ;;
    bench_quick | bench_1b | bench_expandable | bench_wide | fit)
        # The bench stops starting modes at --budget-s; the rest of the limit is for the last one.
        case "$p" in
        bench_quick) secs=$(limit 75) args=(--quick) margin=25 ;;
        bench_1b) secs=$(limit 560) args=(--batch 8 --steps 3 --fio-size 2GiB --disk-step-s 8) margin=70 ;;
        bench_expandable) secs=$(limit 240) args=(--batch 8 --steps 3 --no-fio --modes keep,ssdtier_adaptive,checkpoint)
            margin=50 ;;
        # Wider blocks: more compute per byte saved, so more of it can cross the link in time.
        bench_wide) secs=$(limit 300) args=(--layers 8 --d-model 4096 --heads 32 --batch 8 --steps 3 --no-fio
            --modes keep,ssdtier_adaptive,ssdtier_host,checkpoint) margin=60 ;;
        # The modes that may fit more at keep's speed, and checkpointing: the rest are many times
        # slower (runs 2 and 3).
        fit) secs=$(limit 320) args=(--fit --modes keep,ssdtier_adaptive,checkpoint) margin=60 ;;
        esac
        env=()
        [ "$p" = bench_expandable ] && env=(env "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        part "$p" "$secs" ${env[@]+"${env[@]}"} "$PY" benches/gpu_step.py ${args[@]+"${args[@]}"} --budget-s $((secs > margin + 10 ? secs - margin : 10)) \
            --json "$LOGS/gpu_step_$p.json" --md "$LOGS/gpu_step_$p.md"
        ;;
    rok)
        # gpu_step's 1.3B GPT (bf16 autocast, fused attention, batch 8). The bench stops starting
        # settings at --budget-s (half of it for the side-by-side run, half for --fit); the rest of
        # the limit is for the last one. --fit searches the modes that may fit more at keep's speed.
        # --fit searches keep, checkpointing and ssdtier: compile's cold builds would take a probe each.
        # Six warmup steps: adaptive mode's plans changed through the first 4-6 (H100 run 3), and
        # 2 timed that churn.
        secs=$(limit 540)
        part rok "$secs" "$PY" -m ssdtier bench rok --device cuda --layers 24 --d-model 2048 --heads 16 --seq 2048 \
            --vocab 32000 --batch 8 --attention sdpa --dtype bf16 --dropout 0 --min-tensor-bytes 1MiB --steps 3 \
            --warmup 6 --fractions 0.8,0.6,0.4,0.25 --dir benches/out/rok-nvme --out "$LOGS/rok" \
            --fit --fit-max-batch 160 --fit-modes keep,checkpoint,ssdtier \
            --budget-s $((secs > 80 ? secs - 70 : 10))
        ;;
    rok_targets | rok_fit)
        # rok's model. rok_targets: the judge (compile's partitioner at 0.5 kept 0.47 of keep's
        # memory at 1.03x in H200 run 4; ssdtier on such blocks is what can beat it below that),
        # then --fit: keep searched, the others at the targets' batches: keep's largest x1.4,
        # x1.8, checkpoint's largest and its x1.15 (keep 13 / 26, checkpoint 43 / ~96 on the
        # H100 / H200). A search compiles afresh at each probe: too long. ssdtier on compile 0.5
        # is not probed again (run 4: 40, as compile alone).
        # rok_fit: ssdtier on blocks compiled at 0.2 (compile alone at 0.2 fit 72 at 1.05x keep
        # on the H200), at those batches (eager ssdtier's are rok_targets').
        batches=19,24,32,43,50
        big_gpu && batches=37,47,72,96,110
        if [ "$p" = rok_targets ]; then
            secs=$(limit 560) args=(--modes keep,checkpoint,ssdtier,compile --checkpoint-every 1
                --compile-budgets 0.5,0.2 --fractions 0.8,0.6,0.4,0.25 --ssdtier-compile 0.5
                --fit-modes keep,ssdtier,checkpoint)
        else
            secs=$(limit 560) args=(--modes keep,ssdtier --fractions 0.4 --ssdtier-compile 0.2
                --fit-modes keep,ssdtier-compile)
        fi
        # The arena is pinned once a run (reusing_stores); 48 GiB holds the blocks' inputs that
        # recompute+offload moves at checkpointing's batches (72-110: 29-44 GB).
        part "$p" "$secs" "$PY" -m ssdtier bench rok --device cuda --layers 24 --d-model 2048 --heads 16 --seq 2048 \
            --vocab 32000 --batch 8 --attention sdpa --dtype bf16 --dropout 0 --min-tensor-bytes 1MiB --steps 3 --arena 48GiB \
            --warmup 6 --dir benches/out/rok-nvme --out "$LOGS/$p" "${args[@]}" --fit --fit-batches "$batches" \
            --fit-slow 1.4 --budget-s $((secs > 80 ? secs - 60 : 10))
        ;;
    rok_wide | rok_long)
        secs=$(limit 300)
        part "$p" "$secs" "$PY" -m ssdtier bench rok --device cuda "--${p#rok_}" --steps 3 --warmup 5 \
            --modes keep,checkpoint,ssdtier --fractions 0.6,0.4 --dir benches/out/rok-nvme --out "$LOGS/$p" \
            --budget-s $((secs > 80 ? secs - 60 : 10))
        ;;
    plan_trace)
        # 1.2: a budget above keep's peak (ssdtier keeping everything: its own cost); both
        # profiled, where the forward's host time was 2-5x keep's (H100 run 3). auto: past
        # keep's largest batch (13 on the H100, about 26 on the H200; eager ssdtier ran out
        # of memory at 40 there in H200 run 4: the INFO log says each step's budget and plan).
        autos=auto:16,auto:20
        big_gpu && autos=auto:32,auto:40
        part plan_trace "$(limit 170)" "$PY" benches/plan_trace.py --out "$LOGS/trace" --steps 10 \
            --runs "keep,$autos,1.2,0.8,0.4,0.25" --profile 1.2,0.8
        ;;
    compile_peak)
        part compile_peak "$(limit 240)" "$PY" benches/compile_peak.py --device cuda --backend inductor \
            --layers 8 --d-model 2048 --heads 16 --seq 2048 --batch 4 --vocab 32000 --arena 16GiB \
            --dir benches/out/compile-nvme --json "$LOGS/compile_peak.json"
        ;;
    train_step_cuda)
        part train_step_cuda "$(limit 240)" "$PY" benches/train_step.py --device cuda --skip-per-tensor \
            --json "$LOGS/train_step_cuda.json"
        ;;
    train_step_cuda_big)
        part train_step_cuda_big "$(limit 300)" "$PY" benches/train_step.py --device cuda --skip-per-tensor \
            --layers 12 --d-model 1024 --seq 1024 --batch 8 --heads 16 --arena 2GiB \
            --json "$LOGS/train_step_cuda_big.json"
        ;;
    esac
done

echo "== gpu_session summary ($OUT/summary.txt; logs in $OUT/gpu_session.tgz) =="
printf '%s\n' "${summary[@]}"
for name in ${failed[@]+"${failed[@]}"}; do
    echo "== $name.log, last lines =="
    tail -n 30 "$LOGS/$name.log"
done
