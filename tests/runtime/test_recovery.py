"""LoRA recovery fine-tuning (pyprune.runtime.recovery.lora_finetune and ``pyprune recover``) on tiny
random Llamas: the loss goes down, the merged model is the original model object with dense
weights, only the adapted layers change, structured (non-uniform) models work, bad input is
refused before anything changes."""
import json

import pytest
import torch
from torch import nn

import pyprune
from pyprune import cli
from pyprune.nn.layout import LINEARS, block_layout
from pyprune.patterns import Structured
from pyprune.runtime.recovery import DEFAULT_TARGET_MODULES, lora_finetune
from tests.helpers import random_tokens, tiny_llama

VOCAB = 128
SETTINGS = dict(rank=8, alpha=16.0, lr=1e-2, batch_size=4, progress=False)


def counting_tokens(nsamples=8, seqlen=32, seed=1):
    """Samples that count upward from a random start: a rule LoRA can learn in a few steps."""
    return (random_tokens((nsamples, 1), vocab=VOCAB, seed=seed) + torch.arange(seqlen)) % VOCAB


@torch.no_grad()
def mean_loss(model, tokens):
    model.eval()
    return float(model(input_ids=tokens, labels=tokens, use_cache=False).loss)


def snapshot(model):
    """Everything lora_finetune must give back: module objects and classes, parameters (cloned),
    requires_grad flags, train/eval modes and the config."""
    return {
        "modules": [(name, type(m), id(m), m.training) for name, m in model.named_modules()],
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "requires_grad": [(name, p.requires_grad) for name, p in model.named_parameters()],
        "config": model.config.to_dict(),
    }


def assert_no_peft_leftovers(model):
    for name, module in model.named_modules():
        assert not type(module).__module__.startswith("peft"), name
        assert not [key for key in vars(module) if "peft" in key or "lora" in key], name
        assert "lora" not in name
    assert not hasattr(model, "peft_config")


def assert_same_model(model, before, weights_equal=True):
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert list(after["state"]) == list(before["state"])
    assert after["requires_grad"] == before["requires_grad"]
    assert after["config"] == before["config"]
    if weights_equal:
        for key, value in before["state"].items():
            assert torch.equal(after["state"][key], value), key
    assert_no_peft_leftovers(model)


def test_training_lowers_the_loss():
    model, tokens = tiny_llama(), counting_tokens()
    before = mean_loss(model, tokens)
    report = lora_finetune(model, tokens, steps=30, **SETTINGS)
    after = mean_loss(model, tokens)
    # the dense random model sits at ~ln(128) = 4.85; 30 steps take it below 4.35
    assert before > 4.7 and after < before - 0.5, (before, after)
    assert len(report["losses"]) == 30 and report["first_loss"] == report["losses"][0]
    assert report["last_loss"] == report["losses"][-1] < report["first_loss"] - 0.5
    assert {k: report[k] for k in ("steps", "rank", "alpha", "lr", "batch_size", "seed", "nsamples", "seqlen")} \
        == {"steps": 30, "rank": 8, "alpha": 16.0, "lr": 1e-2, "batch_size": 4, "seed": 0, "nsamples": 8,
            "seqlen": 32}
    assert report["target_modules"] == list(DEFAULT_TARGET_MODULES) and report["lora_layers"] == 2 * 7
    assert report["time_s"] >= 0


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["mlp.down_proj"]])
def test_merge_restores_the_model_and_changes_only_the_targets(targets):
    model, tokens = tiny_llama(), counting_tokens()
    model.model.embed_tokens.weight.requires_grad_(False)  # flags must come back as they were
    model.model.layers[1].train()  # and per-module modes too
    model.config.pretraining_tp = 2  # peft sets it to 1
    before = snapshot(model)
    lora_finetune(model, tokens, steps=5, target_modules=targets, **SETTINGS)
    assert_same_model(model, before, weights_equal=False)
    names = DEFAULT_TARGET_MODULES if targets is None else [t.split(".")[-1] for t in targets]
    changed = {k for k, v in before["state"].items() if not torch.equal(model.state_dict()[k], v)}
    expected = {f"model.layers.{i}.{block_name}.weight" for i in range(2) for block_name in LINEARS
                if block_name.split(".")[-1] in names}
    assert changed == expected
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_trainable_parameters_are_the_peft_count():
    import peft
    model, tokens = tiny_llama(), counting_tokens()
    report = lora_finetune(model, tokens, steps=1, target_modules=["q_proj", "up_proj"], **SETTINGS)
    wrapped = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, target_modules=["q_proj", "up_proj"]))
    assert report["trainable_parameters"] == wrapped.get_nb_trainable_parameters()[0] == 2 * 8 * (64 + 64 + 64 + 128)


