"""SparseLinear: an nn.Linear whose weight lives in the compressed N:M form, and ``sparsify_``.

The weight is stored as ``values`` [out, in·n/m] (a parameter) and ``meta`` [out, ceil(in/8)]
uint8 (the keep mask, a buffer), as :func:`pyprune.ops.nm_compress` produces them: 9/16 of the
dense bytes for 16-bit 2:4 and 4:8. That pair is the module's whole state (``state_dict`` holds
``values``, ``meta``, ``bias`` and ``_extra_state`` = [n, m, in_features], checked on load along
with the mask's exact n-of-m groups); every faster representation an implementation needs is derived from
it, cached, and rebuilt when the values change in place or are replaced. Writes through
``values.data`` bypass the version counter: call :meth:`SparseLinear.invalidate` after them.

Implementations (:data:`pyprune.nn.dispatch.IMPLEMENTATIONS`); ``implementation="auto"`` runs the sparse one
measured at least 1.05x dense in this environment (machine, torch, pyprune, threads) for the
dtype, pattern, weight size and token count (:mod:`pyprune.nn.dispatch`): the per-user cache's
answer, else a ``dense`` row of the shipped table for this very environment. A CPU case without
either (a shipped row naming ``kernel`` included) is timed on first use, kernel against dense on
the layer's own weights (:mod:`pyprune.nn.tuning`), and the measurement decides. Where no
measurement can run (``PYPRUNE_TUNE=0``, a GPU) the layer runs dense; under torch.compile it runs
the implementation eager forwards chose for the same case, else dense:

* ``kernel``: :func:`pyprune.ops.nm_linear` on the compressed form (Triton on GPU; on CPU the
  C++ kernel: a GEMV over kept weights for <= 256 tokens (AVX-512 or AVX2, chosen at run time),
  block-wise decompression into BLAS above). Differentiable: gradients reach ``values`` at the kept positions only, so fine-tuning
  keeps the pattern.
* ``dense``: ``F.linear`` (cuBLAS/MKL/oneDNN) on the weight decompressed once and cached: as fast
  as the layer left dense, at the memory of the compressed and the dense form together.
* ``cusparselt`` / ``cutlass``: torch's 2:4 semi-structured tensors (CUDA, fp16/bf16; one cached
  copy), with the cuSPARSELt algorithm searched once per power-of-two token count.
* ``sparse24_linear``: :func:`pyprune.ops.sparse24_linear`, pyprune's CUDA 2:4 sparse tensor-core
  GEMM (``pyprune._C_cuda``, sm80+).

Calls in grad mode where x or a parameter requires grad always run ``kernel`` (the only
differentiable implementation), whatever ``implementation`` says.

``backend=`` / ``.backend`` / ``choose_backend`` and the name ``mma_sp`` are the former names of
``implementation=`` / ``.implementation`` / ``choose_implementation`` and ``sparse24_linear``; they
still work, with a DeprecationWarning, until the next release, and saved layers naming them load.
"""
from __future__ import annotations

import copy
import warnings
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..ops.conventions import pack_mask, sparse24_mma_meta, unpack_mask
from ..ops.implementations import call
from ..ops.library import native
from ..patterns import NM, max_kept_per_group, parse
from . import dispatch, tuning
from .experts import MATRICES, ExpertLinears, RoutedExperts, expert_layout, experts_of, fused_experts

#: The patterns ``sparsify_`` recognises in a weight when none is given, most hardware-friendly first.
DETECTED_PATTERNS = (NM(2, 4), NM(4, 8))
_SEMI_STRUCTURED = ("cusparselt", "cutlass")


def _as_nm(pattern) -> NM:
    if isinstance(pattern, tuple) and len(pattern) == 2:
        return NM(*pattern)
    parsed = parse(pattern)
    if not isinstance(parsed, NM):
        raise ValueError(f"pattern must be N:M (e.g. '2:4', '4:8', NM(2, 4) or (2, 4)); got {pattern!r}")
    return parsed


