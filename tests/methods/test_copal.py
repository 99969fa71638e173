"""COPAL on tiny random Llamas: the accumulated score against a hand computation, recoverable
weights (no weight stasis), order invariance with dense propagation, the saved continual state
(resume, refusals), and the continual runner's metrics."""
import json
import os

import pytest
import torch

import pyprune
from pyprune.studies import continual
from pyprune.runtime import engine
from pyprune.methods.copal import STATE_FILE, Copal
from pyprune.patterns import Unstructured
from pyprune.ops.reference import kept_count
from tests.helpers import WORDS, random_tokens, tiny_llama


def _linears(model):
    prefix = engine.block_prefix(model)
    return {f"{prefix}.{i}.{name}": linear for i, block in enumerate(engine.decoder_blocks(model))
            for name, linear in engine.block_linears(block).items()}


def _weights(model):
    return {name: linear.weight.detach().clone() for name, linear in _linears(model).items()}


def _dense_sensitivity(model, calib, epsilon):
    """Σ_t 2·|2ε·y_t| |x_t|ᵀ for every linear of the dense model (COPAL Eq. 10 with ΔW = εW,
    ΔX = εX), from hooks on one ordinary forward pass."""
    G = {name: torch.zeros_like(linear.weight, dtype=torch.float64) for name, linear in _linears(model).items()}
    def hook(name, x, y):
        G[name] += 2 * (2 * epsilon * y.double().reshape(-1, y.shape[-1])).abs().T \
            @ x.double().reshape(-1, x.shape[-1]).abs()

    handles = [linear.register_forward_hook(lambda mod, args, out, name=name: hook(name, args[0], out))
               for name, linear in _linears(model).items()]
    with torch.no_grad():
        model(input_ids=calib, use_cache=False)
    for handle in handles:
        handle.remove()
    return G


def _assert_masks_match_scores(weights, scores, sparsity):
    """Every layer keeps the top (1 − s) of its scores per matrix; a disagreement is allowed only
    within rounding of the threshold (the two sums run in a different order)."""
    for name, w in weights.items():
        score = scores[name].flatten()
        keep = (w != 0).flatten()
        assert int(keep.sum()) == kept_count(score.numel(), sparsity)
        threshold = score.sort(descending=True).values[int(keep.sum()) - 1]
        wrong = keep != (score >= threshold)
        assert bool(((score[wrong] - threshold).abs() <= 1e-6 * threshold).all()), name


def test_one_step_keeps_the_top_scores_of_the_dense_model():
    model = tiny_llama(seed=0)
    dense = _weights(model)
    calib = random_tokens((4, 32), seed=1)
    report = pyprune.prune(model, "copal", 0.5, calib, progress=False, propagate="dense")
    G = _dense_sensitivity(tiny_llama(seed=0), calib, epsilon=0.01)
    pruned = _weights(model)
    _assert_masks_match_scores(pruned, {n: dense[n].double().abs() * G[n] for n in dense}, 0.5)
    for name, w in pruned.items():  # kept weights keep their dense values
        assert torch.equal(w[w != 0], dense[name][w != 0])
    assert report["continual_step"] == 1 and report["scope"] == "tensor"


def test_pruned_weights_come_back_on_the_next_dataset():
    """No weight stasis (Eq. 2): the second mask comes from the dense weights and the summed
    sensitivities, so weights zeroed after dataset A are restored when B makes them important."""
    model = tiny_llama(seed=0)
    dense = _weights(model)
    method = Copal()
    pyprune.prune(model, method, 0.5, random_tokens((4, 32), seed=1), progress=False)
    after_a = _weights(model)
    pyprune.prune(model, method, 0.5, random_tokens((4, 32), seed=2, vocab=40), progress=False)
    after_b = _weights(model)
    revived = sum(int(((after_a[n] == 0) & (after_b[n] != 0)).sum()) for n in dense)
    assert revived > 0
    for name, w in after_b.items():
        assert torch.equal(w[w != 0], dense[name][w != 0])
        assert int((w == 0).sum()) == w.numel() // 2


