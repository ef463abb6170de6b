"""A conversion is keyed on the model class's code where no package's version names it: a checkpoint's
own code (``auto_map`` with ``trust_remote_code``) or a user's subclass, edited between two loads
(``_keep_in_fp32_modules_strict`` added), converts again. Reused, the old conversion gave the old code's
dtypes, silently (``lm_head`` rounded through float16 where transformers keeps it float32)."""

from __future__ import annotations

import importlib
import json
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402

CODE = (
    "from transformers import LlamaConfig, LlamaForCausalLM\n"
    "class MyLlamaConfig(LlamaConfig):\n    model_type = 'myllama'\n"
    "class MyLlamaForCausalLM(LlamaForCausalLM):\n    config_class = MyLlamaConfig\n"
)
KEEP = "    _keep_in_fp32_modules_strict = ['lm_head']\n"
SUBCLASS = "from transformers import LlamaForCausalLM\nclass MyLlamaForCausalLM(LlamaForCausalLM):\n    pass\n"


def _tiny(folder) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)


def _load(cls, folder, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = cls.from_pretrained(folder, dtype="float16", **kwargs)
        ours = mapoffload.from_pretrained(cls, folder, device=None, dtype="float16", **kwargs)
    mine = ours.state_dict()
    for k, t in ref.state_dict().items():
        assert mine[k].dtype == t.dtype and torch.equal(mine[k], t), k
    return ours.mapoffload_report, ref.lm_head.weight.dtype


def test_a_checkpoint_s_own_code_edited_converts_again(tmp_path):
    _tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["MyLlamaForCausalLM"], model_type="myllama", auto_map={
        "AutoConfig": "modeling_my.MyLlamaConfig", "AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = tmp_path / "modeling_my.py"
    code.write_text(CODE)
    auto = transformers.AutoModelForCausalLM
    first, head = _load(auto, str(tmp_path), trust_remote_code=True)
    assert not first.conversion_reused and head == torch.float16
    code.write_text(CODE + KEEP)
    second, head = _load(auto, str(tmp_path), trust_remote_code=True)
    assert not second.conversion_reused and head == torch.float32  # transformers' dtype, not the old conversion's
    third, _ = _load(auto, str(tmp_path), trust_remote_code=True)
    assert third.conversion_reused


def test_a_user_subclass_edited_converts_again(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    _tiny(folder)
    code = tmp_path / "mine_conversion_code.py"
    code.write_text(SUBCLASS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("mine_conversion_code")
    try:
        first, head = _load(module.MyLlamaForCausalLM, str(folder))
        assert not first.conversion_reused and head == torch.float16
        code.write_text(SUBCLASS + KEEP)
        module = importlib.reload(module)
        second, head = _load(module.MyLlamaForCausalLM, str(folder))
        assert not second.conversion_reused and head == torch.float32
        third, _ = _load(module.MyLlamaForCausalLM, str(folder))
        assert third.conversion_reused
    finally:
        sys.modules.pop("mine_conversion_code", None)
