"""Where each state-dict name lives in a module: its owner and attribute, and the tie groups.

:func:`load_checkpoint <mapoffload.load_checkpoint>` assigns a loaded tensor to every name of its
group at once (names sharing one tensor object: tied embeddings), straight into the owner's
``_parameters`` / ``_buffers``; non-persistent buffers are no names of the state dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Site", "module_sites"]


@dataclass
class Site:
    """Where one state-dict name lives in the module."""

    owner: Any
    attr: str
    is_param: bool
    current: Any


def module_sites(module: torch.nn.Module) -> tuple[dict[str, Site], list[list[str]]]:
    """Every parameter and persistent buffer by name, and tie groups (names
    sharing one tensor object)."""
    sites: dict[str, Site] = {}
    groups: dict[int, list[str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in sub._parameters.items():
            if p is None:
                continue
            sites[dot + name] = Site(sub, name, True, p)
            groups.setdefault(id(p), []).append(dot + name)
        for name, b in sub._buffers.items():
            if b is None or name in sub._non_persistent_buffers_set:
                continue
            sites[dot + name] = Site(sub, name, False, b)
            groups.setdefault(id(b), []).append(dot + name)
    return sites, list(groups.values())
