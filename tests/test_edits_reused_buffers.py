"""Edits and outputs of layers that compute from a buffer the next layers reuse.

Found by a hostile review: in place with ``reads="uncached"`` a layer computes from views of an
``O_DIRECT`` buffer. A write into its weight there (a hook's online update, a resident layer edited
between forwards) was taken for a write into the host store and lost at the release, and a write into
the host store while the layer's bytes were being read uncached was overwritten by the file's bytes;
on every path with reused buffers (uncached in place, the CPU twin) a layer output that is a view of
its own weight (learned latents expanded) was overwritten by the next layers' weights. Each test
compares with the plain model given the same edits, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
from stacks import IN, OUT, Stack, mapped

LAYER = (OUT * IN + OUT) * 4


def plain(path):
    ref = Stack()
    ref.load_state_dict(load_file(path))
    return ref


def scaled(module, args, output):
    """A forward hook that updates the layer's own weight after it ran (an online update)."""
    with torch.no_grad():
        module.weight.mul_(1.5)


def test_a_hook_writing_the_weight_of_a_layer_read_uncached_keeps_its_write(ckpt):
    path, x, _ = ckpt
    ref, model = plain(path), mapped(path)
    for m in (ref, model):
        m.blocks[3].register_forward_hook(scaled)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached", page_cache_bytes=0) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), ref(x))
    assert torch.equal(model.blocks[3].weight, ref.blocks[3].weight)


def test_a_write_into_the_host_store_while_the_layer_is_read_uncached_is_what_computes(ckpt):
    path, x, _ = ckpt
    models = [plain(path), mapped(path)]
    for m in models:
        def doubled(module, args, output, m=m):  # layer 1 is read ahead as layer 0 computes
            with torch.no_grad():
                m.blocks[1].weight.mul_(2.0)

        m.blocks[0].register_forward_hook(doubled)
    ref, model = models
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached", page_cache_bytes=3 * LAYER,
                                 prefetch_layers=1) as mgr:
        assert mgr.residency.depth == 1 and 1 in mgr.residency.streamed
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), ref(x))


def test_a_resident_layer_read_uncached_and_edited_is_given_back_with_the_edit(ckpt):
    path, x, _ = ckpt
    ref, model = plain(path), mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached", page_cache_bytes=0,
                                 resident_layers=1) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
            for m in (ref, model):
                m.blocks[0].weight.mul_(2.0)
            assert torch.equal(model(x), ref(x))
    assert torch.equal(model.blocks[0].weight, ref.blocks[0].weight)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


class Latents(nn.Module):
    """A layer that returns a view of one of its weights beside its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lat = nn.Parameter(torch.randn(3, IN))
        self.lin = nn.Linear(IN, IN)

    def forward(self, x):
        return self.lin(x), self.lat.expand(2, 3, IN)


class LatentStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Latents() for _ in range(6))

    def forward(self, x):
        latents = []
        for block in self.blocks:
            x, lat = block(x)
            latents.append(lat)
        return torch.stack(latents), x


@pytest.mark.parametrize("how", [{"reads": "uncached"}, {"cpu_twin": True, "reads": "mapping"}],
                         ids=["uncached in place", "cpu twin"])
def test_an_output_that_views_the_layers_weight_outlives_the_buffer(tmp_file_dir, how):
    torch.manual_seed(1)
    ref = LatentStack()
    path = tmp_file_dir / "latents.safetensors"
    save_file(ref.state_dict(), path)
    x = torch.randn(3, IN)
    with empty_weights():
        model = LatentStack()
    load_checkpoint(model, path, keep_mapping=True)
    want = ref(x)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=0, **how) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                got = model(x)
                assert all(torch.equal(a, b) for a, b in zip(got, want))
