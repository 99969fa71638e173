"""Data-parallel pruning (pyprune.runtime.distributed): 2 gloo ranks on localhost give the masks and
weights of one process (unstructured and N:M masks, SparseGPT's and ALPS's updated weights, Taylor's and
MoreauPruner's kept heads and channels), on tiny models of three families (one MoE) and on SmolLM2-135M;
without the reductions they do not; a rank that raises ends both with one line naming it, under torchrun
too; the commands (eval, recover, continual, run) under a group report and write what one process does."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_decoder

FAMILIES = ("llama", "gemma3", "qwen2_moe")
MOE = ("qwen2_moe",)
#: (name, method, pattern, options); every one prunes a fresh copy of each family's model
CASES = [
    ("magnitude-owl", "magnitude", 0.5, {"owl": True, "owl_lambda": 0.1}),
    ("wanda", "wanda", "2:4", {}),
    ("wanda-owl", "wanda", 0.6, {"owl": True, "owl_lambda": 0.1}),
    ("sparsegpt", "sparsegpt", 0.5, {"blocksize": 16}),
    ("sparsegpt-2:4", "sparsegpt", "2:4", {"blocksize": 16}),
    ("alps", "alps", 0.5, {"admm_iterations": 30, "min_iterations": 10, "pcg_iterations": 5}),
    ("taylor", "taylor", Structured(0.25), {}),  # heads and channels of the dense families
    ("moreau", "moreau", Structured(0.25), {"steps": 3}),
    ("sleb", "sleb", Structured(0.5), {"early_barrier": 0, "latter_barrier": 0}),  # removes one of two blocks
    ("slicegpt", "slicegpt", Structured(0.25), {}),
    ("copal", "copal", 0.5, {}),  # its sums of the sensitivity increments, float64 like the Hessians
]
#: training, one process at two seeds and two ranks at the first: block training, DReSS's regularisation
TRAINING = [(f"{name}-seed{seed}", method, pattern, dict(options, train_seed=seed))
            for name, method, pattern, options in [
                ("masked-recon", "masked-recon", "2:4", {"start": "sparsegpt", "epochs": 1}),
                ("safe+", "safe+", 0.5, {"dual_interval": 2, "epochs": 1}),
                ("dress", "dress", Structured(0.25), {"steps": 4})]
            for seed in (0, 1)]
#: cases that run on some families only (structured ones: on the dense families)
ONLY = {"slicegpt": ("llama",),  # SliceGPT rotates two-norm RMS-norm blocks
        **{case: ("llama",) for case, *_ in TRAINING}}
#: cases whose result is equal up to rounding, not to the bit: SliceGPT's eigenvectors of summed Gram matrices
APPROX = ("slicegpt",)
BATCH = 2
CALIB = dict(shape=(8, 16), vocab=128, seed=3)  # 4 batches of 2: two per rank


def _model(family):
    """A fresh model of ``family``: a tiny random one, the real SmolLM2-135M ("smollm2"), or its first N
    decoder blocks alone ("smollm2:N", where the layer solves of all 30 would cost minutes)."""
    if family.startswith("smollm2"):
        from pyprune.inputs.models import load_model
        from pyprune.nn.anatomy import decoder_blocks
        model = load_model("smollm2-135m")[0]
        _, _, blocks = family.partition(":")
        if blocks:
            del decoder_blocks(model)[int(blocks):]
            model.config.num_hidden_layers = int(blocks)
        return model
    return tiny_decoder(family, layers=2)


def _linear_weights(model):
    """{block.linear: a copy of its weight} of every decoder block."""
    from pyprune.nn.anatomy import block_linears, decoder_blocks
    from pyprune.nn.experts import expert_linears
    weights = {}
    for index, block in enumerate(decoder_blocks(model)):
        with expert_linears(block):
            weights.update({f"{index}.{name}": linear.weight.detach().clone()
                            for name, linear in block_linears(block).items()})
    return weights


def _prune_all(cases, families=FAMILIES, only=None):
    """{family/case: {linear name: weight}} of every case on every family (or on the families ``only``
    names for it, default :data:`ONLY`), in this process."""
    import pyprune
    calib = random_tokens(**CALIB)
    only = ONLY if only is None else only
    results = {}
    for family in families:
        for case, method, pattern, options in cases:
            if (isinstance(pattern, Structured) and family in MOE) or family not in only.get(case, families):
                continue
            model = _model(family)
            report = pyprune.prune(model, method, pattern, calib, batch_size=BATCH, progress=False, **options)
            results[f"{family}/{case}"] = (_linear_weights(model), report.get("owl"),
                                           report.get("admm", {}).get("layers"),
                                           report.get("pruned_channels"))
    return results


def _worker(rank, world, rendezvous, out, cases, mode, families, only):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        from pyprune.runtime import distributed
        from pyprune.methods.sparsegpt import SparseGPT
        solves, solve = [], SparseGPT.prune_layer
        SparseGPT.prune_layer = lambda self, linear, *args: solves.append(1) or solve(self, linear, *args)
        if mode == "unreduced":  # each rank prunes from its own shard's statistics
            distributed.all_reduce_ = lambda tensor: tensor
        if mode == "raise":
            from pyprune.methods.wanda import Wanda
            prune_layer = Wanda.prune_layer

            def failing(self, linear, stats, pattern):
                if distributed.rank() == 1 and linear.out_features == 128:  # block 1's up_proj (see below)
                    raise ValueError("injected\nsecond line")
                return prune_layer(self, linear, stats, pattern)
            Wanda.prune_layer = failing
        try:
            result = dict(_prune_all(cases, families, only), solves=len(solves))
        except Exception as error:  # noqa: BLE001 (the test reads what each rank raised)
            result = f"{type(error).__name__}: {error}"
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path, cases, mode="reduced", world=2, families=FAMILIES, only=None):
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path), cases, mode, families, only),
             nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def one_process():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels, the same rounding
    try:
        return _prune_all(CASES + TRAINING)
    finally:
        torch.set_num_threads(before)


def _differing(result, reference):
    """Names of the layers whose weights differ (masks or values) between two runs."""
    def same(key, got, expected):
        if key.split("/")[1] in APPROX:
            return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
        return torch.equal(got, expected)

    return [f"{key}:{name}" for key, (weights, *_) in reference.items() for name, weight in weights.items()
            if name not in result[key][0] or not same(key, result[key][0][name], weight)]


def test_two_ranks_give_the_masks_and_weights_of_one_process(tmp_path, one_process):
    ranks = _run_ranks(tmp_path, CASES)
    expected = {key: value for key, value in one_process.items() if key.split("/")[1] in {case[0] for case in CASES}}
    for rank, result in enumerate(ranks):
        assert isinstance(result, dict), f"rank {rank}: {result}"
        assert _differing(result, expected) == [], f"rank {rank}"
        for key, (_, *details) in expected.items():
            assert result[key][1:] == tuple(details), key  # OWL's allocation; ALPS's report covers every layer
    # SparseGPT's layer solves were spread: each rank solved its share, none twice
    layers = sum(len(weights) for key, (weights, *_) in expected.items() if key.split("/")[1].startswith("sparsegpt"))
    solves = [result["solves"] for result in ranks]
    assert sum(solves) == layers and min(solves) > layers // 4, solves


def test_without_the_reductions_the_results_differ(tmp_path, one_process):
    """The checks here can fail: each rank pruning from its own shard's statistics (Wanda's norms, OWL's
    outlier ratios, Taylor's gradients, SliceGPT's Gram matrices) gives other masks, channels and rotations,
    and block training on its own shard's gradients lands outside the bound of the next test."""
    cases = [case for case in CASES if case[0] in ("wanda", "wanda-owl", "taylor", "slicegpt")]
    training = [case for case in TRAINING if case[0] in ("masked-recon-seed0", "safe+-seed0")]
    names = {case[0] for case in cases + training}
    for rank, result in enumerate(_run_ranks(tmp_path, cases + training, mode="unreduced")):
        assert set(result) - {"solves"} == {key for key in one_process if key.split("/")[1] in names}, rank
        for key in set(result) - {"solves"}:
            if key.endswith("seed0"):
                seed1 = one_process[key.replace("seed0", "seed1")][0]
                assert _distance(result[key][0], one_process[key][0]) >= 0.1 * _distance(seed1, one_process[key][0])
            else:
                assert _differing({key: result[key]}, {key: one_process[key]}), f"rank {rank} {key}"


