"""DReSS on tiny random Llamas: channel choice and rounding, the regularisation shrinking the
pruned slices (and not without λ), slicing, checkpoint resume, refusals, the CLI."""
import json
import math

import pytest
import torch

import pyprune
from pyprune.methods.dress import DReSS
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_llama


def _calib(n=8, seqlen=32):
    return random_tokens((n, seqlen), seed=1)


def _config(hidden=64, heads=4):
    return tiny_llama(hidden=hidden, heads=heads, kv_heads=2).config


@pytest.mark.parametrize("channels,expected", [
    ("last", list(range(48, 64))),
    ("first", list(range(16))),
    ("spread", [9, 10, 11, 12, 23, 24, 25, 36, 37, 38, 49, 50, 51, 61, 62, 63]),  # 5 segments
])
def test_pruned_channels(channels, expected):
    assert DReSS(channels=channels).pruned_channels(_config(), 0.25).tolist() == expected


def _with_a_massive_channel(channel=60, scale=300.0):
    """A tiny Llama whose residual stream carries one massive-activation channel (as SmolLM2's 507)."""
    model = tiny_llama(seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, channel] *= scale
    return model


def test_quiet_channels_are_the_least_energetic_and_spare_a_massive_one():
    model, calib = _with_a_massive_channel(), _calib()
    energy = DReSS.channel_energy(model, calib, batch_size=3)
    assert energy.shape == (64,) and energy.argmax() == 60 and abs(float(energy.sum()) - 1) < 1e-5
    quiet = DReSS(channels="quiet").pruned_channels(model.config, 0.25, energy)
    assert 60 not in quiet.tolist() and quiet.tolist() == sorted(quiet.tolist())
    assert energy[quiet].max() <= energy[[c for c in range(64) if c not in quiet.tolist()]].min()
    with torch.no_grad():
        dense = model(input_ids=calib).logits.log_softmax(-1)
    divergence = {}
    for channels in ("quiet", "last"):
        sliced = _with_a_massive_channel()
        report = pyprune.prune(sliced, "dress", Structured(0.25), calib, progress=False, steps=0, channels=channels)
        assert (60 in report["pruned_channels"]) == (channels == "last")
        with torch.no_grad():
            logp = sliced(input_ids=calib).logits.log_softmax(-1)
        divergence[channels] = float((dense.exp() * (dense - logp)).sum(-1).mean())
    assert divergence["quiet"] < 0.5 * divergence["last"], divergence


def test_channel_count_rounds_to_the_head_count_and_multiple():
    assert len(DReSS().pruned_channels(_config(hidden=576, heads=9), 0.25)) == 144  # SmolLM2: 576 -> 432
    assert len(DReSS(multiple=16).pruned_channels(_config(hidden=576, heads=9), 0.25)) == 144  # lcm 144
    assert len(DReSS().pruned_channels(_config(hidden=64, heads=4), 0.3)) == 20  # 44.8 kept -> 44
    for ratio, multiple in ((0.01, 1), (0.25, 64)):
        with pytest.raises(ValueError, match="rounds to"):
            DReSS(multiple=multiple).pruned_channels(_config(), ratio)


def test_regularisation_shrinks_the_pruned_slices_and_slicing_keeps_the_rest():
    calib = _calib()
    reports = {}
    for lam in (0.0, 0.05):
        model = tiny_llama(seed=0)
        reports[lam] = pyprune.prune(model, "dress", Structured(0.25), calib, progress=False,
                                     steps=30, lam=lam, lr=3e-3)
        assert model.config.hidden_size == 48
        assert model.model.embed_tokens.weight.shape == (128, 48)
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=calib[:2]).logits).all()
    assert reports[0.05]["slice_mass_ratio"] < 0.5 * reports[0.0]["slice_mass_ratio"]
    assert reports[0.0]["slice_mass_ratio"] > 0.7
    log = reports[0.05]["regularisation"]
    assert len(log["loss"]) == 30 and log["penalty"][-1] < 0.7 * log["penalty"][0]
    assert reports[0.05]["cost_after"]["parameters"] < reports[0.05]["cost_before"]["parameters"]


