"""End to end: prefill latency and decode speed of an N:M-pruned model (2:4, 4:8), sparse vs dense.

Both models hold the same pruned weights (magnitude N:M on every decoder linear: the pattern, not
the mask's quality, sets the speed); the sparse one has its pruned linears replaced by SparseLinear
(``pyprune.nn.sparsify_``, implementation ``--implementation``, by default from this environment's measurements,
see pyprune.nn.dispatch). ``--sparse-where faster`` (the default, as ``pyprune generate``) converts
only the linears this environment measured faster sparse at one token; ``all`` every N:M linear.

A case (model, pattern, where) has four benchmarks, grouped by the case: ``prefill`` (one forward
over the prefill tokens, no KV cache) and ``decode`` (the new tokens after the first, one forward
each with the KV cache, after an 8-token prompt that is not timed: pyprune.runtime.decode, as
``pyprune generate``), each for the ``dense`` and the ``sparse`` model. Before any is timed, the
sparse model's logits must be about as close to the same model in fp32 as the dense model's: its largest
error against them, relative to their largest |logit|, may pass the dense model's by TOLERANCE of the dtype
(in fp32 the dense model is that model, so the sparse one must lie within TOLERANCE of it; in bf16 the dense
GEMM's own error on a deep pruned model can pass 0.1). Recorded with every benchmark: the model, dtype,
pattern, where, the sparse layers and their decode / prefill backends and where those came from (cache, prior, measured,
fallback), what tuning on first use measured, the top-1 agreement, whether greedy decoding made the
same tokens, the side's weight memory (with any dense copy a SparseLinear keeps for its dense
fallback) and the load average. ``benchmarks/report.py`` turns a run into ``e2e-<device>.{json,md}``.

    pytest benchmarks/test_e2e.py --benchmark-only --size full --benchmark-json run.json
    pytest benchmarks/test_e2e.py --benchmark-only --size full --models smollm2-135m-shape --layers 8
"""
import copy
import functools
from collections import Counter
from typing import NamedTuple

import pytest
import torch
from _common import build_model, default_device, load_average, prefill, synchronized

import pyprune
from pyprune.nn import SparseLinear, dispatch, sparsify_, tuning
from pyprune.runtime.decode import decode_steps, greedy_generate, prompt_step

#: Per size and device: models, decoder layers of the *-shape stand-ins, prefill tokens, new tokens and
#: dtype (options override each). Timed rounds: ``--benchmark-min-rounds`` (5 unless set), after a warm-up.
PRESETS = {
    "full": {"cuda": dict(models=["smollm2-135m", "llama-7b-shape"], layers=32, prefill=2048, decode=128,
                          dtype="bfloat16"),
             "cpu": dict(models=["smollm2-135m", "llama-7b-shape"], layers=2, prefill=128, decode=64,
                         dtype="float32")},
    "tiny": {device: dict(models=["tiny-llama-shape"], layers=1, prefill=16, decode=4, dtype="float32")
             for device in ("cuda", "cpu")},
}
PATTERNS = ["2:4", "4:8"]
PROMPT_TOKENS = 8
#: How far the sparse model's largest logit error may pass the dense model's, both against the model in fp32
#: and relative to its largest |logit|.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.1}


class Pair(NamedTuple):
    """A case's dense and sparse models, its prompts and what was found about it untimed."""
    models: dict
    long_prompt: torch.Tensor
    short_prompt: torch.Tensor
    record: dict
    max_rel_logit_error: float
    fp32_error: dict

    @property
    def excess_error(self) -> float:
        """How far the sparse model's logits are further from the fp32 model's than the dense model's."""
        return self.fp32_error["sparse"] - self.fp32_error["dense"]


def weight_bytes(model):
    """Bytes of parameters and buffers, plus the dense copies SparseLinear layers cached for a
    dense fallback (those are memory the sparse model really holds)."""
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    for module in model.modules():
        if isinstance(module, SparseLinear):
            total += sum(v.numel() * v.element_size() for _, v in module._cache.values()
                         if isinstance(v, torch.Tensor))
    return total


def agreeing_new_tokens(dense, sparse):
    """How many new tokens the sparse model generated before its first departure from the dense one."""
    differ = (dense[0] != sparse[0]).nonzero()
    return int(differ[0, 0]) if len(differ) else int(dense[0].numel())


