"""The controller in a thread or a process: same decisions as inline, at the same steps
(a decision applies a fixed number of steps after its reading, training waiting for a late
answer), bounded queues, faults that never stop training, no orphan processes."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import egeria
from egeria.config import MAX_IN_FLIGHT
from egeria.knowledge.executors import InlineExecutor, ProcessExecutor, ThreadExecutor
from fakes import Delayed, Recorder
import tiny
from tiny import Chain, Trapped, batches, quick_config, train

HELPERS = Path(tiny.__file__).parent  # the scripts import tiny from there


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _recorded_run(steps: int = 120):
    """A run with an inline controller that records every message it gets."""
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = quick_config()
    made: list[Recorder] = []

    def recorder(spec):
        made.append(Recorder(copy.deepcopy(spec)))
        made[-1].spec = spec
        return made[-1]

    policy = egeria.KnowledgeGuided(config, executor=recorder)
    eg = egeria.Egeria(model, opt, config=config, policy=policy, example_inputs=(torch.randn(4, 8),))
    decisions = train(model, opt, eg, batches(1) * steps)
    eg.close()
    [rec] = made
    return rec.messages, decisions, rec.spec


def _replay(executor, messages) -> list:
    """Sends the messages one evaluation at a time, waiting for each answer."""
    answers = []
    for kind, message in messages:
        if kind == "request":
            assert executor.offer(message)
        elif kind == "readout":
            executor.readout(message)
            got = _wait_for_answer(executor)
            assert len(got) == 1, executor.failure
            answers.append(got[0])
        elif kind == "restart":
            executor.restart(**message.args)
    executor.close()
    return [(a.seq, a.step, a.module, a.readings, a.decision, a.note) for a in answers]


def _wait_for_answer(executor, limit_s: float = 60.0) -> list:
    """Polls until an answer arrives (the outcome never depends on how fast it comes)."""
    deadline = time.monotonic() + limit_s
    got: list = []
    while not got and time.monotonic() < deadline and executor.failure is None:
        got = executor.poll()
        if not got:
            time.sleep(0.005)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["thread", "process-fork", "process-spawn"])
def test_thread_and_process_controllers_answer_exactly_as_inline(kind):
    messages, decisions, spec = _recorded_run()
    assert len(decisions) >= 2  # the recording includes freezes
    spec.cpu_threshold = None
    spec.threads = 1  # every replay on one thread: the same float kernels
    expected = _replay(InlineExecutor(copy.deepcopy(spec)), messages)
    torch.set_num_threads(1)  # the thread controller shares this pool; inline used 1 thread
    if kind == "thread":
        executor = ThreadExecutor(spec, max_in_flight=2, timeout=60)
    else:
        executor = ProcessExecutor(spec, max_in_flight=2, timeout=60, start_method=kind.split("-")[1])
    assert _replay(executor, messages) == expected
    assert any(d is not None for *_, d, _ in expected)


@pytest.mark.timing
@pytest.mark.slow
def test_process_controller_freezes_without_making_training_wait():
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = quick_config(executor="process", eval_interval=4, cpu_threshold=None)
    with egeria.Egeria(model, opt, config=config) as eg:
        in_flight = []
        decisions = train(model, opt, eg, batches(1) * 600, on_step=lambda i: in_flight.append(eg.controller_stats["in_flight"]))
        stats = eg.controller_stats
        pid = stats["pid"]
    assert stats["executor"] == "process" and stats["failure"] is None
    assert max(in_flight) <= MAX_IN_FLIGHT
    assert stats["sent"] == stats["answered"] + stats["in_flight"]
    freezes = [d for d in decisions if d.action == "freeze"]
    assert freezes, stats
    assert all(d.step - d.evaluated_at == config.eval_interval for d in freezes)  # D = n = 4
    assert stats["dropped"] == 0
    assert not _alive(pid)


@pytest.mark.slow
def test_a_controller_process_with_two_threads_is_spawned_and_answers():
    # Two cores named: the controller gets a thread for each, which a forked child cannot
    # start, so it is spawned.
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = quick_config(executor="process", eval_interval=4, controller_cpus=[0, 1], cpu_threshold=None)
    with egeria.Egeria(model, opt, config=config) as eg:
        train(model, opt, eg, batches(1) * 30)
        deadline = time.monotonic() + 60
        while eg.controller_stats["answered"] == 0 and time.monotonic() < deadline:
            train(model, opt, eg, batches(1) * 4)
        assert eg.controller_stats["start_method"] == "spawn"
        assert eg.controller_stats["answered"] > 0 and eg.controller_stats["failure"] is None


def _delayed_run(config, lag: int, steps: int = 120, in_flight: int = MAX_IN_FLIGHT):
    """Trains with a controller each of whose answers arrives ``lag`` steps after its
    evaluation (1: at the next step boundary), at most ``in_flight`` unanswered."""
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    made: list[Delayed] = []

    def executor(spec):
        made.append(Delayed(spec, max_in_flight=in_flight))
        return made[-1]

    eg = egeria.Egeria(model, opt, config=config, policy=egeria.KnowledgeGuided(config, executor=executor))
    sent_by_step: list[int] = []  # messages sent up to the end of each step

    def deliver(i: int) -> None:
        sent_by_step.append(len(made[0].outbox))
        if i + 1 >= lag:  # evaluations of steps up to i + 2 - lag, polled at step i + 2
            made[0].deliver(sent_by_step[i + 1 - lag])

    decisions = train(model, opt, eg, batches(1) * steps, on_step=deliver)
    stats, history = eg.controller_stats, eg.history
    eg.close()
    return decisions, stats, history


def test_a_decision_applies_lag_steps_after_its_reading_however_late_its_answer_comes():
    """Answers that come at the next step boundary, three steps late (later than D = 4, so
    training waits for them) or only when training waits: the same freezes at the same steps,
    each D steps after the reading that decided it, nothing dropped, at most a reading and
    the refresh before the next in flight."""
    config = quick_config(eval_interval=4)
    runs = {lag: _delayed_run(config, lag=lag) for lag in (1, 3, 1000)}
    freezes = {lag: [(d.step, d.modules) for d in decisions if d.action == "freeze"] for lag, (decisions, *_) in runs.items()}
    assert freezes[1], "the test needs freezes"
    assert freezes[1] == freezes[3] == freezes[1000]
    for decisions, stats, _ in runs.values():
        assert all(d.step - d.evaluated_at == 4 for d in decisions if d.action == "freeze")
        assert stats["dropped"] == 0 and stats["sent"] == stats["answered"] + stats["in_flight"]
    assert runs[1][1]["training_waits"] == 0 and runs[1000][1]["training_waits"] > 0


def test_an_inline_and_a_delayed_controller_freeze_at_the_same_steps_with_sparse_readings(monkeypatch):
    """Readings every 8 steps under Egeria's own timing with D = 4 (a refresh-only evaluation
    4 steps before each reading): an inline controller and one whose answers come only when
    training waits for them freeze the same modules at the same steps, D after the reading."""
    monkeypatch.setattr(egeria.knowledge.policy, "MIN_EVAL_INTERVAL", 4)
    config = quick_config(eval_interval=8, rule="egeria", window=3, horizon=1.0, floor_ratio=0.0)
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with egeria.Egeria(model, opt, config=config) as eg:
        inline = [(d.step, d.modules) for d in train(model, opt, eg, batches(1) * 200) if d.action == "freeze"]
    delayed = [d for d in _delayed_run(config, lag=1000, steps=200)[0] if d.action == "freeze"]
    assert inline and inline == [(d.step, d.modules) for d in delayed]
    assert all(d.evaluated_at % 8 == 0 and d.step - d.evaluated_at == 4 for d in delayed)


def _warnings(caplog) -> list[str]:
    """The controller's fault warnings. The starvation warning is left out: whether a
    process controller keeps pace depends on the machine's speed, not on the fault."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "controller" in r.getMessage() and "cannot keep pace" not in r.getMessage()
    ]


