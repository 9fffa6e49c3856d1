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
    """Runs ``worker`` (a function of ddp_workers) on ``world`` ranks; a rank that fails
    shows its standard error in the test's failure."""
    try:
        mp.spawn(ddp_workers.run, args=(world, str(tmp_path / "init"), str(tmp_path), worker.__name__),
                 nprocs=world, join=True)
    except mp.ProcessExitedException.__mro__[1] as err:  # ProcessException: exited or raised
        logs = {r: (tmp_path / f"rank{r}.err").read_text()[-4000:] for r in range(world) if (tmp_path / f"rank{r}.err").exists()}
        raise AssertionError(f"{err}\n" + "\n".join(f"--- rank {r} stderr:\n{text}" for r, text in logs.items())) from err
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


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


def test_a_load_on_one_rank_only_stops_every_rank_with_what_differs(tmp_path):
    zero, one = _spawn(ddp_workers.a_load_on_one_rank_only, tmp_path)
    assert zero["frozen_before"] == one["frozen_before"] != []  # the static freeze applied on both
    for rank in (zero, one):
        assert rank["error"] == "RanksDisagree", rank
        assert "rank 1's step count is 7, rank 0's is 3" in rank["message"]
        assert "load the same Egeria checkpoint on every rank" in rank["message"]


def test_ranks_with_different_models_stop_at_the_first_step_with_what_differs(tmp_path):
    for rank in _spawn(ddp_workers.a_rank_with_another_model, tmp_path):
        assert rank["error"] == "RanksDisagree", rank
        assert "rank 1's layer modules is" in rank["message"] and "(12, 8)" in rank["message"]


@pytest.mark.slow
def test_a_rank_that_stops_calling_step_is_named_instead_of_hanging(tmp_path):
    zero, one = _spawn(ddp_workers.a_rank_that_stops_stepping, tmp_path)
    assert zero["error"] == "RuntimeError", zero
    assert "eg.step()" in zero["message"] and "every rank" in zero["message"]
    assert one["error"] is None


def test_freezing_to_the_average_gives_every_rank_the_same_weights_and_statistics(tmp_path):
    zero, one = _spawn(ddp_workers.freeze_to_average, tmp_path)
    assert zero["frozen"] == one["frozen"] == ["stem.0", "stem.1..stem.2"]
    # the stem froze at step 3, its BatchNorm re-estimated on the next 10 batches (each rank's own)
    assert zero["settled"] == one["settled"] == [0, 0] + [1] * 10 + [2] * 4
    assert torch.equal(zero["weights"], one["weights"])
    assert torch.equal(zero["buffers"], one["buffers"])


def test_releasing_optimizer_state_under_ddp_changes_no_bit_through_a_resume_and_an_unfreeze(tmp_path):
    zero, one = _spawn(ddp_workers.optimizer_state_release, tmp_path)
    for rank in (zero, one):
        release, keep = rank["release"], rank["keep"]
        assert release["events"] == keep["events"] == ["unfreeze", "freeze"]
        assert release["held_while_frozen"] == release["held_after_resume"] == 0  # out of the optimizer
        assert keep["held_while_frozen"] > 0
        assert torch.equal(release["weights"], keep["weights"])
        assert torch.equal(release["state"], keep["state"])
    assert torch.equal(zero["release"]["weights"], one["release"]["weights"])
