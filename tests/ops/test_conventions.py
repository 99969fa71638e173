"""pyprune.ops.conventions: one rounding for every count (halves up), shared by the ops, the methods
(DReSS's kept width included) and the reference; the mask packing round-trips; the score kinds are
the same numbers in Python and in csrc/score_kind.h."""
import pathlib
import re

import pytest
import torch

from pyprune.ops import reference
from pyprune.ops.conventions import (ScoreKind, kept_count, pack_mask, round_half_up, sparse24_mma_mask,
                                     sparse24_mma_meta, unpack_mask)
from pyprune.methods.dress import DReSS
from tests.helpers import tiny_llama


def test_halves_round_up_unlike_python_round():
    assert [round_half_up(x) for x in (0.5, 1.5, 2.5, 2.49, -0.5)] == [1, 2, 3, 2, 0]
    assert [round(x) for x in (0.5, 2.5)] == [0, 2]  # what DReSS's count used to do
    assert kept_count(10, 0.25) == 8 and kept_count(6, 0.25) == 5  # 7.5 -> 8, 4.5 -> 5


@pytest.mark.parametrize("ratio,multiple,kept", [
    (0.09, 1, 60),   # kept_count(64, 0.09) = 58 -> 14.5 groups of 4 -> 15 (Python's round: 14, kept 56)
    (0.375, 16, 48),  # 40 -> 2.5 groups of 16 -> 3 (Python's round: 2, kept 32)
    (0.25, 1, 48),
    (0.3, 1, 44),
])
def test_dress_kept_width_rounds_halves_up(ratio, multiple, kept):
    config = tiny_llama(hidden=64, heads=4, kv_heads=2).config
    assert len(DReSS(multiple=multiple, channels="last").pruned_channels(config, ratio)) == 64 - kept


def test_mask_packing_round_trips_and_the_reference_uses_it():
    mask = torch.rand(5, 21, generator=torch.Generator().manual_seed(0)) > 0.5
    meta = pack_mask(mask)
    assert meta.shape == (5, 3) and meta.dtype == torch.uint8
    assert int(meta[0, 0]) == sum(int(mask[0, j]) << j for j in range(8))
    assert torch.equal(unpack_mask(meta, 21), mask)
    assert reference.kept_count is kept_count and reference.pack_mask is pack_mask


def test_score_kind_header_mirrors_the_python_enum():
    header = (pathlib.Path(__file__).resolve().parents[2] / "csrc" / "score_kind.h").read_text()
    body = re.search(r"enum ScoreKind : int \{(.*?)\};", header, re.S).group(1)
    entries = {name: int(value) for name, value in re.findall(r"^\s*(\w+)\s*=\s*(\d+)\s*,", body, re.M)}
    assert entries == {kind.name: kind.value for kind in ScoreKind}


def test_sparse24_mma_mask_inverts_sparse24_mma_meta():
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(6, 64, dtype=torch.bool)
    keep = torch.rand(6, 16, 4, generator=g).argsort(dim=-1)[..., :2]  # 2 random positions per group
    mask.view(6, 16, 4).scatter_(-1, keep, True)
    assert torch.equal(sparse24_mma_mask(sparse24_mma_meta(pack_mask(mask), 64), 64), mask)
