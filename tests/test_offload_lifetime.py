"""The manager on the paths deployments take: layers that mix stores within
one dtype, weights tied outside the stack, runs without hooks, faults while
streaming, the model given back whole."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from mapoffload import Copier, LayerwiseOffloadManager, MappingFaultError, empty_weights, load_checkpoint
from mapoffload.offload.placeholder import OffloadedWeight

from models import IDS, TinyModel, mixed_model, no_grad_forward, saveable_state



@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return TinyModel(width=32, layers=4)


def test_mixed_stores_in_one_dtype_compute_right_and_move_only_their_bytes(tmp_path, reference):
    model = mixed_model(tmp_path, reference)
    want = no_grad_forward(reference)
    copier = Copier("cpu", threads=3, staging_bytes=4096, slots=2)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="mapped", copier=copier, cpu_twin=True)
    stores = {mgr.parts.store_of(n) for n in ("blocks.0.fc1.weight", "blocks.0.norm.weight", "blocks.1.fc2.weight")}
    assert stores == {"mapped", "consolidated", "strided"}
    mgr.register_forward_hooks()
    for _ in range(5):
        assert torch.equal(no_grad_forward(model), want)
    # A weight made strided by update_cpu_weights joins the mix.
    name = "blocks.2.fc1.weight"
    mgr.update_cpu_weights({name: reference.blocks[2].fc1.weight})
    assert mgr.parts.store_of(name) == "strided"
    for _ in range(3):
        assert torch.equal(no_grad_forward(model), want)
    # Each prefetch moves the layer's own bytes, and each consolidated host
    # buffer holds only the consolidated weights.
    for i in range(4):
        before = copier.stats().bytes
        mgr.prefetch_layer(i, non_blocking=False)
        moved = copier.stats().bytes - before
        assert moved <= 1.02 * mgr.parts.layer_bytes(i) + 64 * 1024, (i, moved, mgr.parts.layer_bytes(i))
        mgr.release_layer(i)
        store = mgr.parts.sequencer.stores[i]
        consolidated = [w for w in store.weights if w.store == "consolidated"]
        held = sum(b.numel() for b in store.consolidated.values())
        assert held <= sum(w.nbytes for w in consolidated) + 256 * len(consolidated)
    mgr.close()
    copier.close()


def test_a_layer_run_without_hooks_fails_loudly_naming_the_layer(reference):
    model = TinyModel(width=32, layers=4)
    model.load_state_dict(reference.state_dict())
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True)  # the device path
    w = model.blocks[2].fc1.weight
    assert isinstance(w, OffloadedWeight)
    assert w.shape == reference.blocks[2].fc1.weight.shape and w.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"blocks\.0\.norm\.weight .* layer 0 .*register_forward_hooks"):
        no_grad_forward(model)
    with pytest.raises(RuntimeError, match=r"blocks\.0\.norm\.weight is offloaded .* used by TensorBase\.detach"):
        model.state_dict()
    model.to("cpu")  # a whole-model move leaves the managed weights to the manager
    mgr.prefetch_layer(2, non_blocking=False)
    assert torch.equal(model.blocks[2].fc1.weight, reference.blocks[2].fc1.weight)
    mgr.close()
    # In place nothing moves: without hooks the model runs from its host tensors as it is.
    with LayerwiseOffloadManager(model, "blocks", device="cpu"):
        assert not isinstance(model.blocks[2].fc1.weight, OffloadedWeight)
        assert torch.equal(no_grad_forward(model), no_grad_forward(reference))
        assert model.state_dict().keys() == reference.state_dict().keys()


def test_close_and_remove_hooks_give_the_model_back_whole(reference):
    model = TinyModel(width=32, layers=4)
    model.load_state_dict(reference.state_dict())
    params = dict(model.named_parameters())
    want = no_grad_forward(reference)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=2) as mgr:
        mgr.register_forward_hooks()
        assert torch.equal(no_grad_forward(model), want)
        mgr.remove_forward_hooks()
        assert torch.equal(no_grad_forward(model), want)  # usable without the manager
        mgr.register_forward_hooks()
        assert torch.equal(no_grad_forward(model), want)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())  # the model's own parameter objects
    for k, v in reference.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert torch.equal(no_grad_forward(model), want)
    # A second manager on the returned model sees real weights.
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as again:
        again.register_forward_hooks()
        assert torch.equal(no_grad_forward(model), want)
    mgr.close()  # idempotent


def test_weight_tied_outside_the_stack_is_left_alone_and_right(reference):
    model = TinyModel(width=32, layers=3)
    model.load_state_dict(reference.state_dict(), strict=False)
    # The head shares its weight with the last block's fc1 (64x32 both).
    model.blocks[2].fc1.weight = model.head.weight
    with torch.no_grad():
        want = model(IDS)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        assert mgr.unmanaged == ["blocks.2.fc1.weight"]
        mgr.register_forward_hooks()
        assert torch.equal(no_grad_forward(model), want)
        assert torch.equal(no_grad_forward(model), want)
        assert model.head.weight is model.blocks[2].fc1.weight


def test_load_all_layers_keeps_them_through_a_forward(reference):
    model = TinyModel(width=32, layers=4)
    model.load_state_dict(reference.state_dict())
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        mgr.load_all_layers()
        assert torch.equal(no_grad_forward(model), no_grad_forward(reference))
        assert all(mgr.parts.is_loaded(i) for i in range(4))
        mgr.release_all()
        assert not any(mgr.parts.is_loaded(i) for i in range(4))
        assert torch.equal(no_grad_forward(model), no_grad_forward(reference))
        assert not any(mgr.parts.is_loaded(i) for i in range(4))


def test_fault_while_streaming_releases_the_layer_and_recovers(tmp_path, reference):
    path = tmp_path / "model.safetensors"
    save_file(saveable_state(reference), path)
    good = path.read_bytes()
    with empty_weights():
        model = TinyModel(width=32, layers=4)
    load_checkpoint(model, path, keep_mapping=True)
    # Only the streamed layers stay on the mapping: a read of the truncated
    # file anywhere else would be a real crash, as it is without the library.
    model.embed.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    model.head.weight = model.embed.weight
    want = no_grad_forward(reference)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="mapped", prefetch_layers=2)
    mgr.register_forward_hooks()
    assert torch.equal(no_grad_forward(model), want)
    os.truncate(path, 4096)  # the file goes away under the mapping
    with pytest.raises(MappingFaultError) as info:
        no_grad_forward(model)
    assert info.value.filename == str(path)
    assert not any(mgr.parts.is_loaded(i) for i in range(4))
    with open(path, "r+b") as f:  # whole again, same inode: the mapping sees it
        f.write(good)
    for _ in range(2):
        assert torch.equal(no_grad_forward(model), want)
    mgr.close()
    assert torch.equal(no_grad_forward(model), want)


def test_placeholders_report_the_managers_device_and_a_second_manager_is_refused(reference):
    model = TinyModel(width=32, layers=4)
    model.load_state_dict(reference.state_dict())
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True) as mgr:  # the device path
        w = model.blocks[0].fc1.weight
        assert isinstance(w, OffloadedWeight)
        assert w.device == torch.device("cpu") and not w.is_meta and w.get_device() == -1
        assert {p.device for p in model.parameters()} == {torch.device("cpu")}  # model.device stays right
        mgr.load_all_layers()  # loaded: real parameters in the slots
        with pytest.raises(ValueError, match="managed by another LayerwiseOffloadManager"):
            LayerwiseOffloadManager(model, "blocks", device="cpu")
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:  # in place: real parameters all along
        with pytest.raises(ValueError, match="managed by another LayerwiseOffloadManager"):
            LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as again:  # closed: free to take
        again.register_forward_hooks()
        assert torch.equal(no_grad_forward(model), no_grad_forward(reference))


def test_building_copied_stores_never_holds_two_copies_of_the_model(monkeypatch):
    from mapoffload.offload import plan  # where the manager calls it from (imported by name there)

    torch.manual_seed(5)
    model = TinyModel(width=64, layers=4)
    old = {id(p): p.untyped_storage().data_ptr() for p in model.blocks.parameters()}
    still_old, built = [], []
    real = plan.build_consolidated

    def watched(layer, pin, **kwargs):
        real(layer, pin, **kwargs)
        built.append(layer)
        # Right after its store is built, a layer's parameters hold the store,
        # not their old tensors: those are freed layer by layer, never all at once.
        still_old.extend(w.names[0] for w in layer.weights if w.param.untyped_storage().data_ptr() == old[id(w.param)])

    monkeypatch.setattr(plan, "build_consolidated", watched)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="pageable")
    monkeypatch.undo()
    assert len(built) == 4  # the watcher saw every layer's store built (else this test checks nothing)
    assert still_old == []
    mgr.close()