def test_steps_zero_is_plain_slicing():
    model, reference = tiny_llama(seed=0), tiny_llama(seed=0)
    report = pyprune.prune(model, "dress", Structured(0.25), _calib(), progress=False, steps=0, channels="last",
                           rescale_norms=False)
    pyprune.nn.keep_hidden_channels_(reference, torch.arange(48))
    assert report["slice_mass_ratio"] == 1.0 and report["regularisation"] == {}
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_rescale_norms_by_the_measured_energy_share():
    """Every norm of the hidden stream (the blocks' and the final one) is scaled by the mean over
    tokens of sqrt(s·d/d'), s the kept channels' share of its input's energy, each computed here
    by hand from the dense model's norm inputs; the weights it does not read stay."""
    model, plain, calib = tiny_llama(seed=0), tiny_llama(seed=0), _calib()
    norms = pyprune.nn.layout.hidden_stream(model)["norms"]
    inputs = {name: [] for name in norms}
    handles = [norm.register_forward_pre_hook(lambda module, args, name=name: inputs[name].append(args[0].detach()))
               for name, norm in norms.items()]
    with torch.no_grad():
        model(input_ids=calib)
    for handle in handles:
        handle.remove()
    before = {name: norm.weight.detach().clone() for name, norm in norms.items()}
    report = pyprune.prune(model, "dress", Structured(0.25), calib, progress=False, steps=0, channels="last")
    pyprune.prune(plain, "dress", Structured(0.25), calib, progress=False, steps=0, channels="last",
                  rescale_norms=False)
    assert set(report["norm_scale"]) == set(norms) and len(norms) == 5 and "model.norm" in norms
    after = pyprune.nn.layout.hidden_stream(model)["norms"]
    for name in norms:
        energy = torch.cat(inputs[name]).double().square()
        expected = float((energy[..., :48].sum(-1) / energy.sum(-1) * 64 / 48).sqrt().mean())
        assert report["norm_scale"][name] == pytest.approx(expected, rel=1e-5), name
        assert expected < 0.99 * math.sqrt(64 / 48), name  # the share is measurably below 1 here
        torch.testing.assert_close(after[name].weight, before[name][:48] * expected)
    assert report["width_scale"] == pytest.approx(math.sqrt(64 / 48))
    torch.testing.assert_close(model.model.norm.weight, plain.model.norm.weight * report["norm_scale"]["model.norm"])
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, plain.model.layers[0].mlp.up_proj.weight)


def test_the_measured_rescale_is_sqrt_width_when_the_removed_channels_are_empty():
    model, calib = tiny_llama(seed=0), _calib()
    stream = pyprune.nn.layout.hidden_stream(model)
    with torch.no_grad():  # nothing writes the last 16 channels: the residual stream is zero there
        stream["embed"].weight[:, 48:] = 0
        for writer in stream["writers"].values():
            writer.weight[48:] = 0
    scales = DReSS.norm_scales(model, torch.arange(48), calib, batch_size=4)
    assert len(scales) == 5 and all(v == pytest.approx(math.sqrt(64 / 48), rel=1e-6) for v in scales.values())


def test_the_preview_with_the_rescale_gives_the_sliced_model_s_logits():
    calib = _calib()
    sliced, preview = tiny_llama(seed=0), tiny_llama(seed=0)
    report = pyprune.prune(sliced, "dress", Structured(0.25), calib, progress=False, steps=0)
    keep = sorted(set(range(64)) - set(report["pruned_channels"]))
    pyprune.nn.slice_hidden_channels_(preview, keep, norm_scale=report["norm_scale"])
    with torch.no_grad():
        expected, got = sliced(input_ids=calib).logits, preview(input_ids=calib).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    pyprune.nn.unslice_(preview)
    pyprune.nn.slice_hidden_channels_(preview, keep)  # without the rescale it is another model
    with torch.no_grad():
        assert not torch.allclose(preview(input_ids=calib).logits, expected, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="norm_scale names no norm"):
        pyprune.nn.slice_hidden_channels_(tiny_llama(seed=0), keep, norm_scale={"model.nowhere": 2.0})


