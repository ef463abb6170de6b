"""A mapped weight written in place before offloading (a LoRA merged with
``+=``) holds bytes the file does not: reading its layer uncached
(``O_DIRECT``) would compute with the file's bytes. Such a layer is read
through its mapping, on both uncached paths (in place, the device
pipeline's CPU twin), and the outputs are those of the edited model."""

from __future__ import annotations

import pytest
import torch

from mapoffload import LayerwiseOffloadManager, cow_report
from mapoffload._native import _core
from mapoffload.memory.regions import tensor_spans
from stacks import mapped

TWIN = {"cpu_twin": True, "host_store": "mapped"}


def test_private_page_bytes_counts_the_pages_written_in_place(ckpt):
    path, _, _ = ckpt
    model = mapped(path)
    w = model.blocks[3].weight
    assert _core.private_page_bytes(tensor_spans([w])) == 0
    with torch.no_grad():
        w[0, :8] += 1.0  # one page turns the process's own
    got = _core.private_page_bytes(tensor_spans([w]))
    assert got == 4096 == cow_report([w]).anonymous_bytes  # the same page, seen by smaps (independently)
    assert _core.private_page_bytes(tensor_spans([model.blocks[4].weight])) == 0


@pytest.mark.parametrize("extra", [{}, TWIN], ids=["in-place", "twin"])
def test_a_layer_written_in_place_is_read_through_its_mapping(ckpt, extra, caplog):
    path, x, _ = ckpt
    model = mapped(path)
    with torch.no_grad():
        model.blocks[2].weight.add_(0.5)  # a LoRA merged into a streamed layer's mapped weight
        model.blocks[7].bias[:3] = 0
        want = model(x)  # the edited model, plain
    with caplog.at_level("INFO", logger="mapoffload"):
        with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached", page_cache_bytes=0,
                                     **extra) as mgr:
            mgr.register_forward_hooks()
            assert mgr.parts.member.reads_mode == "uncached" and len(mgr.residency.streamed) == len(model.blocks)
            with torch.no_grad():
                for _ in range(2):
                    assert torch.equal(model(x), want)
            assert mgr.parts.loads.source.reader.stats()["reads"] > 0  # the other layers were still read uncached
    said = [r.getMessage() for r in caplog.records if "written in place" in r.getMessage()]
    assert any("blocks.2" in m or "layer 2" in m for m in said), said
    assert any("blocks.7" in m or "layer 7" in m for m in said), said
