"""A side-by-side demo: ResNet-20 on a Fashion-MNIST subset, plain PyTorch vs. Egeria at its
default and at its fastest setting (``EgeriaConfig(speed="fast")``).

All runs start from the same initial weights and see the same batches in the same order;
the only difference is that the Egeria ones call :meth:`egeria.Egeria.step` after each
optimizer step. The runs train at once, each in a fresh process of its own with the
caller's torch thread count, taking turns every ``turn_steps`` steps
(:mod:`egeria.bench.turns`): none inherits another's allocator and cache state (on a 2-core
VM the first run of a process was up to 15% faster than a second one of the same work),
and a drift of the machine's speed falls on all alike. Every process fixes glibc's heap
thresholds first (:mod:`egeria.bench.allocator`; ``steady_heap``), so that none pays page
faults on every step by the chance of its first allocations. The runs are bit-identical
until each Egeria run's first freeze, which the demo checks and reports. It prints the
machine and a table (training wall time, final test accuracy, time-to-target speedup, when
each layer module froze and unfroze), and writes ``demo.png`` (frozen share of parameters
over steps; accuracy vs. wall time) and ``demo.json`` (every recorded number) into
``out_dir``.

Training time is measured around the training steps only (forward, backward, optimizer,
scheduler and, in the Egeria run, ``eg.step``); the test evaluations are excluded. Between
epochs each run is evaluated on a fixed subset of the test split (its first ``eval_limit``
images, 2,000 by default), at the end on all of ``test_limit`` (10,000): the final accuracy
reads to about 0.3 points, the curve between costs a fifth of it. Time to target is read on
that curve, against the MLPerf-style target of :mod:`egeria.bench.targets` taken from this
seed's plain run: where plain has made 99% of its gain over the run
(``docs/decisions/023-mlperf-target.md``), not plain's last accuracy, which a run a few test
images under misses.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import torch
from torch import nn

from ..checks import check_int
from ..config import EgeriaConfig
from ..engine import Egeria
from ..knowledge.quantization import bf16_kind
from ..optimizer_state import state_bytes, tensor_bytes
from .allocator import can_fix_heap, heap_state, steady_heap
from .harness import StepResult, classification_loss, train
from .machine import describe_machine, training_device
from .targets import mlperf_target
from .turns import current as current_turns
from .turns import run_in_turns

__all__ = [
    "ARMS", "DemoSettings", "FULL", "QUICK", "run_demo", "format_report", "Prepared", "prepare", "identical_through",
    "demo_target",
]

logger = logging.getLogger(__name__)

#: The demo's runs: plain PyTorch, Egeria's defaults, and its fastest speed (speed="fast":
#: a settled module may freeze once the learning rate is 1/10 of its peak, not 1/100).
ARMS: dict[str, dict] = {"plain": {}, "egeria": {}, "fast": {"speed": "fast"}}
#: How the table and the plot name them.
TITLES = {"plain": "plain PyTorch", "egeria": "Egeria (default)", "fast": "Egeria speed='fast'"}


@dataclass(frozen=True)
class DemoSettings:
    """Sizes and hyperparameters of one demo run."""

    # Training images (the first ``train_limit`` of Fashion-MNIST's training split).
    train_limit: int = 12_800
    # Test images of the final accuracy (the first ones of the test split; all 10,000 by
    # default, so that "the same accuracy" is read to about 0.3 points).
    test_limit: int = 10_000
    # Test images of the accuracy between epochs and of the time to target: the first
    # ``eval_limit`` of them (a fifth of the final evaluation's cost).
    eval_limit: int = 2_000
    # Passes over the training subset: 8, so that with the learning rate dropping at 50%
    # and 75% the modules Egeria freezes after the first drop train frozen for a third of
    # the run.
    epochs: int = 8
    batch_size: int = 128
    # SGD with momentum 0.9 and weight decay 5e-4, learning rate ``lr`` ...
    lr: float = 0.1
    # ... dropped 10x after each of these shares of the training steps (as the benchmark
    # task resnet-fmnist and most step schedules: at 50% and 75%).
    lr_drops: tuple[float, ...] = (0.5, 0.75)
    # The two runs train at once in turns of this many steps, each in its own process, so
    # the machine's drift (10% and more over minutes on a shared VM) falls on both alike.
    turn_steps: int = 10
    # Both runs' processes fix glibc's heap thresholds before training (egeria.bench.allocator):
    # otherwise which of them pays thousands of page faults per step is a matter of chance.
    steady_heap: bool = True
    # Where the model trains ("cpu", or an accelerator such as "cuda"): the data stays on the
    # host and each batch is moved there, as a user's loop does.
    device: str = "cpu"


#: The full demo: 800 steps a run (its time by VM: ``benchmarks/RESULTS.md``, "The demo").
FULL = DemoSettings()
#: A smoke-test run of a few seconds of training.
QUICK = DemoSettings(train_limit=1_024, test_limit=500, eval_limit=200, epochs=2)


def run_demo(
    out_dir: str | Path = "egeria-demo",
    seed: int = 0,
    train_limit: int = FULL.train_limit,
    epochs: int = FULL.epochs,
    progress: bool = True,
    *,
    settings: DemoSettings | None = None,
    data_root: str | Path | None = None,
    command: str | None = None,
    stream: TextIO | None | str = "stdout",
) -> dict:
    """Trains ResNet-20 three times (plain, Egeria's defaults, Egeria speed="fast"; in turns)
    and reports them side by side.

    Args:
        out_dir: where ``demo.png`` and ``demo.json`` are written (created if missing).
        seed: seeds the initial weights and the batch order of both runs.
        train_limit: training images used; overrides ``settings.train_limit``.
        epochs: passes over them; overrides ``settings.epochs``.
        progress: show a tqdm progress bar per run (on stderr).
        settings: the other sizes and hyperparameters; :data:`FULL` when None.
        data_root: directory of the Fashion-MNIST IDX files; the loader's default when None.
        command: the command line printed at the top; a Python call when None.
        stream: where the machine line and the table are printed: "stdout" (the default) is
            ``sys.stdout`` as it is at the call; None prints nothing.

    Returns:
        The JSON-safe dict also written to ``demo.json``: settings, machine, each Egeria
        run's config, every run's per-epoch accuracy and training time, per-step losses and
        times, Egeria's events and plasticity history, and the summary numbers (the
        default run's at the top of ``summary``, the fast run's under ``summary["fast"]``).
    """
    stream = sys.stdout if stream == "stdout" else stream
    base = settings if settings is not None else FULL
    s = DemoSettings(**{**asdict(base), "train_limit": train_limit, "epochs": epochs})
    _check_settings(s)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if command is None:
        command = f"python -c 'import egeria.bench.demo as d; d.run_demo(out_dir={str(out)!r}, seed={seed})'"
    machine = describe_machine(s.device)
    _echo(stream, f"command: {command}")
    _echo(stream, "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))

    train_data, test, initial, milestones, steps_per_epoch, total_steps = prepare(s, seed, data_root)
    configs = {name: None if name == "plain" else EgeriaConfig(**fields) for name, fields in ARMS.items()}
    config = configs["egeria"]  # Egeria's defaults, nothing hand-picked
    _echo(
        stream,
        f"ResNet-20 on {len(train_data[1])} Fashion-MNIST training images ({steps_per_epoch} steps/epoch x "
        f"{s.epochs} epochs = {total_steps} steps, batch {s.batch_size}), accuracy on {min(s.eval_limit, len(test[1]))} "
        f"test images between epochs and on {len(test[1])} at the end; "
        f"SGD lr {s.lr:g} momentum 0.9 wd 5e-4, lr /10 at steps {', '.join(map(str, milestones))}; "
        f"Egeria with its default configuration (rule {config.rule!r}, window {config.window}, executor "
        f"{config.executor!r}, cost budget {config.cost_budget:.0%}"
        f", {_reference_words()}) "
        "and with speed='fast' (a settled module may freeze at 1/10 of the peak learning rate, not 1/100), "
        "both through the activation cache",
    )

    names = tuple(ARMS)
    calls = [
        (name, initial, train_data, test, s, seed, milestones, configs[name], total_steps, progress)
        for name in names
    ]
    heap = ", glibc's heap thresholds fixed in each (egeria.bench.allocator)" if s.steady_heap and can_fix_heap() else ""
    _echo(stream, f"the {len(names)} runs take turns every {s.turn_steps} steps, each in its own process{heap}")
    answers = run_in_turns(_train, calls, s.turn_steps, initializer=_start_child, initargs=_child_settings(s))
    runs: dict[str, dict] = {name: record for name, (record, _) in zip(names, answers)}
    extras: dict[str, Any] = {name: extra for name, (_, extra) in zip(names, answers)}

    for name in names[1:]:
        runs[name].update(extras[name])
        runs[name]["frozen_share"] = _frozen_share_timeline(
            extras[name]["events"], extras[name]["module_params"], extras[name]["modules"], total_steps
        )
    summary = {**_summary(runs, "egeria", steps_per_epoch), "fast": _summary(runs, "fast", steps_per_epoch)}
    result = {
        "command": command,
        "machine": machine,
        "seed": seed,
        "settings": asdict(s),
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "lr_drop_steps": milestones,
        "egeria_config": config.to_dict(),
        "fast_config": configs["fast"].to_dict(),
        "runs": runs,
        "summary": summary,
        "files": {"png": str(out / "demo.png"), "json": str(out / "demo.json")},
    }
    _plot(result, out / "demo.png")
    (out / "demo.json").write_text(json.dumps(result, indent=1, allow_nan=False))
    _echo(stream, format_report(result))
    return result


class Prepared(NamedTuple):
    """What both arms of a demo share."""

    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    initial: dict[str, torch.Tensor]  # the seed's initial ResNet-20 weights
    milestones: list[int]  # the steps after which the learning rate drops
    steps_per_epoch: int
    total_steps: int


def prepare(s: DemoSettings, seed: int, data_root: str | Path | None = None) -> Prepared:
    """The data, initial weights and step counts both arms of a demo share."""
    from ..data import load_fashion_mnist
    from ..models import resnet

    data_kw = {} if data_root is None else {"root": data_root}
    train_data = load_fashion_mnist(split="train", limit=s.train_limit, **data_kw).tensors
    test = load_fashion_mnist(split="test", limit=s.test_limit, **data_kw).tensors
    steps_per_epoch = math.ceil(len(train_data[1]) / s.batch_size)
    total_steps = steps_per_epoch * s.epochs
    milestones = sorted({max(1, int(share * total_steps)) for share in s.lr_drops})
    torch.manual_seed(seed)
    initial = resnet(depth=20, in_channels=1, num_classes=10).state_dict()
    return Prepared(train_data, test, initial, milestones, steps_per_epoch, total_steps)


def identical_through(a: list[float], b: list[float]) -> int:
    """How many leading steps two runs' per-step losses are bit-identical for."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _reference_words() -> str:
    """How the default reference computes on this machine (the demo's model is on the CPU)."""
    if bf16_kind(torch.device("cpu")) == "bf16":
        return "a bf16 reference"
    return "a bf16 reference computed in fp32 on bf16-rounded values, this CPU having no native bf16"


