"""The run's learning-rate schedule as a sequence: the learning rate of every optimizer step.

Why the learning-rate *mass* ahead (issue 28): a module frozen at step ``s`` misses what the
later steps would still have moved it, and how far SGD-like optimizers move a weight is in
proportion to the learning rate, so a freeze costs about the share of the run's summed
learning rate still ahead, :meth:`LRSchedule.mass_ahead`. Schedules put little of it in
their last stretch: on a cosine schedule (to 0) the last 30% of the steps carry 4.2% of the
mass, on a linear decay the last 20% carry 4.0%, and in the demo's step schedule (lr /10 at
50% and 75% of the steps) the last phase carries 0.47%. ``tests/test_lr_schedule.py``
(``test_mass_figures_of_issue_28``) computes these from schedules read by this module.

How a schedule is read, whatever the scheduler (:func:`read_schedule`): a deep copy of the
scheduler is stepped forward over a throwaway optimizer holding copies of the user's
param-group settings (no parameters, no optimizer state), and the first param group's
learning rate is read after each step. The user's scheduler, optimizer, parameters and
learning rates are never touched, and nothing here depends on the scheduler's class: a
scheduler whose ``step()`` needs an argument (a metric, as ``ReduceLROnPlateau``'s does)
cannot be read ahead, nor can one that fails to copy or step or gives non-finite learning
rates; these, and a run without a known length, give None with one warning that says what
is unknown and what to pass. A callable ``lr_at(step) -> float`` (:func:`schedule_from`)
is the escape hatch.

Steps and positions. Optimizer steps count from 0; the schedule holds the learning rate
each of steps ``0 .. total_steps - 1`` uses. A scheduler's *position* is its own step count
(``last_epoch``, 0 after construction). A scheduler stepped every ``steps_per_epoch``
optimizer steps (once per epoch, say) and built at the run's first step is at position
``p`` while the optimizer takes steps ``p * steps_per_epoch`` to
``(p + 1) * steps_per_epoch - 1``, whether it is read at the start, the middle or the end
of such an epoch. A schedule read mid-run (a resumed run) is read from the scheduler's
position on; earlier steps take the learning rates observed there where given (Egeria's
checkpoint carries those of the steps taken, :meth:`ScheduleWatch.taken`, so a resumed run
reads the uninterrupted run's schedule, its jumps and peak included), else the
first learning rate read, held back to step 0 (:attr:`LRSchedule.reconstructed` counts
them; for a schedule that does not rise after that point this understates the mass behind
and so overstates the mass ahead, the cautious side for a freeze, and it hides the
schedule's jumps and peak before that point).

Egeria itself (:class:`ScheduleWatch`) copies the scheduler when it is given (before
training, normally at position 0, so a fresh run's schedule is read whole) and learns how
many optimizer steps pass between the scheduler's steps by watching its position at the
step boundaries: the gap, in optimizer steps, between its first two advances. A scheduler
that keeps no position (``ChainedScheduler`` keeps none) is taken to step once per
optimizer step. The schedule itself is read at the first request that can be answered.
"""

from __future__ import annotations

import bisect

import copy
import inspect
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["LRAt", "LRSchedule", "ScheduleUnknown", "ScheduleWatch", "read_schedule", "schedule_from"]

logger = logging.getLogger(__name__)

LRAt = Callable[[int], float]  # the learning rate of optimizer step ``step`` (from 0)


class ScheduleUnknown(ValueError):
    """The schedule cannot be known; the message says what is unknown and what to pass."""