def _check_implementation(name: str, backend: Optional[str] = None) -> str:
    """``name`` checked; ``backend`` (the former keyword) and former names warn and still work."""
    if backend is not None:
        warnings.warn("SparseLinear's backend= is deprecated; use implementation=", DeprecationWarning, stacklevel=3)
        name = backend
    if name in dispatch.FORMER_NAMES:
        warnings.warn(f"SparseLinear implementation {name!r} is now called {dispatch.FORMER_NAMES[name]!r}",
                      DeprecationWarning, stacklevel=3)
        name = dispatch.FORMER_NAMES[name]
    if name != "auto" and name not in dispatch.IMPLEMENTATIONS:
        raise ValueError(f"implementation must be 'auto' or one of {', '.join(dispatch.IMPLEMENTATIONS)}; "
                         f"got {name!r}")
    return name


def detect_pattern(weight: Tensor, candidates: Iterable[NM] = DETECTED_PATTERNS) -> Optional[NM]:
    """The first candidate N:M pattern that ``weight`` satisfies (at most n nonzeros in every
    group of m), or None."""
    return next((pattern for pattern in candidates if pattern.fits(weight)), None)


class SparseLinear(nn.Module):
    """Drop-in for ``nn.Linear`` (same forward, bias, dtype/device moves) with an N:M weight.

    Build one with :meth:`from_dense`; the constructor makes an all-zero layer of the given shape
    (what ``load_state_dict`` fills)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, n: int = 2,
                 m: int = 4, implementation: str = "auto", device=None, dtype=None,
                 backend: Optional[str] = None):
        super().__init__()
        pattern = NM(n, m)
        pattern.check_layer("SparseLinear", in_features)
        self.in_features, self.out_features = in_features, out_features
        self.n, self.m = n, m
        self.implementation = _check_implementation(implementation, backend)
        factory = {"device": device, "dtype": dtype}
        self.values = nn.Parameter(torch.zeros(out_features, in_features * n // m, **factory))
        mask = torch.zeros(out_features, in_features // m, m, dtype=torch.bool, device=device)
        mask[..., :n] = True
        self.register_buffer("meta", pack_mask(mask.reshape(out_features, in_features)))
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        self._cache: Dict[str, Tuple[tuple, object]] = {}
        self._cusparselt_algorithms: Dict[int, int] = {}
        #: implementation="auto": (implementation, what else picked it) per (device, dtype, token bucket)
        self._choices: Dict[tuple, Tuple[str, tuple]] = {}
        #: implementation="auto": (implementation, source in dispatch.SOURCES) per token bucket met so far
        self.decisions: Dict[str, Tuple[str, str]] = {}

    def get_extra_state(self) -> Tensor:
        return torch.tensor([self.n, self.m, self.in_features], dtype=torch.int64)

    def set_extra_state(self, state: Tensor) -> None:
        n, m, in_features = (int(v) for v in state.tolist())
        if (n, m, in_features) != (self.n, self.m, self.in_features):
            raise ValueError(f"SparseLinear state is {n}:{m} with {in_features} inputs; this layer is "
                             f"{self.pattern} with {self.in_features} (build it with those first)")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        extra = state_dict.get(prefix + "_extra_state")
        if extra is not None:
            self.set_extra_state(extra)  # a wrong pattern is named before its mask is checked
        meta = state_dict.get(prefix + "meta")
        if isinstance(meta, Tensor) and tuple(meta.shape) == tuple(self.meta.shape):
            kept = unpack_mask(meta, self.in_features).reshape(-1, self.m).sum(dim=1)
            if not bool((kept == self.n).all()):
                raise ValueError(f"{prefix}meta is not a {self.pattern} mask: a group keeps "
                                 f"{int(kept[kept != self.n][0])} of {self.m}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def backend(self) -> str:
        """Deprecated name of :attr:`implementation`."""
        warnings.warn("SparseLinear.backend is deprecated; use .implementation", DeprecationWarning, stacklevel=2)
        return self.implementation

    @backend.setter
    def backend(self, name: str) -> None:
        warnings.warn("SparseLinear.backend is deprecated; use .implementation", DeprecationWarning, stacklevel=2)
        self.implementation = _check_implementation(name)

    def invalidate(self) -> None:
        """Drop the cached forms (needed only after writes through ``values.data``)."""
        self._cache.clear()
        self._cusparselt_algorithms.clear()
        self._choices.clear()
        self.decisions.clear()

    def __getstate__(self):
        state = super().__getstate__()
        return dict(state, _cache={}, _cusparselt_algorithms={}, _choices={}, decisions={})

    @classmethod
    def from_dense(cls, linear: nn.Linear, pattern: Union[str, NM, Tuple[int, int]] = "2:4",
                   mask: Optional[Tensor] = None, implementation: str = "auto",
                   backend: Optional[str] = None) -> "SparseLinear":
        """A SparseLinear holding ``linear.weight ⊙ mask`` (and its bias).

        Without ``mask`` the weight must already be N:M sparse (as after pruning with that
        pattern): anything else raises rather than silently pruning. ``linear`` is not modified.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear; got {type(linear).__name__}")
        pattern = _as_nm(pattern)
        weight = linear.weight.detach()
        pattern.check_layer("linear", weight.shape[1])
        if mask is None:
            kept = max_kept_per_group(weight, pattern.m)
            if kept > pattern.n:
                raise ValueError(f"linear's weight is not {pattern} sparse (a group of {pattern.m} "
                                 f"holds {kept} nonzeros); prune it first or pass mask= "
                                 f"(e.g. pyprune.ops.score_nm_mask(weight, {pattern.n}, {pattern.m}))")
            mask = ops.score_nm_mask(weight, pattern.n, pattern.m)  # keeps every nonzero
        values, meta = ops.nm_compress(weight, mask.to(weight.device), pattern.n, pattern.m)
        layer = cls(weight.shape[1], weight.shape[0], linear.bias is not None, n=pattern.n,
                    m=pattern.m, implementation=_check_implementation(implementation, backend), device="meta",
                    dtype=weight.dtype)
        layer.values = nn.Parameter(values, requires_grad=linear.weight.requires_grad)
        layer.meta = meta
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(),
                                      requires_grad=linear.bias.requires_grad)
        return layer

    @property
    def pattern(self) -> NM:
        return NM(self.n, self.m)

    @property
    def weight(self) -> Tensor:
        """The dense ``W ⊙ mask`` (materialised on every access; for inspection, not for speed)."""
        return ops.nm_decompress(self.values.detach(), self.meta, self.n, self.m)

    def to_dense(self) -> nn.Linear:
        """An nn.Linear with the same weight and bias."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device="meta")
        dense.weight = nn.Parameter(self.weight.clone(), requires_grad=self.values.requires_grad)
        if self.bias is not None:
            dense.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=self.bias.requires_grad)
        return dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, pattern={self.pattern}, implementation={self.implementation}")

    def choose_backend(self, x: Tensor) -> str:
        """Deprecated name of :meth:`choose_implementation`."""
        warnings.warn("SparseLinear.choose_backend is deprecated; use choose_implementation",
                      DeprecationWarning, stacklevel=2)
        return self.choose_implementation(x)

    def choose_implementation(self, x: Tensor) -> str:
        """The implementation this forward runs on (see the module docstring)."""
        tokens = x.numel() // max(x.shape[-1], 1)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.values.requires_grad
                                                  or (self.bias is not None and self.bias.requires_grad))
        if needs_grad:
            return "kernel"
        name = self.implementation
        if name == "auto":
            bucket = dispatch.token_bucket(tokens)
            case = (x.device, x.dtype, bucket)
            if torch.compiler.is_compiling():  # a graph reads no file: what eager chose, else dense
                return self._choices.get(case, (dispatch.FALLBACK_IMPLEMENTATION,))[0]
            # remembered per case (a decode step is short, the lookup is not free) and context:
            # what else picks the table, the cache file and the answers in it
            context = (dispatch.table_path(), dispatch.cache_root(), torch.get_num_threads(),
                       dispatch.native_kernels(x.device))
            choice = self._choices.get(case)
            if choice is None or choice[1] != context:
                name, source = _decide(self, self.pattern, x.device, x.dtype, tokens)
                if not self.supports(name, x):
                    name, source = dispatch.FALLBACK_IMPLEMENTATION, "fallback"
                choice = self._choices[case] = (name, context)
                self.decisions[bucket] = (name, source)
            name = choice[0]
        elif not self.supports(name, x):
            raise RuntimeError(f"SparseLinear implementation {name!r} cannot run {self.pattern} "
                               f"{x.dtype} on {x.device.type} here: {self.unsupported_reason(name, x)}")
        return name

    def tune(self, tokens: int) -> Tuple[Dict, str]:
        """Time ``kernel`` against ``dense`` on this layer's weights at ``tokens`` tokens (CPU) and
        record the answer in the per-user cache: (the cache entry, the cache file's path). The dense
        weight built for the timing is kept only when dense won."""
        device, dtype = self.values.device, self.values.dtype
        if device.type != "cpu":
            raise ValueError(f"SparseLinear.tune measures CPU layers; this one is on {device.type}")
        kept = "dense" in self._cache
        entry = tuning.measure(lambda x: self.forward_on("dense", x), lambda x: self.forward_on("kernel", x),
                               tuning.timed_input(self.in_features, tokens, dtype, device))
        if entry["implementation"] != "dense" and not kept:
            self._cache.pop("dense", None)
        key = dispatch.case_key(dtype, str(self.pattern), self.out_features, self.in_features, tokens)
        return entry, dispatch.record(device, {key: entry})

    def supports(self, name: str, x: Tensor) -> bool:
        return self.unsupported_reason(name, x) is None

    def unsupported_reason(self, name: str, x: Tensor) -> Optional[str]:
        if name in ("kernel", "dense"):
            return None
        if x.device.type != "cuda":
            return "it needs CUDA tensors"
        if (self.n, self.m) != (2, 4) or x.dtype not in (torch.float16, torch.bfloat16):
            return "it runs 2:4 fp16/bf16 only"
        if name == "sparse24_linear":
            if self.in_features % 32:
                return "it needs in_features divisible by 32"
            if torch.cuda.get_device_capability(x.device) < (8, 0):
                return "it needs sparse tensor cores (sm80 or newer)"
            return None if native("cuda") is not None else "pyprune._C_cuda is not built"
        if self._semi_structured(name, x) is None:
            return f"torch rejected this weight for {name} (shape or library)"
        return None

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have {self.in_features} features in its last dim; got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if x.device != self.values.device:
            raise ValueError(f"x must be on the layer's device {self.values.device}; got {x.device}")
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            if dtype != self.values.dtype or dtype != x.dtype:
                # as nn.Linear under autocast: inputs and weights cast to the autocast dtype (a
                # differentiable cast, so mixed-precision training updates the stored values)
                with torch.autocast(device_type, enabled=False):
                    bias = None if self.bias is None else self.bias.to(dtype)
                    return ops.nm_linear(x.to(dtype), self.values.to(dtype), self.meta, self.n,
                                         self.m, bias)
        if x.dtype != self.values.dtype:
            raise TypeError(f"x must have the layer's dtype {self.values.dtype}; got {x.dtype}")
        return self.forward_on(self.choose_implementation(x), x)

    def forward_on(self, name: str, x: Tensor) -> Tensor:
        """The forward on implementation ``name`` (chosen and checked by :meth:`choose_implementation`)."""
        if name == "kernel":
            # the op itself: the compressed form and bias are valid by construction and forward
            # checked x, so pyprune.ops.nm_linear's argument checks would only repeat
            return call(torch.ops.pyprune.nm_linear.default, x, self.values, self.meta, self.n, self.m, self.bias)
        if name == "dense":
            return F.linear(x, self._cached("dense", lambda: self.weight), self.bias)
        if name == "sparse24_linear":
            meta = self._cached(name, lambda: sparse24_mma_meta(self.meta, self.in_features))
            return ops.sparse24_linear(x, self.values.detach(), meta, self.bias)
        return F.linear(x, self._semi_structured(name, x), self.bias)

    def _cached(self, name: str, build):
        """``build()`` cached until values or meta change (in place or replaced) or move."""
        key = (self.values.data_ptr(), self.values._version, self.meta.data_ptr(),
               self.meta._version, self.values.dtype, self.values.device)
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            hit = (key, build())
            self._cache[name] = hit
        return hit[1]

    def _semi_structured(self, name: str, x: Tensor):
        """The weight as torch's 2:4 semi-structured tensor for ``name`` (one cached copy), or None
        if torch refuses it. For cuSPARSELt the algorithm is searched
        (``torch._cslt_sparse_mm_search``) on the first input of each power-of-two token count."""
        def build():
            from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS
            kind = SparseSemiStructuredTensorCUTLASS if name == "cutlass" else SparseSemiStructuredTensorCUSPARSELT
            try:
                return kind.from_dense(self.weight)
            except (RuntimeError, ValueError, NotImplementedError):
                return None
        sparse = self._cached(name, build)
        if sparse is not None and name == "cusparselt":
            tokens = x.numel() // max(x.shape[-1], 1)
            bucket = 1 << max(tokens - 1, 0).bit_length()  # the token count rounded up to a power of 2
            if bucket not in self._cusparselt_algorithms:
                self._cusparselt_algorithms[bucket] = _cusparselt_algorithm(sparse, x)
            sparse.alg_id_cusparselt = self._cusparselt_algorithms[bucket]
        return sparse

    def _apply(self, fn, recurse=True):
        self.invalidate()
        return super()._apply(fn, recurse)


def _with_parameters(module: nn.Module, parameters: Dict[str, nn.Parameter]) -> nn.Module:
    """A shallow copy of ``module`` (same class, attributes and children) holding ``parameters``."""
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters, **parameters)
    twin._buffers, twin._modules = dict(module._buffers), dict(module._modules)
    return twin


class SparseExperts(RoutedExperts):
    """A fused MoE experts module (:mod:`pyprune.nn.experts`) whose every expert matrix is N:M
    sparse, held as one :class:`SparseLinear` per expert matrix (``experts.3.gate_up_proj``: the
    compressed values and metadata, the implementations and decisions of any SparseLinear) and run by the
    fused module's routing (:class:`~pyprune.nn.experts.RoutedExperts`). The dense 3-D parameters
    are not kept: the fused module is remembered with its parameters on ``meta``, and
    :meth:`to_fused` rebuilds it with the same weights."""

    def __init__(self, fused: nn.Module, layers: Sequence[Dict[str, SparseLinear]]):
        shell = _with_parameters(fused, {name: nn.Parameter(p.detach().to("meta"))
                                         for name, p in fused.named_parameters(recurse=False)})
        super().__init__([experts_of(linears) for linears in layers], shell, expert_layout(fused)[0])
        object.__setattr__(self, "_fused_shell", shell)  # not a child: no state, no memory

    @classmethod
    def from_fused(cls, fused: nn.Module, pattern: NM, implementation: str = "auto") -> "SparseExperts":
        """The experts of ``fused`` (each matrix already ``pattern`` sparse) as SparseLinear layers."""
        views = ExpertLinears(fused)
        return cls(fused, [{matrix: SparseLinear.from_dense(getattr(expert, matrix), pattern,
                                                            implementation=implementation)
                            for matrix in MATRICES} for expert in views])

    def to_fused(self) -> nn.Module:
        """The fused experts module with the dense 3-D weights (the same values, zeros included)."""
        stacked = {}
        for matrix in MATRICES:
            layers = [getattr(expert, matrix) for expert in self]
            grad = layers[0].values.requires_grad
            stacked[matrix] = nn.Parameter(self.layout.stacked([layer.weight for layer in layers]), requires_grad=grad)
            if self.layout.biases:
                stacked[f"{matrix}_bias"] = nn.Parameter(torch.stack([layer.bias.detach() for layer in layers]),
                                                         requires_grad=grad)
        return _with_parameters(self._fused_shell, stacked)

    def layers(self) -> Iterator[Tuple[str, SparseLinear]]:
        """(``<expert>.<matrix>``, SparseLinear) of every expert matrix."""
        for index, expert in enumerate(self):
            for matrix in MATRICES:
                yield f"{index}.{matrix}", getattr(expert, matrix)


def _cusparselt_algorithm(sparse, x: Tensor) -> int:
    """The fastest cuSPARSELt algorithm id for ``x @ sparseᵀ`` (0, the default, if the search fails)."""
    try:
        return int(torch._cslt_sparse_mm_search(sparse.packed, x.reshape(-1, x.shape[-1]).t()))
    except (RuntimeError, AttributeError, TypeError):
        return 0


def _check_tokens(faster_at: Optional[int], allow_none: bool = True) -> Optional[int]:
    if faster_at is None and allow_none:
        return None
    if isinstance(faster_at, bool) or not isinstance(faster_at, int) or faster_at < 1:
        raise ValueError(f"faster_at must be {'None or ' if allow_none else ''}a token count >= 1 "
                         f"(e.g. 1 for batch-1 decode); got {faster_at!r}")
    return faster_at


def _decide(module: nn.Module, pattern: NM, device: torch.device, dtype: torch.dtype,
            tokens: int) -> Tuple[str, str]:
    """(implementation, source in :data:`dispatch.SOURCES`) of ``module`` (an nn.Linear or SparseLinear of
    ``pattern``) at ``tokens`` tokens: :func:`dispatch.answer`, else a measurement taken now where
    :func:`tuning.can_tune` (:meth:`SparseLinear.tune`; a shipped row naming sparse is confirmed or
    overruled so), else dense."""
    found = dispatch.answer(device, dtype, str(pattern), module.out_features, module.in_features, tokens)
    if found is not None:
        return dispatch.entry_implementation(found[0]), found[1]
    if tuning.can_tune(device):
        tuning.announce(dispatch.cache_path(device))  # a measurement nobody asked for by name: said once
        layer = module if isinstance(module, SparseLinear) else SparseLinear.from_dense(module, pattern)
        return layer.tune(tokens)[0]["implementation"], "measured"
    return dispatch.FALLBACK_IMPLEMENTATION, "fallback"


def _pays(module: nn.Module, pattern: NM, faster_at: Optional[int]) -> bool:
    """An nn.Linear or SparseLinear: sparse measured faster in this environment at ``faster_at``
    tokens (or no count given), as :func:`_decide` finds."""
    if faster_at is None:
        return True
    tensor = module.values if isinstance(module, SparseLinear) else module.weight
    return _decide(module, pattern, tensor.device, tensor.dtype, faster_at)[0] != "dense"


def sparsify_(model: nn.Module, pattern: Union[None, str, NM, Tuple[int, int]] = None, *,
              implementation: str = "auto", skip: Iterable[str] = ("lm_head",),
              faster_at: Optional[int] = None, backend: Optional[str] = None) -> Dict[str, str]:
    """Replace, in place, every nn.Linear of ``model`` whose weight is N:M sparse by a SparseLinear,
    and every fused MoE experts module (:func:`pyprune.nn.experts.fused_experts`) whose expert
    matrices are all N:M sparse by a :class:`SparseExperts` (one SparseLinear per expert matrix).

    ``pattern`` None detects 2:4, else 4:8, per layer (per experts module); a given pattern converts
    exactly the layers that satisfy it. Layers named in ``skip`` (by the last part of their name)
    stay dense, as do layers that satisfy no pattern, and with ``faster_at=T`` those for which no
    sparse implementation measured faster than dense at T tokens per forward (per expert call for experts)
    in this environment, dtype and shape (its cache, or a measurement taken now on a CPU; a shipped
    row naming sparse is measured first; T = batch size for decode): they would only run dense, at
    the memory of both forms. Routers are nn.Linear layers no method prunes: they satisfy no
    pattern and stay dense.
    Returns {qualified name: pattern} of the replaced layers (``...experts.3.down_proj`` for experts).
    """
    candidates = DETECTED_PATTERNS if pattern is None else (_as_nm(pattern),)
    implementation = _check_implementation(implementation, backend)
    _check_tokens(faster_at)
    skip = set(skip)
    plan, replaced = {}, {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name.rsplit(".", 1)[-1] not in skip:
            found = detect_pattern(module.weight.detach(), candidates)
            if found is not None and _pays(module, found, faster_at):
                plan[name] = found
    for name, fused in fused_experts(model, strict=False).items():
        views = ExpertLinears(fused)  # each expert matrix as [out, in], whatever the layout
        found = next((p for p in candidates
                      if all(p.fits(getattr(expert, matrix).weight) for expert in views for matrix in MATRICES)), None)
        first = views[0]  # every expert has its shapes
        if (name.rsplit(".", 1)[-1] not in skip and found is not None
                and all(_pays(getattr(first, matrix), found, faster_at) for matrix in MATRICES)):
            experts = SparseExperts.from_fused(fused, found, implementation)
            _replace(model, name, experts)
            replaced.update({f"{name}.{layer}": str(found) for layer, _ in experts.layers()})
    for name, found in plan.items():
        _replace(model, name, SparseLinear.from_dense(model.get_submodule(name), found,
                                                      implementation=implementation))
    return dict({name: str(found) for name, found in plan.items()}, **replaced)


def _sparse_modules(model: nn.Module) -> Dict[str, Union[SparseLinear, SparseExperts]]:
    """The SparseExperts of ``model`` and its SparseLinear layers outside them, by qualified name."""
    experts = tuple(f"{name}." for name in sparse_experts(model))
    return {name: module for name, module in model.named_modules()
            if isinstance(module, SparseExperts) or (isinstance(module, SparseLinear) and not name.startswith(experts))}


def _patterns(name: str, module: Union[SparseLinear, SparseExperts]) -> Dict[str, str]:
    """{qualified name: pattern} of the sparse layers of ``module`` (every expert matrix of experts)."""
    if isinstance(module, SparseLinear):
        return {name: str(module.pattern)}
    return {f"{name}.{layer}": str(linear.pattern) for layer, linear in module.layers()}


def _dense(module: Union[SparseLinear, SparseExperts]) -> nn.Module:
    return module.to_dense() if isinstance(module, SparseLinear) else module.to_fused()


def densify_slower_(model: nn.Module, faster_at: int) -> Dict[str, str]:
    """Turn back into nn.Linear (fused experts), in place, every SparseLinear (SparseExperts) of
    ``model`` that measured (cache or first use, as in :func:`sparsify_`) no faster than
    dense at ``faster_at`` tokens per forward (a loaded sparse checkpoint on a machine where a
    layer does not pay). Returns {qualified name: pattern} of those layers."""
    _check_tokens(faster_at, allow_none=False)
    slower = {name: module for name, module in _sparse_modules(model).items()
              if not all(_pays(layer, layer.pattern, faster_at)
                         for layer in ([module] if isinstance(module, SparseLinear) else module[0].children()))}
    for name, module in slower.items():
        _replace(model, name, _dense(module))
    return {layer: found for name, module in slower.items() for layer, found in _patterns(name, module).items()}


def densify_(model: nn.Module) -> Dict[str, str]:
    """Turn every SparseLinear of ``model`` back into nn.Linear and every SparseExperts back into
    the fused experts module, in place (the same weights, zeros included), e.g. to prune or
    fine-tune a loaded sparse checkpoint. Returns {qualified name: pattern} of those layers."""
    layers = _sparse_modules(model)
    for name, module in layers.items():
        _replace(model, name, _dense(module))
    return {layer: found for name, module in layers.items() for layer, found in _patterns(name, module).items()}


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def sparse_layers(model: nn.Module) -> Dict[str, Dict]:
    """{qualified name: constructor arguments} of the SparseLinear layers of ``model`` (those of
    its SparseExperts included)."""
    return {name: {"in_features": module.in_features, "out_features": module.out_features,
                   "bias": module.bias is not None, "n": module.n, "m": module.m,
                   "implementation": module.implementation}
            for name, module in model.named_modules() if isinstance(module, SparseLinear)}


def sparse_experts(model: nn.Module) -> List[str]:
    """The qualified names of the SparseExperts modules of ``model``."""
    return [name for name, module in model.named_modules() if isinstance(module, SparseExperts)]


def _empty_layer(spec: Dict, reference_tensor: Tensor) -> SparseLinear:
    # model dirs saved before the rename name the implementation "backend", perhaps by a former name
    name = spec.get("implementation", spec.get("backend", "auto"))
    return SparseLinear(spec["in_features"], spec["out_features"], spec["bias"], n=spec["n"], m=spec["m"],
                        implementation=dispatch.FORMER_NAMES.get(name, name), device=reference_tensor.device,
                        dtype=reference_tensor.dtype)


def restore_sparse_layers_(model: nn.Module, layers: Dict[str, Dict], experts: Iterable[str] = ()) -> None:
    """Put empty SparseExperts where ``experts`` (from :func:`sparse_experts`) names them and empty
    SparseLinear layers where ``layers`` (from :func:`sparse_layers`) names them, with the
    dtype/device of the module they replace, ready for ``load_state_dict``."""
    for name in experts:
        fused = model.get_submodule(name)
        count = getattr(fused, MATRICES[0]).shape[0]
        _replace(model, name, SparseExperts(fused, [
            {matrix: _empty_layer(layers[f"{name}.{index}.{matrix}"], getattr(fused, matrix))
             for matrix in MATRICES} for index in range(count)]))
    for name, spec in layers.items():
        old = model.get_submodule(name)
        if not isinstance(old, SparseLinear):
            _replace(model, name, _empty_layer(spec, next(old.parameters())))
