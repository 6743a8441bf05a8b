#!/usr/bin/env bash
# One call on a lent GPU machine: fingerprint; the given microbench modules twice through pytest-benchmark (saved
# JSON, histogram) and compared; then `verifybench run`; everything packed into $OUT/run.tgz, a short table last.
# Usage: VERIFYBENCH_GIT_COMMIT=<sha> scripts/device_run.sh "microbench/bench_a.py ..." [verifybench subcommands...]
# (no subcommands: `verifybench run`, every component)
# (the tree sent to the device has no .git: the commit is passed in and lands in every fingerprint)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/verifybench-out}
W=$OUT/w
mkdir -p "$W"
if [ -d .whl ]; then  # pygal for --benchmark-histogram: not preinstalled on the GPU image
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
BENCH=${1:-microbench/}
shift || true

python3 -m harness env > "$W/env.txt" 2>&1
B="python3 -m pytest --benchmark-only -q -p no:cacheprovider $BENCH --benchmark-storage=file://$W/storage"
timeout 420 $B --benchmark-save=first --benchmark-json="$W/pb_first.json" --benchmark-histogram="$W/hist" \
  > "$W/pytest_first.log" 2>&1; echo "pytest first: rc=$?"
timeout 420 $B --benchmark-save=second --benchmark-json="$W/pb_second.json" > "$W/pytest_second.log" 2>&1
echo "pytest second: rc=$?"
python3 -m harness compare "$W/pb_first.json" "$W/pb_second.json" > "$W/compare_first_second.txt" 2>&1
echo "compare first vs second: rc=$?"
for sub in "${@:-run}"; do
  timeout 420 python3 -m harness "$sub" >> "$W/run.log" 2>&1; echo "verifybench $sub: rc=$?"
done
# the same cases timed by the CLI run and by pytest: medians must agree (graph-mode cases especially)
for comp in $(ls results/*/*-2*.json | xargs -n1 basename | sed 's/-2.*//' | sort -u); do
  f=$(ls -t results/*/"$comp"-2*.json | head -1)
  python3 -m harness compare "$f" "$W/pb_first.json" >> "$W/compare_cli_vs_pytest.txt" 2>&1
done
cp -r results "$W/"
grep -E "summary:|WARNING" "$W/compare_first_second.txt"
grep -E "graph|summary:" "$W/compare_cli_vs_pytest.txt" | head -20
tail -n 60 "$W/run.log"
tar czf "$OUT/run.tgz" -C "$W" . && rm -rf "$W"  # one file comes back (the device tool returns few files)
