"""Hybrid decoder families on tiny random models: Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet
linear attention in block 0), Falcon-H1 (Mamba2 beside attention in every block), LFM2 (a short
convolution in block 0). Their depthwise Conv1d is no fused experts module; the engine's block inputs
equal the model's own hidden states; Wanda's masks equal a sequential full-model reference, and every
linear projection gets the pattern, unstructured, N:M and with block training; the convolutions and
the mixers' state and gate parameters stay as they are and the report lists them; Taylor with
heads=False prunes every block's MLP channels (an MoE hybrid's expert channels) and equals the
from-config model of that size holding the hand-sliced weights, with heads it refuses naming the
mixer, as SliceGPT does. (The dense families: tests/runtime/test_engine.py,
tests/methods/test_families.py.)"""
import copy

import pytest
import torch

import pyprune
from pyprune import ops
from pyprune.nn.anatomy import block_linears, decoder_blocks
from pyprune.nn.experts import expert_linears, fused_experts
from pyprune.patterns import NM, Structured, Unstructured
from pyprune.runtime import engine
from tests.helpers import HYBRID, random_tokens, tiny_decoder

#: what stays dense in each family's block 0 (Falcon-H1: in both blocks), by name inside the block
MIXER_STATE = {
    "qwen3_5": ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias"),
    "qwen3_5_moe": ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias"),
    "qwen3_next": ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias"),
    "falcon_h1": ("mamba.conv1d.weight", "mamba.conv1d.bias", "mamba.A_log", "mamba.D", "mamba.dt_bias"),
    "lfm2": ("conv.conv.weight",),
}
MOE = ("qwen3_5_moe", "qwen3_next")
TOKENS = random_tokens((5, 24))



def _state(model, family):
    """Every mixer state parameter of the model by qualified name, copied."""
    return {f"model.layers.{index}.{name}": block.get_parameter(name).detach().clone()
            for index, block in enumerate(decoder_blocks(model)) for name in MIXER_STATE[family]
            if name.split(".")[0] in dict(block.named_children())}


@pytest.mark.parametrize("family", HYBRID)
def test_a_depthwise_convolution_is_no_fused_experts_module(family, tiny_copy):
    model = tiny_copy(family)
    for block in decoder_blocks(model):
        assert set(fused_experts(block, where="block")) == ({"mlp.experts"} if family in MOE else set())
    conv = next(m for m in decoder_blocks(model)[0].modules() if isinstance(m, torch.nn.Conv1d))
    assert conv.weight.dim() == 3 and conv.weight.shape[1] == 1  # depthwise: one input channel per group


@pytest.mark.parametrize("family", HYBRID)
def test_block_inputs_equal_the_model_hidden_states(family, tiny_copy):
    """Each block runs on a batch without a cache (its recurrent state starts afresh, as in the model's
    own forward over the whole sequence), 5 samples in batches of 2."""
    model = tiny_copy(family)
    assert not any("cache" in key for arguments in engine.capture_block_arguments(model, TOKENS)
                   for key in arguments if key != "use_cache")
    seen = []
    engine.run_blockwise(model, TOKENS, lambda ctx: seen.append(ctx.inputs.clone()), batch_size=2, progress=False)
    with torch.no_grad():
        hidden = model(input_ids=TOKENS, output_hidden_states=True, use_cache=False).hidden_states
    assert len(seen) == 2
    for index, inputs in enumerate(seen):
        torch.testing.assert_close(inputs, hidden[index], rtol=1e-5, atol=1e-5, msg=f"block {index}")


def _sequential_wanda(model, pattern):
    """Wanda by hand: block after block, the whole (partly pruned) model runs over the calibration
    batches with hooks on that block's linears (an MoE's experts one linear per expert matrix, which
    sees the tokens routed to it), then each linear is pruned from its input norms."""
    with torch.no_grad():
        for block in decoder_blocks(model):
            with expert_linears(block):
                linears = block_linears(block)
                norms = {name: torch.zeros(linear.in_features) for name, linear in linears.items()}

                def observe(name):
                    def hook(module, args, output):
                        ops.accumulate_sqnorm_(norms[name], args[0])  # returns None: the output stays
                    return hook

                handles = [linear.register_forward_hook(observe(name)) for name, linear in linears.items()]
                for start in range(0, TOKENS.shape[0], 2):
                    model(input_ids=TOKENS[start:start + 2], use_cache=False)
                for handle in handles:
                    handle.remove()
                for name, linear in linears.items():
                    linear.weight.mul_(pattern.weight_mask(linear.weight, norms[name]))


