#!/usr/bin/env bash
# Does the frontier move with run length on a GPU? Every session of the run-length study
# (benchmarks/frontier.py) at once on one GPU machine: each session pinned to its own two
# host cores, its arms taking turns on the GPU as on the CPU. Sessions share the GPU, so
# the speedups are read only within a session (its arms take turns); accuracy is untouched.
#
#   bash benchmarks/frontier_device.sh OUT_DIR [DEADLINE_S] [knob|baselines]
#
# knob (the default): the knob's values at 1x, 4x and 16x, into results/frontier-gpu.
# baselines: the demo's length, seeds 0-2, Egeria's fast value and its no-bound value (1)
# beside the two baselines no Egeria setting dominated on the CPU VM (static at step 450,
# FreezeOut t0=0.5), into results/frontier-gpu-baselines.
#
# Run from the repository root on the GPU machine (no install: PYTHONPATH=src); Fashion-MNIST's
# four IDX files go in ${FMNIST:-.devdata} (carried there). Writes OUT_DIR/<results folder>.tgz with
# every finished session file and each session's log; a session still running at the deadline
# keeps running (setsid) and a second call with the same arguments collects it.
set -u
out=${1:?OUT_DIR}; deadline=${2:-560}; set_name=${3:-knob}
mkdir -p /usr/share/datasets/fashion-mnist
cp -n "${FMNIST:-.devdata}"/*-ubyte.gz /usr/share/datasets/fashion-mnist/ 2>/dev/null
export PYTHONPATH=src OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1
case $set_name in
knob) res=benchmarks/results/frontier-gpu; sessions=(
  "16 0 plain egeria:safe egeria:fast"
  "16 1 plain egeria:safe egeria:fast"
  "16 2 plain egeria:safe egeria:fast"
  "4 0 plain egeria:safe egeria:balanced egeria:fast"
  "4 1 plain egeria:safe egeria:balanced egeria:fast"
  "4 2 plain egeria:safe egeria:balanced egeria:fast"
  "1 0 plain egeria:safe egeria:balanced egeria:fast"
  "1 1 plain egeria:safe egeria:balanced egeria:fast"
  "1 2 plain egeria:safe egeria:balanced egeria:fast"
) ;;
baselines) res=benchmarks/results/frontier-gpu-baselines; base="plain egeria:fast egeria:1 static:count=5:at_step=450 freezeout:t0=0.5"
  sessions=("1 0 $base" "1 1 $base" "1 2 $base") ;;
*) echo "unknown set $set_name: knob or baselines" >&2; exit 2 ;;
esac
logs=$res/logs; mkdir -p "$logs"
if ! pgrep -f "frontier.py run" >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  i=0
  for s in "${sessions[@]}"; do
    read -r scale seed arms <<<"$s"
    [ -f "$res/x$scale/seed$seed-$set_name.json" ] && continue
    setsid taskset -c $((2 * i)),$((2 * i + 1)) python3 benchmarks/frontier.py run --device cuda --out "$res" \
      --label "$set_name" --seed "$seed" --scale "$scale" $arms >"$logs/x$scale-seed$seed.log" 2>&1 </dev/null &
    i=$((i + 1))
  done
fi
start=$(date +%s)
while pgrep -f "frontier.py run" >/dev/null && [ $(($(date +%s) - start)) -lt "$deadline" ]; do sleep 5; done
echo "after $(($(date +%s) - start)) s: $(ls $res/x*/*.json 2>/dev/null | wc -l) sessions done, $(pgrep -fc 'frontier.py run') running"
tail -n 3 "$logs"/*.log
tar czf "$out/$(basename "$res").tgz" -C benchmarks/results "$(basename "$res")"
