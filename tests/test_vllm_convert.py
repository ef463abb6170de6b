"""bind_mapped without vLLM: a module whose load_weights copies as vLLM's loaders do. A conversion
whose manifest names aliases this module did not write is converted again, and the new folder
takes the old one's place (the next start reuses it instead of converting forever)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from mapoffload.vllm._convert import bind_mapped

KEY = "00112233445566778899aabb"


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(8, 4), requires_grad=False)  # unchanged: an alias
        self.qkv = torch.nn.Parameter(torch.empty(16, 4), requires_grad=False)  # stacked: converted

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            if name == "w":
                self.w.data.copy_(t)
            else:
                self.qkv.data.narrow(0, 0 if name == "q" else 8, 8).copy_(t)
            loaded.add("w" if name == "w" else "qkv")
        return loaded


def _bind(tmp_path):
    model = Tiny()
    bound, cache = bind_mapped(model, [str(tmp_path / "ckpt.safetensors")], key=KEY, cache_dir=str(tmp_path / "conv"),
                               folder=str(tmp_path), check_loaded=lambda m, loaded: None)
    if not cache.reused:
        cache.commit()
    return model, bound


def test_a_conversion_with_foreign_aliases_is_replaced(tmp_path):
    torch.manual_seed(0)
    src = {"w": torch.randn(8, 4), "q": torch.randn(8, 4), "k": torch.randn(8, 4)}
    save_file(src, str(tmp_path / "ckpt.safetensors"))
    model, bound = _bind(tmp_path)
    assert not bound.reused and (bound.mapped, bound.converted) == (8 * 4 * 4, 16 * 4 * 4)
    assert torch.equal(model.w, src["w"]) and torch.equal(model.qkv, torch.cat([src["q"], src["k"]]))
    again, bound = _bind(tmp_path)
    assert bound.reused and torch.equal(again.qkv, model.qkv)

    manifest = os.path.join(tmp_path, "conv", KEY, "manifest.json")
    data = json.load(open(manifest))
    data["meta"]["vllm"]["aliases"]["w"] = {"not": "a pair"}
    with open(manifest, "w") as f:
        json.dump(data, f)
    rebuilt, bound = _bind(tmp_path)
    assert not bound.reused and torch.equal(rebuilt.w, src["w"])
    _, bound = _bind(tmp_path)
    assert bound.reused  # the rebuilt folder took the broken one's place
    assert [n for n in os.listdir(tmp_path / "conv") if not n.startswith(".")] == [KEY]


def _digests(folder) -> dict[str, str]:
    import hashlib

    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


def _shared_writable_maps(folder) -> list[str]:
    """This process's mappings of files under ``folder`` that are shared and writable (a write lands in the file)."""
    real = os.path.realpath(folder)
    with open("/proc/self/maps") as f:
        rows = [line.split(maxsplit=5) for line in f]
    return [r[5].strip() for r in rows if len(r) > 5 and r[5].startswith(real) and r[1][1] == "w" and r[1][3] == "s"]


def test_a_write_into_a_converted_parameter_stays_in_the_process(tmp_path):
    """The start that converts binds the converted parameters to a private (copy-on-write) mapping of the
    finished files, as a reusing start does: a weight update written into them (RLHF weight syncing,
    any in-place write) changes neither the conversion folder nor what the next start maps."""
    torch.manual_seed(0)
    src = {"w": torch.randn(8, 4), "q": torch.randn(8, 4), "k": torch.randn(8, 4)}
    save_file(src, str(tmp_path / "ckpt.safetensors"))
    model, bound = _bind(tmp_path)
    assert not bound.reused and bound.converted
    folder = os.path.join(tmp_path, "conv", KEY)
    before = _digests(folder)
    assert _shared_writable_maps(tmp_path / "conv") == []
    with torch.no_grad():
        model.qkv.add_(1.0)  # an update made in this process
        model.w.add_(1.0)  # a view of the checkpoint, privately mapped already
    assert _digests(folder) == before
    again, bound = _bind(tmp_path)
    assert bound.reused
    assert torch.equal(again.qkv, torch.cat([src["q"], src["k"]])) and torch.equal(again.w, src["w"])
