"""Under FSDP2, do frozen parameters leave the reduce-scatter and the all-gather?

Bytes reduce-scattered and all-gathered per step, plain FSDP2 against Egeria under
FSDP2: 2 ranks over gloo on this machine's CPU, a 6-layer Transformer LM
(``egeria.models.TransformerLM``, d_model 128, vocabulary 1000, 64 tokens, batch 8 per
rank) sharded with ``fully_shard`` per layer and at the root, as FSDP2 users do.

Egeria's policy is the static one (the first K layer modules freeze at a fixed step), so
both arms train the same batches from the same weights and the Egeria arm freezes the
same modules at the same step on any machine: the point is what a freeze does to FSDP2's
communication, not when a rule freezes. Egeria's own rule is refused under FSDP2
(``egeria.distributed.check_fsdp2_policy``). Bytes are counted through FSDP2's public
custom-collective hooks (``set_custom_reduce_scatter``, ``set_custom_all_gather``):
a reduce-scatter's input (the unsharded gradients, padded to the world size) and an
all-gather's output (the unsharded parameters), on rank 0.

    .venv/bin/python benchmarks/fsdp2_bytes.py [--steps 12] [--freeze-at 4] [--frozen 4]

Writes ``benchmarks/results/fsdp2/bytes.json`` and prints the command, the machine and the
ratios. Bytes only: the step times of 2 ranks sharing a busy 2-core CPU measure nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
VOCAB, LENGTH, BATCH = 1000, 64, 8


def _counting(model: torch.nn.Module, counts: dict[str, int]) -> None:
    """Counts every reduce-scatter's input and all-gather's output bytes into ``counts``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            counts["reduce_scattered"] += input_tensor.numel() * input_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    class AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            counts["all_gathered"] += output_tensor.numel() * output_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, group, async_op)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(ReduceScatter())
            module.set_custom_all_gather(AllGather())


def _arm(rank: int, world: int, arm: str, args: dict) -> dict:
    import egeria
    from egeria.models import TransformerLM
    from egeria.models.transformer_lm import next_token_loss
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TransformerLM(VOCAB, d_model=128, n_heads=4, n_layers=6, d_ff=512, max_len=LENGTH, dropout=0.0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    counts = {"reduce_scattered": 0, "all_gathered": 0}
    _counting(model, counts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eg = None
    if arm == "egeria":
        config = egeria.EgeriaConfig(policy="static", policy_options={"count": args["frozen"], "at_step": args["freeze_at"]})
        eg = egeria.Egeria(model, opt, config=config)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches, the same in both arms
    rows = []
    for step in range(args["steps"]):
        tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
        counts.update(reduce_scattered=0, all_gathered=0)
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if eg is not None:
            eg.step(loss)
        rows.append({"step": step + 1, **counts, "loss": float(loss.detach())})
    result = {
        "rows": rows,
        "frozen": list(eg.frozen) if eg is not None else [],
        "modules": eg.modules if eg is not None else [],
        "trainable_bytes_after": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    if eg is not None:
        eg.close()
    return result


def _worker(rank: int, world: int, init: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    arms = {arm: _arm(rank, world, arm, args) for arm in ("plain", "egeria")}  # one start of the ranks for both
    if rank == 0:
        Path(out).write_text(json.dumps(arms))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--freeze-at", type=int, default=4)
    parser.add_argument("--frozen", type=int, default=4, help="leading layer modules the static policy freezes")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fsdp2/bytes.json"))
    args = parser.parse_args()
    if args.steps <= args.freeze_at + 1:
        parser.error(f"--steps {args.steps} leaves no step after the freeze at --freeze-at {args.freeze_at}")
    from egeria.bench.machine import describe_machine

    command = " ".join([".venv/bin/python", "benchmarks/fsdp2_bytes.py", *sys.argv[1:]])
    machine = describe_machine()
    print(command)
    print(machine)
    settings = {"steps": args.steps, "freeze_at": args.freeze_at, "frozen": args.frozen, "world": 2,
                "model": f"TransformerLM(vocab {VOCAB}, d_model 128, 6 layers, d_ff 512), {LENGTH} tokens x {BATCH}"}
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/arms.json"
        mp.spawn(_worker, args=(2, f"{tmp}/init", settings, out), nprocs=2, join=True)
        arms = json.loads(Path(out).read_text())
    summary = {}
    for arm, result in arms.items():
        rows = [r for r in result["rows"] if r["step"] > args.freeze_at]  # the freeze applies after its step
        summary[arm] = {
            "reduce_scattered_per_step_after_freeze": statistics.mean(r["reduce_scattered"] for r in rows),
            "all_gathered_per_step_after_freeze": statistics.mean(r["all_gathered"] for r in rows),
            "trainable_bytes_after": result["trainable_bytes_after"],
            "frozen": result["frozen"],
        }
    plain, eg = summary["plain"], summary["egeria"]
    ratios = {
        "reduce_scattered": eg["reduce_scattered_per_step_after_freeze"] / plain["reduce_scattered_per_step_after_freeze"],
        "all_gathered": eg["all_gathered_per_step_after_freeze"] / plain["all_gathered_per_step_after_freeze"],
        "trainable": eg["trainable_bytes_after"] / plain["trainable_bytes_after"],
    }
    before = [r for r in arms["egeria"]["rows"] if r["step"] <= args.freeze_at]
    same_before = before == [r for r in arms["plain"]["rows"] if r["step"] <= args.freeze_at]
    print(f"{'arm':8} {'reduce-scattered/step':>22} {'all-gathered/step':>18}  frozen")
    for arm, s in summary.items():
        print(f"{arm:8} {s['reduce_scattered_per_step_after_freeze']:>22.0f} "
              f"{s['all_gathered_per_step_after_freeze']:>18.0f}  {s['frozen']}")
    print(f"after the freeze, Egeria's share of plain FSDP2's bytes: reduce-scattered {ratios['reduce_scattered']:.1%}, "
          f"all-gathered {ratios['all_gathered']:.1%}; trainable parameters {ratios['trainable']:.1%}")
    print(f"steps before the freeze identical in both arms (bytes and loss): {same_before}")
    print("bytes only: step times of 2 ranks on this busy 2-core CPU are not a measurement")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": command, "machine": machine, "settings": settings,
                                          "summary": summary, "ratios": ratios, "same_before_freeze": same_before,
                                          "arms": arms}, indent=1))


if __name__ == "__main__":
    main()
