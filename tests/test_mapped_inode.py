"""Checks look at the mapped inode, not the path: a checkpoint replaced
atomically (a new, shorter file renamed over the path, as downloaders do)
leaves the mapped file whole, and forwards go on; a truncation of the mapped
file itself is refused with MappingFaultError naming it."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from mapoffload import LayerwiseOffloadManager, MappingFaultError

from stacks import Stack, mapped
@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    ref = Stack()
    path = tmp_path / "stack.safetensors"
    save_file(ref.state_dict(), path)
    x = torch.randn(3, 512)
    with torch.no_grad():
        want = ref(x)
    return path, x, want


@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_a_checkpoint_renamed_over_leaves_the_mapped_one_in_use(ckpt, twin):
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)
        new = path.with_suffix(".tmp")
        save_file({"blocks.0.bias": torch.zeros(4)}, new)  # far shorter
        os.replace(new, path)
        assert os.path.getsize(path) < 4096
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(model(x), want)  # the old inode is mapped, whole


def test_a_truncation_of_the_mapped_file_is_refused_naming_it(ckpt):
    path, x, _ = ckpt
    model = mapped(path)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    mgr.register_forward_hooks()
    # The same inode, cut: computing from it would be a SIGBUS.
    os.truncate(path, 4096)
    with pytest.raises(MappingFaultError, match="truncated") as info:
        with torch.no_grad():
            model(x)
    assert info.value.filename == str(path)
    mgr.close()
