#!/usr/bin/env bash
# One call on a lent GPU machine: the steps named in $STEPS, each under its own timeout, logs and results under
# $OUT (the device tool returns what is there). Prints a short table of step, exit code and seconds at the end.
#   STEPS="install env tests verify" OUT=/tmp/out scripts/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/verifybench-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export VERIFYBENCH_GIT_COMMIT=${VERIFYBENCH_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# Triton's compile cache from an earlier call, when one was carried (a fresh machine compiles everything again)
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -f .cache-carry/triton-cache.tar.gz ]; then
  mkdir -p "$cache" && tar -xzf .cache-carry/triton-cache.tar.gz -C "$cache" && echo "triton cache restored"
fi
summary=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  summary+=("$(printf '%-14s rc=%-4s %5ss' "$name" "$rc" "$((SECONDS - t0))")")
}
for s in ${STEPS:-install env}; do
  case $s in
    install) step install 120 .ci/install ;;
    env) step env 60 verifybench env ;;
    gputests) step gputests "${LIMIT:-300}" python3 -m pytest -q -m gpu -x -p no:randomly ;;
    tests) step tests "${LIMIT:-420}" python3 -m pytest -q -x ;;
    verify) step verify "${LIMIT:-300}" verifybench verify --tokens "${TOKENS:-1-8}" --out "$OUT/run"
            step compare 60 verifybench compare results/baselines/nvidia-h200-x1/verify.json "$OUT"/run/verify-*.json ;;
    run) step run "${LIMIT:-540}" verifybench run --out "$OUT/run"
         step compare 60 verifybench compare results/baselines/nvidia-h200-x1/verify.json "$OUT"/run/verify-*.json ;;
    bench) step bench "${LIMIT:-300}" python3 -m pytest --benchmark-only -q microbench/ \
             --benchmark-json="$OUT/bench.json" ;;
    savecache) tar -czf "$OUT/triton-cache.tar.gz" -C "$cache" . && ls -la "$OUT/triton-cache.tar.gz" ;;
    *) echo "unknown step $s" ;;
  esac
done
printf '%s\n' "${summary[@]}"
