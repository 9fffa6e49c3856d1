"""The activation cache: with it on, every loss and gradient equals the uncached run's,
through freezes, deeper boundaries, unfreezes, disk storage, corrupt files and failing
writes; limits hold; random data and non-chain models are refused."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import egeria
from egeria.cache import Augmented
from egeria.cache.datasets import Keyed
from egeria.models import TransformerLM, next_token_loss
from tiny import Plan, tiny_cnn


def images(n: int = 96):
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 12, 12, generator=g), torch.randint(0, 3, (n,), generator=g))


def tokens(n: int = 64, vocab: int = 50, length: int = 12):
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, vocab, (n, length + 1), generator=g)
    return torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:])


def classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def language(model, batch):
    x, y = batch
    return next_token_loss(model(x), y)


def run(make_model, dataset, plan, *, cache=None, epochs=4, loss_fn=classify, on_step=None, average=None,
        total_steps=None, accumulate=1):
    """Trains with a scheduled policy, an optimizer step every ``accumulate`` batches;
    returns per-batch (loss, grads), Egeria's cache stats."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eg = egeria.Egeria(model, opt, policy=Plan(plan), average=average, total_steps=total_steps)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
    if cache is not None:
        loader = eg.cache_loader(loader, **{"serve": "always", **cache})
    trace = []
    model.train()
    for epoch in range(epochs):
        if isinstance(dataset, Augmented):
            dataset.set_epoch(epoch)  # as a user does without the cache (the cache does it too)
        for batch in loader:
            loss = loss_fn(model, batch)
            loss.backward()
            trace.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
            if len(trace) % accumulate == 0:
                opt.step()
                opt.zero_grad()
            eg.step(loss)  # after every batch: only those after an optimizer step count
            if on_step is not None:
                on_step(eg, len(trace))
    stats = eg.cache_stats
    eg.close()
    return trace, stats


