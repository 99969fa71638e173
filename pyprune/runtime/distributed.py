"""Data-parallel pruning on ``torch.distributed`` (``torchrun``; gloo on CPU, NCCL on GPU).

Every function is a no-op, or returns its input, in one process, so the methods call them
unconditionally. In a process group of N ranks:

* :func:`shard`: each rank takes a contiguous run of whole calibration batches, so every batch is
  the one a single process would run (same rows, same shapes: the same rounding), and the union
  over ranks is exactly the one-process set. Each rank propagates its own shard through the blocks.
* :func:`all_reduce_` / :func:`reduce_`: sums of per-rank statistics. The methods keep them as
  float64 sums of per-batch float32 partials: such a sum is exact while its terms span fewer than
  about 29 − log2(batches) binades, so its value, hence the float32 statistic a method prunes from,
  does not depend on how the batches were split over ranks.
* :func:`all_reduce_gradients_`: training (a block's reconstruction, DReSS's regularisation, LoRA
  recovery: :func:`pyprune.runtime.training.backward_shared`) steps on the sum of the ranks'
  gradients, each rank's loss over its rows of a global minibatch.
* :func:`sharded` / :func:`local` / :func:`rows_held` / :func:`sum_shards_`: training sharded by FSDP2
  (:func:`pyprune.runtime.training.sharded_copy`): each rank holds rows of every trained weight (a
  ``DTensor``); the optimisers step on the local rows and sum their norms over the ranks, DReSS's
  penalty its channels' norms.
* Evaluation: perplexity sums its NLL and token counts over the ranks, each rank scoring its shard
  of the windows (:func:`shard` with ``empty_ok``).
* :func:`owners` / :func:`broadcast_`: a block's costly per-layer solves are spread over the ranks
  (balanced by their cost) and each solved weight is broadcast from its owner.
* :func:`failure_shared`: a rank that raises tells the others at their next collective (every
  collective here is preceded by a one-integer status exchange), so all ranks raise
  :class:`RankFailed` with one line naming the failing rank and its error. A rank that dies or
  hangs is seen by the others when its connection closes or a collective exceeds the process
  group's timeout (:func:`join_from_environment`'s ``timeout_s``): each ends with a
  :class:`RankFailed` naming itself and the collective's error.
* :func:`is_main`: the one rank (0) that writes the model, report and checkpoints.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RankFailed", "active", "rank", "world_size", "is_main", "join_from_environment", "leave", "shard_bounds",
           "shard", "owners", "all_reduce_", "reduce_", "broadcast_", "all_reduce_gradients_", "all_gather_objects",
           "sharded", "local", "rows_held", "sum_shards_", "failure_shared",
           "DEFAULT_TIMEOUT_S"]

#: seconds a collective waits for a silent rank before the job fails (``--dist-timeout``)
DEFAULT_TIMEOUT_S = 600


class RankFailed(RuntimeError):
    """A rank of a data-parallel run raised; the message names it and its error in one line.
    Every rank raises one; ``on_rank`` is the rank this one was raised on (rank 0 reports it)."""

    def __init__(self, message: str, on_rank: int):
        super().__init__(message)
        self.on_rank = on_rank


def active() -> bool:
    """Whether this process runs in a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Whether this rank writes the run's files (rank 0, or the only process)."""
    return rank() == 0


def join_from_environment(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) join its process group, gloo for
    ``device`` "cpu" and NCCL for "cuda" (this rank's GPU, ``cuda:LOCAL_RANK``), with collectives
    failing after ``timeout_s`` seconds; returns the device this rank runs on. Outside torchrun,
    or when a group is already initialised, it returns ``device`` unchanged."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0; got {timeout_s!r}")
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return device


