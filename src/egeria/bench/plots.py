"""The report's figures, one PNG each per task, its layouts side by side (one panel each).

- metric against training wall time, the target dotted and the MLPerf-style target dashed
  (paper Figure 8);
- the share of parameters still trainable over steps (Figure 11);
- the share of the backward pass's FLOPs still computed over steps, against the first
  step with nothing frozen: a CNN's front holds few of its parameters but many of its
  FLOPs, so this share falls further than the parameters' one when the front freezes;
- plasticity per module over steps, one panel per Egeria run (Figure 4);
- memory by part over steps (:mod:`egeria.memory`: parameters, gradients, optimizer state
  held and released, saved activations, the cache's store), stacked, one panel per run
  that recorded it.

matplotlib is imported lazily and drawn on Agg canvases, without pyplot state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .runfiles import layout_name, policy_label

__all__ = ["plot_task", "plot_memory", "policy_colour"]

# one colour per policy in every speed-against-accuracy plot (the report's frontier,
# freeze_cost.py's and frontier.py's): plain black, Egeria blue (in frontier.py's, under the
# paper's rule a lighter blue; the report's shows that rule by its label), each baseline its own
_POLICY_COLOURS = {"none": "black", "egeria": "tab:blue", "paper": "tab:cyan", "freezeout": "tab:orange",
                   "autofreeze": "tab:red", "linear": "tab:green", "static": "tab:purple", "smartfrz": "tab:brown"}


def policy_colour(policy: str) -> str:
    """The plots' colour for a policy name (``plain`` is ``none``); grey for one not listed."""
    return _POLICY_COLOURS.get("none" if policy == "plain" else policy, "tab:gray")


def _run_label(run: dict) -> str:
    return f"{policy_label(run)} seed {run['seed']}"


def _new_figure(nrows: int, ncols: int, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5 * ncols, height * nrows))
    FigureCanvasAgg(fig)
    return fig


def _lines(ax: Any, runs: list[dict], x: str, y: Callable[[dict], float | None], **style: Any) -> int:
    """One line per run through its records' (``rec[x]``, ``y(rec)``) points; the number drawn."""
    drawn = 0
    for r in runs:
        pts = [(rec[x], y(rec)) for rec in r["records"] if rec.get(x) is not None and y(rec) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=_run_label(r), **style)
            drawn += 1
    return drawn


def _percent(key: str) -> Callable[[dict], float | None]:
    def value(rec: dict) -> float | None:
        share = rec.get(key)
        return None if share is None else 100.0 * share

    return value


def _save(fig: Any, out: Path, name: str) -> str:
    fig.savefig(out / name, dpi=110, bbox_inches="tight")
    return name


def _by_layout(
    groups: dict[str, list[dict]],
    draw: Callable[[Any, str, list[dict]], int],
    out: Path,
    name: str,
) -> str | None:
    """One panel per layout side by side; the file's name, or None where no panel drew."""
    fig = _new_figure(1, len(groups))
    drawn = 0
    for i, (layout, runs) in enumerate(groups.items()):
        ax = fig.add_subplot(1, len(groups), i + 1)
        drawn += draw(ax, layout, runs)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return _save(fig, out, name) if drawn else None


def plot_task(task: str, groups: dict[str, list[dict]], data: dict, out: Path) -> dict[str, str]:
    """Write ``task``'s PNGs into ``out``; return their names by kind.

    Args:
        groups: the task's runs by layout, in the order to show, each in the order to draw.
        data: the task's report (``metric``, and per layout ``target``).
    """
    files: dict[str, str] = {}
    metric = data["metric"]["name"]

    def metric_vs_time(ax: Any, layout: str, runs: list[dict]) -> int:
        drawn = _lines(ax, runs, "wall_time_s", lambda rec: rec.get("metric"), marker=".")
        target = data["layouts"][layout]["target"]
        if target is not None:
            ax.axhline(target, linestyle=":", color="black", label="target")
        fair = data["layouts"][layout].get("mlperf_target")
        if fair is not None:
            ax.axhline(fair["target"], linestyle="--", color="gray", label="MLPerf-style target")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel(metric)
        ax.set_title(f"{task}, layout {layout}: {metric} vs wall time")
        return drawn

    def share(key: str, ylabel: str, title: str, missing: str) -> Callable[[Any, str, list[dict]], int]:
        """A panel of one record field in percent over the training steps."""

        def draw(ax: Any, layout: str, runs: list[dict]) -> int:
            drawn = _lines(ax, runs, "step", _percent(key), drawstyle="steps-post")
            ax.set_xlabel("training step")
            ax.set_ylabel(ylabel)
            ax.set_ylim(0, 105)
            ax.set_title(f"{task}, layout {layout}: {title}" + ("" if drawn else missing))
            return drawn

        return draw

    trainable = share("trainable_share", "trainable parameters (%)", "trainable parameter share", "")
    backward = share(
        "backward_share", "backward FLOPs computed (% of the first step's)", "backward FLOPs share", " (not recorded)"
    )
    for kind, draw in (("metric_vs_time", metric_vs_time), ("trainable_share", trainable),
                       ("backward_flops_share", backward)):  # fmt: skip
        name = _by_layout(groups, draw, out, f"{task}-{kind.replace('_', '-')}.png")
        if name is not None:
            files[kind] = name

    def frontier(ax: Any, layout: str, runs: list[dict]) -> int:
        """Every run a point: its whole-run speedup (at plain's pace where it has one) and its
        final past the worst plain seed."""
        rows = [row for row in data["layouts"][layout]["rows"]
                if row.get("frontier_speedup") is not None and row.get("vs_worst_plain") is not None]
        rows.sort(key=lambda row: (row["frontier_speedup"], row["vs_worst_plain"]))
        names = []
        for i, row in enumerate(rows, start=1):
            egeria = row["policy_name"] == "egeria"
            point = (row["frontier_speedup"], row["vs_worst_plain"])
            colour = policy_colour(row["policy_name"])
            ax.scatter(*point, marker="*" if egeria else "o", s=80 if egeria else 30, color=colour)
            raw = "" if row["plain"] or row["frontier_at_plains_pace"] else " raw"
            # a number at the point, its name in a list under the panel: close points' names would overlap
            ax.annotate(str(i), point, fontsize=7, color=colour, xytext=(3, 3), textcoords="offset points")
            names.append(f"{i:>2} {row['policy']} s{row['seed']}{raw} "
                         f"({row['frontier_speedup']:.2f}x, {row['vs_worst_plain'] + 0.0:+.3g})")  # + 0.0: no "-0"
        ax.annotate("\n".join(names), (0, 0), xycoords="axes fraction", xytext=(0, -42), textcoords="offset points",
                    va="top", fontsize=7, family="monospace")
        linear_up_to = frontier_linear_range(rows)
        if linear_up_to is not None:
            ax.set_yscale("symlog", linthresh=linear_up_to)
        ax.axhline(0, linestyle=":", color="black")
        ax.set_xlabel("whole-run speedup over the plain seeds' mean time, at plain's pace where known (x)")
        ax.set_ylabel(f"final {metric} past the worst plain seed" + ("" if data["metric"]["higher_is_better"]
                                                                    else " (lower is better: sign turned)"))
        ax.set_title(f"{task}, layout {layout}: speed against {metric}")
        return len(rows)

    name = _by_layout(groups, frontier, out, f"{task}-frontier.png")
    if name is not None:
        files["frontier"] = name

    with_plasticity = [r for runs in groups.values() for r in runs if r.get("plasticity")]
    if with_plasticity:
        files["plasticity"] = _plasticity(task, with_plasticity, out)
    with_memory = [r for runs in groups.values() for r in runs if r.get("memory")]
    if with_memory:
        files["memory"] = plot_memory(task, with_memory, out)
    return files


