"""The copier attacked as a careless or hostile caller would: tensors
re-pointed while their copy runs, a copier that is a temporary. Risky cases
run in a child interpreter, so a crash fails the test instead of the suite."""

from __future__ import annotations

import pytest
import torch

from mapoffload import Copier

from child import describe, run_python


@pytest.mark.slow
def test_source_and_destination_repointed_while_copying_stay_alive():
    # `param.data = other` (or set_()) frees the old storage when the tensor
    # object was its only owner: the copier must hold the storage, not just
    # the tensor object, or its workers read and write freed (unmapped) memory.
    proc = run_python("""
import gc, torch
from mapoffload import Copier
c = Copier("cpu", "staged", threads=1, staging_bytes=1 << 16, slots=1)
for _ in range(3):
    src = torch.nn.Parameter(torch.randint(0, 255, (64 << 20,), dtype=torch.uint8), requires_grad=False)
    dst = torch.nn.Parameter(torch.empty_like(src), requires_grad=False)
    want = src.detach().clone()
    h = c.copy([dst], [src])
    got = dst.detach()  # an alias of the destination storage, taken before it is re-pointed
    src.data = torch.zeros(1, dtype=torch.uint8)
    dst.set_(torch.zeros(1, dtype=torch.uint8))
    gc.collect()
    filler = torch.ones(64 << 20, dtype=torch.uint8)  # reuse what was freed
    h.wait()
    assert torch.equal(got, want)
    del filler, got
c.close()
print("ok")
""", timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, describe(proc)


def test_a_temporary_copier_completes_the_copy_its_handle_waits_for():
    src = torch.randint(0, 255, (16 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    handle = Copier("cpu", threads=1, staging_bytes=1 << 16, slots=1).copy([dst], [src])
    handle.wait()  # the copier lives as long as the handle: nothing was cancelled
    assert torch.equal(dst, src)

