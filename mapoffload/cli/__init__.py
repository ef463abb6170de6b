"""The ``mapoffload`` command (``inspect``, ``demo``, ``convert``; also ``python -m mapoffload``)."""

from __future__ import annotations

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
