"""Why a load's bytes are not on the file mapping: :class:`CopyReason`, the keys of
:attr:`LoadReport.copied <mapoffload.LoadReport.copied>`.

One type for every place that names a copy: the report's ``copied`` dict and its log line,
:func:`~mapoffload.load_checkpoint`, the Hugging Face loaders' reports and ``summary()``. A member
is a ``str`` whose value is the text users see (``"copies fit (gate)"``), so ``report.copied`` stays
a dict of reason -> bytes that compares, looks up and serialises as the plain strings.
"""

from __future__ import annotations

import enum

__all__ = ["CopyReason"]


class CopyReason(str, enum.Enum):
    """Why bytes were copied rather than left on the file mapping."""

    DTYPE = "dtype"  # converted to the module's dtype
    DEVICE = "device"  # moved to a device other than the CPU
    COLUMN_SLICE = "column slice"  # a rank's slice strided in the file: no view can be it
    GATE = "copies fit (gate)"  # keep_mapping=None: the gate found host copies fit
    ASKED = "keep_mapping=False"  # the caller asked for copies
    NOT_MAPPED = "not mapped"  # the checkpoint's own tensor was not on a file mapping
    INITIALISED_BY_TRANSFORMERS = "initialised by transformers (not in the checkpoint)"
    INITIALISED_BY_DIFFUSERS = "initialised by diffusers (not in the checkpoint)"
    MADE_BY_TRANSFORMERS = "made by transformers after loading"
    MADE_BY_DIFFUSERS = "made by diffusers after loading"

    # The value, as the plain string would print (Enum's own str/format give "CopyReason.GATE").
    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    @classmethod
    def of_decision(cls, decided_by: str) -> CopyReason:
        """The reason for copies the load's decision made: the gate's (``"gate"``) or the caller's."""
        return cls.GATE if decided_by == "gate" else cls.ASKED

    @classmethod
    def initialised_by(cls, maker: str) -> CopyReason:
        """Tensors ``maker`` (``"transformers"`` or ``"diffusers"``) initialised: not in the checkpoint."""
        return cls(f"initialised by {maker} (not in the checkpoint)")

    @classmethod
    def made_by(cls, maker: str) -> CopyReason:
        """Tensors ``maker`` made after its load (ties, casts, buffers it filled)."""
        return cls(f"made by {maker} after loading")

    @property
    def by_decision(self) -> bool:
        """A copy the load's mapping-or-copies decision made (the gate's or the caller's)."""
        return self in (CopyReason.GATE, CopyReason.ASKED)

    @property
    def words(self) -> str:
        """The reason in a sentence's words (``summary()``)."""
        return _WORDS[self]


_WORDS = {
    CopyReason.DTYPE: "converted to the module's dtype",
    CopyReason.DEVICE: "moved to the device",
    CopyReason.COLUMN_SLICE: "a rank's slice strided in the file",
    CopyReason.GATE: "the gate found host copies fit",
    CopyReason.ASKED: "keep_mapping=False asked for copies",
    CopyReason.NOT_MAPPED: "not on a file mapping",
    CopyReason.INITIALISED_BY_TRANSFORMERS: "initialised by transformers, not in the checkpoint",
    CopyReason.INITIALISED_BY_DIFFUSERS: "initialised by diffusers, not in the checkpoint",
    CopyReason.MADE_BY_TRANSFORMERS: "made by transformers after loading",
    CopyReason.MADE_BY_DIFFUSERS: "made by diffusers after loading",
}
