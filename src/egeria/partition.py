"""Splitting a model into ordered layer modules, the unit Egeria freezes (paper 4.2.1, 6.3).

A *block* is a model part that is not split further: a residual block, a transformer
layer, an embedding, a head. Blocks are found from the module tree (containers and
modules that hold a stack of repeated blocks are opened up), put in *execution* order by
tracing one forward pass, and grouped into *layer modules* of comparable parameter counts.
Every parameter belongs to exactly one layer module; a parameter used by several modules
(tied embeddings and output layer) belongs to the deepest of them, so it stays trainable as
long as any of its users does. The last layer module, the head, is never frozen.

Tied input embeddings (GPT-2, BERT and most language models share the input embedding's
weight with the output layer): a module that reads a deeper module's weight through an
``nn.Embedding`` lookup can still freeze. Its :attr:`LayerModule.detached` lists those
embeddings; while it is frozen, :class:`~egeria.freezing.FrozenPrefix` detaches their
output, so the shared weight gets no gradient through the lookup and trains through its
owner (the head) only. Any other read of a deeper module's parameter (weights shared
across layers) keeps that module, and every module after it, trainable.
"""

from __future__ import annotations

import logging
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from .hooks import mark
from .nested import first_tensor

__all__ = [
    "LayerModule",
    "Partition",
    "find_blocks",
    "chosen_modules",
    "ExecutionTrace",
    "build_partition",
    "check_blocks",
    "partition_model",
    "first_tensor",
]

logger = logging.getLogger(__name__)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# A module is merged into a neighbour when it holds fewer parameters than this share of
# the median module, e.g. a ResNet stem convolution or a final LayerNorm.
_SMALL_SHARE = 0.1


@dataclass
class LayerModule:
    """One freezable unit: consecutive blocks and the parameters they own.

    Attributes:
        name: display name, the block's name or ``"first..last"`` for merged blocks.
        blocks: names of the model's submodules in this unit, in execution order.
        params: names (as in ``model.named_parameters()``) of the parameters it owns.
        num_params: number of scalar parameters it owns.
        detached: names of the ``nn.Embedding`` submodules in its blocks whose weight a
            deeper module owns (a tied input embedding); their output is detached while
            this module is frozen. Derived from the model, not saved.
    """

    name: str
    blocks: list[str]
    params: list[str] = field(default_factory=list)
    num_params: int = 0
    detached: list[str] = field(default_factory=list)

    @property
    def output_block(self) -> str:
        """The block whose output is this module's activation."""
        return self.blocks[-1]


@dataclass
class Partition:
    """The ordered layer modules of a model; the last one is the head.

    Attributes:
        modules: the layer modules in execution order.
        freezable: how many leading modules may ever be frozen. Normally all but the
            head; fewer when a module uses a parameter that a deeper module owns other
            than through an ``nn.Embedding`` lookup (weights shared across layers): that
            module and all after it stay trainable.
        cap: how many leading modules ``EgeriaConfig.max_frozen_flops`` lets freeze while
            they still move; the modules after them, up to ``freezable``, freeze only once
            they no longer move at all (Egeria's rule:
            docs/decisions/041-quiet-modules-pass-the-cap.md). None: no such bound (no cap,
            or a cap that lowered ``freezable`` itself, as a baseline's does).
    """

    modules: list[LayerModule]
    freezable: int = -1
    cap: int | None = None

    def __post_init__(self) -> None:
        if self.freezable < 0:
            self.freezable = len(self.modules) - 1

    @property
    def names(self) -> list[str]:
        """The layer modules' names, in execution order."""
        return [m.name for m in self.modules]

    def __len__(self) -> int:
        return len(self.modules)

    def to_state(self) -> list[dict]:
        """JSON-safe description, enough to rebuild the partition without a forward pass."""
        return [{"name": m.name, "blocks": list(m.blocks), "params": list(m.params)} for m in self.modules]

    @classmethod
    def from_state(cls, model: nn.Module, state: Sequence[dict]) -> Partition:
        """Rebuilds a partition saved by :meth:`to_state`, checking it fits ``model``."""
        named = dict(model.named_modules())
        params = dict(model.named_parameters())
        modules = []
        for entry in state:
            missing = [b for b in entry["blocks"] if b not in named]
            missing += [p for p in entry["params"] if p not in params]
            if missing:
                raise ValueError(f"saved Egeria partition does not fit this model: no {missing[:5]!r}")
            count = sum(params[p].numel() for p in entry["params"])
            modules.append(LayerModule(entry["name"], list(entry["blocks"]), list(entry["params"]), count))
        partition = cls(modules, _freezable(model, modules))
        _check_coverage(model, partition)
        return partition

    def flops(self, block_flops: Mapping[str, float]) -> list[float]:
        """Each layer module's share of ``block_flops`` (a block's :func:`weight_flops` in
        one forward pass, as :class:`ExecutionTrace` counts them): the sum over its blocks."""
        return [sum(block_flops.get(b, 0.0) for b in m.blocks) for m in self.modules]


