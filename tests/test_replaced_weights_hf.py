"""Replaced weights through the Hugging Face entry points (issue 36): ``offload()`` and
``from_pretrained`` on ``device="cpu"`` (in place) and on the device pipeline's CPU twin, a weight
swapped between generated tokens, the tied embedding swapped; each against transformers' own model
holding the same new weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import mapoffload  # noqa: E402
import importlib  # noqa: E402

offload_pkg = importlib.import_module("mapoffload.offload")  # the package (mapoffload.offload is the function)
from hf_models import save  # noqa: E402

IDS = torch.tensor([[3, 17, 42, 5, 88, 9, 61]])
ENTRIES = ["from_pretrained", "offload"]
WAYS = ["parameter", "data", "assign"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-swap")
    return save("llama", torch.float32, folder), str(folder)


@pytest.fixture(params=["in-place", "twin"])
def path_kind(request, monkeypatch):
    """The twin: every manager the entry points make runs the device pipeline on the CPU."""
    if request.param == "twin":
        real = offload_pkg.LayerwiseOffloadManager

        class Twin(real):
            def __init__(self, *args, **kwargs):
                kwargs.update(cpu_twin=True, host_store="mapped")
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(offload_pkg, "LayerwiseOffloadManager", Twin)
    return request.param


def _offloaded(cls, folder, entry):
    if entry == "from_pretrained":
        model = mapoffload.from_pretrained(cls, folder, device="cpu")
        return model, model.mapoffload_handle
    model = cls.from_pretrained(folder).eval()
    return model, mapoffload.offload(model, device="cpu")


def _replace(module: nn.Module, attr: str, new: torch.Tensor, way: str, like: nn.Module) -> None:
    if way == "parameter":
        setattr(module, attr, nn.Parameter(new.clone()))
    elif way == "data":
        getattr(module, attr).data = new.clone()
    else:
        sd = {n: (new.clone() if n == attr else p.detach().clone()) for n, p in like.named_parameters()}
        module.load_state_dict(sd, assign=True)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_replaced_weight_computes(llama, entry, way, path_kind):
    cls, folder = llama
    model, handle = _offloaded(cls, folder, entry)
    ref = cls.from_pretrained(folder).eval()
    _logits(model)
    torch.manual_seed(3)
    new = torch.randn_like(ref.model.layers[1].mlp.down_proj.weight)
    _replace(model.model.layers[1].mlp.down_proj, "weight", new, way, like=ref.model.layers[1].mlp.down_proj)
    ref.model.layers[1].mlp.down_proj.weight = nn.Parameter(new.clone())
    for _ in range(2):
        assert torch.equal(_logits(model), _logits(ref))
    handle.close()
    assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_weight_swapped_between_generated_tokens(llama, entry, path_kind):
    """A logits processor swaps a layer's weight after the second token: the following tokens are
    those of transformers' model with the same swap at the same step."""
    cls, folder = llama
    model, handle = _offloaded(cls, folder, entry)
    ref = cls.from_pretrained(folder).eval()
    torch.manual_seed(4)
    new = torch.randn_like(ref.model.layers[0].self_attn.o_proj.weight) * 3

    class SwapAt(transformers.LogitsProcessor):
        def __init__(self, m):
            self.m, self.step = m, 0

        def __call__(self, input_ids, scores):
            self.step += 1
            if self.step == 2:
                self.m.model.layers[0].self_attn.o_proj.weight = nn.Parameter(new.clone())
            return scores

    def gen(m):
        with torch.no_grad():
            return m.generate(IDS, max_new_tokens=6, do_sample=False, logits_processor=[SwapAt(m)],
                              pad_token_id=0)

    got, want = gen(model), gen(ref)
    assert torch.equal(got, want)
    handle.close()


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_tied_embedding_swapped(llama, entry, path_kind):
    """The tied embedding is outside the layers (the model's to place): swapping it, tied or untied,
    is a normal model's swap."""
    cls, folder = llama
    model, handle = _offloaded(cls, folder, entry)
    ref = cls.from_pretrained(folder).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.manual_seed(5)
    new = nn.Parameter(torch.randn_like(ref.lm_head.weight))
    model.model.embed_tokens.weight = model.lm_head.weight = new
    ref.model.embed_tokens.weight = ref.lm_head.weight = nn.Parameter(new.detach().clone())
    assert torch.equal(_logits(model), _logits(ref))
    head = nn.Parameter(torch.randn_like(ref.lm_head.weight))  # untied: only the head
    model.lm_head.weight = head
    ref.lm_head.weight = nn.Parameter(head.detach().clone())
    assert torch.equal(_logits(model), _logits(ref))
    handle.close()


def test_another_dtype_is_refused_naming_the_weight(llama):
    cls, folder = llama
    model = mapoffload.from_pretrained(cls, folder, device="cpu")
    w = model.model.layers[0].mlp.up_proj.weight
    model.model.layers[0].mlp.up_proj.weight = nn.Parameter(w.detach().to(torch.bfloat16))
    with pytest.raises(mapoffload.ReplacedWeightError, match=r"layers\.0\.mlp\.up_proj\.weight.*bfloat16"):
        _logits(model)
    model.mapoffload_handle.close()
