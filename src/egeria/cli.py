"""The ``egeria`` command line: ``egeria demo``, ``egeria bench``, ``egeria report``.

Each subcommand is one ``_add_<name>`` function that declares its arguments and sets
``func`` to the function that runs it; :func:`main` parses and dispatches.
"""

from __future__ import annotations

import argparse
import ast
import logging
import shlex
import sys
from typing import Any, Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="egeria", description="Knowledge-guided layer freezing (EuroSys'23 Egeria) for PyTorch."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log Egeria's decisions (INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_report(sub)
    return parser


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train ResNet-20 on Fashion-MNIST with and without Egeria, side by side",
        description="Trains ResNet-20 on a Fashion-MNIST subset three times from the same initial weights and "
        "batch order, plain PyTorch, Egeria's defaults and Egeria speed='fast', in three processes taking turns "
        "every 10 steps, and prints a side-by-side table; writes demo.png and demo.json. Each run trains 800 "
        "steps, evaluated on 2,000 test images between epochs and on all 10,000 at the end (7 to 9 minutes in all on "
        "2-core Intel Xeon and AMD EPYC VMs: benchmarks/RESULTS.md; --device cuda trains on a GPU).",
    )
    p.add_argument("--out", default="egeria-demo", metavar="DIR", help="output directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batch order (default: 0)")
    p.add_argument("--quick", action="store_true", help="a tiny run of about 30 s, for smoke tests")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--data-root", default=None, metavar="DIR", help="directory of the Fashion-MNIST IDX files")
    p.add_argument("--device", default="cpu", help="where the three runs train: cpu (default) or cuda")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace, command: str) -> int:
    from .bench import missing_extra

    if (message := missing_extra("demo")) is not None:
        print(message, file=sys.stderr)
        return 2
    from dataclasses import replace

    from .bench.demo import FULL, QUICK, run_demo

    settings = replace(QUICK if args.quick else FULL, device=args.device)
    run_demo(
        out_dir=args.out,
        seed=args.seed,
        train_limit=settings.train_limit,
        epochs=settings.epochs,
        progress=not args.no_progress,
        settings=settings,
        data_root=args.data_root,
        command=command,
    )
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench import HEAPS, POLICY_NAMES, TASKS
    from .bench.layouts import LAYOUTS

    p = sub.add_parser(
        "bench",
        help="train one benchmark task under one freezing policy and record it as JSON",
        description="Trains TASK under POLICY in LAYOUT and writes OUT/LAYOUT/TASK/POLICY-seedS.json (records of "
        "wall time, validation metric, frozen modules, FLOPs per step, plasticity) and the trained weights (.pt).",
    )
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--policy", default="egeria", choices=POLICY_NAMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None, help="override the task's default number of epochs")
    p.add_argument("--out", default="benchmarks/results/runs", metavar="DIR")
    p.add_argument(
        "--layout", default="cpu", choices=LAYOUTS,
        help="cpu: train on every core this process may use, with as many torch threads, Egeria's controller "
        "where its config puts it; accel: train on the first of those cores with one thread (standing for an "
        "accelerator), Egeria's controller in its own process on the others (default: %(default)s)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N training samples only (quick runs)")
    p.add_argument("--eval-limit", type=int, default=None, help="first N validation samples only")
    p.add_argument("--records-per-epoch", type=int, default=1)
    p.add_argument("--init", default=None, metavar="PATH", help="checkpoint to start from (finetune-mnist)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--cache", action="store_true",
        help="train from Egeria.cache_loader: frozen modules' outputs cached, their forward skipped where faster "
        "(writes POLICY-cache-seedS.json)",
    )
    p.add_argument(
        "--snapshots", action="store_true",
        help="also save the model's weights at every record, outside the timed training "
        "(POLICY-seedS-snapshots/stepN.pt; for benchmarks/studies/oracle.py)",
    )
    p.add_argument(
        "--heap", choices=HEAPS, default="steady",
        help="steady: fix glibc's heap thresholds before training, so no run pays page faults on every step "
        "by chance (egeria.bench.allocator); default: leave the heap as the process started (default: %(default)s)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
        help="override one EgeriaConfig field, e.g. --set eval_interval=20 (repeatable; "
        "VALUE is read as a Python literal, else as a string)",
    )
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace, command: str) -> int:
    from .bench import missing_extra, run_bench

    if (message := missing_extra("bench")) is not None:
        print(message, file=sys.stderr)
        return 2

    result = run_bench(
        args.task,
        args.policy,
        seed=args.seed,
        epochs=args.epochs,
        out_dir=args.out,
        layout=args.layout,
        limit=args.limit,
        eval_limit=args.eval_limit,
        records_per_epoch=args.records_per_epoch,
        init=args.init,
        overrides=parse_overrides(args.overrides),
        command=command,
        progress=not args.no_progress,
        cache=args.cache,
        snapshots=args.snapshots,
        heap=args.heap,
    )
    final = result["final"]
    print(
        f"{args.task} / {args.policy} / seed {args.seed} / {args.layout}: {result['metric']['name']} "
        f"{final['metric']:.4f}, "
        f"{final['wall_time_s']:.1f} s of training, {final['total_flops']:.3g} FLOPs"
    )
    return 0


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["eval_interval=20", "reference_precision=bf16"]`` -> ``{"eval_interval": 20, ...}``."""
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        overrides[name.strip()] = value
    return overrides


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="turn benchmark runs into tables and plots",
        description="Reads run JSON files (or directories of them) and writes report.md, report.json and plots, "
        "each task's layouts side by side. A run's layout is the one it recorded; for a run that records none "
        "(made before layouts): the LAYOUT of a LAYOUT=PATH argument, else the nearest folder on its path named "
        "cpu, accel, runs-cpu or runs-accel, else accel (those runs trained on one core with one thread).",
    )
    p.add_argument("paths", nargs="+", metavar="[LAYOUT=]PATH")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR")
    p.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace, command: str) -> int:
    from .bench.report import build_report, load_runs

    build_report(load_runs(args.paths), args.out)
    print(f"wrote {args.out}/report.md")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``egeria`` console script.

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(args_list)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return args.func(args, shlex.join(["egeria", *args_list]))


if __name__ == "__main__":
    sys.exit(main())
