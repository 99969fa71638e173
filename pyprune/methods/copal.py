"""COPAL (Malla et al., 2024): continual pruning from sensitivities accumulated over datasets.

Per linear layer with dense base weights W [out, in], COPAL keeps an fp32 accumulator G and, for
every new calibration dataset k (Algorithm 1, in the linear-layer form of Eqs. 10-11),

    DY = X·ΔWᵀ + ΔX·Wᵀ                      (Eqs. 4-6: S_W + S_x, exact for a linear layer)
    G ← G + 2·|DY|ᵀ|X|                      (Eq. 10, one term per calibration token)
    W* = |W| ⊙ G                             (Eq. 11)
    W ← W_dense ⊙ select(W*)                 (Eq. 1; per matrix by default, per row or N:M as options)

The mask is always taken from the dense W, so weights pruned on an earlier dataset can come back
(no weight stasis, Eq. 2), and no earlier calibration data is needed: G carries it.

The paper does not fix the perturbations ΔW, ΔX (spec §3.3). ``perturbation="proportional"``
(default) takes ΔW = εW, ΔX = εX, so DY = 2ε(Y − b) from the layer outputs the engine hands over
(no extra GEMM). ``"gaussian"`` draws ΔW once per layer (the same for every dataset) with std
ε·std(W), and ΔX per token x_t with std ρ·ε·rms(x_t), ρ = ``perturbation_ratio``: each token's
perturbation is relative to that token alone, so G does not depend on how the calibration
tokens are batched. In both modes DY, hence G, is linear in ε: ε never changes a mask. What does
in gaussian mode is ρ, the size of ΔX relative to ΔW (ρ → 0: DY = X·ΔWᵀ, a random projection of
the inputs; ρ → ∞: DY = ΔX·Wᵀ, blind to the inputs' direction).

The continual state (G and the dense weights of every pruned layer, the steps taken, the
settings and a fingerprint of the model) lives on the method object between ``prune`` calls,
and in the directory ``state`` when that option is set: it is loaded before the first step
(refused, before anything changes, when made with other settings or for another model) and
rewritten atomically after every step.
"""
from __future__ import annotations

import os
import zlib
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from ..runtime import distributed, engine
from .. import ops
from ..io import storage
from ..nn.experts import expert_linears
from ..runtime.checkpoint import model_fingerprint, tokens_digest
from ..patterns import Pattern
from .base import LayerwiseMaskMethod, restore_dense_weights
from .options import block_checkpoint, option, positive, written_directory

STATE_FILE = "copal-state.safetensors"
_KIND = "COPAL state"
_FORMAT = 2  # 2: pyprune's state protocol (kind, format and key in the metadata)


class _Layer:
    """One linear layer's calibration pass: its accumulator G, this step's sum of G's increments
    (the float64 sum of each batch's float32 2|DY|ᵀ|X|, so that ranks add their sums exactly, as
    :mod:`pyprune.runtime.distributed` explains), dense weights and, for gaussian perturbations, ΔW
    (fixed per layer) and the generator of the per-token ΔX of this step."""

    def __init__(self, linear: nn.Linear, accumulator: Tensor, dense: Tensor,
                 delta_w: Optional[Tensor] = None, generator: Optional[torch.Generator] = None):
        self.linear, self.accumulator, self.dense = linear, accumulator, dense
        self.step_sum = torch.zeros(accumulator.shape, dtype=torch.float64, device=accumulator.device)
        self.delta_w, self.generator = delta_w, generator

    def add(self, output_sensitivity: Tensor, x: Tensor) -> None:
        """Add one batch's 2|DY|ᵀ|X| (Eq. 10) to this step's sum."""
        increment = torch.zeros(self.accumulator.shape, dtype=torch.float32, device=self.accumulator.device)
        self.step_sum += ops.accumulate_abs_outer_(increment, output_sensitivity, x, alpha=2.0)

    @torch.no_grad()
    def close_step(self) -> None:
        """G ← G + this step's (reduced) sum, rounded once to float32."""
        self.accumulator.copy_(self.accumulator.double().add_(self.step_sum))
        self.step_sum.zero_()


