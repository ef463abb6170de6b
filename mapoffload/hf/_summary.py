"""What an offload set up, measured: :class:`OffloadRow` per unit and the
plain-text table :meth:`OffloadHandle.summary` prints.

Every number is measured when asked, not remembered from the plan: each
unit's storage ranges (the union of its tensors' extents, so a byte reached
by two views counts once) are classified against one snapshot of
``/proc/self/maps`` (a file mapping, anonymous memory, pinned) or found on the
device, and the pages of the mapped ranges that copy-on-write made the
process's own (a weight written in place) are read from
``/proc/self/pagemap`` and counted as anonymous. The words are chosen from
what is measured and from the device in use, so that none contradicts
another (no "streamed" on a CPU that computes in place, no "mapped" next to
bytes that are a copy).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._log import format_bytes
from ..memory.budget import HOST_COPY_RESERVE_BYTES
from ._measure import measure

if TYPE_CHECKING:
    import torch

    from ..offload import LayerwiseOffloadManager
    from ..offload.stores import StorePlan

__all__ = ["OffloadRow", "format_rows", "placed_row", "stack_row"]

WIDTH = 100  # columns the summary fits in

# how a unit computes
STREAMED, IN_PLACE, PLACED = "streamed", "in place", "placed"


@dataclass
class OffloadRow:
    """One unit of an offload (a streamed stack, the streamed rest, or the
    placed tensors), as measured. :meth:`OffloadHandle.summary` is these rows
    as a table; ``handle.rows`` gives them as data.

    Attributes
    ----------
    unit
        The stack's path (``"model.layers"``), ``"rest"`` (what lies outside
        the stacks) or ``"placed"`` (shared weights and buffers left placed
        when the rest is streamed).
    how
        ``"streamed"`` (copied to the device one layer or module at a time),
        ``"in place"`` (``device="cpu"``: computes from the host tensors, no
        copy) or ``"placed"`` (on the device whole; on the CPU, left where it is).
    layers
        Layers (or modules) streamed one at a time; None when placed.
    mapped_bytes, anonymous_bytes, pinned_bytes
        Host bytes of the unit's tensors on a file mapping (page cache the
        kernel can drop and re-read), in anonymous memory (a copy: the model's
        own tensors or a host store; or pages of a mapped tensor written in
        place, see ``written_bytes``), and in pinned memory. For a placed unit
        on a GPU these are the host originals kept for ``close()``.
    device_bytes
        Bytes placed on the GPU for good (streamed layers' device buffers
        come and go and are not counted).
    nbytes
        The unit's tensors, each counted once, wherever they are.
    cached_bytes, read_per_forward
        Of the mapped bytes: planned to stay in the page cache across
        forwards, and re-read from the file every forward.
    where, residency, why
        One sentence each: where it computes, what happens to its file
        pages, and the decision that put the bytes where they are.
    component
        The pipeline component (``"transformer"``); empty for a single model.
    written_bytes
        Of ``anonymous_bytes``: bytes of tensors on a file mapping whose pages
        were written in place since they were mapped (copy-on-write made them
        the process's own memory, no longer the file's: the kernel cannot drop
        them). A page is copied whole: the bytes of the unit's tensors in
        such pages are counted, a neighbour's bytes in the same page are the
        neighbour's.
    """

    unit: str
    how: str
    layers: int | None
    mapped_bytes: int
    anonymous_bytes: int
    pinned_bytes: int
    device_bytes: int
    nbytes: int
    cached_bytes: int
    read_per_forward: int
    where: str
    residency: str
    why: str
    component: str = ""
    written_bytes: int = 0

    @property
    def host_bytes(self) -> int:
        return self.mapped_bytes + self.anonymous_bytes + self.pinned_bytes

    @property
    def store(self) -> str:
        """Where the host bytes live, in words (``"12.00 MiB mapped + 1.00 KiB anonymous"``)."""
        parts = [(self.mapped_bytes, "mapped"), (self.anonymous_bytes, "anonymous"), (self.pinned_bytes, "pinned")]
        words = " + ".join(f"{format_bytes(n)} {what}" for n, what in parts if n)
        return words or "no host bytes"

    def __str__(self) -> str:
        name = f"{self.component}.{self.unit}" if self.component else self.unit
        count = f"{self.layers} {'modules' if self.unit == 'rest' else 'layers'}, " if self.layers else ""
        device = f", {format_bytes(self.device_bytes)} on the device" if self.device_bytes else ""
        return f"{name} ({count}{self.how}): {self.store}{device}; {self.where}; {self.residency}; {self.why}"


def _manager_hosts(m: LayerwiseOffloadManager) -> list[torch.Tensor]:
    return [t for _, t in m.iter_cpu_weights()]


# --- words --------------------------------------------------------------------------------


def _residency(m: LayerwiseOffloadManager, mapped: int, what: str) -> tuple[str, int, int]:
    """(sentence, cached bytes, bytes read per forward) of a manager's page-cache plan."""
    plan = m.residency
    n = len(plan.layer_bytes)
    if not mapped or not sum(plan.layer_bytes):
        return "no file pages to keep cached or re-read", 0, 0
    if not plan.streamed:
        its = f"its {what[:-1]}" if n == 1 else f"all {n} {what}"
        return f"the file pages of {its} stay in the page cache", plan.cached_bytes, 0
    after = (f" after {format_bytes(plan.always_bytes)} of other weights every forward reads"
             if plan.always_bytes and not plan.always_streamed else "")
    how = (f", part by part (the largest part {format_bytes(plan.part_bytes)}: one {what[:-1]} does not fit"
           f"{'; the next part read while one computes' if plan.depth else ''}"
           f"{'; smaller parts read ahead within it' if plan.readahead and not plan.depth else ''})"
           if plan.parts else ", the next read while one computes" if plan.readahead else "")
    rest = (f"; the {format_bytes(plan.always_bytes)} of other weights every forward reads do not fit beside "
            "them: read as they run and let go after" if plan.always_streamed else "")
    return (
        f"{len(plan.cached)} of {n} {what} stay in the page cache ({format_bytes(plan.cached_bytes)}); "
        f"{len(plan.streamed)} are re-read from the file every forward "
        f"({format_bytes(plan.streamed_bytes)} a forward{how}): "
        f"memory leaves {format_bytes(plan.budget)} for these pages{after}{rest}",
        plan.cached_bytes, plan.streamed_bytes,
    )


