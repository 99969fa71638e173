"""The DReSS studies (``dress``, ``dress-lambda-sweep``, ``dress-channel-energy``) at tiny scale: each
row is the arm its label names (the proximal arm prunes with the labelled λ, slice-then-train slices
before it trains), the seed table's verdict is the verdict rule's, and a rerun resumes."""
import json

import pytest
import torch

from pyprune import studies
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.io.storage import StateError
from pyprune.methods.dress import DReSS
from pyprune.studies import dress, dress_channel_energy, dress_lambda_sweep
from pyprune.studies.results import mean_std
from pyprune.studies.svg import line_plot
from pyprune.studies.verdict import paired_verdict

TINY = dict(channels=["quiet"], nsamples=8, seqlen=16, steps=2, lr=1e-2, train_batch=2, lora_steps=1,
            eval_tokens=64, eval_seqlen=16)
TEXTS = ("pride_and_prejudice", "moby_dick")


def test_a_row_is_told_apart_by_its_training_options_and_slicing_alone_by_none():
    default = dress.Dress()
    for name in ("dress", "prox", "lam0", "npr"):
        stored = default.arm(name, "quiet").spec[2]  # the head of the row the arm writes
        assert dress.row_key(stored) == default.arm(name, "quiet").key
        for other in (dress.Dress(lr=3e-3), dress.Dress(train_seed=1), dress.Dress(steps=450)):
            assert other.arm(name, "quiet").key != default.arm(name, "quiet").key
        assert default.arm(name, "last").key != default.arm(name, "quiet").key
    assert dress.Dress(lr=3e-3, train_seed=1).arm("slice", "quiet").key == default.arm("slice", "quiet").key
    assert dress.Dress(lam=250.0).arm("npr", "quiet").key == default.arm("npr", "quiet").key
    assert default.arm("npr", "quiet").spec[2]["train_steps"] == 150 and default.arm("npr", "quiet").spec[1]
    assert default.arm("prox", "quiet").spec[0]["regulariser"] == "proximal"
    assert dress.arm_name("DReSS-l1 proximal") == "prox" and dress.arm_name("DReSS-l1") == "dress"
    with pytest.raises(ValueError, match="no arm of study 'dress' makes rows labelled 'other'"):
        dress.arm_name("other")


def test_dress_settings_are_typed():
    assert dress.Dress(calib="mixed").output_path(None).endswith("dress-smollm2-135m-mixed.json")
    assert dress.Dress(rows=["prox"], lam=250, skip_lora="true").command() == \
        "pyprune study dress --rows prox --lam 250.0 --skip-lora true"
    with pytest.raises(ValueError, match="option rows of study 'dress' must be one of slice, dress, prox, lam0, npr; "
                                         "got 'proximal'"):
        dress.Dress(rows=["proximal"])
    with pytest.raises(ValueError, match=r"option nsamples of study 'dress' must be >= 4 \(three quarters train"):
        dress.Dress(nsamples=3)
    with pytest.raises(ValueError, match="option lam of study 'dress' must be >= 0; got -1.0"):
        dress.Dress(lam=-1.0)
    with pytest.raises(ValueError, match="option tasks of study 'dress' scores the rows after LoRA"):
        dress.Dress(tasks=["austen_continuation"], skip_lora=True)
    with pytest.raises(ValueError, match="option channels of study 'dress-lambda-sweep' must be one of quiet"):
        dress_lambda_sweep.DressLambdaSweep(channels="middle")


def _row(label, seed, ppl, lam=250.0, lr=1e-3, steps=150):
    return {"channels": "quiet", "label": label, "lam": None if label == dress.CONTROL else lam, "lr": lr,
            "norm": "l2", "train_batch": 4, "steps": 0 if label == dress.CONTROL else steps, "train_steps": steps,
            "rescale_norms": True, "slice_mass_ratio": 0.5, "ppl_sliced": {"pride_and_prejudice": ppl},
            **({} if seed == 0 else {"train_seed": seed})}


