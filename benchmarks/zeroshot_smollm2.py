"""Zero-shot accuracy and perplexity of SmolLM2-135M, dense and pruned: the README's zero-shot table.

Rows: dense, Wanda 50% unstructured, SparseGPT 2:4 (both calibrated on ``--nsamples`` x
``--seqlen`` random windows of Emma, as the baselines table) and LLM-Pruner's Taylor at a 20% ratio
with the first 3 and the last layer dense (the same calibration). Each row: perplexity on
the first ``--eval-tokens`` tokens of Pride and Prejudice in ``--seqlen`` windows, and lm-eval's
acc / acc_norm on the first ``--items`` items of each local task (pyprune.evaluation.zeroshot: the held-out
Austen, Moby Dick and Python texts). Every row is a report in ``pyprune prune --report``'s
format; the table and the figure come from :mod:`pyprune.studies.compare`. Results:
benchmarks/results/zeroshot-smollm2-135m.{json,md,png,svg}, rewritten atomically after every row;
a rerun with the same settings skips the rows already there.

    python benchmarks/zeroshot_smollm2.py                  # 300 items per task
    python benchmarks/zeroshot_smollm2.py --items 100 --threads 1
"""
import argparse
import copy
import os
import sys
import time

import torch

from _common import environment, previous_result, write_atomic, write_json
import pyprune
from pyprune.studies import compare
from pyprune.inputs import data
from pyprune.evaluation import zeroshot
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs.models import load_model
from pyprune.patterns import NM, Structured, Unstructured

RUNS = [  # (method, pattern, method options)
    ("wanda", Unstructured(0.5), {}),
    ("sparsegpt", NM(2, 4), {}),
    ("taylor", Structured(0.2), {"first_layer": 3, "last_layer": -2}),
]
TASKS = list(zeroshot.LOCAL_TASKS)
EVAL_SOURCE, CALIB_SOURCE = "pride_and_prejudice", "emma"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=300, help="items per task (the first N)")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                         "zeroshot-smollm2-135m.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = {"model": "smollm2-135m", "tasks": TASKS, "items": args.items,
                "context_lines": zeroshot.CONTEXT_LINES, "continuation_lines": zeroshot.CONTINUATION_LINES,
                "choices": zeroshot.CHOICES, "num_fewshot": 0, "calib": CALIB_SOURCE, "nsamples": args.nsamples,
                "seqlen": args.seqlen, "eval": EVAL_SOURCE, "eval_tokens": args.eval_tokens,
                "runs": [[m, str(p), o] for m, p, o in RUNS]}
    result = previous_result(args.output, settings) or {"settings": settings, "rows": []}
    result["environment"] = environment(torch.device("cpu"))
    done = {(row["method"], row["pattern"]) for row in result["rows"]}
    if done:
        print(f"resuming: {len(done)} row(s) already in {args.output}", flush=True)

    tasks = zeroshot.load_tasks(TASKS)
    dense_model, tokenizer = load_model("smollm2-135m")
    settings_note = context_note(tokenizer, args.items)
    result["context"] = settings_note
    calib = data.calibration_samples(tokenizer, CALIB_SOURCE, nsamples=args.nsamples, seqlen=args.seqlen, seed=0)
    tokens = data.eval_tokens(tokenizer, EVAL_SOURCE, max_tokens=args.eval_tokens)

    def measure(model, report):
        ppl = perplexity(model, tokens, args.seqlen, progress=False)
        report["eval"] = [{"data": EVAL_SOURCE, "perplexity": round(ppl, 4),
                           "tokens": tokens.numel() // args.seqlen * args.seqlen, "seqlen": args.seqlen}]
        start = time.perf_counter()
        report["tasks"] = zeroshot.evaluate(model, tokenizer, tasks, limit=args.items, batch_size=args.batch_size)
        report["zeroshot_time_s"] = round(time.perf_counter() - start, 1)
        result["rows"].append(report)
        write_results(args.output, result)
        accs = ", ".join(f"{name} {r['acc']:.3f}" for name, r in report["tasks"].items())
        print(f"{report['method']} {report['pattern']}: perplexity {ppl:.2f}; acc {accs} "
              f"({report['zeroshot_time_s']} s)", flush=True)

    if ("dense", "-") not in done:
        measure(dense_model, {"method": "dense", "pattern": "-", "sparsity": 0.0})
    for method, pattern, options in RUNS:
        if (method, str(pattern)) in done:
            continue
        model = copy.deepcopy(dense_model)
        report = pyprune.prune(model, method, pattern, calib, progress=False, **options)
        report.pop("layers", None)
        measure(model, report)
        del model
    return 0


def context_note(tokenizer, items):
    """Mean context and candidate lengths in SmolLM2 tokens over the items evaluated."""
    note = {}
    for name, source in zeroshot.LOCAL_TASKS.items():
        built = zeroshot.build_items(data.load_text(source))[:items]
        context = sum(len(tokenizer(i["context"])["input_ids"]) for i in built) / len(built)
        choice = sum(len(tokenizer("\n" + c)["input_ids"]) for i in built for c in i["choices"]) / (4 * len(built))
        note[name] = {"context_tokens": round(context, 1), "choice_tokens": round(choice, 1)}
    return note


def write_results(path, result):
    """JSON, the markdown table and the figure (pyprune.studies.compare), each written atomically."""
    write_json(path, result)
    settings = result["settings"]
    stem = os.path.splitext(path)[0]
    context = "; ".join(f"{name} {c['context_tokens']:.0f} + {c['choice_tokens']:.0f}"
                        for name, c in result["context"].items())
    header = (f"SmolLM2-135M, zero-shot, lm-eval {lm_eval_version()}: the first {settings['items']} items of each "
              f"local task ({settings['context_lines']} lines of context, {settings['choices']} candidate "
              f"continuations of {settings['continuation_lines']} line; mean context + candidate tokens: {context}); "
              f"`acc` ranks candidates by summed log-likelihood, `acc_norm` by log-likelihood per character "
              f"(chance 0.25); ± is lm-eval's standard error. Perplexity: first {settings['eval_tokens']} tokens "
              f"of {settings['eval']} in {settings['seqlen']}-token windows. Calibration: {settings['nsamples']} x "
              f"{settings['seqlen']} tokens of {settings['calib']} for every method (Taylor with the first 3 and "
              f"the last layer dense).\n\n")
    table_rows = compare.rows(result["rows"])
    write_atomic(f"{stem}.md", header + compare.markdown_table(table_rows))
    compare.plot(table_rows, stem, title="SmolLM2-135M: perplexity and zero-shot accuracy vs sparsity")


def lm_eval_version():
    import lm_eval
    return lm_eval.__version__


if __name__ == "__main__":
    sys.exit(main())