def _written_words(written: int) -> str:
    """The clause on a unit's mapped bytes written in place, or ''."""
    if not written:
        return ""
    return (f"; {format_bytes(written)} of its mapped weights' pages were written in place since they were "
            "mapped (copy-on-write: anonymous memory of the process now, no longer the file's)")


def _why(m: LayerwiseOffloadManager, mapped: int, anonymous: int, pinned: int, available: int | None,
         host_store_given: bool, written: int = 0) -> str:
    """Why the unit's bytes are where they are. ``written`` (part of
    ``anonymous``) are mapped bytes written in place: the words on copies
    are about the rest."""
    copied = anonymous - written
    on_file = mapped + written  # what the load left on the mapping
    return _decision(m, on_file, copied, pinned, available, host_store_given, bool(written)) + _written_words(written)


def _store_plan(m: LayerwiseOffloadManager) -> StorePlan | None:
    """The decision the manager's plan recorded on its layers' stores (one for all of them)."""
    return next((s.plan for s in m.parts.sequencer.stores if s.plan is not None), None)


def _pin_words(m: LayerwiseOffloadManager) -> str | None:
    """The copies' pinning as the plan chose it, when it pinned some layers and not others."""
    from ..offload.stores import PinChoice

    choices = [s.pin for s in m.parts.sequencer.stores if s.pin is not PinChoice.NONE]
    pinned = sum(c is PinChoice.PINNED for c in choices)
    if not pinned or pinned == len(choices):
        return None
    why = sorted({c.value for c in choices if c is not PinChoice.PINNED})
    return f"host copies fit: {pinned} of {len(choices)} layers pinned, the rest pageable ({', '.join(why)})"


def _load_copies(m: LayerwiseOffloadManager) -> str:
    """The clause on the copies the model's load decided (``model.mapoffload_report``, from
    ``from_pretrained``), by the reasons its report files them under, or ''."""
    from ..loading.reasons import CopyReason

    copied = getattr(getattr(m.model, "mapoffload_report", None), "copied", None) or {}
    parts = []
    for reason, n in sorted(copied.items()):
        try:
            reason = CopyReason(reason)
        except ValueError:
            continue
        if reason.by_decision:
            parts.append(f"{format_bytes(n)} because {reason.words} (copied[{str(reason)!r}])")
    return f"; the load copied {', '.join(parts)}" if parts else ""


