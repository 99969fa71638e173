"""The layer-wise engine and evaluation on tiny random models (every family for the block inputs)."""
import math

import pytest
import torch
import torch.nn.functional as F

from pyprune.runtime import engine
from pyprune.evaluation.perplexity import perplexity
from pyprune.nn.measure import sparsity_report
from tests.helpers import FAMILIES, random_tokens, tiny_decoder, tiny_llama


def test_blockwise_pass_reproduces_the_model_hidden_states():
    model = tiny_llama(layers=3)
    tokens = random_tokens((5, 24))
    seen = []
    engine.run_blockwise(model, tokens, lambda ctx: seen.append((ctx.index, ctx.name, ctx.inputs.clone())),
                         batch_size=2, progress=False)
    hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states
    assert [(i, n) for i, n, _ in seen] == [(i, f"model.layers.{i}") for i in range(3)]
    for index, _, inputs in seen:
        torch.testing.assert_close(inputs, hidden[index], rtol=1e-5, atol=1e-5)


#: every family with both attention implementations, but Gemma 2, which transformers runs eager only
FAMILY_CASES = [(family, impl) for family in FAMILIES for impl in ("eager", "sdpa")
                if (family, impl) != ("gemma2", "sdpa")]


@pytest.mark.parametrize("family,attn_implementation", FAMILY_CASES)
def test_block_inputs_equal_the_full_forward_hidden_states_in_every_family(family, attn_implementation):
    """Each block gets its own arguments (a sliding-window block its own mask; Gemma 3's local blocks
    their own RoPE): the inputs the engine propagates through dense blocks equal the model's own hidden
    states at every block, with a last partial batch (5 samples, batch size 2) and windows shorter
    than the sequence."""
    model = tiny_decoder(family, attn_implementation=attn_implementation)
    tokens = random_tokens((5, 24))
    seen = []
    engine.run_blockwise(model, tokens, lambda ctx: seen.append(ctx.inputs.clone()), batch_size=2, progress=False)
    with torch.no_grad():
        hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states
    assert len(seen) == len(engine.decoder_blocks(model)) == 4
    for index, inputs in enumerate(seen):
        torch.testing.assert_close(inputs, hidden[index], rtol=1e-5, atol=1e-5, msg=f"block {index}")


def test_block_arguments_follow_each_layer_type():
    """Gemma 3 alternates local (sliding, RoPE base 10k) and global layers: the arguments recorded
    for a local block differ from a global block's in both the mask and the position embeddings."""
    model = tiny_decoder("gemma3", attn_implementation="eager")
    arguments = engine.capture_block_arguments(model, random_tokens((3, 24)))
    local, global_ = arguments[0], arguments[1]
    assert not torch.equal(local["attention_mask"], global_["attention_mask"])
    assert not torch.equal(local["position_embeddings"][0], global_["position_embeddings"][0])
    assert torch.equal(arguments[2]["attention_mask"], local["attention_mask"])


def test_capture_sees_every_linear_input_and_output():
    model = tiny_llama()
    tokens = random_tokens((4, 16))
    inputs = {}

    def process(ctx):
        if ctx.index == 0:
            ctx.capture(lambda name, linear, x, y: inputs.setdefault(name, []).append((x, y)))

    engine.run_blockwise(model, tokens, process, batch_size=3, progress=False)
    linears = engine.block_linears(model.model.layers[0])
    assert set(inputs) == set(linears)
    hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states[0]
    normed = model.model.layers[0].input_layernorm(hidden)
    x = torch.cat([batch[0] for batch in inputs["self_attn.q_proj"]])
    torch.testing.assert_close(x, normed, rtol=1e-5, atol=1e-5)
    y = torch.cat([batch[1] for batch in inputs["self_attn.q_proj"]])
    torch.testing.assert_close(y, linears["self_attn.q_proj"](normed), rtol=1e-5, atol=1e-5)


def test_block_forward_with_grad_gives_gradients_through_one_block():
    model = tiny_llama()
    tokens = random_tokens((2, 8))
    grads = []  # per call: the block's parameter gradients of mean(output²)

    def process(ctx):
        out = ctx.forward(grad=True)
        out.square().mean().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in ctx.block.parameters()])
        ctx.block.zero_grad(set_to_none=True)

    engine.run_blockwise(model, tokens, process, progress=False)
    blocks = model.model.layers
    assert len(grads) == len(blocks) == 2
    # the same gradients through the whole model: each block's output, differentiated w.r.t. its
    # own parameters (earlier blocks are unchanged, so each block sees the same inputs)
    outputs = []

    def keep_output(module, args, out):
        outputs.append(out[0] if isinstance(out, tuple) else out)

    handles = [block.register_forward_hook(keep_output) for block in blocks]
    try:
        model(input_ids=tokens)
    finally:
        for handle in handles:
            handle.remove()
    for block, out, got in zip(blocks, outputs, grads):
        params = list(block.parameters())
        expected = torch.autograd.grad(out.square().mean(), params, retain_graph=True)
        assert all(g is not None for g in got)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-7)