def test_with_dense_propagation_the_final_mask_does_not_depend_on_the_order():
    """Spec §4.2: with inputs from the dense model, W*_k is a sum over datasets."""
    calib_a, calib_b = random_tokens((4, 32), seed=1), random_tokens((4, 32), seed=2, vocab=40)
    finals = []
    for first, second in ((calib_a, calib_b), (calib_b, calib_a)):
        model, method = tiny_llama(seed=0), Copal(propagate="dense")
        pyprune.prune(model, method, "2:4", first, progress=False)
        pyprune.prune(model, method, "2:4", second, progress=False)
        finals.append((_weights(model), method))
    (w1, m1), (w2, _) = finals
    scores = {n: m1.dense[n].abs().double() * m1.accumulators[n].double() for n in w1}
    differ = sum(int(((w1[n] != 0) != (w2[n] != 0)).sum()) for n in w1)
    assert differ <= 4  # near-ties only: the two orders add the same terms in a different order
    for name, w in w1.items():
        assert bool(((w != 0).reshape(-1, 4).sum(1) == 2).all())
    assert scores  # the accumulators cover every layer
    assert set(scores) == set(_linears(tiny_llama(seed=0)))


def test_pruned_propagation_changes_later_blocks_only():
    calib = random_tokens((4, 32), seed=1)
    results = {}
    for propagate in ("pruned", "dense"):
        model = tiny_llama(seed=0, layers=3)
        pyprune.prune(model, "copal", 0.5, calib, progress=False, propagate=propagate)
        results[propagate] = _weights(model)
    first = [n for n in results["dense"] if ".0." in n]
    later = [n for n in results["dense"] if ".2." in n]
    assert all(torch.equal(results["dense"][n], results["pruned"][n]) for n in first)
    assert any(not torch.equal(results["dense"][n], results["pruned"][n]) for n in later)


@pytest.mark.parametrize("pattern,scope", [("4:8", None), (0.6, "row")])
def test_patterns_are_exact(pattern, scope):
    model = tiny_llama(seed=3)
    spec = pyprune.patterns.Unstructured(pattern, scope) if scope else pattern
    pyprune.prune(model, "copal", spec, random_tokens((2, 32), seed=1), progress=False)
    for w in _weights(model).values():
        if scope == "row":
            assert bool(((w != 0).sum(1) == kept_count(w.shape[1], 0.6)).all())
        else:
            assert bool(((w != 0).reshape(-1, 8).sum(1) == 4).all())


def test_gaussian_perturbation_is_seeded_and_differs_from_proportional():
    calib = random_tokens((2, 32), seed=1)
    runs = []
    for options in ({"perturbation": "gaussian"}, {"perturbation": "gaussian"},
                    {"perturbation": "gaussian", "perturbation_seed": 5}, {}):
        model = tiny_llama(seed=0)
        pyprune.prune(model, "copal", 0.5, calib, progress=False, **options)
        runs.append(_weights(model))
    same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    assert same(runs[0], runs[1])
    assert not same(runs[0], runs[2]) and not same(runs[0], runs[3])


def test_gaussian_masks_follow_the_perturbation_ratio_not_epsilon():
    """DY is linear in ε at a fixed ratio (ε ×4 is exact in floating point), so every mask stays;
    the ratio of the ΔX and ΔW sizes changes them."""
    calib = random_tokens((2, 32), seed=1)
    runs = {}
    for epsilon, ratio in ((0.01, 1.0), (0.04, 1.0), (0.01, 8.0), (0.04, 8.0)):
        model = tiny_llama(seed=0)
        pyprune.prune(model, "copal", 0.5, calib, progress=False, perturbation="gaussian", epsilon=epsilon,
                      perturbation_ratio=ratio)
        runs[epsilon, ratio] = {name: w != 0 for name, w in _weights(model).items()}
    same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    assert same(runs[0.01, 1.0], runs[0.04, 1.0]) and same(runs[0.01, 8.0], runs[0.04, 8.0])
    changed = sum(int((runs[0.01, 1.0][n] != runs[0.01, 8.0][n]).sum()) for n in runs[0.01, 1.0])
    assert changed > 0.01 * sum(m.numel() for m in runs[0.01, 1.0].values()), changed


