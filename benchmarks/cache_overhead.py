"""What does evaluating cost before anything freezes, with and without the activation cache?

What evaluating costs before anything freezes, with and without the activation cache:
plain training, Egeria evaluating but never freezing, and the same through
``Egeria.cache_loader``, side by side on the demo's setting (ResNet-20, 12,800 Fashion-MNIST
images, batch 128, the demo's schedule) or, with ``--task vgg-fmnist``, on suite task (b)'s
first steps (``egeria.bench.tasks``: the VGG-style net, augmented Fashion-MNIST, warm-up and
cosine over its 10 epochs; up to one epoch, 469 steps, is measured as it trains: beyond it the
plain arm would see epoch 0's augmented variants again), in either benchmark layout (``egeria.bench.layouts``:
``cpu``, every core training; ``accel``, one core and thread training, Egeria's controller
process on the others).

The three arms train at once, each in its own process, taking turns every ``--turn`` steps
(``egeria.bench.turns``), so the machine's drift falls on all three; the order of the arms within
a round rotates with ``--rounds``. Egeria runs its default configuration with
``horizon`` and ``floor_ratio`` set so that nothing freezes before its last step (its readings, controller and
cost budget run as usual).

    .venv/bin/python benchmarks/cache_overhead.py [--task vgg-fmnist] [--steps 300] [--turn 10] [--rounds 2] [--layout cpu]

Per arm: the training steps' time (forward, backward, optimizer, scheduler, ``eg.step``;
the loader's time apart), the process's CPU time (user and system, every thread) and minor
page faults over the training loop, Egeria's own counted time; the ratios to plain. Every
arm fixes glibc's heap thresholds first (``egeria.bench.allocator``) unless ``--heap default``.
With ``--profile`` each arm's loop runs under cProfile and its record says where the
Python time went (egeria's own functions per step, the costliest functions); the profiler
slows every call, so those runs' times are not the measurement.
Writes ``benchmarks/results/eval_overhead/[<task>-]cache-turns-<layout>-<heap>-heap[-profile].json`` (the
task named unless it is the demo's).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("plain", "egeria", "egeria-cache")


def _start(threads: int, steady: bool) -> None:
    import torch

    from egeria.bench.allocator import steady_heap

    torch.set_num_threads(threads)
    if steady and not steady_heap():
        raise RuntimeError("glibc refused the heap thresholds in an arm's process")


def _arm(name: str, steps: int, seed: int, layout: str, task: str, profile: bool = False) -> dict:
    from egeria.bench.layouts import pinned, resolve_layout

    place = resolve_layout(layout)
    with pinned(place):
        return _train_arm(name, steps, seed, place.config_overrides("egeria"), task, profile)


def _profiled(profiler: cProfile.Profile, steps: int) -> dict:
    """Where the profiled loop's Python time went: the time spent in egeria's own functions
    (their own time, not their callees'), per step, and the functions that took the most,
    egeria's and all."""
    import egeria

    stats = pstats.Stats(profiler)
    source = str(Path(egeria.__file__).parent)
    rows = [
        {"function": f"{Path(file).name}:{line}({func})", "calls": calls, "own_ms_per_step": 1e3 * own / steps,
         "egeria": file.startswith(source)}
        for (file, line, func), (_, calls, own, _, _) in stats.stats.items()
    ]
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    ours = [r for r in rows if r["egeria"]]
    return {
        "egeria_own_ms_per_step": sum(r["own_ms_per_step"] for r in ours),
        "top_egeria": ours[:12],
        "top": rows[:12],
    }


def _setup(task: str, seed: int) -> tuple:
    """model, optimizer, scheduler, the run's length in steps, and a loader of (x, y)
    batches (for ``vgg-fmnist``, its augmented data at epoch 0)."""
    import torch

    if task == "demo":
        import egeria.bench.demo as demo

        s = demo.FULL
        prepared = demo.prepare(s, seed)
        model, optimizer, scheduler = demo._setup(prepared.initial, s, prepared.milestones)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(*prepared.train), batch_size=s.batch_size, shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        return model, optimizer, scheduler, prepared.total_steps, loader
    from egeria.bench.tasks import build_task

    built, epochs = build_task(task, seed=seed, eval_limit=1)
    return built.model, built.optimizer, built.scheduler, built.steps_per_epoch * epochs, built.batches()


def _train_arm(name: str, steps: int, seed: int, overrides: dict, task: str = "demo", profile: bool = False) -> dict:
    import torch

    from egeria import Egeria, EgeriaConfig
    from egeria.bench.turns import current

    turns = current()
    assert turns is not None
    model, optimizer, scheduler, total_steps, loader = _setup(task, seed)
    eg = None
    if name != "plain":
        never = EgeriaConfig(horizon=1e-12, floor_ratio=0, **overrides)  # evaluates as usual, freezes nothing before the end
        eg = Egeria(model, optimizer, config=never, lr_scheduler=scheduler, total_steps=total_steps)
        if name == "egeria-cache":
            loader = eg.cache_loader(loader)
    loss_fn = torch.nn.CrossEntropyLoss()
    step_s, loader_s, done = 0.0, 0.0, 0
    try:
        turns.join()
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        before = resource.getrusage(resource.RUSAGE_SELF)
        while done < steps:
            waiting = time.perf_counter()
            for x, y in loader:
                started = time.perf_counter()
                loader_s += started - waiting
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                scheduler.step()
                if eg is not None:
                    eg.step(loss)
                step_s += time.perf_counter() - started
                done += 1
                turns.step()
                if done >= steps:
                    break
                waiting = time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
        if profiler is not None:
            profiler.disable()
    finally:
        turns.leave()
    record = {
        "arm": name, "steps": done, "step_s": step_s, "loader_s": loader_s,
        "cpu_user_s": after.ru_utime - before.ru_utime, "cpu_sys_s": after.ru_stime - before.ru_stime,
        "minor_faults": after.ru_minflt - before.ru_minflt,
    }
    if profiler is not None:
        record["profile"] = _profiled(profiler, done)
    if eg is not None:
        record["frozen"] = list(eg.frozen)
        record["readings"] = len({row["step"] for row in eg.history})
        record["egeria_counted_s"] = eg.controller_stats["overhead"]["egeria_s"]
        record["eval_interval"] = eg.eval_interval
        eg.close()
    return record


def _round(
    order: list[str], steps: int, turn: int, seed: int, threads: int, steady: bool, layout: str, task: str,
    profile: bool = False,
) -> dict[str, dict]:
    from egeria.bench.turns import run_in_turns

    calls = [(name, steps, seed, layout, task, profile) for name in order]
    records = run_in_turns(_arm, calls, turn, initializer=_start, initargs=(threads, steady))
    return dict(zip(order, records))


def main() -> None:
    import torch

    from egeria.bench.allocator import can_fix_heap
    from egeria.bench.machine import describe_machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per arm (bootstrapping ends near 80)")
    parser.add_argument("--turn", type=int, default=10, help="steps per turn")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the arms' order rotated in each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=("demo", "vgg-fmnist"), default="demo",
                        help="demo: the demo's ResNet-20 setting; vgg-fmnist: suite task (b)")
    parser.add_argument(
        "--layout", choices=("cpu", "accel"), default="cpu",
        help="cpu: every arm trains on all cores, Egeria's controller where its config puts it; accel: every arm "
        "trains on the first core with one thread, Egeria's controller in a process on the others",
    )
    parser.add_argument(
        "--heap", choices=("steady", "default"), default="steady",
        help="steady: every arm fixes glibc's heap thresholds first (egeria.bench.allocator); default: as the process starts",
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="run each arm's loop under cProfile and record where its Python time went (the profiler slows "
        "every Python call, so the arms' times are then not the measurement; the file is named -profile)",
    )
    args = parser.parse_args()
    if args.heap == "steady" and not can_fix_heap():
        parser.error("--heap steady needs glibc's mallopt (this C library has none); use --heap default")
    command = " ".join([".venv/bin/python", "benchmarks/cache_overhead.py", *sys.argv[1:]])
    machine = describe_machine()
    print(command)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    threads = torch.get_num_threads()
    rounds = []
    for index in range(args.rounds):
        order = list(ARMS[index % 3:] + ARMS[: index % 3])
        records = _round(
            order, args.steps, args.turn, args.seed, threads, args.heap == "steady", args.layout, args.task, args.profile
        )
        assert not any(r.get("frozen") for r in records.values()), "a module froze"
        plain = records["plain"]
        for name in ARMS:
            r = records[name]
            r["step_ratio"] = r["step_s"] / plain["step_s"]
            r["cpu_ratio"] = (r["cpu_user_s"] + r["cpu_sys_s"]) / (plain["cpu_user_s"] + plain["cpu_sys_s"])
            print(
                f"round {index} ({' > '.join(order)}): {name:>12}: steps {r['step_s']:7.1f} s ({r['step_ratio']:.3f}x), "
                f"cpu {r['cpu_user_s'] + r['cpu_sys_s']:7.1f} s ({r['cpu_ratio']:.3f}x), loader {r['loader_s']:5.1f} s, "
                f"minor faults {r['minor_faults']}"
                + (f", readings {r['readings']}, Egeria counted {r['egeria_counted_s']}" if name != "plain" else ""),
                flush=True,
            )
            if "profile" in r:
                print(f"    Python time in egeria's functions: {r['profile']['egeria_own_ms_per_step']:.3f} ms a step; most: "
                      + ", ".join(f"{f['function']} {f['own_ms_per_step']:.3f}" for f in r["profile"]["top_egeria"][:5]))
        rounds.append({"order": order, "arms": records})
    summary = {
        name: {
            "step_ratio_median": statistics.median(r["arms"][name]["step_ratio"] for r in rounds),
            "cpu_ratio_median": statistics.median(r["arms"][name]["cpu_ratio"] for r in rounds),
        }
        for name in ARMS[1:]
    }
    for name, figures in summary.items():
        print(f"{name}: step time {figures['step_ratio_median']:.3f}x plain, CPU time {figures['cpu_ratio_median']:.3f}x plain (medians)")
    task = "" if args.task == "demo" else f"{args.task}-"
    out = ROOT / "benchmarks" / "results" / "eval_overhead" / f"{task}cache-turns-{args.layout}-{args.heap}-heap{'-profile' if args.profile else ''}.json"
    out.write_text(json.dumps({"command": command, "machine": machine, "task": args.task, "steps": args.steps, "turn": args.turn,
                               "layout": args.layout, "heap": args.heap,
                               "rounds": rounds, "summary": summary}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
