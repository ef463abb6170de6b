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
