"""Egeria over FSDP2 (``fully_shard``): 2 CPU ranks over gloo (torch.multiprocessing), one
decision source, frozen parameters out of the reduce-scatter, a frozen prefix without
autograd, rank 0's BatchNorm statistics in frozen modules, DCP resume, Egeria's rule on
gathered weights, the activation cache served where every rank can; FSDP1 and the other
policies that read the model refused with what works."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fsdp_workers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _moves(run: dict) -> list[tuple]:
    """A run's decisions as (step, action, modules), without their reasons."""
    return [(e["step"], e["action"], e["modules"]) for e in run["events"]]


def _weights(steps: list[dict]) -> list:
    """Each step's whole parameters, from a run's per-step records."""
    return [s["weights"] for s in steps]


def _same_weights(a: list, b: list) -> None:
    """Two runs' whole parameters, step by step: bit-identical, and as many steps."""
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Callable[[str], list]:
    """Runs every scenario of fsdp_workers on 2 ranks, once for this file (starting the
    ranks is the slow part); gives each scenario's records, rank 0's first. A rank that
    fails shows its standard error in every test's failure."""
    out = tmp_path_factory.mktemp("fsdp")
    world = 2
    try:
        mp.spawn(fsdp_workers.run, args=(world, str(out / "init"), str(out), "every_scenario"), nprocs=world, join=True)
    except mp.ProcessExitedException.__mro__[1] as err:  # ProcessException: exited or raised
        logs = {r: (out / f"rank{r}.err").read_text()[-4000:] for r in range(world) if (out / f"rank{r}.err").exists()}
        failure = f"{err}\n" + "\n".join(f"--- rank {r} stderr:\n{text}" for r, text in logs.items())

        def failed(scenario: str) -> list:
            raise AssertionError(failure)

        return failed
    return lambda scenario: [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=True) for r in range(world)]


def test_fsdp2_freezes_and_unfreezes_on_every_rank_and_frozen_parameters_leave_the_reduce_scatter(ranks):
    zero, one = ranks("freeze_unfreeze")
    # One decision source: the same moves at the same steps on both ranks.
    assert _moves(zero) == _moves(one) == [
        (2, "freeze", ["stem.0", "stem.1..stem.2"]), (3, "unfreeze", ["stem.0", "stem.1..stem.2"]),
        (4, "freeze", ["stem.0", "stem.1..stem.2", "blocks.0"])]
    full = zero["all_parameters"]
    for rank in (zero, one):
        for s in rank["steps"]:
            frozen_during = s["step"] in (3, 5)  # after a freeze, before the unfreeze
            # A reduce-scatter takes in exactly the trainable parameters' gradients.
            assert s["reduce_scattered"] == s["trainable"], s
            assert (s["trainable"] < full) == frozen_during, s
            # The frozen prefix ran without autograd (its output needs no gradient).
            assert s["stem_output_needed_grad"] == (not frozen_during), s
        assert rank["stem_unchanged_while_frozen"]
    # With two FSDP units frozen (stem, blocks.0) a step gathers less: the front one is not
    # gathered again for backward. FSDP2's backward prefetch still gathers the unit just
    # before the first trainable one (with the stem alone frozen, no saving).
    assert zero["steps"][4]["all_gathered"] < zero["steps"][1]["all_gathered"]
    # Before the freeze each rank's BatchNorm statistics are its own data's; from the
    # freeze on every rank holds rank 0's, and they stay put while frozen.
    assert not torch.equal(zero["steps"][0]["bn"], one["steps"][0]["bn"])
    for i in (1, 2):  # steps 2 and 3: frozen at the end of step 2
        assert torch.equal(zero["steps"][i]["bn"], one["steps"][i]["bn"])
        assert torch.equal(zero["steps"][i]["bn"], zero["steps"][1]["bn"])
    assert torch.equal(zero["weights"], one["weights"])  # replicas' full parameters bit-identical


