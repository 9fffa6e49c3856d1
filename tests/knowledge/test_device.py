"""egeria.knowledge.device on CPU tensors: the copies, timing and start method the GPU paths use, and
the link's handling of a host copy that is not ready yet (as a GPU copy may not be)."""

from __future__ import annotations

import pytest
import torch

import egeria
import egeria.knowledge.device
from egeria.knowledge.device import HostCopy, Stopwatch, as_float32, pack_to_host, safe_start_method, to_device, wait_for
from tiny import Chain, batches, quick_config, train


def test_a_host_copy_is_independent_of_the_source_and_keeps_the_tree():
    x, ids = torch.randn(4, 3), torch.arange(4)
    copy = HostCopy(((x, {"ids": ids}), {"flag": True}))
    x.add_(1.0)
    assert copy.ready()
    (cx, extra), kwargs = copy.get()
    assert torch.equal(cx + 1.0, x) and torch.equal(extra["ids"], ids) and kwargs == {"flag": True}
    half = as_float32((x.to(torch.bfloat16), ids))
    assert half[0].dtype == torch.float32 and half[1].dtype == torch.int64


def test_pack_to_host_makes_one_buffer_per_dtype_with_each_tensors_offset():
    a, b, c = torch.randn(2, 3), torch.arange(5), torch.randn(4)
    buffers, where = pack_to_host([a, b, c])
    assert set(buffers) == {torch.float32, torch.int64}
    assert where == [(torch.float32, 0), (torch.int64, 0), (torch.float32, 6)]
    assert torch.equal(buffers[torch.float32][6:10], c) and torch.equal(buffers[torch.int64], b)
    a.zero_()
    assert buffers[torch.float32][:6].abs().sum() > 0  # a copy, not a view of the model's weights


def test_cpu_paths_of_device_copies_timing_and_start_method(monkeypatch):
    t = torch.randn(3)
    moved, event = to_device(t, torch.device("cpu"))
    assert event is None and wait_for(moved, event) is moved and torch.equal(moved, t)
    watch = Stopwatch(torch.device("cpu"))
    assert watch.seconds() is None
    watch.stop()
    assert watch.seconds() >= 0
    assert safe_start_method("fork") == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert safe_start_method("fork") == "spawn" and safe_start_method("forkserver") == "forkserver"


def test_a_batch_copy_not_ready_in_the_forward_goes_out_at_the_step_boundary(monkeypatch):
    """On a GPU the batch's host copy is usually not done when the forward hook starts it;
    the request must then go out at the boundary, and the run decide exactly as when the
    copy is ready at once (inline executor: the same readings, the same freezes)."""

    def run():
        torch.manual_seed(0)
        model = Chain()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        eg = egeria.Egeria(model, opt, config=quick_config(window=3))
        decisions = train(model, opt, eg, batches(1) * 60)
        history = [(r["step"], r["module"], r["plasticity"]) for r in eg.history]
        eg.close()
        return decisions, history

    ready = run()
    waits: list[bool] = []
    original = HostCopy.ready
    monkeypatch.setattr(HostCopy, "ready", lambda self: waits.append(True) and False)
    late = run()
    monkeypatch.setattr(HostCopy, "ready", original)
    assert waits and ready[0] and late == ready


def test_a_captured_activation_reduced_to_its_gram_where_it_lives_reads_the_same(monkeypatch):
    """Beside an accelerator a train-mode capture crosses as its Gram matrix; forced here on
    CPU tensors, the readings equal those from whole activations (to float rounding)."""
    from egeria.knowledge.similarity import Gram, gram_of, sp_loss

    a, b = torch.randn(6, 4, 3), torch.randn(6, 5)
    assert torch.allclose(sp_loss(gram_of(a), b), sp_loss(a, b)) and torch.allclose(sp_loss(a, gram_of(b)), sp_loss(a, b))
    assert isinstance(gram_of(a), Gram) and gram_of(a).matrix.shape == (6, 6)

    def run():
        torch.manual_seed(0)
        model = Chain()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        eg = egeria.Egeria(model, opt, config=quick_config(window=3, activation_mode="train"))
        train(model, opt, eg, batches(1) * 30)
        readings = [r["plasticity"] for r in eg.history]
        eg.close()
        return readings

    whole = run()
    monkeypatch.setattr(egeria.knowledge.device, "gram_where_it_lives", lambda activation: True)
    reduced = run()
    assert whole and reduced == pytest.approx(whole, rel=1e-4, abs=1e-12)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_reference_on_the_models_device_reads_as_on_the_host_without_a_host_copy(monkeypatch, mode):
    """``reference_device="model"``: batch and activations stay where they live
    (:class:`LocalCopy`), the controller's front and reference sit on the model's device.
    With the model on the CPU that device is the CPU, so the run must decide exactly as
    with host copies, and make none."""

    def run(reference_device):
        torch.manual_seed(0)
        model = Chain()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        config = quick_config(window=3, reference_precision="fp32", activation_mode=mode, reference_device=reference_device)
        eg = egeria.Egeria(model, opt, config=config)
        decisions = train(model, opt, eg, batches(1) * 60)
        history = [(r["step"], r["module"], r["plasticity"]) for r in eg.history]
        eg.close()
        return decisions, history

    host = run("cpu")
    monkeypatch.setattr(egeria.knowledge.device.HostCopy, "__init__", lambda self, tree: pytest.fail("a host copy was made"))
    local = run("model")
    assert host[0] and host[1] and local == host


def test_reference_device_choices_and_refusals():
    from egeria.knowledge.placement import reference_home, resolve_executor, resolve_precision
    from egeria.knowledge.reference import ReferenceModel
    from egeria.knowledge.weights import float_snapshot

    model = Chain()
    assert resolve_executor("auto", model, "model") == "inline"
    assert resolve_precision("auto") == "bf16" and resolve_precision("int8") == "int8"
    assert reference_home("model", model) == torch.device("cpu") and reference_home("cpu", model).type == "cpu"
    on_meta = float_snapshot(model, "meta")  # the snapshot goes where it is asked, weights and all
    assert {p.device.type for p in on_meta.parameters()} == {"meta"} and not any(p.requires_grad for p in on_meta.parameters())
    with pytest.raises(ValueError, match="int8 reference runs on the CPU only, not on meta"):
        ReferenceModel(on_meta, None, "int8")  # refused before the partition is read
    with pytest.raises(ValueError, match="reference_device='gpu' is not one of 'cpu', 'model'"):
        egeria.EgeriaConfig(reference_device="gpu")
    with pytest.raises(ValueError, match="reference_device='model', executor='process'"):
        egeria.EgeriaConfig(reference_device="model", executor="process")
    with pytest.raises(ValueError, match="reference_device='model', reference_precision='int8'"):
        egeria.EgeriaConfig(reference_device="model", reference_precision="int8")
