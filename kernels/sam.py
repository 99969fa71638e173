"""SAFE's x-step over all the tensors of a block (spec §1.5, §1.8; kernels K4 and K5):

    sam_perturb_:   ‖g‖₂ over every tensor; anchor ← x; x ← x + (rho/‖g‖₂)·g  (no move if ‖g‖₂ = 0)
    sam_adam_step_: x = anchor; G = g + lam·(x + v·(1 − 2·keep)); x ← x·(1 − lr·wd); Adam on G

Multi-tensor form: a block has seven weight tensors (and a model many more small ones), so the
kernels do not launch per tensor. One launch covers every tensor of a group: its programs walk a
chunk table — (tensor, start) of every CHUNK elements of every tensor — and reach each list's
tensors from one typed base pointer (the group's first tensor of that list) plus the tensor's
element offset from it, read from a table. A group is the tensors that share the lists' dtypes
(and address residues modulo the element size, so the offsets are whole elements); a list of one
dtype is one launch per kernel. Base + offset, unlike a table of raw addresses, keeps alignment
visible to the compiler: when every address is 16-byte aligned and every size a multiple of 16
(LLM weights), the launch is ALIGNED and the loads and stores are 16-byte vectors. It works the
same under TRITON_INTERPRET=1, which dereferences the resulting addresses of CPU tensors as they
are.

* sam_perturb_: stage 1 writes each chunk's Σg² (fp32 lanes, one tree sum) to a partials buffer;
  torch sums the partials and takes the square root (a 0-d tensor); stage 2 reads that norm from
  device memory, so nothing waits on the host between the launches. Stage 2 copies x to the anchor
  in x's dtype and writes x + scale·g, computed in fp32 and rounded once, or x untouched when the
  norm is 0.
* sam_adam_step_: one element-wise pass (reads anchor, g, v, keep, m, s; writes x, m, s).

Divisions and square roots are the IEEE-rounded ones (div_rn, sqrt_rn), as in eager PyTorch. The
kernels write in place, so a GPU launch uses one fixed tile (no autotuning: trial runs would move
the weights).
"""
import functools
from typing import Dict, List, Sequence, Tuple

import torch
import triton
import triton.language as tl

# Rows of the offset table of a launch, one per list; the row after the lists holds each tensor's
# element count.
_X, _GRAD, _ANCHOR, _V, _KEEP, _EXP_AVG, _EXP_AVG_SQ = (tl.constexpr(i) for i in range(7))
_PERTURB_NUMELS = tl.constexpr(3)
_ADAM_NUMELS = tl.constexpr(7)

#: Elements per program on a GPU, walked in tiles of _BLOCK (4 warps: 8 elements per thread).
_CHUNK = 1 << 14
_BLOCK = 1024
#: Largest tile under the CPU interpreter, whose cost is mostly per operation: one tile per program.
_INTERPRETER_TILE = 1 << 16
#: Alignment (bytes) and size multiple (elements) of every tensor of an ALIGNED launch.
_VECTOR_BYTES = 16