@pytest.mark.parametrize("pattern", [NM(2, 4), Unstructured(0.5, "row")], ids=["2:4", "0.5"])
@pytest.mark.parametrize("family", HYBRID)
def test_wanda_masks_equal_a_sequential_reference_and_the_mixer_state_stays(family, pattern, tiny_copy):
    model = tiny_copy(family)
    reference, state = copy.deepcopy(model), _state(model, family)
    report = pyprune.prune(model, "wanda", pattern, TOKENS, batch_size=2, progress=False)
    _sequential_wanda(reference, pattern)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got == 0, want == 0), name
    projections = [n for n in block_linears(decoder_blocks(model)[0])
                   if n.startswith(("linear_attn.", "mamba.", "conv."))]
    assert len(projections) >= 2 and all(f"model.layers.0.{n}" in {layer["name"] for layer in report["layers"]}
                                         for n in projections)
    assert report["sparsity"] == 0.5 and report["nm_valid"]["2:4"] == isinstance(pattern, NM)
    assert set(state) <= set(report["left_dense"]["tensors"])
    assert all(torch.equal(model.get_parameter(name), value) for name, value in state.items())


@pytest.mark.parametrize("family", HYBRID)
def test_block_training_gives_exact_2_4_and_lowers_every_blocks_loss(family, tiny_copy):
    """masked-recon (Wanda's mask, then the block's kept weights trained on the dense outputs) runs
    through the hybrid blocks with gradients: 2:4 on every linear, each block's loss falls."""
    model = tiny_copy(family)
    report = pyprune.prune(model, "masked-recon", "2:4", TOKENS[:4], batch_size=2, progress=False, epochs=4, lr=1e-3)
    assert report["nm_valid"]["2:4"] and [block["block"] for block in report["blocks"]] == [0, 1]
    for block in report["blocks"]:
        assert block["loss_last"] < 0.8 * block["loss_first"], block


@pytest.mark.parametrize("method", ["taylor", "slicegpt"])
@pytest.mark.parametrize("family", HYBRID)
def test_structured_methods_refuse_a_recurrent_mixer_by_name(family, method, tiny_copy):
    """Heads (Taylor's default) and hidden slicing (SliceGPT; an MoE hybrid: its experts, checked first)
    name block 0's mixer, in one line, before anything changes."""
    mixer = MIXER_STATE[family][0].split(".")[0]
    refusal = ("its structured pruning acts on dense blocks" if family in MOE and method == "slicegpt"
               else f"model.layers.0 .*mixes tokens with {mixer} .*"
               + ("pass heads=False" if method == "taylor" else "not attention heads"))
    model = tiny_copy(family)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=refusal) as info:
        pyprune.prune(model, method, Structured(0.25), TOKENS, progress=False)
    assert "\n" not in str(info.value)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


