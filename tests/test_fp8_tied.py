"""A weight stored as fp8 codes and scales, tied to another place in the module, is refused at load.

Found by a hostile review: the codes went behind one module's parametrization and the other place kept
what it held - its initial values, or (built under ``empty_weights``) a meta tensor that ``F.linear``
turned into uninitialised memory - with no missing key reported.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mapoffload import empty_weights, load_checkpoint

from fp8_models import random_codes, random_scales


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(256, 256, bias=False)
        self.b = torch.nn.Linear(256, 256, bias=False)
        self.b.weight = self.a.weight


@pytest.mark.parametrize("stored", ["a.weight", "b.weight"])
@pytest.mark.parametrize("meta", [False, True], ids=["built", "empty_weights"])
def test_a_tied_fp8_weight_is_refused_naming_both_places(tmp_path, stored, meta):
    path = tmp_path / "tied.safetensors"
    save_file({stored: random_codes((256, 256), seed=3), f"{stored}_scale_inv": random_scales((2, 2))}, str(path))
    if meta:
        with empty_weights():
            model = Tied().to(torch.bfloat16)
    else:
        model = Tied().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"fp8 codes and scales.*ties it to") as info:
        load_checkpoint(model, str(path), keep_mapping=True)
    assert "a.weight" in str(info.value) and "b.weight" in str(info.value)
    assert not hasattr(model.a, "parametrizations") and model.a.weight is model.b.weight  # nothing assigned
