#!/usr/bin/env bash
# Runs every command README.md and docs/*.md show, as a user types them, and checks each exit code and one line of
# its output. usage: scripts/acceptance.sh [--cpu | --gpu]   (default: --gpu where a GPU is present, else --cpu)
#
# --cpu runs anywhere (without a GPU: the smoke profile, the torchrun jobs on gloo at tiny shapes); CI runs it after
#   the README's test command. 30 commands in about 2 minutes on the 2-core box, more under load (most of each
#   command's few seconds is importing torch).
# --gpu runs what only a GPU can measure, in one device command (about 4.5 minutes on an H200 or an H100): the main
#   job, compare against this GPU's committed baseline (refused as other hardware where none is committed), advise,
#   plan, project, record and trace on its results. With ACCEPT_LONG=1
#   (a device command of its own) also: pytest --benchmark-only microbench/ (on CPU it would time the smoke profile
#   for minutes and prove nothing the run does not), tune, defaults_vs_tuned.py, record --what cycle, cycle
#   --contexts, a run on no tables, and on several GPUs the torchrun jobs and the NCCL sweep. --cpu checks that the
#   GPU-only commands refuse in one line, and that the H200 baseline is refused as other hardware.
# Left to tests/suite/test_docs.py (parsed, not run): docs/FINDINGS.md (and its archive), results/baselines/INDEX.md, whose commands
# are the measurements behind dated findings and baselines (hours of GPU time), and the engines' own commands (curl,
# SGLang, vLLM) in README.md and docs/trace.md.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
part=${1:-auto}
case $part in
  --cpu|--gpu|auto) ;;
  *) echo "scripts/acceptance.sh: unknown argument '$part' (allowed: --cpu, --gpu, or nothing)" >&2; exit 2 ;;
esac
gpu=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$part" = auto ]; then
  if [ "$gpu" = 1 ]; then parts=gpu; else parts=cpu; fi
elif [ "$part" = --gpu ] && [ "$gpu" != 1 ]; then
  echo "scripts/acceptance.sh: --gpu needs a CUDA GPU (none here); run --cpu" >&2; exit 2