@pytest.mark.timing
@pytest.mark.parametrize(
    "executor, trap", [("process", "raise"), ("thread", "raise"), ("inline", "raise"), ("process", "hang"), ("thread", "hang")]
)
@pytest.mark.slow
def test_a_broken_controller_is_reported_once_and_training_goes_on(caplog, monkeypatch, executor, trap):
    monkeypatch.setattr("egeria.knowledge.policy.CONTROLLER_TIMEOUT", 1.0)
    torch.manual_seed(0)
    model = Trapped(trap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = quick_config(executor=executor, cpu_threshold=None)
    eg = egeria.Egeria(model, opt, config=config)
    before = None
    with caplog.at_level(logging.WARNING, logger="egeria"):
        for x, y in batches(1) * 200:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            eg.step(loss)
            if eg.controller_stats["failure"] is not None and before is None:
                before = {k: v.clone() for k, v in model.state_dict().items()}
                time.sleep(0.01)
            if eg.controller_stats["failure"] is None:
                time.sleep(0.01)  # give the hang time to show
        started = time.monotonic()
        eg.close()
        closing = time.monotonic() - started
    stats = eg.controller_stats
    assert stats["failure"] is not None
    assert ("raised" in stats["failure"]) if trap == "raise" else ("heartbeat" in stats["failure"])
    assert len(_warnings(caplog)) == 1
    assert eg.frozen == [] and before is not None
    assert not torch.equal(model.head.weight, before["head.weight"])  # it kept training
    assert closing < 10
    if executor == "process":
        assert not _alive(stats["pid"])


@pytest.mark.timing
@pytest.mark.slow
def test_a_killed_controller_process_is_noticed_and_training_goes_on(caplog):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config(executor="process", eval_interval=2, cpu_threshold=None))
    data = batches(1) * 300
    failed_at = None
    with caplog.at_level(logging.WARNING, logger="egeria"):
        decisions = train(model, opt, eg, data[:20])
        os.kill(eg.controller_stats["pid"], 9)
        for i, batch in enumerate(data[20:]):
            decisions += train(model, opt, eg, [batch])
            if failed_at is None and eg.controller_stats["failure"] is not None:
                failed_at, frozen, head = 21 + i, list(eg.frozen), model.head.weight.detach().clone()
        eg.close(unfreeze=False)
    stats = eg.controller_stats
    assert "exited" in stats["failure"] and failed_at is not None
    assert len(_warnings(caplog)) == 1
    assert all(d.step <= failed_at for d in decisions)  # no decision once the failure is known
    assert eg.frozen == frozen
    assert not torch.equal(model.head.weight, head)  # training went on


