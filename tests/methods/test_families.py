"""The unstructured methods on every dense family (tiny random models): exact N:M counts on every
prunable linear, nothing left dense, and the pruned model kept through SparseLinear, save,
pyprune.load and plain from_pretrained with the same logits. (MoE families: tests/methods/test_moe.py;
structured methods: tests/methods/test_structured_families.py; the engine: tests/runtime/test_engine.py.)"""
import copy

import pytest
import torch

import pyprune
from pyprune.nn import sparsify_
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_decoder

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "glm4", "exaone4", "cohere", "olmo2",
         "opt", "gpt_neox")
METHODS = [("magnitude", {}), ("wanda", {}), ("sparsegpt", {}), ("safe+", {"epochs": 1}), ("copal", {})]


def _model(family):
    return tiny_decoder(family, layers=2)


@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
@pytest.mark.parametrize("family", DENSE)
def test_every_linear_of_every_family_is_exactly_2_4(family, method, options):
    model = _model(family)
    report = pyprune.prune(model, method, "2:4", random_tokens((5, 24)), batch_size=2, progress=False,
                           **options)
    linears = [linear for block in engine.decoder_blocks(model) for linear in engine.block_linears(block).values()]
    assert len(report["layers"]) == len(linears) > 0
    for linear in linears:
        kept = (linear.weight != 0).reshape(linear.out_features, -1, 4).sum(-1)
        assert bool((kept == 2).all())  # random weights hold no zeros of their own
    assert report["nm_valid"]["2:4"] and report["left_dense"] == {"tensors": [], "parameters": 0}


@pytest.mark.parametrize("family", DENSE)
def test_a_pruned_model_keeps_its_logits_through_sparse_layers_save_load_and_from_pretrained(family, tmp_path):
    from transformers import AutoModelForCausalLM
    model = _model(family)
    tokens = random_tokens((5, 24))
    report = pyprune.prune(model, "sparsegpt", "2:4", tokens, batch_size=2, progress=False)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
        pyprune.save(model, None, str(tmp_path / "dense-form"), report)
        loaded, _ = pyprune.load(str(tmp_path / "dense-form"))
        assert torch.equal(loaded(input_ids=tokens).logits, logits)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense-form", dtype=torch.float32).eval()
        assert torch.equal(plain(input_ids=tokens).logits, logits)
        sparse = copy.deepcopy(model)
        replaced = sparsify_(sparse, "2:4", implementation="kernel")
        assert len(replaced) == len(report["layers"])
        torch.testing.assert_close(sparse(input_ids=tokens).logits, logits, rtol=1e-4, atol=1e-4)
        pyprune.save(sparse, None, str(tmp_path / "sparse-form"), report)
        reloaded, _ = pyprune.load(str(tmp_path / "sparse-form"))
        assert torch.equal(reloaded(input_ids=tokens).logits, sparse(input_ids=tokens).logits)


@pytest.mark.parametrize("family", DENSE)
def test_block_training_lowers_every_blocks_reconstruction_loss(family):
    """The training loop SAFE and masked-recon share works on every family's blocks (their own
    arguments: masks, RoPE): each block's loss after training is below its loss at Wanda's mask."""
    report = pyprune.prune(_model(family), "masked-recon", "2:4", random_tokens((4, 24)), batch_size=2,
                           progress=False, epochs=4, lr=1e-3)
    assert [block["block"] for block in report["blocks"]] == [0, 1]
    for block in report["blocks"]:
        assert block["loss_last"] < 0.8 * block["loss_first"], block
