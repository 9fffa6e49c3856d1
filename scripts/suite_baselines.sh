#!/usr/bin/env bash
# Issue 28's suite: its runs one at a time, each committed as it lands: the plain (policy
# none) baseline seeds of its new tasks by default, or any policy's runs interleaved with them.
#
#   nohup bash scripts/suite_baselines.sh >> /tmp/suite-baselines.log 2>&1 &
#
# The runs train the repository's *committed* code, from a clone of it (CODE, default
# /work/suite-code, pulled before every run), so that edits under way in the working tree
# reach no run; the run records that code's commit. Each run is one call of
# benchmarks/run_tta_full.sh (its sizes, LAYOUT=cpu, PLAIN_ONLY=1), writing
# benchmarks/results/tta-full/cpu/<task>/none-seed<S>.json in this working tree; a run whose
# JSON exists is skipped. A task the committed script does not size yet is waited for
# (checked every minute); a run of the same item already under way (an earlier runner's) is
# waited for. A finished run's JSON, and nothing else, is committed with the task, seed,
# final metric, training time, CPU model and the load average at its end in the message
# (the runs' times are only as good as the machine was idle).
#
# QUEUE overrides the order, as "task:seed" words (plain runs) or "task:seed:policy" (that
# policy; egeria trains through the cache as in run_tta_full.sh), e.g. arms taking turns on
# one machine: QUEUE="vgg-fmnist:1 vgg-fmnist:0:egeria vgg-fmnist:2 vgg-fmnist:1:egeria".
# A smoke test of the machinery:
#   CODE=/tmp/smoke-code OUT_ROOT=/tmp/smoke-out NO_COMMIT=1 QUEUE=vgg-fmnist:0 \
#     EXTRA="--epochs 1 --limit 256 --eval-limit 100" bash scripts/suite_baselines.sh
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
code=${CODE:-/work/suite-code}
out=${OUT_ROOT:-$repo/benchmarks/results/tta-full}
queue=${QUEUE:-"vgg-fmnist:0 vgg-fmnist:1 vgg-fmnist:2 transformer-ptb-cosine:0 transformer-ptb-cosine:1 transformer-ptb-cosine:2 gpt-ptb-order:0 gpt-ptb-order:1 gpt-ptb-order:2"}
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)

say() { echo "[suite-baselines $(date -Is)] $*"; }

sync_code() {
  if [ ! -d "$code/.git" ]; then
    git clone -q "$repo" "$code" || return 1
  fi
  git -C "$code" pull -q --ff-only || return 1
}

commit_run() {  # json task seed name
  local summary msg try
  summary=$("$repo/.venv/bin/python" - "$1" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))
final = run["final"]
print(f"{run['metric']['name']} {final['metric']:.5g}, {final['wall_time_s']:.1f} s of training, code {str(run.get('code'))[:7]}")
PY
  ) || summary="(summary unreadable)"
  local what="plain baseline"
  [ "$4" = none ] || what="$4 run"
  msg="Results: suite $what $2 seed $3, cpu layout: $summary; $cpu, 2 cores; load average at its end $(cut -d' ' -f1-3 /proc/loadavg) (scripts/suite_baselines.sh)"
  for try in 1 2 3 4 5 6 7 8 9 10; do
    if git -C "$repo" add -- "$1" && git -C "$repo" commit -q -m "$msg" -- "$1"; then
      say "committed $1: $msg"; return 0
    fi
    sleep 15  # another engineer's git command holds the index
  done
  say "could not commit $1"
}

commit_pretraining() {  # the encoder's pretraining record, once, when it appears
  local record=$out/cpu/gpt-ptb-order/pretraining.json msg summary
  [ -f "$record" ] && [ "${NO_COMMIT:-0}" != 1 ] || return 0
  git -C "$repo" ls-files --error-unmatch -- "$record" >/dev/null 2>&1 && return 0
  summary=$("$repo/.venv/bin/python" - "$record" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
last = r["epochs"][-1]
kind, key = ("next-word", "valid_next_word_accuracy") if "valid_next_word_accuracy" in last else ("masked-word", "valid_masked_accuracy")
print(f"{r['steps']} steps, {kind} accuracy {last[key]:.4f} on the validation text, "
      f"{r['train_s']:.0f} s of training, code {str(r.get('code'))[:7]}")
PY
  ) || summary="(summary unreadable)"
  msg="Results: the suite's GPT-style model pretrained on PTB (scripts/pretrain_ptb_lm.py, seed 0): $summary; $cpu, 2 cores; the weights stay out of git (the script makes them)"
  git -C "$repo" add -- "$record" && git -C "$repo" commit -q -m "$msg" -- "$record" && say "committed $record"
}

# Other work beside the timed runs must be niced, and nice orders processes only within one
# scheduling group: with the kernel's autogroups on (each terminal session its own group), a
# niced test run in another session takes half the cores from a run here (seen: a plain
# vgg-fmnist run at 0.9 cores for 30 minutes beside niced helpers). Turn them off (as root:
# echo 0 > /proc/sys/kernel/sched_autogroup_enabled) before starting anything else.
if [ "$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null)" = 1 ]; then
  say "WARNING: sched autogroups are on: niced work in other sessions competes with these runs as equals"
fi

for item in $queue; do
  IFS=: read -r task seed policy <<< "$item"
  policy=${policy:-none} name=$policy
  if [ "$policy" = egeria ] && [ "$task" != gpt-ptb-order ]; then name=egeria-cache; fi
  json=$out/cpu/$task/$name-seed$seed.json
  if [ -f "$json" ]; then say "skip $task seed $seed: $json exists"; continue; fi
  # A run of this item already under way (started by an earlier runner): wait for it.
  while pgrep -f -- "$task --policy $policy --seed $seed --layout cpu --out $out" >/dev/null; do
    say "a run of $task seed $seed is under way: waiting for it"; sleep 120
  done
  if [ -f "$json" ]; then commit_run "$json" "$task" "$seed" "$name"; continue; fi
  until sync_code && grep -q "^\s*\[$task\]=" "$code/benchmarks/run_tta_full.sh"; do
    say "waiting for $task in the committed benchmarks/run_tta_full.sh"; sleep 60
  done
  say "start $task seed $seed ($policy) at code $(git -C "$code" rev-parse --short HEAD)"
  LAYOUT=cpu OUT=$out TASKS=$task SEEDS=$seed POLICY=$policy \
    EGERIA="env PYTHONPATH=$code/src $repo/.venv/bin/egeria" PYTHON="env PYTHONPATH=$code/src $repo/.venv/bin/python" \
    bash "$code/benchmarks/run_tta_full.sh"
  status=$?
  if [ -f "$json" ] && [ "${NO_COMMIT:-0}" = 1 ]; then say "wrote $json (not committed: NO_COMMIT=1)"
  elif [ -f "$json" ]; then commit_run "$json" "$task" "$seed" "$name"; else say "$task seed $seed failed (exit $status), no $json"; fi
  commit_pretraining
done
say "queue done"