def leave() -> None:
    """Leave the process group :func:`join_from_environment` joined (nothing without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_bounds(nsamples: int, batch_size: int, empty_ok: bool = False) -> Tuple[int, int]:
    """(first, stop): the calibration samples of this rank. Of the ``ceil(nsamples / batch_size)``
    batches a single process would run, rank r takes the contiguous run ``[r·B/N, (r+1)·B/N)``
    (B batches, N ranks); ValueError when there are fewer batches than ranks, unless ``empty_ok``
    (a sum over the samples, such as an evaluation's, takes a rank without any)."""
    if not active():
        return 0, nsamples
    batches, ranks = -(-nsamples // batch_size), world_size()
    if batches < ranks and not empty_ok:
        raise ValueError(f"calib: {nsamples} samples in batches of batch_size={batch_size} make {batches} "
                         f"batches, fewer than the {ranks} ranks; give at least {ranks * batch_size} samples or a "
                         "smaller batch_size")
    first, last = rank() * batches // ranks, (rank() + 1) * batches // ranks
    return first * batch_size, min(last * batch_size, nsamples)


def shard(tokens: Tensor, batch_size: int, empty_ok: bool = False) -> Tensor:
    """This rank's calibration windows, ``tokens[first:stop]`` of :func:`shard_bounds`."""
    first, stop = shard_bounds(tokens.shape[0], batch_size, empty_ok)
    return tokens[first:stop]


def owners(costs: Sequence[float]) -> List[int]:
    """The rank that solves each of a block's layers, from their ``costs``: the costliest first, each
    to the rank with the least cost so far (ties to the lower rank), so the ranks finish together.
    All 0 in one process."""
    load = [0.0] * world_size()
    assigned = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        assigned[index] = min(range(len(load)), key=lambda r: load[r])
        load[assigned[index]] += costs[index]
    return assigned


def _backend_tensor(tensor: Tensor) -> Tensor:
    """``tensor`` as the group's backend takes it: contiguous, on CUDA for NCCL and on the CPU for
    gloo (a copy when it is not)."""
    wants_cuda = dist.get_backend() == "nccl"
    if wants_cuda == (tensor.device.type == "cuda") and tensor.is_contiguous():
        return tensor
    return tensor.to(f"cuda:{torch.cuda.current_device()}" if wants_cuda else "cpu").contiguous()


def _status(failure: Optional[str] = None) -> Optional[RankFailed]:
    """The status exchange before every collective: a :class:`RankFailed` with the message of the
    highest failing rank when any rank reports a failure (``failure`` from this one), else None."""
    code = _backend_tensor(torch.tensor([rank() + 1 if failure is not None else 0], dtype=torch.int64))
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    failed = int(code.item()) - 1
    if failed < 0:
        return None
    message = [failure]
    dist.broadcast_object_list(message, src=failed)
    return RankFailed(message[0], rank())


def _check() -> None:
    """The status exchange of a rank that has not failed: raises what another rank reported."""
    failed = _status()
    if failed is not None:
        raise failed


def _collective(tensor: Tensor, run) -> Tensor:
    """``run(t)`` on ``tensor`` as the backend takes it, after the status exchange; the result is
    written back into ``tensor``."""
    _check()
    on_backend = _backend_tensor(tensor)
    run(on_backend)
    if on_backend is not tensor:
        tensor.copy_(on_backend)
    return tensor


def all_reduce_(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` over the ranks, in place on every rank; returns it."""
    if not active():
        return tensor
    return _collective(tensor, dist.all_reduce)


def reduce_(tensor: Tensor, dst: int) -> Optional[Tensor]:
    """Sum ``tensor`` over the ranks onto rank ``dst``: the sum there, None on the others (whose
    ``tensor`` is then undefined). In one process, ``tensor``."""
    if not active():
        return tensor
    _collective(tensor, lambda t: dist.reduce(t, dst=dst))
    return tensor if rank() == dst else None


def broadcast_(tensor: Tensor, src: int) -> Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s; returns it."""
    if not active():
        return tensor
    return _collective(tensor, lambda t: dist.broadcast(t, src=src))


def all_reduce_gradients_(params: Sequence[Tensor]) -> None:
    """Sum the ``.grad`` of every one of ``params`` over the ranks (a missing one counts as zeros),
    in one collective: the data-parallel step of block training."""
    if not active():
        return
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = all_reduce_(torch.cat([grad.reshape(-1) for grad in grads]))
    for p, summed in zip(params, flat.split([p.numel() for p in params])):
        p.grad = summed.view_as(p)


def sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is sharded over the ranks (a ``DTensor``: a parameter FSDP sharded, or its
    gradient); always False in one process."""
    if not active():
        return False
    from torch.distributed.tensor import DTensor  # imported here: it takes about a second
    return isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's shard of a :func:`sharded` tensor (sharing its storage: writing it writes the
    shard), or ``tensor`` itself."""
    return tensor.detach().to_local() if sharded(tensor) else tensor


def rows_held(tensor: Tensor) -> Tuple[int, int]:
    """(first, stop): the rows (dim 0) of a :func:`sharded` tensor this rank holds, as FSDP2 cuts
    them (``torch.chunk``: ceil(rows / N) a rank, the last ranks fewer or none); all of them
    otherwise."""
    rows = tensor.shape[0]
    if not sharded(tensor):
        return 0, rows
    first = min(rank() * -(-rows // world_size()), rows)
    return first, first + tensor.to_local().shape[0]


def sum_shards_(tensor: Tensor, over: Tensor) -> Tensor:
    """A sum over the shards of ``over``: ``tensor`` (this rank's partial, e.g. a squared norm of its
    rows) summed over the ranks in place when ``over`` is :func:`sharded`; as it is otherwise."""
    return all_reduce_(tensor) if sharded(over) else tensor


def all_gather_objects(value) -> List:
    """Every rank's picklable ``value``, in rank order (``[value]`` in one process)."""
    if not active():
        return [value]
    _check()
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


@contextlib.contextmanager
def failure_shared(where: str) -> Iterator[None]:
    """Run the body on every rank so that a failure on one ends it on all: the failing rank reports
    its error (named with ``where``, e.g. the block) at the others' next collective and every rank
    raises :class:`RankFailed` with the one line ``rank R failed in WHERE: Error: message``; on
    leaving the body the ranks agree that none failed. Nothing extra in one process."""
    if not active():
        yield
        return
    try:
        yield
    except RankFailed:
        raise
    except Exception as error:
        message = _failure_line(where, error)
        try:
            failed = _status(message)  # this rank's report, or a higher failing rank's
        except RuntimeError:  # the group itself is broken (a rank died): this rank's own error says so
            raise RankFailed(message, rank()) from error
        raise failed from error
    try:
        _check()
    except RankFailed:
        raise
    except RuntimeError as error:  # the group is broken: a rank died, or a collective timed out
        raise RankFailed(_failure_line(where, error), rank()) from error


def _failure_line(where: str, error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"rank {rank()} failed in {where}: {type(error).__name__}" + (f": {text[0]}" if text else "")