def test_state_resumes_exactly_from_the_dense_or_the_pruned_model(tmp_path):
    calib_a, calib_b = random_tokens((4, 32), seed=1), random_tokens((4, 32), seed=2, vocab=40)
    memory_model, method = tiny_llama(seed=0), Copal()
    for calib in (calib_a, calib_b):
        pyprune.prune(memory_model, method, "2:4", calib, progress=False)
    expected = _weights(memory_model)

    for from_pruned in (False, True):  # resume on the base model, or on the output of step 1
        state = str(tmp_path / f"state-{from_pruned}")
        first = tiny_llama(seed=0)
        report = pyprune.prune(first, "copal", "2:4", calib_a, progress=False, state=state)
        assert report["state"] == state and os.listdir(state) == [STATE_FILE]
        start = first if from_pruned else tiny_llama(seed=0)
        report = pyprune.prune(start, "copal", "2:4", calib_b, progress=False, state=state)
        assert report["continual_step"] == 2
        assert all(torch.equal(expected[n], w) for n, w in _weights(start).items())


def test_state_refuses_other_settings_other_models_and_repeated_data(tmp_path):
    state = str(tmp_path / "state")
    calib = random_tokens((2, 32), seed=1)
    pyprune.prune(tiny_llama(seed=0), "copal", 0.5, calib, progress=False, state=state)
    saved = open(os.path.join(state, STATE_FILE), "rb").read()
    cases = [
        (tiny_llama(seed=0), 0.5, {"epsilon": 0.1}, "other settings: epsilon 0.01"),
        (tiny_llama(seed=0), "2:4", {}, "other settings: pattern"),
        (tiny_llama(seed=0), Unstructured(0.5, "row"), {}, "other settings: scope 'tensor' \\(now 'row'\\)"),
        (tiny_llama(seed=7), 0.5, {}, "another model"),
        (tiny_llama(seed=0).to(torch.bfloat16), 0.5, {}, "another model"),
        (tiny_llama(seed=0), 0.5, {}, "already accumulated"),
    ]
    for model, pattern, options, message in cases:
        before = _weights(model)
        with pytest.raises(ValueError, match=message):
            pyprune.prune(model, "copal", pattern, calib, progress=False, state=state, **options)
        assert all(torch.equal(before[n], w) for n, w in _weights(model).items())
        assert open(os.path.join(state, STATE_FILE), "rb").read() == saved
    assert os.listdir(state) == [STATE_FILE]


def test_bad_options_are_rejected():
    for options, message in (({"epsilon": 0}, "epsilon"), ({"perturbation": "uniform"}, "perturbation"),
                             ({"propagate": "both"}, "propagate"), ({"perturbation_ratio": 0.0}, "perturbation_ratio"),
                             ({"perturbation_ratio": 2.0}, "perturbation_ratio applies to perturbation 'gaussian'")):
        with pytest.raises(ValueError, match=message):
            pyprune.methods.get("copal", **options)


def test_metrics_by_hand():
    """Two orders of A, B: BWT_A = P[last][A] − P[step of A][A], per dataset over orders."""
    matrix = {
        ("A", "B"): [{"pruned_on": "A", "perplexity": {"A": 10.0, "B": 30.0}},
                     {"pruned_on": "B", "perplexity": {"A": 12.0, "B": 20.0}}],
        ("B", "A"): [{"pruned_on": "B", "perplexity": {"A": 15.0, "B": 21.0}},
                     {"pruned_on": "A", "perplexity": {"A": 11.0, "B": 24.0}}],
    }
    result = continual.metrics(["A", "B"], matrix)
    assert result["per_dataset"]["A"]["bwt"] == pytest.approx(2.0)  # only order (A, B) has A before the end
    assert result["per_dataset"]["B"]["bwt"] == pytest.approx(3.0)
    assert result["per_dataset"]["A"]["ppl"] == pytest.approx(11.5)
    assert result["a_bwt"] == pytest.approx(2.5) and result["m_bwt"] == pytest.approx(3.0)
    assert result["a_ppl"] == pytest.approx((11.5 + 22.0) / 2) and result["m_ppl"] == pytest.approx(24.0)
    # spread across orders: order (A, B) has A-BWT 2 and final mean 16, order (B, A) 3 and 17.5
    assert result["a_bwt_std"] == pytest.approx(0.5) and result["a_ppl_std"] == pytest.approx(0.75)


