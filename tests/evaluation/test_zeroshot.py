"""Zero-shot accuracy through lm-evaluation-harness (pyprune.evaluation.zeroshot): the local tasks' items, the
whole path (task files, lm-eval's loading, log-likelihood scoring, accuracy) against a hand
computation on tiny random Llamas, every kind of pruned layer, the one-line data error, the CLI,
and SmolLM2-135M well above chance (slow)."""
import copy
import functools
import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pyprune
from pyprune import cli
from pyprune.inputs import data
from pyprune.evaluation import zeroshot
from pyprune.patterns import Structured
from tests.helpers import random_tokens, text_tokenizer, tiny_llama

TASK = "austen_continuation"
LIMIT = 4


def _true_next_lines(text, context, continuation_lines):
    """The lines that follow ``context`` in ``text`` (the context is unique there)."""
    at = text.index(context + "\n")
    return "\n".join(text[at + len(context) + 1:].split("\n")[:continuation_lines])


def test_items_are_deterministic_and_hold_the_true_continuation_exactly_once():
    text = data.load_text(zeroshot.LOCAL_TASKS[TASK])
    items = zeroshot.build_items(text, items=60)
    assert items == zeroshot.build_items(text, items=60)
    assert items != zeroshot.build_items(text, items=60, seed=1)
    assert len(items) == 60 and {item["label"] for item in items} == set(range(zeroshot.CHOICES))
    for item in items:
        context, choices = item["context"], item["choices"]
        assert len(context.split("\n")) == zeroshot.CONTEXT_LINES and context.split("\n")[-1].strip()
        assert len(choices) == zeroshot.CHOICES == len(set(choices))
        truth = _true_next_lines(text, context, zeroshot.CONTINUATION_LINES)
        assert choices.count(truth) == 1 and choices[item["label"]] == truth
        for choice in choices:  # every candidate is the same number of non-blank lines of the text
            lines = choice.split("\n")
            assert len(lines) == zeroshot.CONTINUATION_LINES and all(line.strip() for line in lines)
            assert "\n" + choice + "\n" in text + "\n"


def test_items_spread_over_the_text_in_random_order():
    text = data.load_text(zeroshot.LOCAL_TASKS["python_continuation"])
    positions = [text.index(item["context"] + "\n") for item in zeroshot.build_items(text, items=40)]
    assert positions != sorted(positions)
    assert max(positions[:10]) - min(positions[:10]) > len(text) / 3  # the first 10 are not all in one place


@pytest.mark.parametrize("option, value", [("items", 0), ("context_lines", 0), ("choices", 1), ("items", 1.5)])
def test_build_items_rejects_bad_settings(option, value):
    with pytest.raises(ValueError, match=option):
        zeroshot.build_items("a\nb\n" * 500, **{option: value})


def test_task_files_are_lm_eval_yaml_and_jsonl(tmp_path):
    path = zeroshot.write_local_task(TASK, str(tmp_path), items=5)
    yaml = open(path).read()
    assert "dataset_path: json" in yaml and "output_type: multiple_choice" in yaml
    lines = open(tmp_path / f"{TASK}.jsonl").read().splitlines()
    assert [json.loads(line) for line in lines] == zeroshot.build_items(data.load_text("pride_and_prejudice"),
                                                                        items=5)


def _items():
    return zeroshot.build_items(data.load_text("pride_and_prejudice"))[:LIMIT]


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """A word-level tokenizer over every word of the items evaluated, "\\n" a token of its own: no
    item word is <unk>, and the delimiter between context and choice is scored (a tokenizer
    dropping whitespace would score any delimiter alike)."""
    return text_tokenizer([text for item in _items() for text in [item["context"], *item["choices"]]])


def _tiny_llama():
    return tiny_llama(vocab=len(_tokenizer()))


def _hand_loglikelihoods(model, tokenizer, item):
    """log p(choice tokens | context) for each choice, the model run directly (lm-eval's split:
    the context's tokens, then those of "\\n" + choice)."""
    scores = []
    for choice in item["choices"]:
        context = tokenizer(item["context"], add_special_tokens=False)["input_ids"]
        whole = tokenizer(item["context"] + "\n" + choice, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([whole])
        with torch.no_grad():
            log_probs = F.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), dim=-1)[0]
        scores.append(sum(float(log_probs[i - 1, whole[i]]) for i in range(len(context), len(whole))))
    return scores


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    return zeroshot.load_tasks([TASK], task_dir=str(tmp_path_factory.mktemp("zeroshot")))