def _child_settings(s: DemoSettings) -> tuple[int, int | None, bool]:
    """(torch threads, log level, steady heap) a child process takes from this one."""
    root = logging.getLogger()
    return torch.get_num_threads(), root.level if root.handlers else None, s.steady_heap


def _start_child(threads: int, log_level: int | None, steady: bool) -> None:
    torch.set_num_threads(threads)
    if steady:
        steady_heap()
    if log_level is not None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")


def _setup(
    initial: dict[str, torch.Tensor], s: DemoSettings, milestones: list[int]
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.MultiStepLR]:
    """A demo run's ResNet-20 (from ``initial``), its SGD and its step schedule."""
    from ..models import resnet

    model = resnet(depth=20, in_channels=1, num_classes=10)
    model.load_state_dict(initial)
    model.to(s.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    return model, optimizer, scheduler


class _Alone:
    """The turns of an arm that trains alone: none to take."""

    def join(self) -> None:
        return None

    def step(self) -> None:
        return None

    def leave(self) -> None:
        return None


def _train(
    name: str,
    initial: dict[str, torch.Tensor],
    train_data: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    s: DemoSettings,
    seed: int,
    milestones: list[int],
    config: EgeriaConfig | None,
    total_steps: int,
    progress: bool,
    unfreeze_rule: Any = None,
    average: Any = None,
) -> tuple[dict, dict]:
    """One run; the Egeria one when ``config`` is given, trained through Egeria's activation
    cache (batches unchanged: a frozen prefix's outputs are served where that is faster),
    with ``unfreeze_rule`` and ``average`` where given (``Egeria(unfreeze_rule=..., average=...)``).
    Returns (run record, Egeria extras)."""
    from tqdm.auto import tqdm

    model, optimizer, scheduler = _setup(initial, s, milestones)
    # The same batches in the same order in both runs: the sampler's generator has the seed.
    loader: Any = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*train_data), batch_size=s.batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    eg = None
    if config is not None:
        eg = Egeria(model, optimizer, config=config, lr_scheduler=scheduler, total_steps=total_steps,
                    unfreeze_rule=unfreeze_rule, average=average)
        loader = eg.cache_loader(loader)
    epochs: list[dict] = []
    bar = tqdm(
        total=total_steps, desc=f"{name:>6}", unit="step", disable=not progress, leave=True,
        position=list(ARMS).index(name) if name in ARMS else 0,  # one line per run: they run at once, in turns
    )

    device = torch.device(s.device)
    test = (test[0].to(device), test[1].to(device))

    def epoch_batches() -> Any:
        if device.type == "cpu":
            return loader
        return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)

    def show(result: StepResult) -> None:
        turns.step()
        bar.update(1)
        if eg is not None:
            bar.set_postfix(loss=f"{result.loss:.3f}", frozen=len(eg.frozen), stage=eg.stage, refresh=False)
        else:
            bar.set_postfix(loss=f"{result.loss:.3f}", refresh=False)

    def evaluate(result: StepResult) -> None:
        last = result.step == total_steps
        correct = _correct(model, test if last else (test[0][: s.eval_limit], test[1][: s.eval_limit]))
        record = {"epoch": result.epoch, "step": result.step, "train_time_s": result.train_time_s,
                  "test_accuracy": float(correct[: s.eval_limit].float().mean())}  # on the first eval_limit images
        if last:
            record["full_test_accuracy"] = float(correct.float().mean())  # on all test_limit images
        epochs.append(record)
        logger.info(
            "%s epoch %d: %.4f test accuracy (%d images) after %.1f s of training", name, result.epoch,
            record["test_accuracy"], min(s.eval_limit, len(test[1])), result.train_time_s,
        )

    turns = current_turns() or _Alone()  # one arm alone (benchmarks/studies/demo_arm.py) takes no turns
    try:
        turns.join()
        steps = train(
            model, optimizer, epoch_batches, classification_loss, epochs=s.epochs, scheduler=scheduler, egeria=eg,
            on_step=show, evaluate=evaluate,
        )
    finally:
        turns.leave()
        bar.close()
    train_time = steps[-1].train_time_s
    losses = [r.loss for r in steps]
    step_times = [r.time_s for r in steps]
    record = {
        "heap": heap_state(),
        "memory": _training_memory(model, optimizer),
        "epochs": epochs,
        "train_time_s": train_time,
        "final_accuracy": epochs[-1]["full_test_accuracy"],
        "losses": losses,
        "step_times_s": step_times,
    }
    extra: dict[str, Any] = {}
    if eg is not None:
        extra = {
            "modules": list(eg.modules),
            "module_params": [m.num_params for m in eg.partition.modules],
            "eval_interval": eg.eval_interval,
            "events": [d.to_dict() for d in eg.events],
            "history": eg.history,
            "frozen_at_end": list(eg.frozen),
        }
        eg.close()
    return record, extra