def _distance(weights, others):
    return sum(float((weights[name] - others[name]).double().square().sum()) for name in weights) ** 0.5


def test_training_on_two_ranks_is_within_its_seed_to_seed_spread(tmp_path, one_process):
    """SAFE⁺ and masked reconstruction (from SparseGPT's solves, spread over the ranks) train each block,
    DReSS the whole model, on the gradients summed over the ranks: the weights of 2 ranks differ from one
    process's by less than one process's differ between two training seeds (the sums' rounding differs, not
    the data); DReSS removes the same hidden channels (its channel energies are summed over the ranks)."""
    [result, _] = _run_ranks(tmp_path, [case for case in TRAINING if case[0].endswith("seed0")])
    for method in ("masked-recon", "safe+", "dress"):
        seed0, seed1 = (one_process[f"llama/{method}-seed{seed}"][0] for seed in (0, 1))
        ranks = result[f"llama/{method}-seed0"][0]
        assert _distance(ranks, seed0) < 0.1 * _distance(seed1, seed0), method
    channels = result["llama/dress-seed0"][3]
    assert channels is not None and channels == one_process["llama/dress-seed0"][3]


#: the SmolLM2-135M cases and the model each runs on: Wanda's norms on all 30 blocks; SparseGPT's Hessians and
#: solves on the first four blocks, ALPS's on the first (on all 30 they would take minutes of CI) with a few
#: ADMM and PCG iterations (the claim is that 2 ranks give one process's result, not that it converged)
SMOLLM2_CASES = [case for case in CASES if case[0] in ("wanda", "wanda-owl", "sparsegpt-2:4")] + [
    ("alps-short", "alps", 0.5, {"admm_iterations": 4, "min_iterations": 4, "pcg_iterations": 2})]
