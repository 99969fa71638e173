"""DReSS (2025): regularise hidden channels with data, slice them out, optionally recover with LoRA.

The channels P of the hidden (residual-stream) dimension, the same in every layer, are the
round(p·d) of least residual-stream energy on the calibration data by default (not in the paper:
it keeps massive-activation channels, which the paper's positional choices appear to miss on
LLaMA-2-7B), or by position as in the paper (the last, the first, or spread over five segments; §4.4,
Table 3); the kept width stays a multiple of the head count (and of ``multiple``).

1. Regularise (Algorithm 1, Eqs. 1-4): train the whole model on calibration windows with
   L = LM loss + λ·Σ‖slice‖ over every slice that reads or writes P: q/k/v/gate/up input columns,
   o/down output rows, embedding (and an untied LM head's) columns, every RMSNorm entry; ‖·‖ is ℓ2
   per channel (DReSS-ℓ2, default) or ℓ1 (DReSS-ℓ1, Eq. 5-7 as its subgradient). The penalty's
   gradient is added to ``.grad`` by :func:`pyprune.ops.channel_penalty_`. The paper leaves the
   optimiser open: AdamW without weight decay, constant ``lr``; fp32 master weights. Inside Adam
   the penalised weights move ~lr per step whatever λ, and stall at a floor set by lr, not at zero;
   ``regulariser="proximal"`` (not in the paper) instead takes each AdamW step on the LM loss alone,
   then applies the penalty's proximal operator to the slices, prox of lr·λ‖·‖ (proximal gradient,
   step lr): group soft-thresholding (:func:`pyprune.ops.group_soft_threshold`; ℓ1: elementwise
   :func:`pyprune.ops.soft_threshold`), which sets a slice exactly to zero once its norm is below lr·λ.
   With ``shard_training`` the model trains sharded over the ranks (FSDP2, each decoder block a
   unit): each rank holds rows of every weight, so a channel's slice norm is the square root of
   its partial squared norms (ℓ1: its partial sums of |w|) summed over the ranks, one all-reduce a
   step (:meth:`DReSS.sharded_slices`), and every rank shrinks its rows of the slice alike.
2. Slice (Eqs. 8-9): :func:`pyprune.nn.keep_hidden_channels_` removes P physically; each norm
   is then scaled by the factor that keeps its output on the calibration data (``rescale_norms``,
   not in the paper; :meth:`DReSS.norm_scales`): sqrt(s·d/d') with s the kept channels' measured
   share of its input's energy, which is sqrt(d/d') only when the removed channels are empty.
3. Optional RFT: :func:`pyprune.runtime.recovery.lora_finetune` on the held-out quarter of the windows
   (the paper's 3:1 split), merged back into dense weights.

``steps=0`` slices without regularisation (the paper's "w/o R" ablation).
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import ops
from ..ops import reference
from ..ops.conventions import kept_count, round_half_up
from ..nn.measure import model_cost
from ..nn.anatomy import block_linears, decoder_blocks
from ..nn.compact import keep_hidden_channels_
from ..nn.layout import hidden_slices, hidden_stream, rescaled_norm_weight
from ..patterns import Structured
from ..runtime.recovery import DEFAULTS as LORA
from ..runtime.recovery import lora_finetune
from ..runtime import distributed
from ..runtime.checkpoint import model_fingerprint, tokens_digest
from ..runtime.training import TrainingCheckpoint, fp32_master_weights, train
from .base import Method
from .options import at_least_one, nonnegative, option, positive, shard_training, written_directory



def _layer_of(name: str) -> str:
    """'layer 3' for a tensor of model.layers.3, else the tensor's own name (embedding, final norm)."""
    parts = name.split(".")
    return f"layer {parts[2]}" if parts[:2] == ["model", "layers"] else name