else
  parts=${part#--}
fi

# Commands run in a scratch folder that sees the checkout's results/, scripts/ and tests/data/, so that
# ./verifybench-results/<machine>/ is the user's default output folder and nothing lands in the checkout.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/verifybench-acceptance.XXXXXX")
ln -s "$REPO/results" "$WORK/results"; ln -s "$REPO/scripts" "$WORK/scripts"; mkdir -p "$WORK/tests"
ln -s "$REPO/tests/data" "$WORK/tests/data"; mkdir -p "$WORK/logs"
trap 'echo "interrupted: logs in $WORK/logs"; exit 130' INT
cd "$WORK"
rows=(); failed=0; n=0

# check RC PATTERN TIMEOUT_S COMMAND: runs COMMAND (one bash line) under timeout; ok when it exits RC and a line
# of its output (stdout and stderr) matches the extended regex PATTERN.
check() {
  local want=$1 pattern=$2 limit=$3 command=$4 rc ok=yes log
  n=$((n + 1)); log=$WORK/logs/$(printf %02d $n).log
  printf '[%02d] %s ... ' "$n" "$command"
  local start=$SECONDS
  timeout -k 10 "$limit" bash -c "$command" >"$log" 2>&1; rc=$?
  if [ "$rc" != "$want" ]; then ok=no; fi
  if ! grep -Eq -- "$pattern" "$log"; then ok=no; fi
  printf 'rc %s (%ss) %s\n' "$rc" $((SECONDS - start)) "$([ $ok = yes ] && echo ok || echo "FAILED: see $log")"
  [ $ok = yes ] || { failed=$((failed + 1)); tail -n 5 "$log" | sed 's/^/     | /'; }
  rows+=("$command"$'\t'"$rc"$'\t'"$want /$pattern/"$'\t'"$ok")
}

TRACE=tests/data/traces/suite-forward-k2.5-L3-TP-0.trace.json.gz
H200=results/baselines/nvidia-h200-x1

compare_with_baseline() {  # MACHINE RUN: SAME against this GPU's committed baseline; without one (a CPU, another
  # GPU model), the README's compare against the H200 baseline is refused in one line as other hardware
  local base; base=$(ls "results/baselines/$1"/verify.json* 2>/dev/null | head -n 1)
  if [ -n "$base" ]; then
    check 0 "SAME" 120 "verifybench compare $base $2/"
  else
    check 2 "cannot be compared|different GPU models" 120 "verifybench compare $H200/verify.json $2/"
  fi
}

cpu_part() {
  echo "== CPU part (without a GPU: the smoke profile; with one, the same commands on it)"
  check 0 "Exit codes" 60 "verifybench --help"
  check 0 "^report: " 900 "verifybench run"
  local machine; machine=$(ls verifybench-results | head -n 1)
  local run=verifybench-results/$machine verify
  check 0 "mla_verify" 300 "verifybench mla_verify --tokens 3,6"
  check 0 "verify" 300 "verifybench verify"
  check 0 "cycle" 600 "verifybench cycle --configs \"2,1,3;5,4,8\" --attention extend,split_kv"
  check 0 "cycle" 600 "verifybench cycle --configs \"2,1,3\" --contexts 1024,4096"
  # B requests at once: one shape at two batches keeps it short; advise gives its per-batch section
  check 0 "cycle" 600 "verifybench cycle --configs \"2,1,3\" --batch 1,2 --out batched"
  check 0 "^## Per batch" 120 "verifybench advise batched --accept-len 3:2.4,6:3.1"
  local cpu_label="CPU numbers"; [ "$gpu" = 1 ] && cpu_label="[0-9]"
  check 0 "$cpu_label" 120 "verifybench advise"
  check 0 "$cpu_label" 120 "verifybench advise $run --accept-len 3:2.4,6:3.1"
  check 0 "[0-9]" 120 "verifybench advise $H200 --accept-len 3:2.4,6:3.1"
  check 0 "tok" 60 "verifybench plan --decode-ms 11.1 --verify-ms 3:25.6,6:28.7 --draft-ms 1 --reextend-ms 0.3 --accept-len 3:2.4,6:3.1"
  check 0 "tok" 60 "verifybench plan $H200/cycle.json --accept-rates 0.8,0.7,0.6,0.5,0.4"
  # a file against its own folder: the folder's latest verify result is that file (one run's timings, so SAME;
  # CPU numbers get no verdict: the samples side by side, exit 0)
  verify=$(ls "$run"/verify-*.json | tail -n 1)
  local same_label="no verdict"; [ "$gpu" = 1 ] && same_label="SAME"
  check 0 "$same_label" 120 "verifybench compare $verify $run/"
  compare_with_baseline "$machine" "$run"
  check 0 "allreduce" 120 "verifybench trace $TRACE --against $H200/ --layers 3"  # the trace holds 3 of 61 layers
  check 0 "cycle" 120 "verifybench trace $TRACE --json cycle.json --chart cycle.png"
  check 0 "rtx|RTX" 60 "verifybench project $H200/verify.json --target rtx-pro-6000-pcie-tp8"
  check 0 "break" 60 "verifybench breakeven --accept-len 2.5"
  check 0 "copy" 300 "verifybench baseline"
  check 0 "CPU machine|GPU" 60 "verifybench env"
  check 0 "\\{" 60 "verifybench env --json"
  check 0 "NCCL_" 120 "python3 -m verifybench.harness.multigpu.allreduce --nccl-sweep --nproc-per-node=2 --list"
  check 0 "^all " 300 "python3 scripts/probe_bad_inputs.py probes.json --only kernel-edges,limits --no-torchrun"
  # SGLang's extend beside ours as ptxas builds them (no GPU needed); where SGLang is not importable, one line says so
  if python3 -c "import sglang" 2>/dev/null; then check 0 "prefix" 300 "python3 scripts/extend_fidelity.py"
  else check 2 "SGLang" 60 "python3 scripts/extend_fidelity.py"; fi
  [ "$gpu" = 1 ] && return  # with a GPU, the GPU part runs what follows for real
  check 2 "GPU" 60 "verifybench tune"
  check 2 "GPU" 60 "verifybench record OUT.json.gz"
  check 2 "GPU" 60 "python3 scripts/defaults_vs_tuned.py OUT.json"
  check 0 "saved" 300 "torchrun --nproc-per-node=2 -m verifybench.harness.multigpu.allreduce"
  check 0 "saved" 300 "torchrun --nproc-per-node=2 -m verifybench.harness.multigpu.verify"
}

gpu_part() {  # what only a GPU measures, sized for one 10-minute device command on an H200 (about 4.5 minutes)
  echo "== GPU part"
  check 0 "^report: " 600 "verifybench run"
  local machine; machine=$(ls verifybench-results | head -n 1)
  local gpu_run=verifybench-results/$machine
  compare_with_baseline "$machine" "$gpu_run"
  check 0 "Levers" 120 "verifybench advise"
  check 0 "tok/s" 120 "verifybench advise $gpu_run --accept-len 3:2.4,6:3.1"
  check 0 "tok" 60 "verifybench plan $gpu_run --accept-rates 0.8,0.7,0.6,0.5,0.4"
  check 0 "rtx|RTX" 60 "verifybench project $gpu_run --target rtx-pro-6000-pcie-tp8"
  check 0 "[0-9]" 300 "verifybench record OUT.json.gz"
  check 0 "allreduce" 120 "verifybench trace OUT.json.gz --against $gpu_run/"
  [ -n "${ACCEPT_LONG:-}" ] || return  # the rest outlasts one device command: ACCEPT_LONG=1 in a call of its own
  check 0 "passed" 600 "cd $REPO && python3 -m pytest --benchmark-only -q microbench/"
  check 0 "[0-9]" 600 "verifybench tune --budget-s 180 --out tuned"
  check 0 "[0-9]" 600 "python3 scripts/defaults_vs_tuned.py dvt.json --user-dir tuned --max-time-s 0.3"
  check 0 "[0-9]" 300 "verifybench record cycle.json.gz --what cycle"
  check 0 "cycle" 600 "verifybench cycle --configs \"2,1,3\" --contexts 1024,4096"
  check 0 "report: " 600 "VERIFYBENCH_CONFIG_TABLES=none verifybench run --components verify --out gpu-defaults"
  local gpus; gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if [ "$gpus" -ge 2 ]; then
    check 0 "saved" 300 "torchrun --nproc-per-node=$gpus -m verifybench.harness.multigpu.allreduce"
    check 0 "saved" 300 "torchrun --nproc-per-node=$gpus -m verifybench.harness.multigpu.verify"
    check 0 "export" 600 "python3 -m verifybench.harness.multigpu.allreduce --nccl-sweep --nproc-per-node=$gpus"
  fi
}

for p in $parts; do "${p}_part"; done

echo
echo "== summary ($n commands, $failed failed; logs in $WORK/logs)"
table() { if command -v column >/dev/null; then column -t -s $'\t'; else cat; fi; }
printf '%s\n' "command"$'\t'"rc"$'\t'"expected"$'\t'"ok" "${rows[@]}" | table
[ "$failed" -eq 0 ]
