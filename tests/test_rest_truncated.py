"""A checkpoint truncated under a model whose weights outside the stack (the
embedding, a tied head, norms: "the rest") are on the mapping too: every
forward reads them before the first layer's check, so they are checked
first - a MappingFaultError naming the file, never a SIGBUS. Run in a child
process: without the check the process dies."""

from __future__ import annotations

from child import describe, run_python

VICTIM = """
import os, sys
import torch
from safetensors.torch import save_file
from mapoffload import LayerwiseOffloadManager, MappingFaultError, empty_weights, load_checkpoint
from models import TinyModel, saveable_state

twin = {twin}
path = os.path.join({folder!r}, "model.safetensors")
torch.manual_seed(0)
ref = TinyModel(width=32, layers=4)
save_file(saveable_state(ref), path)
good = open(path, "rb").read()
ids = torch.arange(24).reshape(3, 8) % 64
with torch.no_grad():
    want = ref(ids)
with empty_weights():
    model = TinyModel(width=32, layers=4)
load_checkpoint(model, path, keep_mapping=True)
model.head.weight = model.embed.weight  # tied, on the mapping like the embedding and the norms
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin, host_store="mapped")
mgr.register_forward_hooks()
with torch.no_grad():
    assert torch.equal(model(ids), want)
os.truncate(path, 4096)
try:
    with torch.no_grad():
        model(ids)
except MappingFaultError as exc:
    print("refused:", exc.filename == path, "outside" in str(exc))
with open(path, "r+b") as f:  # whole again, same inode
    f.write(good)
with torch.no_grad():
    print("recovered:", torch.equal(model(ids), want))
mgr.close()
"""


def run_victim(tmp_path, twin: bool):
    proc = run_python(VICTIM.format(folder=str(tmp_path), twin=twin), timeout=120)
    assert proc.returncode == 0, describe(proc)  # -7: SIGBUS
    assert "refused: True True" in proc.stdout and "recovered: True" in proc.stdout, describe(proc)


def test_truncated_under_the_rest_is_an_exception_in_place(tmp_path):
    run_victim(tmp_path, twin=False)


def test_truncated_under_the_rest_is_an_exception_twin(tmp_path):
    run_victim(tmp_path, twin=True)