@functools.lru_cache(maxsize=1)  # a case's models, kept while its four benchmarks run
def prepare(name, pattern, where, implementation, layers, prefill_tokens, decode, dtype, device):
    dense = build_model(name, layers, dtype, device)
    pyprune.prune(dense, "magnitude", pattern, progress=False)
    sparse = copy.deepcopy(dense)
    cost_before = dict(tuning.COST)
    replaced = sparsify_(sparse, pattern, implementation=implementation, faster_at=1 if where == "faster" else None)
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, dense.config.vocab_size, (1, prefill_tokens), generator=g).to(device)
    short_prompt = long_prompt[:, :PROMPT_TOKENS]
    with torch.no_grad():
        logits = {label: prefill(model, long_prompt).float() for label, model in (("dense", dense), ("sparse", sparse))}
        reference = logits["dense"] if dtype == torch.float32 else prefill(copy.deepcopy(dense).float(), long_prompt)
        layers_ = [m for m in sparse.modules() if isinstance(m, SparseLinear)]
        backends = {klass: sorted({m.choose_implementation(torch.zeros(tokens, m.in_features, dtype=dtype, device=device))
                                   for m in layers_})
                    for klass, tokens in (("decode", 1), ("prefill", prefill_tokens))}
    scale = reference.abs().max().item() or 1.0
    error = (logits["sparse"] - logits["dense"]).abs().max().item() / scale
    fp32_error = {label: (output - reference).abs().max().item() / scale for label, output in logits.items()}
    # where each converted layer's decode and prefill backends came from (pyprune.nn.dispatch.SOURCES),
    # counted and per layer, and what tuning on first use measured here (those answers then read back as "cache")
    buckets = ("1", dispatch.token_bucket(prefill_tokens))
    generated = {label: greedy_generate(model, short_prompt, decode).tokens
                 for label, model in (("dense", dense), ("sparse", sparse))}
    record = {
        "model": name, "dtype": str(dtype).replace("torch.", ""), "pattern": pattern, "sparse_where": where,
        "backend": implementation, "layers_of_stand_in": layers, "sparse_layers": len(replaced), "backends": backends,
        "decision_sources": {bucket: dict(Counter(m.decisions[bucket][1] for m in layers_ if bucket in m.decisions))
                             for bucket in buckets},
        "decisions": {layer: {bucket: list(m.decisions[bucket]) for bucket in buckets if bucket in m.decisions}
                      for layer, m in sparse.named_modules() if isinstance(m, SparseLinear)},
        "tuned_on_first_use": {"cases": tuning.COST["cases"] - cost_before["cases"],
                               "seconds": round(tuning.COST["seconds"] - cost_before["seconds"], 3)},
        "prefill_tokens": prefill_tokens, "new_tokens": decode,
        "top1_agreement_sparse_vs_dense": round(float((logits["dense"].argmax(-1) == logits["sparse"].argmax(-1))
                                                      .float().mean()), 4),
        "same_generated_tokens": bool(torch.equal(generated["dense"], generated["sparse"])),
        "same_new_tokens_before_divergence": agreeing_new_tokens(generated["dense"], generated["sparse"]),
        "weight_bytes": {"dense": weight_bytes(dense), "sparse": weight_bytes(sparse)},
    }
    return Pair({"dense": dense, "sparse": sparse}, long_prompt, short_prompt, record, error, fp32_error)


def extra_info(pair, phase, side, device):
    """What a benchmark of ``pair`` records beside its times."""
    return dict(pair.record, suite="e2e", phase=phase, side=side, device=str(device),
                max_rel_logit_error=pair.max_rel_logit_error, fp32_rel_logit_error=pair.fp32_error,
                load_average=load_average())


def pytest_generate_tests(metafunc):
    if "phase" not in metafunc.fixturenames:
        return
    config = metafunc.config
    size, device = config.getoption("size"), default_device(config.getoption("device"))
    preset = PRESETS[size][device.type]
    where = config.getoption("sparse_where") or (["faster"] if size == "full" else ["faster", "all"])
    params = [pytest.param(dtype, model, pattern, place, phase, side,
                           id=f"{model.rstrip('/').split('/')[-1]}-{dtype}-{pattern}-{place}-{phase}-{side}")
              for dtype in config.getoption("dtype") or [preset["dtype"]]
              for model in config.getoption("models") or preset["models"] for pattern in PATTERNS
              for place in where for phase in ("prefill", "decode") for side in ("dense", "sparse")]
    metafunc.parametrize(("dtype_name", "model", "pattern", "where", "phase", "side"), params)


def test_e2e(benchmark, request, dtype_name, model, pattern, where, phase, side, device, size):
    config, dtype = request.config, getattr(torch, dtype_name)
    preset = PRESETS[size][device.type]
    layers = config.getoption("layers") or preset["layers"]
    decode = config.getoption("new_tokens") or preset["decode"]
    rounds = config.getoption("benchmark_min_rounds")
    pair = prepare(model, pattern, where, config.getoption("implementation"), layers,
                   config.getoption("prefill_tokens") or preset["prefill"], decode, dtype, device)
    assert pair.excess_error <= TOLERANCE[dtype], (
        f"sparse logits off the fp32 model's by {pair.fp32_error['sparse']:.3g} of the largest, the dense model's by "
        f"{pair.fp32_error['dense']:.3g}")
    if where == "all":  # every N:M linear of the decoder became a SparseLinear
        assert pair.record["sparse_layers"] == sum(
            type(m) is torch.nn.Linear for name, m in pair.models["dense"].named_modules() if "layers." in name)
    target = pair.models[side]
    benchmark.group = f"{model} {dtype_name} {pattern} {where} {phase}"
    benchmark.extra_info.update(extra_info(pair, phase, side, device))
    if phase == "prefill":
        benchmark.pedantic(synchronized(lambda: prefill(target, pair.long_prompt), device),
                           rounds=rounds, warmup_rounds=1)
    else:
        def after_prompt():  # untimed: the prompt's forward, its first new token and the KV cache
            return prompt_step(target, pair.short_prompt), {}
        steps = synchronized(lambda token, cache: decode_steps(target, token, cache, decode - 1), device)
        benchmark.pedantic(steps, setup=after_prompt, rounds=rounds, warmup_rounds=1)