def partition_model(
    model: nn.Module,
    example_inputs: tuple,
    *,
    example_kwargs: dict | None = None,
    modules: str | Sequence[str] | None = None,
    max_modules: int = 8,
) -> Partition:
    """Splits ``model`` into ordered layer modules, as :class:`~egeria.Egeria` does.

    Runs one forward pass on ``example_inputs`` in eval mode without gradients (the
    training flags are restored after) to learn the execution order.

    Args:
        model: the model to split.
        example_inputs: positional arguments of one forward call, e.g. ``(x,)``.
        example_kwargs: keyword arguments of that call.
        modules: ``EgeriaConfig.modules``: None (automatic), a regex or a list of names.
        max_modules: ``EgeriaConfig.max_modules``.

    Raises:
        ValueError: bad arguments, or a model that splits into fewer than two modules.
    """
    from .modes import eval_forward

    if not isinstance(example_inputs, tuple):
        raise ValueError(
            f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}; "
            "write example_inputs=(x,)"
        )
    blocks = find_blocks(model, modules)
    check_blocks(model, blocks)
    trace = ExecutionTrace(model, blocks)
    try:
        with eval_forward(model):
            model(*example_inputs, **(example_kwargs or {}))
    finally:
        trace.remove()
    return build_partition(
        model, blocks, trace.order, max_modules=max_modules, user_chosen=chosen_modules(model, modules)
    )


def check_blocks(model: nn.Module, blocks: Sequence[str]) -> None:
    """Raises ValueError unless at least two blocks hold parameters (the head never freezes)."""
    weighted = [b for b in blocks if any(True for _ in model.get_submodule(b).parameters())]
    if len(weighted) < 2:
        raise ValueError(
            f"the model has a single layer module ({weighted!r}); the head is never frozen, "
            "so Egeria has nothing to freeze; name the modules with EgeriaConfig.modules (a list of "
            "submodule names or a regex) if the model wraps its layers"
        )


def find_blocks(model: nn.Module, spec: str | Sequence[str] | None = None) -> list[str]:
    """Names of the model's blocks, in registration order.

    Parameter-free blocks (dropout, pooling, activations) are listed too: they join the
    layer module they run in, so freezing that module also fixes their train/eval mode.

    Args:
        model: the training model.
        spec: ``None`` for automatic blocks; a regular expression or a list of module
            names that the user wants as layer modules (see :class:`EgeriaConfig`).

    Raises:
        ValueError: a name that is not a submodule, a regex that matches nothing, or
            chosen modules that nest inside each other; the message lists what exists.
    """
    chosen = chosen_modules(model, spec)
    blocks: list[str] = []

    def visit(prefix: str, module: nn.Module, is_root: bool) -> None:
        if prefix in chosen:
            blocks.append(prefix)
            return
        holds_chosen = any(c.startswith(prefix + ".") for c in chosen)
        if is_root or holds_chosen or isinstance(module, _CONTAINERS) or _holds_stack(module):
            for child_name, child in module.named_children():
                visit(f"{prefix}.{child_name}" if prefix else child_name, child, False)
        else:
            blocks.append(prefix)  # parameter-free blocks (dropout, pooling) run inside a module

    visit("", model, True)
    return blocks


