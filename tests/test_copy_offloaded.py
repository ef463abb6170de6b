"""Objects users copy and keep (issue 36): an offloaded model is not deep-copied or pickled while
offloaded - its hooks would run the original's layers - and the refusal names the call that gives
the model back; after that call the copy is a plain model with its own weights. The
``model.mapoffload_handle`` attribute names the live handle; ``close()`` sets it to None."""

from __future__ import annotations

import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from hf_models import save  # noqa: E402
from mapoffload import LayerwiseOffloadManager  # noqa: E402
from mapoffload.offload.hooks import OffloadedCopyError  # noqa: E402
from stacks import mapped  # noqa: E402

IDS = torch.tensor([[3, 17, 42, 5, 88, 9, 61]])
COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": pickle.dumps,
    "torch.save": lambda m: torch.save(m, io.BytesIO()),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-copy")
    return save("llama", torch.float32, folder), str(folder)


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_a_managed_model_is_not_copied_and_says_close_first(ckpt, how, twin):
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        with pytest.raises(RuntimeError, match=r"was (copied|pickled).*Call manager\.close\(\) first"):
            COPIES[how](model)
        with pytest.raises(RuntimeError, match=r"manager\.close\(\) first"):
            COPIES[how](model.blocks[4])  # one layer alone: its hooks too
        with torch.no_grad():
            assert torch.equal(model(x), want)  # the refusal left nothing half done
    twin_model = copy.deepcopy(model)  # closed: a plain model with its own weights
    pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(twin_model(x), want)
    assert twin_model.blocks[0].weight.data_ptr() != model.blocks[0].weight.data_ptr()


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("entry", ["from_pretrained", "offload"])
def test_an_offloaded_transformers_model_is_copied_after_close(llama, entry, how):
    cls, folder = llama
    if entry == "from_pretrained":
        model = mapoffload.from_pretrained(cls, folder, device="cpu")
        call = r"model\.mapoffload_handle\.close\(\)"
    else:
        model = cls.from_pretrained(folder).eval()
        mapoffload.offload(model, device="cpu")
        call = r"handle\.close\(\)"
    with pytest.raises(RuntimeError, match=rf"Call {call} first"):
        COPIES[how](model)
    with torch.no_grad():
        want = model(IDS).logits
    model.mapoffload_handle.close()
    assert model.mapoffload_handle is None  # not left naming the closed handle
    copied = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(copied(IDS).logits, want)
        assert torch.equal(restored(IDS).logits, want)


def test_the_handle_attribute_names_the_live_handle(llama):
    cls, folder = llama
    model = mapoffload.from_pretrained(cls, folder, device="cpu")
    first = model.mapoffload_handle
    first.close()
    assert model.mapoffload_handle is None  # not left naming a closed handle
    second = mapoffload.offload(model, device="cpu")
    assert model.mapoffload_handle is second
    first.close()  # closing the old one again takes nothing from the live one
    assert model.mapoffload_handle is second
    second.close()
    assert model.mapoffload_handle is None
    with LayerwiseOffloadManager(model, "model.layers", device="cpu"):
        assert model.mapoffload_handle is None  # a manager made directly is its own handle


@pytest.mark.parametrize("loaded", [False, True], ids=["released", "all-loaded"])
@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_share_memory_is_refused_with_true_words(ckpt, twin, loaded):
    # In place every layer is loaded, yet share_memory() said "layer 0 is not loaded ... prefetch_layer(0,
    # non_blocking=False)", which changed nothing: moving a weight into shared memory copies it (a mapped
    # weight is the file's private pages), where the offload keeps it on its mapping.
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        if loaded:
            mgr.load_all_layers()
        with pytest.raises(OffloadedCopyError, match=r"share_memory\(\).*Call manager\.close\(\) first") \
                as err:
            model.share_memory()
        assert "not loaded" not in str(err.value) and "prefetch_layer" not in str(err.value)
        mgr.release_all()
        with torch.no_grad():
            assert torch.equal(model(x), want)  # the refusal left nothing half done
        assert not model.blocks[0].weight.is_shared()
    model.share_memory()  # closed: a plain model, its own weights copied into shared memory
    with torch.no_grad():
        assert torch.equal(model(x), want)
