#!/usr/bin/env bash
# The issue-2 repeat on a GPU machine, in two device calls (one call's 600 s cannot hold two full suites):
#   STEP=first  scripts/repeat_gpu.sh   GPU tests of the engine; `pytest --benchmark-only microbench/` saved as
#                                       "first" (+ histogram); `verifybench harness` and `graph`; CLI vs pytest
#   STEP=second BASE=pb_first.json scripts/repeat_gpu.sh   the same pytest again; compare BASE vs it
# Output: $OUT/<step>.tgz and $OUT/pb_<step>.json; the compare summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
STEP=${STEP:?STEP=first or STEP=second}
OUT=${OUT:-/tmp/verifybench-out}
W=$OUT/$STEP
mkdir -p "$W"
if [ -d .whl ]; then  # pygal for --benchmark-histogram: not preinstalled on the GPU image
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
B="python3 -m pytest --benchmark-only -q -p no:cacheprovider microbench/ --benchmark-storage=file://$W/storage"
if [ "$STEP" = first ]; then
  python3 -m harness env > "$W/env.txt" 2>&1
  # what slows the host: the probe idle, with the GPU busy (host idle), with one other CPU busy
  P="timeout 40 python3 -m harness.hostprobe --seconds 10"
  $P > "$W/probe_idle.txt" 2>&1
  timeout 40 python3 - <<'PY' &
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    a @ a  # cuBLAS makes its handle and workspace outside the capture (inside, the capture was invalidated)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(100):
        a @ a
for _ in range(60):
    g.replay()  # ~0.2 s each on the GPU; enqueued at once, then the host sleeps
time.sleep(12)
torch.cuda.synchronize()
PY
  sleep 3; $P > "$W/probe_gpu_busy.txt" 2>&1; wait
  timeout 15 python3 -c "import time; t = time.time()
while time.time() - t < 12: pass" & sleep 1; $P > "$W/probe_cpu_busy.txt" 2>&1; wait
  grep -H -E "probe_us|replay_us|eager_us" "$W"/probe_*.txt
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_timing.py tests/test_hostprobe.py \
    tests/test_pytest_plugin.py > "$W/tests.log" 2>&1; echo "engine tests on the GPU: rc=$?"
  timeout 380 $B --benchmark-save=first --benchmark-json="$OUT/pb_first.json" --benchmark-histogram="$W/hist" \
    > "$W/pytest.log" 2>&1; echo "pytest first: rc=$?"
  for sub in harness graph; do
    timeout 60 python3 -m harness "$sub" > "$W/$sub.log" 2>&1; echo "verifybench $sub: rc=$?"
    f=$(ls -t results/*/"$( [ $sub = graph ] && echo graph_replay || echo baseline )"-2*.json | head -1)
    python3 -m harness compare "$f" "$OUT/pb_first.json" > "$W/compare_cli_${sub}_vs_pytest.txt" 2>&1
    cp "$f" "$W/"
    grep -E "summary:" "$W/compare_cli_${sub}_vs_pytest.txt"
  done
else
  timeout 420 $B --benchmark-save=second --benchmark-json="$OUT/pb_second.json" > "$W/pytest.log" 2>&1
  echo "pytest second: rc=$?"
  python3 -m harness compare "${BASE:?BASE=pb_first.json}" "$OUT/pb_second.json" > "$W/compare.txt" 2>&1
  echo "compare first vs second: rc=$?"
  grep -vE " SAME$" "$W/compare.txt" | cut -c1-160
fi
tail -3 "$W/pytest.log"
tar czf "$OUT/$STEP.tgz" -C "$W" . && rm -rf "$W"