def _decision(m: LayerwiseOffloadManager, mapped: int, anonymous: int, pinned: int, available: int | None,
              host_store_given: bool, written: bool = False) -> str:
    """The words on the rule the manager's plan recorded (:class:`~mapoffload.offload.stores.StorePlan`),
    with the bytes measured now."""
    from ..offload.stores import StoreRule

    sp = _store_plan(m)
    if sp is not None and sp.rule is StoreRule.IN_PLACE:
        if not anonymous and not pinned:
            return "its weights are views of the checkpoint's file mapping" + ("" if written else ", as loaded")
        if not mapped:
            return ("its weights are the model's own tensors in anonymous memory, not on a file mapping (on the "
                    "CPU the offload computes from them where they are and copies nothing)" + _load_copies(m))
        return "kept as they are: part on the file mapping, part anonymous copies (on the CPU nothing is copied)"
    if host_store_given or sp is None or sp.rule is StoreRule.ASKED:
        return f"host_store={m.options.host_store!r} asked"
    if sp.available_bytes is None and available is None:
        return "host stores chosen against the host's available memory"
    total = mapped + anonymous + pinned
    n, room = sp.local_ranks, max(sp.room or 0, 0)
    available = sp.available_bytes if sp.available_bytes is not None else available
    if sp.rule is StoreRule.COPIES_DO_NOT_FIT:
        verdict = ("a host copy would not fit: kept on the file mapping" if not anonymous and not pinned
                   else "mapped where a host copy would not fit, copied for the rest")
    else:
        verdict = _pin_words(m) or ("host copies fit: pinned, so the copies to the device overlap compute"
                                    if pinned else "host copies fit: copied into anonymous memory")
    if n > 1:
        return (f"{n} local ranks x {format_bytes(total)} against {format_bytes(available)} available less "
                f"{n} x the {format_bytes(HOST_COPY_RESERVE_BYTES)} reserve ({format_bytes(room)}): {verdict}")
    return (f"{format_bytes(total)} against {format_bytes(available)} available less the "
            f"{format_bytes(HOST_COPY_RESERVE_BYTES)} reserve ({format_bytes(room)}): {verdict}")


def stack_row(unit: str, m: LayerwiseOffloadManager, *, available: int | None, host_store_given: bool,
              modules: bool = False, why: str | None = None) -> OffloadRow:
    """The row of one manager (a stack, or the streamed rest when ``modules``)."""
    from ..offload.manager import held_buffers

    mapped, anonymous, pinned, _, total, written = measure(_manager_hosts(m))
    what = "modules" if modules else "layers"
    held = held_buffers(m.parts.loads, m.copier, m.device)
    uncached = next((b for b in held if b.what == "uncached buffers"), None)
    if m.copier is None and uncached is not None:
        how, where = IN_PLACE, ("computes on the CPU from the host tensors; the streamed layers are read from "
                                f"the file into reused uncached buffers ({format_bytes(uncached.nbytes)}, "
                                "row 'buffers'), the cached ones compute from the mapping")
    elif m.copier is None:
        how, where = IN_PLACE, "computes on the CPU from the host tensors; nothing is copied"
    elif m.device.type == "cpu":
        how = STREAMED
        where = f"copied {'module' if modules else 'layer'} by {'module' if modules else 'layer'} into CPU " \
                "buffers (the device pipeline's CPU twin)"
    else:
        how = STREAMED
        route = "pinned memory straight to the device" if pinned and not mapped and not anonymous else \
            "the host stores through pinned staging to the device"
        step = "module by module" if modules else "one layer at a time"
        where = f"copied to {m.device} {step}, {m.options.prefetch_layers} ahead, from {route}"
    residency, cached, read = _residency(m, mapped, what)
    reason = (why + _written_words(written)) if why else _why(m, mapped, anonymous, pinned, available,
                                                              host_store_given, written)
    return OffloadRow(unit, how, len(m.layers), mapped, anonymous, pinned, 0, total, cached, read, where,
                      residency, reason, written_bytes=written)


