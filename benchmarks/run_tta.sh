#!/usr/bin/env bash
# How long does each policy take to each task's target? Every task under every policy, one run after
# another on the same machine, plus a second seed of plain training for the seed spread.
# Runs whose JSON already exists are skipped, so the script can be resumed across
# sessions; then `egeria report` turns the runs into tables and plots.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/runs
# The sizes that fit this project's 2-core CPU machine: one core per run (pinned, one
# torch thread, so development on the other core does not disturb the timings), a
# training subset for the two larger tasks, the full validation sets.
declare -A size=(
  [resnet-fmnist]="--limit 15000"
  [finetune-mnist]=""
  [transformer-ptb]="--limit 6400"
)
export OMP_NUM_THREADS=1
core=${CORE:-0}  # CORE=1 runs a second lane on the other core (it skips what exists, too)
run() {  # task policy seed
  # The recorded runs predate layouts ($out/TASK/, read as accel by egeria report); a new
  # run goes to $out/cpu/TASK/ (the default layout, on the one core taskset leaves it).
  local json
  for json in "$out/$1/$2-seed$3.json" "$out/cpu/$1/$2-seed$3.json"; do
    if [ -f "$json" ]; then echo "skip $json"; return; fi
  done
  # shellcheck disable=SC2086
  taskset -c "$core" .venv/bin/egeria bench "$1" --policy "$2" --seed "$3" --out "$out" --no-progress ${size[$1]}
}
tasks="resnet-fmnist finetune-mnist transformer-ptb"  # finetune needs resnet-fmnist/none-seed0.pt
for task in $tasks; do
  run "$task" none 0
  run "$task" none 1
  for policy in freezeout autofreeze linear static; do
    run "$task" "$policy" 0
  done
done
for task in $tasks; do
  run "$task" egeria 0
done
.venv/bin/egeria report "$out" --out benchmarks/results
