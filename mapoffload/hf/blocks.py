"""Finding a model's repeated block lists (the stacks worth streaming)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A stack must hold at least this share of the model's parameter bytes (all
# stacks together), and have at least this many blocks.
MIN_SHARE = 0.5
MIN_BLOCKS = 2


def _param_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _no_split_names(model: torch.nn.Module) -> set[str]:
    names = getattr(model, "_no_split_modules", None) or ()
    return {str(n) for n in names}


def find_block_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The model's stacks: ``(path, ModuleList)`` of same-class blocks, in model order.

    A stack is a ``ModuleList`` (or ``Sequential``) of at least two modules of
    one class, not nested in another stack. When the model declares
    ``_no_split_modules`` (transformers), lists of those classes are preferred;
    otherwise every such list counts. The stacks must hold at least half of the
    model's parameter bytes, or none is returned.
    """
    import torch

    no_split = _no_split_names(model)
    candidates: list[tuple[str, torch.nn.Module]] = []
    for path, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < MIN_BLOCKS:
            continue
        classes = {type(m) for m in module}
        if len(classes) != 1:
            continue
        if any(path.startswith(p + ".") for p, _ in candidates):
            continue  # nested inside a stack already found
        if _param_bytes(module) == 0:
            continue
        candidates.append((path, module))
    if no_split:
        preferred = [(p, m) for p, m in candidates if type(m[0]).__name__ in no_split]
        if preferred:
            candidates = preferred
    total = _param_bytes(model)
    held = sum(_param_bytes(m) for _, m in candidates)
    if not candidates or total == 0 or held < MIN_SHARE * total:
        return []
    return candidates