@triton.jit
def _chunk(table_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr, NUMELS: tl.constexpr,
           CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    """(tensor, first element, element count) of this program's chunk."""
    chunk = tl.program_id(0)
    tensor = tl.load(chunk_tensor_ptr + chunk)
    start = tl.multiple_of(tl.load(chunk_start_ptr + chunk), CHUNK)
    numel = tl.load(table_ptr + NUMELS * n_tensors + tensor)
    length = tl.minimum(numel - start, CHUNK)
    if ALIGNED:  # (a hint must be set where its value is made: one on an argument is lost)
        length = tl.multiple_of(length, 16)
    return tensor, start, length


@triton.jit
def _at(base_ptr, table_ptr, n_tensors, row: tl.constexpr, tensor, start, ALIGNED: tl.constexpr):
    """Element ``start`` of tensor ``tensor`` of list ``row``: the list's base pointer moved by the
    tensor's element offset (16 bytes' worth of elements divide it in an ALIGNED launch)."""
    offset = tl.load(table_ptr + row * n_tensors + tensor)
    if ALIGNED:
        offset = tl.multiple_of(offset, 128 // base_ptr.dtype.element_ty.primitive_bitwidth)
    return base_ptr + offset + start


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to nearest even in DTYPE. For bf16 the rounding is integer arithmetic on the
    bits: the interpreter (triton 3.9) truncates in .to(tl.bfloat16), and this way compiled and
    interpreted kernels write the same bits, the reference's."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        nearest_even = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x != x, bits | 0x400000, nearest_even)  # NaN stays a (quiet) NaN
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _sum_squares_kernel(grad_base, table_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr, partials_ptr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, start, length = _chunk(table_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr,
                                   _PERTURB_NUMELS, CHUNK, ALIGNED)
    grad = _at(grad_base, table_ptr, n_tensors, _GRAD, tensor, start, ALIGNED)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, length, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        g = tl.load(grad + index, mask=index < length, other=0.0).to(tl.float32)
        squares += g * g
    tl.store(partials_ptr + tl.program_id(0), tl.sum(squares))


@triton.jit(do_not_specialize=["rho"])
def _perturb_kernel(x_base, grad_base, anchor_base, table_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr,
                    norm_ptr, rho, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, start, length = _chunk(table_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr,
                                   _PERTURB_NUMELS, CHUNK, ALIGNED)
    x_ptr = _at(x_base, table_ptr, n_tensors, _X, tensor, start, ALIGNED)
    grad = _at(grad_base, table_ptr, n_tensors, _GRAD, tensor, start, ALIGNED)
    anchor = _at(anchor_base, table_ptr, n_tensors, _ANCHOR, tensor, start, ALIGNED)
    norm = tl.load(norm_ptr)
    move = norm > 0
    scale = tl.div_rn(rho, tl.where(move, norm, 1.0))
    for offset in range(0, length, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        in_bounds = index < length
        x = tl.load(x_ptr + index, mask=in_bounds)
        tl.store(anchor + index, x, mask=in_bounds)
        g = tl.load(grad + index, mask=in_bounds, other=0.0).to(tl.float32)
        moved = _rounded(x.to(tl.float32) + scale * g, x_base.dtype.element_ty)
        tl.store(x_ptr + index, tl.where(move, moved, x), mask=in_bounds)


@triton.jit(do_not_specialize=["lr", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "bias1",
                               "bias2", "eps", "decay", "lam"])
def _adam_kernel(x_base, grad_base, anchor_base, v_base, keep_base, exp_avg_base, exp_avg_sq_base, table_ptr,
                 n_tensors, chunk_tensor_ptr, chunk_start_ptr, lr, beta1, one_minus_beta1, beta2, one_minus_beta2,
                 bias1, bias2, eps, decay, lam, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, start, length = _chunk(table_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr,
                                   _ADAM_NUMELS, CHUNK, ALIGNED)
    x_ptr = _at(x_base, table_ptr, n_tensors, _X, tensor, start, ALIGNED)
    grad = _at(grad_base, table_ptr, n_tensors, _GRAD, tensor, start, ALIGNED)
    anchor = _at(anchor_base, table_ptr, n_tensors, _ANCHOR, tensor, start, ALIGNED)
    v_ptr = _at(v_base, table_ptr, n_tensors, _V, tensor, start, ALIGNED)
    keep_ptr = _at(keep_base, table_ptr, n_tensors, _KEEP, tensor, start, ALIGNED)
    m_ptr = _at(exp_avg_base, table_ptr, n_tensors, _EXP_AVG, tensor, start, ALIGNED)
    s_ptr = _at(exp_avg_sq_base, table_ptr, n_tensors, _EXP_AVG_SQ, tensor, start, ALIGNED)
    for offset in range(0, length, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        in_bounds = index < length
        x = tl.load(anchor + index, mask=in_bounds, other=0.0).to(tl.float32)
        g = tl.load(grad + index, mask=in_bounds, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + index, mask=in_bounds, other=0.0)
        keep = tl.load(keep_ptr + index, mask=in_bounds, other=0) != 0
        # x − z + u = x + v·(1 − 2·keep), i.e. x − v where kept and x + v where pruned
        G = g + lam * (x + tl.where(keep, -v, v))
        m = tl.load(m_ptr + index, mask=in_bounds, other=0.0) * beta1 + one_minus_beta1 * G
        s = tl.load(s_ptr + index, mask=in_bounds, other=0.0) * beta2 + one_minus_beta2 * G * G
        tl.store(m_ptr + index, m, mask=in_bounds)
        tl.store(s_ptr + index, s, mask=in_bounds)
        update = tl.div_rn(lr * tl.div_rn(m, bias1), tl.sqrt_rn(tl.div_rn(s, bias2)) + eps)
        tl.store(x_ptr + index, _rounded(x * decay - update, x_base.dtype.element_ty), mask=in_bounds)


@functools.lru_cache(maxsize=64)
def _chunk_table(numels: Tuple[int, ...], chunk: int, device: torch.device):
    """(tensor index int32, first element int64) of every chunk, tensor by tensor."""
    tensors, starts = [], []
    for tensor, numel in enumerate(numels):
        for start in range(0, numel, chunk):
            tensors.append(tensor)
            starts.append(start)
    return (torch.tensor(tensors, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int64, device=device))


class _Launch:
    """One launch over the tensors ``indices`` of ``lists``: each list's base tensor, the table of
    element offsets from it (a row per list, then the element counts), the chunk table, the tile."""

    def __init__(self, lists: Sequence[Sequence[torch.Tensor]], indices: List[int], interpreted: bool):
        numels = tuple(lists[0][i].numel() for i in indices)
        if interpreted:
            self.block = self.chunk = min(_INTERPRETER_TILE, triton.next_power_of_2(max(numels)))
        else:
            self.chunk, self.block = _CHUNK, _BLOCK
        self.bases = [values[indices[0]] for values in lists]
        rows = [[(values[i].data_ptr() - base.data_ptr()) // base.element_size() for i in indices]
                for values, base in zip(lists, self.bases)]
        device = lists[0][0].device
        self.table = torch.tensor(rows + [list(numels)], dtype=torch.int64, device=device)
        self.n_tensors = len(indices)
        self.chunk_tensor, self.chunk_start = _chunk_table(numels, self.chunk, device)
        self.n_chunks = self.chunk_tensor.numel()
        self.aligned = (all(n % _VECTOR_BYTES == 0 for n in numels) and
                        all(values[i].data_ptr() % _VECTOR_BYTES == 0 for values in lists for i in indices))

    def args(self, *rows: tl.constexpr):
        """The base tensors of lists ``rows``, then the tables."""
        return (*(self.bases[row.value] for row in rows), self.table, self.n_tensors, self.chunk_tensor,
                self.chunk_start)

    def options(self):
        return {"CHUNK": self.chunk, "BLOCK": self.block, "ALIGNED": self.aligned}


def _groups(lists: Sequence[Sequence[torch.Tensor]]) -> Dict[tuple, List[int]]:
    """The tensor indices of each group, in order of first use: the same dtype in every list, and
    the same address residue modulo the element size (so offsets between them are whole elements)."""
    groups: Dict[tuple, List[int]] = {}
    for i in range(len(lists[0])):
        key = tuple((values[i].dtype, values[i].data_ptr() % values[i].element_size()) for values in lists)
        groups.setdefault(key, []).append(i)
    return groups


def sam_perturb_(params, grads, anchors, rho: float, interpreted: bool) -> torch.Tensor:
    """params/anchors (one dtype per pair) and grads: lists of contiguous tensors of equal shapes."""
    lists = (params, grads, anchors)
    launches = [_Launch(lists, indices, interpreted) for indices in _groups(lists).values()]
    partials = torch.empty(sum(launch.n_chunks for launch in launches), dtype=torch.float32,
                           device=params[0].device)
    first = 0
    for launch in launches:
        _sum_squares_kernel[(launch.n_chunks,)](*launch.args(_GRAD), partials[first:], **launch.options())
        first += launch.n_chunks
    norm = partials.sum().sqrt()
    for launch in launches:
        _perturb_kernel[(launch.n_chunks,)](*launch.args(_X, _GRAD, _ANCHOR), norm, rho, **launch.options())
    return norm


def sam_adam_step_(params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decay: float, lam: float, step: int,
                   interpreted: bool) -> None:
    """Lists of contiguous tensors of equal shapes: params/grads/anchors fp32/fp16/bf16, vs and the
    moments fp32, keeps bool. The scalars are rounded to fp32 where the reference's eager
    arithmetic rounds them (1 − β, the bias corrections and 1 − lr·wd in double first)."""
    keeps = [keep.view(torch.uint8) for keep in keeps]  # 0/1 bytes, loaded as integers
    lists = (params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs)
    scalars = (lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - beta1 ** step, 1.0 - beta2 ** step, eps,
               1.0 - lr * weight_decay, lam)
    for indices in _groups(lists).values():
        launch = _Launch(lists, indices, interpreted)
        _adam_kernel[(launch.n_chunks,)](*launch.args(_X, _GRAD, _ANCHOR, _V, _KEEP, _EXP_AVG, _EXP_AVG_SQ),
                                         *scalars, **launch.options())