class Copal(LayerwiseMaskMethod):
    name = "copal"
    default_scope = "tensor"
    calibration = (16, 512)
    keeps_state = True
    offload_refusal = "it keeps every layer's dense weights across calls"
    commands = ("prune", "continual")
    data_parallel = True  # each step's sums of G's increments are added over the ranks

    state: Optional[str] = option(None, "COPAL: directory of the continual state; resumed when it holds one, "
                                  "rewritten after every step", written_directory)
    perturbation: str = option("proportional", "COPAL: perturbation model of dY (paper unspecified): proportional "
                               "(dW=eps*W, dX=eps*X) or gaussian", choices=("proportional", "gaussian"))
    epsilon: float = option(0.01, "COPAL: perturbation size eps (scales the accumulated sensitivity only: no mask "
                            "depends on it)", positive)
    perturbation_ratio: float = option(1.0, "COPAL: gaussian perturbation only: size of dX (relative to each "
                                       "token's rms) over the size of dW (relative to std(W)); the knob that "
                                       "changes the masks", positive)
    perturbation_seed: int = option(0, "COPAL: seed of the gaussian perturbations")
    propagate: str = option("pruned", "COPAL: the next block's calibration inputs come from this block "
                            "pruned or dense", choices=("pruned", "dense"))
    checkpoint: Optional[str] = block_checkpoint()

    def __init__(self, **values):
        super().__init__(**values)
        self.accumulators: Dict[str, Tensor] = {}
        self.dense: Dict[str, Tensor] = {}
        self.steps: list = []
        self._stored_settings: Optional[dict] = None
        self._fingerprint: Optional[str] = None
        self._incomplete = False
        self._loaded = False

    def check_options(self, settings) -> None:
        if settings["perturbation"] == "proportional" and settings["perturbation_ratio"] != 1.0:
            raise ValueError("COPAL: perturbation_ratio applies to perturbation 'gaussian' only (with proportional "
                             f"perturbations every ratio gives the same masks); got {settings['perturbation_ratio']}")
        if settings["checkpoint"] is not None and settings["state"] is not None:
            raise ValueError("COPAL: options checkpoint and state exclude each other (blocks restored from a "
                             "checkpoint come without their accumulators, which the state keeps)")

    def check_continual(self) -> None:
        if self.state is not None:
            raise ValueError("the continual runner keeps COPAL's state in memory, one per order; drop the "
                             "state option")

    # -- the continual state -------------------------------------------------------------------

    def _settings_key(self, pattern: Pattern) -> dict:
        """What a saved state must match: the options that change G or the masks, the pattern and
        its selection scope (``str(pattern)`` omits it)."""
        return {key: self.settings[key] for key in ("perturbation", "epsilon", "perturbation_ratio", "perturbation_seed",
                                                        "propagate")
                } | {"pattern": str(pattern), "scope": getattr(pattern, "scope", None)}

    def check(self, model: nn.Module, pattern: Pattern) -> None:
        super().check(model, pattern)
        if self._incomplete:
            raise RuntimeError("COPAL: an earlier step failed midway or resumed from a block checkpoint, so this "
                               "method object's accumulators are incomplete; start from a new one (and its saved "
                               "state, if any)")

    def check_loaded(self, model: nn.Module, pattern: Pattern) -> None:
        """A saved state's settings and model against this run's (the model by its fingerprint)."""
        super().check_loaded(model, pattern)
        stored, fingerprint = self._stored_key()
        if stored is not None:
            storage.check_key(f"COPAL state {self.state or '(in memory)'}", {"settings": stored, "model": fingerprint},
                              {"settings": self._settings_key(self.resolve(pattern)), "model": model_fingerprint(model)})

    def check_config(self, config, pattern: Pattern) -> None:
        """A saved state's settings are refused from its metadata, before the model is loaded."""
        super().check_config(config, pattern)
        stored, _ = self._stored_key()
        if stored is not None:
            storage.check_key(f"COPAL state {self.state}", {"settings": stored},
                              {"settings": self._settings_key(self.resolve(pattern))})

    def _stored_key(self):
        """(settings, model fingerprint) of the state this object continues: its own once it has
        one, else the saved state's (read, not loaded), else (None, None)."""
        if self._loaded or self.state is None or self._stored_settings is not None:
            return self._stored_settings, self._fingerprint
        path = os.path.join(self.state, STATE_FILE)
        if not os.path.exists(path):
            return None, None
        key = storage.read_state_meta(path, _KIND, (_FORMAT,))["key"]
        return key["settings"], key["model"]

    def _load(self, directory: str) -> None:
        path = os.path.join(directory, STATE_FILE)
        self._loaded = True
        if not os.path.exists(path):
            return
        tensors, meta = storage.load_state(path, _KIND, (_FORMAT,))
        for key, tensor in tensors.items():
            kind, layer = key.split(":", 1)
            (self.accumulators if kind == "G" else self.dense)[layer] = tensor
        self._stored_settings = meta["key"]["settings"]
        self._fingerprint = meta["key"]["model"]
        self.steps = meta["steps"]

    def _save(self, directory: str) -> None:
        tensors = {f"G:{n}": g for n, g in self.accumulators.items()} | {f"W:{n}": w for n, w in self.dense.items()}
        storage.save_state(os.path.join(directory, STATE_FILE), tensors, {
            "kind": _KIND, "format": _FORMAT, "steps": self.steps,
            "key": {"settings": self._stored_settings, "model": self._fingerprint}})

    # -- one dataset -----------------------------------------------------------------------------

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        if not self._loaded and self.state is not None:
            self._load(self.state)
        digest = tokens_digest(calib)
        if any(step["calib_sha256"] == digest for step in self.steps):
            raise ValueError("COPAL: these calibration tokens were already accumulated "
                             f"(step {[s['calib_sha256'] for s in self.steps].index(digest) + 1}); "
                             "give the next dataset")
        self._stored_settings = self._settings_key(pattern)
        self._fingerprint = model_fingerprint(model)
        self._incomplete = True
        details = super()._prune(model, pattern, calib, batch_size=batch_size, progress=progress)
        self.steps.append({"calib_sha256": digest, "tokens": int(calib.numel())})
        # blocks restored from a block checkpoint come without their accumulators
        self._incomplete = len(self.accumulators) < sum(len(engine.block_linears(block))
                                                        for block in engine.decoder_blocks(model))
        if self.state is not None and distributed.is_main():
            self._save(self.state)
        return details | {"continual_step": len(self.steps), "state": self.state}

    @torch.no_grad()
    def prepare_block(self, ctx: engine.BlockContext) -> None:
        """Calibrate every layer on its dense weights: restore them (or record them on the first step)."""
        restore_dense_weights(ctx, self.dense)
        for name, linear in ctx.linears().items():
            qualified = f"{ctx.name}.{name}"
            if qualified in self.accumulators:
                self.accumulators[qualified] = self.accumulators[qualified].to(linear.weight.device)

    def new_stats(self, name, linear):
        accumulator = self.accumulators.get(name)
        if accumulator is None:
            accumulator = self.accumulators[name] = torch.zeros(
                linear.weight.shape, dtype=torch.float32, device=linear.weight.device)
        dense = self.dense[name]
        if self.perturbation == "proportional":
            return _Layer(linear, accumulator, dense)
        seed = self.perturbation_seed * 1_000_003 + zlib.crc32(name.encode())
        generator = torch.Generator(device=dense.device).manual_seed(seed)
        delta_w = torch.randn(dense.shape, generator=generator, device=dense.device) * (
            self.epsilon * dense.float().std())
        generator.manual_seed(seed + 7919 * (len(self.steps) + 1))
        return _Layer(linear, accumulator, dense, delta_w, generator)

    def update(self, stats: _Layer, x, y):
        stats.add(self._output_sensitivity(stats, x, y), x)

    def reduce_stats(self, stats: _Layer, dst):
        """This step's sums of G's increments, added over the ranks (every rank then holds the same G)."""
        distributed.all_reduce_(stats.step_sum)
        return stats

    def data_parallel_refusal(self):
        if self.perturbation == "gaussian":
            return ("its gaussian ΔX is drawn token after token from one stream per layer, whose place a rank "
                    "cannot know for its shard; use perturbation 'proportional'")
        return super().data_parallel_refusal()

    def working_bytes(self, block):
        """Every layer's float64 sum of this step's increments (all are filled in one pass over the
        block), and for the largest layer a batch's float32 increment, its score and mask."""
        with expert_linears(block, strict=False):
            linears = list(engine.block_linears(block).values())
        return sum(8 * linear.weight.numel() for linear in linears) + 9 * max(linear.weight.numel() for linear in linears)

    def _output_sensitivity(self, layer: _Layer, x: Tensor, y: Tensor) -> Tensor:
        """DY = X·ΔWᵀ + ΔX·Wᵀ (Eqs. 4-6) for one batch of the layer's inputs and outputs."""
        if layer.delta_w is None:  # ΔW = εW, ΔX = εX: DY = 2ε·(Y − b)
            bias = layer.linear.bias
            return 2 * self.epsilon * (y if bias is None else y - bias)
        x = x.float()
        token_rms = x.square().mean(-1, keepdim=True).sqrt()
        delta_x = torch.randn(x.shape, generator=layer.generator, device=x.device) * (
            self.perturbation_ratio * self.epsilon * token_rms)
        return x @ layer.delta_w.T + delta_x @ layer.dense.float().T

    @torch.no_grad()
    def prune_layer(self, linear, stats: _Layer, pattern):
        stats.close_step()
        keep = pattern.keep_mask(ops.taylor_score(stats.dense, stats.accumulator))  # |W ⊙ G| = |W|·G (Eq. 11)
        linear.weight.copy_(stats.dense * keep.to(stats.dense.dtype))