SMOLLM2 = {"wanda": ("smollm2",), "wanda-owl": ("smollm2",), "sparsegpt-2:4": ("smollm2:4",),
           "alps-short": ("smollm2:1",)}


@pytest.mark.slow
def test_two_ranks_give_the_masks_and_weights_of_one_process_on_smollm2(tmp_path):
    families = tuple(sorted({family for names in SMOLLM2.values() for family in names}))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = _prune_all(SMOLLM2_CASES, families, SMOLLM2)
    finally:
        torch.set_num_threads(before)
    assert sorted(expected) == sorted(f"{family}/{case}" for case, names in SMOLLM2.items() for family in names)
    ranks = _run_ranks(tmp_path, SMOLLM2_CASES, families=families, only=SMOLLM2)
    for rank, result in enumerate(ranks):
        assert isinstance(result, dict), f"rank {rank}: {result}"
        assert _differing(result, expected) == [], f"rank {rank}"
        for key, (_, *details) in expected.items():
            assert result[key][1:] == tuple(details), key  # OWL's allocation; ALPS's report of every layer
    solves = [result["solves"] for result in ranks]  # SparseGPT's 4 × 7 layer solves, spread over the ranks
    assert sum(solves) == 4 * 7 and min(solves) > 0, solves


def test_a_rank_that_raises_ends_every_rank_with_one_line_naming_it(tmp_path):
    ranks = _run_ranks(tmp_path, [("wanda", "wanda", 0.5, {})], mode="raise")
    # tiny_decoder's llama: hidden 64, intermediate 128; block 0's up_proj fails first on rank 1
    assert ranks == ["RankFailed: rank 1 failed in block 0 (model.layers.0): ValueError: injected"] * 2


def test_shards_are_whole_batches_whose_union_is_the_calibration(tmp_path):
    ranks = _run_ranks_shards(tmp_path)
    tokens = torch.arange(7 * 3).reshape(7, 3)
    assert [r.shape[0] for r in ranks] == [4, 3]  # batches of 2: [0:2] [2:4] | [4:6] [6:7]
    assert torch.equal(torch.cat(ranks), tokens)


def _shard_worker(rank, world, rendezvous, out):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        from pyprune.runtime import distributed
        shard = distributed.shard(torch.arange(7 * 3).reshape(7, 3), batch_size=2)
        try:
            distributed.shard(torch.arange(3 * 3).reshape(3, 3), batch_size=4)
        except ValueError as error:
            assert "1 batches, fewer than the 2 ranks" in str(error)
        else:
            raise AssertionError("one batch for two ranks was accepted")
        torch.save(shard, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_ranks_shards(tmp_path):
    mp.spawn(_shard_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_owners_balance_the_solve_costs(monkeypatch):
    from pyprune.runtime import distributed
    assert distributed.owners([5.0, 1.0, 1.0]) == [0, 0, 0]  # one process solves everything
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    # q, k, v, o of cost 1, gate and up of cost 2, down of cost 4: 6 and 6
    assert distributed.owners([1, 1, 1, 1, 2, 2, 4]) == [0, 1, 0, 1, 1, 1, 0]


def test_copal_s_gaussian_perturbation_is_refused_in_a_group_before_anything_changes(monkeypatch):
    """Its per-token ΔX comes from one stream per layer in token order, which a rank cannot place itself in."""
    import pyprune
    from pyprune.runtime import distributed
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    model = tiny_decoder("llama", layers=2)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="copal' cannot run in a torch.distributed group of 2 ranks: its gaussian"):
        pyprune.prune(model, "copal", 0.5, random_tokens(**CALIB), progress=False, perturbation="gaussian")
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())


# -- the command line under torchrun ------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]

#: ``pyprune prune`` whose rank 1 raises when it reaches block 1 (a torchrun script: argv as the CLI's)
_FAILING_PRUNE = """
import sys
from pyprune.methods.base import LayerwiseMaskMethod
from pyprune.runtime import distributed
prepare = LayerwiseMaskMethod.prepare_block
def failing(self, ctx):
    if distributed.rank() == 1 and ctx.index == 1:
        raise ValueError("injected")
    prepare(self, ctx)
LayerwiseMaskMethod.prepare_block = failing
from pyprune.cli import main
sys.exit(main())
"""


def _prune_args(model_dir, text, output, checkpoint):
    return ["prune", "--model", str(model_dir), "--method", "sparsegpt", "--pattern", "2:4", "--calib", str(text),
            "--nsamples", "8", "--seqlen", "16", "--batch-size", "2", "--threads", "1", "--quiet",
            "--output", str(output), "--checkpoint", str(checkpoint)]


def _torchrun(*command):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _saved(directory):
    from safetensors.torch import load_file
    return {name: tensor for path in sorted(Path(directory).glob("*.safetensors")) for name, tensor in
            load_file(path).items()}