class DReSS(Method):
    name = "dress"
    patterns = (Structured,)
    uses_gradients = True
    #: the channel statistics are summed over the ranks, the regularised training and LoRA sum their
    #: gradients over them (pyprune.runtime.training.train)
    data_parallel = True
    calibration = (800, 128)  # 600 windows regularise (one pass of the default steps), 200 for LoRA
    #: the default lr as a share of the RMS of the decoder's linear weights (:meth:`learning_rate`)
    lr_share = 5e-3
    #: windows whose residual stream ranks the channels for ``channels="quiet"``
    energy_windows = 64

    norm: str = option("l2", "DReSS: penalty norm per channel slice (l2 = DReSS-l2, l1 = DReSS-l1)",
                       choices=("l2", "l1"))
    lam: float = option(1.0, "DReSS: penalty weight lambda (paper 1e-3; AdamW normalises the gradient, so "
                        "from ~1 on each penalised weight moves ~lr per step toward 0, while 1e-3 hardly moves them "
                        "in a CPU budget of steps)", nonnegative)
    regulariser: str = option("penalty", "DReSS: how lambda acts: penalty = lambda*sum of slice norms in the loss, "
                              "inside AdamW (the paper); proximal = after each AdamW step on the LM loss, the slices "
                              "shrink by the prox of lr*lambda*norm (group soft-thresholding: exact zeros; not in "
                              "the paper)", choices=("penalty", "proximal"))
    steps: int = option(150, "DReSS: regularisation steps (0 = slice without regularising)", nonnegative)
    lr: Optional[float] = option(None, "DReSS: AdamW learning rate of the regularisation (paper: unspecified); unset: "
                                 "5e-3 x the RMS of the model's decoder linear weights, as AdamW moves every weight by "
                                 "~lr per step whatever its scale (SmolLM2-135M ~1e-3; Gemma 3 270M, whose weights are "
                                 "5x smaller, ~2e-4)", positive)
    train_batch: int = option(4, "DReSS: calibration windows per training step", at_least_one)
    channels: str = option("quiet", "DReSS: which hidden channels go: quiet = least residual-stream "
                           "energy on the calibration data (avoids massive-activation channels; not in the paper), "
                           "last (the paper's default), first, spread", choices=("quiet", "last", "first", "spread"))
    multiple: int = option(1, "DReSS: keep a multiple of this many channels (e.g. 8 or 64 for "
                           "tensor cores), besides a multiple of the head count", at_least_one)
    rescale_norms: bool = option(True, "DReSS: scale each sliced norm by sqrt(s*d/d'), s the kept channels' "
                                 "measured share of its input's energy on the calibration data (not in the paper)")
    lora_steps: int = option(0, "DReSS: LoRA recovery steps after slicing (0 = none)", nonnegative)
    lora_rank: int = option(LORA.rank, "DReSS: LoRA rank (paper 32)", at_least_one)
    lora_alpha: float = option(LORA.alpha, "DReSS: LoRA scaling factor alpha (paper 10)", positive)
    lora_lr: float = option(LORA.lr, "DReSS: LoRA learning rate (paper 2e-5 at batch 64)", positive)
    checkpoint: Optional[str] = option(None, "DReSS: directory for regularisation checkpoints; a rerun with the "
                                       "same settings resumes from it", written_directory)
    checkpoint_every: int = option(10, "DReSS: steps between checkpoints", at_least_one)
    train_seed: int = option(0, "DReSS: seed of the minibatch order (and of LoRA)")
    shard_training: bool = shard_training()

    # -- which channels ------------------------------------------------------------------------

    #: called with the regularised model just before slicing (e.g. a benchmark's pre-slice
    #: evaluation); what it returns goes into the report as ``before_slice``
    before_slice = None

    def pruned_channels(self, config, ratio: float, energy: Optional[Tensor] = None) -> Tensor:
        """The hidden channels P to remove for ``ratio``: the kept width :func:`kept_count` (d, ratio)
        rounded to the nearest multiple of the head count and of ``multiple`` (halves up, as every
        count in pyprune); ValueError when
        that removes no channel or keeps none. ``channels="quiet"`` takes the channels of least
        ``energy`` (:meth:`channel_energy`), sorted; without ``energy`` it only checks the count."""
        d = config.hidden_size
        step = math.lcm(int(config.num_attention_heads), self.multiple)
        kept = round_half_up(kept_count(d, ratio) / step) * step
        if kept >= d or kept <= 0:
            raise ValueError(f"ratio {ratio} of hidden size {d} rounds to {'zero' if kept >= d else 'all'} "
                             f"channels removed once the kept width is a multiple of {step} (the head count "
                             f"{config.num_attention_heads} and multiple {self.multiple})")
        count = d - kept
        if self.channels == "quiet":
            return torch.arange(count) if energy is None else energy.argsort(stable=True)[:count].sort().values
        if self.channels == "last":
            return torch.arange(kept, d)
        if self.channels == "first":
            return torch.arange(count)
        segments = torch.arange(d).tensor_split(5)  # Table 3 (3): the last channels of 5 segments
        shares = [count // 5 + (i < count % 5) for i in range(5)]
        return torch.cat([seg[len(seg) - share:] for seg, share in zip(segments, shares)])

    @staticmethod
    @torch.no_grad()
    def channel_energy(model: nn.Module, windows: Tensor, batch_size: int) -> Tensor:
        """Each hidden channel's share of the residual stream's energy Σx², averaged over the hidden
        states of ``output_hidden_states`` on ``windows`` (the embedding output, every block's output
        but the last, the final norm's output; each weighs the same; a pass of the decoder, no LM
        head). A few massive-activation
        channels hold most of it (SmolLM2-135M: channel 507, 71% on this average and 89-98% of the
        outputs of blocks 12-28, study dress-channel-energy); slicing one of them breaks the
        model, whatever the regularisation (DReSS's positional choices appear to miss LLaMA-2-7B's).
        The sums are float64 sums of each batch's float32 ones, added over the ranks of a process
        group (each runs its shard of ``windows``, :mod:`pyprune.runtime.distributed`)."""
        device = next(model.parameters()).device
        energy = None
        for batch in distributed.shard(windows, batch_size).split(batch_size):  # at least one batch a rank
            states = model.get_decoder()(input_ids=batch.to(device=device, dtype=torch.long),
                                         output_hidden_states=True, use_cache=False).hidden_states
            sums = torch.stack([h.float().pow(2).sum((0, 1)) for h in states]).cpu().double()
            energy = sums if energy is None else energy + sums
        distributed.all_reduce_(energy)
        return (energy / energy.sum(1, keepdim=True)).mean(0).float()

    def check_config(self, config, pattern) -> None:
        if not hasattr(config, "rms_norm_eps"):  # what transformers' configs of RMS-norm models state
            raise ValueError(f"method 'dress' slices hidden channels of RMS-norm models (Llama, Mistral, Qwen, Gemma, "
                             f"Phi-3); {type(config).__name__} has no rms_norm_eps (LayerNorm centres over every "
                             f"channel)")
        self.pruned_channels(config, pattern.ratio)
        if self.shard_training and self.checkpoint:
            raise ValueError(f"option shard_training of method {self.name!r} takes no checkpoint (a sharded "
                             f"regularisation is not saved mid-run); got checkpoint={self.checkpoint!r}")
        if self.shard_training and not distributed.active():
            raise ValueError(f"option shard_training of method {self.name!r} shards its regularised training over "
                             "the ranks of a torch.distributed group: run under torchrun --nproc-per-node N with N "
                             ">= 2 (or in a process group of 2 or more ranks); got one process")
        if self.checkpoint:  # another run's checkpoint is refused from its metadata, before the model loads
            self.training_checkpoint(None, pattern).check(parts=["settings"])

    def check(self, model, pattern):
        super().check(model, pattern)
        hidden_stream(model)  # a LLaMA-style model whose hidden channels can all be sliced
        self.check_config(model.config, pattern)
        checkpoint = self.training_checkpoint(model, pattern)
        if checkpoint is not None:
            checkpoint.check(parts=["settings", "model"])  # the windows are checked once drawn

    def training_checkpoint(self, model: Optional[nn.Module], pattern: Structured,
                            windows: Optional[Tensor] = None) -> Optional[TrainingCheckpoint]:
        """Where the regularisation saves, keyed by its settings, the dense model (not yet loaded:
        None) and the windows it trains on (not yet drawn: None) (None without ``checkpoint``). The
        steps are not part of the key: the learning rate is constant, so a longer run goes on from
        a shorter one's save."""
        if not self.checkpoint:
            return None
        key = {"settings": {k: self.settings[k] for k in (
            "norm", "regulariser", "lam", "lr", "train_batch", "channels", "multiple", "train_seed")}
            | {"ratio": pattern.ratio},
            "model": model_fingerprint(model) if model is not None else None,
            "calibration": tokens_digest(windows) if windows is not None else None}
        return TrainingCheckpoint(self.checkpoint, self.checkpoint_every, key, "dress-regularise.safetensors")

    # -- regularise, slice, recover ----------------------------------------------------------------

    def learning_rate(self, model: nn.Module) -> float:
        """``lr``, or where unset :attr:`lr_share` × the RMS of the decoder blocks' linear weights:
        an AdamW step moves each weight by about lr whatever its scale (its first step is lr·sign(g)),
        so an lr fixed in absolute terms is a 5× larger share of Gemma 3 270M's weights (RMS ~0.035)
        than of SmolLM2-135M's (~0.19), and one step at 1e-3 wrecks the former (loss 4.7 -> 14)."""
        if self.lr is not None:
            return self.lr
        squares, count = 0.0, 0
        for block in decoder_blocks(model):
            for linear in block_linears(block).values():
                squares += float(linear.weight.detach().double().square().sum())
                count += linear.weight.numel()
        return self.lr_share * math.sqrt(squares / count)

    def penalised_slices(self, model: nn.Module) -> List[Tuple[str, nn.Parameter, int, float]]:
        """(name, parameter, dim of the hidden channels, offset) of every weight that reads or writes
        them (Eqs. 2-4): :func:`pyprune.nn.layout.hidden_slices` without biases. The penalty and the
        mass act on parameter + offset, the norm's effective scale: 1 + w for Gemma's norms (driving
        w to 0 would leave the scale at 1), the weight itself (offset 0) everywhere else."""
        return hidden_slices(model, biases=False)

    @staticmethod
    def effective(parameter: Tensor, offset: float) -> Tensor:
        """The values the penalty acts on: ``parameter`` itself, or a detached parameter + offset."""
        return parameter if offset == 0 else parameter.detach() + offset

    @staticmethod
    def slice_mass(slices, channels: Tensor) -> Dict[str, float]:
        """Σ|W| over the P-slices of every penalised tensor (Fig. 5's measure; W + offset for an
        offset norm), by tensor name."""
        with torch.no_grad():
            return {name: float(DReSS.effective(p, offset).index_select(dim, channels.to(p.device)).abs().sum())
                    for name, p, dim, offset in slices}

    @staticmethod
    def mass_ratio_by(start: Dict[str, float], end: Dict[str, float], group) -> Dict[str, float]:
        """Σ end / Σ start of the slice masses over the tensors ``group(name)`` puts together
        (e.g. by layer or by kind of matrix, as in Fig. 5)."""
        totals: Dict[str, List[float]] = {}
        for name, before in start.items():
            total = totals.setdefault(group(name), [0.0, 0.0])
            total[0] += end[name]
            total[1] += before
        return {key: after / before for key, (after, before) in totals.items() if before}

    @staticmethod
    @torch.no_grad()
    def norm_scales(model: nn.Module, keep: Tensor, windows: Tensor, batch_size: int) -> Dict[str, float]:
        """Per norm of the hidden stream, the factor that keeps its output on the kept channels once
        the others are sliced: an RMS norm over d' channels divides by sqrt(s·d'/d) times the old
        RMS, s = Σ_kept x² / Σ x² of the token's input, so the factor is sqrt(s·d/d'), averaged over
        the tokens of ``windows`` (a pass of the decoder, no LM head); it is sqrt(d/d') exactly when
        the removed channels are zero. In a process group each rank runs its shard of ``windows`` and
        the sums are added over the ranks."""
        stream = hidden_stream(model)
        device = next(model.parameters()).device
        index, width = keep.to(device), model.config.hidden_size / keep.numel()
        sums = dict.fromkeys(stream["norms"], 0.0)

        def record(name):
            def hook(module, args):
                energy = args[0].float().square()
                total = energy.sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
                share = energy.index_select(-1, index).sum(-1) / total
                sums[name] += float((share * width).sqrt().sum())
            return hook

        handles = [norm.register_forward_pre_hook(record(name)) for name, norm in stream["norms"].items()]
        try:
            for batch in distributed.shard(windows, batch_size).split(batch_size):
                model.get_decoder()(input_ids=batch.to(device=device, dtype=torch.long), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        totals = distributed.all_reduce_(torch.tensor(list(sums.values()), dtype=torch.float64))
        return {name: float(total) / windows.numel() for name, total in zip(sums, totals)}

    def split_windows(self, calib: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """(the windows the regularisation trains on, those LoRA recovers on): with ``lora_steps``
        the paper's 3:1 split (X1 regularises, X2 recovers), otherwise all of ``calib`` and None."""
        if self.lora_steps == 0:
            return calib, None
        split = max(1, math.ceil(0.75 * calib.shape[0]))
        if split == calib.shape[0]:
            raise ValueError(f"dress with lora_steps needs at least 2 calibration windows; got {calib.shape[0]}")
        return calib[:split], calib[split:]

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        windows, recovery = self.split_windows(calib)
        checkpoint = self.training_checkpoint(model, pattern, windows)
        energy = self.channel_energy(model, calib[:self.energy_windows], batch_size) \
            if self.channels == "quiet" else None
        channels = self.pruned_channels(model.config, pattern.ratio, energy)
        keep = torch.tensor(sorted(set(range(model.config.hidden_size)) - set(channels.tolist())))
        before = model_cost(model, calib.shape[1])
        slices = self.penalised_slices(model)
        mass_start = self.slice_mass(slices, channels)
        log = self._regularise(model, slices, channels, windows, checkpoint, progress) if self.steps > 0 else {}
        mass_end = self.slice_mass(slices, channels)
        evaluated = {} if self.before_slice is None else {"before_slice": self.before_slice(model)}
        d = model.config.hidden_size
        scales = self.norm_scales(model, keep, calib[:self.energy_windows], batch_size) if self.rescale_norms else {}
        keep_hidden_channels_(model, keep)
        self._rescale_norms(model, scales)
        details = {
            "hidden_size": [d, keep.numel()], "pruned_channels": channels.tolist(),
            "norm_scale": scales, "width_scale": math.sqrt(d / keep.numel()),
            "slice_mass_ratio": sum(mass_end.values()) / sum(mass_start.values()),
            "slice_mass_ratio_per_tensor": {k: mass_end[k] / mass_start[k] for k in mass_start if mass_start[k]},
            "slice_mass_ratio_per_layer": self.mass_ratio_by(mass_start, mass_end, _layer_of),
            "slice_mass_ratio_per_kind": self.mass_ratio_by(mass_start, mass_end, lambda n: n.rpartition(".")[2]),
            "regularisation": log, "cost_before": before, "cost_after": model_cost(model, calib.shape[1]),
            **evaluated}
        if recovery is not None:
            details["lora"] = lora_finetune(model, recovery, steps=self.lora_steps, rank=self.lora_rank,
                                            alpha=self.lora_alpha, lr=self.lora_lr, seed=self.train_seed,
                                            batch_size=min(self.train_batch, recovery.shape[0]),
                                            progress=progress, shard_training=self.shard_training)
        return details

    @staticmethod
    @torch.no_grad()
    def proximal_step(slices, channels: Tensor, alpha: float, norm: str = "l2") -> None:
        """W[slice c] ← prox of α‖·‖ at W[slice c] for every c in ``channels`` of every penalised
        tensor, in place; the other entries are not touched. ℓ2: group soft-thresholding,
        W_c·max(0, 1 − α/‖W_c‖₂) (zero once ‖W_c‖₂ ≤ α); ℓ1: sign(w)·max(|w| − α, 0) per entry.
        An offset norm (Gemma's 1 + w) is shrunk on its effective scale: w ← prox(1 + w) − 1.
        Tensors sharded by rows over the ranks shrink their rows by the norms summed over the
        ranks (:meth:`sharded_slices`)."""
        if slices and distributed.sharded(slices[0][1]):
            for rows, dim, offset, held, part, norms in DReSS.sharded_slices(slices, channels, norm)[0]:
                shrunk = reference.group_shrink(part, norms, alpha) if norm == "l2" else \
                    ops.soft_threshold(part, alpha)
                rows.index_copy_(dim, held, (shrunk - offset if offset else shrunk).to(rows.dtype))
            return
        for _, p, dim, offset in slices:
            part = DReSS.effective(p, offset).index_select(dim, channels)
            shrunk = ops.group_soft_threshold(part, alpha, dim) if norm == "l2" else ops.soft_threshold(part, alpha)
            p.index_copy_(dim, channels, shrunk - offset if offset else shrunk)

    @staticmethod
    @torch.no_grad()
    def penalise_(slices, channels: Tensor, lam: float, norm: str) -> float:
        """grad[slice c] += lam·∂‖W[slice c]‖/∂W for every c in ``channels`` of every penalised
        tensor (:func:`pyprune.ops.channel_penalty_`; of this rank's rows, with the norms summed
        over the ranks, for tensors sharded by rows: :meth:`sharded_slices`); returns Σ‖slice‖."""
        if not (slices and distributed.sharded(slices[0][1])):
            return sum(float(ops.channel_penalty_(p.grad, DReSS.effective(p, offset), channels, dim, lam, norm).sum())
                       for _, p, dim, offset in slices)
        parts, total = DReSS.sharded_slices(slices, channels, norm)
        for (_, p, _, _), (_, dim, _, held, part, norms) in zip(slices, parts):
            grad = distributed.local(p.grad)
            step = grad.index_select(dim, held).float() + reference.penalty_gradient(part, norms, lam, norm)
            grad.index_copy_(dim, held, step.to(grad.dtype))
        return total

    @staticmethod
    @torch.no_grad()
    def sharded_slices(slices, channels: Tensor, norm: str) -> Tuple[List[Tuple], float]:
        """The slices of ``channels`` in the rows this rank holds of every penalised tensor sharded
        by rows over the ranks (a ``DTensor``), and Σ‖slice‖ over them all. A reader's slice (a
        column) runs through every rank's rows, a writer's or a norm's (a row, an entry) lies in one
        rank's: either way each rank adds up its rows' part of every channel's norm — Σw² for ℓ2,
        Σ|w| for ℓ1, in float64, 0 where it holds none of the slice — and one all-reduce of these
        partials gives every rank the whole norms. Per tensor: (its local rows, dim, offset, the
        local indices of the slices it holds, their fp32 values + offset, their norms in fp32
        shaped to broadcast against them)."""
        count, held_slices, partials = channels.numel(), [], []
        for _, p, dim, offset in slices:
            rows = distributed.local(p)
            first, stop = distributed.rows_held(p)
            at = ((channels >= first) & (channels < stop)).nonzero().reshape(-1) if dim == 0 else \
                torch.arange(count, device=channels.device)
            held = channels[at] - first if dim == 0 else channels
            part = DReSS.effective(rows, offset).index_select(dim, held).float()
            measure = part.double().abs() if norm == "l1" else part.double().square()
            others = [d for d in range(part.dim()) if d != dim]
            partial = torch.zeros(count, dtype=torch.float64, device=part.device)
            partial[at] = measure.sum(others) if others else measure
            held_slices.append((rows, dim, offset, held, part, at))
            partials.append(partial)
        sums = distributed.all_reduce_(torch.cat(partials))
        norms = (sums if norm == "l1" else sums.sqrt()).split(count)
        parts = [(rows, dim, offset, held, part,
                  whole.float()[at].reshape([-1 if d == dim else 1 for d in range(part.dim())]))
                 for (rows, dim, offset, held, part, at), whole in zip(held_slices, norms)]
        return parts, float(sums.sum() if norm == "l1" else sum(whole.sum() for whole in norms))

    @torch.no_grad()
    def _rescale_norms(self, model, scales: Dict[str, float]) -> None:
        stream = hidden_stream(model)
        for name, norm in stream["norms"].items():
            if name in scales:
                norm.weight.copy_(rescaled_norm_weight(norm.weight, scales[name], stream["norm_offset"]))

    def _regularise(self, model: nn.Module, slices, channels: Tensor, windows: Tensor,
                    checkpoint: Optional[TrainingCheckpoint], progress: bool) -> Dict:
        """Train every weight on LM loss + λ·penalty (Eq. 1) with fp32 master weights: the penalty's
        gradient added by :func:`pyprune.ops.channel_penalty_` after each backward, or (proximal)
        :meth:`proximal_step` after each step; the log's ``penalty`` is λ·Σ‖slice‖ before the step.
        With ``shard_training`` a copy sharded over the ranks trains (each decoder block an FSDP
        unit), its trained weights gathered back into ``model`` at the end."""
        index = channels.to(next(model.parameters()).device)
        proximal = self.regulariser == "proximal"
        of = {id(model): slices}  # the penalised slices of the module that trains (model, or its sharded copy)

        def trained_slices(trained: nn.Module):
            if id(trained) not in of:  # the copy's parameters of the same names
                names, copied = {id(p): name for name, p in model.named_parameters()}, dict(trained.named_parameters())
                of[id(trained)] = [(name, copied[names[id(p)]], dim, offset) for name, p, dim, offset in slices]
            return of[id(trained)]

        def penalty(trained: nn.Module) -> Dict[str, float]:
            total = self.penalise_(trained_slices(trained), index, 0.0 if proximal else self.lam, self.norm)
            return {"penalty": round(self.lam * total, 6)}

        start, lr = time.perf_counter(), self.learning_rate(model)
        with fp32_master_weights(model), torch.enable_grad():
            log = train(model, list(model.parameters()), windows, steps=self.steps, lr=lr,
                        batch_size=self.train_batch, seed=self.train_seed, after_backward=penalty,
                        after_step=(lambda trained: self.proximal_step(trained_slices(trained), index,
                                                                       lr * self.lam, self.norm))
                        if proximal else None, checkpoint=checkpoint, desc="dress regularise", progress=progress,
                        shard=decoder_blocks(model) if self.shard_training else ())
        log["time_s"], log["lr"] = round(time.perf_counter() - start, 1), lr
        return log
