"""OffloadOptions: one frozen object, checked once where it is made, taken whole by every entry point."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import mapoffload
from mapoffload import LayerwiseOffloadManager, OffloadOptions
from stacks import mapped


@pytest.mark.parametrize("field, value, error", [
    ("device", "gpu", ValueError), ("device", 1.5, TypeError), ("layers", 5, TypeError),
    ("rest", "host", ValueError), ("prefetch_layers", 1.5, TypeError), ("prefetch_layers", -1, ValueError),
    ("resident_layers", True, TypeError), ("host_store", "gpu", ValueError), ("reads", "odirect", ValueError),
    ("available_bytes", "1G", TypeError), ("device_free_bytes", -1, ValueError), ("page_cache_bytes", 1.0, TypeError),
    ("local_ranks", 0, ValueError), ("cpu_twin", "false", TypeError), ("kernel_caps", 3, TypeError),
])
def test_each_field_is_checked_when_made_naming_it(field, value, error):
    with pytest.raises(error, match=field):
        OffloadOptions(**{"device": "cpu", field: value})
    good = OffloadOptions(device="cpu")
    with pytest.raises(error, match=field):  # and when replaced
        good.replace(**{field: value})


def test_options_are_frozen_and_compare_by_value():
    o = OffloadOptions(device="cpu", prefetch_layers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.prefetch_layers = 3  # type: ignore[misc]
    assert o == OffloadOptions(device=torch.device("cpu"), prefetch_layers=2)
    assert o.device == torch.device("cpu") and o.in_place and not o.cuda
    assert not OffloadOptions(device="cpu", cpu_twin=True).in_place


def test_old_names_are_refused_as_unknown_naming_the_current_ones(ckpt):
    # Never released: no old name is kept (it was accepted with a DeprecationWarning).
    with pytest.raises(ValueError, match=r"reads must be one of \('auto', 'mapping', 'uncached'\), not 'direct'"):
        OffloadOptions(device="cpu", reads="direct")
    with pytest.raises(ValueError, match=r"host_store must be one of \('auto', .*\), not None"):
        OffloadOptions(device="cpu", host_store=None)
    path, x, want = ckpt
    model = mapped(path).eval()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stream_reads': the offload options are "
                                        r"device, .*reads"):
        LayerwiseOffloadManager(model, "blocks", device="cpu", stream_reads="mapping")
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="mapping") as m:
        assert not hasattr(m, "stream_reads") and m.parts.member.reads_mode == "mapping"


def test_every_entry_point_takes_the_options_or_its_keywords(ckpt):
    path, x, want = ckpt
    o = OffloadOptions(device="cpu", prefetch_layers=2, resident_layers=1, reads="mapping")
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", o) as a:
        got_a = a.options
        with torch.no_grad():
            assert torch.equal(model(x), want)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=2, resident_layers=1,
                                 reads="mapping") as b:
        assert b.options.replace(available_bytes=None) == got_a.replace(available_bytes=None)  # measured apart
    assert (got_a.prefetch_layers, got_a.resident_layers, got_a.reads) == (2, 1, "mapping")
    assert got_a.available_bytes is not None and got_a.local_ranks >= 1  # filled in by the manager
    with mapoffload.offload(model, o, layers="blocks") as handle:  # keywords laid over the options
        assert handle.options.layers == "blocks" and handle.options.prefetch_layers == 2
        (m,) = handle.managers.values()
        assert m.options.prefetch_layers == 2 and m.options.resident_layers == 1
        with torch.no_grad():
            assert torch.equal(model(x), want)
    with pytest.raises(TypeError, match="options must be a mapoffload.OffloadOptions, not dict"):
        mapoffload.offload(model, {"device": "cpu"})


def test_a_misspelt_option_is_named_with_the_one_meant(ckpt):
    model = mapped(ckpt[0]).eval()
    with pytest.raises(TypeError, match=r"'prefech_layers': did you mean prefetch_layers=\?"):
        mapoffload.offload(model, device="cpu", prefech_layers=2)
    with pytest.raises(TypeError, match=r"'resident_layer': did you mean resident_layers=\?"):
        LayerwiseOffloadManager(model, "blocks", device="cpu", resident_layer=1)
    with pytest.raises(TypeError, match=r"'devcie': did you mean device=\?"):
        mapoffload.offload(model, devcie="cpu")


def test_the_options_are_checked_once_per_call(ckpt, monkeypatch):
    # The entry point checks them at the door; the managers, the rest and the parts take them whole.
    checks = []
    original = OffloadOptions.__post_init__
    monkeypatch.setattr(OffloadOptions, "__post_init__", lambda self: (checks.append(1), original(self)))
    model = mapped(ckpt[0]).eval()
    with mapoffload.offload(model, device="cpu", cpu_twin=True, layers="blocks", rest="stream",
                            prefetch_layers=2) as handle:
        assert set(handle.managers) == {"blocks", "rest"}
    assert len(checks) == 1
    o = OffloadOptions(device="cpu")
    checks.clear()
    with mapoffload.offload(model, o):
        pass
    assert checks == []  # made (and checked) by the caller, once


def test_the_pipeline_entry_points_refuse_layers_they_find_themselves():
    class Pipe:
        components = {"unet": torch.nn.Linear(2, 2)}

    with pytest.raises(ValueError, match="a pipeline's block lists are found in each component"):
        mapoffload.offload_pipeline(Pipe(), device="cpu", layers="blocks")


def test_from_pretrained_refuses_offload_keywords_without_a_device(tmp_path):
    with pytest.raises(TypeError, match=r"prefetch_layers= offload\(s\) the model, and device=None"):
        mapoffload.from_pretrained(object, tmp_path, device=None, prefetch_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match=r"'devcie': did you mean device=\?"):
            mapoffload.from_pretrained(object, tmp_path, devcie="cpu")


def test_from_pretrained_names_block_lists_by_path_not_by_module(tmp_path):
    # The model does not exist yet: a module given as layers cannot be one of its own.
    with pytest.raises(TypeError, match="named by attribute path"):
        mapoffload.from_pretrained(object, tmp_path, device="cpu", layers=torch.nn.ModuleList())


def test_the_class_names_a_misspelt_field_with_the_one_meant():
    # The entry points named the field meant; OffloadOptions itself said only "unexpected keyword".
    with pytest.raises(TypeError, match=r"OffloadOptions got an unexpected keyword argument 'devise': did you mean "
                                        r"device=\?"):
        OffloadOptions(devise="cpu")
    with pytest.raises(TypeError, match=r"'prefech_layers': did you mean prefetch_layers=\?"):
        OffloadOptions(device="cpu").replace(prefech_layers=2)


@pytest.mark.parametrize("device", ["cpu:1", torch.device("cpu", 3)])
def test_a_cpu_index_other_than_0_is_refused(device):
    # There is one CPU device: "cpu:1" was taken for it.
    with pytest.raises(ValueError, match=r"one CPU device"):
        OffloadOptions(device=device)
    assert OffloadOptions(device="cpu:0").device == torch.device("cpu")


def test_device_none_beside_options_says_which_two_meanings_meet(tmp_path):
    # device=None is documented as "loaded, not offloaded"; beside options= it said None is no device.
    o = OffloadOptions(device="cpu")
    with pytest.raises(TypeError, match=r"device=None loads the model without offloading it, and options= "
                                        r"offloads it: give one of them"):
        mapoffload.from_pretrained(object, tmp_path, options=o, device=None)


def test_rest_stream_on_the_cpu_is_refused_with_what_streams_there(ckpt):
    """On the CPU the weights outside the stacks compute where they are and the page-cache plan streams
    them (``OutsideWeights``): a second mechanism (a stack of their modules) for the same pages is refused."""
    with pytest.raises(ValueError, match=r"rest='stream' streams .* to the device; on the CPU .* page-cache plan"):
        OffloadOptions(device="cpu", rest="stream")
    model = mapped(ckpt[0]).eval()
    with pytest.raises(ValueError, match="cpu_twin=True runs the device path's streaming"):
        mapoffload.offload(model, device="cpu", layers="blocks", rest="stream")
    assert OffloadOptions(device="cpu", cpu_twin=True, rest="stream").rest == "stream"
    with mapoffload.offload(model, device="cpu", layers="blocks") as handle:  # nothing was left hooked
        assert list(handle.managers) == ["blocks"]