@torch.no_grad()
def _correct(model: nn.Module, test: tuple[torch.Tensor, torch.Tensor], batch: int = 64) -> torch.Tensor:
    """Whether each image of ``test`` is classified right (the model is in eval mode), in
    order. Batches of 64 keep a layer's activations within the CPU's caches: 10,000 images
    took 3.8 s on the AMD EPYC VM against 7.0 s in batches of 500, with the same predictions
    (``docs/decisions/037-reading-cost-sets-n.md``)."""
    x_all, y_all = test
    return torch.cat([model(x_all[start : start + batch]).argmax(dim=1).cpu() == y_all[start : start + batch].cpu()
                      for start in range(0, len(y_all), batch)])


def _accuracy(model: nn.Module, test: tuple[torch.Tensor, torch.Tensor], batch: int = 64) -> float:
    """Share of ``test`` classified right (the model is in eval mode)."""
    return float(_correct(model, test, batch).float().mean())


def _frozen_share_timeline(events: list[dict], params: list[int], names: list[str], total_steps: int) -> list[dict]:
    """Step function of the frozen share of parameters: ``[{"step", "share"}, ...]``, from step 0.

    A freeze event at step s takes effect for steps after s; an unfreeze resets the share to 0.
    """
    total = sum(params)
    size = dict(zip(names, params))
    frozen = 0
    points = [{"step": 0, "share": 0.0}]
    for event in events:
        if event["action"] == "freeze":
            frozen += sum(size[m] for m in event["modules"])
        elif event["action"] == "unfreeze":
            frozen = 0
        else:
            continue
        points.append({"step": int(event["step"]), "share": frozen / total})
    points.append({"step": total_steps, "share": frozen / total})
    return points