def test_merged_forward_equals_the_adapted_forward(monkeypatch):
    """The logits of the peft model just before merging equal the merged model's (a dense model:
    no weight is zero, so nothing is masked)."""
    from pyprune.runtime import recovery
    model, tokens = tiny_llama(), counting_tokens()
    probe = random_tokens((2, 24), vocab=VOCAB, seed=5)
    dense = model(input_ids=probe).logits.detach()
    adapted = []
    merge = recovery._merge_under_masks

    def recording_merge(wrapped_model, masks):
        assert masks == {}
        with torch.no_grad():
            wrapped_model.eval()
            adapted.append(wrapped_model(input_ids=probe).logits)
        return merge(wrapped_model, masks)

    monkeypatch.setattr(recovery, "_merge_under_masks", recording_merge)
    lora_finetune(model, tokens, steps=10, **SETTINGS)
    merged = model(input_ids=probe).logits.detach()
    assert len(adapted) == 1
    assert (adapted[0] - dense).abs().max() > 0.1  # training moved the model, so the comparison means something
    torch.testing.assert_close(merged, adapted[0], rtol=1e-5, atol=1e-5)


def test_structured_pruned_model_with_non_uniform_layers():
    model = tiny_llama(layers=3, heads=8, kv_heads=4)
    calib = random_tokens((4, 32), vocab=VOCAB, seed=3)
    pyprune.prune(model, "taylor", Structured(0.25), calib, progress=False, first_layer=1)
    layouts = [block_layout(block) for block in model.model.layers]
    assert layouts[0] != layouts[1] and layouts[1]["heads"] == 6 and layouts[1]["intermediate"] == 96
    tokens = counting_tokens()
    before, loss_before = snapshot(model), mean_loss(model, tokens)
    report = lora_finetune(model, tokens, steps=30, **SETTINGS)
    assert_same_model(model, before, weights_equal=False)
    assert [block_layout(block) for block in model.model.layers] == layouts
    expected = sum(8 * (m.in_features + m.out_features) for block in model.model.layers
                   for m in block.modules() if isinstance(m, nn.Linear))
    assert report["trainable_parameters"] == expected
    assert mean_loss(model, tokens) < loss_before - 0.5


def test_sixteen_bit_model_keeps_its_dtype():
    model, tokens = tiny_llama().to(torch.bfloat16), counting_tokens()
    before = snapshot(model)
    report = lora_finetune(model, tokens, steps=5, **SETTINGS)
    assert_same_model(model, before, weights_equal=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[q], before["state"][q])
    assert all(torch.isfinite(torch.tensor(report["losses"])))


def test_zero_steps_leaves_the_model_bit_identical():
    model, tokens = tiny_llama(), counting_tokens()
    before = snapshot(model)
    report = lora_finetune(model, tokens, steps=0, rank=4)
    assert_same_model(model, before)
    assert report["losses"] == [] and report["first_loss"] is None and report["last_loss"] is None
    assert report["trainable_parameters"] == 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32) + 2 * (64 + 128) + (128 + 64))


def test_same_seed_same_weights_and_the_global_rng_is_untouched():
    tokens = counting_tokens()
    first, second, other = tiny_llama(), tiny_llama(), tiny_llama()
    rng = torch.random.get_rng_state()
    lora_finetune(first, tokens, steps=3, seed=7, **SETTINGS)
    assert torch.equal(torch.random.get_rng_state(), rng)
    torch.rand(10)  # a different global state must not matter
    lora_finetune(second, tokens, steps=3, seed=7, **SETTINGS)
    lora_finetune(other, tokens, steps=3, seed=8, **SETTINGS)
    key = "model.layers.0.mlp.up_proj.weight"
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert not torch.equal(first.state_dict()[key], other.state_dict()[key])


def test_diverging_training_leaves_the_model_unchanged():
    model, tokens = tiny_llama(), counting_tokens()
    before = snapshot(model)
    with pytest.raises(FloatingPointError, match="the model is left unchanged"):
        lora_finetune(model, tokens, steps=10, rank=8, alpha=16.0, lr=1e30, batch_size=4, progress=False)
    assert_same_model(model, before)


TOKENS = counting_tokens()