def test_mass_ratio_per_layer_and_kind_of_matrix():
    report = pyprune.prune(tiny_llama(seed=0), "dress", Structured(0.25), _calib(), progress=False,
                           steps=5, lam=0.05, lr=3e-3)
    per_tensor, per_layer, per_kind = (report[f"slice_mass_ratio_per_{k}"] for k in ("tensor", "layer", "kind"))
    assert set(per_layer) == {"layer 0", "layer 1", "model.embed_tokens", "model.norm", "lm_head"}  # untied
    assert {"q_proj", "o_proj", "down_proj", "input_layernorm", "embed_tokens", "norm"} <= set(per_kind)
    start = DReSS.slice_mass(DReSS().penalised_slices(tiny_llama(seed=0)),
                             torch.tensor(report["pruned_channels"]))
    q = [n for n in start if n.endswith("q_proj")]
    expected = sum(per_tensor[n] * start[n] for n in q) / sum(start[n] for n in q)  # Σ after / Σ before
    assert per_kind["q_proj"] == pytest.approx(expected, rel=1e-6)


def test_an_interrupted_regularisation_resumes_exactly(tmp_path):
    calib = _calib()
    options = dict(steps=6, lam=0.05, lr=3e-3, train_batch=3)
    straight = tiny_llama(seed=0)
    pyprune.prune(straight, "dress", Structured(0.25), calib, progress=False, **options)
    first = tiny_llama(seed=0)  # "interrupted" after 3 steps: its checkpoint holds step 3
    pyprune.prune(first, "dress", Structured(0.25), calib, progress=False, checkpoint=str(tmp_path),
                  checkpoint_every=3, **dict(options, steps=3))
    resumed = tiny_llama(seed=0)
    report = pyprune.prune(resumed, "dress", Structured(0.25), calib, progress=False, checkpoint=str(tmp_path),
                           checkpoint_every=3, **options)
    assert len(report["regularisation"]["loss"]) == 6
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_checkpoint_of_other_settings_is_refused(tmp_path):
    calib = _calib()
    pyprune.prune(tiny_llama(seed=0), "dress", Structured(0.25), calib, progress=False, steps=2,
                  checkpoint=str(tmp_path), checkpoint_every=1)
    model = tiny_llama(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for options in ({"lam": 0.5}, {"norm": "l1"}):
        with pytest.raises(ValueError, match="other settings"):
            pyprune.prune(model, "dress", Structured(0.25), calib, progress=False, steps=2,
                          checkpoint=str(tmp_path), **options)
    with pytest.raises(ValueError, match="other calibration data"):  # the same settings on other windows
        pyprune.prune(model, "dress", Structured(0.25), random_tokens((8, 32), seed=2), progress=False, steps=2,
                      checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match=r"steps=1 is fewer than the 2 steps the checkpoint in .* has done"):
        pyprune.prune(model, "dress", Structured(0.25), calib, progress=False, steps=1, checkpoint=str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lora_recovery_runs_on_the_held_out_quarter_and_merges():
    model = tiny_llama(seed=0)
    report = pyprune.prune(model, "dress", Structured(0.25), _calib(n=8), progress=False, steps=3, lam=0.05,
                           lr=3e-3, lora_steps=4, lora_rank=4, lora_lr=1e-2)
    assert len(report["regularisation"]["loss"]) == 3 and report["lora"]["steps"] == 4
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert model.config.hidden_size == 48


def test_the_proximal_step_shrinks_exactly_the_selected_slices():
    """Each selected slice becomes W_c·max(0, 1 − α/‖W_c‖₂) (computed here by hand), zero once its
    norm is ≤ α; every other entry keeps its bits."""
    model, channels = tiny_llama(seed=0), torch.tensor([3, 17, 40])
    method = DReSS()
    slices = method.penalised_slices(model)
    before = {name: p.detach().clone() for name, p, _, _ in slices}
    norms = {name: torch.linalg.vector_norm(before[name].index_select(dim, channels).double(),
                                            dim=[d for d in range(p.dim()) if d != dim] or None, keepdim=True)
             if p.dim() > 1 else before[name][channels].double().abs() for name, p, dim, _ in slices}
    alpha = float(torch.cat([n.flatten() for n in norms.values()]).median())
    method.proximal_step(slices, channels, alpha)
    zeroed = 0
    for name, p, dim, _ in slices:
        others = [c for c in range(p.shape[dim]) if c not in channels.tolist()]
        assert torch.equal(p.detach().index_select(dim, torch.tensor(others)),
                           before[name].index_select(dim, torch.tensor(others))), name
        expected = before[name].index_select(dim, channels).double() * (1 - alpha / norms[name]).clamp_min(0)
        got = p.detach().index_select(dim, channels)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
        emptied = (norms[name] <= alpha).expand_as(got)
        assert bool((got[emptied] == 0).all()), name
        zeroed += int((norms[name] <= alpha).sum())
    assert zeroed > 0


def test_the_proximal_regulariser_empties_the_slices_before_slicing():
    """With lr·λ above every slice norm, the pruned slices are exactly zero before the cut (the
    penalty inside Adam only shrinks them), the LM loss still trains the rest, and the report
    carries the pre-slice evaluation."""
    calib, ratios = _calib(), {}
    for regulariser in ("penalty", "proximal"):
        method = DReSS(regulariser=regulariser, steps=3, lam=1000.0, lr=3e-3)
        method.before_slice = lambda model: model.config.hidden_size
        model = tiny_llama(seed=0)
        report = pyprune.prune(model, method, Structured(0.25), calib, progress=False)
        ratios[regulariser] = report["slice_mass_ratio"]
        assert report["before_slice"] == 64 and model.config.hidden_size == 48
        assert len(report["regularisation"]["penalty"]) == 3
    assert ratios["proximal"] == 0.0 and ratios["penalty"] > 0.1, ratios


def test_l1_penalty_also_shrinks():
    model = tiny_llama(seed=0)
    report = pyprune.prune(model, "dress", Structured(0.25), _calib(), progress=False, steps=30, lam=0.002,
                           lr=3e-3, norm="l1")
    assert report["slice_mass_ratio"] < 0.6


def test_the_default_rate_is_a_share_of_the_linear_weights_rms_and_is_reported():
    """AdamW moves each weight by ~lr per step whatever its scale: unset, lr is lr_share x the RMS of
    the decoder's linear weights, so a model with 5x smaller weights (Gemma 3 270M against SmolLM2)
    trains at a 5x smaller rate; a given lr is used as is; the report says which ran."""
    model = tiny_llama(seed=0)
    linears = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    rms = math.sqrt(sum(float(w.double().square().sum()) for w in linears) / sum(w.numel() for w in linears))
    assert DReSS().learning_rate(model) == pytest.approx(DReSS.lr_share * rms, rel=1e-9)
    with torch.no_grad():
        for weight in linears:
            weight.mul_(0.2)
    assert DReSS().learning_rate(model) == pytest.approx(0.2 * DReSS.lr_share * rms, rel=1e-9)
    assert DReSS(lr=1e-3).learning_rate(model) == 1e-3
    report = pyprune.prune(model, "dress", Structured(0.25), _calib(), progress=False, steps=1)
    assert report["regularisation"]["lr"] == pytest.approx(0.2 * DReSS.lr_share * rms, rel=1e-9)


def test_bad_options():
    for options, message in (({"norm": "l3"}, "norm"), ({"lam": -1.0}, "lam"), ({"steps": -1}, "steps"),
                             ({"lr": 0.0}, "lr"), ({"channels": "middle"}, "channels"),
                             ({"regulariser": "admm"}, "regulariser")):
        with pytest.raises(ValueError, match=message):
            pyprune.methods.get("dress", **options)


def test_cli_dress(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from pyprune.cli import main
    model_dir, text = tiny_model_dir
    out, report = tmp_path / "out", tmp_path / "report.json"
    assert main(["prune", "--model", str(model_dir), "--method", "dress", "--ratio", "0.25", "--calib", str(text),
                 "--nsamples", "4", "--seqlen", "16", "--steps", "2", "--lam", "0.01", "--output", str(out),
                 "--report", str(report), "--quiet"]) == 0
    assert json.loads(report.read_text())["hidden_size"] == [64, 48]
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.hidden_size == 48
    assert reloaded.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
    for ratio, message in (("0", "ratio"), ("1", "ratio"), ("0.01", "rounds to zero")):
        assert main(["prune", "--model", str(model_dir), "--method", "dress", "--ratio", ratio, "--calib",
                     str(text), "--output", str(tmp_path / f"bad{ratio}")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / f"bad{ratio}").exists()


@pytest.mark.slow
def test_on_smollm2_quiet_channels_and_regularisation_each_lower_the_sliced_perplexity(smollm2):
    """576 -> 432 hidden channels. Slicing the last quarter removes the massive-activation channel
    507 and breaks the model; the quiet quarter does not, and 20 DReSS steps (80 windows, one
    pass) lower its sliced perplexity further (the benchmark's 150 steps: see the README)."""
    import copy

    from pyprune.inputs import data
    from pyprune.evaluation.perplexity import perplexity

    dense, tokenizer = smollm2
    calib = data.calibration_samples(tokenizer, "emma", nsamples=80, seqlen=64, seed=0)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=2048)
    ppl, mass = {}, {}
    for label, options in (("last", {"steps": 0, "channels": "last"}), ("quiet", {"steps": 0}),
                           ("dress", {"steps": 20})):
        model = copy.deepcopy(dense)
        report = pyprune.prune(model, "dress", Structured(0.25), calib, progress=False, **options)
        assert report["hidden_size"] == [576, 432]
        ppl[label], mass[label] = perplexity(model, tokens, 256, progress=False), report["slice_mass_ratio"]
    print(f"\nsliced perplexity {ppl}, slice mass {mass}")
    assert ppl["quiet"] < ppl["last"] / 100
    assert ppl["dress"] < 0.8 * ppl["quiet"] and mass["dress"] < 0.9


def test_on_gemma_the_penalty_shrinks_the_norms_effective_scale_one_plus_w():
    """Gemma's norms multiply by 1 + w: the penalty and the slice mass act on 1 + w (the scale the
    sliced channels carry), so regularising shrinks |1 + w| of the selected channels."""
    from tests.helpers import tiny_decoder
    model = tiny_decoder("gemma3", layers=2)
    slices = DReSS().penalised_slices(model)
    offsets = {name: offset for name, _, _, offset in slices}
    assert {offset for name, offset in offsets.items() if "norm" in name} == {1.0}
    assert {offset for name, offset in offsets.items() if "norm" not in name} == {0.0}
    channels = torch.arange(0, model.config.hidden_size, 4)
    norm_name, norm_weight = next((n, p) for n, p, _, o in slices if o == 1.0)
    mass = DReSS.slice_mass(slices, channels)[norm_name]
    assert mass == pytest.approx(float((norm_weight.detach()[channels] + 1).abs().sum()), rel=1e-6)
    calib = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    report = pyprune.prune(model, "dress", Structured(0.25), calib, progress=False, steps=6, lam=1.0, lr=1e-2)
    assert report["slice_mass_ratio_per_kind"]["input_layernorm"] < 0.99
