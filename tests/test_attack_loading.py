"""Loading, attacked by hostile reviews: results that were silently wrong (or a valid checkpoint refused at
every forward), each test failing before its fix.

- A load that converts (a dtype cast) left persistent float buffers (BatchNorm's running statistics) at
  their initial values: the mapped view put in their place did not carry transformers' "loaded" mark, so
  its initialisation overwrote it. The next load (the conversion reused) was right.
- A sharded checkpoint's index was not in the conversion's key: transformers takes an ``"auto"`` dtype from
  its metadata where the config has none, so an edited index reused a conversion in the other dtype.
- ``load_checkpoint`` took a tie group's tensor from the first of its names in the file and never looked
  at the others: another tensor stored under a tied name was neither loaded, checked nor reported.
- ``LoadReport.copied`` lost the bytes transformers made itself where the decision copied
  (``keep_mapping=False``): its reasons did not add up to ``bytes_copied``.
- An fp8 weight's float32 scale packed at an address not a multiple of 4 (the format allows it) made
  every forward raise: the native kernel reads scales aligned.
"""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from mapoffload import empty_weights, load_checkpoint  # noqa: E402


def _quiet(load, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(*args, **kwargs)


def test_a_cast_keeps_the_checkpoint_s_batchnorm_statistics(tmp_path):
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    num_labels=3)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(cfg).eval()
    with torch.no_grad():
        for _, b in model.named_buffers():
            if b.is_floating_point():
                b.add_(torch.rand_like(b) + 0.5)  # trained statistics, not the initial 0 and 1
    model.save_pretrained(tmp_path)
    cls = transformers.ResNetForImageClassification
    ref = _quiet(cls.from_pretrained, tmp_path, dtype=torch.bfloat16).eval()
    x = torch.randn(1, 3, 32, 32, dtype=torch.bfloat16)
    for reused in (False, True):
        ours = _quiet(mapoffload.from_pretrained, cls, tmp_path, device=None, dtype=torch.bfloat16)
        assert ours.mapoffload_report.conversion_reused is reused
        for name, b in ref.named_buffers():
            assert torch.equal(ours.get_buffer(name), b), (reused, name)
        with torch.no_grad():
            assert torch.equal(ours(x).logits, ref(x).logits)