def placed_row(unit: str, tensors: Sequence[torch.Tensor], originals: Sequence[torch.Tensor],
               device: torch.device, why: str, streamed: int = 0) -> OffloadRow:
    """The row of the tensors placed whole: on the device (``originals``: their
    host data, kept for ``close()``), or on the CPU left where they are.
    ``streamed``: of their mapped bytes, those each forward reads and lets go
    (on the CPU only)."""
    mapped, anonymous, pinned, on_device, total, written = measure(tensors)
    read = 0
    if device.type != "cpu":
        kept = measure(originals)
        mapped, anonymous, pinned, written = kept.mapped, kept.anonymous, kept.pinned, kept.written
        where = f"on {device} whole" + (" (host originals kept for close())" if any(kept[:3]) else "")
        residency = "no file pages read by forwards" if not mapped else "host originals only read by close()"
    else:
        where = "left where it is (the device is the CPU)"
        read = min(streamed, mapped)
        if read:
            kept = "" if read == mapped else f"; the other {format_bytes(mapped - read)} of its file pages stay cached"
            residency = (f"{format_bytes(read)} of its file pages (the weights every forward reads whole) are read "
                         f"from the file every forward as their modules run and let go after: the page-cache "
                         f"plan leaves them no room beside the streaming window{kept}")
        else:
            residency = ("its file pages are read every forward and stay cached" if mapped
                         else "no file pages to keep cached or re-read")
    return OffloadRow(unit, PLACED, None, mapped, anonymous, pinned, on_device, total,
                      mapped - read if device.type == "cpu" else 0, read, where, residency,
                      why + _written_words(written), written_bytes=written)


# --- the table ------------------------------------------------------------------------------


REUSED = "reused"


def buffers_row(managers: Iterable[LayerwiseOffloadManager], model: torch.nn.Module | None = None,
                component: str = "") -> OffloadRow | None:
    """The row of the working buffers the managers' machinery holds now
    (:mod:`mapoffload.offload.manager`: uncached buffers, staging slots,
    the CPU twin's device buffers) and, for a model with fp8 weights, the
    process's fp8 working buffers; None when there are none. Not weights:
    its ``nbytes`` is 0, so it is no part of "a full host copy"."""
    from ..loading.fp8 import fp8_weights
    from ..loading.fp8_workspace import workspace
    from ..offload.manager import held_buffers

    kinds: dict[str, list[int]] = {}
    seen: set[int] = set()
    for m in managers:
        for b in held_buffers(m.parts.loads, m.copier, m.device):
            if b.owner in seen:
                continue
            seen.add(b.owner)
            k = kinds.setdefault(b.what, [0, 0])
            k[0] += b.anonymous
            k[1] += b.pinned
    if model is not None and next(fp8_weights(model), None) is not None and workspace().bytes:
        kinds["fp8 working buffers (shared by the process's fp8 weights)"] = [workspace().bytes, 0]
    if not kinds:
        return None
    anonymous, pinned = sum(a for a, _ in kinds.values()), sum(p for _, p in kinds.values())
    parts = "; ".join(f"{what} {format_bytes(a + p)}" + (" pinned" if p and not a else "")
                      for what, (a, p) in kinds.items())
    return OffloadRow("buffers", REUSED, None, 0, anonymous, pinned, 0, 0, 0, 0,
                      f"the offload's working memory, reused every forward: {parts}",
                      "not weights: no file pages", "what streaming needs besides the weights' own stores",
                      component)