class LRSchedule:
    """The learning rate of every optimizer step of a run, and the mass it carries.

    Args:
        lrs: the learning rate of steps ``0 .. total_steps - 1``, shape ``(total_steps,)``;
            finite, non-negative, not all zero.
        start: the first step read from the scheduler or callable (earlier ones were
            observed or reconstructed).
        reconstructed: how many steps before ``start`` were neither read nor observed.

    Raises:
        ScheduleUnknown: ``lrs`` is empty, not finite, negative or all zero.
    """

    def __init__(self, lrs: Sequence[float] | torch.Tensor, *, start: int = 0, reconstructed: int = 0) -> None:
        values = torch.as_tensor(lrs, dtype=torch.float64).detach().clone().reshape(-1)
        if values.numel() == 0:
            raise ScheduleUnknown("the schedule has no steps: pass total_steps= (optimizer steps of the run)")
        if not bool(torch.isfinite(values).all()):
            bad = int((~torch.isfinite(values)).nonzero()[0])
            raise ScheduleUnknown(
                f"the learning rate of step {bad} is {float(values[bad])}: not finite; pass lr_schedule= (a callable)"
            )
        if bool((values < 0).any()) or float(values.sum()) <= 0:
            raise ScheduleUnknown("the learning rates are negative or all zero: no mass to share out")
        self._lrs = values
        self._cumulative = torch.cat([values.new_zeros(1), values.cumsum(0)])  # (total_steps + 1,)
        self._peak = float(values.max())  # read at every evaluation: kept
        self.start = start
        self.reconstructed = reconstructed
        self._jumps: dict[float, list[int]] = {}  # jumps() per factor, once asked

    @property
    def lrs(self) -> torch.Tensor:
        """The learning rate of every step, float64, shape ``(total_steps,)`` (a copy)."""
        return self._lrs.clone()

    @property
    def total_steps(self) -> int:
        """How many optimizer steps the run takes."""
        return self._lrs.numel()

    def __len__(self) -> int:
        return self.total_steps

    @property
    def peak(self) -> float:
        """The highest learning rate of the run."""
        return self._peak

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (from 0; clamped into the run)."""
        return float(self._lrs[min(max(int(step), 0), self.total_steps - 1)])

    def mass_between(self, first: int, end: int) -> float:
        """The share of the run's learning-rate mass in steps ``first .. end - 1`` (each
        clamped into ``0 .. total_steps``), in [0, 1]."""
        a = min(max(int(first), 0), self.total_steps)
        b = min(max(int(end), a), self.total_steps)
        return float((self._cumulative[b] - self._cumulative[a]) / self._cumulative[-1])

    def lr_sum(self, first: int, end: int | None = None) -> float:
        """The sum of the learning rates of steps ``first .. end - 1`` (``end`` None: to
        the run's end; each clamped into ``0 .. total_steps``): the learning-rate mass in
        the schedule's own units. From the scheduler's position on it does not depend on
        how earlier steps were reconstructed, so a resumed run reads what an uninterrupted
        one did."""
        a = min(max(int(first), 0), self.total_steps)
        b = self.total_steps if end is None else min(max(int(end), a), self.total_steps)
        return float(self._cumulative[b] - self._cumulative[a])

    def jumps(self, factor: float) -> list[int]:
        """The steps whose learning rate differs ``factor``x or more from the step before it
        and holds for the step after (a step schedule's drops, a restart), in order: between
        two of them the steps share one *regime*. A continuous decay never jumps, however far
        it falls between two readings; nor do the last steps of a decay to 0, which halve
        from one step to the next but hold no rate."""
        if factor not in self._jumps:
            before, after = self._lrs[:-1], self._lrs[1:]
            high, low = torch.maximum(before, after), torch.minimum(before, after)
            changed = (high > 0) & (high >= factor * low)  # changed[k]: step k + 1 differs from step k
            held = torch.cat([~changed[1:], changed.new_zeros(1)])  # and step k + 2 keeps step k + 1's rate
            self._jumps[factor] = (torch.nonzero(changed & held).reshape(-1) + 1).tolist()
        return list(self._jumps[factor])

    def last_jump(self, step: int, factor: float) -> int:
        """The latest of :meth:`jumps` at or before ``step``, -1 if none: the start of the
        regime ``step`` trains in."""
        jumps = self.jumps(factor)
        at = bisect.bisect_right(jumps, step)
        return jumps[at - 1] if at else -1

    def mass_ahead(self, step: int) -> float:
        """The share of the run's learning-rate mass in steps ``step`` and after: 1.0 at
        step 0, 0.0 at ``total_steps``. After ``Egeria.step()``, ``mass_ahead(eg.steps)``
        is the mass of the steps not yet taken."""
        return self.mass_between(step, self.total_steps)

    def __repr__(self) -> str:
        return f"LRSchedule(total_steps={self.total_steps}, peak={self.peak:g}, start={self.start})"


def read_schedule(
    scheduler: Any,
    optimizer: Any,
    total_steps: int | None,
    *,
    steps_per_epoch: int = 1,
    start: int | None = None,
    observed: Sequence[float] = (),
) -> LRSchedule | None:
    """Reads a scheduler's learning rate at every optimizer step by stepping a copy of it.

    Args:
        scheduler: any learning-rate scheduler whose ``step()`` takes no argument.
        optimizer: the optimizer it schedules (the scheduler's own ``optimizer``, where it
            has one, is the one copied).
        total_steps: optimizer steps of the whole run.
        steps_per_epoch: optimizer steps between two of the scheduler's steps (1: stepped
            after every optimizer step; the batches of an epoch: stepped once per epoch).
        start: the optimizer step that the optimizer's learning rate now belongs to; None:
            the scheduler's position (``last_epoch``) times ``steps_per_epoch``, or 0 for a
            scheduler that keeps no position.
        observed: learning rates seen at steps ``0 .. len(observed) - 1``, used for steps
            before ``start``.

    Returns:
        The schedule, or None (with one warning saying why) when it cannot be known.

    Raises:
        ValueError: a bad ``steps_per_epoch`` or ``start``.
    """
    try:
        return _read(scheduler, optimizer, total_steps, steps_per_epoch=steps_per_epoch, start=start, observed=observed)
    except ScheduleUnknown as err:
        logger.warning("the learning-rate schedule is unknown: %s", err)
        return None


def schedule_from(lr_at: LRAt, total_steps: int | None) -> LRSchedule | None:
    """The schedule a callable states: ``lr_at(step)`` for steps ``0 .. total_steps - 1``.

    Returns:
        The schedule, or None (with one warning saying why) when the callable fails or
        gives a value that is not a finite non-negative number, or ``total_steps`` is None.
    """
    try:
        return _from_callable(lr_at, total_steps)
    except ScheduleUnknown as err:
        logger.warning("the learning-rate schedule is unknown: %s", err)
        return None


class ScheduleWatch:
    """The run's schedule as Egeria comes to know it (one per ``Egeria``; the engine owns
    the scheduler, the optimizer and the step count and hands them in).

    :meth:`watch` copies a scheduler when it is first seen and, at each step boundary until
    its cadence is known, notes its position; :meth:`schedule` reads the schedule once,
    at the first request that can be answered, and keeps the answer.
    """

    def __init__(self) -> None:
        self._cadence: int | None = None  # optimizer steps per scheduler step, restored from a checkpoint
        self._taken: list[float] = []  # the learning rates of the steps taken before a resume (a checkpoint's)
        self._reset(None, 0)
        self._told: set[int] = set()  # the levels of the messages logged (one each)

    def _reset(self, scheduler: Any, step: int) -> None:
        self._scheduler = scheduler  # the scheduler watched
        self._copy: tuple[Any, Any] | None = None  # (its copy, the copy's optimizer) when first seen
        self._copied_at = step  # the optimizer step count then
        self._failed: str | None = None  # why it could not be copied
        self._last: tuple[int, int] | None = None  # (step count, position) at the last boundary watched
        self._advances: list[int] = []  # step counts at which its position advanced (the first two)
        self._too_fast: str | None = None  # it stepped more often than the optimizer
        self._answer: LRSchedule | None = None
        self._answered = False

    def watch(self, step: int, scheduler: Any, optimizer: Any, keep: Iterable[object] = ()) -> None:
        """Notes ``scheduler`` at a step boundary (``step``: optimizer steps taken).

        Args:
            step: optimizer steps taken so far, as the engine counts them.
            scheduler: the run's scheduler (None: nothing to note).
            optimizer: its optimizer.
            keep: objects a copy shares instead of copying (the model).
        """
        if scheduler is None:
            return
        if scheduler is not self._scheduler:
            self._reset(scheduler, step)
            try:
                self._copy = _copy_scheduler(scheduler, optimizer, keep)
            except ScheduleUnknown as err:
                self._failed = str(err)
        if self.steps_per_epoch is not None or self._too_fast is not None:
            return
        position = _position(scheduler)
        if position is None:
            return
        if self._last is not None and step > self._last[0] and position > self._last[1]:
            if position - self._last[1] > step - self._last[0]:
                self._too_fast = (
                    f"the scheduler stepped {position - self._last[1]} times in {step - self._last[0]} optimizer "
                    "step(s); pass lr_schedule= (a callable giving each optimizer step's learning rate)"
                )
            self._advances.append(step)
        if self._last is None or step >= self._last[0]:
            self._last = (step, position)

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps between two steps of the scheduler, once seen (None before its
        second advance) or restored from a checkpoint (:meth:`assume_cadence`); 1 for a
        scheduler that keeps no position."""
        if self._scheduler is not None and _position(self._scheduler) is None:
            return 1
        if len(self._advances) >= 2:
            return self._advances[1] - self._advances[0]
        return self._cadence

    def assume_cadence(self, steps_per_epoch: int | None) -> None:
        """The cadence a run learnt before it was checkpointed, so that a resumed run reads
        its schedule at once instead of after two more steps of the scheduler."""
        self._cadence = steps_per_epoch

    def taken(self, steps: int) -> torch.Tensor | None:
        """The learning rates of steps ``0 .. steps - 1`` as this run's schedule holds them
        (float64), for a checkpoint; None before the schedule is known."""
        answer = self._answer if self._answered else None
        if answer is not None:
            return answer.lrs[: min(steps, answer.total_steps)].clone()
        return torch.tensor(self._taken[:steps], dtype=torch.float64) if self._taken else None

    def assume_taken(self, lrs: Sequence[float] | torch.Tensor | None) -> None:
        """The learning rates of the steps a run took before it was checkpointed
        (:meth:`taken`): a resumed run's schedule holds them instead of reconstructing the
        steps before the scheduler's position, so it reads the jumps, the peak and the
        learning-rate mass of the uninterrupted run's schedule, bit for bit."""
        self._taken = [] if lrs is None else [float(v) for v in lrs]

    def schedule(
        self, optimizer: Any, total_steps: int | None, lr_at: LRAt | None = None, *, final: bool = True
    ) -> LRSchedule | None:
        """The run's schedule, read at the first call that can answer and kept.

        Args:
            optimizer: the training optimizer (its learning rate stands for the whole run
                when there is neither a scheduler nor ``lr_at``).
            total_steps: optimizer steps of the run.
            lr_at: the user's callable; it takes precedence over the scheduler.
            final: whether what is missing now stays missing (training has started); if
                not, a missing piece gives None quietly and is asked for again later.

        Returns:
            The schedule; None while it is not known, or for good (one warning said why).
        """
        if self._answered:
            return self._answer
        try:
            if total_steps is None:
                raise ScheduleUnknown(
                    "the run's length is not known: pass total_steps= (optimizer steps) to Egeria or to set_schedule()"
                )
            if lr_at is not None:
                answer = _from_callable(lr_at, total_steps)
            elif self._scheduler is None:
                if not final:
                    return None
                answer = LRSchedule(torch.full((total_steps,), _first_lr(optimizer), dtype=torch.float64))
            elif self._failed is not None:
                raise ScheduleUnknown(self._failed)
            elif self._too_fast is not None:
                raise ScheduleUnknown(self._too_fast)
            elif _step_needs(self._scheduler):
                _read(self._scheduler, optimizer, total_steps, steps_per_epoch=1, start=None)  # raises why
            elif self.steps_per_epoch is None:
                self._tell_once(
                    logging.INFO,
                    "the learning-rate schedule is read once the scheduler has stepped twice (to learn how many "
                    "optimizer steps pass between its steps); pass lr_schedule= to give it now",
                )
                return None
            else:
                scheduler, shadow = self._copy  # type: ignore[misc]
                position = _position(scheduler)
                steps = self.steps_per_epoch
                start = position * steps if position is not None else self._copied_at
                answer = _read(scheduler, shadow, total_steps, steps_per_epoch=steps, start=start, observed=self._taken)
        except ScheduleUnknown as err:
            if not final:
                return None
            self._tell_once(
                logging.WARNING,
                f"the learning-rate schedule is unknown: {err} (without it Egeria's rule cannot tell how much "
                "movement is still to come, and freezes only modules at their floor or idle)",
            )
            answer = None
        if final:  # before training, total_steps or the scheduler may still change
            self._answer, self._answered = answer, True
        return answer

    def _tell_once(self, level: int, message: str) -> None:
        """Logs one message per level per Egeria: a note while the cadence is being
        learnt (INFO), the reason the schedule is unknown (WARNING)."""
        if level not in self._told:
            self._told.add(level)
            logger.log(level, message)