def _tasks():
    return [continual.Task(name, random_tokens((2, 32), seed=seed, vocab=vocab),
                           random_tokens((128,), seed=seed + 10, vocab=vocab))
            for name, seed, vocab in (("A", 1, 128), ("B", 2, 40), ("C", 3, 80))]


def test_global_baseline_depends_on_the_last_dataset_only():
    model = tiny_llama(seed=0)
    dense = _weights(model)
    report = continual.run(model, "wanda", 0.5, _tasks(), permutations="all", eval_seqlen=32, progress=False)
    assert len(report["matrix"]) == 6
    by_last = {}
    for run in report["matrix"]:
        for step in run["steps"]:
            by_last.setdefault(step["pruned_on"], step["perplexity"])
            assert step["perplexity"] == by_last[step["pruned_on"]]
    assert all(torch.equal(dense[n], w) for n, w in _weights(model).items())  # left dense


def test_sequential_baseline_freezes_the_mask():
    """Weight stasis (Eq. 2): pruning the pruned model again keeps its zeros."""
    model = tiny_llama(seed=0)
    seen = []
    original = continual.prune

    def recording(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        seen.append({n: (w == 0) for n, w in _weights(model).items()})
        return result

    continual.prune = recording
    try:
        continual.run(model, "wanda", 0.5, _tasks(), init="sequential", eval_seqlen=32, progress=False)
    finally:
        continual.prune = original
    assert all(torch.equal(seen[0][n], seen[-1][n]) for n in seen[0])


def test_copal_runs_continually_and_reports_every_step():
    report = continual.run(tiny_llama(seed=0), "copal", "2:4", _tasks(), eval_seqlen=32, progress=False)
    (run,) = report["matrix"]
    assert [s["pruned_on"] for s in run["steps"]] == ["A", "B", "C"]
    assert report["init"] == "continual state"
    assert set(report["per_dataset"]) == {"A", "B", "C"} and report["per_dataset"]["C"]["bwt"] is None
    assert report["a_bwt"] is not None and report["m_ppl"] >= report["a_ppl"]


def _input_sqnorms(model, calib):
    """Σ_t x_t² per input feature of every linear of the dense ``model`` (fp64), by hooks."""
    sums = {name: torch.zeros(linear.in_features, dtype=torch.float64) for name, linear in _linears(model).items()}
    def hook(name, x):
        sums[name] += x.double().reshape(-1, x.shape[-1]).square().sum(0)

    handles = [linear.register_forward_hook(lambda mod, args, out, name=name: hook(name, args[0]))
               for name, linear in _linears(model).items()]
    with torch.no_grad():
        model(input_ids=calib, use_cache=False)
    for handle in handles:
        handle.remove()
    return sums


@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_cumulative_wanda_prunes_the_dense_weights_by_the_summed_statistic(scope):
    """After datasets A then B, each layer keeps the top |W_ij|·sqrt(Σ_A‖x_j‖² + Σ_B‖x_j‖²) of the
    dense W (per row or per matrix). One block: every layer's inputs come from the dense block, so
    hooks on the dense model give the statistic by hand."""
    calib_a, calib_b = random_tokens((2, 32), seed=1), random_tokens((2, 32), seed=2, vocab=40)
    model = tiny_llama(seed=0, layers=1)
    dense = _weights(model)
    norms = {n: _input_sqnorms(model, calib_a)[n] + s for n, s in _input_sqnorms(model, calib_b).items()}
    runner = pyprune.methods.get("wanda").accumulate_across_calls()
    for calib in (calib_a, calib_b):
        pyprune.prune(model, runner, Unstructured(0.5, scope), calib, progress=False)
    for name, w in _weights(model).items():
        score = dense[name].double().abs() * norms[name].sqrt()
        rows = score if scope == "row" else score.reshape(1, -1)
        k = kept_count(rows.shape[1], 0.5)
        expected = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, rows.topk(k, dim=1).indices, True)
        assert torch.equal(w != 0, expected.reshape(w.shape)), name
        assert torch.equal(w[w != 0], dense[name][w != 0])  # kept weights are the dense ones


