"""Runs the authors' Wanda / SparseGPT (locuslab/wanda ``lib/``) for the ``crosscheck-wanda`` study (:mod:`pyprune.studies.crosscheck_wanda`).

Started by that study with the python of a separate virtual environment (transformers 4.36,
which the authors' code targets); pyprune imports it only for AUTHORS_FILES (the files the study
checks in the checkout and records by their sha256, :mod:`pyprune.studies.authors_code`). It imports only torch,
transformers and the authors' ``lib`` from the checkout named in the job, read-only.

    python _wanda_driver.py JOB.pt OUT.pt

JOB.pt (written by the study with torch.save) holds the checkout path, a model
directory, the expected ``rope_theta``, the calibration token ids [nsamples, seqlen], the
evaluation windows [windows, seqlen] and the runs. OUT.pt receives the environment, the dense
perplexity and, per run, the perplexity, the time and the nonzero mask of every pruned linear.

Three things are bridged without touching their code: ``lib.prune.get_loaders`` (which would
download C4) is replaced by the job's calibration ids; ``model.seqlen`` and an empty
``model.hf_device_map`` are set as their ``main.py`` would; and on a CPU-only torch
``torch.cuda.synchronize`` (called at the end of their SparseGPT ``fasterprune``) becomes a
no-op. Their own prints go to the job's log file.
"""
import contextlib
import copy
import platform
import sys
import time
import types

import torch

AUTHORS_FILES = ("lib/prune.py", "lib/sparsegpt.py", "lib/layerwrapper.py", "lib/eval.py")


def log(message):
    print(f"[authors' code] {message}", file=sys.stderr, flush=True)


def calibration_loader(calib):
    """What their ``get_loaders`` returns for calibration: a list of (input_ids [1, seqlen], target)."""
    def get_loaders(name, nsamples, seed, seqlen, tokenizer):
        if nsamples != calib.shape[0] or seqlen != calib.shape[1]:
            raise ValueError(f"the authors' code asked for {nsamples} x {seqlen} calibration tokens; "
                             f"the job has {tuple(calib.shape)}")
        return [(row[None, :].clone(), None) for row in calib], None
    return get_loaders


def load_model(job):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], torch_dtype=torch.float32,
                                                 local_files_only=True)
    if model.config.rope_theta != job["rope_theta"]:
        raise RuntimeError(f"transformers read rope_theta={model.config.rope_theta} from "
                           f"{job['model_dir']}, the model has {job['rope_theta']}")
    model.eval()
    model.seqlen = job["eval_windows"].shape[1]
    model.hf_device_map = {}  # their prepare_calibration_input reads it
    return model


def nonzero_masks(model, find_layers):
    return {f"model.layers.{index}.{name}": linear.weight.detach() != 0
            for index, layer in enumerate(model.model.layers)
            for name, linear in find_layers(layer).items()}


def main(job_path, output_path):
    job = torch.load(job_path)
    sys.path.insert(0, job["wanda_repo"])
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
    import transformers
    from lib import prune as authors
    from lib.eval import eval_ppl_wikitext

    authors.get_loaders = calibration_loader(job["calib"])
    cpu = torch.device("cpu")
    test_ids = types.SimpleNamespace(input_ids=job["eval_windows"].reshape(1, -1))
    dense = load_model(job)
    result = {
        "environment": {"python": platform.python_version(), "torch": str(torch.__version__),
                        "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads(),
                        "attention": dense.config._attn_implementation},
        "runs": {},
    }
    with open(job["log"], "a", encoding="utf-8", buffering=1) as authors_log, contextlib.redirect_stdout(authors_log):
        with torch.no_grad():
            result["dense_perplexity"] = eval_ppl_wikitext(dense, test_ids, 1, cpu)
        log(f"dense: perplexity {result['dense_perplexity']:.3f}")
        for run in job["runs"]:
            model = copy.deepcopy(dense)  # keeps seqlen and hf_device_map
            args = types.SimpleNamespace(nsamples=job["calib"].shape[0], seed=job["seed"],
                                         sparsity_ratio=run["sparsity"], use_variant=False)
            prune = {"wanda": authors.prune_wanda, "sparsegpt": authors.prune_sparsegpt}[run["method"]]
            start = time.perf_counter()
            prune(args, model, None, cpu, prune_n=run["n"], prune_m=run["m"])
            elapsed = time.perf_counter() - start
            with torch.no_grad():
                ppl = eval_ppl_wikitext(model, test_ids, 1, cpu)
            result["runs"][run["name"]] = {"perplexity": ppl, "time_s": elapsed,
                                           "masks": nonzero_masks(model, authors.find_layers)}
            log(f"{run['name']}: perplexity {ppl:.3f}, {elapsed:.1f} s")
            del model
    torch.save(result, output_path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB.pt OUT.pt")
    sys.exit(main(sys.argv[1], sys.argv[2]))
