#!/usr/bin/env bash
# The allreduce component on a lent GPU machine, about 5 minutes (every step under its own `timeout`, 7.6 min
# worst case): the table at 14-112 KiB for every backend and mode on all GPUs, the crash and hang paths, the NCCL
# setting sweep (one fresh torchrun per setting), the 1-rank pytest-benchmark module; JSON and logs under
# $OUT/allreduce, a short summary last. Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
# Usage: scripts/allreduce_gpu.sh   (>= 2 GPUs for multi-rank numbers; 1 GPU runs 1 rank). Quick rerun knobs:
#   STEPS="main fault sweep bench" (default all)  SWEEP_SETTINGS="default NCCL_PROTO=LL ..." (default: every
#   setting in harness/allreduce_sweep.py)  SWEEP_LIMIT_S=300
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/verifybench-out}/allreduce
mkdir -p "$OUT"
: > "$OUT/steps.txt"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NP=$(( NGPU >= 1 ? NGPU : 2 ))
TR="python3 -m torch.distributed.run --standalone --nproc-per-node=$NP"
if [ "$NGPU" -ge 2 ]; then  # the failure paths need two ranks: on NCCL where there are two GPUs, else on gloo
  FAULT="python3 -m torch.distributed.run --standalone --nproc-per-node=$NP -m harness.allreduce --backend nccl,pynccl"
else
  FAULT="python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m harness.allreduce --backend gloo"
fi

step() {  # step NAME LIMIT_S CMD...: output to $OUT/NAME.log, "NAME: rc=.. in .. s" to steps.txt
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name ($(date +%T))"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
}

STEPS=" ${STEPS:-main fault sweep bench} "
if [[ $STEPS == *" main "* ]]; then
  step main 110 $TR -m harness.allreduce --out "$OUT/main" --name main.json
fi
if [[ $STEPS == *" fault "* ]]; then
  step fault_exit 45 $FAULT --mode graph --out "$OUT/fault_exit" --fault exit-early:1@2
  step fault_hang 60 $FAULT --mode graph --out "$OUT/fault_hang" --fault hang:1@2 --hang-timeout 20
fi
if [[ $STEPS == *" sweep "* ]]; then
  SWEEP_ARGS=()
  for s in ${SWEEP_SETTINGS:-}; do SWEEP_ARGS+=(--setting "$s"); done
  step sweep "${SWEEP_LIMIT_S:-300}" python3 -m harness.allreduce --nccl-sweep --nproc-per-node="$NP" \
    --setting-timeout 40 --sweep-time-limit $(( ${SWEEP_LIMIT_S:-300} - 15 )) --out "$OUT/sweep" "${SWEEP_ARGS[@]}"
  tail -n 45 "$OUT/sweep.log"
fi
if [[ $STEPS == *" bench "* ]]; then
  step bench 50 env VERIFYBENCH_MAX_TIME_S=0.3 python3 -m pytest --benchmark-only -q -p no:cacheprovider \
    microbench/bench_allreduce.py --benchmark-json="$OUT/bench.json"
fi
python3 -m harness env > "$OUT/env.txt" 2>&1
[ -f "$OUT/main.log" ] && tail -n 40 "$OUT/main.log"
echo
python3 scripts/allreduce_summary.py "$OUT"
