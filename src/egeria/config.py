"""The one configuration object of Egeria, with its defaults and their validation."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence, Union

from .checks import check_int

__all__ = [
    "EgeriaConfig", "RULES", "SPEEDS", "speed_horizon", "PRECISIONS", "ACTIVATION_MODES", "EXECUTORS", "START_METHODS", "UNFREEZE_LR_DROP",
]

#: Freezing rules of Egeria's own policy.
RULES = ("paper", "egeria")
#: What the rule-dependent fields left at None become under each rule: the paper's
#: Algorithm 1 as published, and Egeria's own rule (the evidence for each value is a
#: decision record, named at its field below; the index is docs/decisions/README.md).
RULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "paper": {"window": 10, "horizon": None, "max_frozen_flops": None, "probe_size": None, "floor_ratio": None},
    "egeria": {"window": 3, "horizon": 0.0005, "max_frozen_flops": 0.75, "probe_size": 32, "floor_ratio": 8.0},
}
#: The points on the speed-accuracy frontier a user picks with ``EgeriaConfig.speed``: under
#: Egeria's rule, the learning rate, as a share of the run's peak, at or under which a module
#: that has settled but is not at its floor may freeze (docs/decisions/031-speed-knob.md).
#: "safe": after a step schedule's two tenfold decays, the last few percent of a cosine;
#: "balanced": a third of the way between; "fast": after one tenfold decay.
SPEEDS: dict[str, float] = {"safe": 0.01, "balanced": 0.03, "fast": 0.1}
#: Seconds without a heartbeat after which the controller counts as hung.
CONTROLLER_TIMEOUT = 120.0
#: The learning-rate drop since the frontmost module froze that unfreezes every module,
#: per rule: the paper's 10x step decay, and never under Egeria's own (its modules freeze
#: once the drift still to come is small, after the decays that matter, and unfreezing
#: does not give back what a freeze cost: see docs/decisions/006-never-unfreeze.md).
#: Another rule of the user's goes to
#: ``Egeria(unfreeze_rule=...)`` (egeria.knowledge.unfreezing).
UNFREEZE_LR_DROP = {"paper": 10.0, "egeria": math.inf}
#: T = TOLERANCE_RATIO x the largest slope magnitude among a module's first three
#: readings: the per-module tolerance of the slope test (the paper's).
TOLERANCE_RATIO = 0.2
#: Bootstrapping ends when the relative change of the smoothed training loss between two
#: consecutive intervals of n steps falls below this (the paper's 10%).
BOOTSTRAP_CHANGE_RATE = 0.10
#: D under Egeria's rule: the steps each reading's drift covers (the reference is refreshed
#: this many steps before the reading), and n when ``eval_interval`` is None; the rule's
#: spans are W x D steps (egeria.knowledge.spans). The paper's guideline n is raised to it.
#: The paper evaluates every ~10 to ~100 iterations (section 3.2); on short runs its
#: guideline gives readings too close to tell convergence from SGD noise: see
#: docs/decisions/003-eval-interval.md.
MIN_EVAL_INTERVAL = 20
#: The smallest W the paper's rule halves down to at repeated unfreezes.
MIN_WINDOW = 2
#: Evaluations in flight at most (sent, not yet answered): a reading and the refresh before
#: the next one. A decision applies D steps after its reading, the trainer waiting there for
#: an answer not yet in, so no more are ever in flight; one more would be dropped and counted.
MAX_IN_FLIGHT = 2
#: Fields of earlier 0.x versions, with what took their place.
REMOVED = {
    "tolerance_ratio": "removed: the slope test's ratio is the paper's, egeria.config.TOLERANCE_RATIO",
    "bootstrap_change_rate": "removed: bootstrapping ends at the paper's 10%, egeria.config.BOOTSTRAP_CHANGE_RATE",
    "unfreeze_lr_drop": "removed: each rule has its own (egeria.config.UNFREEZE_LR_DROP); pass "
                        "Egeria(unfreeze_rule=egeria.LRDropRule(factor)) for another",
    "max_frozen": "removed: max_frozen_flops caps the frozen share of the model's weight computation",
    "fixed_probe": "removed: a fixed probe did not make readings quieter (docs/decisions/013-fixed-probe.md)",
    "max_frozen_params": "removed: max_frozen_flops caps the frozen share of the model's weight computation",
    "controller_timeout": "removed: a controller silent for egeria.config.CONTROLLER_TIMEOUT seconds (120) counts as hung",
}
#: Precisions the reference model can run in.
PRECISIONS = ("auto", "int8", "bf16", "fp32")
REFERENCE_DEVICES = ("cpu", "model")
#: Where the training side's activation for a reading comes from.
ACTIVATION_MODES = ("eval", "train")
#: Where the controller (reference model and freezing rule) runs.
EXECUTORS = ("auto", "process", "thread", "inline")
#: multiprocessing start methods for the controller process (None: the platform default).
START_METHODS = (None, "fork", "spawn", "forkserver")


@dataclass(frozen=True)
class EgeriaConfig:
    """Knobs of knowledge-guided layer freezing (paper sections 3 and 4.2).

    The default rule is Egeria's own (``rule="egeria"``); ``rule="paper"`` is the paper's
    Algorithm 1 with the paper's settings. ``window``,
    ``horizon``, ``max_frozen_flops``, ``probe_size`` and ``floor_ratio`` left at None take the rule's own values
    (:data:`RULE_DEFAULTS`; a baseline ``policy`` takes the paper's, which cap nothing); a
    value given is kept under either rule. Values are checked
    when the config is built; a bad one raises ``ValueError`` naming the field and the value.
    """

    eval_interval: int | None = None
    """n: steps between two plasticity readings. It sets how densely the rule's spans are
    sampled, not the spans: they are optimizer steps (egeria.knowledge.spans; each reading
    covers the drift of D = 20 steps, a module must stay settled for W x D), so a faster or
    slower machine freezes the same modules at the same steps within one interval. None:
    under Egeria's rule, MIN_EVAL_INTERVAL, 20, and the cost budget may space readings up to
    (W - 1) x D; under the paper's, derived from ``total_steps`` by its guideline n =
    total_steps / (2 W) / modules / 1.75 (section 4.2.2), raised to 20, and D = n. An
    explicit value is used as given: below D each reading covers n steps; beyond (W - 1) x D
    each covers n / (W - 1) (a span holds two readings)."""
    window: int | None = None
    """W: the rule's span is W x D steps (D = 20 under Egeria's rule): a module must have a
    low plasticity slope at every reading of a span to freeze, and the moving average and
    the slope fit take a span's readings (W readings at one every D steps, as in the
    paper). Halved at each unfreeze under the paper's rule. None: the rule's own, 10
    (paper) or 3 (egeria: its modules freeze only once the drift still to come has fallen
    to ``horizon`` of its largest, so the span confirms a level rather than guards against
    noise at a high learning rate; see docs/decisions/009-window-3.md)."""
    reference_precision: str = "auto"
    """Arithmetic of the reference model: "int8" (quantized, the paper's), "bf16", "fp32",
    or "auto": bf16 (its refresh is a cast, and floor_ratio is measured
    with its error; on a CPU without native bf16 it computes in fp32 on bf16-rounded values;
    see docs/decisions/002-reference-precision.md)."""
    reference_device: str = "cpu"
    """Where the controller's reference and fp32 front live. "cpu" (default): host copies,
    so the controller can run beside the trainer on idle host cores (the paper's design).
    "model": on the model's own device, in the training process (executor "inline";
    "auto" picks it), so a reading crosses no device-host copy and runs at the
    accelerator's speed, taking a little of its time between steps (int8 kernels are
    CPU-only)."""
    modules: Union[str, Sequence[str], None] = None
    """Layer modules: None = automatic (building blocks grouped in execution order);
    a list of module names; or a regular expression matched against module names."""
    max_modules: int = 8
    """Upper bound on the number of automatic layer modules; small neighbouring blocks
    are merged until at most this many remain."""
    max_frozen_flops: float | None = None
    """At most the leading modules holding this share of the model's weight computation
    ever freeze: the multiply-adds of its linear and convolutional weights in the first
    forward pass (egeria.partition.weight_flops), whose shares are those of the backward
    work a freeze saves. None: the rule's own, no cap (paper) or 0.75 (egeria: at least
    a quarter of the model's weight computation keeps training: on ResNet-20 the stem and
    stages 1-2 may freeze and stage 3 trains on; on a 6-layer encoder it allows 4 layers,
    as AutoFreeze froze; see docs/decisions/011-max-frozen-flops.md). A baseline policy is
    capped only by a value given. 1.0: no cap."""
    rule: str = "egeria"
    """The freezing rule. "paper": Algorithm 1 as published: one module watched at a time,
    each starting its history when the one before it froze; after an unfreeze W is
    halved and watching restarts at once. "egeria": every freezable module is read
    from one forward pass, so a module's history is ready when the one before it
    freezes; after an unfreeze the rule waits for the loss to settle again (bootstrapping)
    and keeps W; a jump of the schedule (a step whose learning rate differs 2x from the
    step before it and holds; without a known schedule, a 2x change since the previous
    reading) restarts each module's moving average and stale count (a new regime; its
    tolerance stays), and the reading spanning it joins neither regime's average
    (docs/decisions/004-read-every-module.md, docs/decisions/014-lr-regimes.md)."""
    probe_size: int | None = None
    """Readings run on the first ``probe_size`` samples of the evaluation batch; a reading's
    cost shrinks with it. None: the rule's, 32 (egeria, in activation_mode "eval": small
    enough that the cost budget keeps n at 20 on 2 CPU cores; see
    docs/decisions/010-probe-size.md) or the whole batch (paper)."""
    horizon: float | None = None
    """Egeria's criterion: a module whose readings have settled (the slope test over the
    rule's span) freezes once the drift still to come is at most this share of the largest
    it has had in the run. The drift still to come is the module's pace (its drift per
    unit of learning-rate mass, the median of the span's readings) times the
    learning-rate mass still ahead, read from the schedule whatever built it
    (egeria.lr_schedule); without a known schedule only quiet modules (floor_ratio) and
    idle ones (at most 1/100 of the most active watched module's plasticity;
    docs/decisions/032-idle-modules.md) freeze. With it, a module that is neither also waits for a learning rate at most
    the share of the run's peak that ``speed`` names (1/100 by default;
    docs/decisions/030-freeze-at-low-lr.md). None: the rule's own, 0.0005 at the default
    speed (egeria; see docs/decisions/008-horizon.md), scaled with ``speed``
    (:func:`speed_horizon`: 0.0026 "balanced", 0.016 "fast"), or none (paper: the slope
    alone decides); 1.0 turns both conditions off."""
    speed: Union[str, float] = "safe"
    """The point on the speed-accuracy frontier (Egeria's rule): how low the learning rate
    must have come, as a share of the run's peak, before a module that has settled but
    still moves (is not at its floor) may freeze. "safe" (default): 1/100, after a step
    schedule's second tenfold decay or in the last few percent of a cosine; every freeze
    measured there cost nothing. "balanced": 1/30. "fast": 1/10, after a step schedule's
    first decay. A number in (0, 1] is that share itself (1.0: no bound). Unless
    ``horizon`` is given, it moves the drift still to come that a module may freeze at
    with it (:func:`speed_horizon`). The lower the
    bound, the later and safer the freeze; the measured cost and speedup of each value are
    in docs/decisions/031-speed-knob.md. Quiet modules (floor_ratio) and idle ones
    (docs/decisions/032-idle-modules.md) freeze at any learning rate whatever the value. The paper's rule and the baseline policies
    ignore it."""
    floor_ratio: float | None = None
    """A module also freezes after a span of readings (W x D steps) whose smoothed plasticity is at most
    this many times its *floor*: what a reading reads when the module has not moved (the
    reference's own error, measured after each refresh at one more reference forward),
    however much learning-rate mass is still ahead: its drift cannot be told from none.
    This is how a pretrained front freezes early in fine-tuning, where its drift never
    falls far below its first readings. None: the rule's own, off (paper) or 8.0 (egeria;
    measured with a bf16 reference, whose floor is far below an int8 one's; see
    docs/decisions/012-floor-ratio.md). 0 turns it off."""
    cost_budget: float | None = 0.01
    """Share of training time Egeria's readings may take on the training thread. With a
    derived n, readings are spaced further apart once, early, to keep within it (measured
    on the first evaluations), up to (W - 1) x D steps so that a span holds two: it sets
    how densely the rule's spans are sampled, never the spans, so the decisions stay where
    they are within one interval (docs/decisions/038-steps-not-readings.md). A budget an
    explicit eval_interval breaks is reported once. None: no budget. See
    docs/decisions/016-cost-budget.md."""
    activation_mode: str = "eval"
    """Where a reading's training activation comes from. "eval": at the evaluation step the
    model's front, up to the watched module, runs once more in eval mode without
    gradients, so the reading sees the module's own drift and not BatchNorm batch
    statistics or dropout noise. "train": hooked from the training forward pass, as in
    the paper; no extra compute, but that noise dwarfs the reference's own error (see
    docs/decisions/001-eval-mode-readings.md)."""
    policy: str = "egeria"
    """When to freeze: "egeria" (plasticity against the reference model), or a baseline
    from egeria.policies: "freezeout", "autofreeze", "linear", "static", "none"."""
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of a baseline policy, e.g. {"t0": 0.8, "scaling": "cubic"} for "freezeout"."""
    executor: str = "auto"
    """Where the controller runs (paper 4.1): "auto" (inline for a model on the CPU, whose
    cores all train; its own process beside an accelerator: egeria.knowledge.placement), "process"
    (its own process; the trainer never waits for it), "thread" (a thread of the training
    process), "inline" (inside Egeria.step(), decisions at the evaluation step)."""
    controller_cpus: Union[Sequence[int], None] = None
    """Cores the controller process may run on (Linux; None: wherever the trainer may).
    Beside an accelerator, name host cores the data loader does not need."""
    start_method: str | None = None
    """Start method of the controller process; None follows the platform default, as
    torch's DataLoader workers do. Under "spawn" the model must be picklable, and the
    script's training code under `if __name__ == "__main__":` (without it the process
    stops and the controller runs in a thread, with one warning: egeria.knowledge.mainguard)."""
    cpu_threshold: float | None = 0.5
    """The controller runs a reference forward pass only while other processes use less
    than this share of the machine's CPU time (the paper's 50%); None never waits."""
    release_optimizer_state: bool = True
    """At a freeze, take the frozen parameters' optimizer state (Adam's moments, SGD's
    momentum) out of the optimizer: off the accelerator into host memory, given back
    unchanged at an unfreeze, so training is bit for bit the same; on a CPU run it frees
    nothing (egeria.optimizer_state, docs/decisions/039-optimizer-state-release.md).
    False keeps it in the optimizer (an optimizer that reads every parameter's state)."""
    _from_rule: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    """The rule-dependent fields that were left at None and took the rule's values (so
    that replace() with another rule takes that rule's)."""

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"EgeriaConfig.rule={self.rule!r} is not one of {', '.join(map(repr, RULES))}")
        _check_speed(self.speed)  # the rule's horizon follows it
        taken = []
        # A baseline policy reads none of these; the paper's values leave it as it was
        # (no parameter cap on which modules it freezes).
        for name, value in RULE_DEFAULTS[self.rule if self.policy == "egeria" else "paper"].items():
            if name == "probe_size" and self.activation_mode != "eval":
                value = None  # a part of the batch is read only in eval mode
            if name == "horizon" and value is not None:
                value = speed_horizon(value, self.speed)
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
                taken.append(name)
        object.__setattr__(self, "_from_rule", frozenset(taken))
        _check_optional_positive_int(self, "eval_interval")
        _check_positive_int(self, "window")
        _check_positive_int(self, "max_modules")
        if self.max_modules < 2:
            raise ValueError(
                f"EgeriaConfig.max_modules={self.max_modules!r}: at least 2 modules are needed "
                "(the last one, the head, is never frozen)"
            )
        if self.horizon is not None:
            _check_positive(self, "horizon", share="of a module's largest drift still to come")
        _check_optional_ratio(self, "floor_ratio")
        if self.max_frozen_flops is not None:
            _check_positive(self, "max_frozen_flops", share="of the model's weight computation; None: no cap")
        if self.cost_budget is not None:
            _check_positive(self, "cost_budget", share="of training time, 0.01 for 1%; None: no budget")
        _check_optional_positive_int(self, "probe_size")
        if self.probe_size is not None and self.activation_mode != "eval":
            raise ValueError(
                "EgeriaConfig.probe_size reads a part of the batch, while the training forward pass sees all of "
                f"it; it needs activation_mode='eval', not {self.activation_mode!r}"
            )
        if self.reference_precision not in PRECISIONS:
            raise ValueError(
                f"EgeriaConfig.reference_precision={self.reference_precision!r} is not one of "
                f"{', '.join(map(repr, PRECISIONS))}"
            )
        if self.reference_device not in REFERENCE_DEVICES:
            raise ValueError(
                f"EgeriaConfig.reference_device={self.reference_device!r} is not one of "
                f"{', '.join(map(repr, REFERENCE_DEVICES))}"
            )
        if self.executor not in EXECUTORS:
            raise ValueError(
                f"EgeriaConfig.executor={self.executor!r} is not one of {', '.join(map(repr, EXECUTORS))}"
            )
        if self.reference_device == "model" and self.executor not in ("auto", "inline"):
            raise ValueError(
                f"EgeriaConfig(reference_device='model', executor={self.executor!r}): a reference on the model's "
                "device runs inline, in the training process; use executor='inline' (or 'auto')"
            )
        if self.reference_device == "model" and self.reference_precision == "int8":
            raise ValueError(
                "EgeriaConfig(reference_device='model', reference_precision='int8'): int8 kernels run on the CPU "
                "only; use 'bf16', 'fp32' or 'auto' (bf16) on the model's device"
            )
        if self.activation_mode not in ACTIVATION_MODES:
            raise ValueError(
                f"EgeriaConfig.activation_mode={self.activation_mode!r} is not one of "
                f"{', '.join(map(repr, ACTIVATION_MODES))}"
            )
        _check_modules(self.modules)
        if not isinstance(self.release_optimizer_state, bool):
            raise ValueError(
                f"EgeriaConfig.release_optimizer_state={self.release_optimizer_state!r} must be True or False"
            )
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"EgeriaConfig.start_method={self.start_method!r} is not one of {START_METHODS!r}"
            )
        _check_cpus(self.controller_cpus)
        if self.controller_cpus is not None and self.executor in ("inline", "thread"):
            raise ValueError(
                f"EgeriaConfig.controller_cpus={list(self.controller_cpus)!r} pins a controller process; "
                f"executor={self.executor!r} runs it in the trainer's process"
            )
        if self.cpu_threshold is not None:
            _check_positive(self, "cpu_threshold", share="of the machine's CPU time, 0.5 for 50%; None: never wait")
        from .policies import POLICIES

        names = ["egeria", *POLICIES]
        if not isinstance(self.policy, str):
            raise ValueError(
                f"EgeriaConfig.policy={self.policy!r} must be a policy name, one of {names!r}; "
                "a FreezePolicy object goes to Egeria(policy=...)"
            )
        if self.policy not in names:
            raise ValueError(f"EgeriaConfig.policy={self.policy!r} is not one of {names!r}")
        if not isinstance(self.policy_options, Mapping):
            raise ValueError(
                f"EgeriaConfig.policy_options={self.policy_options!r} must be a mapping of option names to values "
                f"(a dict), not {type(self.policy_options).__name__}"
            )
        if self.policy == "egeria" and self.policy_options:
            raise ValueError(
                f"EgeriaConfig.policy_options={dict(self.policy_options)!r} apply to baseline policies; "
                "configure the 'egeria' policy with the other fields"
            )

    def replace(self, **changes: Any) -> EgeriaConfig:
        """A copy with ``changes`` applied and validated; an unknown field raises ValueError.
        Fields that took the rule's values still follow the rule (another ``rule`` gives
        its own)."""
        known = {f.name for f in fields(self) if f.init}
        unknown = sorted(set(changes) - known)
        if unknown:
            hint = REMOVED.get(unknown[0])
            raise ValueError(
                f"EgeriaConfig has no field {unknown[0]!r}"
                + (f" ({hint})" if hint else f"; fields: {', '.join(sorted(known))}")
            )
        return dataclasses.replace(self, **{**{name: None for name in self._from_rule}, **changes})

    def to_dict(self) -> dict:
        """The config as a JSON-safe dict (``modules`` as a string or a list)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if out["modules"] is not None and not isinstance(out["modules"], str):
            out["modules"] = list(out["modules"])
        out["policy_options"] = dict(out["policy_options"])
        if out["controller_cpus"] is not None:
            out["controller_cpus"] = list(out["controller_cpus"])
        return out


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_positive_int(cfg: EgeriaConfig, name: str) -> None:
    check_int(getattr(cfg, name), f"EgeriaConfig.{name}")


def _check_optional_positive_int(cfg: EgeriaConfig, name: str) -> None:
    if getattr(cfg, name) is not None:
        _check_positive_int(cfg, name)


def _not_a_number(value: object, wanted: str) -> str:
    """What is wrong with ``value``, which is not a finite number, when ``wanted`` was asked."""
    if isinstance(value, float):
        return f"must be finite ({wanted})"
    return f"must be {wanted}, not {type(value).__name__}"


def _check_positive(cfg: EgeriaConfig, name: str, *, share: str | None = None, unit: str = "") -> None:
    """A finite number > 0 (of ``unit``); a ``share`` (described by the text) is at most 1 too."""
    value = getattr(cfg, name)
    if not _finite_number(value):
        problem = _not_a_number(value, f"a number{' of' + unit if unit else ''} > 0")
    elif value <= 0:
        problem = f"must be > 0{' (' + unit.strip() + ')' if unit else ''}"
    elif share is not None and value > 1:
        problem = f"must be at most 1 (a share {share})"
    else:
        return
    raise ValueError(f"EgeriaConfig.{name}={value!r} {problem}")


def _check_optional_ratio(cfg: EgeriaConfig, name: str) -> None:
    """None (the rule's own), 0 (off) or a finite positive ratio."""
    value = getattr(cfg, name)
    if value is None:
        return
    if not _finite_number(value):
        raise ValueError(f"EgeriaConfig.{name}={value!r} {_not_a_number(value, 'a number >= 0; 0: off')}")
    if value < 0:
        raise ValueError(f"EgeriaConfig.{name}={value!r} must be >= 0 (0: off; None: the rule's own)")


def lr_bound(speed: str | float) -> float:
    """The learning-rate share of the run's peak that ``EgeriaConfig.speed`` names."""
    return SPEEDS[speed] if isinstance(speed, str) else float(speed)


def speed_horizon(horizon: float, speed: str | float) -> float:
    """The rule's ``horizon`` at ``speed``: as many times ``horizon`` as the learning-rate
    mass a cosine decay has still ahead when its rate reaches ``speed``'s share of the peak
    is times what it has ahead at the safe speed's share. That mass goes as the share to
    the power 1.5 near a cosine's end, so "fast" (1/10) allows 10^1.5 = 32 times the
    drift still to come that "safe" (1/100) does: both conditions then name the same
    point of a cosine (docs/decisions/031-speed-knob.md)."""
    return min(1.0, horizon * (lr_bound(speed) / SPEEDS["safe"]) ** 1.5)


def _check_speed(speed: object) -> None:
    """One of SPEEDS' names, or a share of the peak learning rate in (0, 1]."""
    if isinstance(speed, str):
        if speed in SPEEDS:
            return
        problem = "is not one of " + ", ".join(map(repr, SPEEDS))
    elif not _finite_number(speed):
        problem = "must be one of " + ", ".join(map(repr, SPEEDS)) + " or a number in (0, 1]" + (
            f", not {type(speed).__name__}" if not isinstance(speed, float) else " (finite)")
    elif not 0 < speed <= 1:
        problem = "must be in (0, 1] (a share of the run's peak learning rate)"
    else:
        return
    raise ValueError(
        f"EgeriaConfig.speed={speed!r} {problem}; it says how low the learning rate must be, as a share of "
        "its peak, before a settled module may freeze ('safe', the default: 1/100)"
    )


def _check_cpus(cpus: object) -> None:
    """None or a non-empty list of core numbers."""
    if cpus is None:
        return
    if not isinstance(cpus, (list, tuple)):
        raise ValueError(
            f"EgeriaConfig.controller_cpus={cpus!r} must be None or a list of core numbers, not {type(cpus).__name__}"
        )
    if not cpus:
        raise ValueError(
            f"EgeriaConfig.controller_cpus={cpus!r} is empty; name at least one core, or None for wherever the trainer runs"
        )
    bad = [c for c in cpus if not isinstance(c, int) or isinstance(c, bool) or c < 0]
    if bad:
        raise ValueError(f"EgeriaConfig.controller_cpus={cpus!r} holds {bad[0]!r}, which is not a core number (an integer >= 0)")


def _check_modules(modules: object) -> None:
    if modules is None:
        return
    if isinstance(modules, str):
        try:
            re.compile(modules)
        except re.error as err:
            raise ValueError(f"EgeriaConfig.modules={modules!r} is not a valid regular expression: {err}") from None
        return
    if isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules):
        if len(modules) < 2:
            raise ValueError(
                f"EgeriaConfig.modules={list(modules)!r} names fewer than 2 modules; the last one "
                "(the head) is never frozen, so there would be nothing to freeze"
            )
        if len(set(modules)) != len(modules):
            raise ValueError(f"EgeriaConfig.modules={list(modules)!r} names a module twice")
        return
    if isinstance(modules, (list, tuple)):
        bad = next(m for m in modules if not isinstance(m, str))
        raise ValueError(
            f"EgeriaConfig.modules={modules!r} holds {bad!r}, which is not a module name (a string such as 'layer1')"
        )
    raise ValueError(
        f"EgeriaConfig.modules={modules!r} must be None, a regular expression string, or a list of module names"
    )