def _check_scores(model, tokenizer, tasks, reference=None):
    """lm-eval's per-choice log-likelihoods equal the hand computation (run on ``reference``, by
    default the model itself), and its acc / acc_norm are the argmax of the sums / of the sums per
    character."""
    result = zeroshot.evaluate(model, tokenizer, tasks, limit=LIMIT, batch_size=3, details=True)[TASK]
    items = _items()
    assert result["n"] == LIMIT and [r["label"] for r in result["items"]] == [i["label"] for i in items]
    acc = acc_norm = 0
    for item, scored in zip(items, result["items"]):
        hand = _hand_loglikelihoods(model if reference is None else reference, tokenizer, item)
        np.testing.assert_allclose(scored["loglikelihoods"], hand, rtol=1e-5, atol=1e-4)
        lengths = np.array([len(choice) for choice in item["choices"]], dtype=float)
        acc += int(np.argmax(hand)) == item["label"]
        acc_norm += int(np.argmax(np.array(hand) / lengths)) == item["label"]
    assert result["acc"] == pytest.approx(acc / LIMIT) and result["acc_norm"] == pytest.approx(acc_norm / LIMIT)
    assert result["stderr"]["acc"] == pytest.approx(np.std([1.0] * acc + [0.0] * (LIMIT - acc), ddof=1)
                                                    / np.sqrt(LIMIT))
    assert result["metric"] == "acc" and result["chance"] == 1 / zeroshot.CHOICES and result["num_fewshot"] == 0
    return result


def _state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}, \
        [type(m).__name__ for m in model.modules()], model.training


def _evaluated_unchanged(model, tokenizer, tasks, reference=None):
    before = _state(model)
    _check_scores(model, tokenizer, tasks, reference)
    after = _state(model)
    assert after[1:] == before[1:] and "tie_weights" not in vars(model)
    assert all(torch.equal(after[0][k], before[0][k]) for k in before[0])


def test_scoring_matches_a_hand_computation_on_a_tiny_model(local_tasks):
    model = _tiny_llama().train()  # training mode must come back
    tokenizer = _tokenizer()
    ids = [tokenizer(item["context"] + "\n" + choice)["input_ids"] for item in _items() for choice in item["choices"]]
    assert tokenizer.unk_token_id not in sum(ids, [])
    _evaluated_unchanged(model, tokenizer, local_tasks)


def test_sparse_linear_model(local_tasks):
    """SparseLinear layers on the sparse kernel (on every machine: no dispatch table decides), scored
    as the same weights in dense nn.Linear layers."""
    from pyprune.nn import SparseLinear, sparsify_
    model, tokenizer = _tiny_llama(), _tokenizer()
    pyprune.prune(model, "magnitude", "2:4", progress=False)
    dense = copy.deepcopy(model)
    assert len(sparsify_(model, "2:4", implementation="kernel")) == 14
    _evaluated_unchanged(model, tokenizer, local_tasks, reference=dense)
    assert [m.implementation for m in model.modules() if isinstance(m, SparseLinear)] == ["kernel"] * 14


def test_compacted_structured_model(local_tasks):
    model, tokenizer = _tiny_llama(), _tokenizer()
    pyprune.prune(model, "taylor", Structured(0.5), random_tokens((4, 32), vocab=len(tokenizer)), progress=False)
    assert model.model.layers[0].mlp.gate_proj.out_features < 128
    _evaluated_unchanged(model, tokenizer, local_tasks)


@pytest.mark.parametrize("physically", [False, True])
def test_hidden_sliced_models(local_tasks, physically):
    """DReSS's slicing: through SlicedLinear/SlicedEmbedding/SlicedNorm wrappers (the LM head
    included, which lm-eval's re-tying would break) and physically smaller."""
    from pyprune.nn import SlicedLinear, keep_hidden_channels_, slice_hidden_channels_
    model, keep = _tiny_llama(), torch.arange(1, 48, 4)
    (keep_hidden_channels_ if physically else slice_hidden_channels_)(model, keep)
    assert model.config.hidden_size == 12 if physically else isinstance(model.lm_head, SlicedLinear)
    _evaluated_unchanged(model, _tokenizer(), local_tasks)


def test_bad_arguments(local_tasks):
    model, tokenizer = _tiny_llama(), _tokenizer()
    for kwargs, match in (({"limit": 0}, "limit"), ({"batch_size": 0}, "batch_size")):
        with pytest.raises(ValueError, match=match):
            zeroshot.evaluate(model, tokenizer, local_tasks, **kwargs)
    for names in ([], [TASK, TASK], [" "]):
        with pytest.raises(ValueError, match="tasks"):
            zeroshot.load_tasks(names)


def test_missing_lm_eval_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ImportError, match=r"pyprune\[eval\]"):
        zeroshot.load_tasks([TASK])


