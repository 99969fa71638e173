"""SliceGPT on tiny random models: rotation alone keeps the logits, slicing keeps exactly k hidden
dims everywhere (but the LM head, the final norm and the last block's output unless slice_head),
slice_head=True gives the logits of the code before the option, the kept directions are a
brute-force PCA's, save -> pyprune.load is exact while plain from_pretrained refuses, Gemma, bad
ratios and bad options are refused with the model untouched."""
import copy
import json

import pytest
import torch

import pyprune
from pyprune.methods.slicegpt import SliceGPT, principal_directions
from pyprune.nn.compact import keep_hidden_channels_
from pyprune.nn.layout import block_family
from pyprune.nn.rotation import ResidualRotations
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_decoder, tiny_llama

CALIB = random_tokens((8, 16), seed=1)
TOKENS = random_tokens((2, 16), seed=3)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("slice_head", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_rotation_without_slicing_keeps_the_logits(family, slice_head):
    model = tiny_decoder(family, layers=2).double()
    if family == "llama":  # a tied LM head: SliceGPT unties it (Q_0 and Q_L differ)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    expected = _logits(model)
    d = model.config.hidden_size
    SliceGPT(slice_head=slice_head).rotate_and_slice_(model, CALIB, d, batch_size=4, progress=False)
    rotations = [m for m in model.modules() if isinstance(m, ResidualRotations)]
    assert len(rotations) == 2 and not torch.allclose(rotations[0].attention, torch.eye(d, dtype=torch.float64))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    # fp64 weights; transformers' RMSNorm and softmax compute in fp32, hence 1e-6, not 1e-12
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=1e-6)


def _sliced(tied=True, ratio=0.25, family="llama", **options):
    model = tiny_llama(layers=2, tie_word_embeddings=tied) if family == "llama" else tiny_decoder(family, layers=2)
    report = pyprune.prune(model, "slicegpt", Structured(ratio), CALIB, batch_size=4, progress=False, **options)
    return model, report


@pytest.mark.parametrize("slice_head", [False, True])
def test_slicing_keeps_exactly_k_hidden_dims_but_the_head_unless_slice_head(slice_head):
    model, report = _sliced(slice_head=slice_head)
    d, k = 64, 48
    head = k if slice_head else d  # the authors' default keeps the LM head and the last block's output whole
    assert report["hidden_size"] == [d, k] and report["head_size"] == head and model.config.hidden_size == k
    assert model.model.embed_tokens.weight.shape == (128, k) and model.lm_head.weight.shape == (128, head)
    assert torch.equal(model.model.norm.weight, torch.full((head,), (d / head) ** 0.5))  # 1 over d entries
    widths = []
    for block in model.model.layers:
        block.register_forward_hook(lambda module, args, output: widths.append(output.shape[-1]))
    logits = _logits(model)
    assert widths == [k, head] and torch.isfinite(logits).all()  # every block's output sliced but the last's
    blocks = model.model.layers
    for index, block in enumerate(blocks):
        family = block_family(block)
        out = head if index == len(blocks) - 1 else k
        for name in family.hidden_readers:
            assert block.get_submodule(name).weight.shape[1] == k, name
        for name in family.hidden_writers:
            width = out if name == family.mlp_out else k
            assert block.get_submodule(name).weight.shape[0] == width, name
        for name in family.norms:  # plain normalisations dividing by the RMS over d entries
            assert torch.equal(block.get_submodule(name).weight, torch.full((k,), (d / k) ** 0.5))
        assert block.residual_rotation.attention.shape == (k, k) and block.residual_rotation.mlp.shape == (k, out)
    assert report["rotation_parameters"] == 3 * k * k + k * head
    assert report["parameters_after"] == sum(p.numel() for p in model.parameters())


#: logits[0, -1, :4] and sum |logits| of the tiny models sliced by the code before slice_head existed
#: (commit 2d67d71, which always sliced the head): slice_head=True gives them again
BEFORE_SLICE_HEAD = {"llama": ([0.05803927, -0.15001090, -0.01423867, -0.14002879], 580.38293),
                     "phi3": ([-0.06496542, 0.17201608, -0.03462145, -0.25042722], 527.09784)}


@pytest.mark.parametrize("family", BEFORE_SLICE_HEAD)
def test_slice_head_gives_the_logits_of_the_code_that_always_sliced_it(family):
    logits = _logits(_sliced(family=family, slice_head=True)[0])
    values, total = BEFORE_SLICE_HEAD[family]
    torch.testing.assert_close(logits[0, -1, :4], torch.tensor(values), rtol=1e-4, atol=1e-6)
    assert float(logits.abs().sum()) == pytest.approx(total, rel=1e-5)


