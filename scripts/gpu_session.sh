#!/usr/bin/env bash
# One call on a lent GPU machine: the steps named in $STEPS, each under its own timeout; logs and results go to
# $WORK and are bundled into $OUT/bundle.tgz at the end (the device tool returns at most 8 files). Prints a short
# table of step, exit code and seconds last.
#   STEPS="install env cycle" OUT=/tmp/out scripts/gpu_session.sh
# The README's tests on a fresh machine outlast one device command: STEPS="install tests" runs the whole suite, and
# TEST_FILES="$(LC_ALL=C ls tests/*/test_*.py | sed -n '25,$p')" the files a stopped run did not reach.
# The device's copy of .git can lag the checkout: pass VERIFYBENCH_GIT_COMMIT=<this checkout's HEAD> in the command.
# The engines' rows and the batches (carry .whl and .cache-carry; on an H100 2026-12-06 mla_verify took 88 s, moe_int4
# 33 s, mla_decode 12 s, the batched cycle at one context and one shape 62 s), with DEADLINE_S under the call's limit:
#   DEADLINE_S=575 STEPS='install engines batch' ENGINE_RUNS='mla_verify mla_decode moe_int4' TESTS_MAX_S=0
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/verifybench-gpu}
WORK=${WORK:-/tmp/vb}
mkdir -p "$OUT" "$WORK/run"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export VERIFYBENCH_GIT_COMMIT=${VERIFYBENCH_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# the committed verify baseline of this card (SAME is only meaningful on the card that measured it)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)" in
  *H100*) BASE=${BASE:-results/baselines/nvidia-h100-80gb-hbm3-x1} ;;
  *) BASE=${BASE:-results/baselines/nvidia-h200-x1} ;;
esac
BASE_VERIFY=${BASE_VERIFY:-$(ls "$BASE"/verify.json* 2>/dev/null | head -n1)}
# Triton's compile cache from an earlier call, when one was carried (a fresh machine compiles everything again)
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# FlashInfer's JIT-built modules (about a minute of nvcc each) likewise, under $FLASHINFER_WORKSPACE_BASE
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$HOME}
if [ -f .cache-carry/flashinfer-cache.tar.gz ]; then
  mkdir -p "$FLASHINFER_WORKSPACE_BASE/.cache" && tar -xzf .cache-carry/flashinfer-cache.tar.gz -C "$FLASHINFER_WORKSPACE_BASE/.cache" \
    && echo "flashinfer cache restored"
fi
if [ -f .cache-carry/triton-cache.tar.gz ]; then
  mkdir -p "$cache" && tar -xzf .cache-carry/triton-cache.tar.gz -C "$cache" && echo "triton cache restored"