def _hub_failure(names, task_dir):
    with pytest.raises(zeroshot.TaskDataError) as error:
        zeroshot.load_tasks(names, task_dir=task_dir)
    return str(error.value)


def test_hub_task_without_data_is_one_line_naming_it(monkeypatch, tmp_path):
    """Offline, a task whose dataset is on the hub (and not cached) fails while the tasks load,
    before any model work, in one line that names it (lm-eval's own index of thousands of tasks
    is replaced by one such task here; the slow test below asks for piqa itself)."""
    from lm_eval.tasks import TaskManager
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    (hub_dir / "hub_task.yaml").write_text("task: hub_task\ndataset_path: pyprune-tests/not-on-this-machine\n"
                                           "output_type: multiple_choice\ntest_split: test\ndoc_to_text: q\n"
                                           "doc_to_choice: choices\ndoc_to_target: 0\n")
    monkeypatch.setattr(zeroshot, "_manager", lambda task_dir, hub: TaskManager(
        include_path=[task_dir, str(hub_dir)], include_defaults=False))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = _hub_failure([TASK, "hub_task"], str(tmp_path / "tasks"))
    assert message.startswith("task 'hub_task': its data could not be loaded") and "\n" not in message
    with pytest.raises(ValueError, match="unknown task.*no_such_task"):
        zeroshot.load_tasks(["no_such_task"], task_dir=str(tmp_path / "tasks"))


@pytest.mark.slow
def test_piqa_offline_is_one_line_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = _hub_failure(["piqa"], str(tmp_path))
    assert message.startswith("task 'piqa': its data could not be loaded") and "\n" not in message


def test_cli_eval_and_prune_add_tasks_to_the_report(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYPRUNE_CACHE", str(tmp_path / "cache"))
    model_dir, text = tiny_model_dir
    report = tmp_path / "eval.json"
    assert cli.main(["eval", "--model", str(model_dir), "--data", str(text), "--seqlen", "32",
                     "--tasks", "austen_continuation,python_continuation", "--limit", "3", "--quiet",
                     "--report", str(report)]) == 0
    tasks = json.loads(report.read_text())["tasks"]
    assert set(tasks) == {"austen_continuation", "python_continuation"} and tasks["python_continuation"]["n"] == 3
    pruned = tmp_path / "pruned.json"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4",
                     "--output", str(tmp_path / "out"), "--sparse-layers", "--tasks", TASK, "--limit", "2",
                     "--quiet", "--report", str(pruned)]) == 0
    saved = json.loads((tmp_path / "out" / "pyprune.json").read_text())
    assert json.loads(pruned.read_text())["tasks"][TASK]["n"] == 2
    assert "austen_continuation: acc" in capsys.readouterr().out
    assert len(saved["sparse_layers"]) == 14  # the evaluated model was saved with its SparseLinear layers


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "austen_continuation", "--limit", "0"], "--limit must be >= 1"),
    (["--limit", "3"], "--limit needs --tasks"),
    (["--tasks", "austen_continuation,,python_continuation"], "--tasks"),
    (["--tasks", "austen_continuation", "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_cli_checks_before_the_model_loads(tiny_model_dir, capsys, argv, message):
    """The flags are refused in one line, before the model loads."""
    model_dir, text = tiny_model_dir
    capsys.readouterr()
    assert cli.main(["eval", "--model", str(model_dir), "--data", str(text)] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_smollm2_is_well_above_chance(smollm2, tmp_path):
    """40 Austen items: SmolLM2-135M picks the true next line far more often than 1 in 4."""
    model, tokenizer = smollm2
    tasks = zeroshot.load_tasks([TASK], task_dir=str(tmp_path))
    result = zeroshot.evaluate(model, tokenizer, tasks, limit=40, batch_size=8)[TASK]
    assert result["n"] == 40
    assert result["acc"] - 3 * result["stderr"]["acc"] > 0.25, result


def test_progress_false_hides_lm_evals_request_bars_and_scores_the_same(local_tasks, capsys):
    """``--quiet`` reaches lm-eval: no "Running loglikelihood requests" bar, the same results."""
    model, tokenizer = _tiny_llama(), _tokenizer()
    loud = zeroshot.evaluate(model, tokenizer, local_tasks, limit=LIMIT, batch_size=3)
    assert "Running loglikelihood requests" in capsys.readouterr().err
    quiet = zeroshot.evaluate(model, tokenizer, local_tasks, limit=LIMIT, batch_size=3, progress=False)
    assert "Running loglikelihood requests" not in capsys.readouterr().err
    assert quiet == loud
