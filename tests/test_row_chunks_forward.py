"""A linear computed over chunks of its rows computes what its forward would, or computes whole.

Found by a hostile review (issue 43's chunks): a forward patched onto ``nn.Linear`` itself was taken for
torch's own, and the chunks (``F.linear`` over rows) ran instead of it - the head and every chunked part
silently off; a fp32 precision set through torch's newer per-backend API made the chunks' kind of input
raise; a tensor subclass's input came back a plain tensor. The stack of ``test_attack_room`` under its
tight fake cap: its head and each block's projections compute in chunks.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fake_cgroups import fake_cap
from test_attack_room import IN_USE, MARGIN, W, checkpoint, engaged, plain, row_chunks


@pytest.fixture
def cap(tmp_path, monkeypatch):
    return fake_cap(tmp_path, monkeypatch, margin=MARGIN, in_use=IN_USE)


def doubled(monkeypatch, wraps: bool = False) -> None:
    """``nn.Linear.forward`` patched on the class: twice what it computed."""
    real = nn.Linear.forward

    def forward(self, inp):
        return real(self, inp) * 2.0

    monkeypatch.setattr(nn.Linear, "forward", functools.wraps(real)(forward) if wraps else forward)


@pytest.mark.parametrize("wraps", [False, True], ids=["a function", "functools.wraps of torch's"])
def test_a_forward_patched_onto_linear_after_the_chunks_were_found_is_the_one_that_runs(
        tmp_file_dir, cap, monkeypatch, wraps):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    with mgr, torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
        head = row_chunks(model.head)
        assert head is not None and head.chunked_calls  # the head computed in chunks before the patch
        doubled(monkeypatch, wraps)
        h = torch.randn(3, W)
        exp, head_exp = ref(x), ref.head(h)
        assert not torch.equal(exp, want)
        for _ in range(2):
            assert torch.equal(model(x), exp)
            assert torch.equal(model.head(h), head_exp)


def test_a_forward_patched_onto_linear_before_the_offload_is_the_one_that_runs(tmp_file_dir, cap, monkeypatch):
    path, x, want = checkpoint(tmp_file_dir)
    doubled(monkeypatch)
    ref = plain(path)
    model, mgr = engaged(path, cap)
    with mgr, torch.no_grad():
        exp = ref(x)
        for _ in range(3):
            assert torch.equal(model(x), exp)
        h = torch.randn(3, W)
        assert torch.equal(model.head(h), ref.head(h))


@pytest.mark.parametrize("setting", ["set_float32_matmul_precision", "mkldnn.matmul", "backends"])
def test_every_way_of_setting_the_fp32_matmul_precision_computes_what_the_plain_model_does(
        tmp_file_dir, cap, setting):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    legacy = torch.get_float32_matmul_precision()
    try:
        with mgr, torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
            if setting == "set_float32_matmul_precision":
                torch.set_float32_matmul_precision("medium")
            elif setting == "mkldnn.matmul":  # torch.get_float32_matmul_precision() raises from here on
                torch.backends.mkldnn.matmul.fp32_precision = "bf16"
            else:
                torch.backends.fp32_precision = "bf16"
            for rows in (3, 300):
                h = torch.randn(rows, W)
                for _ in range(2):
                    assert torch.equal(model.head(h), ref.head(h)), rows
            for _ in range(2):
                assert torch.equal(model(x), ref(x))
    finally:
        torch.backends.fp32_precision = "none"
        torch.backends.mkldnn.matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision(legacy)
    assert torch.get_float32_matmul_precision() == legacy  # put back for the tests after


class Tagged(torch.Tensor):
    pass


def test_a_tensor_subclass_input_comes_back_as_its_forward_makes_it(tmp_file_dir, cap):
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr = engaged(path, cap)
    ref = plain(path)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        for _ in range(2):
            h = torch.randn(3, W).as_subclass(Tagged)
            got, exp = model.head(h), ref.head(h)
            assert type(got) is type(exp) is Tagged
            assert torch.equal(got.as_subclass(torch.Tensor), exp.as_subclass(torch.Tensor))
