#!/usr/bin/env bash
# One device call: how much does the host CPU's speed wander, and do host-timed figures follow it?
# 1) CPU topology and steal time; 2) hostprobe series in one process (pinned, unpinned) and in fresh processes;
# 3) a scan for hidden core siblings: the probe on the pinned CPU while one other CPU busy-loops;
# 4) the harness + graph-replay microbenches through pytest twice, compared (host_% column).
# Everything lands in $OUT/host_noise.tgz; a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/verifybench-out}
W=$OUT/w
mkdir -p "$W"
{ nproc; lscpu; for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$c $(cat $c/topology/thread_siblings_list 2>/dev/null)"; done
  grep MHz /proc/cpuinfo | sort | uniq -c; cat /proc/loadavg; } > "$W/cpu.txt" 2>&1
grep '^cpu ' /proc/stat > "$W/stat_before.txt"
timeout 90 python3 -m harness.hostprobe --seconds 40 --json "$W/series_pinned.json" > "$W/series.txt" 2>&1
VERIFYBENCH_PIN_CPU=off timeout 60 python3 -m harness.hostprobe --seconds 20 --json "$W/series_unpinned.json" \
  >> "$W/series.txt" 2>&1
for i in 1 2 3 4; do
  timeout 40 python3 -m harness.hostprobe --seconds 5 --json "$W/series_proc$i.json" >> "$W/series.txt" 2>&1
done
timeout 90 python3 - > "$W/siblings.txt" 2>&1 <<'PY'
# probe on the pinned CPU while each other allowed CPU busy-loops: a CPU whose load slows ours shares its core
import os, time, multiprocessing as mp
from harness import hostpin, hostprobe
me = hostpin.pin("auto")["cpu"]
def spin(cpu, stop):
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        pass
def probe(n=20):
    return sorted(hostprobe.probe_us() for _ in range(n))[n // 2]
base = probe()
print(f"pinned cpu {me}: probe {base:.1f} us idle")
for cpu in sorted(os.sched_getaffinity(0) | set(range(os.cpu_count()))):
    if cpu == me:
        continue
    stop = mp.Event(); p = mp.Process(target=spin, args=(cpu, stop)); p.start(); time.sleep(0.1)
    t = probe(); stop.set(); p.join()
    print(f"busy cpu {cpu:3d}: probe {t:8.1f} us  x{t / base:.2f}")
print(f"pinned cpu {me}: probe {probe():.1f} us idle again")
PY
B="python3 -m pytest --benchmark-only -q -p no:cacheprovider microbench/bench_harness.py microbench/bench_graph_replay.py"
timeout 240 $B --benchmark-json="$W/pb_first.json" > "$W/pytest_first.log" 2>&1; echo "pytest first: rc=$?"
timeout 240 $B --benchmark-json="$W/pb_second.json" > "$W/pytest_second.log" 2>&1; echo "pytest second: rc=$?"
python3 -m harness compare "$W/pb_first.json" "$W/pb_second.json" > "$W/compare.txt" 2>&1
echo "compare: rc=$?"
grep '^cpu ' /proc/stat > "$W/stat_after.txt"
tar czf "$OUT/host_noise.tgz" -C "$W" .
grep -E "Model name|Thread|Core|Socket|NUMA node" "$W/cpu.txt"; cat "$W/stat_before.txt" "$W/stat_after.txt"
cat "$W/series.txt"; cat "$W/siblings.txt" | sort -t x -k2 -n | tail -5
grep -E "host_|replay|eager|hot|summary|NOTE" "$W/compare.txt" | cut -c1-150