fi
summary=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # $DEADLINE_S: seconds this whole call may take (the device command's limit, less the bundling); each step gets
  # at most what is left of it, so the bundle is written even when the steps ran long
  if [ -n "${DEADLINE_S:-}" ]; then
    local left=$(( DEADLINE_S - SECONDS - 20 ))
    if [ "$left" -lt 15 ]; then summary+=("$(printf '%-14s skipped: %ss left of DEADLINE_S' "$name" "$left")"); return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name (limit ${limit}s): $*"
  # SIGINT, not TERM: a pytest that can still act on it prints its summary and writes its junit file (one busy in
  # a child process may not; --kill-after ends it then)
  timeout -s INT --kill-after=20 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$WORK/$name.log"
  summary+=("$(printf '%-14s rc=%-4s %5ss' "$name" "$rc" "$((SECONDS - t0))")")
}
for s in ${STEPS:-install env}; do
  case $s in
    install) step install 120 .ci/install ;;
    env) step env 60 verifybench env ;;
    tests) step tests "${TESTS_LIMIT:-560}" python3 -m pytest --durations=40 -rfE --junitxml="$WORK/junit.xml" \
             ${TEST_FILES:-} ;;  # the README's test command (after `install`), the whole suite unless TEST_FILES
    cycle) step cycle "${LIMIT:-400}" verifybench cycle --out "$WORK/run" ;;
    mla_verify) step mla_verify 200 verifybench mla_verify --out "$WORK/run" ;;
    verify) step verify "${LIMIT:-300}" verifybench verify --tokens "${TOKENS:-1-8}" --out "$WORK/run"
            step compare 60 verifybench compare "$BASE_VERIFY" "$WORK"/run/verify-*.json ;;
    run) step run "${LIMIT:-540}" verifybench run --out "$WORK/run"
         step compare 60 verifybench compare "$BASE_VERIFY" "$WORK"/run/verify-*.json ;;
    record) step record 200 verifybench record "$WORK/run/forward.json.gz" --tokens 4 \
              --components misc,attn_proj,attn_core,allreduce,router,moe,dense,head
            for r in verify_forward only-misc only-attn_proj only-attn_core only-allreduce only-router only-moe \
                     only-dense only-head; do
              step "trace-$r" 60 verifybench trace "$WORK/run/forward.json.gz" --cycle-range "$r" \
                --json "$WORK/run/trace-$r.json"
            done ;;
    recordcycle) step recordcycle 200 verifybench record "$WORK/run/cycle.json.gz" --what cycle --replays 10
                 step tracecycle 60 verifybench trace "$WORK/run/cycle.json.gz" --cycle-range spec_cycle \
                   --verify-range verify --json "$WORK/run/trace-cycle.json" ;;
    testdata) step testdata 200 bash -c "verifybench record $WORK/run/small-forward.json.gz --layers 3 --replays 3 \
                && verifybench record $WORK/run/small-cycle.json.gz --what cycle --layers 3 --replays 3" ;;
    sweeplist) step sweeplist 60 python3 -m verifybench.harness.multigpu.allreduce --nccl-sweep --list ;;
    core) step core "${LIMIT:-480}" verifybench run --components verify,cycle,mla_verify --out "$WORK/run"
          step compare 60 verifybench compare "$BASE_VERIFY" "$WORK"/run/verify-*.json ;;
    readme) step readme "${README_LIMIT:-420}" bash -c ".ci/install && verifybench run"  # the README's main job, as written
            step compare 60 bash -c "verifybench compare $BASE_VERIFY verifybench-results/*/verify-*.json"
            mkdir -p "$WORK/readme" && cp -r verifybench-results "$WORK/readme/" ;;
    hidden) step hidden "${HIDDEN_LIMIT:-300}" env VERIFYBENCH_CONFIG_TABLES=none VERIFYBENCH_MEMORY_CAP_GIB=94 \
              verifybench run ${HIDDEN_ARGS:---components moe_int4,verify --tokens 1,4,8} --out "$WORK/hidden" ;;
    tune) step tune "${LIMIT:-300}" verifybench tune --budget-s "${TUNE_BUDGET:-200}" --out "$WORK/tuned" ;;
    dvt) step dvt "${LIMIT:-240}" python3 scripts/defaults_vs_tuned.py "$WORK/run/defaults_vs_tuned.json" \
           --max-time-s "${DVT_MAX_TIME_S:-0.5}" $([ -d "$WORK/tuned" ] && echo --user-dir "$WORK/tuned") ;;
    diag) step diag "${DIAG_LIMIT:-120}" python3 -m pytest -q --tb=short ${DIAG:-tests} ;;
    diag2) step diag2 "${DIAG2_LIMIT:-120}" python3 -m pytest -q --tb=short ${DIAG2:-tests} ;;
    gputests) step gputests "${LIMIT:-300}" python3 -m pytest -q -m gpu -x -p no:randomly ;;
    bench) step bench "${LIMIT:-300}" python3 -m pytest --benchmark-only -q microbench/ \
             --benchmark-json="$WORK/run/bench.json" ;;
    bench3) for i in 1 2 3; do  # the README's benchmark command, three runs in a row on one machine
              step "bench$i" "${BENCH_LIMIT:-190}" python3 -m pytest --benchmark-only -q microbench/ \
                --benchmark-json="$WORK/run/bench$i.json"
            done ;;
    advise) step advise 60 verifybench advise "$WORK/run"
            step advise-tau 60 verifybench advise "$WORK/run" --accept-len 3:2.4,6:3.1
            [ -d "$WORK/batch" ] && step advise-batch 60 verifybench advise "$WORK/batch" --accept-len 3:2.4,6:3.1 ;;
    acceptance) step acceptance "${ACCEPT_LIMIT:-480}" env TMPDIR="$WORK" scripts/acceptance.sh --gpu  # its scratch folder is bundled
                for r in "$WORK"/verifybench-acceptance.*/verifybench-results/*/run-*.md; do
                  [ -f "$r" ] && { echo "=== $r: the first 40 lines"; head -n 40 "$r"; }
                done ;;
    engines) # the engines' own kernels beside ours: wheels fetched by scripts/fetch_engine_wheels.sh, carried in .whl/
      # at one fixed path: the carried FlashInfer cache's build files name the include folders of the install that
      # built them, and a module whose headers moved is rebuilt from them and fails
      engines=/tmp/vb/engines
      step engines-install 120 python3 -m pip install -q --no-index --no-deps --target "$engines" .whl/engines/*.whl
      # SGLang's Marlin JIT (6 min of nvcc) from an earlier call's savecache, at its fixed path: ninja reuses the
      # carried objects when the engines' headers are older than them (a fresh install dates them now): dated 2020
      export TVM_FFI_CACHE_DIR=/tmp/vb/jit
      if [ -f .cache-carry/sglang-jit.tar.gz ]; then
        find "$engines" -exec touch -h -d 2020-01-01 {} + && mkdir -p "$TVM_FFI_CACHE_DIR" \
          && tar -xzf .cache-carry/sglang-jit.tar.gz -C "$TVM_FFI_CACHE_DIR" && echo "sglang jit cache restored"
      fi
      export PYTHONPATH="$engines${PYTHONPATH:+:$PYTHONPATH}"
      # SGLang's utilities import torchvision's JPEG decoder at import time; where the image's torchvision does not
      # load with its torch, the tests' stand-in (tests/engine_stubs) serves that import and nothing else
      python3 -c "import torchvision" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/tests/engine_stubs"
      # SGLang's MoE module imports names from sgl-kernel (not carried): its stand-in, whose every op raises
      python3 -c "import sgl_kernel" 2>/dev/null \
        || export PYTHONPATH="$PYTHONPATH:$PWD/tests/engine_stubs/no_sgl_kernel"
      # the components with engine rows ($ENGINE_RUNS picks some), then the GPU tests in what is left of a
      # one-command budget ($BUDGET_S, at most $TESTS_MAX_S), so the timings come back first
      for c in ${ENGINE_RUNS:-mla_verify mla_decode moe_int4}; do
        case $c in
          moe_int4) step engines-moe_int4 "${MOE_INT4_LIMIT:-300}" verifybench moe_int4 --tokens 1-8 --out "$WORK/run" ;;
          *) step "engines-$c" "${ENGINE_LIMIT:-300}" verifybench "$c" --out "$WORK/run" ;;
        esac
      done
      left=$(( ${BUDGET_S:-540} - SECONDS )); [ "$left" -gt "${TESTS_MAX_S:-600}" ] && left=${TESTS_MAX_S:-600}
      [ "$left" -lt 30 ] && left=30
      [ "${TESTS_MAX_S:-600}" = 0 ] || step engines-tests "$left" python3 -m pytest -q -x tests/engines/test_engines.py tests/kernels/test_mla_verify.py \
        -k "engine or registers or w4a16" ;;
    batch) step batch "${LIMIT:-400}" verifybench cycle --batch "${BATCH:-1,2,4,8}" --contexts "${CONTEXTS:-1024,8192}" \
             ${CYCLE_ARGS:-} --out "$WORK/batch" ;;  # concurrency: B requests per cycle, apart from run's cycle file
    savecache) tar -czf "$OUT/triton-cache.tar.gz" -C "$cache" . && ls -la "$OUT/triton-cache.tar.gz"
               [ -d "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" ] && tar -czf "$OUT/flashinfer-cache.tar.gz" \
                 -C "$FLASHINFER_WORKSPACE_BASE/.cache" flashinfer && ls -la "$OUT/flashinfer-cache.tar.gz"
               # with the objects and ninja's logs, times to the nanosecond (ninja compares them with its log's)
               [ -d "${TVM_FFI_CACHE_DIR:-/nonexistent}" ] && tar --format=posix -czf "$OUT/sglang-jit.tar.gz" \
                 -C "$TVM_FFI_CACHE_DIR" . && ls -la "$OUT/sglang-jit.tar.gz" ;;
    *) echo "unknown step $s" ;;
  esac
done
printf '%s\n' "${summary[@]}" | tee "$WORK/summary.txt"
# a recorded trace is too big to come back
tar -czf "$OUT/bundle.tgz" --exclude=OUT.json.gz --exclude=./engines -C "$WORK" . && ls -la "$OUT/bundle.tgz"