def test_fsdp2_resumed_through_dcp_equals_the_uninterrupted_run_unfreeze_included(ranks):
    for rank in ranks("resume_equals_uninterrupted"):
        whole = rank["uninterrupted"]
        assert [(d["step"], d["action"]) for d in whole["decisions"]] == [(2, "freeze"), (3, "unfreeze"), (4, "freeze")]
        for resumed in (rank["resumed"], rank["rolled_back"]):
            assert resumed["frozen_at_save"] == resumed["frozen_after_load"] == ["stem.0", "stem.1..stem.2"]
            assert not any(n.startswith("stem.") for n in resumed["trainable_after_load"])
            # The unfreeze at step 3 and the freeze at step 4 come after the resume, as in the whole run.
            assert [(d["step"], d["action"]) for d in resumed["decisions"]] == [(3, "unfreeze"), (4, "freeze")]
            assert resumed["steps"] == whole["steps"] == 5
            # Bit-identical: the frozen stem's AdamW moments survived the load, so its
            # training after the unfreeze is the uninterrupted run's.
            assert torch.equal(resumed["weights"], whole["weights"])
            # Each rank's shards of the frozen stem's AdamW state were out of the optimizer
            # when saved and again after the load (egeria.optimizer_state).
            assert resumed["held_at_save"] == resumed["held_after_load"] == 0
        # Releasing that state changes no bit: the same run keeping it in the optimizer.
        assert torch.equal(rank["kept"]["weights"], whole["weights"])
        # The rollback loaded into a model whose stem was frozen again (with blocks.0): the
        # optimizer state of every parameter loaded all the same.
        assert rank["rolled_back"]["frozen_before_load"] == ["stem.0", "stem.1..stem.2", "blocks.0"]


def test_lightnings_fsdp2_strategy_freezes_on_every_rank_and_resumes_as_if_uninterrupted(ranks):
    zero, one = ranks("lightning")
    if "skipped" in zero:
        pytest.skip(zero["skipped"])
    stem, three = ["stem.0", "stem.1..stem.2"], ["stem.0", "stem.1..stem.2", "blocks.0"]
    for rank in (zero, one):
        whole, saved, resumed = rank["uninterrupted"], rank["saved"], rank["resumed"]
        assert [(s["step"], s["egeria_steps"], s["frozen"]) for s in whole["steps"]] == [
            (1, 1, []), (2, 2, stem), (3, 3, []), (4, 4, three), (5, 5, three)]
        # The stem did not move in the step it was frozen for (step 3), and moved in the others.
        moved = [not torch.equal(a["stem"], b["stem"]) for a, b in zip(whole["steps"], whole["steps"][1:])]
        assert moved == [True, False, True, False]
        # Saved after step 4 with three modules frozen, resumed by a fresh Trainer: step 5
        # trains with them frozen and ends where the uninterrupted run ended, bit for bit.
        assert [s["frozen"] for s in saved["steps"]][-1] == three
        assert [(s["step"], s["egeria_steps"], s["frozen"]) for s in resumed["steps"]] == [(5, 5, three)]
        assert torch.equal(resumed["steps"][-1]["weights"], whole["steps"][-1]["weights"])
        assert _moves(resumed) == _moves(whole) and resumed["global_step"] == whole["global_step"] == 5
    # Every rank resumes rank 0's record of the decisions, reasons included.
    assert zero["resumed"]["events"] == one["resumed"]["events"] == zero["uninterrupted"]["events"]
    # One decision source, and replicas' full parameters bit-identical at every step.
    assert _moves(zero["uninterrupted"]) == _moves(one["uninterrupted"])
    _same_weights(_weights(zero["uninterrupted"]["steps"]), _weights(one["uninterrupted"]["steps"]))


def test_egerias_rule_under_lightnings_fsdp2_strategy_resumes_as_if_uninterrupted(ranks):
    zero, one = ranks("lightning")
    if "skipped" in zero:
        pytest.skip(zero["skipped"])
    # The same training as the torchrun loop's: the same readings and decisions, bit for bit.
    assert zero["rule"]["history"] == ranks("egeria_rule")[0]["fsdp2"]["history"]
    assert _moves(zero["rule"]) == _moves(ranks("egeria_rule")[0]["fsdp2"])
    for rank in (zero, one):
        whole, resumed = rank["rule"], rank["rule_resumed"]
        # Saved by a Trainer after step 30 (Lightning's checkpoint on every rank), resumed by
        # a fresh one: the same decisions (every rank resumes rank 0's record, with its
        # policy's own "guided"), the same weights bit for bit, rank 0's readings as the
        # uninterrupted run's (they were not without rank 0's buffers in the checkpoint).
        assert [s["frozen"] for s in resumed["steps"]][0] == [s["frozen"] for s in whole["steps"]][fsdp_workers.RULE_SAVE_AT]
        assert [m for m in _moves(resumed) if m[1] != "guided"] == [m for m in _moves(whole) if m[1] != "guided"]
        _same_weights(_weights(resumed["steps"]), _weights(whole["steps"][fsdp_workers.RULE_SAVE_AT:]))
    assert zero["rule_resumed"]["history"] == zero["rule"]["history"]
    assert [m for m in _moves(one["rule"]) if m[1] != "guided"] == [m for m in _moves(zero["rule"]) if m[1] != "guided"]
    _same_weights(_weights(zero["rule"]["steps"]), _weights(one["rule"]["steps"]))


