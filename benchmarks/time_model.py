"""The time model of docs/distributed.md: seconds per decoder block of a SparseGPT prune and of a
block-training prune (SAFE⁺) on N ranks, from per-layer FLOP counts and assumed rates, and the memory
one rank holds.

Per block, with T calibration tokens (a layer with ``in``, ``out`` features and ``T_l`` tokens; an
expert sees ``T·k/E`` of them):

* forward, twice (capture and propagation): ``2 · 2 · P_active · T / (N · R_fwd)``;
* Hessians: ``Σ_l 2 · T_l · in² / (N · R_fp32)`` (pyprune forms x xᵀ in float32);
* solves: the most loaded rank's ``Σ (in³ + 2·out·in²) / R_solve``, layers given to ranks as
  ``pyprune.runtime.distributed.owners`` does;
* communication: ``(Σ_l 8·in² · (N − 1)/N + Σ_l 2·out·in) / B`` (the float64 sums reduced, the
  16-bit weights broadcast).

A block-training prune (SAFE⁺, masked reconstruction) has the same two forwards, then ``S`` optimiser
steps on minibatches of ``T_s`` tokens split over the ranks, each step ``p`` forward-and-backward
passes (SAM: 2) and ``p`` all-reduces of the block's float32 gradients:

* training: ``S · p · 3 · 2 · P_active · T_s / (N · R_fp32)`` (a backward costs two forwards), or
  ``S`` times a step's seconds measured on one rank's share of the minibatch;
* gradient communication: ``S · p · 2 · (N − 1)/N · 4 · P / B`` (a ring all-reduce sends each byte
  twice over).

``GPU_RATES`` and ``LINKS`` are assumptions (A100-class GPUs, see the docs page);
``bench_distributed.py`` evaluates the same model with rates measured on its CPU.

    python benchmarks/time_model.py     # the docs page's memory and hours for three model shapes
"""
from typing import Dict, List, Optional, Sequence, Tuple

#: FLOP/s: bf16 forward, float32 Hessians, solves (SparseGPT paper: OPT-175B in under 4.5 hours on one A100)
GPU_RATES = {"fwd": 200e12, "fp32": 15e12, "solve": 1.5e12}
#: bytes/s between ranks: NVLink within a node, 200 Gb/s InfiniBand across nodes
LINKS = {"nvlink": 150e9, "ib": 25e9}
#: calibration tokens of the docs' large-model lines (128 x 2048)
TOKENS = 128 * 2048

Layer = Tuple[float, float, float]  # (in, out, tokens)


def dense(h: int, i: int, kv: int, tokens: float = TOKENS) -> List[Layer]:
    """(in, out, tokens) of q, k, v, o, gate, up, down of a dense block."""
    t = tokens
    return [(h, h, t), (h, kv, t), (h, kv, t), (h, h, t), (h, i, t), (h, i, t), (i, h, t)]


def moe(h: int, kv: int, experts: int, width: int, shared: int, tokens: float = TOKENS) -> List[Layer]:
    """An MoE block: attention, every expert's three matrices (top-1 routing, balanced), a shared expert."""
    t = tokens / experts
    return (dense(h, 0, kv, tokens)[:4] + [(h, width, t), (h, width, t), (width, h, t)] * experts
            + [(h, shared, tokens), (h, shared, tokens), (shared, h, tokens)])


def most_loaded(costs: Sequence[float], n: int) -> float:
    """The largest load of ``n`` ranks given ``costs`` costliest first to the least loaded (distributed.owners)."""
    load = [0.0] * n
    for cost in sorted(costs, reverse=True):
        load[load.index(min(load))] += cost
    return max(load)


