"""How vLLM's CPU backend computes linear layers over the weights: packed or mapped.

After loading, vLLM's CPU backend hands every 2-D linear weight to a GEMM
library (oneDNN, or its small-GEMM kernel) that *packs* it into its own
layout: an owned copy of the weight, the original dropped. That is faster, and
is what happens when host copies fit. When they do not, :func:`mapped_linear`
makes that step keep the weights on a mapping, in one of two layouts
(``plain`` unless the load format's option ``linear: "vnni"`` asks, and
:func:`mapped_layout` finds the kernel):

- ``"vnni"``, where vLLM's small-GEMM kernel runs (``weight_packed_linear``,
  the kernel vLLM itself uses for small weights on AMX machines) and the CPU
  has AVX-512 BF16: a bf16 linear weight is packed into that kernel's VNNI
  layout - a plain tensor of the weight's shape - which the load format writes
  once into the mapped conversion folder (``_postprocess.py``) and maps at
  every later start. Decode runs at about the speed of vLLM's packed oneDNN
  weights (docs/benchmarks.md); its sums differ from oneDNN's in the last bit
  of a few elements, as vLLM's own kernel does (greedy tokens can part from
  vLLM's oneDNN ones on a large model: asked for, not the default).
- ``"plain"`` elsewhere (and for weights the kernel does not take: not bf16,
  out features not a multiple of 16, in features not of 32, embeddings whose
  weight is also looked up): ``torch.nn.functional.linear`` over the mapped
  weight as the checkpoint stores it, bit for bit what oneDNN computes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from ._errors import VllmLoadError

VNNI = "vnni"
PLAIN = "plain"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _vnni_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``weight`` in the small-GEMM kernel's VNNI layout (bias in float32)."""
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    torch.ops._C.weight_packed_linear(out.view(-1, n), x.reshape(-1, x.shape[-1]), weight, bias, True)
    return out


def mapped_layout() -> str:
    """``"vnni"`` where vLLM's small-GEMM kernel runs on this CPU (see the module), else ``"plain"``."""
    try:
        ops = torch.ops._C
        if not (hasattr(ops, "convert_weight_packed") and hasattr(ops, "weight_packed_linear")):
            return PLAIN
    except (AttributeError, RuntimeError):
        return PLAIN
    # Beyond 4 rows the kernel goes through torch's oneDNN brgemm: with oneDNN off it could fail inside
    # an OpenMP region (a process abort, not an exception).
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return PLAIN
    return VNNI if torch.cpu._is_avx512_bf16_supported() else PLAIN


def _takes(weight: torch.Tensor) -> bool:
    """Whether the small-GEMM kernel takes this weight (bf16: its fp16 path needs AMX-FP16; the tile sizes)."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0 and weight.is_contiguous()


# On a layer mapped_linear dispatched: the layout its weight computes in (vLLM's reload dispatches it again).
_MARK = "_mapoffload_linear"


def _pack(layer: torch.nn.Module, weight: torch.Tensor, packed: torch.Tensor | None = None) -> None:
    """``layer``'s weight replaced by its VNNI packing (``packed`` where one was kept), its bias made float32,
    and the layer computing through the small-GEMM kernel."""
    if packed is None or packed.shape != weight.shape or packed.dtype != weight.dtype:
        packed = torch.ops._C.convert_weight_packed(weight.data)
    weight.data = packed
    bias = getattr(layer, "bias", None)
    if bias is not None and bias.dtype != torch.float32:
        bias.data = bias.data.float()
    layer.cpu_linear = _vnni_linear


def _reload_dispatch(original: Callable) -> Callable:
    """vLLM's CPU GEMM dispatch, as installed for good at the first mapped load: a layer that
    :func:`mapped_linear` dispatched is dispatched again as at its load when vLLM post-processes it outside
    a load (its ``reload_weights``, which then copies what the dispatch left into the bound weight: packed
    away by vLLM's own, that was an empty tensor, and the engine lost its linear weights). A plain one keeps
    its weight; a VNNI one has the reloaded weight packed again, once where two linears share it (it was
    never an embedding's: the load refuses that). Any other layer is vLLM's."""
    packed: dict[int, weakref.ref] = {}  # id -> the weights packed by a reload (packed once)

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        mark = getattr(layer, _MARK, None)
        weight = getattr(layer, "weight", None)
        if mark is None or weight is None or weight.is_meta:
            return original(layer, remove_weight)
        if mark != VNNI:
            layer.cpu_linear = _linear  # the reloaded weight computed from as it is, as at the load
            return None
        known = packed.get(id(weight))
        if known is not None and known() is weight:
            layer.cpu_linear = _vnni_linear  # packed for the other linear sharing it
            return None
        _pack(layer, weight)
        packed[id(weight)] = weakref.ref(weight, lambda _, key=id(weight): packed.pop(key, None))
        return None

    dispatch.mapoffload_original = original
    return dispatch


@contextlib.contextmanager
def mapped_linear(enabled: bool, *, layout: str = PLAIN,
                  stored: Callable[[torch.nn.Module, str], torch.Tensor | None] | None = None) -> Iterator[None]:
    """While active (and ``enabled``), vLLM's CPU GEMM dispatch keeps 2-D weights for the mapping.

    ``layout="vnni"`` packs each linear weight the kernel takes into its VNNI layout in place of the
    weight (and its bias into float32): the caller maps what replaced them (``PostProcessed``).
    ``stored(layer, attr)`` gives a tensor already packed for the layer (a reused conversion), used
    instead of packing again.
    """
    if not enabled:
        yield
        return
    from vllm.model_executor.layers import utils

    if not hasattr(utils.dispatch_cpu_unquantized_gemm, "mapoffload_original"):
        utils.dispatch_cpu_unquantized_gemm = _reload_dispatch(utils.dispatch_cpu_unquantized_gemm)
    original = utils.dispatch_cpu_unquantized_gemm
    # A weight shared by two layers is packed once, and never where another holder reads its rows.
    seen: dict[int, str] = {}  # id of a weight parameter dispatched -> "vnni" (packed) or "plain"

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        before = seen.get(id(weight))
        if before == VNNI:
            if not remove_weight:
                raise VllmLoadError(f"a weight packed for vLLM's small-GEMM kernel (VNNI) is also an embedding's "
                                   f"({type(layer).__name__}), whose lookup reads plain rows: load without "
                                   f"linear='vnni'")
            layer.cpu_linear = _vnni_linear  # already packed for its other linear
            setattr(layer, _MARK, VNNI)
            return None
        # An embedding keeps its weight (remove_weight=False): the lookup reads the plain rows.
        if layout != VNNI or not remove_weight or before == PLAIN or not _takes(weight):
            seen[id(weight)] = PLAIN
            layer.cpu_linear = _linear
            setattr(layer, _MARK, PLAIN)
            return None
        seen[id(weight)] = VNNI
        setattr(layer, _MARK, VNNI)
        bias = getattr(layer, "bias", None)
        kept = stored(layer, "bias") if stored is not None and bias is not None else None
        if kept is not None and kept.dtype == torch.float32 and bias.dtype != torch.float32:
            bias.data = kept
        _pack(layer, weight, stored(layer, "weight") if stored is not None else None)
        return None

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def packed_layers(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s layers computing from VNNI-packed weights."""
    return [name for name, m in model.named_modules() if getattr(m, "cpu_linear", None) is _vnni_linear]