def test_torchrun_fails_in_one_line_writes_nothing_and_resumes_to_the_one_process_model(tiny_model_dir, tmp_path):
    from pyprune.cli import main
    model_dir, text = tiny_model_dir
    before = torch.get_num_threads()
    try:
        assert main(_prune_args(model_dir, text, tmp_path / "one", tmp_path / "one-checkpoint")) == 0
    finally:
        torch.set_num_threads(before)
    script = tmp_path / "failing_prune.py"
    script.write_text(_FAILING_PRUNE)
    args = _prune_args(model_dir, text, tmp_path / "two", tmp_path / "checkpoint")

    failed = _torchrun(str(script), *args)
    assert failed.returncode != 0
    ours = [line for line in failed.stderr.splitlines() if line.startswith("pyprune prune:")]
    assert ours == ["pyprune prune: error: rank 1 failed in block 1 (model.layers.1): ValueError: injected"], \
        failed.stderr[-3000:]
    assert not (tmp_path / "two").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["block-0.safetensors", "blockwise.json"]

    resumed = _torchrun("-m", "pyprune", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    one, two = _saved(tmp_path / "one"), _saved(tmp_path / "two")
    assert one.keys() == two.keys() and all(torch.equal(one[name], two[name]) for name in one)


def _killed_worker(rank, world, rendezvous, out):
    import datetime
    import signal
    import time
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=KILL_TIMEOUT_S))
    from pyprune.methods.wanda import Wanda
    from pyprune.runtime import distributed
    prune_layer = Wanda.prune_layer

    def dying(self, linear, stats, pattern):
        if distributed.rank() == 1:
            torch.save(time.time(), os.path.join(out, "killed.pt"))
            os.kill(os.getpid(), signal.SIGKILL)
        return prune_layer(self, linear, stats, pattern)
    Wanda.prune_layer = dying
    try:
        _prune_all([("wanda", "wanda", 0.5, {})])
        result = "finished"
    except Exception as error:  # noqa: BLE001 (the test reads what rank 0 raised)
        result = f"{type(error).__name__}: {error}"
    torch.save((result, time.time()), os.path.join(out, f"rank{rank}.pt"))


KILL_TIMEOUT_S = 30


def test_when_a_rank_is_killed_the_other_stops_within_the_timeout(tmp_path):
    context = mp.start_processes(_killed_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2,
                                 join=False)
    for process in context.processes:
        process.join(timeout=KILL_TIMEOUT_S + 60)
    assert [process.exitcode for process in context.processes] == [0, -9]  # rank 0 caught its error and wrote it
    result, ended = torch.load(tmp_path / "rank0.pt")
    assert result.startswith("RankFailed: rank 0 failed in block 0 (model.layers.0): "), result
    assert "\n" not in result and ended - torch.load(tmp_path / "killed.pt") < KILL_TIMEOUT_S


# -- eval, recover and continual in a process group ---------------------------------------------------------------

def _command_argvs(model_dir, text, lines, other, out):
    """argv of ``pyprune eval``, ``recover`` (LoRA) and ``continual`` (COPAL) on the tiny model, writing under ``out``."""
    common = ["--model", str(model_dir), "--threads", "1", "--quiet"]
    return {
        "eval": ["eval", *common, "--data", str(text), "--seqlen", "16", "--batch-size", "2",
                 "--report", str(out / "eval.json")],
        "recover": ["recover", *common, "--calib", str(text), "--nsamples", "8", "--seqlen", "16", "--steps", "3",
                    "--lr", "1e-3", "--batch-size", "4", "--eval", str(text), "--eval-seqlen", "16",
                    "--output", str(out / "recovered"), "--report", str(out / "recover.json")],
        "continual": ["continual", *common, "--method", "copal", "--pattern", "2:4", "--datasets", str(lines), str(other),
                      "--nsamples", "4", "--seqlen", "16", "--batch-size", "2", "--eval-seqlen", "16",
                      "--report", str(out / "continual.json")],
    }


def _commands_worker(rank, world, rendezvous, argvs):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        from pyprune.cli import main
        for name, argv in argvs.items():
            assert main(argv) == 0, f"rank {rank}: pyprune {name} failed"
    finally:
        dist.destroy_process_group()