def block_parts(layers: Sequence[Layer], n: int, rates: Dict[str, float], link: float) -> Dict[str, float]:
    """Seconds of one block on ``n`` ranks, by part (forward, hessians, solves, communication)."""
    tokens = max(t for _, _, t in layers)
    active = sum(i * o * t for i, o, t in layers) / tokens
    return {"forward": 2 * 2 * active * tokens / (n * rates["fwd"]),
            "hessians": sum(2 * t * i * i for i, o, t in layers) / (n * rates["fp32"]),
            "solves": most_loaded([i ** 3 + 2 * o * i * i for i, o, t in layers], n) / rates["solve"],
            "communication": (n > 1) * (sum(8 * i * i for i, o, t in layers) * (n - 1) / n
                                        + sum(2 * i * o for i, o, t in layers)) / link}


#: forward-and-backward passes of a SAFE⁺ step: SAM's ascent and the step's own gradient
SAM_PASSES = 2
#: SAFE⁺'s default schedule on the docs' calibration: 3 epochs over 128 windows, minibatches of 2 x 2048 tokens
TRAINING = {"steps": 3 * 128 // 2, "step_tokens": 2 * 2048}


def training_parts(layers: Sequence[Layer], n: int, rates: Dict[str, float], link: float, *, steps: int,
                   step_tokens: float, passes: int = SAM_PASSES, step_seconds: Optional[float] = None
                   ) -> Dict[str, float]:
    """Seconds of one block of a block-training prune on ``n`` ranks, by part (forward, training,
    communication): ``steps`` steps of ``step_tokens`` tokens, each ``passes`` forward-and-backward
    passes costed by FLOPs at ``rates["fp32"]``, or ``step_seconds`` a step where measured."""
    tokens = max(t for _, _, t in layers)
    active = sum(i * o * t for i, o, t in layers) / tokens
    params = sum(i * o for i, o, t in layers)
    step = (step_seconds if step_seconds is not None
            else passes * 3 * 2 * active * step_tokens / (n * rates["fp32"]))
    return {"forward": 2 * 2 * active * tokens / (n * rates["fwd"]),
            "training": steps * step,
            "communication": steps * passes * 2 * (n - 1) / n * 4 * params / link}


def block_seconds(layers: Sequence[Layer], n: int, rates: Dict[str, float], link: float) -> float:
    return sum(block_parts(layers, n, rates, link).values())


MODELS = {"70B dense (Llama-3-70B shapes)": [(80, dense(8192, 28672, 1024))],
          "405B dense (Llama-3.1-405B shapes)": [(126, dense(16384, 53248, 1024))],
          "400B MoE (hidden 5120, 128 experts every other block)": [(24, moe(5120, 1024, 128, 8192, 8192)),
                                                                     (24, dense(5120, 16384, 1024))]}


def main() -> None:
    for name, parts in MODELS.items():
        layers = max((layers for _, layers in parts), key=lambda ls: sum(8 * i * i for i, o, t in ls))
        print(f"{name}: per rank, Hessian sums {sum(8 * i * i for i, o, t in layers) / 2**30:.1f} GiB, "
              f"solve temporaries {max(12 * i * i + 8 * i * o for i, o, t in layers) / 2**30:.1f} GiB, "
              f"activations {TOKENS * layers[0][0] * 4 / 2**30:.1f} GiB / N, "
              f"block weights {sum(2 * i * o for i, o, t in layers) / 2**30:.1f} GiB")
        ranks = ((1, "nvlink"), (8, "nvlink"), (16, "ib"), (64, "ib"))
        hours = [(n, sum(b * block_seconds(ls, n, GPU_RATES, LINKS[link]) for b, ls in parts) / 3600)
                 for n, link in ranks]
        print("  SparseGPT hours on", ", ".join(f"{n} GPUs: {h:.2f}" for n, h in hours))
        hours = [(n, sum(b * sum(training_parts(ls, n, GPU_RATES, LINKS[link], **TRAINING).values())
                         for b, ls in parts) / 3600) for n, link in ranks]
        print(f"  SAFE⁺ hours ({TRAINING['steps']} steps of {TRAINING['step_tokens']} tokens a block) on",
              ", ".join(f"{n} GPUs: {h:.2f}" for n, h in hours))


if __name__ == "__main__":
    main()