def test_cumulative_sparsegpt_equals_one_shot_on_the_datasets_together():
    """SparseGPT's Hessian summed over A then B is the one of A and B together, and the weights
    are updated from the dense ones: the same result as one call on both (one block)."""
    calib_a, calib_b = random_tokens((2, 32), seed=1), random_tokens((2, 32), seed=2, vocab=40)
    model, together = tiny_llama(seed=0, layers=1), tiny_llama(seed=0, layers=1)
    runner = pyprune.methods.get("sparsegpt").accumulate_across_calls()
    for calib in (calib_a, calib_b):
        pyprune.prune(model, runner, 0.5, calib, batch_size=2, progress=False)
    pyprune.prune(together, "sparsegpt", 0.5, torch.cat([calib_a, calib_b]), batch_size=2, progress=False)
    expected = _weights(together)
    for name, w in _weights(model).items():
        torch.testing.assert_close(w, expected[name], rtol=1e-4, atol=1e-5)


def test_continual_runner_cumulative_init():
    model = tiny_llama(seed=0)
    report = continual.run(model, "wanda", 0.5, _tasks(), init="cumulative", eval_seqlen=32, progress=False)
    assert report["init"] == "cumulative" and report["scope"] == "row"
    (run,) = report["matrix"]
    first = continual.run(model, "wanda", 0.5, _tasks()[:1], eval_seqlen=32, progress=False)
    assert run["steps"][0]["perplexity"]["A"] == first["matrix"][0]["steps"][0]["perplexity"]["A"]
    assert run["steps"][-1]["perplexity"] != first["matrix"][0]["steps"][0]["perplexity"]
    for method in ("copal", "magnitude"):
        with pytest.raises(ValueError, match="init 'cumulative' needs"):
            continual.run(model, method, 0.5, _tasks(), init="cumulative", progress=False)
    with pytest.raises(ValueError, match="cannot accumulate"):
        Copal().accumulate_across_calls()


def test_metrics_over_every_step():
    """Eq. 13 read over every step i and dataset j: the mean and max of all of P."""
    matrix = {("A", "B"): [{"pruned_on": "A", "perplexity": {"A": 10.0, "B": 30.0}},
                           {"pruned_on": "B", "perplexity": {"A": 12.0, "B": 20.0}}]}
    result = continual.metrics(["A", "B"], matrix)
    assert result["a_ppl_steps"] == pytest.approx(18.0) and result["m_ppl_steps"] == 30.0
    assert result["a_ppl"] == pytest.approx(16.0)


def _two_texts(directory):
    """Two texts of the tiny tokenizer's words, with lines (so that they have two halves)."""
    text, other = directory / "text.txt", directory / "other.txt"
    text.write_text("\n".join(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(10)) for i in range(60)))
    other.write_text("\n".join(["house woman truth wife ."] * 150))
    return text, other


def _continual_argv(tiny_model_dir, tmp_path, *pattern):
    """(argv of a tiny COPAL continual run over the two texts with ``pattern``, its report path)."""
    model_dir, _ = tiny_model_dir
    text, other = _two_texts(tmp_path)
    report_path = tmp_path / "continual.json"
    return (["continual", "--model", str(model_dir), "--method", "copal", *pattern, "--datasets", str(text),
             str(other), "--nsamples", "2", "--seqlen", "16", "--eval-seqlen", "16", "--report", str(report_path),
             "--quiet"], report_path)


def test_cli_continual_end_to_end_and_resume(tiny_model_dir, tmp_path, capsys):
    from pyprune.cli import main
    argv, report_path = _continual_argv(tiny_model_dir, tmp_path, "--pattern", "2:4", "--permutations", "all")
    assert main(argv) == 0
    report = json.loads(report_path.read_text())
    assert len(report["matrix"]) == 2 and {"a_ppl", "m_ppl", "a_bwt", "m_bwt"} <= set(report)
    partial = dict(report, matrix=report["matrix"][:1], partial=True)
    report_path.write_text(json.dumps(partial))
    assert main(argv) == 0
    assert "resuming: 1 order(s)" in capsys.readouterr().out
    assert json.loads(report_path.read_text())["matrix"] == report["matrix"]
    # the same report path with other settings is refused, and left as it is
    before = report_path.read_text()
    assert main(argv[:-1] + ["--epsilon", "0.1", "--quiet"]) == 2
    assert "other settings" in capsys.readouterr().err and report_path.read_text() == before


