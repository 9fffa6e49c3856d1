"""What does Egeria cost a step on an accelerator before any freeze, by where its controller runs?

What Egeria costs a training step on an accelerator before anything freezes, by where its
controller runs: one command for a GPU machine.

``benchmarks/device_check.py`` found Egeria's Transformer run on an H100 0.81x of plain's
with nothing frozen, while Egeria's own timed work was 1.1% of the run. This script looks
for the rest. The same Transformer as there (``device_check``'s ``transformer-6``, bf16
autocast, the same seed and batches in every arm) trains ``--steps`` steps under each arm,
the arms interleaved and the list run ``--rounds`` times (the spread between rounds is the
noise). The learning rate stays at its peak (a constant schedule, told to Egeria with a
length ten times the run's), so nothing freezes and every difference is Egeria's cost:

- ``plain``: no Egeria.
- ``none``: Egeria with the ``none`` policy: its wrapper, hooks and step, no readings.
- ``process``: Egeria's rule, its defaults beside an accelerator (the controller in its own
  process on one host thread, the reference on the host).
- ``process-4cpus``: the same with the controller on four host cores (``controller_cpus``).
- ``inline``: the rule with the controller on the training thread (``executor="inline"``).
- ``on-device``: the rule with its reference on the model's device (``reference_device="model"``).

Per arm and round: the whole time, the median and mean step, the median of the steps at
which a reading began (the evaluation steps) and of the others, each against plain's same
steps, the controller's counts, and which processes hold a CUDA context while it trains
(``nvidia-smi``: a controller process that made one would share the GPU with training).

On a GPU machine, from the repository root::

    PYTHONPATH=src python3 benchmarks/device_overhead.py --ptb DIR --out $OUT/device_overhead.json

``--device cpu --quick`` runs every arm for a few steps on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import egeria  # noqa: E402

ARMS = {
    "plain": None,
    "none": {"policy": "none"},
    "process": {"executor": "process"},
    "process-4cpus": {"executor": "process", "controller_cpus": [1, 2, 3, 4]},
    "inline": {"executor": "inline"},
    "on-device": {"reference_device": "model"},
}


def _device_check() -> Any:
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_check", module)
    spec.loader.exec_module(sys.modules["device_check"])
    return sys.modules["device_check"]


def _gpu_processes() -> list[str]:
    """The processes holding a CUDA context now (``nvidia-smi``), or why none could be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()] or [out.stderr.strip() or "none"]
    except (OSError, subprocess.SubprocessError) as err:
        return [f"not read: {err}"]


def run_arm(task: Any, arm: str, device: torch.device, amp: bool, check: Any) -> dict:
    """Trains ``task`` under ``arm`` (``check``: the device_check module, whose batches and
    timed training step it shares)."""
    torch.manual_seed(0)
    model = task.build().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    eg = None
    options = ARMS[arm]
    if options is not None:
        eg = egeria.Egeria(model, optimizer, lr_scheduler=scheduler, total_steps=10 * task.steps,
                           config=egeria.EgeriaConfig(**options))
    step_s: list[float] = []
    reading_steps: list[int] = []
    seen_sent = 0
    processes: list[str] = []
    model.train()
    loader = task.loader()
    for step, (x, y) in enumerate(check.batches(task, loader), start=1):
        loss, _, seconds = check.timed_step(task, model, optimizer, scheduler, eg, x, y, device, amp)
        step_s.append(seconds)
        if eg is not None:
            stats = eg.controller_stats
            sent = stats.get("sent", 0) + stats.get("dropped", 0)
            if sent != seen_sent:
                reading_steps.append(step)
                seen_sent = sent
        if step == task.steps // 2 and device.type == "cuda":
            processes = _gpu_processes()
    stats: dict = {}
    if eg is not None:
        stats = {k: v for k, v in eg.controller_stats.items() if k in ("executor", "sent", "dropped", "answered", "late",
                                                                       "controller_seconds", "overhead")}
        eg.close()
    return {"arm": arm, "step_s": step_s, "reading_steps": reading_steps, "controller": stats,
            "gpu_processes": processes, "final_loss": float(loss.detach())}