#: each dense hybrid's gated MLP (gate, up, down) inside a block
MLPS = {"qwen3_5": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        "falcon_h1": ("feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"),
        "lfm2": ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")}


@pytest.mark.parametrize("family", sorted(MLPS))
def test_taylor_prunes_every_blocks_mlp_channels_around_the_mixer(family, tiny_copy, tmp_path):
    """heads=False: each block keeps its MLP channels of highest |W ⊙ ∇W| (gate and up rows, down column,
    from the gradient of the mean loss computed here), the mixer and attention untouched; the result
    equals a from-config model with that intermediate_size holding the hand-sliced weights, and reads back
    with plain from_pretrained."""
    from transformers import AutoModelForCausalLM
    dense = tiny_copy(family)
    model = copy.deepcopy(dense)
    report = pyprune.prune(model, "taylor", Structured(0.25), TOKENS, batch_size=5, progress=False, heads=False)
    graded = copy.deepcopy(dense)
    graded(input_ids=TOKENS, labels=TOKENS, use_cache=False).loss.backward()
    state = dense.state_dict()
    gate, up, down = MLPS[family]
    for index, block in enumerate(decoder_blocks(graded)):
        taylor = {name: (block.get_submodule(name).weight * block.get_submodule(name).weight.grad).abs().double()
                  for name in (gate, up, down)}
        scores = taylor[gate].sum(dim=1) + taylor[up].sum(dim=1) + taylor[down].sum(dim=0)
        kept = torch.sort(scores, descending=True, stable=True).indices[:round(0.75 * scores.numel())].sort().values
        assert report["structure"][index]["pruned_channels"] == sorted(set(range(scores.numel())) - set(kept.tolist()))
        for name, axis in ((gate, 0), (up, 0), (down, 1)):
            key = f"model.layers.{index}.{name}.weight"
            state[key] = state[key].index_select(axis, kept)
    config = copy.deepcopy(dense.config)
    config.intermediate_size = len(kept)
    reference = type(dense)(config).eval()
    reference.load_state_dict(state, strict=True)
    mixer = [n for n in dense.state_dict()
             if n.startswith("model.layers.") and n.split(".")[3] in ("linear_attn", "mamba", "conv", "self_attn")]
    assert mixer
    assert all(torch.equal(model.state_dict()[n], dense.state_dict()[n]) for n in mixer)
    with torch.no_grad():
        logits = model(input_ids=TOKENS, use_cache=False).logits
        assert torch.equal(logits, reference(input_ids=TOKENS, use_cache=False).logits)
        pyprune.save(model, None, str(tmp_path / "pruned"), report)
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pruned")).eval()
        assert torch.equal(plain(input_ids=TOKENS, use_cache=False).logits, logits)


def test_taylor_prunes_an_moe_hybrids_expert_channels(tiny_copy):
    """Qwen3-Next: heads=False prunes its experts' and shared expert's channels; Gated DeltaNet stays."""
    model = tiny_copy("qwen3_next")
    state = _state(model, "qwen3_next")
    pyprune.prune(model, "taylor", Structured(0.25), TOKENS, batch_size=5, progress=False, heads=False)
    assert model.config.moe_intermediate_size == 24 and model.config.shared_expert_intermediate_size == 24
    assert all(torch.equal(model.get_parameter(name), value) for name, value in state.items())


@pytest.mark.parametrize("family", HYBRID)
def test_a_pruned_hybrid_keeps_its_logits_through_sparse_layers_save_load_and_from_pretrained(family, tiny_copy, tmp_path):
    from transformers import AutoModelForCausalLM
    from pyprune.nn import sparsify_
    model = tiny_copy(family)
    report = pyprune.prune(model, "sparsegpt", "2:4", TOKENS, batch_size=2, progress=False)
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
        pyprune.save(model, None, str(tmp_path / "dense-form"), report)
        loaded, _ = pyprune.load(str(tmp_path / "dense-form"))
        assert torch.equal(loaded(input_ids=TOKENS).logits, logits)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense-form", dtype=torch.float32).eval()
        assert torch.equal(plain(input_ids=TOKENS).logits, logits)
        sparse = copy.deepcopy(model)
        assert len(sparsify_(sparse, "2:4")) == len(report["layers"])
        torch.testing.assert_close(sparse(input_ids=TOKENS).logits, logits, rtol=1e-4, atol=1e-4)
        pyprune.save(sparse, None, str(tmp_path / "sparse-form"), report)
        reloaded, _ = pyprune.load(str(tmp_path / "sparse-form"))
        assert torch.equal(reloaded(input_ids=TOKENS).logits, sparse(input_ids=TOKENS).logits)


@pytest.mark.parametrize("family", ["falcon_h1", "lfm2"])
def test_sleb_removes_a_hybrid_block_as_skipping_it_does_and_the_model_reloads(family, tmp_path):
    """Falcon-H1's blocks return a tuple, LFM2's a tensor: the skipped block hands on its input in the
    container the model reads; the saved model, its per-block layer types cut, loads with the same logits."""
    from transformers import AutoModelForCausalLM
    from pyprune.methods.sleb import skipped
    model = tiny_decoder(family, layers=4)
    dense = copy.deepcopy(model)
    report = pyprune.prune(model, "sleb", Structured(0.25), TOKENS[:4, :16], progress=False)
    assert len(report["removed_blocks"]) == 1 and len(decoder_blocks(model)) == model.config.num_hidden_layers == 3
    with torch.no_grad(), skipped(decoder_blocks(dense)[report["removed_blocks"][0]]):
        expected = dense(input_ids=TOKENS).logits
    pyprune.save(model, None, str(tmp_path / "sleb"), report)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sleb", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=TOKENS).logits, expected)
        torch.testing.assert_close(loaded(input_ids=TOKENS).logits, expected)