def test_cli_continual_report_keys_the_selection_scope(tiny_model_dir, tmp_path, capsys):
    """A report made per matrix (COPAL's default) is not resumed per row."""
    from pyprune.cli import main
    argv, report_path = _continual_argv(tiny_model_dir, tmp_path, "--sparsity", "0.5")
    assert main(argv) == 0
    before = report_path.read_text()
    assert json.loads(before)["scope"] == "tensor"
    assert main(argv + ["--scope", "row"]) == 2
    assert "other settings" in capsys.readouterr().err and report_path.read_text() == before
    assert main(argv + ["--init", "cumulative"]) == 2
    assert "--init cumulative needs" in capsys.readouterr().err and report_path.read_text() == before
    wanda = [a if a != "copal" else "wanda" for a in argv[:-2]] + [str(tmp_path / "wanda.json"), "--quiet"]
    assert main(wanda + ["--init", "cumulative"]) == 0
    report = json.loads((tmp_path / "wanda.json").read_text())
    assert report["init"] == "cumulative" and report["settings"]["scope"] == "row"


@pytest.mark.parametrize("extra,message", [
    (["--datasets", "emma"], "two or more"),
    (["--datasets", "emma", "emma"], "two or more"),
    (["--datasets", "emma", "python", "--eval", "emma"], "one text per dataset"),
    (["--datasets", "emma:first_half", "python"], "names a half"),
    (["--datasets", "emma", "nowhere"], "nowhere"),
])
def test_cli_continual_bad_arguments(extra, message, tmp_path, capsys):
    from pyprune.cli import main
    argv = ["continual", "--model", "smollm2-135m", "--method", "copal", "--sparsity", "0.5",
            "--report", str(tmp_path / "r.json")] + extra
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_prune_with_state(tiny_model_dir, tmp_path):
    from pyprune.cli import main
    model_dir, _ = tiny_model_dir
    text, other = _two_texts(tmp_path)
    state = tmp_path / "state"
    base = ["prune", "--model", str(model_dir), "--method", "copal", "--pattern", "2:4", "--nsamples", "2",
            "--seqlen", "16", "--state", str(state), "--quiet"]
    assert main(base + ["--calib", str(text), "--report", str(tmp_path / "a.json")]) == 0
    assert main(base + ["--calib", str(other), "--report", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["continual_step"] == 2
    assert main(base + ["--calib", str(other)]) == 2  # the same data again


@pytest.mark.slow
def test_copal_forgets_less_than_wanda_on_smollm2(smollm2):
    """COPAL's claim on the real model, in a CI-sized setting: Austen prose then Python source
    (4 x 128 calibration tokens of each first half, 1024 evaluation tokens of each second half),
    50% unstructured per output row. Wanda re-pruned on Python forgets Austen (positive BWT); COPAL, which keeps
    Austen's sensitivities, forgets much less, at no worse final perplexity.
    the continual study (pyprune study continual) measures the full table."""
    from pyprune.inputs import data
    model, tokenizer = smollm2  # continual.run leaves the model dense
    tasks = [continual.Task(name, data.calibration_samples(tokenizer, f"{name}:first_half", nsamples=4,
                                                           seqlen=128, seed=0),
                            data.eval_tokens(tokenizer, f"{name}:second_half", max_tokens=1024))
             for name in ("austen", "python")]
    per_row = pyprune.patterns.Unstructured(0.5, "row")
    reports = {method: continual.run(model, method, per_row, tasks, eval_seqlen=256, progress=False)
               for method in ("copal", "wanda")}
    summary = {m: (r["a_bwt"], r["a_ppl"]) for m, r in reports.items()}
    print(f"\n(A-BWT, A-PPL): {summary}; dense {reports['wanda']['dense']}")
    assert reports["wanda"]["a_bwt"] > 0.5  # forgetting: Austen perplexity rises after pruning on Python
    assert reports["copal"]["a_bwt"] < 0.5 * reports["wanda"]["a_bwt"]
    assert reports["copal"]["a_ppl"] <= reports["wanda"]["a_ppl"]