def test_the_kept_directions_are_those_of_most_variance():
    # principal_directions against a brute-force PCA (SVD) of a toy with known variances
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([5.0, 0.1, 3.0, 0.5, 1.0, 0.01], dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=generator, dtype=torch.float64))[0]
    x = torch.randn(4000, 6, generator=generator, dtype=torch.float64) * scales @ basis.T
    values, vectors = principal_directions(x.T @ x)
    singular = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(values, singular.S ** 2)
    for k in (1, 3, 5):  # the same subspace: projectors agree, the energy kept is the top-k sum
        ours, brute = vectors[:, :k] @ vectors[:, :k].T, singular.Vh[:k].T @ singular.Vh[:k]
        torch.testing.assert_close(ours, brute, rtol=0, atol=1e-8)
    kept = (x @ vectors[:, :3]).square().sum()
    for _ in range(20):  # no other 3-dim subspace keeps more
        other = torch.linalg.qr(torch.randn(6, 3, generator=generator, dtype=torch.float64))[0]
        assert (x @ other).square().sum() < kept
    # on the model: the share SliceGPT keeps at the embedding is the brute-force top-k share
    model = tiny_llama(layers=2)
    rows = model.model.embed_tokens.weight.detach().double()[CALIB.flatten()]
    energy = torch.linalg.svdvals(rows) ** 2
    report = pyprune.prune(model, "slicegpt", Structured(0.25), CALIB, batch_size=4, progress=False)
    assert report["kept_variance"]["embedding"] == pytest.approx(float(energy[:48].sum() / energy.sum()), rel=1e-5)


@pytest.mark.parametrize("slice_head", [False, True])
def test_save_then_pyprune_load_is_exact_and_from_pretrained_refuses(tmp_path, slice_head):
    from transformers import AutoModelForCausalLM
    model, report = _sliced(slice_head=slice_head)
    expected = _logits(model)
    assert torch.equal(_logits(copy.deepcopy(model)), expected)  # the hooks follow a copy
    manifest = pyprune.save(model, None, tmp_path / "sliced", report)
    head = 48 if slice_head else 64
    assert manifest["residual_rotations"] == {"hidden_size": 48, "head_size": head, "dense_hidden_size": 64}
    assert manifest["config_compatible"] is False
    assert json.loads((tmp_path / "sliced" / "config.json").read_text())["hidden_size"] == 64
    loaded, _ = pyprune.load(tmp_path / "sliced")
    assert torch.equal(_logits(loaded), expected) and loaded.lm_head.in_features == head
    with pytest.raises(ValueError, match=r"pyprune-checkpoint: load it with pyprune\.load"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "sliced", local_files_only=True)
    if slice_head:  # a directory of format 4, which records no head_size: its head was sliced
        path = tmp_path / "sliced" / "pyprune.json"
        old = json.loads(path.read_text())
        del old["residual_rotations"]["head_size"]
        path.write_text(json.dumps(dict(old, version=4)))
        assert torch.equal(_logits(pyprune.load(tmp_path / "sliced")[0]), expected)


def test_gemma_and_bad_ratios_are_refused_with_the_model_untouched():
    gemma = tiny_decoder("gemma3", layers=2)
    state = copy.deepcopy(gemma.state_dict())
    with pytest.raises(ValueError, match="residual rotations need a block"):
        pyprune.prune(gemma, "slicegpt", Structured(0.25), CALIB, progress=False)
    assert all(torch.equal(state[k], v) for k, v in gemma.state_dict().items())
    llama = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="keeps 0 directions"):
        pyprune.prune(llama, "slicegpt", Structured(0.99), CALIB, progress=False)
    with pytest.raises(ValueError, match="eigen_dtype"):
        pyprune.prune(llama, "slicegpt", Structured(0.25), CALIB, progress=False, eigen_dtype="float16")
    for bad in ("sometimes", 1):
        with pytest.raises(ValueError, match=r"^option slice_head of method 'slicegpt' must be true or false; got "):
            pyprune.prune(llama, "slicegpt", Structured(0.25), CALIB, progress=False, slice_head=bad)
    assert llama.model.embed_tokens.weight.shape == (128, 64)
    tied = tiny_llama(layers=2, tie_word_embeddings=True)  # the head keeps what the shared embedding loses
    with pytest.raises(ValueError, match=r"^keep_hidden_channels_ slice_head=False: the LM head shares"):
        keep_hidden_channels_(tied, torch.arange(48), slice_head=False)
    assert tied.model.embed_tokens.weight.shape == (128, 64) and tied.model.layers[1].mlp.down_proj.out_features == 64
