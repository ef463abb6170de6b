"""Finding a model's repeated block lists (the stacks worth streaming), by structure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..memory.regions import tensor_bytes

if TYPE_CHECKING:
    import torch

MIN_BLOCKS = 2


def _param_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += tensor_bytes(p)
    return total


def _no_split_names(model: torch.nn.Module) -> set[str]:
    names: set[str] = set()
    for m in model.modules():  # composite models (CLIP, Llava) declare them per tower too
        names.update(str(n) for n in (getattr(m, "_no_split_modules", None) or ()))
    return names


def _is_block(module: torch.nn.Module) -> bool:
    """A block is a module built of modules (a decoder layer), not a leaf (a Linear, an activation)."""
    return next(module.children(), None) is not None


def find_block_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The model's stacks: ``(path, ModuleList)`` of repeated blocks, in model order.

    A stack is a ``ModuleList`` (or ``Sequential``) of at least two blocks —
    modules built of modules — that holds parameters and is not nested in
    another stack. Blocks may be of several classes (a hybrid's attention and
    Mamba layers in one list). When the model declares ``_no_split_modules``
    (transformers; composite models per tower), lists whose blocks are all of
    those classes are preferred. Every stack found counts, whatever its share
    of the bytes (embedding tables may be larger than all blocks together);
    an empty answer means the model has no stack (it is then placed whole, or
    streamed module by module, by :func:`mapoffload.offload`).
    """
    import torch

    no_split = _no_split_names(model)
    candidates: list[tuple[str, torch.nn.Module]] = []
    for path, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < MIN_BLOCKS:
            continue
        if any(path.startswith(p + ".") for p, _ in candidates):
            continue  # nested inside a stack already found
        if not all(_is_block(m) for m in module) or _param_bytes(module) == 0:
            continue
        candidates.append((path, module))
    if no_split:
        preferred = [(p, m) for p, m in candidates if all(type(b).__name__ in no_split for b in m)]
        if preferred:
            candidates = preferred
    return candidates
