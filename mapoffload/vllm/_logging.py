"""The library's log lines in vLLM's output."""

from __future__ import annotations

import logging


def share_vllm_handlers() -> None:
    """Let the library's log lines show in vLLM's output, formatted as vLLM's own (when the
    application configured no handler for the ``mapoffload`` logger)."""
    ours = logging.getLogger("mapoffload")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = not theirs.handlers
