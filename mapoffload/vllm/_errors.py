"""Errors of the vLLM load format."""

from __future__ import annotations


class VllmLoadError(ValueError):
    """The mapoffload load format cannot serve this request as asked (the message says why and what to do).

    ``.keys`` names the ``model_loader_extra_config`` keys (and the engine's settings, as
    ``cpu_offload_gb``, and environment variables) the refusal is about, every one given that
    takes part; empty where it is about none.
    """

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


class VllmVersionError(VllmLoadError):
    """The installed vLLM is outside the range this load format is tested with (both are named)."""