def summarise(runs: list[dict]) -> list[dict]:
    """Each run against the plain run of its round, step for step."""
    rows = []
    plains = {r["round"]: r for r in runs if r["arm"] == "plain"}
    for run in runs:
        plain = plains[run["round"]]["step_s"]
        steps = run["step_s"]
        at_reading = set(run["reading_steps"])
        read = [s for i, s in enumerate(steps, start=1) if i in at_reading]
        other = [s for i, s in enumerate(steps, start=1) if i not in at_reading]
        plain_other = [s for i, s in enumerate(plain, start=1) if i not in at_reading]
        rows.append({
            "arm": run["arm"], "round": run["round"], "train_s": sum(steps), "speedup": sum(plain) / sum(steps),
            "median_step_ms": 1000 * statistics.median(steps), "mean_step_ms": 1000 * statistics.fmean(steps),
            "reading_steps": len(read), "median_reading_step_ms": 1000 * statistics.median(read) if read else None,
            "median_other_step_ms": 1000 * statistics.median(other),
            "plain_median_other_step_ms": 1000 * statistics.median(plain_other),
            "controller": run["controller"], "gpu_processes": run["gpu_processes"],
        })
    return rows


def plot(report: dict, path: Path) -> None:
    """Each run's step times (ms) as a box, arms side by side, one colour per round: the
    spread within a run and between rounds beside the arms' differences."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    runs = report["runs"]
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    rounds = sorted({r["round"] for r in runs})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(rounds)
    for k, round_ in enumerate(rounds):
        mine = {r["arm"]: r for r in runs if r["round"] == round_}
        data = [[1000 * s for s in mine[a]["step_s"]] for a in arms if a in mine]
        where = [i + (k - (len(rounds) - 1) / 2) * width for i, a in enumerate(arms) if a in mine]
        boxes = ax.boxplot(data, positions=where, widths=width * 0.9, showfliers=False, patch_artist=True)
        for box in boxes["boxes"]:
            box.set_facecolor(f"C{k}")
            box.set_alpha(0.5)
        ax.plot([], [], color=f"C{k}", lw=6, alpha=0.5, label=f"round {round_}")
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("step time (ms), whiskers 1.5 IQR, outliers not drawn")
    machine = report["machine"]
    ax.set_title(f"{report['task']}, {report['steps']} steps, nothing frozen: {machine.get('gpu', machine['device'])}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--ptb", type=Path, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "device_check" / "device_overhead.json")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if arms[0] != "plain" or any(a not in ARMS for a in arms):
        p.error(f"--arms must start with plain and name only {list(ARMS)}; got {args.arms!r}")
    check = _device_check()
    device = torch.device(args.device)
    amp = not args.no_amp
    command = "PYTHONPATH=src python3 benchmarks/device_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(command)
    machine = check.describe(device)
    print(json.dumps(machine))
    all_tasks, _ = check.tasks(args.steps, args.quick, Path("/nonexistent"), args.ptb)
    task = all_tasks[1]
    check.run_arm(check.Task(**{**task.__dict__, "steps": min(20, args.steps)}), "plain", device, amp,
                  lambda *a: 0.0)  # untimed warm-up
    runs = []
    for round_ in range(args.rounds):
        for arm in arms:
            run = run_arm(task, arm, device, amp, check)
            run["round"] = round_
            runs.append(run)
            print(f"round {round_} {arm}: {sum(run['step_s']):.2f} s", flush=True)
    rows = summarise(runs)
    report = {"command": command, "machine": machine, "task": task.name, "data": task.data, "steps": args.steps,
              "amp": "bf16" if amp else "fp32", "rows": rows, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    print(f"\n{task.name} ({task.data}), {args.steps} steps, nothing frozen")
    print(f"{'arm':14} {'round':>5} {'train s':>8} {'speedup':>8} {'median ms':>9} {'mean ms':>8} "
          f"{'reading ms':>10} {'other ms':>9} {'plain other':>11}  sent/dropped  GPU processes")
    for r in rows:
        c = r["controller"]
        reading = "-" if r["median_reading_step_ms"] is None else f"{r['median_reading_step_ms']:.2f}"
        print(f"{r['arm']:14} {r['round']:5d} {r['train_s']:8.2f} {r['speedup']:7.3f}x {r['median_step_ms']:9.2f} "
              f"{r['mean_step_ms']:8.2f} {reading:>10} {r['median_other_step_ms']:9.2f} "
              f"{r['plain_median_other_step_ms']:11.2f}  {c.get('sent', '-')}/{c.get('dropped', '-')}  "
              f"{len(r['gpu_processes'])}: {'; '.join(r['gpu_processes'])[:80]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
