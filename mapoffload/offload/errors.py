"""Errors of the offload parts that more than one of them raises, and the calls their messages name
(no imports of torch: any part may use them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallNames", "ReplacedWeightError"]


class ReplacedWeightError(ValueError):
    """A weight of an offloaded layer was replaced by something its manager cannot compute with
    (another shape, dtype or device, a meta or offloaded tensor, a weight tied in some of its places
    only, or none): raised by the next forward (or ``register_forward_hooks``), naming the weight."""


@dataclass(frozen=True)
class CallNames:
    """What the placeholders' errors tell a user to call, as the entry point that made the manager
    names them (a manager's ``calls``): ``close`` gives the model back
    (``"model.mapoffload_handle.close()"`` after from_pretrained), ``reload`` (with ``{dtype}``)
    loads it in another dtype. None for a manager made directly."""

    close: str | None = None
    reload: str | None = None