def _time_to_target(epochs: list[dict], target: float) -> float | None:
    for record in epochs:
        if record["test_accuracy"] >= target:
            return record["train_time_s"]
    return None


def demo_target(plain_epochs: list[dict]) -> float:
    """The MLPerf-style target (:func:`egeria.bench.targets.mlperf_target`) of the plain run's
    accuracy between epochs: where its best-so-far curve has made 99% of its gain."""
    records = [{"step": e["step"], "metric": e["test_accuracy"]} for e in plain_epochs]
    target = mlperf_target([{"seed": None, "records": records}], higher_is_better=True)
    return plain_epochs[-1]["test_accuracy"] if target is None else target["target"]


def _summary(runs: dict[str, dict], name: str, steps_per_epoch: int) -> dict:
    """Run ``name`` against the plain run."""
    plain, eg = runs["plain"], runs[name]
    target = demo_target(plain["epochs"])
    plain_ttt = _time_to_target(plain["epochs"], target)
    eg_ttt = _time_to_target(eg["epochs"], target)
    first_freeze = next((e["step"] for e in eg["events"] if e["action"] == "freeze"), None)
    same_until = identical_through(plain["losses"], eg["losses"])
    return {
        "target_accuracy": target,
        "time_to_target_s": {"plain": plain_ttt, "egeria": eg_ttt},
        "time_to_target_speedup": None if plain_ttt is None or eg_ttt is None else plain_ttt / eg_ttt,
        "wall_time_speedup": plain["train_time_s"] / eg["train_time_s"],
        "first_freeze_step": first_freeze,
        # Losses are recorded after each step; index i is step i + 1.
        "identical_losses_through_step": same_until,
        "steps_per_epoch": steps_per_epoch,
    }


