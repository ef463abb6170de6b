"""Read uncached in place (``reads="uncached"``, ``device="cpu"``): a layer computes from views of a reused
buffer. Three ways the views went wrong silently, found by a hostile review; each test failed before its fix.

- A weight at a file offset that is not a multiple of its element size (a hand-written safetensors file: a
  float32 tensor right after a 3-byte int8 one) was viewed a few bytes early in the buffer: garbage or NaN.
  Such a weight computes from its mapping.
- A write through ``.data`` (which moves no version counter) into a layer's host weight while the layer
  was read ahead was ignored for that forward: the layer computed from the file's bytes. Whether the
  layer's pages were written in place is checked again when it is bound.
- A view of a weight kept past its forward (a hook recording ``weight.detach()``, a module caching
  ``weight.t()``) pointed into a buffer the next layers were read into. A buffer some view still holds is
  left to that view and not reused.
"""

from __future__ import annotations

import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
from packed_safetensors import write_packed

W, N = 64, 4


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.zeros(3, dtype=torch.int8), requires_grad=False)
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + self.s.float().sum()


class Stack(nn.Module):
    def __init__(self, block=lambda: nn.Linear(W, W)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(N))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _mapped(make, path):
    with empty_weights():
        model = make()
    load_checkpoint(model, str(path), keep_mapping=True)
    return model


def _three_forwards_uncached(model, x, want, also=lambda: True) -> None:
    """Three forwards with every streamed layer read uncached in place, each equal to ``want`` (and
    ``also()`` after each); something was read uncached."""
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached", page_cache_bytes=0) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), want)
                assert also()
        assert mgr.parts.loads.source.reader.stats()["reads"] > 0


def test_a_weight_at_an_offset_not_a_multiple_of_its_element_size_computes_its_own_values(tmp_file_dir):
    torch.manual_seed(0)
    ref = Stack(Odd)
    with torch.no_grad():
        for b in ref.blocks:
            b.s.copy_(torch.tensor([1, -2, 3], dtype=torch.int8))
    sd = ref.state_dict()
    path = tmp_file_dir / "odd.safetensors"
    write_packed(path, {k: sd[k] for i in range(N) for k in (f"blocks.{i}.s", f"blocks.{i}.lin.weight",
                                                          f"blocks.{i}.lin.bias")})
    model = _mapped(lambda: Stack(Odd), path)
    assert model.blocks[0].lin.weight.data_ptr() % 4  # the case: a float32 weight at an odd address
    x = torch.randn(2, W)
    with torch.no_grad():
        want = ref(x)
    _three_forwards_uncached(model, x, want)  # the aligned weights from the buffer, the odd one from its mapping


def _square(tmp_file_dir):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = Stack()
    path = tmp_file_dir / "m.safetensors"
    save_file(ref.state_dict(), str(path))
    return ref, path


def test_a_data_write_into_a_layer_read_ahead_is_computed_with(tmp_file_dir):
    ref, path = _square(tmp_file_dir)
    model = _mapped(Stack, path)
    hosts = {id(m): m.blocks[1].weight.data_ptr() for m in (ref, model)}

    def merge(root):  # an online merge into the next layer, through .data (no version counted)
        def hook(module, args, output):
            assert root.blocks[1].weight.data_ptr() == hosts[id(root)]  # the host store, not a buffer
            root.blocks[1].weight.data.add_(0.5)
        return hook

    for m in (ref, model):
        m.blocks[0].register_forward_hook(merge(m))
    x = torch.randn(2, W)
    layer = (W * W + W) * 4
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached", page_cache_bytes=3 * layer,
                                 prefetch_layers=1) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), ref(x))


def test_a_view_of_a_weight_kept_past_its_forward_keeps_its_values(tmp_file_dir):
    ref, path = _square(tmp_file_dir)
    model = _mapped(Stack, path)

    class Cached(nn.Linear):  # caches a view of its weight at its first call, as some modules do
        def forward(self, x):
            if getattr(self, "wt", None) is None:
                self.wt = self.weight.t()
            return x @ self.wt + self.bias

    model.blocks[3].__class__ = Cached
    kept = {}
    model.blocks[2].register_forward_hook(lambda m, a, o: kept.__setitem__("w", m.weight.detach()))
    x = torch.randn(2, W)
    with torch.no_grad():
        want = ref(x)
    _three_forwards_uncached(model, x, want, lambda: torch.equal(kept["w"], ref.blocks[2].weight))
    with torch.no_grad():
        assert torch.equal(model(x), want)  # after close(): the cached view still holds layer 3's weight


def test_without_such_views_every_buffer_goes_back_to_be_reused(tmp_file_dir, monkeypatch):
    """The check that keeps a viewed buffer away finds no view in a plain run, in place and on the CPU twin
    of the device path: every buffer released is reused."""
    import pytest

    from mapoffload.pagecache import uncached_read

    viewed = []
    give_back = uncached_read.UncachedReader._give_back
    monkeypatch.setattr(uncached_read.UncachedReader, "_give_back",
                        lambda self, slab: viewed.append(slab.viewed()) or give_back(self, slab))
    ref, path = _square(tmp_file_dir)
    x = torch.randn(2, W)
    for twin in ({}, {"cpu_twin": True, "host_store": "mapped"}):
        model = _mapped(Stack, path)
        with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached", page_cache_bytes=0,
                                     **twin) as mgr:
            mgr.register_forward_hooks()
            with torch.no_grad():
                for _ in range(3):
                    assert torch.equal(model(x), ref(x))
        if not viewed:
            pytest.fail(f"nothing was read uncached ({twin})")
        assert not any(viewed), (twin, viewed)
        viewed.clear()
