"""The addressing of csrc/cuda/sparse24_linear.cu (sparse24_linear's CUDA kernel) against the
documented mma.sp fragment layout.

No GPU runs here, so this emulates one warp tile of the kernel in Python: each lane gathers its
registers from the same addresses as the CUDA code, the registers are assembled into the 16x32
sparse A, the 32x8 B and the 16x8 accumulator exactly as the PTX ISA defines the m16n8k32
.f16/.bf16 fragments and metadata (sparsity selector 0), and the lanes write their results where
the kernel writes them. The result must equal the dense masked matmul; any wrong offset, swapped
half or metadata word shows up as a mismatch. The GPU test in test_sparse_linear.py checks the
real kernel where a GPU exists.
"""
import pytest
import torch

from pyprune.ops import reference as R


def _lane_registers(values, meta, x, out0, tok0, K, k0, lane):
    """What lane ``lane`` loads for the k-step at ``k0`` (mirrors sparse24_linear_kernel)."""
    g, t = lane // 4, lane % 4
    row_lo, row_hi = out0 + g, out0 + g + 8
    vc = k0 // 2 + 2 * t
    a = [values[row_lo, vc:vc + 2], values[row_hi, vc:vc + 2],
         values[row_lo, vc + 8:vc + 10], values[row_hi, vc + 8:vc + 10]]
    mc = k0 // 16 + (t & 1)
    word = (int(meta[row_lo, mc]) & 0xFFFF) | ((int(meta[row_hi, mc]) & 0xFFFF) << 16)
    tok = tok0 + g
    b = [x[tok, k0 + 2 * t + 8 * q:k0 + 2 * t + 8 * q + 2] for q in range(4)]
    return a, word, b


def _assemble_a(regs):
    """The 16x32 dense A the hardware sees: A values per the fragment layout, positions from the
    metadata of lanes with t = 0 (columns 0..15) and t = 1 (columns 16..31)."""
    compressed = torch.zeros(16, 16)
    for lane, (a, _, _) in enumerate(regs):
        g, t = lane // 4, lane % 4
        compressed[g, 2 * t:2 * t + 2] = a[0]
        compressed[g + 8, 2 * t:2 * t + 2] = a[1]
        compressed[g, 2 * t + 8:2 * t + 10] = a[2]
        compressed[g + 8, 2 * t + 8:2 * t + 10] = a[3]
    dense = torch.zeros(16, 32)
    for lane, (_, word, _) in enumerate(regs):
        g, t = lane // 4, lane % 4
        if t > 1:
            continue  # selector 0: only threads 0 and 1 of each quad supply metadata
        for half, row in ((word & 0xFFFF, g), (word >> 16, g + 8)):
            for group in range(4):
                code = (half >> (4 * group)) & 0xF
                c = 8 * t + 2 * group  # compressed column of the group's first kept value
                dense[row, 16 * t + 4 * group + (code & 3)] = compressed[row, c]
                dense[row, 16 * t + 4 * group + (code >> 2)] = compressed[row, c + 1]
    return dense


def _assemble_b(regs):
    b_tile = torch.zeros(32, 8)
    for lane, (_, _, b) in enumerate(regs):
        g, t = lane // 4, lane % 4
        for q in range(4):
            b_tile[2 * t + 8 * q:2 * t + 8 * q + 2, g] = b[q]
    return b_tile


def emulate(x, values, meta, K):
    """y = x @ Wᵀ computed tile by tile as the kernel does (tokens and outputs multiples of 8/16)."""
    tokens, out_features = x.shape[0], values.shape[0]
    y = torch.zeros(tokens, out_features)
    for out0 in range(0, out_features, 16):
        for tok0 in range(0, tokens, 8):
            acc = torch.zeros(16, 8)
            for k0 in range(0, K, 32):
                regs = [_lane_registers(values, meta, x, out0, tok0, K, k0, lane) for lane in range(32)]
                acc += _assemble_a(regs) @ _assemble_b(regs)
            for lane in range(32):  # c0..c3 of each lane, stored as the kernel stores them
                g, t = lane // 4, lane % 4
                for e in range(2):
                    y[tok0 + 2 * t + e, out0 + g] = acc[g, 2 * t + e]
                    y[tok0 + 2 * t + e, out0 + g + 8] = acc[g + 8, 2 * t + e]
    return y


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_addressing_reproduces_the_masked_matmul(seed):
    gen = torch.Generator().manual_seed(seed)
    out_features, K, tokens = 32, 64, 16
    w = torch.randn(out_features, K, generator=gen)
    mask = R.nm_mask(torch.rand(out_features, K, generator=gen), 2, 4)  # every position pattern
    values, packed = R.nm_compress(w, mask, 2, 4)
    meta = R.sparse24_mma_meta(packed, K)
    x = torch.randn(tokens, K, generator=gen)
    torch.testing.assert_close(emulate(x, values, meta, K), x @ (w * mask).t(), rtol=1e-5, atol=1e-5)


def test_metadata_word_matches_the_ptx_example():
    # PTX/MLIR example: kept positions 0 and 2 in every group -> 0b1000 per group -> 0x8888.
    mask = torch.tensor([[True, False, True, False] * 8])
    assert int(R.sparse24_mma_meta(R.pack_mask(mask), 32)[0, 0]) & 0xFFFF == 0x8888
    positions = torch.tensor([[False, True, True, False] * 4 + [False, False, True, True] * 4])
    words = R.sparse24_mma_meta(R.pack_mask(positions), 32)[0]
    assert [int(v) & 0xFFFF for v in words] == [0x9999, 0xEEEE]
