"""``empty_weights``: build a module without memory for its parameters (they go to meta; buffers stay real).

The module is then filled by :func:`~mapoffload.load_checkpoint`, whose views of the file mapping
become its parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["empty_weights"]


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers real.

    Building a 60 GiB model costs nothing: each parameter moves to meta as it
    is registered, before the module's own initialisation runs on it. Buffers
    (position ids, rotary tables, non-persistent ones too) are created as
    usual, so they exist after :func:`load_checkpoint`.
    """
    import torch

    original = torch.nn.Module.register_parameter

    def register_parameter(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(param)
            meta = cls(param.to("meta"), requires_grad=param.requires_grad)
            self._parameters[name] = meta

    torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]
