"""Errors of the offload parts that more than one of them raises (no imports: any part may use them)."""

from __future__ import annotations

__all__ = ["ReplacedWeightError"]


class ReplacedWeightError(ValueError):
    """A weight of an offloaded layer was replaced by something its manager cannot compute with
    (another shape, dtype or device, a meta or offloaded tensor, a weight tied in some of its places
    only, or none): raised by the next forward (or ``register_forward_hooks``), naming the weight."""
