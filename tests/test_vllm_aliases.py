"""AliasRecorder: whole copies from the checkpoint become views of it; everything else sees
exactly the bytes a real copy would have left (no vLLM needed: plain torch code plays the loader)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from mapoffload.loading.read import read_file
from mapoffload.conversion import reserve_safetensors
from mapoffload.vllm._aliases import AliasRecorder, SourceIndex


def _setup(tmp_path, specs):
    torch.manual_seed(0)
    src = {"a": torch.randn(8, 4), "b": torch.randn(8, 4), "c": torch.randn(16), "h": torch.randn(4, 4).half()}
    save_file(src, str(tmp_path / "ckpt.safetensors"))
    mapped = read_file(str(tmp_path / "ckpt.safetensors"))
    views = reserve_safetensors(str(tmp_path / "part.safetensors"), specs)
    params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in views.items()}
    return src, mapped, params


def test_whole_copy_is_recorded_and_not_written(tmp_path):
    src, mapped, params = _setup(tmp_path, {"w": ((8, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["w"].data.copy_(mapped["a"])
    assert set(rec.aliases) == {"w"} and rec.aliases["w"].key == "a" and rec.aliases["w"].byte_offset == 0
    assert torch.count_nonzero(params["w"]) == 0  # the file's bytes were never written
    assert torch.equal(rec.aliases["w"].source, src["a"])


def test_a_row_slice_is_an_alias_at_its_offset(tmp_path):
    src, mapped, params = _setup(tmp_path, {"w": ((4, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["w"].data.copy_(mapped["b"].narrow(0, 4, 4))  # a tensor-parallel rank's rows
    assert rec.aliases["w"].key == "b" and rec.aliases["w"].byte_offset == 4 * 4 * 4


def test_an_empty_padding_tail_keeps_the_alias(tmp_path):
    """vLLM's vocabulary loader: copy the rows, then zero the padding rows past them -- none when the
    vocabulary needs no padding. An empty slice reads nothing: the parameter stays an alias."""
    src, mapped, params = _setup(tmp_path, {"w": ((8, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["w"][:8].data.copy_(mapped["a"])
        params["w"][8:].data.fill_(0)
    assert set(rec.aliases) == {"w"} and rec.materialized == set()
    assert torch.count_nonzero(params["w"]) == 0


def test_partial_copies_stack_into_the_file(tmp_path):
    src, mapped, params = _setup(tmp_path, {"qkv": ((16, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["qkv"].data.narrow(0, 0, 8).copy_(mapped["a"])
        params["qkv"].data.narrow(0, 8, 8).copy_(mapped["b"])
    assert rec.aliases == {}
    assert torch.equal(params["qkv"], torch.cat([src["a"], src["b"]]))


def test_read_after_a_skipped_copy_sees_the_bytes(tmp_path):
    src, mapped, params = _setup(tmp_path, {"w": ((8, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["w"].data.copy_(mapped["a"])
        total = params["w"].sum()  # a loader that checks what it loaded
    assert rec.aliases == {} and rec.materialized == {"w"}
    assert torch.equal(total, src["a"].sum()) and torch.equal(params["w"], src["a"])


def test_in_place_edit_after_a_skipped_copy(tmp_path):
    src, mapped, params = _setup(tmp_path, {"w": ((8, 4), torch.float32), "v": ((16,), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["w"].data.copy_(mapped["a"])
        params["w"].data.mul_(2)
        params["v"].data.copy_(mapped["c"])
        params["v"].data[3:5].fill_(7.0)  # a view first (no read), then a write through it
    assert rec.aliases == {}
    assert torch.equal(params["w"], src["a"] * 2)
    want = src["c"].clone()
    want[3:5] = 7.0
    assert torch.equal(params["v"], want)


def test_cast_shape_change_and_second_copy(tmp_path):
    src, mapped, params = _setup(tmp_path, {"f": ((4, 4), torch.float32), "g": ((32,), torch.float32),
                                            "w": ((8, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["f"].data.copy_(mapped["h"])  # a cast: converted
        params["g"].data.copy_(mapped["a"].view(-1))  # same bytes, a flat view: still an alias
        params["w"].data.copy_(mapped["a"])
        params["w"].data.copy_(mapped["b"])  # the last whole copy wins
    assert torch.equal(params["f"], src["h"].float())
    assert set(rec.aliases) == {"g", "w"} and rec.aliases["w"].key == "b"


def test_copy_from_memory_of_its_own_is_written(tmp_path):
    src, mapped, params = _setup(tmp_path, {"w": ((8, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    owned = src["a"] + 1
    with rec, torch.no_grad():
        params["w"].data.copy_(mapped["a"])
        params["w"].data.copy_(owned)  # overwrites the whole parameter: the skipped copy no longer matters
    assert rec.aliases == {} and torch.equal(params["w"], owned)


def test_views_and_metadata_do_not_materialize(tmp_path):
    src, mapped, params = _setup(tmp_path, {"w": ((8, 4), torch.float32)})
    rec = AliasRecorder(params, SourceIndex(mapped))
    with rec, torch.no_grad():
        params["w"].data.copy_(mapped["a"])
        p = params["w"]
        _ = (p.shape, p.dtype, p.data, p.narrow(0, 0, 2), p.view(-1), p[1:3], p.t(), p.is_contiguous(), p.size(0))
    assert set(rec.aliases) == {"w"} and rec.materialized == set()