def assert_same(a, b):
    assert len(a) == len(b)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b):
        torch.testing.assert_close(loss_b, loss_a)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_nothing_is_recorded_in_the_runs_last_epoch_where_no_row_could_be_served(accumulate):
    """6 batches an epoch, 3 epochs: frozen from the last epoch's first batch, the cache
    computes and records nothing (no later epoch reads it); frozen an epoch earlier, it
    records that epoch and serves the last; without a known length it records as before.
    With gradient accumulation the steps are counted in forward passes."""
    steps = 18 // accumulate
    last_epoch = {12 // accumulate: 1}  # frozen after step 12 // accumulate: from batch 13 on
    plain, _ = run(tiny_cnn, images(), last_epoch, epochs=3, accumulate=accumulate)
    cached, stats = run(tiny_cnn, images(), last_epoch, epochs=3, cache={"memory_limit": 2**30},
                        total_steps=steps, accumulate=accumulate)
    assert_same(plain, cached)
    assert (stats["computed"], stats["unrecorded"], stats["served"]) == (6, 6, 0), stats
    assert all(level["bytes"] == 0 for level in stats["levels"].values())
    _, unknown = run(tiny_cnn, images(), last_epoch, epochs=3, cache={"memory_limit": 2**30}, accumulate=accumulate)
    assert (unknown["computed"], unknown["unrecorded"]) == (6, 0) and any(level["bytes"] > 0 for level in unknown["levels"].values())
    earlier = {6 // accumulate: 1}  # from batch 7, the second epoch's first
    _, stats = run(tiny_cnn, images(), earlier, epochs=3, cache={"memory_limit": 2**30}, total_steps=steps,
                   accumulate=accumulate)
    assert (stats["computed"], stats["unrecorded"], stats["served"]) == (6, 0, 6), stats


# 6 batches per epoch: freeze 1 module at step 3, 2 at step 15, unfreeze at 27, refreeze at 30.
PLAN = {3: 1, 15: 2, 27: 0, 30: 2}


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_resnet_cache_gives_the_same_losses_and_gradients(tier, tmp_path):
    plain, _ = run(tiny_cnn, images(), PLAN, epochs=7)
    limits = {"memory_limit": 2**30} if tier == "memory" else {"memory_limit": 0, "directory": str(tmp_path)}
    cached, stats = run(tiny_cnn, images(), PLAN, epochs=7, cache=limits)
    assert_same(plain, cached)
    assert stats["served"] >= 12 and stats["chained"] >= 1, stats
    assert all(level["tier"] == tier for level in stats["levels"].values())


def test_a_module_frozen_to_its_average_is_served_once_its_batchnorm_is_re_estimated():
    average = egeria.WeightAverage(span=4)
    settled = []
    plain, _ = run(tiny_cnn, images(), PLAN, epochs=9, average=average)
    cached, stats = run(tiny_cnn, images(), PLAN, epochs=9, cache={"memory_limit": 2**30}, average=average,
                        on_step=lambda eg, step: settled.append((step, eg._cache.frozen)))
    assert_same(plain, cached)
    # the cache counts a module frozen to its average only after its 10 batches of re-estimate
    assert dict(settled)[12] == 0 and dict(settled)[13] == 1 and dict(settled)[24] == 1 and dict(settled)[25] == 2
    assert dict(settled)[27] == 0 and dict(settled)[39] == 0 and dict(settled)[40] == 2
    assert stats["served"] >= 6, stats


def test_transformer_lm_cache_gives_the_same_losses_and_gradients():
    def lm():
        return TransformerLM(50, d_model=16, n_heads=2, n_layers=4, d_ff=32, max_len=16, dropout=0.1)

    plan = {3: 2, 10: 3}
    plain, _ = run(lm, tokens(), plan, epochs=5, loss_fn=language)
    cached, stats = run(lm, tokens(), plan, epochs=5, loss_fn=language, cache={})
    assert_same(plain, cached)
    assert stats["served"] >= 4 and stats["chained"] >= 1, stats


class HFBlock(nn.Module):
    """Takes a mask, returns a tuple, as Hugging Face layers do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, hidden, attention_mask=None):
        out = hidden + self.drop(torch.tanh(self.fc(hidden)))
        if attention_mask is not None:
            out = out * attention_mask[..., None]
        return (out, None)


class HFModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList(HFBlock(8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        mask = (x[..., 0] > -5).float()
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, attention_mask=mask)[0]
        return self.head(h.mean(1))


def test_blocks_with_masks_and_tuple_outputs_are_skipped_too():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    plain, _ = run(HFModel, data, {3: 2}, epochs=4)
    cached, stats = run(HFModel, data, {3: 2}, epochs=4, cache={})
    assert_same(plain, cached)
    assert stats["served"] >= 8, stats


def test_a_batch_held_in_part_is_served_in_part_with_the_same_losses_and_gradients(caplog):
    """Frozen at step 3 of 6 per epoch, the next epoch's shuffled batches mix rows recorded
    since the freeze with rows not seen since: the prefix runs on the missing rows only, the
    others come from the cache, and every loss and gradient is the uncached run's; the rows
    computed so are recorded, so the epoch after is served whole."""
    plain, _ = run(HFModel, images_5x6(), {3: 2}, epochs=4)
    with caplog.at_level(logging.INFO, logger="egeria"):
        cached, stats = run(HFModel, images_5x6(), {3: 2}, epochs=4, cache={"prefetch": 0})
    assert_same(plain, cached)
    assert stats["partly"] >= 3 and stats["served"] >= 6, stats
    assert stats["served"] + stats["partly"] + stats["computed"] == stats["batches"]
    assert any("served in part" in r.getMessage() for r in caplog.records)


class BatchMean(nn.Module):
    """A frozen block whose rows depend on the whole batch: not per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(dim=0, keepdim=True)


def test_a_prefix_whose_rows_depend_on_the_batch_is_never_served_in_part(caplog):
    """Running such a prefix on some rows gives other rows: the check of the first batch held
    in part sees the model's outputs differ, and batches held in part are computed whole (the
    run's losses and gradients are the uncached run's)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.front = BatchMean()
            self.layers = nn.ModuleList(HFBlock(8) for _ in range(2))
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.front(x)
            for layer in self.layers:
                h = layer(h)[0]
            return self.head(h.mean(1))

    plain, _ = run(Model, images_5x6(), {3: 1}, epochs=2)  # the epoch after the freeze: held in part only
    with caplog.at_level(logging.INFO, logger="egeria"):
        cached, stats = run(Model, images_5x6(), {3: 1}, epochs=2, cache={"prefetch": 0})
    assert_same(plain, cached)
    assert stats["partly"] == 0, stats
    assert any("computed whole" in r.getMessage() for r in caplog.records)


def images_5x6(n: int = 96):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 5, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def disk_files(eg):
    """(descriptor, bytes per row) of each disk table: their files are unlinked once open."""
    return [(t.fd, t.stride) for lv in eg._cache.levels.values() for t in lv.tables or [] if t.kind == "disk"]


def test_a_corrupt_or_truncated_cache_file_is_detected_and_the_batch_recomputed(tmp_path, caplog):
    def damage(eg, step):
        files = disk_files(eg)
        if not files:
            return
        fd, stride = files[0]
        if step == 14:  # flip bytes in the middle of the file
            os.pwrite(fd, b"\xff" * 64, stride * 5 + 10)
        if step == 26:
            os.ftruncate(fd, stride * 40)

    plain, _ = run(tiny_cnn, images(), {3: 2}, epochs=6)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        cached, stats = run(
            tiny_cnn, images(), {3: 2}, epochs=6, cache={"memory_limit": 0, "directory": str(tmp_path), "prefetch": 0}, on_step=damage
        )
    assert_same(plain, cached)
    assert stats["corrupt"] >= 2, stats
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "checksum" in messages and "truncated" in messages


def test_a_failing_write_turns_caching_off_once_and_training_goes_on(tmp_path, caplog, monkeypatch):
    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    plain, _ = run(tiny_cnn, images(), {3: 2}, epochs=3)
    monkeypatch.setattr(os, "pwrite", full)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        cached, stats = run(tiny_cnn, images(), {3: 2}, epochs=3, cache={"memory_limit": 0, "directory": str(tmp_path)})
    assert_same(plain, cached)
    assert "No space left" in stats["off"] and stats["served"] == 0
    assert sum("caching turned off" in r.getMessage() for r in caplog.records) == 1
    assert os.listdir(tmp_path) == []


def test_limits_hold_and_a_cache_over_both_limits_is_not_built(tmp_path):
    seen = []

    def watch(eg, step):
        seen.extend(os.fstat(fd).st_size for fd, _ in disk_files(eg))

    row = 4 * 12 * 12 * 4  # the first module's output per sample: 4 channels of 12x12 fp32
    limit = 96 * row
    _, stats = run(tiny_cnn, images(), {3: 1}, epochs=3, cache={"memory_limit": limit - 1, "disk_limit": limit, "directory": str(tmp_path)}, on_step=watch)
    assert seen and max(seen) <= limit
    assert stats["served"] > 0
    plain, _ = run(tiny_cnn, images(), {3: 1}, epochs=3)
    cached, stats = run(tiny_cnn, images(), {3: 1}, epochs=3, cache={"memory_limit": limit - 1, "disk_limit": limit - 1})
    assert_same(plain, cached)
    level = next(iter(stats["levels"].values()))
    assert level["bytes"] == 0 and "limit" in level["off"]


def test_random_transforms_are_refused_and_augmented_data_is_cached(caplog):
    class Noisy(torch.utils.data.Dataset):
        def __init__(self, base):
            self.base = base

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            x, y = self.base[i]
            return x + 0.1 * torch.randn_like(x), y

    model = tiny_cnn()
    eg = egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=Plan({}))
    loader = torch.utils.data.DataLoader(Noisy(images()), batch_size=16)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        assert eg.cache_loader(loader) is loader
    assert any("transform is random" in r.getMessage() for r in caplog.records)
    eg.close()

    def jitter(x, g):
        return x + 0.1 * torch.randn(x.shape, generator=g)

    augmented = Augmented(images(), jitter, variants=2, seed=7)
    plain, _ = run(tiny_cnn, augmented, {3: 2}, epochs=6)
    cached, stats = run(tiny_cnn, Augmented(images(), jitter, variants=2, seed=7), {3: 2}, epochs=6, cache={})
    assert_same(plain, cached)
    assert stats["served"] > 0, stats


class Skipping(nn.Module):
    """Not a chain: the head also reads the stem's output directly."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.body = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        s = self.stem(x)
        h = s
        for layer in self.body:
            h = torch.relu(layer(h))
        return self.head(h + s)


def test_a_model_that_is_not_a_chain_at_the_boundary_is_not_served(caplog):
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    plain, _ = run(Skipping, data, {3: 2}, epochs=3)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        cached, stats = run(Skipping, data, {3: 2}, epochs=3, cache={})
    assert_same(plain, cached)
    assert stats["served"] == 0
    assert any("not a chain" in r.getMessage() for r in caplog.records)


def test_serving_stops_where_reading_is_slower_than_computing(monkeypatch, caplog):
    """Served forward passes measured slower than computed ones: after its trial the cache
    computes. The measured times are replaced by forced ones at the decision (a wall-clock
    race between a slowed read and a forward pass would depend on the machine's load)."""
    from egeria.cache.manager import _TIMING_SAMPLES, ActivationCache

    decide = ActivationCache._decide

    def decide_on_forced_timings(self, level):
        level.compute_s = [0.001] * len(level.compute_s)  # computing the prefix: 1 ms
        level.serve_s = [1.0] * len(level.serve_s)  # serving from the cache: 1 s
        decide(self, level)

    monkeypatch.setattr(ActivationCache, "_decide", decide_on_forced_timings)
    plain, _ = run(tiny_cnn, images(), {3: 2}, epochs=6)
    with caplog.at_level(logging.INFO, logger="egeria"):
        cached, stats = run(tiny_cnn, images(), {3: 2}, epochs=6, cache={"serve": "auto", "prefetch": 0})
    assert_same(plain, cached)
    # the trial (served whole or in part; the batch of each check and those held less than
    # half not timed), then computing
    assert _TIMING_SAMPLES + 1 <= stats["served"] + stats["partly"] <= 2 * _TIMING_SAMPLES + 2, stats
    assert stats["computed"] >= stats["batches"] - 2 * _TIMING_SAMPLES - 2, stats
    assert any("computing is cheaper" in r.getMessage() for r in caplog.records)
    (decision,) = stats["decisions"]
    assert decision["serving"] is False and decision["serve_ms"] == 1000.0 and decision["compute_ms"] == 1.0


def test_bad_cache_options_name_the_value():
    model = tiny_cnn()
    eg = egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=Plan({}))
    loader = torch.utils.data.DataLoader(images(), batch_size=16)
    with pytest.raises(ValueError, match="memory_limit=-1"):
        eg.cache_loader(loader, memory_limit=-1)
    with pytest.raises(ValueError, match="storage_dtype"):
        eg.cache_loader(loader, storage_dtype=torch.int8)
    with pytest.raises(ValueError, match="batch_size"):
        eg.cache_loader(torch.utils.data.DataLoader(images(), batch_size=None))
    eg.close()


def test_serving_is_weighed_against_the_computing_just_before_it_not_the_chain_check(monkeypatch):
    """The trial times the served forward passes after the one that ran the chain check (two
    forward passes of its own), and weighs them against the passes computed just before
    serving began: here the level's early history computed fast (1 ms) and its last passes
    slowly (2 s), as under a load that came later; served at 1 s, serving wins. Timings
    forced at the decision, as above; batches held in part computed whole here, so that
    the served ones are whole batches."""
    from egeria.cache.manager import _TIMING_SAMPLES, ActivationCache

    decide, seen = ActivationCache._decide, []

    def decide_on_forced_timings(self, level):
        if len(level.serve_s) >= _TIMING_SAMPLES and not seen:
            seen.append((self.stats["served"], len(level.serve_s), len(level.compute_s)))
            level.compute_s = [0.001] * 100 + [2.0] * _TIMING_SAMPLES
            level.serve_s = [1.0] * _TIMING_SAMPLES
        decide(self, level)

    monkeypatch.setattr(ActivationCache, "_decide", decide_on_forced_timings)
    monkeypatch.setattr(ActivationCache, "_serve_part", lambda self, *args: False)
    plain, _ = run(tiny_cnn, images(), {3: 2}, epochs=6)
    cached, stats = run(tiny_cnn, images(), {3: 2}, epochs=6, cache={"serve": "auto", "prefetch": 0})
    assert_same(plain, cached)
    served_then, timed, computed = seen[0]
    assert timed == _TIMING_SAMPLES and served_then == _TIMING_SAMPLES + 1  # the checked batch not among them
    assert computed >= 1
    (decision,) = stats["decisions"]
    assert decision["serving"] is True and decision["compute_ms"] == 2000.0
    assert stats["served"] > 2 * _TIMING_SAMPLES  # it went on serving


def test_a_write_still_pending_when_its_level_is_turned_off_is_dropped_not_recreated():
    """The boundary output of a recording forward is written at the next forward's start.
    A level turned off in between (computing measured cheaper, decided here from forced
    timings) must stay closed: the pending write is dropped, no table is made again, and
    training goes on exactly as without the cache."""
    from egeria.cache.manager import _TIMING_SAMPLES

    turned_off = []

    def on_step(eg, step):
        cache = eg._cache
        if turned_off or cache._unwritten is None:
            return
        level = cache._unwritten[0]
        level.compute_s, level.serve_s = [0.001] * _TIMING_SAMPLES, [1.0] * _TIMING_SAMPLES  # serving measured slower
        cache._decide(level)
        assert level.off is not None and level.tables is None
        cache._flush()  # the pending write: dropped
        turned_off.append(level)

    plain, _ = run(tiny_cnn, images(), {3: 2}, epochs=3)
    cached, stats = run(tiny_cnn, images(), {3: 2}, epochs=3, cache={"serve": "auto", "prefetch": 0}, on_step=on_step)
    assert_same(plain, cached)
    (level,) = turned_off
    assert level.tables is None and stats["levels"][level.boundary]["tier"] is None and stats["served"] == 0


def test_augmented_variants_are_the_seeded_draws_drawn_once_an_epoch(monkeypatch):
    def seeded(seed, epoch, index):  # the documented draw, from (seed, epoch, index)
        g = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + epoch * 1_000_003 + index) % (2**63))
        return int(torch.randint(4, (1,), generator=g))

    data = Augmented(images(), lambda x, g: x, variants=4, seed=3)
    n = len(data)
    for epoch in (0, 1, 0):  # back to an epoch: drawn again, the same
        data.set_epoch(epoch)
        expected = [seeded(3, epoch, i) for i in range(n)]
        assert [data.variant(i) for i in range(n)] == expected
        assert data.key(n - 1) == (n - 1) * 4 + expected[-1] and data.variant(-1) == expected[-1]
    assert len({tuple(seeded(3, e, i) for i in range(n)) for e in (0, 1)}) == 2  # the epochs differ

    draws = []
    real = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: draws.append(1) or real(*a, **k))
    data.set_epoch(5)
    keyed = Keyed(data)
    for i in range(n):  # the loader's plan, the key of the item, the item's transform
        keyed.key(i)
        keyed[i]
    assert len(draws) == n


def test_a_negative_index_is_the_same_item_key_and_variant_as_its_position():
    def shift(x, g):  # a transform whose result shows the generator's seed
        return x + torch.rand((), generator=g)

    data = Augmented(images(), shift, variants=4, seed=3)
    n = len(data)
    keyed, plain_keyed = Keyed(data), Keyed(images())
    for i in (1, n // 2, n - 1):
        assert torch.equal(data[i - n][0], data[i][0])
        assert data.key(i - n) == data.key(i) and keyed.key(i - n) == keyed.key(i)
        assert plain_keyed.key(i - n) == i
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for a dataset of {n} items"):
            data[bad]
        with pytest.raises(IndexError, match=f"index {bad}"):
            plain_keyed.key(bad)