def frontier_linear_range(rows: list[dict], far: float = 20.0) -> float | None:
    """The frontier's accuracy axis stays linear unless a point lies ``far`` times or more past
    the plain seeds' own spread (a run that lost the task, such as SmartFRZ on (c)): then
    it turns logarithmic beyond that spread (None: linear throughout), so the points near
    plain keep their distances apart instead of collapsing onto one line."""
    plain = [abs(row["vs_worst_plain"]) for row in rows if row["plain"]]
    spread = max(plain, default=0.0) or min((abs(row["vs_worst_plain"]) for row in rows
                                             if row["vs_worst_plain"]), default=0.0)
    largest = max((abs(row["vs_worst_plain"]) for row in rows), default=0.0)
    return spread if spread > 0 and largest >= far * spread else None


def _plasticity(task: str, runs: list[dict], out: Path) -> str:
    """Plasticity per module, log scale, one panel per run."""
    fig = _new_figure(len(runs), 1, height=3.5)
    for i, r in enumerate(runs):
        ax = fig.add_subplot(len(runs), 1, i + 1)
        by_module: dict[str, list[tuple[int, float]]] = {}
        for p in r["plasticity"]:
            value = p.get("plasticity")
            if value is not None and value > 0:  # a log axis cannot show 0
                by_module.setdefault(p["module"], []).append((p["step"], value))
        modules = r.get("modules") or []
        for module in sorted(by_module, key=lambda m: (modules.index(m) if m in modules else len(modules), m)):
            xs, ys = zip(*by_module[module])
            ax.plot(xs, ys, label=module)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("plasticity")
        ax.set_title(f"{task}: plasticity, {_run_label(r)}, layout {layout_name(r)}")
        if by_module:
            ax.legend(fontsize="x-small", ncol=2)
        ax.grid(alpha=0.3, which="both")
    return _save(fig, out, f"{task}-plasticity.png")


def plot_memory(task: str, runs: list[dict], out: Path, name: str | None = None) -> str:
    """Memory by part over the run (MiB, stacked; a part not measured at a row counts 0
    there), one panel per run, on one scale; writes ``<task>-memory.png`` (or ``name``)."""
    from ..memory import PARTS

    fig = _new_figure(len(runs), 1, height=3.2)
    fig.subplots_adjust(hspace=0.5)
    top = max(sum(row.get(p) or 0 for p in PARTS) for r in runs for row in r["memory"]) / 2**20
    for i, r in enumerate(runs):
        ax = fig.add_subplot(len(runs), 1, i + 1)
        rows = r["memory"]
        steps = [row["step"] for row in rows]
        ax.stackplot(steps, *[[(row.get(p) or 0) / 2**20 for row in rows] for p in PARTS],
                     labels=[p.replace("_", " ") for p in PARTS], step="post")
        for event in r.get("events", []):
            if event.get("action") in ("freeze", "unfreeze"):
                ax.axvline(event["step"], color="black", linestyle=":", linewidth=0.8)
        ax.set_ylim(0, top * 1.05 if top > 0 else 1)
        ax.set_xlabel("training step (dotted: a freeze or unfreeze)")
        ax.set_ylabel("MiB")
        ax.set_title(f"{task}: memory by part, {_run_label(r)}, layout {layout_name(r)}")
        ax.legend(fontsize="x-small", loc="upper right", ncol=2)
        ax.grid(alpha=0.3)
    return _save(fig, out, name or f"{task}-memory.png")
