#!/usr/bin/env bash
# One call on a lent single-GPU machine for the verify forward: the kernels' GPU-marked tests, the kernel tunes (their
# tables are written into kernels/ of this tree, so the verify run that follows uses them, and copied to $OUT), the
# one-rank verify decomposition (`verifybench run --components verify`), and optionally the repeatability run of
# scripts/device_run.sh. Everything lands in $OUT/gpu.tgz; short summaries are printed last.
# Usage: VERIFYBENCH_GIT_COMMIT=<sha> STEPS="tests profile skinny mla moe verify repeat" scripts/verify_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/verifybench-out}
W=$OUT/g
mkdir -p "$W"
STEPS=" ${STEPS:-tests skinny verify} "
: > "$W/steps.txt"

step() {  # step NAME LIMIT_S CMD...: output to $W/NAME.log, "NAME: rc=.. in .. s" to steps.txt
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name ($(date +%T))"
  timeout -k 10 "$limit" "$@" > "$W/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$W/steps.txt"
}

if [[ $STEPS == *" tests "* ]]; then
  step tests "${TESTS_LIMIT_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_fused_ops.py \
    tests/test_mla_decode.py tests/test_mla_glue.py tests/test_skinny_gemm.py tests/test_verify_forward.py \
    tests/test_moe_int4.py
fi
if [[ $STEPS == *" profile "* ]]; then  # per-kernel device time of one eager forward at n = 1 and 8
  step profile "${PROFILE_LIMIT_S:-120}" bash -c "python3 scripts/verify_profile.py 1 $W/verify_profile_n1.json && \
    python3 scripts/verify_profile.py 8 $W/verify_profile_n8.json"
fi
if [[ $STEPS == *" skinny "* ]]; then
  step skinny "${SKINNY_LIMIT_S:-150}" python3 -m microbench.bench_skinny_gemm tune \
    --out kernels/skinny_gemm_configs.json --time-limit "${SKINNY_TUNE_S:-100}"
  cp kernels/skinny_gemm_configs.json "$W/"
fi
if [[ $STEPS == *" mla "* ]]; then
  step mla "${MLA_LIMIT_S:-120}" python3 -m microbench.bench_mla_decode tune --out kernels/mla_decode_configs.json \
    --time-limit "${MLA_TUNE_S:-80}"
  cp kernels/mla_decode_configs.json "$W/"
fi
if [[ $STEPS == *" moe "* ]]; then
  step moe "${MOE_LIMIT_S:-450}" python3 -m microbench.bench_moe_int4 tune --in-place --ns 1,2,3,4,5,6,7,8 \
    --spaces "${MOE_SPACES:-new,half2}" --max-minutes "${MOE_TUNE_MIN:-6}"
  cp kernels/moe_int4_configs.json "$W/"
fi
if [[ $STEPS == *" verify "* ]]; then
  step verify "${VERIFY_LIMIT_S:-240}" python3 -m harness run --components verify --out "$W/verify"
fi
if [[ $STEPS == *" repeat "* ]]; then  # issue 2: the harness and graph benches twice, compared; CLI vs pytest
  OUT=$W/repeat scripts/device_run.sh "microbench/bench_harness.py microbench/bench_graph_replay.py" harness graph \
    > "$W/repeat.log" 2>&1
  echo "repeat: rc=$?" | tee -a "$W/steps.txt"
fi
tar czf "$OUT/gpu.tgz" -C "$W" .
echo
cat "$W/steps.txt"
[ -f "$W/tests.log" ] && tail -n 8 "$W/tests.log"
for s in profile skinny mla moe; do [ -f "$W/$s.log" ] && { echo "-- $s"; tail -n 25 "$W/$s.log"; }; done
[ -f "$W/verify.log" ] && grep -v "━" "$W/verify.log" | tail -n 45
[ -f "$W/repeat.log" ] && tail -n 30 "$W/repeat.log"
! grep -qv "rc=0" "$W/steps.txt"  # the exit status: non-zero when a step failed
