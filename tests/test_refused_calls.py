"""A refused call on an offloaded model changes nothing: ``model.to(dtype)``
raises before converting any tensor, a second offload names the first."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mapoffload import LayerwiseOffloadManager, MappedRegions, OffloadedWeight, empty_weights, load_checkpoint
from mapoffload.offload.placeholder import AlreadyOffloadedError
from models import TinyModel, saveable_state


@pytest.fixture
def mapped_model(tmp_path):
    """A TinyModel in bfloat16, loaded on its file mapping."""
    torch.manual_seed(0)
    ref = TinyModel(width=32, layers=3).to(torch.bfloat16)
    path = tmp_path / "tiny.safetensors"
    save_file(saveable_state(ref), path)
    with empty_weights():
        model = TinyModel(width=32, layers=3).to(torch.bfloat16)
    load_checkpoint(model, path, keep_mapping=True)
    return model.eval()


def _snapshot(model):
    return {n: (p, p.dtype, p.data_ptr() if not isinstance(p, OffloadedWeight) else None)
            for n, p in model.named_parameters(remove_duplicate=False)} | {
        f"buffer {n}": (b, b.dtype, b.data_ptr()) for n, b in model.named_buffers()}


def _forward(model):
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 3]]))


@pytest.mark.parametrize("convert", [
    lambda m: m.to(torch.float32),
    lambda m: m.float(),
    lambda m: m.half(),
    lambda m: m.to("cpu", torch.float16),
    lambda m: m.blocks.to(torch.float32),
    lambda m: m.blocks[1].to(torch.float32),
])
@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_a_refused_conversion_changes_nothing(mapped_model, convert, twin):
    model = mapped_model
    expected = _forward(model)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin) as mgr:
        mgr.register_forward_hooks()
        before = _snapshot(model)
        with pytest.raises(RuntimeError, match=r"is offloaded by a LayerwiseOffloadManager and was converted"):
            convert(model)
        after = _snapshot(model)
        assert after.keys() == before.keys()
        for name, (obj, dtype, ptr) in before.items():
            assert after[name][0] is obj and after[name][1] == dtype and after[name][2] == ptr, name
        assert model.embed.weight.dtype == torch.bfloat16  # converted first before the fix
        assert torch.equal(_forward(model), expected)
    assert torch.equal(_forward(model), expected)  # closed: whole, no dtype mismatch


def test_an_allowed_conversion_still_runs(mapped_model):
    model = mapped_model
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        weight = model.blocks[0].fc1.weight
        model.to("cpu")  # a device move the manager owns: the weights stay on their mapping
        model.to(torch.bfloat16)  # the same dtype: nothing to refuse
        # In place the slots keep the real parameters, untouched by the conversion.
        assert model.blocks[0].fc1.weight is weight and not isinstance(weight, OffloadedWeight)
        assert MappedRegions().holds(weight)
        assert "_apply" in model.__dict__
    # Closed: the guard is gone and the model converts as any module does.
    assert "_apply" not in model.__dict__ and all("_apply" not in m.__dict__ for m in model.modules())
    model.to(torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_two_managers_on_one_model_share_the_guard(mapped_model):
    model = mapped_model
    first = LayerwiseOffloadManager(model, model.blocks[:1], device="cpu")
    second = LayerwiseOffloadManager(model, model.blocks[1:], device="cpu")
    first.close()
    with pytest.raises(RuntimeError, match="was converted"):
        model.float()
    assert model.embed.weight.dtype == torch.bfloat16
    second.close()
    model.float()


def test_a_second_manager_names_the_first(mapped_model):
    with LayerwiseOffloadManager(mapped_model, "blocks", device="cpu") as first:
        with pytest.raises(AlreadyOffloadedError, match=r"already offloaded .*LayerwiseOffloadManager\(3 layers"
                           r".*close its handle"):
            LayerwiseOffloadManager(mapped_model, "blocks", device="cpu")
        first.load_all_layers()  # loaded: the real parameters in the slots, still taken
        with pytest.raises(AlreadyOffloadedError, match="already offloaded"):
            LayerwiseOffloadManager(mapped_model, "blocks", device="cpu")
    LayerwiseOffloadManager(mapped_model, "blocks", device="cpu").close()  # closed: free again


def test_offloading_an_offloaded_model_says_close_its_handle_first(mapped_model):
    import mapoffload

    expected = _forward(mapped_model)
    handle = mapoffload.offload(mapped_model, device="cpu", layers="blocks")
    with pytest.raises(AlreadyOffloadedError, match=r"TinyModel is already offloaded by LayerwiseOffloadManager"
                       r".*close its handle first"):
        mapoffload.offload(mapped_model, device="cpu", layers="blocks")
    with pytest.raises(RuntimeError, match="was converted"):
        mapped_model.to(torch.float32)
    assert torch.equal(_forward(mapped_model), expected)
    handle.close()
    assert torch.equal(_forward(mapped_model), expected)
    mapoffload.offload(mapped_model, device="cpu", layers="blocks").close()