def test_seed_groups_and_their_verdict_against_slice_then_train():
    prox = "DReSS-l2 proximal"
    rows = [_row(prox, 0, 60.0), _row(prox, 1, 62.0), _row(prox, 0, 70.0, lr=3e-3),  # other lr: alone
            _row(dress.CONTROL, 0, 58.0), _row(dress.CONTROL, 2, 57.0), _row(dress.CONTROL, 1, 59.0)]
    groups = dress.seed_groups(rows)
    assert [(first["label"], [r["ppl_sliced"]["pride_and_prejudice"] for r in group]) for first, group in groups] \
        == [(prox, [60.0, 62.0]), (dress.CONTROL, [58.0, 59.0, 57.0])]
    # behind on both seeds both ran, by more than two standard errors (differences +2.0, +3.0)
    assert dress.control_verdict(groups[0][1], rows, "pride_and_prejudice") == "behind"
    assert dress.control_verdict(groups[1][1], rows, "pride_and_prejudice") == "–"  # the control itself
    mixed = rows[:2] + [_row(dress.CONTROL, 0, 61.0), _row(dress.CONTROL, 1, 59.0)]  # −1.0 and +3.0
    assert dress.control_verdict(dress.seed_groups(mixed)[0][1], mixed, "pride_and_prejudice") == "unsettled"
    ahead = rows[:2] + [_row(dress.CONTROL, 0, 70.0), _row(dress.CONTROL, 1, 71.0)]  # −10.0 and −9.0
    assert dress.control_verdict(dress.seed_groups(ahead)[0][1], ahead, "pride_and_prejudice") == "ahead"
    other_lr = [_row(prox, 0, 60.0, lr=3e-3), _row(prox, 1, 62.0, lr=3e-3)] + rows[3:]
    assert dress.control_verdict(dress.seed_groups(other_lr)[0][1], other_lr, "pride_and_prejudice") == "–"
    # a longer budget is its own group, held against the control trained as long
    longer = rows + [_row(prox, 0, 50.0, steps=450), _row(prox, 1, 51.0, steps=450),
                     _row(dress.CONTROL, 0, 49.0, steps=450), _row(dress.CONTROL, 1, 52.0, steps=450)]
    long_groups = [(first["train_steps"], group) for first, group in dress.seed_groups(longer)]
    assert [(steps, len(group)) for steps, group in long_groups] == [(150, 2), (150, 3), (450, 2), (450, 2)]
    assert dress.control_verdict(long_groups[2][1], longer, "pride_and_prejudice") == "unsettled"  # +1.0 and −1.0
    # the table's cells
    assert mean_std([60.0, 62.0], ".2f") == "61.00 ± 1.41"
    assert mean_std([60.0, None], ".2f") == "60.00" and mean_std([None]) == "–"


def test_the_loss_column_averages_the_first_and_last_steps():
    steps = [float(v) for v in range(120)]  # 0 .. 119: first 50 average 24.5, last 50 average 94.5
    assert dress.LOSS_SPAN == 50 and dress.loss_ends({"loss": steps}) == "24.50 → 94.50"
    assert dress.loss_ends({"loss": [4.0, 2.0]}) == "3.00 → 3.00"  # shorter than the span: all of it, twice
    assert dress.loss_ends({"loss": None}) == dress.loss_ends({}) == "–"


def test_the_svg_line_plot_rejects_empty_input():
    with pytest.raises(ValueError, match="at least one point"):
        line_plot({}, "t", "x", "y")