def test_accumulate_gradients_is_the_gradient_of_the_mean_loss():
    model = tiny_llama()
    tokens = random_tokens((6, 12))
    engine.accumulate_gradients(model, tokens, batch_size=4, progress=False)
    batched = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(input_ids=tokens, labels=tokens).loss.backward()
    for got, expected in zip(batched, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_perplexity_is_exp_of_mean_token_nll():
    model = tiny_llama()
    stream = random_tokens((100,), seed=3)
    windows = stream[:96].reshape(3, 32)
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert math.isclose(perplexity(model, stream, 32, batch_size=2, progress=False), math.exp(float(nll)),
                        rel_tol=1e-5)
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity(model, stream[:10], 32, progress=False)


def test_sparsity_report_measures_zeros_and_nm_validity():
    model = tiny_llama()
    report = sparsity_report(model)
    assert report["sparsity"] == 0.0 and not report["nm_valid"]["2:4"]
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in engine.block_linears(layer).values():
                linear.weight.view(-1, 4)[:, :2] = 0
    report = sparsity_report(model)
    assert report["sparsity"] == 0.5 and report["nm_valid"]["2:4"] and report["nm_valid"]["4:8"]
    assert len(report["layers"]) == 2 * 7


def test_model_without_blocks_is_rejected():
    with pytest.raises(ValueError, match="has no decoder blocks"):
        engine.decoder_blocks(torch.nn.Linear(4, 4))


DENSE_FAMILIES = [(family, impl) for family, impl in FAMILY_CASES
                  if family not in ("mixtral", "qwen2_moe") and impl == ("eager" if family == "gemma2" else "sdpa")]


@pytest.mark.parametrize("family,attn_implementation", DENSE_FAMILIES)
def test_wanda_masks_equal_a_sequential_full_forward_reference(family, attn_implementation):
    """Wanda 2:4 through the engine prunes every block exactly as a reference that, block after
    block, runs the whole (partly pruned) model to collect that block's linear inputs; 5 samples in
    batches of 2."""
    import copy

    import pyprune
    from pyprune import ops
    model = tiny_decoder(family, attn_implementation=attn_implementation)
    reference = copy.deepcopy(model)
    tokens = random_tokens((5, 24))
    pyprune.prune(model, "wanda", "2:4", tokens, batch_size=2, progress=False)
    with torch.no_grad():
        for block in engine.decoder_blocks(reference):
            linears = engine.block_linears(block)
            stats = {name: torch.zeros(linear.in_features) for name, linear in linears.items()}
            def observe(module, args, output, name):
                ops.accumulate_sqnorm_(stats[name], args[0])  # returns None: the output stays

            handles = [linear.register_forward_hook(lambda m, a, o, name=name: observe(m, a, o, name))
                       for name, linear in linears.items()]
            for start in range(0, 5, 2):
                reference(input_ids=tokens[start:start + 2], use_cache=False)
            for handle in handles:
                handle.remove()
            for name, linear in linears.items():
                linear.weight.mul_(ops.score_nm_mask(linear.weight, 2, 4, stats[name]))
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got == 0, want == 0), name


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_routers_are_never_pruned_and_the_report_names_what_stays_dense(family):
    """Magnitude 50% on an MoE: the attention, expert (one layer per expert matrix) and Qwen2-MoE
    shared expert linears are pruned, the routers are not, and the report's ``left_dense`` names
    only the routers, with their size."""
    import pyprune
    model = tiny_decoder(family)
    report = pyprune.prune(model, "magnitude", 0.5, progress=False)
    blocks = engine.decoder_blocks(model)
    routers = [block.mlp.gate.weight for block in blocks]
    if family == "qwen2_moe":
        routers += [block.mlp.shared_expert_gate.weight for block in blocks]
    assert all(bool((weight != 0).all()) for weight in routers)
    names = {layer["name"] for layer in report["layers"]}
    assert not any("shared_expert_gate" in name or name.endswith("mlp.gate") for name in names)
    assert "model.layers.3.mlp.experts.3.down_proj" in names
    assert report["sparsity"] == 0.5
    expected = {f"model.layers.{i}.mlp.gate.weight" for i in range(4)}
    if family == "qwen2_moe":
        expected |= {f"model.layers.{i}.mlp.shared_expert_gate.weight" for i in range(4)}
    assert set(report["left_dense"]["tensors"]) == expected
    assert report["left_dense"]["parameters"] == sum(model.get_parameter(name).numel() for name in expected)


def test_a_dense_family_leaves_nothing_dense():
    import pyprune
    report = pyprune.prune(tiny_decoder("llama"), "magnitude", "2:4", progress=False)
    assert report["left_dense"] == {"tensors": [], "parameters": 0}
