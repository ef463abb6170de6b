"""A transformers model offloaded in place (``device="cpu"``) stays a normal
model: ``state_dict()`` is the checkpoint's, ``save_pretrained()`` round-trips,
``model(ids)`` outside ``no_grad`` equals transformers' own output, and the
gradient with respect to ``inputs_embeds`` is transformers' exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from hf_models import save  # noqa: E402
from same_kernels import host_weights, same_threads, seat_like  # noqa: E402

IDS = [[3, 17, 42, 5, 88, 9, 61]]
ENTRIES = ["from_pretrained", "offload"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-fp32")
    return save("llama", torch.float32, folder), str(folder)


def _offloaded(cls, folder, entry):
    if entry == "from_pretrained":
        model = mapoffload.from_pretrained(cls, folder, device="cpu", keep_mapping=True)
        return model, model.mapoffload_handle
    model = cls.from_pretrained(folder).eval()
    return model, mapoffload.offload(model, device="cpu")


def _same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("entry", ENTRIES)
def test_state_dict_and_save_pretrained_round_trip(llama, entry, tmp_path):
    cls, folder = llama
    ref = cls.from_pretrained(folder).eval()
    model, handle = _offloaded(cls, folder, entry)
    with handle:
        stack = next(iter(handle.managers.values()))
        regions = mapoffload.MappedRegions()
        for name, host in stack.iter_cpu_weights():
            p = model.get_parameter(name)
            assert not isinstance(p, mapoffload.OffloadedWeight) and p.data_ptr() == host.data_ptr(), name
            if entry == "from_pretrained":
                assert regions.holds(p), name  # the mapped tensors themselves
        with torch.no_grad():
            model(input_ids=torch.tensor(IDS))  # between forwards, as before any
        _same_state(model.state_dict(), ref.state_dict())
        assert torch.equal(model.model.layers[1].mlp.up_proj.weight, ref.model.layers[1].mlp.up_proj.weight)
        model.save_pretrained(tmp_path / "saved")
    _same_state(cls.from_pretrained(tmp_path / "saved").state_dict(), ref.state_dict())


@pytest.mark.parametrize("entry", ENTRIES)
def test_forward_outside_no_grad_and_input_gradients_equal_transformers(llama, entry):
    cls, folder = llama
    ref = cls.from_pretrained(folder).eval()
    model, handle = _offloaded(cls, folder, entry)
    ids = torch.tensor(IDS)
    with handle, same_threads():
        seat_like(ref, host_weights(model, handle))  # the same kernels on both sides
        want = ref(input_ids=ids).logits
        got = model(input_ids=ids).logits  # grad mode on, weights requiring grad: a plain call
        assert got.requires_grad and torch.equal(got.detach(), want.detach())
        grads = []
        for m in (ref, model):
            emb = m.get_input_embeddings()(ids).detach().requires_grad_()
            out = m(inputs_embeds=emb).logits
            grads.append(torch.autograd.grad(out.square().sum(), emb)[0])
        assert torch.equal(grads[0], grads[1])