def test_eval_recover_and_continual_on_two_ranks_report_what_one_process_does(tiny_model_dir, tmp_path):
    """Each command joins the group it runs in: perplexity's windows, LoRA's minibatches and COPAL's
    calibration are sharded and summed over the ranks; rank 0 alone writes the reports and the model."""
    import json
    from pyprune.cli import main
    model_dir, text = tiny_model_dir
    from tests.helpers import WORDS
    lines, other = tmp_path / "lines.txt", tmp_path / "other.txt"  # continual evaluates each text's second half
    lines.write_text("\n".join(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(10)) for i in range(60)))
    other.write_text("\n".join(["house woman truth wife ."] * 150))
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    before = torch.get_num_threads()
    try:
        for argv in _command_argvs(model_dir, text, lines, other, one).values():
            assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    mp.spawn(_commands_worker, args=(2, str(tmp_path / "rendezvous"), _command_argvs(model_dir, text, lines, other, two)),
             nprocs=2)

    def read(directory, name):
        return json.loads((directory / name).read_text())
    assert read(two, "eval.json")["eval"] == read(one, "eval.json")["eval"]  # the same perplexity, to 4 decimals
    recovered = [read(d, "recover.json") for d in (one, two)]
    assert recovered[1]["recovery"]["losses"] == pytest.approx(recovered[0]["recovery"]["losses"], rel=1e-5)
    assert [e["perplexity"] for e in recovered[1]["eval_after"]] == pytest.approx(
        [e["perplexity"] for e in recovered[0]["eval_after"]], rel=1e-4)
    weights = [_saved(d / "recovered") for d in (one, two)]
    assert weights[0].keys() == weights[1].keys()
    changed = [name for name in weights[0] if not torch.equal(weights[0][name], _saved(model_dir)[name])]
    assert changed and all(torch.allclose(weights[1][n], weights[0][n], rtol=1e-4, atol=1e-6) for n in weights[0])
    continual = [read(d, "continual.json") for d in (one, two)]
    assert continual[1]["matrix"] == continual[0]["matrix"] and continual[1]["a_ppl"] == continual[0]["a_ppl"]


# -- pyprune run under torchrun -----------------------------------------------------------------------------------

#: ``pyprune run`` with each rank in its own working directory (``rank<RANK>`` beside this script), so what a
#: rank writes to a relative path lands in its own directory (a torchrun script: argv as the CLI's)
_RUN_IN_RANK_DIRECTORY = """
import os
import sys
os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank" + os.environ["RANK"]))
from pyprune.cli import main
sys.exit(main())
"""


def test_pyprune_run_on_two_ranks_gives_the_one_process_model_and_only_rank_0_writes(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """``pyprune run`` joins the torchrun group as ``prune`` does: Wanda 50 % (its norms summed over the
    ranks) gives the same masks, the LoRA stage (gradients summed, as ``recover``) the same losses and
    merged weights within the recover test's bounds, the evaluation the same perplexity; rank 0 alone
    writes the model and the report (the recipe's output path is relative to each rank's directory)."""
    import json
    import yaml
    from pyprune.cli import main
    model_dir, text = tiny_model_dir
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(model_dir), "batch_size": 2,
        "calibration": {"data": str(text), "nsamples": 8, "seqlen": 16},
        "stages": [{"method": "wanda", "sparsity": 0.5},
                   {"method": "lora", "options": {"steps": 2, "rank": 4, "lr": 1e-3, "batch_size": 4},
                    "calibration": {"nsamples": 8, "seqlen": 16}}],
        "evaluation": {"data": [str(text)], "seqlen": 16},
        "output": {"path": "model"}}))
    common = ["--report", "run.json", "--threads", "1", "--quiet"]
    one = tmp_path / "one"
    one.mkdir()
    monkeypatch.chdir(one)  # the recipe writes "model" and the report "run.json" here
    before = torch.get_num_threads()
    try:
        assert main(["run", str(recipe), *common]) == 0
    finally:
        torch.set_num_threads(before)
    script = tmp_path / "run_in_rank_directory.py"
    script.write_text(_RUN_IN_RANK_DIRECTORY)
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()

    done = _torchrun(str(script), "run", str(recipe), *common)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["model", "run.json"]
    assert list((tmp_path / "rank1").iterdir()) == []  # rank 1 ran every stage and wrote nothing
    reports = [json.loads((directory / "run.json").read_text()) for directory in (one, tmp_path / "rank0")]
    assert [stage["method"] for stage in reports[1]["stages"]] == ["wanda", "lora"]
    assert reports[1]["recovery"]["losses"] == pytest.approx(reports[0]["recovery"]["losses"], rel=1e-5)
    assert [e["perplexity"] for e in reports[1]["eval"]] == pytest.approx(
        [e["perplexity"] for e in reports[0]["eval"]], rel=1e-4)
    weights = [_saved(directory / "model") for directory in (one, tmp_path / "rank0")]
    assert weights[0].keys() == weights[1].keys()
    masked = [name for name in weights[0] if not bool(weights[0][name].all())]
    assert len(masked) == 2 * 7  # every linear of the tiny model's two blocks: Wanda's masks, LoRA merged under them
    assert all(torch.equal(weights[1][name] == 0, weights[0][name] == 0) for name in weights[0])
    assert all(torch.allclose(weights[1][n], weights[0][n], rtol=1e-4, atol=1e-6) for n in weights[0])


# -- block training sharded over the ranks (shard_training, FSDP2) ------------------------------------------------

#: block training on 2 ranks, data-parallel and sharded: masked reconstruction (from Wanda's masks), and SAFE⁺ as
#: :data:`TRAINING` runs it (whose two seeds measure its seed-to-seed spread)
SHARDED = [(name, method, pattern, dict(options, shard_training=sharded))
           for name, method, pattern, options in [
               ("masked-recon", "masked-recon", 0.5, {"epochs": 1}),
               ("safe+", "safe+", 0.5, {"dual_interval": 2, "epochs": 1, "train_seed": 0})]
           for sharded in (False, True)]