@pytest.mark.timing
def test_an_unpicklable_batch_falls_back_to_a_thread(caplog):
    class Keyed(Chain):
        def forward(self, x, scale=None):
            return super().forward(x * scale())

    torch.manual_seed(0)
    model = Keyed()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config(executor="process", cpu_threshold=None))
    decisions = []
    with caplog.at_level(logging.WARNING, logger="egeria"):
        for x, y in batches(1) * 150:
            loss = torch.nn.functional.cross_entropy(model(x, scale=lambda: 1.0), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            decisions += eg.step(loss)
            time.sleep(0.002)
    stats = eg.controller_stats
    eg.close()
    assert stats["executor"] == "thread" and len(stats["fallbacks"]) == 1
    assert "cannot be sent" in stats["fallbacks"][0]
    assert any("runs in a thread" in m for m in _warnings(caplog))
    assert decisions, stats


def test_an_unpicklable_model_under_spawn_falls_back_to_a_thread(caplog):
    torch.manual_seed(0)
    model = Chain()
    model.callback = lambda: None  # spawn must pickle the model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        eg = egeria.Egeria(
            model, opt, config=quick_config(executor="process", start_method="spawn"), example_inputs=(torch.randn(4, 8),)
        )
        assert eg.controller_stats == {}  # the controller starts at the first step, not in a forward hook
        train(model, opt, eg, batches(1))
    assert eg.controller_stats["executor"] == "thread"
    assert any("could not start" in m for m in _warnings(caplog))
    eg.close()


def test_closing_inside_with_on_keyboard_interrupt_stops_the_controller():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(KeyboardInterrupt):
        with egeria.Egeria(model, opt, config=quick_config(executor="process")) as eg:
            train(model, opt, eg, batches(1) * 5)
            pid = eg.controller_stats["pid"]
            raise KeyboardInterrupt
    assert not _alive(pid)


@pytest.mark.slow
def test_no_orphan_process_after_an_interrupted_script_that_never_closes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(HELPERS)!r})
            import torch, egeria
            from tiny import Chain, batches, quick_config, train
            model = Chain()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            eg = egeria.Egeria(model, opt, config=quick_config(executor="process"))
            train(model, opt, eg, batches(1) * 5)
            print(eg.controller_stats["pid"], flush=True)
            raise KeyboardInterrupt
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "KeyboardInterrupt" in done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_checkpoint_in_process_mode_waits_for_the_controller_and_resumes():
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = quick_config(executor="process", eval_interval=2, cpu_threshold=None)
    eg = egeria.Egeria(model, opt, config=config)
    train(model, opt, eg, batches(1) * 40)
    state = eg.state_dict()
    assert eg.controller_stats["in_flight"] == 0  # the checkpoint waited for every answer
    assert state["policy_state"]["link"]["controller"] is not None
    eg.close()
    eg2 = egeria.Egeria(model, opt, config=config, example_inputs=(torch.randn(4, 8),))
    eg2.load_state_dict(state)
    again = eg2.state_dict()
    assert again["policy_state"]["link"]["controller"] == state["policy_state"]["link"]["controller"]
    assert eg2.history == eg.history
    train(model, opt, eg2, batches(1) * 10)
    assert len(eg2.history) > len(eg.history)
    eg2.close()


@pytest.mark.timing
@pytest.mark.slow
def test_a_checkpoint_does_not_wait_long_for_a_busy_controller_nor_stop_it(monkeypatch, caplog):
    monkeypatch.setattr(egeria.knowledge.executors, "_STATE_REPLY_S", 0.05)
    torch.manual_seed(0)
    model = Trapped("slow")  # every controller forward takes at least 0.3 s
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config(executor="thread", cpu_threshold=None))
    train(model, opt, eg, batches(1) * 4)  # guided from step 2: an evaluation is in flight
    with caplog.at_level(logging.WARNING, logger="egeria"):
        state = eg.state_dict()
    assert state["policy_state"]["link"]["controller"] is None
    assert any("did not answer 'state'" in r.getMessage() for r in caplog.records)
    train(model, opt, eg, batches(1) * 4)
    deadline = time.monotonic() + 30
    while eg.controller_stats["answered"] == 0 and time.monotonic() < deadline:
        train(model, opt, eg, batches(1))
    assert eg.controller_stats["failure"] is None and eg.controller_stats["answered"] > 0  # it went on
    eg.close()
