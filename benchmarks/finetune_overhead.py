"""Where do a fine-tuned Transformer's steps go before anything freezes?

Where a fine-tuned Transformer's steps go before anything freezes: plain training against
Egeria reading but never freezing, phase by phase (issue 28 item 3).

Issue 28 measured a 6-layer BERT-style encoder (22M parameters) fine-tuned with Egeria 4%
slower per step before any freeze (562 against 539 ms) while Egeria's own work on the
training thread was 0.7%; the two arms ran one after the other in one process. This study
asks where such a difference comes from. Each arm runs in its own process and they take
turns every 10 steps (egeria.bench.turns), so the machine's drift falls on all of them alike; every
arm trains the same model from the same seed on the same batches:

- ``plain``: plain PyTorch;
- ``hooks``: Egeria attached but never reading (bootstrapping never ends): its forward hooks,
  its step boundary and the loss bookkeeping only;
- ``egeria``: Egeria's defaults (inline controller on the CPU, bf16 reference, a reading of
  every module every 20 steps on 32 samples, 1% cost budget), with ``horizon`` so small and
  ``floor_ratio`` off that nothing freezes;

each with glibc's heap thresholds left as they are (``default``, as a user's script runs) and,
with ``--heaps both``, also fixed (``steady``, egeria.bench.allocator), since a run that allocates and
frees large buffers now and then (a reading copies the model's weights) moves glibc's dynamic
mmap threshold. The model: ``BertForSequenceClassification`` from a ``BertConfig`` of the
measured encoder's size (6 layers, width 384, 12 heads, feed-forward 1536, 30,522 words),
randomly initialised (a step costs the same whatever the weights), batch 32 of 32 tokens,
AdamW 4e-5 with a linear decay to 0 (a ``LambdaLR``).

Per arm and phase (forward with the loss, backward, optimizer and scheduler step,
``eg.step``) it reports the median over the steps after the first 20, the whole step's median
and mean against ``plain``'s of the same heap setting, Egeria's own time as its cost budget
measured it, and the process's peak resident memory.

    .venv/bin/python benchmarks/finetune_overhead.py [--steps 200] [--heaps default|both]

Writes ``benchmarks/results/finetune_overhead/<cpu>.json``; prints the command, the machine and
the table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 20
PHASES = ("forward", "backward", "optimizer", "egeria")


def _start(heap: str) -> None:
    import torch

    from egeria.bench.allocator import steady_heap

    torch.set_num_threads(2)
    if heap == "steady":
        steady_heap()


def _model(seed: int):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, num_labels=2)
    return BertForSequenceClassification(config)


def _arm(kind: str, heap: str, steps: int, seed: int) -> dict:
    import torch

    import egeria
    from egeria.bench.allocator import heap_state
    from egeria.bench.turns import current

    model = _model(seed).train()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        {"input_ids": torch.randint(1000, 30522, (32, 32), generator=g),
         "attention_mask": torch.ones(32, 32, dtype=torch.long),
         "labels": torch.randint(0, 2, (32,), generator=g)}
        for _ in range(16)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=4e-5, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / steps))
    eg = None
    if kind == "hooks":
        config = egeria.EgeriaConfig(eval_interval=10**6)
        eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=steps)
    elif kind == "egeria":
        config = egeria.EgeriaConfig(horizon=1e-12, floor_ratio=0)
        eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=steps)
    times = {phase: [] for phase in PHASES}
    turns = current()
    assert turns is not None
    turns.join()
    for i in range(steps):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = model(**batch).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if eg is not None:
            eg.step(loss.detach())
        t4 = time.perf_counter()
        for phase, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            times[phase].append(b - a)
        turns.step()
    turns.leave()
    stats = {}
    if eg is not None:
        assert not eg.frozen, "nothing may freeze in this study"
        stats = eg.controller_stats
        stats = {"overhead": stats.get("overhead"), "sent": stats.get("sent"), "answered": stats.get("answered"),
                 "eval_interval": eg.eval_interval}
        eg.close()
    return {"arm": kind, "heap": heap_state(), "times": times, "egeria": stats,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _summary(run: dict) -> dict:
    times = {phase: values[WARMUP:] for phase, values in run["times"].items()}
    steps = [sum(parts) for parts in zip(*times.values())]
    return {
        "arm": run["arm"], "heap": run["heap"],
        "median_ms": {phase: 1000 * statistics.median(values) for phase, values in times.items()},
        "step_median_ms": 1000 * statistics.median(steps), "step_mean_ms": 1000 * statistics.fmean(steps),
        "egeria": run["egeria"], "max_rss_mib": run["max_rss_mib"],
    }


def main() -> None:
    from egeria.bench.machine import describe_machine
    from egeria.bench.turns import run_in_turns

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heaps", choices=["default", "both"], default="both")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "benchmarks/finetune_overhead.py", *sys.argv[1:]])
    machine = describe_machine()
    print(command)
    print(machine)
    heaps = ["default"] if args.heaps == "default" else ["default", "steady"]
    calls = [(kind, heap, args.steps, args.seed) for heap in heaps for kind in ("plain", "hooks", "egeria")]
    runs = []
    for heap in heaps:  # a process's heap setting is fixed at its start: one turn-taking group per setting
        group = [c for c in calls if c[1] == heap]
        runs += run_in_turns(_arm, group, 10, initializer=_start, initargs=(heap,))
    rows = [_summary(run) for run in runs]
    print(f"{'arm':8} {'heap':8} " + " ".join(f"{p:>10}" for p in PHASES)
          + f" {'step med':>9} {'step mean':>9} {'vs plain':>8} {'own share':>9} {'peak RSS':>9}")
    for row in rows:
        plain = next(r for r in rows if r["arm"] == "plain" and r["heap"] == row["heap"])
        row["vs_plain_median"] = row["step_median_ms"] / plain["step_median_ms"]
        row["vs_plain_mean"] = row["step_mean_ms"] / plain["step_mean_ms"]
        own = (row["egeria"].get("overhead") or {}).get("share")
        print(f"{row['arm']:8} {row['heap']:8} " + " ".join(f"{row['median_ms'][p]:>10.1f}" for p in PHASES)
              + f" {row['step_median_ms']:>9.1f} {row['step_mean_ms']:>9.1f} {row['vs_plain_mean']:>8.3f}"
              + f" {'' if own is None else f'{100 * own:.2f}%':>9} {row['max_rss_mib']:>8.0f}M")
    cpu = machine.get("cpu", "cpu") if isinstance(machine, dict) else "cpu"
    out = ROOT / "benchmarks/results/finetune_overhead" / f"{str(cpu).lower().replace(' ', '-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "machine": machine, "warmup_steps": WARMUP, "rows": rows,
                               "runs": runs}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