@pytest.mark.parametrize("kwargs,message", [
    (dict(steps=-1), r"steps must be >= 0; got -1"),
    (dict(steps=1.5), r"steps must be an integer; got 1.5"),
    (dict(rank=0), r"rank must be >= 1; got 0"),
    (dict(rank=True), r"rank must be an integer; got True"),
    (dict(alpha=0.0), r"alpha must be > 0; got 0.0"),
    (dict(alpha=-10), r"alpha must be > 0; got -10.0"),
    (dict(lr=0.0), r"lr must be > 0; got 0.0"),
    (dict(lr=float("nan")), r"lr must be a finite number; got nan"),
    (dict(batch_size=0), r"batch_size must be >= 1; got 0"),
    (dict(batch_size=9), r"batch_size must be <= the number of samples in tokens \(8\); got 9"),
    (dict(seed=None), r"seed must be an integer; got None"),
    (dict(tokens=TOKENS[0]), r"tokens must be \[nsamples, seqlen\]; got shape \(32,\) \(tokens\[None\] is one sample\)"),
    (dict(tokens=TOKENS[None]), r"tokens must be \[nsamples, seqlen\]; got shape \(1, 8, 32\)"),
    (dict(tokens=TOKENS.float()), r"tokens must hold integer token ids \(int64\); got dtype torch.float32"),
    (dict(tokens=TOKENS.numpy()), r"tokens must be a torch integer tensor .* \(convert it with torch.from_numpy"),
    (dict(tokens=TOKENS[:, :1]), r"tokens must hold samples of at least 2 tokens"),
    (dict(tokens=TOKENS + VOCAB), r"tokens holds token ids in \[1\d\d, 2\d\d\]; the model embeds ids in \[0, 128\)"),
    (dict(target_modules="q_proj"), r"target_modules must be a non-empty list of str; got .q_proj."),
    (dict(target_modules=[]), r"target_modules must be a non-empty list of str; got \[\]"),
    (dict(target_modules=["q_proj", " "]), r"target_modules must not be empty; got . ."),
    (dict(target_modules=["q_proj", "qkv_proj"]), r"target_modules \['qkv_proj'\] match no nn.Linear"),
    (dict(target_modules=["self_attn"]), r"target_modules \['self_attn'\] match no nn.Linear"),
])
def test_bad_arguments_are_refused_before_the_model_changes(kwargs, message):
    model = tiny_llama()
    before = snapshot(model)
    arguments = dict(tokens=TOKENS, steps=2, batch_size=4, progress=False)
    arguments.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=message):  # TypeError: tokens of another type or dtype
        lora_finetune(model, **arguments)
    assert_same_model(model, before)


def test_sparse_and_sliced_layers_are_refused():
    from pyprune.nn import slice_mlp_channels_, sparsify_, unslice_
    model = tiny_llama()
    pyprune.prune(model, "magnitude", "2:4", progress=False)
    sparsify_(model)
    with pytest.raises(ValueError, match="SparseLinear/SlicedLinear layers .*peft's LoRA wraps only nn.Linear"):
        lora_finetune(model, TOKENS, steps=2, progress=False)
    model = tiny_llama()
    slice_mlp_channels_(model.model.layers[0], torch.arange(64))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"SparseLinear/SlicedLinear layers \(model.layers.0.mlp.gate_proj"):
        lora_finetune(model, TOKENS, steps=2, progress=False)
    assert_same_model(model, before)
    unslice_(model)


def test_a_model_with_adapters_already_is_refused():
    import peft
    wrapped = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="model already holds PEFT adapters"):
        lora_finetune(wrapped.base_model.model, TOKENS, steps=2, progress=False)


# --- the command line -------------------------------------------------------------------------

def _recover_argv(model_dir, text, output, *extra):
    return ["recover", "--model", str(model_dir), "--calib", str(text), "--nsamples", "8", "--seqlen", "16",
            "--steps", "6", "--rank", "4", "--lr", "1e-2", "--batch-size", "4", "--output", str(output),
            "--quiet", *extra]