def test_dress_rows_are_what_their_labels_say_and_a_rerun_resumes(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "dress.json"
    pruned, trained = [], []
    prune, train = dress.prune, dress.train

    def recorded_prune(model, method, pattern, calib, **kwargs):
        pruned.append({"options": dict(method.settings), "calib": calib})
        return prune(model, method, pattern, calib, **kwargs)

    def recorded_train(model, parameters, windows, **kwargs):
        trained.append({"hidden": model.config.hidden_size, "windows": windows, **kwargs})
        return train(model, parameters, windows, **kwargs)

    monkeypatch.setattr(dress, "prune", recorded_prune)
    monkeypatch.setattr(dress, "train", recorded_train)
    result = studies.run("dress", str(output), model=model_dir, rows=["slice", "dress", "prox", "npr"], lam=50.0,
                         **TINY)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == dress.markdown(result)
    assert result["settings"]["hidden"] == "64 -> ratio 0.25" and result["settings"]["model"] == model_dir
    rows = result["rows"]
    assert [r["label"] for r in rows] == ["slice only (w/o R)", "DReSS-l2", "DReSS-l2 proximal", dress.CONTROL]
    _, tokenizer = load_model(model_dir)
    windows = data.calibration_samples(tokenizer, "emma", nsamples=8, seqlen=16, seed=0)
    for row, call in zip(rows, pruned):
        assert torch.equal(call["calib"], windows[:6])  # three quarters regularise
        assert row["hidden_size"] == [64, 48] and set(row["ppl_sliced"]) == set(row["ppl_lora"]) == set(TEXTS)
    slice_only, penalty, proximal, control = zip(rows, (c["options"] for c in pruned))
    # slice only: no training anywhere
    assert slice_only[1]["steps"] == 0 and slice_only[0]["train_steps"] == 0 and slice_only[0]["ppl_before_slice"] \
        is None
    # DReSS and its proximal arm: regularised with the labelled λ, learning rate and steps, then sliced
    for row, options in (penalty, proximal):
        assert (options["lam"], options["lr"], options["steps"]) == (row["lam"], row["lr"], row["steps"]) == \
            (50.0, 1e-2, 2)
        assert set(row["ppl_before_slice"]) == set(TEXTS) and len(row["loss"]) == 2
    assert penalty[1]["regulariser"] == "penalty" and proximal[1]["regulariser"] == "proximal"
    assert proximal[0]["slice_mass_ratio"] < penalty[0]["slice_mass_ratio"]  # the prox empties slices exactly
    # slice then train: sliced without regularising, then the 48-wide model trained with the same budget
    assert control[1]["steps"] == 0 and control[0]["train_steps"] == 2
    [call] = trained
    assert call["hidden"] == 48 and torch.equal(call["windows"], windows[:6])
    assert (call["steps"], call["lr"], call["batch_size"], call["seed"]) == (2, 1e-2, 2, 0)
    # the penalty row's slice mass per layer, plotted beside the results
    plot = tmp_path / "dress-mass-quiet-2-steps-lr-0.01-seed-0.svg"
    assert dress.mass_plot_path(str(tmp_path / "dress"), penalty[0]) == str(plot)
    assert plot.read_text() == dress.mass_plot(penalty[0]) and "DReSS-l2, 2 steps, λ 50, lr 0.01, training seed 0" \
        in plot.read_text()

    pruned.clear()
    trained.clear()
    again = studies.run("dress", str(output), model=model_dir, rows=["slice", "prox", "npr"], lam=50.0,
                        train_seed=1, skip_lora=True, **TINY)
    assert [c["options"]["regulariser"] for c in pruned] == ["proximal", "penalty"]  # slice only had run
    assert pruned[0]["options"]["train_seed"] == 1 and [c["seed"] for c in trained] == [1]
    rows = again["rows"]
    assert [(r["label"], dress.train_seed(r)) for r in rows] == [
        ("slice only (w/o R)", 0), ("DReSS-l2", 0), ("DReSS-l2 proximal", 0), ("DReSS-l2 proximal", 1),
        (dress.CONTROL, 0), (dress.CONTROL, 1)]
    assert rows[3]["ppl_lora"] is None and rows[3]["lora_s"] is None
    # the seed table: the proximal arm over seeds 0 and 1, its verdict against slice then train by the rule
    lines = output.with_suffix(".md").read_text().splitlines()
    cells = [c.strip() for c in next(line for line in lines if line.startswith(
        "| quiet | DReSS-l2 proximal | 2 | 50 | 0.01 | 0, 1 |")).strip("|").split("|")]
    assert [cells[10], cells[14]] == [paired_verdict({0: rows[2]["ppl_sliced"][t], 1: rows[3]["ppl_sliced"][t]},
                                                    {0: rows[4]["ppl_sliced"][t], 1: rows[5]["ppl_sliced"][t]}).word
                                     for t in TEXTS]
    control = [c.strip() for c in next(line for line in lines if line.startswith(
        f"| quiet | {dress.CONTROL} | 2 | – | 0.01 | 0, 1 |")).strip("|").split("|")]
    assert [control[10], control[14]] == ["–", "–"]
    before = output.read_text()
    with pytest.raises(StateError, match="other settings: calibration '6 x 16 Emma windows train, 2 train LoRA'"):
        studies.run("dress", str(output), model=model_dir, **{**TINY, "nsamples": 12})
    assert output.read_text() == before


def test_lambda_sweep_rows_prune_with_their_lambda_and_a_rerun_resumes(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "sweep.json"
    calls, prune = [], dress_lambda_sweep.prune

    def recorded(model, method, pattern, calib, **options):
        calls.append({"method": method, "ratio": pattern.ratio, "rows": calib.shape[0], **options})
        return prune(model, method, pattern, calib, **options)

    monkeypatch.setattr(dress_lambda_sweep, "prune", recorded)
    settings = dict(model=model_dir, nsamples=8, seqlen=16, steps=2, eval_tokens=64, eval_seqlen=16)
    result = studies.run("dress-lambda-sweep", str(output), lams=[5.0, 0.5], **settings)
    assert [(c["method"], c["lam"], c["steps"], c["lr"], c["channels"], c["rows"]) for c in calls] == [
        ("dress", 5.0, 2, 1e-3, "quiet", 6), ("dress", 0.5, 2, 1e-3, "quiet", 6)]
    assert [r["lam"] for r in result["rows"]] == [5.0, 0.5] and all(len(r["loss"]) == 2 for r in result["rows"])
    assert result["settings"]["calibration"] == "6 x 16 Emma windows"
    text = output.with_suffix(".md").read_text()
    assert text == dress_lambda_sweep.markdown(result) and text.index("| 0.5 |") < text.index("| 5 |")
    calls.clear()
    studies.run("dress-lambda-sweep", str(output), lams=[0.5, 5.0, 50.0], **settings)
    assert [c["lam"] for c in calls] == [50.0]
    with pytest.raises(StateError, match="other settings: method"):
        studies.run("dress-lambda-sweep", str(output), lams=[0.5], **{**settings, "steps": 3})


def test_channel_energy_measures_what_each_choice_removes_once(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "energy.json"
    result = studies.run("dress-channel-energy", str(output), model=model_dir, nsamples=8, seqlen=16)
    model, tokenizer = load_model(model_dir)
    windows = data.calibration_samples(tokenizer, "emma", nsamples=8, seqlen=16, seed=0)[:DReSS.energy_windows]
    energy = DReSS.channel_energy(model, windows, batch_size=8)
    shares = [t["share"] for t in result["top"]]
    assert len(shares) == dress_channel_energy.TOP and shares == sorted(shares, reverse=True)
    assert shares[0] == pytest.approx(float(energy.max()))
    for choice in dress.CHANNELS:
        removed = DReSS(channels=choice).pruned_channels(model.config, 0.25, energy)
        assert result["removed_share"][choice] == pytest.approx(float(energy[removed].sum()))
    assert len(result["top_channel_share_per_state"]) == model.config.num_hidden_layers + 1
    assert output.with_suffix(".md").read_text() == dress_channel_energy.markdown(result)

    def measured_again(*args):
        raise AssertionError("a rerun of the same settings measured again")

    monkeypatch.setattr(dress_channel_energy, "measure", measured_again)
    assert studies.run("dress-channel-energy", str(output), model=model_dir, nsamples=8, seqlen=16) == result
    with pytest.raises(StateError, match=r"other settings: ratio 0.25 \(now 0.5\)"):
        studies.run("dress-channel-energy", str(output), model=model_dir, nsamples=8, seqlen=16, ratio=0.5)


def test_zero_shot_scores_the_dense_model_once_and_each_row_after_lora(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "dress.json"
    scored = []

    def zero_shot(model, tokenizer, tasks, limit, progress):
        scored.append(model.config.hidden_size)
        return {t: {"acc": 0.5 + 0.1 * len(scored), "stderr": 0.1, "n": limit, "chance": 0.25} for t in tasks}

    monkeypatch.setattr(dress.zeroshot, "load_tasks", list)  # the task names stand for the loaded tasks
    monkeypatch.setattr(dress, "zero_shot", zero_shot)
    settings = dict(model=model_dir, rows=["slice"], tasks=["austen_continuation"], limit=5, **TINY)
    result = studies.run("dress", str(output), **settings)
    assert scored == [64, 48]  # the dense model, then the sliced one after LoRA
    assert result["dense_zero_shot"] == {"austen_continuation": {"acc": 0.6, "stderr": 0.1, "n": 5, "chance": 0.25}}
    assert result["rows"][0]["zero_shot_lora"]["austen_continuation"]["acc"] == 0.7
    assert "| quiet | slice only (w/o R) | 0.700 ± 0.100 (n 5) |" in output.with_suffix(".md").read_text()
    studies.run("dress", str(output), **settings)
    assert scored == [64, 48]  # nothing left to score
    # what a concurrent run of the same settings wrote meanwhile is kept: its rows and dense scores
    on_disk = {"dense_zero_shot": {"moby_dick_continuation": {"acc": 0.3}},
               "rows": [dict(result["rows"][0], channels="last")]}
    dress.Dress().merge(result, on_disk)
    assert set(result["dense_zero_shot"]) == {"austen_continuation", "moby_dick_continuation"}
    assert [r["channels"] for r in result["rows"]] == ["quiet", "last"]


def test_quiet_takes_the_study_progress_bars_away(tiny_model_dir, tmp_path, capsys):
    """``pyprune study ... --quiet`` reaches the bars the study's arms draw (training, pruning)."""
    from pyprune import cli
    argv = ["study", "dress", "--model", str(tiny_model_dir[0]), "--rows", "npr", "--skip-lora", "true",
            "--channels", "quiet", "--nsamples", "8", "--seqlen", "16", "--steps", "2", "--train-batch", "2",
            "--eval-tokens", "64", "--eval-seqlen", "16"]
    assert cli.main(argv + ["--output", str(tmp_path / "loud.json")]) == 0
    assert "train sliced" in capsys.readouterr().err
    assert cli.main(argv + ["--output", str(tmp_path / "quiet.json"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "dress: quiet slice, then train (N&P&R): mass 1.000" in captured.out  # the results still print


class _Stopped(Exception):
    """What stops a run mid-row in the resume test (as a killed process would)."""


def test_a_row_stopped_mid_training_resumes_from_its_last_save(tiny_model_dir, tmp_path, monkeypatch):
    """Both kinds of training a row runs (DReSS's regularisation, N&P&R's training after the cut)
    save every ``checkpoint_every`` steps; a rerun goes on from the save and ends where an
    unbroken run ends, to the bit, and the saves are removed once the row is written."""
    from pyprune.runtime import training
    settings = dict(model=str(tiny_model_dir[0]), rows=["dress", "npr"], skip_lora=True, **{**TINY, "steps": 4},
                    checkpoint_every=2)
    unbroken = studies.run("dress", str(tmp_path / "unbroken.json"), progress=False, **settings)["rows"]
    save = training.TrainingCheckpoint.save

    def save_then_stop(self, model, optimizer, step, log):
        save(self, model, optimizer, step, log)
        if step == 2:
            raise _Stopped

    output = tmp_path / "stopped.json"
    saves = tmp_path / "stopped.checkpoints"
    for done in (0, 1):  # the first stop is in DReSS's regularisation, the second in N&P&R's training
        monkeypatch.setattr(training.TrainingCheckpoint, "save", save_then_stop)
        with pytest.raises(_Stopped):
            studies.run("dress", str(output), progress=False, **settings)
        assert len(list(saves.iterdir())) == 1  # the stopped row's save, the finished rows' removed
        monkeypatch.setattr(training.TrainingCheckpoint, "save", save)
        if done == 0:
            studies.run("dress", str(output), progress=False, **dict(settings, rows=["dress"]))
    resumed = studies.run("dress", str(output), progress=False, **settings)["rows"]
    assert [r["label"] for r in resumed] == [r["label"] for r in unbroken] == ["DReSS-l2", dress.CONTROL]
    for ours, theirs in zip(resumed, unbroken):
        assert ours["loss"] == theirs["loss"] and ours["ppl_sliced"] == theirs["ppl_sliced"]
        assert ours["slice_mass_ratio"] == theirs["slice_mass_ratio"]
    assert resumed[0]["resumed_at_step"] == resumed[1]["resumed_at_step"] == 2
    assert "resumed_at_step" not in unbroken[0] and not saves.exists()  # every save removed, the folder too
    assert "| 4 | – | 0.01 | 0 |" in output.with_suffix(".md").read_text()  # N&P&R's row
    assert dress.train_time(resumed[1]).endswith(" (steps 2–4)")
