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


def _code_of(src: str, name: str = "mine_exec", file: str | None = "/home/u/proj/mine_exec.py") -> dict:
    """``class_code`` of ``Mine`` in a module run from ``src`` (a user's file: ``__file__`` outside any
    install)."""
    from mapoffload.conversion.code_key import class_code

    ns = {"__name__": name, **({"__file__": file} if file else {})}
    exec(compile("import torch\nfrom transformers import LlamaForCausalLM\n" + src, file or "<cell>", "exec"), ns)
    return class_code(ns["Mine"], None, [])


MINE = "class Mine(LlamaForCausalLM):\n    def __init__(self, config):\n        super().__init__(config)\n        {}\n"


@pytest.mark.parametrize("before, after", [
    # a default argument of a helper under a decorator (torch's wrapper's code is torch's)
    ("@torch.no_grad()\ndef keep(m, dt=torch.float16):\n    m.lm_head.to(dt)\n",
     "@torch.no_grad()\ndef keep(m, dt=torch.float32):\n    m.lm_head.to(dt)\n"),
    # a partial, an enum member, a namespace of settings
    ("import functools\ndef cast(m, dt):\n    m.lm_head.to(dt)\nkeep = functools.partial(cast, dt=torch.float16)\n",
     "import functools\ndef cast(m, dt):\n    m.lm_head.to(dt)\nkeep = functools.partial(cast, dt=torch.float32)\n"),
    ("import enum\nclass P(enum.Enum):\n    HALF = 1\n    FULL = 2\nMODE = P.HALF\ndef keep(m):\n    return MODE\n",
     "import enum\nclass P(enum.Enum):\n    HALF = 1\n    FULL = 2\nMODE = P.FULL\ndef keep(m):\n    return MODE\n"),
    ("import types\nS = types.SimpleNamespace(dt=torch.float16)\ndef keep(m):\n    m.lm_head.to(S.dt)\n",
     "import types\nS = types.SimpleNamespace(dt=torch.float32)\ndef keep(m):\n    m.lm_head.to(S.dt)\n"),
    # a method of a reached class's base, under a decorator
    ("class Base:\n    @torch.no_grad()\n    def place(self, m):\n        m.lm_head.to(torch.float16)\n"
     "class Block(Base):\n    pass\ndef keep(m):\n    Block().place(m)\n",
     "class Base:\n    @torch.no_grad()\n    def place(self, m):\n        m.lm_head.to(torch.float32)\n"
     "class Block(Base):\n    pass\ndef keep(m):\n    Block().place(m)\n"),
])
def test_what_a_helper_reaches_is_in_the_key(before, after):
    assert _code_of(before + MINE.format("keep(self)")) == _code_of(before + MINE.format("keep(self)"))
    assert _code_of(before + MINE.format("keep(self)")) != _code_of(after + MINE.format("keep(self)"))


def test_a_package_named_like_a_standard_module_is_the_users():
    """``code.model`` (a user's package, not Python's ``code``) was skipped as Python's own."""
    body = MINE.format("self.lm_head.to(torch.{})")
    assert _code_of(body.format("float16"), "code.model", "/home/u/proj/code/model.py") != \
        _code_of(body.format("float32"), "code.model", "/home/u/proj/code/model.py")


def test_names_the_code_does_not_load_leave_the_key_alone():
    """``self.model`` is an attribute, not the script's global ``model``; what transformers caches on a
    class as it loads it (``..._cached_value``) is no code's: neither changes the key (each converted
    again once per process before)."""
    src = "model = None\n" + MINE.format("self.model.norm.weight.data.fill_(1.0)")
    key = _code_of(src)
    assert _code_of(src.replace("model = None", "model = object()")) == key
    from mapoffload.conversion.code_key import class_code

    ns = {"__name__": "mine_cached", "__file__": "/home/u/proj/mine_cached.py"}
    exec("from transformers import LlamaForCausalLM\n" + MINE.format("pass"), ns)
    before = class_code(ns["Mine"], None, [])
    ns["Mine"]._can_set_experts_implementation_cached_value = False
    assert class_code(ns["Mine"], None, []) == before


def test_values_that_cannot_be_read_do_not_stop_a_load():
    """A module whose ``__getattr__`` raises ImportError, a class attribute that raises on every access, a
    list holding itself: hashed as they can be, never raised."""
    src = ("import types\nclass Lazy(types.ModuleType):\n    def __getattr__(self, n):\n        raise ImportError(n)\n"
           "lazy = Lazy('lazy')\nclass AttrDict(dict):\n    __getattr__ = dict.__getitem__\n"
           "GRAPH = []\nGRAPH.append(GRAPH)\n"
           "class Block:\n    CFG = AttrDict()\n    def place(self, m):\n        return lazy, GRAPH, self.CFG\n")
    assert _code_of(src + MINE.format("Block().place(self)")) == _code_of(src + MINE.format("Block().place(self)"))


def test_a_conversion_the_key_missed_a_change_for_is_not_used(tmp_path, monkeypatch):
    """The net under the key: a reused conversion whose tensors the model takes in another dtype (its code
    changed in a way no key sees; here the key is made blind to code) is discarded and converted again,
    with a warning, where transformers would have rounded the stored float16 head into a float32 one."""
    import logging

    from mapoffload.conversion import naming

    monkeypatch.setattr(naming, "class_code", lambda *a, **k: {})  # a key blind to the model's code
    _tiny(tmp_path)
    first, head = _load(_exec_class("    pass\n", "__main__"), str(tmp_path))
    assert not first.conversion_reused and head == torch.float16
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mapoffload").addHandler(handler)
    try:
        body = ("    def __init__(self, config):\n        super().__init__(config)\n"
                "        self.lm_head.to(__import__('torch').float32)\n")
        second, head = _load(_exec_class(body, "__main__"), str(tmp_path))  # compared with transformers' own
    finally:
        logging.getLogger("mapoffload").removeHandler(handler)
    assert not second.conversion_reused and head == torch.float32
    assert any("lm_head.weight: stored torch.float16" in r.getMessage() for r in records)
    third, _ = _load(_exec_class(body, "__main__"), str(tmp_path))
    assert third.conversion_reused  # the new conversion took the old one's place