def test_egerias_rule_under_fsdp2_reads_and_decides_as_under_ddp_and_resumes_through_dcp(ranks):
    zero, one = ranks("egeria_rule")
    freezes = [(s, a, m) for s, a, m in _moves(zero["fsdp2"]) if a == "freeze"]
    # The rule froze by its readings, before and after the resume's step.
    assert [s for s, _, _ in freezes] and freezes[0][0] < fsdp_workers.RULE_SAVE_AT < freezes[-1][0], freezes
    # Rank 0 read the whole weights: the same readings, bit for bit, and the same moves as
    # the same training under DDP, whose ranks hold the whole model.
    assert zero["fsdp2"]["history"] == zero["ddp"]["history"] and zero["fsdp2"]["history"]
    assert _moves(zero["fsdp2"]) == _moves(zero["ddp"])
    _same_weights(zero["fsdp2"]["weights"], zero["ddp"]["weights"])
    # One decision source (the "guided" event is rank 0's policy's own), replicas bit-identical.
    assert [m for m in _moves(one["fsdp2"]) if m[1] != "guided"] == [m for m in _moves(zero["fsdp2"]) if m[1] != "guided"]
    _same_weights(zero["fsdp2"]["weights"], one["fsdp2"]["weights"])
    # Saved through DCP and resumed into a fresh model: the rule's state (reference,
    # watches) came back, and the run goes on as the uninterrupted one, readings included.
    for rank in (zero, one):
        assert rank["resumed"]["frozen_after_load"] == ["stem.0"]
        assert _moves(rank["resumed"]) == _moves(rank["fsdp2"])
        _same_weights(rank["resumed"]["weights"], rank["fsdp2"]["weights"])
    assert zero["resumed"]["history"] == zero["fsdp2"]["history"]


def test_egerias_rule_under_the_hf_trainers_fsdp2_saves_on_every_rank_and_resumes_what_rank_0_read(ranks):
    (zero, one), (rule_zero, _) = ranks("hf_callback"), ranks("egeria_rule")
    # Driven through the callback (the loss from the model's output), the rule reads and
    # decides as in the torchrun loop, bit for bit.
    assert zero["uninterrupted"]["history"] == rule_zero["fsdp2"]["history"]
    assert _moves(zero["uninterrupted"]) == _moves(rule_zero["fsdp2"])
    _same_weights(zero["uninterrupted"]["weights"], rule_zero["fsdp2"]["weights"])
    # on_save on every rank, rank 0 alone writing into a folder rank 1 cannot see; the
    # resume loads what rank 0 read on both ranks, and goes on as if uninterrupted.
    assert (zero["resumed"]["saved_by_rank"], one["resumed"]["saved_by_rank"]) == (True, False)
    for rank in (zero, one):
        assert rank["resumed"]["frozen_after_load"] == ["stem.0"]
        assert _moves(rank["resumed"]) == _moves(zero["uninterrupted"])
        _same_weights(rank["resumed"]["weights"], zero["uninterrupted"]["weights"])
    assert zero["resumed"]["history"] == zero["uninterrupted"]["history"]
    # A state only rank 0's check refuses (its policy's part): refused on every rank, and
    # nothing of Egeria's changed on any.
    assert "state.policy_state" in zero["refused"]["said"]
    assert "another rank refused this Egeria state" in one["refused"]["said"]
    for rank in (zero, one):
        assert rank["refused"]["before"] == rank["refused"]["after"]


def test_the_activation_cache_under_fsdp2_serves_where_every_rank_can_and_skips_the_frozen_units_gathers(ranks):
    zero, one = ranks("activation_cache")
    # Served at steps 5, 7 and 8 on both ranks; at step 6 rank 1's batch held samples it
    # had never seen, so rank 0 computed too, though it had the rows.
    for rank in (zero, one):
        assert [s["served"] for s in rank["cached"]["steps"]] == [0, 0, 0, 0, 1, 1, 2, 3]
        for cached, plain in zip(rank["cached"]["steps"], rank["plain"]["steps"], strict=True):
            # Cached forward == full forward: bit-identical weights to the run without the cache.
            assert torch.equal(cached["weights"], plain["weights"])
        gathered = [(c["all_gathered"], p["all_gathered"]) for c, p in zip(rank["cached"]["steps"], rank["plain"]["steps"])]
        for step in (3, 4, 6):  # computed, recording: the same collectives as without the cache
            assert gathered[step - 1][0] == gathered[step - 1][1]
        for step in (7, 8):  # served: the frozen units (stem, blocks.0) were not gathered
            assert gathered[step - 1][0] <= gathered[step - 1][1] - rank["cached"]["frozen_unit_bytes"], gathered
    _same_weights(_weights(zero["cached"]["steps"]), _weights(one["cached"]["steps"]))