def _state_numel(optimizer):
    """The elements of an optimiser's state tensors on this rank (its shards' when sharded)."""
    from pyprune.runtime import distributed
    return sum(distributed.local(value).numel() for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor) and value.dim())


#: DReSS's regularisation on 2 ranks, data-parallel and sharded: as :data:`TRAINING` runs it (its penalty inside
#: AdamW), and with the proximal step after each step followed by LoRA recovery
SHARDED_DRESS = [(f"dress-{regulariser}", dict(options, regulariser=regulariser, shard_training=sharded))
                 for regulariser, options in [("penalty", {}), ("proximal", {"lora_steps": 2, "lora_rank": 4})]
                 for sharded in (False, True)]


def _sharded_worker(rank, world, rendezvous, out):
    """Each case of :data:`SHARDED` on the tiny Llama, then LoRA recovery unsharded and sharded, then each of
    :data:`SHARDED_DRESS`; the weights, and the numel of the optimisers' state on this rank (every block's, or
    LoRA's one, or DReSS's regularisation's and its LoRA's), per case; DReSS's all parameters, logged penalties
    and removed channels too."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        from pyprune.methods.reconstruction import BlockTraining
        from pyprune.runtime import recovery
        states, train, adamw = [], BlockTraining.train, torch.optim.AdamW

        def counting(self, *args, **kwargs):
            losses, optimizer = train(self, *args, **kwargs)
            states.append(_state_numel(optimizer))
            return losses, optimizer

        class Counting(adamw):
            def step(self, closure=None):
                result = super().step(closure)
                if not hasattr(self, "slot"):  # each optimiser's entry, after its last step: its state
                    self.slot = len(states)
                    states.append(0)
                states[self.slot] = _state_numel(self)
                return result
        BlockTraining.train, torch.optim.AdamW = counting, Counting
        results = {}
        for case in SHARDED:
            states.clear()
            weights = _prune_all([case], ("llama",), {})["llama/" + case[0]][0]
            results[f"{case[0]}-{case[3]['shard_training']}"] = (weights, list(states))
        for sharded in (False, True):
            states.clear()
            model = tiny_decoder("llama", layers=2)
            report = recovery.lora_finetune(model, random_tokens(**CALIB), steps=3, rank=4, lr=1e-3, batch_size=4,
                                            progress=False, shard_training=sharded)
            results[f"lora-{sharded}"] = ({name: p.detach().clone() for name, p in model.named_parameters()},
                                          list(states), report["losses"])
        import pyprune
        for name, options in SHARDED_DRESS:
            states.clear()
            model = tiny_decoder("llama", layers=2)
            report = pyprune.prune(model, "dress", Structured(0.25), random_tokens(**CALIB), batch_size=BATCH,
                                   progress=False, steps=4, train_seed=0, **options)
            results[f"{name}-{options['shard_training']}"] = (
                _linear_weights(model), list(states), report["regularisation"]["penalty"], report["pruned_channels"],
                {name: p.detach().clone() for name, p in model.named_parameters()})
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.optim.AdamW = adamw
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_ranks(tmp_path_factory):
    """What each rank of :func:`_sharded_worker` saved."""
    out = tmp_path_factory.mktemp("sharded")
    mp.spawn(_sharded_worker, args=(2, str(out / "rendezvous"), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_sharded_training_gives_the_data_parallel_weights_with_half_the_state_on_each_rank(sharded_ranks,
                                                                                           one_process):
    """``shard_training`` trains each block (or the LoRA-wrapped model) through FSDP2: each rank keeps the
    optimiser state of its half of every weight's rows (exactly half the state tensors' elements of the
    data-parallel run: the tiny model's dimensions and the LoRA rank are even), and the weights are the
    data-parallel run's. Masked reconstruction's and LoRA's (merged) are equal to the bit, with LoRA's
    losses: their gradients are the same sums of the two ranks' (a reduce-scatter instead of an all-reduce,
    a + b either way) and Adam acts on each entry alone. SAFE⁺'s SAM ascent divides by ‖∇f‖, which the
    sharded run sums from the two ranks' halves, so the step sizes differ by float32 rounding; Adam's
    normalised steps carry such differences into the next block's inputs, so its weights are held to the
    bound of the data-parallel test: closer to the data-parallel run's than a tenth of the distance
    between two training seeds."""
    ranks = sharded_ranks
    seed0, seed1 = (one_process[f"llama/safe+-seed{seed}"][0] for seed in (0, 1))
    for rank, result in enumerate(ranks):
        for method in ("masked-recon", "safe+"):
            (plain, plain_states), (sharded, sharded_states) = result[f"{method}-False"], result[f"{method}-True"]
            assert len(plain_states) == len(sharded_states) == 2 and min(plain_states) > 0, (rank, method)
            assert [2 * count for count in sharded_states] == plain_states, (rank, method)
            assert plain.keys() == sharded.keys() and len(plain) == 2 * 7
        plain, sharded = result["masked-recon-False"][0], result["masked-recon-True"][0]
        assert all(torch.equal(sharded[name], plain[name]) for name in plain), rank
        plain, sharded = result["safe+-False"][0], result["safe+-True"][0]
        assert _distance(sharded, plain) < 0.1 * _distance(seed1, seed0), rank
        assert sum(int((w == 0).sum()) for w in sharded.values()) == sum(int((w == 0).sum()) for w in plain.values())
        (plain, plain_states, plain_losses), (sharded, sharded_states, sharded_losses) = (
            result["lora-False"], result["lora-True"])
        assert len(plain_states) == 1 and plain_states[0] > 0 and [2 * sharded_states[0]] == plain_states, rank
        assert sharded_losses == plain_losses and len(plain_losses) == 3, rank
        assert plain.keys() == sharded.keys() and all(torch.equal(sharded[n], plain[n]) for n in plain), rank
    assert all(torch.equal(ranks[0][key][0][name], ranks[1][key][0][name]) for key in ranks[0]
               for name in ranks[0][key][0])  # both ranks hold the gathered weights


def test_shard_training_is_refused_in_one_process_before_anything_changes(tmp_path):
    """By a training method, DReSS (and with its checkpoint) and LoRA recovery, before the model is touched."""
    import pyprune
    model = tiny_decoder("llama", layers=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^option shard_training of method 'safe\+' shards a block's training over "
                                         r"the ranks of a torch.distributed group: run under torchrun "
                                         r"--nproc-per-node N with N >= 2 .*; got one process$"):
        pyprune.prune(model, "safe+", "2:4", random_tokens(**CALIB), batch_size=BATCH, shard_training=True)
    from pyprune.runtime import recovery
    with pytest.raises(ValueError, match=r"^setting shard_training of LoRA recovery shards its training over the "
                                         r"ranks of a torch.distributed group: .*; got one process$"):
        recovery.lora_finetune(model, random_tokens(**CALIB), steps=1, shard_training=True)
    with pytest.raises(ValueError, match=r"^option shard_training of method 'dress' shards its regularised training "
                                         r"over the ranks of a torch.distributed group: .*; got one process$"):
        pyprune.prune(model, "dress", Structured(0.25), random_tokens(**CALIB), batch_size=BATCH, shard_training=True)
    with pytest.raises(ValueError, match=r"^option shard_training of method 'dress' takes no checkpoint .*; got "
                                         r"checkpoint='.*'$"):
        pyprune.prune(model, "dress", Structured(0.25), random_tokens(**CALIB), batch_size=BATCH, shard_training=True,
                      checkpoint=str(tmp_path / "checkpoint"))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- the ranks' status exchange after the pre-load checks ---------------------------------------------------------

#: ``pyprune`` in the directory ``rank<RANK>`` beside this script, recording its exit status there as ``status``
_CHECKED_IN_RANK_DIRECTORY = """
import os
import sys
os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank" + os.environ["RANK"]))
from pyprune.cli import main
status = main()
with open("status", "w") as file:
    file.write(str(status))