def test_cli_recover_end_to_end(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    model_dir, text = tiny_model_dir
    output, report_path = tmp_path / "out", tmp_path / "report.json"
    assert cli.main(_recover_argv(model_dir, text, output, "--eval", str(text), "--eval-seqlen", "16",
                                  "--report", str(report_path))) == 0
    report = json.loads(report_path.read_text())
    assert len(report["recovery"]["losses"]) == 6 and report["recovery"]["rank"] == 4
    assert [e["data"] for e in report["eval_before"]] == [e["data"] for e in report["eval_after"]] == [str(text)]
    assert report["eval_after"][0]["perplexity"] != report["eval_before"][0]["perplexity"]
    assert json.loads((output / "pyprune.json").read_text())["report"]["recovery"]["steps"] == 6

    original = AutoModelForCausalLM.from_pretrained(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(output)  # dense weights, nothing peft in the checkpoint
    assert type(plain) is type(original) and list(plain.state_dict()) == list(original.state_dict())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(plain.state_dict()[q], original.state_dict()[q])
    reloaded, _ = pyprune.load(str(output))
    probe = random_tokens((1, 16), vocab=VOCAB)
    torch.testing.assert_close(plain.eval()(input_ids=probe).logits, reloaded(input_ids=probe).logits)


def test_cli_recover_a_non_uniform_pruned_model(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    pruned, output = tmp_path / "pruned", tmp_path / "out"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "taylor", "--ratio", "0.5",
                     "--first-layer", "1", "--calib", str(text), "--nsamples", "4", "--seqlen", "16",
                     "--output", str(pruned), "--quiet"]) == 0
    assert cli.main(_recover_argv(pruned, text, output, "--target-modules", "q_proj", "v_proj")) == 0
    before, _ = pyprune.load(str(pruned))
    after, _ = pyprune.load(str(output))
    layouts = [block_layout(block) for block in after.model.layers]
    assert layouts == [block_layout(block) for block in before.model.layers] and layouts[0] != layouts[1]
    assert json.loads((output / "pyprune.json").read_text())["config_compatible"] is False
    assert list(after.state_dict()) == list(before.state_dict())
    changed = {k for k, v in before.state_dict().items() if not torch.equal(after.state_dict()[k], v)}
    assert changed == {f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in ("q_proj", "v_proj")}


def test_cli_unknown_target_module_fails_before_writing(tiny_model_dir, tmp_path, capsys):
    model_dir, text = tiny_model_dir
    output = tmp_path / "out"
    assert cli.main(_recover_argv(model_dir, text, output, "--target-modules", "qkv_proj")) == 2
    assert "target_modules ['qkv_proj'] match no nn.Linear" in capsys.readouterr().err
    assert not output.exists()


@pytest.mark.parametrize("args,message", [
    (["--steps", "-1"], r"steps must be >= 0; got -1"),
    (["--rank", "0"], r"rank must be >= 1; got 0"),
    (["--alpha", "0"], r"alpha must be > 0; got 0.0"),
    (["--lr", "-0.0001"], r"lr must be > 0; got -0.0001"),
    (["--batch-size", "9"], r"--batch-size 9 is larger than --nsamples 8"),
    (["--seqlen", "1"], r"--seqlen must be >= 2"),
    (["--calib", "missing.txt"], r"source='missing.txt' is neither"),
    (["--eval", "nope/"], r"source='nope/' is neither"),
    (["--report", "/proc/no/such/dir/r.json"], r"--report /proc/no/such/dir/r.json: cannot create files in /proc"),
])
def test_cli_bad_arguments_fail_before_loading(tmp_path, capsys, args, message):
    import re
    output = tmp_path / "out"
    argv = _recover_argv(tmp_path / "never-loaded", "emma", output) + args
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pyprune recover: error:")
    assert re.search(message, err), err
    assert not output.exists()


def test_cli_recover_flags_are_the_declared_settings(tmp_path, capsys):
    """``pyprune recover``'s LoRA flags are the settings that lora_finetune and a recipe's lora
    stage declare (recovery.SETTINGS): each one listed with its help, and --steps, which has no
    default, required."""
    from pyprune.runtime.recovery import SETTINGS
    with pytest.raises(SystemExit):
        cli.main(["recover", "--help"])
    listed = "".join(capsys.readouterr().out.split())  # the help as printed, wrapped anywhere
    for declared in SETTINGS:
        assert declared.flag in listed and "".join(declared.help.split()) in listed
    argv = _recover_argv(tmp_path / "never-loaded", "emma", tmp_path / "out")
    at = argv.index("--steps")
    with pytest.raises(SystemExit) as exit_info:  # argparse's own refusal
        cli.main(argv[:at] + argv[at + 2:])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --steps" in capsys.readouterr().err


def test_cli_recover_refuses_an_existing_output(tmp_path, capsys):
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    assert cli.main(_recover_argv(tmp_path / "never-loaded", "emma", output)) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in output.iterdir()] == ["keep.txt"]
