"""``LoadReport``: what :func:`~mapoffload.load_checkpoint` did, and the line it logs.

Bytes left on the file mapping and bytes copied (by reason), the files and tensors, missing and
unexpected keys, who chose between mapping and copies (the gate or the caller), a rank's slices,
fp8 codes and scales, and the tensors a loader converted (``from_pretrained``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._log import format_bytes

__all__ = ["LoadReport"]


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did.

    ``copied`` maps a reason (a :class:`~mapoffload.CopyReason`, a ``str``:
    ``dtype``, ``keep_mapping=False``, ``copies fit (gate)``, ``device``,
    ``column slice``, ``not mapped``, and for ``from_pretrained`` what its
    library made) to the bytes copied for it. The decision's copies are filed
    under one reason, whoever made them (fp8 codes and scales too):
    ``copies fit (gate)`` when the gate decided, ``keep_mapping=False`` when
    the caller did.

    ``decided_by`` says who chose between the mapping and copies: ``"gate"``
    (the caller passed ``keep_mapping=None``; :func:`keep_checkpoint_mapped`
    weighed the bytes against the host; the same in ``from_pretrained`` and
    the vLLM load format) or ``"caller"`` (True or False).

    With a shard plan, ``shard`` is ``(rank, world_size)``;
    ``bytes_sliced_mapped`` counts this rank's slices left as views of the
    mapping (slices contiguous in the file: row splits) and
    ``bytes_sliced_copied`` the slices that had to be copied because they are
    strided in the file (column splits), whatever else was done to them.

    ``fp8_weights`` / ``bytes_fp8`` / ``bytes_fp8_scales``: fp8 weights kept
    as one-byte codes with their block scales (:mod:`mapoffload.loading.fp8`: the
    module's weight is their dequantization, computed as it is used).

    ``converted_tensors`` / ``bytes_converted``: tensors a loader made (fused
    experts, casts, dequantized weights; :func:`mapoffload.from_pretrained`),
    written once into mapped files in ``conversion_dir`` (counted in
    ``bytes_mapped``); ``conversion_reused`` when an earlier load wrote them.
    """

    files: list[str] = field(default_factory=list)
    keep_mapping: bool = False
    tensors: int = 0
    bytes_mapped: int = 0
    bytes_copied: int = 0
    copied: dict[str, int] = field(default_factory=dict)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    seconds: float = 0.0
    shard: tuple[int, int] | None = None
    bytes_sliced_mapped: int = 0
    bytes_sliced_copied: int = 0
    converted_tensors: int = 0
    bytes_converted: int = 0
    conversion_dir: str | None = None
    conversion_reused: bool = False
    decided_by: str = "caller"
    fp8_weights: int = 0
    bytes_fp8: int = 0
    bytes_fp8_scales: int = 0

    def _decision(self) -> str:
        if self.decided_by == "gate":
            return ("kept on the mapping: the gate found host copies would not fit" if self.keep_mapping
                    else "copied into host memory: the gate found copies fit (keep_mapping=True keeps the mapping)")
        return f"{'kept on the mapping' if self.keep_mapping else 'copied into host memory'}: " \
               f"keep_mapping={self.keep_mapping}"

    def __str__(self) -> str:
        why = ", ".join(f"{format_bytes(n)} for {r}" for r, n in sorted(self.copied.items())) or "nothing"
        keys = ""
        if self.missing_keys:
            keys += f" Missing keys: {', '.join(self.missing_keys)}."
        if self.unexpected_keys:
            keys += f" Unexpected keys: {', '.join(self.unexpected_keys)}."
        shard = ""
        if self.shard is not None:
            shard = (
                f" Rank {self.shard[0]} of {self.shard[1]}: slices {format_bytes(self.bytes_sliced_mapped)} "
                f"as views of the mapping, {format_bytes(self.bytes_sliced_copied)} copied (strided in the file)."
            )
        if self.fp8_weights:
            shard += (
                f" {self.fp8_weights} fp8 weights kept as codes ({format_bytes(self.bytes_fp8)}) and block "
                f"scales ({format_bytes(self.bytes_fp8_scales)}), dequantized as used."
            )
        if self.converted_tensors:
            shard += (
                f" {self.converted_tensors} converted tensors ({format_bytes(self.bytes_converted)}) "
                f"{'reused from' if self.conversion_reused else 'written to'} {self.conversion_dir}, mapped."
            )
        return (
            f"Loaded {self.tensors} tensors from {len(self.files)} file(s) in {self.seconds:.2f} s "
            f"({self._decision()}): "
            f"{format_bytes(self.bytes_mapped)} left on the file mapping, "
            f"{format_bytes(self.bytes_copied)} copied ({why}).{shard}{keys}"
        )


# Where it is imported from (``mapoffload``, the contract's home since the alias modules went) and
# pickled by; set after the class is made: the dataclass machinery looks the class's module up in
# sys.modules while making it.
LoadReport.__module__ = "mapoffload"
