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


def test_an_attribute_set_after_the_class_body_converts_again(tmp_path):
    """Set after the class statement (or from a module constant), it was in no source text hashed."""
    _tiny(tmp_path)
    mine = type("MyLlamaForCausalLM", (transformers.LlamaForCausalLM,), {})
    first, head = _load(mine, str(tmp_path))
    assert not first.conversion_reused and head == torch.float16
    mine._keep_in_fp32_modules_strict = ["lm_head"]
    second, head = _load(mine, str(tmp_path))
    assert not second.conversion_reused and head == torch.float32


def _exec_class(body: str, module: str | None):
    """A class as a notebook cell makes it: no source file; ``module`` None: exec'd with a bare dict
    (its ``__module__`` is ``builtins``)."""
    ns = {} if module is None else {"__name__": module}
    exec(compile("from transformers import LlamaForCausalLM\nclass Mine(LlamaForCausalLM):\n" + body, "<cell>", "exec"),
         ns)
    return ns["Mine"]


@pytest.mark.parametrize("module", [None, "__main__"])
def test_a_class_without_a_source_file_is_reused_unchanged_and_converted_again_edited(tmp_path, module):
    _tiny(tmp_path)
    first, _ = _load(_exec_class("    pass\n", module), str(tmp_path))
    again, _ = _load(_exec_class("    pass\n", module), str(tmp_path))  # the same code, made afresh
    edited, head = _load(_exec_class(KEEP, module), str(tmp_path))
    assert not first.conversion_reused and again.conversion_reused
    assert not edited.conversion_reused and head == torch.float32


def test_the_key_follows_the_code_that_runs_not_its_file(tmp_path, monkeypatch):
    """A module's file edited after it was imported: the class that runs is still the old one, and its
    conversion is keyed on it (hashing the file stored the old code's weights under the new code's key)."""
    from mapoffload.conversion.code_key import class_code

    code = tmp_path / "mine_running_code.py"
    code.write_text(SUBCLASS)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module("mine_running_code")
        before = class_code(module.MyLlamaForCausalLM, None, [])
        code.write_text(SUBCLASS + KEEP)
        assert class_code(module.MyLlamaForCausalLM, None, []) == before
        assert class_code(importlib.reload(module).MyLlamaForCausalLM, None, []) != before
    finally:
        sys.modules.pop("mine_running_code", None)


def test_a_subclass_of_a_diffusers_model_is_keyed_on_diffusers_version():
    diffusers = pytest.importorskip("diffusers")
    from mapoffload.conversion.code_key import class_versions

    mine = type("MyUNet", (diffusers.UNet2DModel,), {"__module__": "my_components"})
    assert class_versions(mine)["diffusers"] == diffusers.__version__
    assert "diffusers" not in class_versions(transformers.LlamaForCausalLM)


def test_the_body_of_a_decorated_method_is_in_the_key():
    """A method under a decorator (``@torch.no_grad()``): the wrapper's code was all that was hashed."""
    from mapoffload.conversion.code_key import class_code

    def make(constant: str):
        body = ("    import torch\n    @torch.no_grad()\n    def _init_weights(self, module):\n"
                f"        return {constant} if module is None else super()._init_weights(module)\n")
        return _exec_class(body, "__main__")

    assert class_code(make("1.0"), None, []) == class_code(make("1.0"), None, [])
    assert class_code(make("1.0"), None, []) != class_code(make("3.0"), None, [])


HELPED = (
    "import torch\nfrom transformers import LlamaForCausalLM\n"
    "HEAD = {head}\n"
    "def keep(model):\n    {keep}\n"
    "class Block:\n    def place(self, model):\n        keep(model)\n"
    "class MyLlamaForCausalLM(LlamaForCausalLM):\n"
    "    def __init__(self, config):\n        super().__init__(config)\n        Block().place(self)\n"
)


@pytest.mark.parametrize("before, after", [
    # a module-level function the class's code calls (through a class of the module), edited
    ({"head": "None", "keep": "pass"}, {"head": "None", "keep": "model.lm_head.to(torch.float32)"}),
    # a module-level value that function reads, edited
    ({"head": "torch.float16", "keep": "model.lm_head.to(HEAD)"},
     {"head": "torch.float32", "keep": "model.lm_head.to(HEAD)"}),
])
def test_code_the_class_calls_edited_converts_again(tmp_path, monkeypatch, before, after):
    """What a method runs through the module's names (a helper function, a class, a constant): its
    ``__init__`` unchanged, the edited helper made ``lm_head`` float32, and the old float16 conversion
    was reused, silently."""
    folder = tmp_path / "model"
    _tiny(folder)
    code = tmp_path / "mine_helped_code.py"
    code.write_text(HELPED.format(**before))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module("mine_helped_code")
        first, head = _load(module.MyLlamaForCausalLM, str(folder))
        assert not first.conversion_reused and head == torch.float16
        code.write_text(HELPED.format(**after))
        module = importlib.reload(module)
        second, head = _load(module.MyLlamaForCausalLM, str(folder))  # compares with transformers' own load
        assert not second.conversion_reused and head == torch.float32
        third, _ = _load(module.MyLlamaForCausalLM, str(folder))
        assert third.conversion_reused
    finally:
        sys.modules.pop("mine_helped_code", None)


def test_the_key_of_a_recursive_helper_is_stable():
    """Helpers calling each other (or themselves) are hashed once each, the same in every call."""
    from mapoffload.conversion.code_key import class_code

    body = ("    def __init__(self, config):\n        super().__init__(config)\n        ping(self, 3)\n")
    ns = {"__name__": "__main__"}
    exec(compile("from transformers import LlamaForCausalLM\n"
                 "def ping(m, n):\n    return pong(m, n - 1) if n else m\n"
                 "def pong(m, n):\n    return ping(m, n)\n"
                 "class Mine(LlamaForCausalLM):\n" + body, "<cell>", "exec"), ns)
    key = class_code(ns["Mine"], None, [])
    assert class_code(ns["Mine"], None, []) == key
    ns["pong"] = lambda m, n: m  # rebound in the module: what runs changed
    assert class_code(ns["Mine"], None, []) != key


def test_a_plain_value_of_the_class_its_code_reads_is_in_the_key():
    """``self.HEAD`` read by ``__init__``: a class attribute no loader names, edited."""
    from mapoffload.conversion.code_key import class_code

    def make(dtype: str):
        return _exec_class(f"    import torch\n    HEAD = torch.{dtype}\n    del torch\n", "__main__")

    assert class_code(make("float16"), None, []) == class_code(make("float16"), None, [])
    assert class_code(make("float16"), None, []) != class_code(make("float32"), None, [])
