"""The vLLM device path's copies, under the stand-in CUDA runtime (tests/fakecuda).

On a GPU the offloaded layers' host weights are the tensors the vLLM binding
reads from the checkpoint (``loading.read.read_files``: views of a private,
writable file mapping). The copier moves them staged: worker threads memcpy
the mapping into pinned slots, the (stand-in) DMA engine reads only those, so
the mapping never turns anonymous. A child interpreter does one layer's worth
of such copies into stand-in device memory; the bytes land exactly, the
copier counts them, the engine never read pageable memory and the mapping's
copy-on-write report stays at zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import ctypes, os, sys
sys.path.insert(0, {tests!r})
from fakecuda import ENV, FakeCuda
import mapoffload
from mapoffload import _core
from mapoffload.loading.read import read_files

fake = FakeCuda(os.environ[ENV]); fake.reset(); fake.set_delay_us(1000)
tensors = list(read_files([{path!r}]).values())
assert all(mapoffload.MappedRegions().classify(tensors))
sizes = [t.numel() * t.element_size() for t in tensors]
total = sum(sizes)
dev = fake.malloc(total)
offsets, pos = [], 0
for n in sizes:
    offsets.append(pos); pos += n
stream = fake.stream_create()
c = _core.Copier(device=0, mode="staged", threads=3, slot_bytes=4096, slots=2)
job = c.submit([dev + o for o in offsets], [t.data_ptr() for t in tensors], sizes, stream, keepalive=tensors,
               unstaged=None)
job.wait()
landed = ctypes.string_at(dev, total)
expected = b"".join(bytes(t.reshape(-1).view(__import__("torch").uint8).numpy()) for t in tensors)
assert landed == expected, "bytes wrong on the device"
assert c.stats().bytes == total, (c.stats().bytes, total)
assert fake.stat("pageable_snapshots") == 0, "the DMA engine read the mapping itself"
assert mapoffload.cow_report(tensors).anonymous_bytes == 0, "the mapping turned anonymous"
c.close(); fake.free(dev); fake.stream_destroy(stream)
print("OK", total)
"""


@pytest.fixture(autouse=True)
def _on_the_stand_in(fakecuda_runtime):
    """Skip unless the copier runs on the stand-in (children inherit MAPOFFLOAD_CUDART)."""


def test_an_offloaded_layers_mapped_weights_go_staged_to_the_device(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    hidden, inter = 256, 512  # one Llama decoder layer of tests/vllm_models.py, its tensors as vLLM binds them
    layer = {"qkv_proj.weight": (hidden + 2 * 128, hidden), "o_proj.weight": (hidden, hidden),
             "gate_up_proj.weight": (2 * inter, hidden), "down_proj.weight": (hidden, inter),
             "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    path = str(tmp_path / "model.safetensors")
    save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in layer.items()}, path)
    code = CHILD.format(tests=TESTS, path=path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
    expected = sum(2 * (s[0] * (s[1] if len(s) > 1 else 1)) for s in layer.values())
    assert int(proc.stdout.split()[1]) == expected
