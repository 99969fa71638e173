"""The subcommands by name: the module that implements each (imported only when the command runs,
so ``pyprune --help`` and a mistyped command are answered without importing torch) and the summary
that ``pyprune --help`` lists."""

#: command -> its module in pyprune.cli (with ``COMMAND``, ``register(subparsers, method)``, ``run(args)``)
MODULES = {
    "prune": "prune",
    "run": "run",
    "eval": "evaluate",
    "compare": "compare",
    "recover": "recover",
    "robustness": "robustness",
    "continual": "continual",
    "study": "study",
    "generate": "generate",
    "tune": "tune",
    "demo": "demo",
}

#: command -> one-line summary
SUMMARIES = {
    "prune": 'prune a model with one method and pattern',
    "run": 'run a recipe: a YAML file of model, calibration, stages, evaluation, output (docs/recipes.md)',
    "eval": 'perplexity of a model on texts, zero-shot accuracy on tasks',
    "compare": 'reports of prune/eval runs -> one markdown table and a figure',
    "recover": 'LoRA recovery fine-tuning (RFT) of a pruned model, merged back into dense weights',
    "robustness": 'prune in bf16 and in fp16 and compare (MoreauPruner Table 1)',
    "continual": 'continual pruning over a sequence of datasets with backward transfer (COPAL)',
    "study": 'run a declared study (robustness, continual, cross-checks...) into its results files, resuming',
    "generate": 'greedy text from a model, with prefill time and decode tokens/s',
    "tune": "measure sparse kernel vs dense for a model's N:M layer shapes on this CPU and cache the answers",
    "demo": 'Wanda 2:4 on SmolLM2-135M with Austen text',
}