def test_an_index_whose_dtype_changed_is_not_served_the_old_conversion(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="20KB")  # float32, sharded
    config = json.loads((tmp_path / "config.json").read_text())
    for k in ("dtype", "torch_dtype"):
        config.pop(k, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    index = tmp_path / "model.safetensors.index.json"
    cls = transformers.LlamaForCausalLM
    for dtype in ("bfloat16", "float32"):
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["dtype"] = dtype
        index.write_text(json.dumps(data))
        ref = _quiet(cls.from_pretrained, tmp_path)
        ours = _quiet(mapoffload.from_pretrained, cls, tmp_path, device=None)
        for name, p in ref.named_parameters():
            q = ours.get_parameter(name)
            assert q.dtype == p.dtype and torch.equal(q, p), (dtype, name, q.dtype, p.dtype)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def _tied_file(tmp_path, head):
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    emb = torch.randn(10, 4)
    save_file({"emb.weight": emb, "head.weight": emb.clone() if head is None else head}, str(path))
    return path, emb


@pytest.mark.parametrize("head", [torch.randn(7, 3), torch.randn(10, 4)], ids=["other-shape", "other-values"])
def test_a_tied_name_holding_another_tensor_is_refused(tmp_path, head):
    path, _ = _tied_file(tmp_path, head)
    with empty_weights():
        model = Tied()
    with pytest.raises(ValueError, match="head.weight"):
        load_checkpoint(model, str(path), keep_mapping=True, strict=True)
    assert model.emb.weight.device.type == "meta"  # nothing assigned


def test_a_tied_name_holding_the_same_tensor_loads(tmp_path):
    path, emb = _tied_file(tmp_path, None)
    with empty_weights():
        model = Tied()
    report = load_checkpoint(model, str(path), keep_mapping=True, strict=True)
    assert torch.equal(model.head.weight, emb) and model.head.weight is model.emb.weight
    assert not report.unexpected_keys and not report.missing_keys


def test_a_tie_is_judged_by_its_bytes(tmp_path):
    """The same bytes with a NaN in them load (``torch.equal`` called them other values); ``0.0`` against
    ``-0.0`` are other bytes, refused."""
    from safetensors.torch import save_file

    emb = torch.randn(10, 4)
    emb[3, 1] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file({"emb.weight": emb, "head.weight": emb.clone()}, str(path))
    with empty_weights():
        model = Tied()
    load_checkpoint(model, str(path), keep_mapping=True, strict=True)
    assert torch.equal(model.emb.weight.view(torch.int32), emb.view(torch.int32))
    zeros = torch.zeros(10, 4)
    path = tmp_path / "zeros.safetensors"
    save_file({"emb.weight": zeros, "head.weight": -zeros}, str(path))
    with empty_weights():
        model = Tied()
    with pytest.raises(ValueError, match="other values"):
        load_checkpoint(model, str(path), keep_mapping=True, strict=True)


def test_the_copied_bytes_reasons_add_up_where_the_decision_copied(tmp_path):
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(tmp_path)
    for keep in (True, False):
        report = _quiet(mapoffload.from_pretrained, transformers.BertForMaskedLM, tmp_path, device=None,
                        keep_mapping=keep).mapoffload_report
        assert sum(report.copied.values()) == report.bytes_copied, (keep, report.copied, report.bytes_copied)
    made = [r for r in report.copied if r is not mapoffload.CopyReason.ASKED]
    assert made, report.copied  # transformers' own bytes (the MLM head's bias) under their reason


def test_an_fp8_scale_packed_unaligned_computes(tmp_path):
    """safetensors asks no alignment: a float32 scale at an odd address (after a 3-byte int8 tensor and a
    padded header) made every forward of the loaded fp8 model raise (the native kernel reads it aligned)."""
    from fp8_models import random_codes, random_scales, transformers_dequant
    from packed_safetensors import write_packed

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tag = torch.nn.Parameter(torch.zeros(3, dtype=torch.int8), requires_grad=False)
            self.lin = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x):
            return self.lin(x) + self.tag.float().sum()

    codes, scale = random_codes((64, 64)), random_scales((2, 2))
    path = tmp_path / "m.safetensors"
    write_packed(path, {"tag": torch.tensor([1, 2, 3], dtype=torch.int8), "lin.weight_scale_inv": scale,
                        "lin.weight": codes}, odd="lin.weight_scale_inv")
    with empty_weights():
        model = M().eval()
    load_checkpoint(model, str(path), keep_mapping=True)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(model(x), x @ transformers_dequant(codes, scale, torch.float32).t() + 6)


def test_an_fp8_kept_model_converts_as_the_dequantized_model_does(tmp_path):
    """``model.half()`` / ``.float()`` / ``.to(dtype)`` on an fp8-kept model cast its codes like any floating
    weight, and every later forward raised (``codes must be float8``): the model was lost. Now the weight
    converts as the plain model's does (each rounding in turn) and the codes stay fp8 views of the file."""
    import copy

    from safetensors.torch import save_file

    from fp8_models import Stack, random_codes, random_scales, transformers_dequant
    from mapoffload.loading.fp8 import fp8_weights

    torch.manual_seed(0)
    ref = Stack(256, 2).to(torch.bfloat16).eval()
    state = {}
    for name, t in ref.state_dict().items():
        if name.endswith(("up.weight", "down.weight")):
            codes, scale = random_codes(t.shape, seed=len(state)), random_scales((2, 2))
            state[name], state[name + "_scale_inv"] = codes, scale
            with torch.no_grad():
                t.copy_(transformers_dequant(codes, scale, torch.bfloat16))
        else:
            state[name] = t.contiguous()
    path = tmp_path / "m.safetensors"
    save_file(state, str(path))
    for convert in (lambda m: m.half(), lambda m: m.float(), lambda m: m.half().float(),
                    lambda m: m.to(torch.float32).to(torch.bfloat16)):
        with empty_weights():
            model = Stack(256, 2).to(torch.bfloat16).eval()
        load_checkpoint(model, str(path), keep_mapping=True)
        plain = copy.deepcopy(ref)
        twin = copy.deepcopy(model)  # a copy converts itself, not the model it was copied from
        convert(twin)
        convert(model)
        convert(plain)
        assert torch.equal(twin(torch.ones(1, 256, dtype=next(plain.parameters()).dtype)),
                           model(torch.ones(1, 256, dtype=next(plain.parameters()).dtype)))
        dtype = next(plain.parameters()).dtype
        x = torch.randn(2, 3, 256).to(dtype)
        with torch.no_grad():
            assert torch.equal(model(x), plain(x))
        kept = list(fp8_weights(model))
        assert kept and all(codes.dtype == torch.float8_e4m3fn for _, codes, _ in kept)