sys.exit(status)
"""


def test_a_rank_that_fails_its_checks_ends_every_rank_at_once_in_one_line_before_anything_is_written(
        tiny_model_dir, tmp_path):
    """The calibration text exists in rank 0's working directory only: rank 1's check of --calib fails, and
    at the status exchange before the model loads both ranks end with the line naming rank 1 and its
    error, exit status 2, long before --dist-timeout, with no --output written."""
    import shutil
    import time
    model_dir, text = tiny_model_dir
    script = tmp_path / "checked_in_rank_directory.py"
    script.write_text(_CHECKED_IN_RANK_DIRECTORY)
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    shutil.copy(text, tmp_path / "rank0" / "calib.txt")
    timeout = 120
    started = time.monotonic()
    done = _torchrun(str(script), "prune", "--model", str(model_dir), "--method", "wanda", "--pattern", "2:4",
                     "--calib", "calib.txt", "--nsamples", "8", "--seqlen", "16", "--batch-size", "2", "--threads", "1",
                     "--quiet", "--output", "pruned", "--dist-timeout", str(timeout))
    assert time.monotonic() - started < timeout / 2
    ours = [line for line in done.stderr.splitlines() if line.startswith("pyprune prune:")]
    line = "pyprune prune: error: rank 1 failed its checks: source='calib.txt' is neither an existing .txt file"
    assert len(ours) == 1 and ours[0].startswith(line), done.stderr[-3000:]
    assert [(tmp_path / f"rank{rank}" / "status").read_text() for rank in (0, 1)] == ["2", "2"]
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["calib.txt", "status"]
    assert sorted(p.name for p in (tmp_path / "rank1").iterdir()) == ["status"]


def test_dress_sharded_removes_the_data_parallel_channels_with_its_penalties_and_half_the_state(sharded_ranks,
                                                                                               one_process):
    """DReSS's regularisation (and its LoRA recovery) with ``shard_training``: each rank holds half the
    optimiser state of the data-parallel run (the tiny Llama's dimensions are even); its group-lasso penalty
    (gradient or proximal step) acts on each channel's norm summed from the two ranks' rows, so it logs the
    data-parallel run's penalties (up to the rounding of those sums: within a relative 1e-7), removes the
    same channels, and its weights stay closer to the data-parallel run's than a tenth of the distance
    between two training seeds (the norms' float64 sums of two halves round unlike one float32 norm, and
    AdamW's normalised steps carry that on)."""
    seed0, seed1 = (one_process[f"llama/dress-seed{seed}"][0] for seed in (0, 1))
    for rank, result in enumerate(sharded_ranks):
        for name, _ in SHARDED_DRESS[::2]:
            plain, sharded = result[f"{name}-False"], result[f"{name}-True"]
            assert len(plain[1]) == len(sharded[1]) and min(plain[1]) > 0, (rank, name)
            assert [2 * count for count in sharded[1]] == plain[1], (rank, name)
            assert len(plain[2]) == len(sharded[2]) == 4, (rank, name)
            assert all(abs(got - logged) <= 1e-7 * logged for got, logged in zip(sharded[2], plain[2])), rank
            assert sharded[3] == plain[3] and len(plain[3]) == 16, (rank, name)
            assert plain[0].keys() == sharded[0].keys() and len(plain[0]) == 2 * 7
            assert _distance(sharded[0], plain[0]) < 0.1 * _distance(seed1, seed0), (rank, name)
            assert _distance(sharded[4], plain[4]) < 0.1 * _distance(seed1, seed0), (rank, name)
        assert len(result["dress-proximal-False"][1]) == 2  # the regularisation's AdamW and LoRA's
    for name in ("dress-penalty-True", "dress-proximal-True"):  # both ranks hold the gathered weights
        assert all(torch.equal(sharded_ranks[0][name][4][n], sharded_ranks[1][name][4][n])
                   for n in sharded_ranks[0][name][4])


#: (family, norm) of :func:`_dress_norms_worker`: Gemma's norms are shrunk on their effective scale 1 + w
DRESS_NORMS = [("llama", "l1"), ("gemma3", "l2")]


def _dress_norms_worker(rank, world, rendezvous, out):
    """DReSS's penalty gradient and proximal step on each of :data:`DRESS_NORMS`' gradients, whole and on
    the model's copy sharded by rows (each rank's loss half the same batch's, so FSDP's sum is the whole
    gradient): the whole gradients, totals and weights of both, per family and norm."""
    import contextlib
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        from pyprune.methods.dress import DReSS
        from pyprune.nn.anatomy import decoder_blocks
        from pyprune.runtime.training import sharded_copy
        channels, batch = torch.tensor([1, 5, 30, 33, 40, 63]), random_tokens(**CALIB)
        results = {}
        for family, norm in DRESS_NORMS:
            for sharded in (False, True):
                model = tiny_decoder(family, layers=2).train()
                slices = DReSS().penalised_slices(model)
                names = {id(p): name for name, p in model.named_parameters()}
                with sharded_copy(model, decoder_blocks(model), fp32=False) if sharded else \
                        contextlib.nullcontext(model) as trained:
                    (trained(input_ids=batch, labels=batch).loss * (0.5 if sharded else 1.0)).backward()
                    copied = dict(trained.named_parameters())
                    mine = [(name, copied[names[id(p)]], dim, offset) for name, p, dim, offset in slices]
                    total = DReSS.penalise_(mine, channels, 0.3, norm)
                    grads = {name: (p.grad.full_tensor() if sharded else p.grad).clone()
                             for name, p, _, _ in mine}
                    DReSS.proximal_step(mine, channels, 0.05, norm)
                results[f"{family}-{norm}-{sharded}"] = (total, grads, {
                    name: p.detach().clone() for name, p in model.named_parameters()})
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_dress_penalty_and_proximal_step_on_rows_sharded_over_the_ranks_act_on_the_whole_channels(tmp_path):
    """On rows sharded over 2 ranks, DReSS's penalty (ℓ1 on Llama, ℓ2 on Gemma 3) adds the whole model's
    gradient and its proximal step gives the whole model's weights, with channels in both ranks' rows of the
    writers and norms and in every rank's rows of the readers' columns (Gemma's norms shrunk on 1 + w): each
    channel's norm is summed over the ranks. Without that sum (each rank its own rows' norms) the totals, and
    ℓ2's gradients and shrinks, differ."""
    mp.spawn(_dress_norms_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for family, norm in DRESS_NORMS:
            (total, grads, weights), (got, sharded_grads, sharded_weights) = (
                result[f"{family}-{norm}-{sharded}"] for sharded in (False, True))
            assert abs(got - total) <= 1e-6 * total, (rank, family, norm)
            assert grads.keys() == sharded_grads.keys() and len(grads) >= 2 * 7 + 2
            assert all(torch.allclose(sharded_grads[n], grads[n], rtol=1e-5, atol=1e-7) for n in grads), \
                (rank, family, norm)
            assert all(torch.allclose(sharded_weights[n], weights[n], rtol=1e-5, atol=1e-7) for n in weights), \
                (rank, family, norm)
            dense = tiny_decoder(family, layers=2).state_dict()
            assert any(not torch.equal(weights[n], dense[n]) for n in weights)  # the step moved weights