def format_report(result: dict) -> str:
    """The side-by-side table and each Egeria run's freeze/unfreeze timeline of a
    :func:`run_demo` result."""
    runs = result["runs"]
    names = [name for name in ARMS if name in runs]
    summaries = {"egeria": result["summary"], **({"fast": result["summary"]["fast"]} if "fast" in result["summary"] else {})}
    target = result["summary"]["target_accuracy"]
    settings = result["settings"]
    subset = min(settings.get("eval_limit", settings["test_limit"]), settings["test_limit"])

    def fmt_time(value: float | None) -> str:
        return "not reached" if value is None else f"{value:.1f} s"

    def ttt(name: str) -> str:
        return fmt_time(summaries[name]["time_to_target_s"]["egeria"] if name != "plain"
                        else result["summary"]["time_to_target_s"]["plain"])

    rows = [
        ("", *(TITLES[n] for n in names)),
        ("training wall time", *(f"{runs[n]['train_time_s']:.1f} s" for n in names)),
        (f"final test accuracy ({settings['test_limit']:,} images)", *(f"{runs[n]['final_accuracy']:.2%}" for n in names)),
        (f"time to {target:.2%} (99% of plain's gain)", *(ttt(n) for n in names)),
        ("wall-time speedup", "", *(f"{summaries[n]['wall_time_speedup']:.2f}x" for n in names[1:])),
        ("time-to-target speedup", "", *("none" if summaries[n]["time_to_target_speedup"] is None
                                         else f"{summaries[n]['time_to_target_speedup']:.2f}x" for n in names[1:])),
        ("mean step time", *(_mean_ms(runs[n]["step_times_s"]) for n in names)),
    ]
    if all("memory" in runs[n] for n in names):  # runs recorded before memory was measured lack it
        rows.append(("gradients + optimizer state at the end",
                     *(f"{(runs[n]['memory']['gradients'] + runs[n]['memory']['optimizer_state']) / 2**20:.2f} MiB"
                       for n in names)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(names) + 1)]
    lines = [""]
    for i, row in enumerate(rows):
        lines.append("  ".join(f"{cell:<{widths[0]}}" if j == 0 else f"{cell:>{widths[j]}}" for j, cell in enumerate(row)))
        if i == 0:
            lines.append("-" * (sum(widths) + 2 * len(names)))
    lines.append("-" * (sum(widths) + 2 * len(names)))
    for name in names[1:]:
        if summaries[name]["time_to_target_speedup"] is None:
            best = max(r["test_accuracy"] for r in runs[name]["epochs"])
            lines.append(f"{TITLES[name]} never reached {target:.2%} at an epoch end (its best was {best:.2%})")
    lines.append(f"target: where plain's accuracy on the first {subset:,} test images made 99% of its gain over "
                 "the run (the MLPerf-style target, docs/decisions/023-mlperf-target.md)")
    lines.append("")
    lines.append(f"per-epoch test accuracy (training time so far), on the first {subset:,} test images:")
    for epochs in zip(*(runs[n]["epochs"] for n in names)):
        lines.append(f"  epoch {epochs[0]['epoch']:>2}:  " + "   ".join(
            f"{TITLES[n].split(' (')[0]} {e['test_accuracy']:.2%} ({e['train_time_s']:6.1f} s)" for n, e in zip(names, epochs)))
    for name in names[1:]:
        lines.append("")
        lines.extend(_timeline(result, name, summaries[name]))
    lines.append("")
    lines.append(f"wrote {result['files']['png']} and {result['files']['json']}")
    return "\n".join(lines)


