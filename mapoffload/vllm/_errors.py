"""Errors of the vLLM load format."""

from __future__ import annotations


class VllmLoadError(ValueError):
    """The mapoffload load format cannot serve this request as asked (the message says why and what to do)."""


class VllmVersionError(VllmLoadError):
    """The installed vLLM is outside the range this load format is tested with (both are named)."""