# -- reading ------------------------------------------------------------------------


def _read(
    scheduler: Any,
    optimizer: Any,
    total_steps: int | None,
    *,
    steps_per_epoch: int,
    start: int | None,
    observed: Sequence[float] = (),
) -> LRSchedule:
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch!r} must be a positive integer (optimizer steps)")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise ValueError(f"start={start!r} must be a non-negative integer (optimizer steps taken)")
    total = _total(total_steps)
    needs = _step_needs(scheduler)
    if needs:
        raise ScheduleUnknown(
            f"{type(scheduler).__name__}.step() needs {', '.join(needs)}: its learning rates depend on values not "
            "known in advance, so they cannot be read ahead; pass lr_schedule= (a callable) if the schedule is known"
        )
    if start is None:
        position = _position(scheduler)
        start = position * steps_per_epoch if position is not None else 0
    copied, shadow = _copy_scheduler(scheduler, optimizer)
    first_epoch = start // steps_per_epoch
    epochs = max(0, (total - 1) // steps_per_epoch - first_epoch)  # scheduler steps to take
    values = [_first_lr(shadow)]
    try:
        with warnings.catch_warnings():  # the copy's own warnings ("step() before optimizer.step()")
            warnings.simplefilter("ignore")
            for _ in range(epochs):
                copied.step()
                values.append(_first_lr(shadow))
    except Exception as err:  # noqa: BLE001 - any failure of a user's scheduler means "unknown"
        raise ScheduleUnknown(
            f"a copy of the scheduler failed to step ({err!r}); pass lr_schedule= (a callable)"
        ) from err
    ahead = torch.tensor(values, dtype=torch.float64)
    steps = torch.arange(min(start, total), total)
    lrs = torch.empty(total, dtype=torch.float64)
    lrs[steps] = ahead[steps // steps_per_epoch - first_epoch]
    known = [float(v) for v in observed[: min(start, total)]]
    lrs[: len(known)] = torch.tensor(known, dtype=torch.float64)
    lrs[len(known) : min(start, total)] = values[0]
    return LRSchedule(lrs, start=start, reconstructed=max(0, min(start, total) - len(known)))


def _from_callable(lr_at: LRAt, total_steps: int | None) -> LRSchedule:
    total = _total(total_steps)
    values = []
    for step in range(total):
        try:
            value = lr_at(step)
        except Exception as err:  # noqa: BLE001 - the user's callable failing means "unknown"
            raise ScheduleUnknown(f"lr_schedule({step}) raised {err!r}") from err
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ScheduleUnknown(f"lr_schedule({step}) gave {value!r}; it must give a finite learning rate >= 0")
        values.append(float(value))
    return LRSchedule(values)


def _copy_scheduler(scheduler: Any, optimizer: Any, keep: Iterable[object] = ()) -> tuple[Any, Any]:
    """A deep copy of ``scheduler`` whose optimizer is a throwaway one: a ``torch.optim.SGD``
    over zero-size tensors with copies of the param groups' settings. Every reference the
    scheduler (and any scheduler inside it) holds to the optimizer, its param groups or its
    state leads to the throwaway's; parameters and ``keep`` are shared, never copied.

    Raises:
        ScheduleUnknown: the scheduler cannot be copied.
    """
    sources = [o for o in (optimizer, getattr(scheduler, "optimizer", None)) if o is not None]
    source = sources[-1]  # the optimizer the scheduler itself steps, where it names one
    try:
        groups = list(source.param_groups)
        shadow = torch.optim.SGD([torch.zeros(0)], lr=0.0)
        shadow.param_groups = [
            {**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, "params": [torch.zeros(0)]} for g in groups
        ]
        shadow.defaults = copy.deepcopy(getattr(source, "defaults", {}))
        memo: dict[int, Any] = {}
        for opt in sources:
            memo[id(opt)] = shadow
            memo[id(opt.param_groups)] = shadow.param_groups
            state = getattr(opt, "state", None)
            if state is not None:
                memo[id(state)] = shadow.state
        for group, copied_group in zip(groups, shadow.param_groups):
            memo[id(group)] = copied_group
            for p in group["params"]:
                memo[id(p)] = p
        for obj in keep:
            memo[id(obj)] = obj
        copied = copy.deepcopy(scheduler, memo)
    except Exception as err:  # noqa: BLE001 - a scheduler that does not copy cannot be read ahead
        raise ScheduleUnknown(
            f"the scheduler {type(scheduler).__name__} cannot be copied to be read ahead ({err!r}); "
            "pass lr_schedule= (a callable giving each optimizer step's learning rate)"
        ) from err
    return copied, shadow


def _step_needs(scheduler: Any) -> list[str]:
    """The arguments ``scheduler.step()`` cannot do without (a metric, say), or ['a step() method']
    when it has no step method."""
    step = getattr(scheduler, "step", None)
    if not callable(step):
        return ["a step() method"]
    try:
        parameters = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = inspect.Parameter
    required = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    return [p.name for p in parameters if p.default is kinds.empty and p.kind in required]


def _position(scheduler: Any) -> int | None:
    """The scheduler's own step count (``last_epoch``), or None where it keeps none."""
    position = getattr(scheduler, "last_epoch", None)
    return position if isinstance(position, int) and not isinstance(position, bool) and position >= 0 else None


def _first_lr(optimizer: Any) -> float:
    value = optimizer.param_groups[0]["lr"]
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _total(total_steps: int | None) -> int:
    if total_steps is None:
        raise ScheduleUnknown("the run's length is not known: pass total_steps= (optimizer steps of the run)")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ScheduleUnknown(f"total_steps={total_steps!r} is not a positive number of optimizer steps")
    return total_steps
