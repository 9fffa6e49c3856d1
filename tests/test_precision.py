"""Half-precision models and mixed precision: the controller reads them in fp32, freezing
works, GradScaler's skipped steps and scaled gradients mislead no policy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import egeria
from tiny import batches, quick_config, tiny_cnn


def _train_half(dtype: torch.dtype, steps: int, precision: str = "int8"):
    torch.manual_seed(0)
    model = tiny_cnn().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # A wide tolerance: what is tested is reading a half-precision model and keeping its
    # frozen weights, not the rule's timing. At the default 0.2 the stale count hangs on
    # slopes within float noise of the tolerance, so whether a module froze within 40 steps
    # depended on the CPU's int8 kernels (none froze on an AVX2-only machine, bf16 model);
    # at 3.0 every reference precision (int8, bf16, fp32) freezes the stem at step 8.
    eg = egeria.Egeria(model, opt, config=quick_config(tolerance_ratio=3.0, reference_precision=precision))
    snapshot: dict[str, torch.Tensor] = {}
    for x, y in batches(1, image=True) * steps:
        loss = F.cross_entropy(model(x.to(dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if eg.step(loss) and not snapshot:
            snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    return model, eg, snapshot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_freezes_and_its_frozen_weights_stay(dtype):
    model, eg, snapshot = _train_half(dtype, 40)
    assert eg.frozen and eg.controller_stats["failure"] is None
    assert eg.history and all(r["plasticity"] == r["plasticity"] for r in eg.history)  # finite readings
    assert snapshot and all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters() if n in snapshot)
    eg.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_freezes_under_the_rounded_bf16_reference(monkeypatch, dtype):
    """The default reference on a CPU without native bf16 (fp32 on bf16-rounded values)."""
    import egeria.knowledge.quantization

    monkeypatch.setattr(egeria.knowledge.quantization, "native_bf16", lambda: False)
    model, eg, snapshot = _train_half(dtype, 40, precision="auto")
    assert eg.frozen and eg.controller_stats["failure"] is None
    assert snapshot and all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters() if n in snapshot)
    eg.close()


def test_autocast_with_a_grad_scaler_freezes_and_skipped_steps_count_nothing():
    torch.manual_seed(0)
    model = tiny_cnn()
    # a rate at which the front's weights settle within the run (at 0.01 only batch norm's
    # running statistics did, and readings hold those: record 040)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    eg = egeria.Egeria(model, opt, config=quick_config())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    skipped = 0
    for i, (x, y) in enumerate(batches(1, image=True) * 40):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss * (float("inf") if i % 10 == 5 else 1.0)).backward()  # 4 overflowing steps
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
        eg.step(loss)
    assert skipped == 4 and eg.steps == 36
    assert eg.frozen
    eg.close()


def test_autofreeze_reads_unscaled_gradients_and_ignores_overflowing_steps():
    """One overflow step used to make AutoFreeze freeze every module at once (it summed the
    scaled, infinite gradients); with the norms read before each real optimizer step, a
    run with overflows decides as the same run without them."""

    def run(overflow: bool) -> list[tuple[int, tuple[str, ...]]]:
        torch.manual_seed(0)
        model = tiny_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        config = egeria.EgeriaConfig(policy="autofreeze", policy_options={"interval": 5})
        eg = egeria.Egeria(model, opt, config=config)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
        data = batches(40, image=True)
        if overflow:
            data = data[:12] + [data[12]] + data[12:]  # one extra, overflowing step
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss * (float("inf") if overflow and i == 12 else 1.0)).backward()
            scaler.step(opt)
            if not (overflow and i == 12):
                scaler.update()  # keep the scale: the two runs see the same scaled gradients
            else:
                scaler.update(1024.0)
            eg.step(loss)
        events = [(d.step, d.modules) for d in eg.events]
        eg.close()
        return events

    clean, overflowed = run(False), run(True)
    assert clean and overflowed == clean


def test_a_fused_optimizer_under_a_grad_scaler_skips_overflowing_steps_for_egeria_and_autofreeze():
    """GradScaler calls a fused optimizer's step() even when gradients overflowed (the
    kernel skips the update, told by ``optimizer.found_inf``), with scaled gradients: such
    steps must not count, and AutoFreeze must read unscaled norms."""

    def run(overflow: bool):
        torch.manual_seed(0)
        model = tiny_cnn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        config = egeria.EgeriaConfig(policy="autofreeze", policy_options={"interval": 5})
        eg = egeria.Egeria(model, opt, config=config)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
        data = batches(40, image=True)
        if overflow:
            data = data[:12] + [data[12]] + data[12:]
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss * (float("inf") if overflow and i == 12 else 1.0)).backward()
            scaler.step(opt)
            scaler.update(1024.0)  # the same scale every step: both runs see the same gradients
            eg.step(loss)
        result = eg.steps, [(d.step, d.modules) for d in eg.events]
        eg.close()
        return result

    clean, overflowed = run(False), run(True)
    assert clean[0] == overflowed[0] == 40 and clean[1]
    assert overflowed == clean
