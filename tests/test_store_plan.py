"""The host-store plan records its decision (issue 34): each layer's store holds the rule that chose
its weights' stores (``StorePlan``) and why its copies are pinned or pageable (``PinChoice``), and
``summary()``'s words are read from that record, not derived again."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint  # noqa: E402
from mapoffload.hf._summary import stack_row  # noqa: E402
from mapoffload.memory.budget import HOST_COPY_RESERVE_BYTES, host_copy_room  # noqa: E402
from mapoffload.offload.stores import PinChoice, StoreRule  # noqa: E402

from models import TinyModel, saveable_state  # noqa: E402

GIB = 1 << 30


@pytest.fixture
def mapped_model(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "tiny.safetensors"
    save_file(saveable_state(TinyModel(width=32, layers=3)), path)
    with empty_weights():
        model = TinyModel(width=32, layers=3)
    load_checkpoint(model, path, keep_mapping=True)
    return model.eval()


def _plans(mgr):
    stores = mgr.parts.sequencer.stores
    assert len({id(s.plan) for s in stores}) == 1  # one decision for the manager, on every layer
    return stores[0].plan, [s.pin for s in stores]


def test_in_place_keeps_every_weight_as_it_is(mapped_model):
    with LayerwiseOffloadManager(mapped_model, "blocks", device="cpu") as mgr:
        plan, pins = _plans(mgr)
        assert plan.rule is StoreRule.IN_PLACE and plan.available_bytes is None
        assert set(pins) == {PinChoice.NONE}
        why = stack_row("blocks", mgr, available=None, host_store_given=False).why
        assert why.startswith("its weights are views of the checkpoint's file mapping")


def test_copies_that_would_not_fit_keep_the_mapping(mapped_model):
    available = HOST_COPY_RESERVE_BYTES + 1024  # room for 1 KiB of copies: the layers' weights do not fit
    with LayerwiseOffloadManager(mapped_model, "blocks", device="cpu", cpu_twin=True,
                                 available_bytes=available) as mgr:
        plan, pins = _plans(mgr)
        assert plan.rule is StoreRule.COPIES_DO_NOT_FIT and plan.host_store == "auto"
        assert plan.weighed_bytes == mgr.mapped_bytes > 0
        assert (plan.available_bytes, plan.room) == (available, host_copy_room(available, 1))
        assert set(pins) == {PinChoice.NONE}  # nothing consolidated, nothing to pin
        why = stack_row("blocks", mgr, available=None, host_store_given=False).why
        assert why.endswith("a host copy would not fit: kept on the file mapping"), why


def test_copies_that_fit_are_made_and_say_why_they_are_pageable(mapped_model):
    with LayerwiseOffloadManager(mapped_model, "blocks", device="cpu", cpu_twin=True,
                                 available_bytes=64 * GIB) as mgr:
        plan, pins = _plans(mgr)
        assert plan.rule is StoreRule.COPIES_FIT and mgr.mapped_bytes == 0
        assert set(pins) == {PinChoice.NO_CUDA}  # a CPU run: pinning needs CUDA
        why = stack_row("blocks", mgr, available=None, host_store_given=False).why
        assert "64.00 GiB available" in why and why.endswith("host copies fit: copied into anonymous memory"), why


def test_a_store_asked_for_is_recorded_as_asked(mapped_model):
    with LayerwiseOffloadManager(mapped_model, "blocks", device="cpu", cpu_twin=True, host_store="pageable",
                                 available_bytes=64 * GIB) as mgr:
        plan, pins = _plans(mgr)
        assert plan.rule is StoreRule.ASKED and plan.host_store == "pageable"
        assert set(pins) == {PinChoice.NOT_ASKED}
        assert stack_row("blocks", mgr, available=None, host_store_given=False).why == "host_store='pageable' asked"