def _timeline(result: dict, name: str, summary: dict) -> list[str]:
    """When Egeria run ``name`` froze each module, and how long it matched plain."""
    eg, spe = result["runs"][name], result["steps_per_epoch"]
    sizes = dict(zip(eg["modules"], eg["module_params"]))
    total = sum(eg["module_params"])
    lines = [
        f"{TITLES[name]}: {len(eg['modules'])} layer modules, eval interval n={eg['eval_interval']}, "
        f"lr drops at steps {', '.join(map(str, result['lr_drop_steps']))}"
    ]
    if not any(e["action"] == "freeze" for e in eg["events"]):
        lines.append("  no module froze in this run, so it did plain's work: any time gap is noise")
    for event in eg["events"]:
        step = event["step"]
        where = f"step {step:>5} (epoch {(step - 1) // spe + 1}, {step / spe:.2f} epochs in)"
        if event["action"] == "guided":
            lines.append(f"  {where}: bootstrapping over, plasticity evaluation starts")
        else:
            share = sum(sizes[m] for m in event["modules"]) / total
            lines.append(f"  {where}: {event['action']:<8} {', '.join(event['modules'])} ({share:.1%} of parameters)")
    lines.append(
        f"  frozen at the end: {', '.join(eg['frozen_at_end']) or 'none'}; "
        f"losses identical to plain's through step {summary['identical_losses_through_step']}"
    )
    return lines


