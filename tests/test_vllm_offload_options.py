"""The vLLM device path's options and refusals, and the layer choice, without vLLM (fake configs)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from mapoffload import OffloadOptions
from mapoffload._env import EnvSettingError
from mapoffload.vllm import VllmLoadError
from mapoffload.vllm._convert import hidden
from mapoffload.vllm._offloader import LayerTaker, OffloadRequest
from mapoffload.vllm._options import ENV_CPU_TWIN, EngineFacts, LoaderOptions
from mapoffload.vllm.loader import _Loader


TWIN = {ENV_CPU_TWIN: "1"}


def _config(gib: float = 0, params=(), group: int = 0, device: str = "cpu", backend: str = "auto"):
    offload = SimpleNamespace(uva=SimpleNamespace(cpu_offload_gb=gib, cpu_offload_params=set(params)),
                              prefetch=SimpleNamespace(offload_group_size=group), offload_backend=backend)
    return SimpleNamespace(offload_config=offload, device_config=SimpleNamespace(device=device))


def _parse(extra: dict, twin: bool = False) -> LoaderOptions:
    with mock.patch.dict(os.environ, TWIN if twin else {}):
        if not twin:
            os.environ.pop(ENV_CPU_TWIN, None)
        return LoaderOptions.parse(extra)


def _facts(device: str = "cpu", eager: bool = True, quantization=None, speculative=None, **config) -> EngineFacts:
    vllm_config = _config(device=device, **config)
    vllm_config.speculative_config = speculative
    return EngineFacts.of(vllm_config, SimpleNamespace(enforce_eager=eager, quantization=quantization),
                          SimpleNamespace(device=None))


def _request(extra: dict, device: str = "cpu", eager: bool = True, twin: bool = False, **config):
    return _parse(extra, twin).plan(_facts(device, eager, **config)).request


@pytest.fixture
def cuda_seen(monkeypatch):
    """OffloadOptions(device="cuda") as where torch sees a device (the refusals run before it is made)."""
    import mapoffload.options

    monkeypatch.setattr(mapoffload.options, "check_device", lambda device, what="device": torch.device(device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _twin_options(prefetch: int = 1) -> OffloadOptions:
    return OffloadOptions(device="cpu", prefetch_layers=prefetch, host_store="mapped", cpu_twin=True)


def test_offload_options_parse():
    opts = _parse({"offload_layers": 3, "prefetch_layers": 2}, twin=True)
    assert (opts.offload_layers, opts.prefetch_layers, opts.cpu_twin) == (3, 2, True)
    assert _parse({}).offload_layers is None and _parse({}).prefetch == 1 and _parse({}).prefetch_layers is None
    assert _parse({"prefetch_layers": 0}).prefetch == 0
    assert not _parse({}).cpu_twin


def test_the_twin_is_the_variable_and_the_old_key_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_CPU_TWIN, "1")
    assert LoaderOptions.parse({"offload_layers": 1}) == _parse({"offload_layers": 1}, twin=True)
    with pytest.raises(VllmLoadError, match=r"unknown key\(s\) \['cpu_twin'\]"):
        LoaderOptions.parse({"offload_layers": 1, "cpu_twin": True})
    monkeypatch.setenv(ENV_CPU_TWIN, "0")
    assert not LoaderOptions.parse({}).cpu_twin
    monkeypatch.setenv(ENV_CPU_TWIN, "maybe")
    with pytest.raises(EnvSettingError, match=ENV_CPU_TWIN):
        LoaderOptions.parse({})


def test_the_options_the_manager_is_handed_are_what_the_keys_and_the_engine_say(cuda_seen):
    twin = _request({"offload_layers": 2, "prefetch_layers": 3}, twin=True)
    assert twin.options == _twin_options(3) and (twin.layers, twin.prefetch) == (2, 3)
    gpu = _request({"offload_layers": 1}, device="cuda")
    assert gpu.options == OffloadOptions(device="cuda:0", prefetch_layers=1, host_store="mapped")
    gb = _request({}, device="cuda", gib=2)
    assert gb.options == gpu.options and gb.max_bytes == 2 << 30
    assert _parse({}).stream_options() == OffloadOptions(device="cpu")


@pytest.mark.parametrize("extra,needle", [
    ({"offload_layers": 0}, "['offload_layers'] must be a whole number >= 1"),
    ({"offload_layers": "2"}, "offload_layers"),
    ({"offload_layers": True}, "offload_layers"),
    ({"offload_layers": 1.5}, "offload_layers"),
    ({"prefetch_layers": -1}, "['prefetch_layers'] must be a whole number >= 0"),
    ({"offload_layers": 1, "keep_mapping": False}, "keep_mapping=false loads with vLLM's own loader and offloader: "
                                                   "offload_layers=1 is for"),
    ({"offload_layers": 1, "linear": "packed"}, "cannot go with linear='packed'"),
    ({"offload_layers": 1, "stream_layers": True}, "cannot go with stream_layers=true"),
])
def test_bad_offload_options_are_named(extra, needle):
    with pytest.raises(VllmLoadError) as info:
        _parse(extra)
    assert needle in str(info.value)


def test_unknown_key_lists_the_offload_keys_and_not_the_test_switch():
    with pytest.raises(VllmLoadError, match="offload_layers: .*prefetch_layers: ") as info:
        LoaderOptions.parse({"offload": 1})
    assert "cpu_twin" not in str(info.value)


def test_what_is_offloaded(cuda_seen):
    assert _request({}) is None
    assert _request({"offload_layers": 2}, twin=True) == OffloadRequest(2, None, _twin_options(), "offload_layers=2")
    gb = _request({"prefetch_layers": 3}, twin=True, gib=0.5)
    assert (gb.layers, gb.max_bytes, gb.prefetch) == (None, 1 << 29, 3) and "cpu_offload_gb=0.5" in gb.why
    assert _request({"offload_layers": 1}, device="cuda").layers == 1
    assert _request({}, device="cuda", gib=2).max_bytes == 2 << 30
    # vLLM's own offloader offloads nothing on its CPU backend: neither do we, unless asked for the twin
    assert _request({}, gib=2) is None and _request({"linear": "packed"}, gib=2) is None


@pytest.mark.parametrize("extra,kwargs,needle", [
    ({"offload_layers": 1}, {"device": "cuda", "eager": False}, "enforce_eager=True (--enforce-eager)"),
    ({}, {"device": "cuda", "eager": False, "gib": 1}, "enforce_eager"),
    ({"offload_layers": 1}, {"eager": False, "twin": True}, "enforce_eager"),
    ({"offload_layers": 1}, {}, f"{ENV_CPU_TWIN}=1 runs the device pipeline's CPU twin"),
    ({"offload_layers": 1}, {"device": "cuda", "twin": True}, f"{ENV_CPU_TWIN}=1 is for vLLM's CPU backend"),
    ({}, {"twin": True}, "give offload_layers"),
    ({"offload_layers": 1}, {"gib": 1, "device": "cuda"}, "give one"),
    ({}, {"gib": 1, "params": ["experts"], "device": "cuda"}, "cpu_offload_params"),
    ({"offload_layers": 1}, {"group": 2, "device": "cuda"}, "offload_group_size=2"),
    ({"offload_layers": 1}, {"device": "xpu"}, "not xpu"),
    ({"linear": "packed"}, {"gib": 1, "twin": True}, "linear='packed' cannot go with cpu_offload_gb=1"),
    ({"stream_layers": True}, {"gib": 1, "twin": True}, "stream_layers=true cannot go with cpu_offload_gb=1"),
    ({"linear": "vnni"}, {"gib": 1, "device": "cuda"}, "linear='vnni' cannot go with cpu_offload_gb=1"),
    ({"offload_layers": 2}, {"gib": 0}, f"{ENV_CPU_TWIN}=1 runs"),
    ({"stream_layers": True}, {"gib": 1, "device": "cuda"}, "stream_layers=true cannot go with cpu_offload_gb=1"),
])
def test_refusals_name_what_to_change(extra, kwargs, needle):
    with pytest.raises(VllmLoadError) as info:
        _request(extra, **kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize("extra,twin,keys", [
    # the keys alone (parse): every key of every rule broken, in one error
    ({"offload_layers": 1, "keep_mapping": False, "linear": "packed", "stream_layers": True, "prefetch_layers": 2},
     False, {"keep_mapping", "offload_layers", "linear", "stream_layers", "prefetch_layers"}),
    ({"keep_mapping": False, "prefetch_layers": 2}, True, {"keep_mapping", "prefetch_layers", ENV_CPU_TWIN}),
    ({"offload_layers": 1, "linear": "vnni", "stream_layers": True}, False, {"offload_layers", "linear",
                                                                            "stream_layers"}),
])
def test_conflicting_keys_are_refused_together_naming_every_one(extra, twin, keys):
    with pytest.raises(VllmLoadError) as info:
        _parse(extra, twin)
    assert set(info.value.keys) == keys
    assert all(k in str(info.value) for k in keys)


@pytest.mark.parametrize("extra,kwargs,keys", [
    ({"offload_layers": 1, "prefetch_layers": 2}, {"gib": 1, "device": "cuda", "eager": False, "speculative": True},
     {"offload_layers", "cpu_offload_gb", "enforce_eager", "speculative_config"}),
    ({"linear": "vnni", "stream_layers": True}, {"gib": 1, "twin": True, "eager": False},
     {"cpu_offload_gb", "linear", "stream_layers", "enforce_eager"}),
    ({"prefetch_layers": 2}, {"device": "cuda", "twin": True}, {"prefetch_layers", ENV_CPU_TWIN, "device"}),
    ({"offload_layers": 1}, {"device": "cuda", "twin": True, "quantization": "fp8"},
     {"quantization", ENV_CPU_TWIN}),
])
def test_what_the_engine_refuses_is_refused_together_naming_every_setting(extra, kwargs, keys):
    with pytest.raises(VllmLoadError) as info:
        _request(extra, **kwargs)
    assert set(info.value.keys) == keys
    assert all(k in str(info.value) for k in keys)


def _loader(extra: dict) -> _Loader:
    loader = _Loader()
    loader.options = _parse(extra)
    loader.load_config = SimpleNamespace(device=None)
    return loader


def _plan(extra: dict, config, model):  # noqa: ANN001
    return _loader(extra)._plan(config, model)


def test_a_gpu_engine_with_nothing_offloaded_is_refused_and_one_without_enforce_eager_too(cuda_seen):
    model = SimpleNamespace(quantization=None, enforce_eager=True)
    with pytest.raises(VllmLoadError, match="nothing is offloaded here: load with load_format='auto'"):
        _plan({}, _config(device="cuda"), model)
    with pytest.raises(VllmLoadError, match="enforce_eager"):
        _plan({"offload_layers": 2}, _config(device="cuda"), SimpleNamespace(quantization=None, enforce_eager=False))
    plan = _plan({"offload_layers": 2}, _config(device="cuda"), model)
    assert plan.device.type == "cuda" and plan.request.layers == 2
    # keep_mapping=false: vLLM's own loader and offloader (its cpu_offload_gb included), on any device
    assert _plan({"keep_mapping": False}, _config(device="cuda", gib=1), model).request is None
    with pytest.raises(VllmLoadError, match="quantization 'fp8'"):
        _plan({"offload_layers": 1}, _config(device="cuda"), SimpleNamespace(quantization="fp8", enforce_eager=True))


def test_offloading_with_speculative_decoding_is_refused_naming_it(cuda_seen):
    """vLLM loads a draft model through the same load config: it would offload its layers too."""
    model = SimpleNamespace(quantization=None, enforce_eager=True)
    config = _config(device="cuda")
    config.speculative_config = SimpleNamespace(method="draft_model")
    with pytest.raises(VllmLoadError, match="speculative_config"):
        _plan({"offload_layers": 2}, config, model)
    config.speculative_config = None
    assert _plan({"offload_layers": 2}, config, model).request.layers == 2
    config.speculative_config = SimpleNamespace(method="draft_model")  # nothing offloaded: not our concern
    assert _plan({"keep_mapping": False}, config, model).request is None


def _layers(n: int) -> list[torch.nn.Module]:
    return [torch.nn.Linear(8, 4, bias=False) for _ in range(n)]  # 32 floats: 128 bytes each


def test_the_first_layers_are_taken_across_make_layers_calls():
    taker = LayerTaker(OffloadRequest(3, None, _twin_options(), "offload_layers=3"))
    first, second = _layers(2), _layers(2)
    assert taker.wrap(iter(first)) == first and taker.wrap(iter(second)) == second
    assert taker.stacks == [first, second[:1]] and (taker.layers, taker.bytes) == (3, 3 * 128)
    assert taker.wrap(iter([torch.nn.ReLU()])) and len(taker.stacks) == 2  # no parameters: never taken


@pytest.mark.parametrize("max_bytes,taken", [(1, 1), (128, 1), (129, 2), (10_000, 4)])
def test_a_byte_amount_takes_layers_until_it_is_reached_as_vllms_uva_offloader(max_bytes, taken):
    taker = LayerTaker(OffloadRequest(None, max_bytes, _twin_options(), "cpu_offload_gb"))
    layers = _layers(4)
    taker.wrap(iter(layers))
    assert taker.stacks == [layers[:taken]]


def test_hidden_parameters_are_neither_read_nor_written_and_come_back():
    layer = torch.nn.Linear(4, 3)
    weight, bias = layer.weight.data, layer.bias.data
    before = weight.clone()
    with hidden([layer.weight, layer.bias], torch.device("cpu")):
        assert layer.weight.data_ptr() != weight.data_ptr() and layer.weight.shape == (3, 4)
        layer.weight.data.copy_(torch.full((3, 4), 7.0))  # what a loader writes lands in the scratch
        layer.bias.data = torch.zeros(3)  # replaced meanwhile: stays, for the caller to find
    assert layer.weight.data_ptr() == weight.data_ptr() and torch.equal(layer.weight.data, before)
    assert layer.bias.data_ptr() != bias.data_ptr()


def test_an_offloaded_weight_that_is_not_mapped_is_refused_by_name(tmp_path):
    from mapoffload.vllm._offloader import check_still_mapped
    from safetensors.torch import save_file

    from mapoffload.loading.read import read_files

    save_file({"w": torch.ones(64, 64)}, str(tmp_path / "m.safetensors"))
    mapped = torch.nn.Parameter(read_files([str(tmp_path / "m.safetensors")])["w"], requires_grad=False)
    owned = torch.nn.Parameter(torch.ones(64, 64), requires_grad=False)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].w, model.layers[0].v = mapped, owned
    params = {"layers.0.w": mapped, "layers.0.v": owned}
    before = {n: p.data_ptr() for n, p in params.items()}
    check_still_mapped(model, {"layers.0.w": mapped}, before)
    with pytest.raises(VllmLoadError, match=r"memory of their own \(layers\.0\.v\)"):
        check_still_mapped(model, params, before)
    mapped.data = torch.zeros(64, 64)  # replaced by post-processing
    with pytest.raises(VllmLoadError, match="layers.0.w"):
        check_still_mapped(model, {"layers.0.w": mapped}, before)


def _mapped_param(tmp_path, name: str = "m") -> torch.nn.Parameter:
    from safetensors.torch import save_file

    from mapoffload.loading.read import read_files

    path = str(tmp_path / f"{name}.safetensors")
    save_file({"w": torch.ones(64, 64)}, path)
    return torch.nn.Parameter(read_files([path])["w"], requires_grad=False)


def test_a_parameter_post_processing_replaces_over_the_scratch_is_refused_by_name(tmp_path):
    # vLLM 0.32's UnquantizedFusedMoEMethod.process_weights_after_loading (CUDA, first load) calls
    # replace_parameter(layer, "w13_weight", w13.contiguous()): a *new* Parameter over the data it sees,
    # which under `hidden` is the scratch. `hidden` puts the old object's data back, so the old object
    # looks mapped while the model computes from the scratch: the check must look at the model.
    from mapoffload.vllm._offloader import check_still_mapped

    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.w13_weight = _mapped_param(tmp_path)
    offloaded = dict(model.named_parameters())
    before = {n: p.data_ptr() for n, p in offloaded.items()}
    with hidden(offloaded.values(), torch.device("cpu")):
        w13 = model.experts.w13_weight
        setattr(model.experts, "w13_weight", torch.nn.Parameter(w13.data.contiguous(), requires_grad=False))
    assert offloaded["experts.w13_weight"].data_ptr() == before["experts.w13_weight"]  # the old one came back
    with pytest.raises(VllmLoadError, match=r"experts\.w13_weight"):
        check_still_mapped(model, offloaded, before)


def test_a_parameter_replaced_by_a_view_of_the_same_mapped_bytes_is_fine(tmp_path):
    # (the CPU twin: replace_parameter over w13.contiguous() of a mapped, contiguous tensor is the same bytes)
    from mapoffload.vllm._offloader import check_still_mapped

    model = torch.nn.Module()
    model.w = _mapped_param(tmp_path)
    offloaded = dict(model.named_parameters())
    before = {n: p.data_ptr() for n, p in offloaded.items()}
    model.w = torch.nn.Parameter(model.w.data.contiguous(), requires_grad=False)
    check_still_mapped(model, offloaded, before)
    mapped = model.w
    model.w = torch.nn.Parameter(mapped.data.clone(), requires_grad=False)  # vLLM's CPU MoE prepack: an owned copy
    with pytest.raises(VllmLoadError, match=r"memory of their own \(w\)"):
        check_still_mapped(model, offloaded, before)
    del model.w  # removed outright (replace_parameter(layer, name, None))
    model.register_parameter("w", None)
    with pytest.raises(VllmLoadError, match=r"\(w\)"):
        check_still_mapped(model, offloaded, before)


class _FakeManager:
    """Stands in for LayerwiseOffloadManager: the n-th construction (``fail_at``) or hook registration fails."""

    made: list = []
    fail_at: int | None = None
    fail_hooks_at: int | None = None
    pinned_bytes = pageable_bytes = 0  # host copies: none (the next stacks' budget is left as it is)

    def __init__(self, model, layers, options, **kwargs) -> None:  # noqa: ANN001
        if len(type(self).made) == type(self).fail_at:
            raise RuntimeError("no device memory for the staging ring")
        assert isinstance(options, OffloadOptions) and not kwargs  # handed the options whole
        self.layers, self.closed, self.hooked, self.options = layers, False, False, options
        self.copier = SimpleNamespace(slots=2, staging_bytes=4096)
        self.parts = SimpleNamespace(layer_bytes=lambda i: 128)  # what tools ask the stack (manager.parts)
        type(self).made.append(self)

    def register_forward_hooks(self) -> None:
        if len(type(self).made) - 1 == type(self).fail_hooks_at:
            raise RuntimeError("hooks")
        self.hooked = True

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_manager(monkeypatch):
    import importlib

    # where the one front door (start_stacks) makes its managers
    manager = importlib.import_module("mapoffload.offload.manager")
    monkeypatch.setattr(manager, "LayerwiseOffloadManager", _FakeManager)
    monkeypatch.setattr(_FakeManager, "made", [])
    monkeypatch.setattr(_FakeManager, "fail_at", None)
    monkeypatch.setattr(_FakeManager, "fail_hooks_at", None)
    return _FakeManager


@pytest.mark.parametrize("where", ["fail_at", "fail_hooks_at"])
def test_managers_started_before_one_that_fails_are_closed(fake_manager, where):
    from mapoffload.vllm._offloader import start_managers

    taker = LayerTaker(OffloadRequest(4, None, _twin_options(), "offload_layers=4"))
    taker.wrap(iter(_layers(2)))
    taker.wrap(iter(_layers(2)))
    setattr(fake_manager, where, 1)  # the second stack's manager fails
    with pytest.raises(RuntimeError):
        start_managers(torch.nn.Module(), taker)
    assert fake_manager.made and all(m.closed for m in fake_manager.made)  # no hooks or copier threads left


@pytest.mark.parametrize("where", ["fail_at", "fail_hooks_at"])
def test_streaming_managers_started_before_one_that_fails_are_closed(fake_manager, monkeypatch, where):
    from mapoffload.vllm import _stream

    monkeypatch.setattr(_stream, "find_block_lists", lambda model: [("a", None), ("b", None)])
    setattr(fake_manager, where, 1)
    with pytest.raises(RuntimeError):
        _stream.stream_layers(torch.nn.Module(), OffloadOptions(device="cpu"))
    assert fake_manager.made and all(m.closed for m in fake_manager.made)


@pytest.mark.parametrize("extra,twin,needle", [
    ({"keep_mapping": False}, True, f"{ENV_CPU_TWIN}=1"),
    ({"prefetch_layers": 2, "keep_mapping": False}, False, "prefetch_layers=2"),
])
def test_device_path_keys_with_keep_mapping_false_are_refused_by_name(extra, twin, needle):
    # keep_mapping=false is vLLM's own loader and offloader: the keys of ours would be ignored silently
    with pytest.raises(VllmLoadError) as info:
        _parse(extra, twin)
    assert needle in str(info.value) and "keep_mapping=false" in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu-backend", "gpu-backend"])  # (no cuda marker)
def test_prefetch_layers_with_nothing_offloaded_is_refused_by_name(device):
    # as cpu_twin is: without offload_layers or --cpu-offload-gb there is nothing for the copier to stream ahead
    with pytest.raises(VllmLoadError, match=r"prefetch_layers=2 is for offloaded layers.*give offload_layers"):
        _request({"prefetch_layers": 2}, device=device)
    assert _request({"prefetch_layers": 2, "offload_layers": 1}, twin=True).prefetch == 2


class _MLAAttention(torch.nn.Module):
    """As vLLM 0.32's MLAAttention: its process_weights_after_loading derives W_UK/W_UV from kv_b_proj once."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(8, 4, bias=False)

    def process_weights_after_loading(self, act_dtype) -> None:  # noqa: ANN001
        self.W_UK = self.kv_b_proj.weight.data.clone()


