#!/usr/bin/env bash
# Time-to-accuracy benchmark (issue 3): every task under every policy, one run after
# another on the same machine, plus a second seed of plain training for the seed spread.
# Runs whose JSON already exists are skipped, so the script can be resumed across
# sessions; then `egeria report` turns the runs into tables and plots.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/runs
run() {  # task policy seed
  local json="$out/$1/$2-seed$3.json"
  if [ -f "$json" ]; then echo "skip $json"; return; fi
  .venv/bin/egeria bench "$1" --policy "$2" --seed "$3" --out "$out" --no-progress
}
for task in resnet-fmnist transformer-ptb finetune-mnist; do  # finetune needs resnet-fmnist/none-seed0.pt
  run "$task" none 0
  run "$task" none 1
  for policy in egeria freezeout autofreeze linear static; do
    run "$task" "$policy" 0
  done
done
.venv/bin/egeria report "$out" --out benchmarks/results