def test_fsdp2_freezes_each_rank_to_its_shards_of_the_average_and_resumes_through_dcp_and_hf_as_if_uninterrupted(ranks):
    from fsdp_workers import AVERAGE_STEPS

    zero, one = ranks("averaging")
    for rank in (zero, one):
        whole = rank["uninterrupted"]
        before, after = whole["before"], whole["after"]
        # The stem froze after step 3 to the mean of steps 1-2 and then step 3 at weight
        # 1/2 (span 2), each rank averaging its shards: the whole result is the average of
        # the whole weights (element by element; close, as kernels may round shards apart).
        expected = before[0].clone().lerp_(before[1], 0.5).lerp_(before[2], 0.5)
        assert whole["frozen"][2] == ["stem.0", "stem.1..stem.2"] and whole["frozen"][1] == []
        assert torch.allclose(after[2], expected, rtol=0, atol=1e-6)
        assert not torch.allclose(after[2], before[2], rtol=0, atol=1e-4)  # not the last iterate
        assert all(torch.equal(a, after[2]) for a in after[3:])  # and held from then on
        # The BatchNorm re-estimates on each rank's batches for 10 steps (4-13), then holds.
        assert not torch.equal(whole["bn"][12], whole["bn"][11])
        assert all(torch.equal(b, whole["bn"][12]) for b in whole["bn"][13:])
    # Every rank ends with rank 0's statistics and the same weights.
    assert torch.equal(zero["uninterrupted"]["bn"][-1], one["uninterrupted"]["bn"][-1])
    assert torch.equal(zero["uninterrupted"]["weights"], one["uninterrupted"]["weights"])
    for index, rank in enumerate((zero, one)):
        whole = rank["uninterrupted"]
        for name, stop in (("dcp_2", 2), ("dcp_6", 6), ("hf_6", 6)):
            resumed = rank[name]
            assert resumed["frozen_after_load"] == whole["frozen"][stop - 1], name
            assert len(resumed["after"]) == AVERAGE_STEPS
            # Bit for bit: the averages (step 2) and the re-estimate (step 6) went on as if
            # never interrupted, on the ranks' shards of the saved whole averages.
            for a, b in zip(resumed["after"], whole["after"], strict=True):
                assert torch.equal(a, b), name
            assert torch.equal(resumed["weights"], whole["weights"]), name
            # The statistics too: on rank 0 at every step; on rank 1 once the re-estimate
            # ended (step 13), as the checkpoint holds one rank's buffers (rank 0's) and a
            # resumed rank 1 re-estimates on from them until it takes rank 0's at the end.
            first = 0 if index == 0 or stop < 4 else 12
            for a, b in zip(resumed["bn"][first:], whole["bn"][first:], strict=True):
                assert torch.equal(a, b), name
    assert not torch.equal(one["dcp_6"]["bn"][6], one["uninterrupted"]["bn"][6])  # rank 1 went on from rank 0's


def test_fsdp2_refuses_the_policies_that_read_the_model_on_their_own_naming_what_works(ranks):
    for said in ranks("refusals"):
        for policy in ("autofreeze", "smartfrz"):
            assert said[policy] is not None, policy
            assert f"the {policy!r} policy reads the model's weights or gradients" in said[policy]
            assert "egeria, linear, static, freezeout, none" in said[policy]


def test_fsdp1_is_refused_with_the_fix():
    from torch.distributed.fsdp import FullyShardedDataParallel

    from egeria.wrappers import unwrap

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        with pytest.raises(ValueError, match=r"FullyShardedDataParallel \(FSDP1\).*fully_shard \(FSDP2\)"):
            unwrap(FullyShardedDataParallel(model, device_id=torch.device("cpu")))
        inner = nn.Sequential(FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu")), nn.Linear(4, 2))
        with pytest.raises(ValueError, match="FSDP1"):  # an FSDP1 unit inside a plain module
            unwrap(inner)
    finally:
        dist.destroy_process_group()