def test_an_offloaded_layer_whose_post_processing_derives_from_its_weights_is_refused_by_name():
    # On a GPU the offloaded weights are hidden (a scratch) from post-processing: MLA would derive W_UK/W_UV
    # from the scratch, silently; streamed each forward, the derived copies would never follow anyway.
    from mapoffload.vllm._offloader import refuse_derived_weights

    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.mla_attn = _MLAAttention()
    layer.mlp = torch.nn.Linear(8, 8)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer, torch.nn.Linear(2, 2)])
    taker = LayerTaker(OffloadRequest(1, None, _twin_options(), "offload_layers=1"))
    taker.wrap(iter(model.layers))
    with pytest.raises(VllmLoadError, match=r"layers\.0\.self_attn\.mla_attn.*kv_b_proj.*offload_layers"):
        refuse_derived_weights(model, taker)
    plain = LayerTaker(OffloadRequest(1, None, _twin_options(), "offload_layers=1"))
    plain.wrap(iter(_layers(2)))
    refuse_derived_weights(torch.nn.ModuleList(plain.stacks[0]), plain)  # nothing derived: fine


def test_the_offloader_before_is_put_back_when_building_the_model_raises(monkeypatch):
    import sys
    import types

    from mapoffload.vllm._offloader import installed

    state = {"offloader": "vllm's own"}
    base = types.ModuleType("vllm.model_executor.offloader.base")  # a stand-in for vLLM's module-level global
    base.get_offloader = lambda: state["offloader"]
    base.set_offloader = lambda o: state.__setitem__("offloader", o)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.offloader.base", base)
    with pytest.raises(RuntimeError, match="create_model"):
        with installed("ours"):
            assert state["offloader"] == "ours"
            raise RuntimeError("create_model failed")
    assert state["offloader"] == "vllm's own"


