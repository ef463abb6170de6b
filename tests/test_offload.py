"""LayerwiseOffloadManager through its CPU twin (and CUDA where present)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save_file

from mapoffload.offload.sequencer import checksum
from mapoffload import LayerwiseOffloadManager, MappedRegions, cow_report, empty_weights, load_checkpoint
from mapoffload.offload.placeholder import OffloadedWeight
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB

from models import TinyModel, saveable_state

IDS = torch.arange(24).reshape(3, 8) % 64
GIB = 1 << 30


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return TinyModel(width=32, layers=5)


@pytest.fixture
def ckpt(tmp_path, reference):
    path = tmp_path / "model.safetensors"
    save_file(saveable_state(reference), path)
    return path


def mapped_model(ckpt):
    with empty_weights():
        model = TinyModel(width=32, layers=5)
    load_checkpoint(model, ckpt, keep_mapping=True)
    return model


def expected_output(reference):
    with torch.no_grad():
        return reference(IDS)


def file_digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("resident", [0, 2])
def test_outputs_identical_and_only_resident_layers_hold_weights(ckpt, reference, prefetch, resident, twin):
    model = mapped_model(ckpt)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=prefetch,
                                  resident_layers=resident, host_store="mapped", cpu_twin=twin)
    mgr.register_forward_hooks()
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(model(IDS), expected_output(reference))
    regions = MappedRegions()
    for i, block in enumerate(model.blocks):
        real = not isinstance(block.fc1.weight, OffloadedWeight)
        if twin:  # the device path: only the resident layers hold their (device) weights
            assert real == (i < resident), (i, resident)
        else:  # in place nothing moves: every layer holds its mapped weights, loaded or not
            assert real and regions.holds(block.fc1.weight), i
            assert torch.equal(block.fc1.weight, reference.blocks[i].fc1.weight), i
        assert mgr.parts.is_loaded(i) == (i < resident)
    assert mgr.mapped_bytes > 0 and mgr.pinned_bytes == 0
    mgr.close()


def test_one_layer_model(tmp_path):
    torch.manual_seed(1)
    ref = TinyModel(width=16, layers=1)
    path = tmp_path / "one.safetensors"
    save_file(saveable_state(ref), path)
    with empty_weights():
        model = TinyModel(width=16, layers=1)
    load_checkpoint(model, path, keep_mapping=True)
    mgr = LayerwiseOffloadManager(model, model.blocks, device="cpu", prefetch_layers=3)
    mgr.register_forward_hooks()
    with torch.inference_mode():
        assert torch.equal(model(IDS % 64), ref(IDS % 64))


@pytest.mark.parametrize("order", ["reversed", "skipped", "repeated"])
def test_out_of_order_execution(ckpt, reference, order):
    model = mapped_model(ckpt)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=2)
    mgr.register_forward_hooks()
    sequence = {"reversed": [4, 3, 2, 1, 0], "skipped": [0, 2, 4], "repeated": [1, 1, 3, 0]}[order]
    x_ref = x = reference.embed(IDS).detach()
    with torch.no_grad():
        for i in sequence:
            x = model.blocks[i](x)
            x_ref = reference.blocks[i](x_ref)
    assert torch.equal(x, x_ref)
    assert not any(mgr.parts.is_loaded(i) for i in range(5))


def test_mapped_stores_are_views_and_anonymous_bytes_do_not_grow(ckpt, reference):
    model = mapped_model(ckpt)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="auto", available_bytes=GIB)
    assert mgr.mapped_bytes == sum(p.nbytes for p in reference.blocks.parameters())
    hosts = [t for _, t in mgr.iter_cpu_weights()]
    assert all(MappedRegions().classify(hosts))
    before = cow_report(hosts).anonymous_bytes
    mgr.register_forward_hooks()
    with torch.no_grad():
        for _ in range(10):
            model(IDS)
    assert cow_report(hosts).anonymous_bytes == before == 0


def test_sync_skips_mapped_and_update_never_writes_the_file(ckpt, reference):
    digest = file_digest(ckpt)
    model = mapped_model(ckpt)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="mapped", cpu_twin=True)
    mgr.prefetch_layer(0, non_blocking=False)
    model.blocks[0].fc1.weight.data.add_(1.0)  # device copy changes
    mgr.sync_layer_to_cpu(0)
    name = "blocks.0.fc1.weight"
    host = dict(mgr.iter_cpu_weights())[name]
    assert torch.equal(host, reference.blocks[0].fc1.weight)  # mapped weight untouched
    assert cow_report([host]).anonymous_bytes == 0
    new = torch.full_like(reference.blocks[0].fc1.weight, 0.5)
    mgr.update_cpu_weights({name: new})
    assert mgr.parts.store_of(name) == "strided"  # now an owned tensor
    assert torch.equal(model.blocks[0].fc1.weight, new)  # loaded layer updated too
    mgr.release_layer(0)
    mgr.prefetch_layer(0, non_blocking=False)
    assert torch.equal(model.blocks[0].fc1.weight, new)
    assert file_digest(ckpt) == digest
    with pytest.raises(KeyError, match="not a weight managed"):
        mgr.update_cpu_weights({"embed.weight": torch.zeros(1)})


def test_sync_writes_back_copied_stores(reference):
    model = TinyModel(width=32, layers=5)
    model.load_state_dict(reference.state_dict())
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="pageable")
    mgr.prefetch_layer(1, non_blocking=False)
    model.blocks[1].fc2.bias.data.fill_(3.0)
    mgr.sync_layer_to_cpu(1)
    assert torch.equal(dict(mgr.iter_cpu_weights())["blocks.1.fc2.bias"], torch.full((32,), 3.0))


def test_checksums_agree_between_mapped_and_copied(ckpt, reference):
    m1 = LayerwiseOffloadManager(mapped_model(ckpt), "blocks", device="cpu", host_store="mapped")
    copied = TinyModel(width=32, layers=5)
    copied.load_state_dict(reference.state_dict())
    m2 = LayerwiseOffloadManager(copied, "blocks", device="cpu", host_store="pageable")
    assert m1.mapped_bytes > 0 and m2.mapped_bytes == 0
    assert checksum(m1.iter_cpu_weights()) == checksum(m2.iter_cpu_weights())
    names = [n for n, _ in m1.iter_cpu_weights()]
    assert "blocks.4.fc2.weight" in names and len(names) == 5 * 6


def test_non_contiguous_weights_keep_their_strides(reference):
    model = TinyModel(width=32, layers=2)
    model.load_state_dict(reference.state_dict(), strict=False)
    w = model.blocks[1].fc1.weight
    t = torch.randn(w.shape[1], w.shape[0]).t()  # transposed storage
    model.blocks[1].fc1.weight = torch.nn.Parameter(t)
    expected_stride = t.stride()
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    assert mgr.parts.store_of("blocks.1.fc1.weight") == "strided"
    mgr.prefetch_layer(1, non_blocking=False)
    assert model.blocks[1].fc1.weight.stride() == expected_stride
    assert torch.equal(model.blocks[1].fc1.weight, t)


def test_tied_weights_inside_a_layer():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(3)
    stack = torch.nn.Sequential(Tied(), Tied())
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = stack(x)
    mgr = LayerwiseOffloadManager(stack, stack, device="cpu")
    names = [n for n, _ in mgr.iter_cpu_weights()]
    assert "0.a.weight" in names and "0.b.weight" in names
    mgr.register_forward_hooks()
    with torch.no_grad():
        assert torch.equal(stack(x), expected)
    assert stack[0].a.weight is stack[0].b.weight


def test_layer_path_errors():
    model = TinyModel(layers=2)
    with pytest.raises(AttributeError, match="'encoder'"):
        LayerwiseOffloadManager(model, "encoder.layer", device="cpu")
    with pytest.raises(TypeError, match="ModuleList"):
        LayerwiseOffloadManager(model, "embed", device="cpu")
    with pytest.raises(ValueError, match="host_store"):
        LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="disk")


def test_gradients_raise_a_clear_error_on_the_device_path(reference):
    from mapoffload import OffloadedGradientError

    model = TinyModel(width=32, layers=5)
    model.load_state_dict(reference.state_dict())
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True)  # in place they are exact
    mgr.register_forward_hooks()
    with pytest.raises(OffloadedGradientError, match="inference") as info:
        model(IDS)
    assert info.value.reason == "weights require grad" and info.value.name == "blocks.0"
    mgr.remove_forward_hooks()


def test_host_store_choice_follows_the_budget(ckpt, reference, monkeypatch):
    weights = sum(p.nbytes for p in reference.blocks.parameters())
    # Plenty of memory: copies fit, so mapped weights are consolidated (pageable on CPU).
    rich = LayerwiseOffloadManager(mapped_model(ckpt), "blocks", device="cpu", cpu_twin=True, available_bytes=64 * GIB)
    assert rich.mapped_bytes == 0 and rich.pageable_bytes == weights
    # Copies would not fit: weights stay on the mapping.
    poor = LayerwiseOffloadManager(mapped_model(ckpt), "blocks", device="cpu", cpu_twin=True, available_bytes=GIB)
    assert poor.mapped_bytes == weights and poor.pageable_bytes == 0
    # The environment override drives the default budget.
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "1")
    env = LayerwiseOffloadManager(mapped_model(ckpt), "blocks", device="cpu", cpu_twin=True)
    assert env.mapped_bytes == weights
    # Forced choices.
    forced = LayerwiseOffloadManager(mapped_model(ckpt), "blocks", device="cpu", cpu_twin=True, host_store="pageable")
    assert forced.mapped_bytes == 0
    anon = TinyModel(width=32, layers=5)
    anon.load_state_dict(reference.state_dict())
    m = LayerwiseOffloadManager(anon, "blocks", device="cpu", cpu_twin=True, host_store="mapped")
    assert m.mapped_bytes == 0 and m.pageable_bytes == weights  # nothing on a mapping to keep
    # On the CPU itself a copy buys nothing: weights stay where they are, however rich the host.
    in_place = LayerwiseOffloadManager(mapped_model(ckpt), "blocks", device="cpu", available_bytes=64 * GIB)
    assert in_place.mapped_bytes == weights and in_place.pageable_bytes == 0 and in_place.copier is None
    anon2 = TinyModel(width=32, layers=5)
    anon2.load_state_dict(reference.state_dict())
    ptrs = {p.data_ptr() for p in anon2.blocks.parameters()}
    owned = LayerwiseOffloadManager(anon2, "blocks", device="cpu")
    assert owned.pageable_bytes == weights  # the model's own tensors, not copies of them
    assert {t.data_ptr() for _, t in owned.iter_cpu_weights()} == ptrs


def test_device_buffers_are_reused_and_accounted(ckpt):
    model = mapped_model(ckpt)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=1)
    mgr.register_forward_hooks()
    with torch.no_grad():
        model(IDS)
    peak = mgr.peak_device_bytes
    held = mgr.parts.device_bytes
    with torch.no_grad():
        for _ in range(5):
            model(IDS)
    assert mgr.peak_device_bytes == peak and mgr.parts.device_bytes == held  # no new allocations
    per_layer = max(sum(s.dev_bytes.values()) for s in mgr.parts.sequencer.stores)
    assert peak <= 3 * per_layer
    mgr.load_all_layers()
    assert all(mgr.parts.is_loaded(i) for i in range(5))
    mgr.release_all()
    assert not any(mgr.parts.is_loaded(i) for i in range(5))


@pytest.mark.cuda
@pytest.mark.parametrize("host_store", ["mapped", "pinned", "pageable"])
def test_cuda_outputs_match(ckpt, reference, host_store):
    model = mapped_model(ckpt)
    model.embed.to("cuda")
    mgr = LayerwiseOffloadManager(model, "blocks", device="cuda", prefetch_layers=2, host_store=host_store)
    mgr.register_forward_hooks()
    ref = TinyModel(width=32, layers=5).cuda()
    ref.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for _ in range(3):
            assert torch.allclose(model(IDS.cuda()), ref(IDS.cuda()))
    if host_store == "pinned":
        assert mgr.pinned_bytes > 0
    mgr.close()