def chosen_modules(model: nn.Module, spec: str | Sequence[str] | None) -> set[str]:
    """The module names the user's ``EgeriaConfig.modules`` picks (empty for automatic)."""
    if spec is None:
        return set()
    named = {name: m for name, m in model.named_modules() if name}
    available = [n for n, m in named.items() if _num_params(m) > 0]
    if isinstance(spec, str):
        pattern = re.compile(spec)
        matched = [n for n in available if pattern.fullmatch(n)]
        if not matched:
            raise ValueError(
                f"EgeriaConfig.modules={spec!r} matches no module; available names: {_shorten(available)}"
            )
        # Keep only the outermost matches: a match inside another match is part of it.
        outer = [n for n in matched if not any(n.startswith(o + ".") for o in matched if o != n)]
        return set(outer)
    unknown = [n for n in spec if n not in named]
    if unknown:
        raise ValueError(
            f"EgeriaConfig.modules names {unknown!r}, not submodules of the model; "
            f"available names: {_shorten(available)}"
        )
    empty = [n for n in spec if _num_params(named[n]) == 0]
    if empty:
        raise ValueError(f"EgeriaConfig.modules names {empty!r}, which hold no parameters")
    nested = [(a, b) for a in spec for b in spec if a != b and b.startswith(a + ".")]
    if nested:
        raise ValueError(f"EgeriaConfig.modules names modules inside each other: {nested[0]!r}")
    return set(spec)


def _shorten(names: list[str], limit: int = 40) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _holds_stack(module: nn.Module) -> bool:
    """Whether some container under ``module`` holds two or more blocks of one class."""
    for sub in module.modules():
        if not isinstance(sub, _CONTAINERS):
            continue
        kinds = [type(c) for c in sub.children() if any(True for _ in c.children())]
        if any(kinds.count(k) >= 2 for k in set(kinds)):
            return True
    return False