def _training_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What training holds at the run's end beyond the weights, in bytes: a gradient for each
    parameter still training, and the state the optimizer holds (a frozen module's is
    released by Egeria, egeria.optimizer_state; on a CPU run it stays in this process's
    memory, so the figure is what an accelerator would hold)."""
    return {
        "gradients": sum(tensor_bytes(p) for p in model.parameters() if p.requires_grad),
        "optimizer_state": sum(state_bytes(v) for v in optimizer.state.values()),
    }


def _mean_ms(times: list[float]) -> str:
    return f"{1000 * sum(times) / max(1, len(times)):.0f} ms"


def _plot(result: dict, path: Path) -> None:
    """Frozen share of parameters over steps (top); test accuracy vs. training time (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    colours = {"plain": "tab:blue", "egeria": "tab:orange", "fast": "tab:green"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7.5), constrained_layout=True)

    egerias = [name for name in ARMS if name != "plain" and name in runs]
    for name in egerias:
        timeline = runs[name]["frozen_share"]
        top.step([p["step"] for p in timeline], [100 * p["share"] for p in timeline], where="post",
                 color=colours[name], lw=2, label=TITLES[name])
        top.fill_between([p["step"] for p in timeline], [100 * p["share"] for p in timeline], step="post",
                         color=colours[name], alpha=0.15)
    spe = result["steps_per_epoch"]
    for epoch in range(1, result["settings"]["epochs"]):
        top.axvline(epoch * spe, color="0.85", lw=0.8, zorder=0)
    for i, drop in enumerate(result["lr_drop_steps"]):
        top.axvline(drop, color="tab:red", ls="--", lw=1, label="learning rate / 10" if i == 0 else None)
    guided = next((e["step"] for e in runs["egeria"]["events"] if e["action"] == "guided"), None)
    if guided is not None:
        top.axvline(guided, color="0.4", ls=":", lw=1, label="bootstrapping over")
    for name in egerias:
        for event in runs[name]["events"]:
            if event["action"] == "freeze":
                top.annotate(
                    event["modules"][0], (event["step"], 0), xytext=(2, 4), textcoords="offset points",
                    rotation=90, fontsize=7, va="bottom", color=colours[name],
                )
    top.set_xlim(0, result["total_steps"])
    top.set_ylim(0, max(10.0, 100 * max(p["share"] for name in egerias for p in runs[name]["frozen_share"]) * 1.25))
    top.set_xlabel(f"training step ({spe} steps per epoch; grey lines: epoch ends)")
    top.set_ylabel("frozen parameters (%)")
    top.set_title("Share of ResNet-20's parameters frozen")
    top.legend(loc="upper left", fontsize=8)

    for name in (name for name in ARMS if name in runs):
        run, label, color = runs[name], TITLES[name], colours[name]
        xs = [0.0] + [r["train_time_s"] for r in run["epochs"]]
        ys = [None] + [100 * r["test_accuracy"] for r in run["epochs"]]
        bottom.plot(xs[1:], ys[1:], marker="o", color=color, label=f"{label} ({run['train_time_s']:.0f} s)")
    target = result["summary"]["target_accuracy"]
    bottom.axhline(100 * target, color="0.5", ls=":", lw=1, label=f"target {100 * target:.2f}% (99% of plain's gain)")
    bottom.set_xlabel("training wall time (s), evaluation excluded; one point per epoch")
    subset = min(result["settings"].get("eval_limit", result["settings"]["test_limit"]), result["settings"]["test_limit"])
    bottom.set_ylabel(f"test accuracy (%), first {subset:,} images")
    bottom.set_title("Test accuracy vs. training time")
    bottom.legend(loc="lower right", fontsize=8)
    bottom.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check_settings(s: DemoSettings) -> None:
    for name in ("train_limit", "test_limit", "eval_limit", "epochs", "batch_size"):
        check_int(getattr(s, name), f"demo {name}")
    if s.eval_limit > s.test_limit:
        raise ValueError(f"demo eval_limit={s.eval_limit}: at most test_limit={s.test_limit}, the images it is the first of")
    check_int(s.turn_steps, "demo turn_steps")
    if not isinstance(s.steady_heap, bool):
        raise ValueError(f"demo steady_heap={s.steady_heap!r}: must be True or False")
    if not all(isinstance(v, (int, float)) and 0 < v < 1 for v in s.lr_drops):
        raise ValueError(f"demo lr_drops={s.lr_drops!r}: each must be a share of the steps in (0, 1)")
    training_device(s.device, f"demo device={s.device!r}")


def _echo(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)