def test_a_prefetch_deeper_than_the_offloaded_stack_is_bounded_and_the_log_says_so(fake_manager, caplog):
    import logging

    from mapoffload.vllm._offloader import start_managers

    taker = LayerTaker(OffloadRequest(2, None, _twin_options(5), "offload_layers=2"))
    taker.wrap(iter(_layers(4)))
    with caplog.at_level(logging.INFO, logger="mapoffload"):
        start_managers(torch.nn.Module(), taker)
    assert fake_manager.made[0].options == _twin_options(1)  # nothing beyond the stack to stream ahead
    line = next(r.getMessage() for r in caplog.records if r.name == "mapoffload" and "prefetch depth" in r.getMessage())
    assert "prefetch depth 1 (prefetch_layers=5: 2 layers offloaded)" in line


def test_asking_more_layers_than_the_model_builds_offloads_them_all_and_warns_naming_the_key(caplog):
    import logging

    from mapoffload.vllm._offloader import note_shortfall

    taker = LayerTaker(OffloadRequest(10, None, _twin_options(), "offload_layers=10"))
    taker.wrap(iter(_layers(3)))
    with caplog.at_level(logging.WARNING, logger="mapoffload"):
        note_shortfall(taker, "LlamaForCausalLM")
    assert taker.layers == 3
    assert any("offload_layers=10" in r.getMessage() and "3 decoder layers" in r.getMessage()
               for r in caplog.records if r.name == "mapoffload" and r.levelno == logging.WARNING)
    caplog.clear()
    enough = LayerTaker(OffloadRequest(2, None, _twin_options(), "offload_layers=2"))
    enough.wrap(iter(_layers(3)))
    with caplog.at_level(logging.WARNING, logger="mapoffload"):
        note_shortfall(enough, "LlamaForCausalLM")
    assert not caplog.records


def test_the_offload_backend_vllm_would_choose_decides(cuda_seen):
    # vLLM's create_offloader: offload_backend="uva" ignores the prefetch fields (with a warning), "prefetch"
    # the UVA ones; "auto" prefers prefetch when both are set
    assert _request({}, device="cuda", gib=1, group=2, backend="uva").max_bytes == 1 << 30
    with pytest.raises(VllmLoadError, match="offload_group_size=2"):
        _request({}, device="cuda", gib=1, group=2)
    with pytest.raises(VllmLoadError, match=r"prefetch offloader \(offload_group_size=2\)"):
        _request({}, device="cuda", gib=1, group=2, backend="prefetch")