class ExecutionTrace:
    """Records the order in which blocks first run during one forward pass, and the
    multiply-adds of each block's weights in it (:func:`weight_flops`).

    Args:
        model: the model whose blocks are watched.
        blocks: names of the blocks to watch.
    """

    def __init__(self, model: nn.Module, blocks: Sequence[str]) -> None:
        self.order: list[str] = []
        self.flops: dict[str, float] = {}
        named = dict(model.named_modules())
        self._handles = [mark(named[b].register_forward_pre_hook(self._seen(b))) for b in blocks]
        for b in blocks:
            for leaf in named[b].modules():
                if _matrix_weight(leaf) is not None:
                    self._handles.append(mark(leaf.register_forward_hook(self._counted(b))))

    def _counted(self, block: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.flops[block] = self.flops.get(block, 0.0) + weight_flops(module, output)

        return hook

    @property
    def active(self) -> bool:
        """True until :meth:`remove`: the order may still grow."""
        return bool(self._handles)

    def _seen(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if name not in self.order:
                self.order.append(name)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _matrix_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight of a layer that multiplies its input by a matrix or convolves it (a
    weight of two or more dimensions); None for lookups (embeddings) and the rest."""
    weight = getattr(module, "weight", None)
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or not isinstance(weight, torch.Tensor):
        return None
    return weight if weight.dim() >= 2 else None


def weight_flops(module: nn.Module, output: Any) -> float:
    """The multiply-adds (x2) of ``module``'s weight in the call that gave ``output``: each
    weight entry is used once per output position (a linear layer's rows, a convolution's
    pixels), so 2 x the weight's size x the output's size / its channels. The backward
    pass computes about twice as much on the same weights, so the shares of this count
    are the shares of the backward's matrix work that freezing a module saves."""
    weight = _matrix_weight(module)
    tensor = output if isinstance(output, torch.Tensor) else None
    if weight is None or tensor is None or tensor.dim() == 0:
        return 0.0
    channels = tensor.shape[1] if isinstance(module, nn.modules.conv._ConvNd) and tensor.dim() > 1 else tensor.shape[-1]
    return 2.0 * weight.numel() * tensor.numel() / max(int(channels), 1)


def leading_within(sizes: Sequence[float], share: float, limit: int) -> int:
    """How many of the first ``limit`` entries of ``sizes`` together hold at most ``share``
    of their sum over all of ``sizes``."""
    total = sum(sizes)
    count, running = 0, 0.0
    for size in sizes[:limit]:
        running += size
        if running > share * total:
            break
        count += 1
    return count


def build_partition(
    model: nn.Module,
    blocks: Sequence[str],
    executed: Sequence[str],
    *,
    max_modules: int,
    user_chosen: Iterable[str] = (),
) -> Partition:
    """Groups blocks into ordered layer modules.

    Args:
        model: the training model.
        blocks: every block (see :func:`find_blocks`).
        executed: the blocks in the order they ran in one forward pass; blocks that did
            not run go into the head, which is never frozen.
        max_modules: at most this many automatic modules.
        user_chosen: modules named by the user; each starts its own layer module, other
            blocks join the chosen module before them (or the first one), and blocks after
            the last chosen module form the head.

    Returns:
        The partition; every parameter of ``model`` is owned by exactly one module.
    """
    ordered = [b for b in executed if b in set(blocks)]
    not_run = [b for b in blocks if b not in set(ordered)]
    if not_run:
        logger.info("blocks not run in the traced forward pass join the head: %s", not_run)
    chosen = set(user_chosen)
    owner = _param_owners(model, ordered + not_run)
    counts = {b: 0 for b in ordered + not_run}
    names = _canonical_param_names(model)
    for pid, block in owner.items():
        counts[block] += names[pid][1]

    if chosen:
        groups = _group_by_choice(ordered, chosen)
    else:
        groups = _group_by_size([b for b in ordered if counts[b] > 0], counts, max_modules)
        # Blocks whose parameters all belong to deeper modules run inside the module they sit in.
        groups = _reattach_empty(ordered, groups)
        groups = _lookups_join_next(model, groups, counts)
    if not_run:
        groups[-1].extend(not_run)
    if len(groups) < 2:
        raise ValueError(
            f"the model has a single layer module ({[b for g in groups for b in g]!r}); "
            "the head is never frozen, so Egeria has nothing to freeze"
        )
    labels = [next((b for b in g if b in chosen), None) or _group_name(g) for g in groups]
    return _assemble(model, groups, labels, owner, names)


def _param_owners(model: nn.Module, blocks_in_order: Sequence[str]) -> dict[int, str]:
    """Maps each parameter (by id) to the deepest block using it; loose parameters owned
    by opened-up modules go to the first block that runs under that module."""
    named = dict(model.named_modules())
    owner: dict[int, str] = {}
    for block in blocks_in_order:
        for p in named[block].parameters():
            owner[id(p)] = block  # later (deeper) users overwrite earlier ones
    for mod_name, module in named.items():
        for p in module.parameters(recurse=False):
            if id(p) in owner:
                continue
            under = [b for b in blocks_in_order if not mod_name or b.startswith(mod_name + ".")]
            owner[id(p)] = under[0] if under else blocks_in_order[-1]
    return owner


def _canonical_param_names(model: nn.Module) -> dict[int, tuple[str, int]]:
    return {id(p): (name, p.numel()) for name, p in model.named_parameters()}


def _group_by_size(blocks: list[str], counts: dict[str, int], max_modules: int) -> list[list[str]]:
    """Merges the smallest group into its smaller neighbour until no group is tiny next to
    the median and at most ``max_modules`` remain, keeping at least two groups."""
    groups = [[b] for b in blocks]

    def size(g: list[str]) -> int:
        return sum(counts[b] for b in g)

    while len(groups) > 2:  # never merge down to a lone head
        sizes = [size(g) for g in groups]
        median = statistics.median(sizes)
        smallest = min(range(len(groups)), key=lambda i: (sizes[i], i))
        if len(groups) <= max_modules and sizes[smallest] >= _SMALL_SHARE * median:
            break
        if smallest == 0:
            other = 1
        elif smallest == len(groups) - 1:
            other = smallest - 1
        else:
            other = smallest - 1 if sizes[smallest - 1] <= sizes[smallest + 1] else smallest + 1
        lo, hi = sorted((smallest, other))
        groups[lo:hi + 1] = [groups[lo] + groups[hi]]
    return groups


def _reattach_empty(ordered: list[str], groups: list[list[str]]) -> list[list[str]]:
    """Puts blocks that own no parameters back into the group they run in."""
    placed = {b for g in groups for b in g}
    result = [list(g) for g in groups]
    index_of = {b: i for i, g in enumerate(result) for b in g}
    current = 0
    for block in ordered:
        if block in placed:
            current = index_of[block]
        else:
            result[current].append(block)
    # Keep each group's blocks in execution order.
    position = {b: i for i, b in enumerate(ordered)}
    return [sorted(g, key=lambda b: position[b]) for g in result]


def _lookups_join_next(model: nn.Module, groups: list[list[str]], counts: dict[str, int]) -> list[list[str]]:
    """A leading module of embedding lookups alone (an LM's token embedding) joins the module
    after it. On its own it would be watched first, and a lookup table has no FLOPs to save
    and sparse updates (rare tokens move until the end), so every layer behind it would
    wait for it; joined, it freezes when the first layer's output, which it feeds, settles."""
    named = dict(model.named_modules())

    def lookups_only(group: list[str]) -> bool:
        return all(isinstance(named[b], nn.Embedding) or counts.get(b, 0) == 0 for b in group)

    groups = [list(g) for g in groups]
    while len(groups) > 2 and lookups_only(groups[0]):
        groups[0:2] = [groups[0] + groups[1]]
    return groups


def _group_by_choice(ordered: list[str], chosen: set[str]) -> list[list[str]]:
    groups: list[list[str]] = []
    pending: list[str] = []  # unchosen blocks since the last chosen one
    for block in ordered:
        if block not in chosen:
            pending.append(block)
        elif not groups:
            groups.append(pending + [block])  # leading blocks join the first chosen module
            pending = []
        else:
            groups[-1].extend(pending)  # blocks between chosen modules join the one before
            groups.append([block])
            pending = []
    if not groups:
        return [pending]
    if pending:
        groups.append(pending)  # blocks after the last chosen module form the head
    return groups


def _assemble(
    model: nn.Module,
    groups: list[list[str]],
    labels: list[str],
    owner: dict[int, str],
    names: dict[int, tuple[str, int]],
) -> Partition:
    group_of = {b: i for i, g in enumerate(groups) for b in g}
    modules = [LayerModule(label, list(g)) for label, g in zip(labels, groups)]
    for pid, block in owner.items():
        if pid not in names:
            continue
        name, count = names[pid]
        module = modules[group_of[block]]
        module.params.append(name)
        module.num_params += count
    partition = Partition(modules, _freezable(model, modules))
    _check_coverage(model, partition)
    return partition


def _freezable(model: nn.Module, modules: list[LayerModule]) -> int:
    """Leading modules that can freeze; also fills each module's ``detached`` embeddings.

    A module whose blocks read a parameter owned by a deeper module through an
    ``nn.Embedding`` lookup (a tied input embedding) can freeze: the lookup's output is
    detached while it is frozen. Any other read (weights shared across layers) means it must
    keep training with the owner; the frozen set is a prefix, so the modules after it stay
    trainable too."""
    named = dict(model.named_parameters())
    owner = {id(named[p]): index for index, module in enumerate(modules) for p in module.params}
    for index, module in enumerate(modules[:-1]):
        module.detached, deeper = _deeper_reads(model, module, owner, index)
        if deeper:
            logger.warning(
                "layer module %s shares parameters with %s (tied weights): it and the modules after it "
                "stay trainable; untie the weights or choose EgeriaConfig.modules to freeze more",
                module.name,
                modules[deeper[0]].name,
            )
            return index
        if module.detached:
            logger.info(
                "layer module %s reads a tied weight through %s: when it is frozen the lookup is detached "
                "and the weight trains through its owner only",
                module.name,
                ", ".join(module.detached),
            )
    return len(modules) - 1


def _deeper_reads(
    model: nn.Module, module: LayerModule, owner: dict[int, int], index: int
) -> tuple[list[str], list[int]]:
    """How ``module`` (at ``index``) reads parameters that deeper modules own.

    Returns:
        The ``nn.Embedding`` submodules whose weight a deeper module owns (their output can
        be detached), and the indices of the deeper modules read any other way.
    """
    embeddings: list[str] = []
    others: set[int] = set()
    for block in module.blocks:
        for sub_name, sub in model.get_submodule(block).named_modules():
            for param_name, p in sub.named_parameters(recurse=False):
                deeper = owner.get(id(p), index)
                if deeper <= index:
                    continue
                # max_norm renormalises the weight in place during the lookup: not a pure read.
                if isinstance(sub, nn.Embedding) and param_name == "weight" and sub.max_norm is None:
                    embeddings.append(f"{block}.{sub_name}" if sub_name else block)
                else:
                    others.add(deeper)
    return embeddings, sorted(others)


def _group_name(blocks: list[str]) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]}..{blocks[-1]}"


def _check_coverage(model: nn.Module, partition: Partition) -> None:
    seen: dict[str, str] = {}
    for module in partition.modules:
        for p in module.params:
            if p in seen:
                raise AssertionError(f"parameter {p} is in both {seen[p]} and {module.name}")
            seen[p] = module.name
    missing = [n for n, _ in model.named_parameters() if n not in seen]
    if missing:
        raise AssertionError(f"parameters in no layer module: {missing[:5]}")