def _cells(r: OffloadRow, cols: list[str], indent: str) -> list[str]:
    by = {
        "mapped": format_bytes(r.mapped_bytes), "anonymous": format_bytes(r.anonymous_bytes),
        "pinned": format_bytes(r.pinned_bytes), "on device": format_bytes(r.device_bytes),
        "read/forward": format_bytes(r.read_per_forward),
    }
    return [indent + r.unit, r.how, "-" if r.layers is None else str(r.layers)] + [by[c] for c in cols]


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def format_rows(rows: Sequence[OffloadRow], device: torch.device | Iterable[Any] | None = None) -> str:
    """Rows as an aligned plain-text table (≤ 100 columns), a totals line
    against a full host copy, and one paragraph per unit."""
    if not rows:
        return "nothing offloaded"
    cuda = any(r.device_bytes or r.pinned_bytes for r in rows) or (
        device is not None and getattr(device, "type", "cpu") != "cpu")
    cols = ["mapped", "anonymous"] + (["pinned", "on device"] if cuda else []) + ["read/forward"]
    components = list(dict.fromkeys(r.component for r in rows))
    grouped = len(components) > 1 or components[0] != ""
    header = ["unit", "how", "layers"] + cols
    body: list[list[str] | str] = []
    for comp in components:
        if grouped:
            body.append(f"{comp}:")
        body += [_cells(r, cols, "  " if grouped else "") for r in rows if r.component == comp]
    total = OffloadRow("total", "", None, sum(r.mapped_bytes for r in rows), sum(r.anonymous_bytes for r in rows),
                       sum(r.pinned_bytes for r in rows), sum(r.device_bytes for r in rows),
                       sum(r.nbytes for r in rows), sum(r.cached_bytes for r in rows),
                       sum(r.read_per_forward for r in rows), "", "", "")
    footer = _cells(total, cols, "")
    footer[1] = footer[2] = ""
    table = [header] + [b for b in body if isinstance(b, list)] + [footer]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    fixed = sum(widths[1:]) + 2 * (len(header) - 1)
    widths[0] = min(widths[0], max(12, WIDTH - fixed))

    def line(cells: list[str]) -> str:
        out = [_fit(cells[0], widths[0]).ljust(widths[0])]
        out += [c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells[1:], widths[1:]), 1)]
        return "  ".join(out).rstrip()

    lines = [line(header)]
    for b in body:
        lines.append(_fit(b, WIDTH) if isinstance(b, str) else line(b))
    lines.append(line(footer))
    full = total.nbytes
    host_copy = total.anonymous_bytes + total.pinned_bytes
    if full:
        pct = 100 * total.mapped_bytes / full
        lines.append(_wrap(
            f"a full host copy of these {format_bytes(full)} would all be anonymous or pinned memory; here "
            f"{format_bytes(host_copy)} is, and {format_bytes(total.mapped_bytes)} ({pct:.0f} %) stays on the "
            "file mapping (page cache the kernel can drop and re-read)", ""))
    buffers = sum(r.anonymous_bytes + r.pinned_bytes for r in rows if r.how == REUSED)
    if full and buffers:
        lines.append(_wrap(f"of the {format_bytes(host_copy)} anonymous or pinned, {format_bytes(buffers)} are "
                           "the offload's reused working buffers (row 'buffers'), not copies of weights", "    "))
    written = sum(r.written_bytes for r in rows)
    if full and written:
        lines.append(_wrap(f"of the {format_bytes(host_copy)} anonymous or pinned, {format_bytes(written)} are "
                           "mapped weights' pages written in place (copy-on-write), not copies the offload made",
                           "    "))
    for r in rows:
        name = f"{r.component}.{r.unit}" if r.component else r.unit
        lines.append(_wrap(f"{name}: {r.where}; {r.residency}. Why: {r.why}.", "    "))
    from ..pagecache.coordinator import coordinator

    if coordinator().managers():
        lines.append(_wrap(f"page cache (one plan for every stack of this process): {coordinator().describe()}",
                           "    "))
    return "\n".join(lines)


def _wrap(text: str, indent: str) -> str:
    return "\n".join(textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False))


def fp8_words(model: torch.nn.Module) -> str:
    """A paragraph on a model's fp8 weights (mapoffload.loading.fp8), or '' when it has none:
    their codes and scales, and the working memory a dequantization takes."""
    import torch

    from ..loading.fp8 import fp8_weights

    found = [(codes, d) for _, codes, d in fp8_weights(model)]
    if not found:
        return ""
    codes_bytes = sum(c.nbytes for c, _ in found)
    scales = sum(d.scale.nbytes for _, d in found)
    widest = max(found, key=lambda cd: cd[0].numel())
    work = widest[0].numel() * torch.empty(0, dtype=widest[1].dtype).element_size()
    return "\n" + _wrap(
        f"fp8: {len(found)} weights stay one-byte codes ({format_bytes(codes_bytes)}) with their block scales "
        f"({format_bytes(scales)}), counted above as read; each is dequantized to {widest[1].dtype} where and "
        f"when it is used (the largest takes {format_bytes(work)} while its module computes)", "    ")


def conversion_words(model: torch.nn.Module) -> str:
    """A paragraph on what the load converted into a mapped folder, or ''."""
    report = getattr(model, "mapoffload_report", None)
    if report is None or not getattr(report, "converted_tensors", 0):
        return ""
    how = "reused from" if report.conversion_reused else "written once to"
    return "\n" + _wrap(
        f"converted: {report.converted_tensors} tensors transformers made while loading (fused experts, casts, "
        f"fp8 stacks; {format_bytes(report.bytes_converted)}) are mapped from a conversion folder, {how} "
        f"{report.conversion_dir}", "    ")
