"""Egeria under torchrun DDP: 2 CPU ranks over gloo (torch.multiprocessing), one decision
source, identical replicas, frozen parameters out of the all-reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ddp_workers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _spawn(worker, tmp_path, world: int = 2) -> list[dict]:
    mp.spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_ddp_freeze_resume_unfreeze_keeps_replicas_identical_and_skips_frozen_all_reduce(tmp_path):
    ranks = _spawn(ddp_workers.freeze_resume_unfreeze, tmp_path)
    zero, one = ranks
    # One decision source: the same events, at the same steps, on both ranks.
    assert [e for e in zero["events"] if e["action"] != "guided"] == [
        {**e, "reason": e["reason"].removeprefix("rank 0: ")} for e in one["events"]
    ]
    assert zero["frozen_at_checkpoint"] and zero["frozen_at_checkpoint"] == one["frozen_at_checkpoint"]
    assert zero["frozen_after_resume"] == one["frozen_after_resume"] == zero["frozen_at_checkpoint"]
    for rank in ranks:
        # Frozen weights did not move on any rank while frozen.
        assert rank["frozen_unchanged"]
        # Before the freeze every parameter's gradient is all-reduced; while frozen, only
        # the trainable ones' (so no stale reducer all-reduces them twice); after the
        # unfreeze every parameter's again.
        sent, trainable = rank["bytes"]["before_freeze"]
        assert sent == trainable
        full = trainable
        sent, trainable = rank["bytes"]["frozen"]
        assert sent == trainable < full
        sent, trainable = rank["bytes"]["resumed"]
        assert sent == trainable < full
        assert [(d["action"]) for d in rank["unfreeze"]] == ["unfreeze"]
        assert rank["bytes"]["unfrozen"] == (full, full, full)
    assert torch.equal(zero["weights"], one["weights"])  # replicas bit-identical at the end


def test_a_builtin_communication_hook_is_registered_again_after_a_rebuild(tmp_path):
    zero, one = _spawn(ddp_workers.builtin_hook_survives_a_rebuild, tmp_path)
    for rank in (zero, one):
        assert rank["frozen"]  # the static policy froze at step 2: DDP was rebuilt
        assert rank["fp16_grads"] == [True] * 5  # every step's gradients crossed in fp16
    assert torch.equal(zero["weights"], one["weights"])
