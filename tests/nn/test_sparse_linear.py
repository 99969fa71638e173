"""SparseLinear is a drop-in nn.Linear for N:M weights: same outputs as the dense masked layer on
every implementation that runs here, the state of the compressed form only, save/load through pyprune,
and sparsify_ on a pruned model."""
import json
import os

import pytest
import torch
from torch import nn

import pyprune
from pyprune import ops
from pyprune.ops import reference as R
from pyprune.nn import SparseLinear, densify_slower_, dispatch, sparsify_
from pyprune.nn.sparse import detect_pattern, sparse_layers
from pyprune.patterns import NM

from tests.helpers import DTYPES, HAS_CUDA, assert_close, assert_linear_close, random_tokens, randn, tiny_llama

PATTERNS = [(2, 4), (4, 8), (1, 4)]


def _pruned_linear(in_features, out_features, n, m, dtype=torch.float32, bias=True, seed=0):
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(randn((out_features, in_features), dtype, seed=seed))
        mask = R.nm_mask(linear.weight.float().abs(), n, m)
        linear.weight.mul_(mask)
    return linear, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("implementation", ["auto", "kernel", "dense"])
@pytest.mark.parametrize("shape", [(2, 5, 64), (1, 64), (3, 1, 64)])
def test_forward_matches_the_dense_masked_layer(dtype, n, m, implementation, shape):
    linear, _ = _pruned_linear(64, 40, n, m, dtype)
    layer = SparseLinear.from_dense(linear, (n, m), implementation=implementation)
    x = randn(shape, dtype, seed=1)
    with torch.no_grad():
        assert_linear_close(layer(x), x, linear.weight, linear.bias)
    assert layer(x).dtype == dtype and layer(x).shape == (*shape[:-1], 40)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("implementation", ["auto", "kernel", "dense"])
@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64), (64,), (2, 1, 3, 64)])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_takes_every_shape_nn_linear_takes(dtype, implementation, shape, grad):
    """A drop-in nn.Linear: an empty batch gives an empty result, a 1-D x one row of outputs, any
    leading dims are kept; the same shape, dtype and values as the dense masked nn.Linear."""
    linear, _ = _pruned_linear(64, 40, 2, 4, dtype)
    layer = SparseLinear.from_dense(linear, "2:4", implementation=implementation)
    x = randn(shape, dtype, seed=1).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, expected = layer(x), linear(x)
    assert out.shape == expected.shape == (*shape[:-1], 40) and out.dtype == expected.dtype
    if out.numel():
        assert_linear_close(out.reshape(-1, 40), x.reshape(-1, 64), linear.weight, linear.bias)
    if grad:
        out.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("in_features", [72, 600])  # 8 columns past the last 16-column block; 600 > 512
@pytest.mark.parametrize("tokens", [1, 3, 12, 17])  # the kernel takes 8 tokens at a time: 12 = 8 + 4, 17 = 8 + 8 + 1
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_kernel_implementation_column_tail_and_token_chunks(dtype, n, m, in_features, tokens, grad):
    """The sparse kernel on shapes the model layers above do not have: a column count that is not
    a multiple of 16, an odd row count, token counts past one 8-token chunk; in plain inference and
    with autograd on (the op's backward formula)."""
    linear, _ = _pruned_linear(in_features, 37, n, m, dtype)
    layer = SparseLinear.from_dense(linear, (n, m), implementation="kernel")
    x = randn((tokens, in_features), dtype, seed=3).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = layer(x)
    assert out.shape == (tokens, 37) and out.dtype == dtype
    assert_linear_close(out, x, linear.weight, linear.bias)


def test_stores_the_compressed_form_only():
    linear, mask = _pruned_linear(128, 32, 2, 4, torch.bfloat16)
    layer = SparseLinear.from_dense(linear, "2:4")
    state = layer.state_dict()
    assert set(state) == {"values", "meta", "bias", "_extra_state"}
    assert state["_extra_state"].tolist() == [2, 4, 128]
    assert state["values"].shape == (32, 64) and state["meta"].shape == (32, 16)
    assert state["meta"].dtype == torch.uint8
    assert torch.equal(layer.weight, linear.weight)
    weight_bytes = sum(state[name].numel() * state[name].element_size() for name in ("values", "meta"))
    assert weight_bytes * 16 == linear.weight.numel() * 2 * 9  # 9/16 of the dense bf16 bytes


def test_from_dense_refuses_a_weight_that_is_not_n_m_sparse_unless_given_a_mask():
    linear = nn.Linear(16, 4)
    before = linear.weight.detach().clone()
    with pytest.raises(ValueError, match="not 2:4 sparse.*mask="):
        SparseLinear.from_dense(linear, "2:4")
    mask = R.nm_mask(linear.weight.detach().abs(), 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4", mask=mask)
    assert torch.equal(layer.weight, before * mask)
    assert torch.equal(linear.weight, before)  # the source layer is untouched


def test_from_dense_keeps_every_nonzero_of_a_sparser_weight():
    linear, _ = _pruned_linear(32, 6, 1, 4)  # 1:4 also satisfies 2:4
    assert torch.equal(SparseLinear.from_dense(linear, "2:4").weight, linear.weight)


@pytest.mark.parametrize("bad,match", [
    (dict(pattern="0.5"), "pattern must be N:M"),
    (dict(pattern="3:4", implementation="fast"), "implementation must be 'auto' or one of kernel, dense"),
    (dict(pattern="2:3"), "M=3 to divide the input features"),
])
def test_bad_arguments_name_the_argument(bad, match):
    linear, _ = _pruned_linear(16, 4, 1, 4)
    with pytest.raises(ValueError, match=match):
        SparseLinear.from_dense(linear, **bad)


def test_state_dict_round_trip_and_device_dtype_moves():
    linear, _ = _pruned_linear(64, 24, 4, 8)
    layer = SparseLinear.from_dense(linear, "4:8")
    fresh = SparseLinear(64, 24, n=4, m=8)
    fresh.load_state_dict(layer.state_dict())
    x = randn((3, 64), seed=2)
    with torch.no_grad():
        assert torch.equal(fresh(x), layer(x))
        with pytest.raises(ValueError, match="x must have 64 features"):
            fresh(x[:, :32])
        half = fresh.to(torch.bfloat16)
        assert half.values.dtype == torch.bfloat16 and half.meta.dtype == torch.uint8
        expected = nn.functional.linear(x.bfloat16().float(), half.weight.float(), half.bias.float())
        assert_close(half(x.bfloat16()), expected, torch.bfloat16)
    assert "pattern=4:8" in repr(layer)


def test_load_refuses_another_pattern_or_a_broken_mask():
    linear, _ = _pruned_linear(64, 8, 4, 8)
    state = SparseLinear.from_dense(linear, "4:8").state_dict()
    with pytest.raises(ValueError, match="state is 4:8 with 64 inputs; this layer is 2:4"):
        SparseLinear(64, 8).load_state_dict(state)  # same tensor shapes as 2:4
    broken = dict(state, meta=state["meta"] | 1)  # a fifth kept element in some group
    with pytest.raises(ValueError, match="meta is not a 4:8 mask"):
        SparseLinear(64, 8, n=4, m=8).load_state_dict(broken)


def test_deepcopy_and_pickle_drop_implementation_caches():
    import copy
    import pickle
    linear, _ = _pruned_linear(64, 8, 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4", implementation="dense")
    layer._cache["dense"] = ("key", torch.zeros(1000))
    assert copy.deepcopy(layer)._cache == {} and pickle.loads(pickle.dumps(layer))._cache == {}
    assert layer._cache  # the original keeps its cache


def test_implementation_cache_follows_the_stored_weight():
    # The cache behind the GPU implementations (SparseLinear._cached, which cusparselt, cutlass and sparse24_linear
    # use), exercised on CPU: one build per state of values and meta.
    linear, _ = _pruned_linear(64, 8, 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4")
    other, _ = _pruned_linear(64, 8, 2, 4, seed=5)  # another mask
    other = SparseLinear.from_dense(other, "2:4")
    builds = []

    def cached_weight():
        def build():
            builds.append(layer.values.dtype)
            return layer.weight.clone()
        return layer._cached("test", build)

    first = cached_weight()
    assert cached_weight() is first and len(builds) == 1
    with torch.no_grad():
        layer.values.mul_(2)  # in place: seen through the version counter
    assert torch.equal(cached_weight(), 2 * first) and len(builds) == 2
    layer.values.data.mul_(0.5)  # bypasses the version counter, so the cached form is stale ...
    assert torch.equal(cached_weight(), 2 * first) and len(builds) == 2
    layer._cusparselt_algorithms[1] = 7
    layer.invalidate()  # ... until invalidate() drops every cached form
    assert layer._cache == {} and layer._cusparselt_algorithms == {}
    assert torch.equal(cached_weight(), first) and len(builds) == 3
    layer.meta.copy_(other.meta)  # a new mask for the same values
    assert torch.equal(cached_weight(), R.nm_decompress(layer.values.detach(), other.meta, 2, 4))
    assert len(builds) == 4
    layer.values = nn.Parameter(3 * other.values)  # replaced
    assert torch.equal(cached_weight(), 3 * other.weight) and len(builds) == 5
    layer.to(torch.bfloat16)  # moved
    assert cached_weight().dtype == torch.bfloat16 and builds[-1] == torch.bfloat16 and len(builds) == 6
    assert cached_weight().dtype == torch.bfloat16 and len(builds) == 6


def test_training_keeps_the_pattern():
    linear, mask = _pruned_linear(32, 8, 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4", implementation="dense")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(3):
        loss = layer(randn((4, 32), seed=step)).square().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert not layer.weight[~mask].any()
    assert not torch.equal(layer.weight, linear.weight)


def test_gpu_only_implementations_refuse_cpu_tensors_clearly():
    linear, _ = _pruned_linear(64, 16, 2, 4, torch.float16)
    layer = SparseLinear.from_dense(linear, "2:4", implementation="cusparselt")
    with torch.no_grad(), pytest.raises(RuntimeError, match="cusparselt.*needs CUDA tensors"):
        layer(randn((1, 64), torch.float16))


def _dispatch_key(layer, dtype, tokens):
    return dispatch.case_key(dtype, str(layer.pattern), layer.out_features, layer.in_features, tokens)


def test_this_machines_measurements_pick_the_implementation(tmp_path, monkeypatch):
    linear, _ = _pruned_linear(64, 16, 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4")
    cpu = torch.device("cpu")
    dispatch.record(cpu, {_dispatch_key(layer, torch.float32, 1): {"implementation": "kernel"},
                          _dispatch_key(layer, torch.float32, 4): {"implementation": "dense"},
                          _dispatch_key(layer, torch.float32, 64): {"implementation": "cutlass"}})
    # the same rows shipped for another machine of the same name (other ISA flags): never read
    other = dict(dispatch.environment(cpu), machine=dict(dispatch.machine(cpu), flags=["avx2", "f16c", "fma"]))
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"environments": [{"environment": other, "entries": {
        _dispatch_key(layer, torch.float32, t): {"implementation": "kernel"} for t in (2, 8)}}]}))
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(path))
    with torch.no_grad():
        assert layer.choose_implementation(torch.zeros(1, 64)) == "kernel"
        assert layer.choose_implementation(torch.zeros(3, 64)) == "dense"  # 3 tokens: the bucket of 4
        # the measured winner cannot run on CPU: dense, never slower than dense
        assert layer.choose_implementation(torch.zeros(33, 64)) == "dense"
        # no answer for 2 tokens (another machine's row only), for bf16, for another weight size: dense
        assert layer.choose_implementation(torch.zeros(2, 64)) == "dense"
        assert layer.decisions == {"1": ("kernel", "cache"), "4": ("dense", "cache"), "64": ("dense", "fallback"),
                                   "2": ("dense", "fallback")}
        assert layer.choose_implementation(torch.zeros(1, 64, dtype=torch.bfloat16)) == "dense"
        wide = SparseLinear.from_dense(_pruned_linear(128, 16, 2, 4)[0], "2:4")
        assert wide.choose_implementation(torch.zeros(1, 128)) == "dense"
    x = torch.zeros(4, 64, requires_grad=True)
    assert layer.choose_implementation(x) == "kernel"  # gradients always go through the kernel


def test_dispatch_keys_and_the_machine_key():
    cpu = dispatch.this_cpu()
    top = [flag for flag in dispatch.ISA_FLAGS if flag in cpu["flags"]]
    assert dispatch.device_key(torch.device("cpu")) == (
        f"cpu/{cpu['model']}/{cpu['family']}.{cpu['model_number']}.{cpu['stepping']}/"
        f"{top[-1] if top else 'no-fma'}/LLC {cpu['llc_bytes'] / 2**20:g} MiB")
    assert dispatch.machine(torch.device("cpu")) == dict(cpu, device="cpu")
    assert dispatch.case_key(torch.bfloat16, "2:4", 4096, 4096, 200) == "bfloat16|2:4|2^12x2^12|256"
    assert [dispatch.token_bucket(t) for t in (1, 2, 3, 4, 5, 8, 9, 33, 64, 65, 256, 257)] == \
        ["1", "2", "4", "4", "8", "8", "16", "64", "64", "128", "256", "many"]
    assert dispatch.shape_bucket(4096, 4096) == "2^12x2^12" and dispatch.shape_bucket(4096, 4097) == "2^12x2^13"
    # a matrix and its transpose are two cases: the kernel's speedup differs between them (compressed along in)
    assert dispatch.shape_bucket(576, 1536) == "2^10x2^11" != dispatch.shape_bucket(1536, 576)


def test_dense_implementation_caches_the_decompressed_weight_until_values_change():
    linear, _ = _pruned_linear(64, 16, 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4", implementation="dense")
    x = randn((2, 64))
    with torch.no_grad():
        first = layer(x)
        cached = layer._cache["dense"][1]
        torch.testing.assert_close(first, linear(x))
        layer(x)
        assert layer._cache["dense"][1] is cached  # decompressed once
        layer.values.mul_(2)
        torch.testing.assert_close(layer(x), 2 * linear(x) - linear.bias)


def test_detect_pattern():
    two_four, _ = _pruned_linear(32, 4, 2, 4)
    four_eight, _ = _pruned_linear(32, 4, 4, 8)
    assert detect_pattern(two_four.weight) == NM(2, 4)
    assert detect_pattern(four_eight.weight) == NM(4, 8)
    assert detect_pattern(nn.Linear(32, 4).weight) is None


def _nm_pruned_llama(n=2, m=4, seed=0):
    model = tiny_llama(seed=seed, hidden=64, intermediate=128, layers=2)
    pyprune.prune(model, "magnitude", f"{n}:{m}", progress=False)
    return model


def test_sparsify_replaces_the_pruned_layers_and_keeps_the_logits():
    model = _nm_pruned_llama()
    tokens = random_tokens((2, 12), seed=5)
    with torch.no_grad():
        before = model(input_ids=tokens).logits
    replaced = sparsify_(model, implementation="kernel")  # the sparse kernel on every machine, whatever the table says
    assert len(replaced) == 2 * 7 and set(replaced.values()) == {"2:4"}
    assert isinstance(model.model.layers[0].mlp.down_proj, SparseLinear)
    assert type(model.lm_head) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, before, rtol=1e-5, atol=1e-5)


def test_sparsify_leaves_dense_layers_alone():
    model = tiny_llama(layers=1)
    assert sparsify_(model) == {}
    assert sparsify_(model, "4:8") == {}


def test_sparsify_faster_at_converts_only_the_layers_measured_to_pay():
    """``faster_at=T``: a layer becomes SparseLinear only where this machine's measurements name a
    sparse implementation at T tokens for its dtype, pattern and weight size; ``densify_slower_`` turns
    back the SparseLinear layers that have no such answer. Logits are unchanged either way."""
    model = _nm_pruned_llama()
    tokens = random_tokens((2, 12), seed=7)
    with torch.no_grad():
        before = model(input_ids=tokens).logits
    k_proj = model.model.layers[0].self_attn.k_proj  # k and v: the only weights of 2^11 elements
    dispatch.record(torch.device("cpu"), {dispatch.case_key(torch.float32, "2:4", k_proj.out_features,
                                                            k_proj.in_features, 1): {"implementation": "kernel"}})
    paying = {f"model.layers.{i}.self_attn.{kind}_proj" for i in (0, 1) for kind in "kv"}
    assert set(sparsify_(model, faster_at=1)) == paying
    assert sparsify_(model, faster_at=4) == {}  # no answer for 4 tokens
    others = set(sparsify_(model))  # without faster_at: every remaining N:M layer
    assert len(others) == 10 and not others & paying
    assert set(densify_slower_(model, 1)) == others
    assert set(sparse_layers(model)) == paying and type(model.model.layers[0].mlp.up_proj) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, before, rtol=1e-5, atol=1e-5)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="faster_at must be"):
            sparsify_(model, faster_at=bad)
    with pytest.raises(ValueError, match="faster_at must be a token count"):
        densify_slower_(model, None)


def test_save_and_load_restore_the_same_sparse_layers(tmp_path):
    model = _nm_pruned_llama(4, 8)
    sparsify_(model)
    tokens = random_tokens((2, 12), seed=6)
    with torch.no_grad():
        before = model(input_ids=tokens).logits
    manifest = pyprune.save(model, None, str(tmp_path / "out"))
    assert len(manifest["sparse_layers"]) == 14 and not manifest["config_compatible"]
    loaded, _ = pyprune.load(str(tmp_path / "out"))
    layers = {name: type(m) for name, m in loaded.named_modules() if isinstance(m, SparseLinear)}
    assert set(layers) == set(manifest["sparse_layers"])
    assert loaded.model.layers[1].self_attn.q_proj.pattern == NM(4, 8)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, before)
    stored = os.path.getsize(tmp_path / "out" / "model.safetensors")
    dense_dir = tmp_path / "dense"
    pyprune.save(_nm_pruned_llama(4, 8), None, str(dense_dir))
    assert stored < os.path.getsize(dense_dir / "model.safetensors")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["kernel", "dense", "cusparselt", "cutlass", "sparse24_linear"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_cuda_implementations_match_the_dense_masked_layer(dtype, implementation, tokens):
    linear, _ = _pruned_linear(256, 128, 2, 4, dtype)
    layer = SparseLinear.from_dense(linear.cuda(), "2:4", implementation=implementation)
    x = randn((tokens, 256), dtype, seed=7).cuda()
    if not layer.supports(implementation, x):
        pytest.skip(f"{implementation} is not available here: {layer.unsupported_reason(implementation, x)}")
    with torch.no_grad():
        expected = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("implementation", ["cusparselt", "cutlass", "sparse24_linear"])
def test_cuda_implementation_caches_follow_value_and_mask_updates(implementation):
    # These implementations keep a form derived from values/meta (_cache[implementation]); it must be rebuilt
    # when either changes in place, and after invalidate() for writes through .data.
    dtype = torch.float16
    linear, _ = _pruned_linear(256, 128, 2, 4, dtype)
    layer = SparseLinear.from_dense(linear.cuda(), "2:4", implementation=implementation)
    other = SparseLinear.from_dense(_pruned_linear(256, 128, 2, 4, dtype, seed=5)[0].cuda(), "2:4")
    x = randn((8, 256), dtype, seed=3).cuda()
    if not layer.supports(implementation, x):
        pytest.skip(f"{implementation} is not available on this GPU: {layer.unsupported_reason(implementation, x)}")

    def expected(weight):
        return nn.functional.linear(x.float(), weight.float(), layer.bias.float())

    weight = layer.weight
    with torch.no_grad():
        torch.testing.assert_close(layer(x).float(), expected(weight), rtol=2e-2, atol=2e-2)
        entry = layer._cache[implementation]
        layer(x)
        assert layer._cache[implementation] is entry  # built once, then reused
        layer.values.mul_(2)
        torch.testing.assert_close(layer(x).float(), expected(2 * weight), rtol=2e-2, atol=2e-2)
        assert layer._cache[implementation] is not entry
        layer.values.data.mul_(0.5)  # bypasses the version counter
        if implementation != "sparse24_linear":  # (sparse24_linear caches only the mask's layout, and reads values directly)
            stale = layer(x).float()  # the cached copy still holds the doubled values
            torch.testing.assert_close(stale, expected(2 * weight), rtol=2e-2, atol=2e-2)
        layer.invalidate()
        torch.testing.assert_close(layer(x).float(), expected(weight), rtol=2e-2, atol=2e-2)
        layer.values.copy_(other.values)
        layer.meta.copy_(other.meta)  # another mask: the metadata must be rebuilt too
        torch.testing.assert_close(layer(x).float(), expected(other.weight), rtol=2e-2, atol=2e-2)


def test_model_dirs_saved_with_backend_fields_still_load(tmp_path):
    """Manifests written before the rename name each layer's implementation ``backend``, and
    sparse24_linear ``mma_sp``."""
    model = _nm_pruned_llama(4, 8)
    sparsify_(model, implementation="kernel")
    pyprune.save(model, None, str(tmp_path / "out"))
    path = tmp_path / "out" / "pyprune.json"
    manifest = json.loads(path.read_text())
    names = sorted(manifest["sparse_layers"])
    for spec in manifest["sparse_layers"].values():
        spec["backend"] = spec.pop("implementation")
    manifest["sparse_layers"][names[0]]["backend"] = "mma_sp"
    path.write_text(json.dumps(manifest))
    loaded, _ = pyprune.load(str(tmp_path / "out"))
    found = {name: m.implementation for name, m in loaded.named_modules() if isinstance(m, SparseLinear)}
    assert found == dict({name: "kernel" for name in names}, **{names[0]: "sparse24_linear"})


def test_former_names_warn_and_still_work():
    linear, _ = _pruned_linear(64, 40, 2, 4)
    with pytest.warns(DeprecationWarning, match="backend= is deprecated"):
        layer = SparseLinear.from_dense(linear, "2:4", backend="dense")
    assert layer.implementation == "dense"
    with pytest.warns(DeprecationWarning, match="backend is deprecated"):
        assert layer.backend == "dense"
    with pytest.warns(DeprecationWarning, match="backend is deprecated"):
        layer.backend = "kernel"
    assert layer.implementation == "kernel"
    with pytest.warns(DeprecationWarning, match="choose_backend is deprecated"):
        assert layer.choose_backend(torch.zeros(1, 64)) == "kernel"
    with pytest.warns(DeprecationWarning, match="'mma_sp' is now called 'sparse24_linear'"):
        assert SparseLinear(64, 8, implementation="mma_sp").implementation == "sparse24_linear"
    with pytest.warns(DeprecationWarning, match="backend= is deprecated"):
        assert len(sparsify_(_nm_pruned_llama(), backend="kernel")) == 14


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,out_features,in_features", [(1, 24, 64), (13, 130, 96), (70, 64, 512)])
def test_sparse24_compress_and_linear_cuda_kernels(dtype, tokens, out_features, in_features):
    from pyprune.ops.library import native
    if native("cuda") is None:  # setup.py builds it wherever CUDA is usable
        pytest.fail("a CUDA device is here but pyprune._C_cuda is not built; reinstall with "
                    "`pip install --no-build-isolation -e .`", pytrace=False)
    w = randn((out_features, in_features), dtype, seed=8).cuda()
    mask = R.nm_mask(w.float().abs(), 2, 4)
    values, meta = ops.sparse24_compress(w, mask)
    ref_values, packed = R.nm_compress(w, mask, 2, 4)
    assert torch.equal(values, ref_values)
    assert torch.equal(meta, R.sparse24_mma_meta(packed, in_features))
    x, bias = randn((tokens, in_features), dtype, seed=9).cuda(), randn((out_features,), dtype, seed=10).cuda()
    expected = nn.functional.linear(x.float(), (w * mask).float(), bias.float())
    torch.testing.assert_close(ops.sparse24_linear(x, values, meta, bias).float(), expected,
                               rtol=2e-2, atol=2e-2)


def test_compaction_refuses_sparse_layers():
    from pyprune.nn import keep_mlp_channels_
    model = _nm_pruned_llama()
    sparsify_(model)
    block = model.model.layers[0]
    with pytest.raises(TypeError, match="compact the model before pyprune.nn.sparsify_"):
        keep_mlp_channels_(block, torch.arange(64))
    assert isinstance(block.mlp.gate_proj, SparseLinear) and block.mlp.gate_proj.out_features == 128


@pytest.mark.parametrize("implementation", ["auto", "kernel", "dense"])
def test_traces_into_one_graph_under_torch_compile(implementation):
    linear, _ = _pruned_linear(64, 32, 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4", implementation=implementation)
    x = randn((3, 64), seed=11)
    with torch.no_grad():
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), layer(x))


def test_generate_with_sparse_layers_matches_dense():
    model = _nm_pruned_llama()
    prompt = random_tokens((1, 6), seed=12)
    dense_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    sparsify_(model, implementation="kernel")  # the sparse kernel on every machine, whatever the table says
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), dense_tokens)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (2, 3, 64), (20, 64)])  # GEMV, GEMV, tl.dot kernel
def test_kernel_implementation_runs_the_triton_kernels(dtype, shape):
    from pyprune.ops import use_implementation
    linear, _ = _pruned_linear(64, 48, 2, 4, dtype)
    layer = SparseLinear.from_dense(linear, "2:4", implementation="kernel")
    x = randn(shape, dtype, seed=13)
    with torch.no_grad(), use_implementation("triton"):
        got = layer(x)
    assert_linear_close(got, x, linear.weight, linear.bias)


def test_autocast_casts_like_nn_linear_and_trains_the_stored_values():
    linear, mask = _pruned_linear(64, 16, 2, 4)
    layer = SparseLinear.from_dense(linear, "2:4")
    x = randn((4, 64), seed=14)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        reference = linear(x)
    assert out.dtype == reference.dtype == torch.bfloat16
    assert_close(out, reference.float(), torch.bfloat16)
    out.float().sum().backward()
    assert layer.values.grad is not None and layer.values.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_forward_is_the_nm_linear_op(dtype):
    """The kernel implementation calls torch.ops.pyprune.nm_linear (on CPU tensors the dispatcher
    runs the C++ kernel: its GEMV, and BLAS on decompressed blocks past 256 tokens): the result of
    pyprune.ops.nm_linear, with and without autograd; x's dtype and device are checked first."""
    dense, _ = _pruned_linear(96, 40, 2, 4, dtype=dtype)
    layer = SparseLinear.from_dense(dense, "2:4", implementation="kernel")
    for x in (randn((3, 5, 96), dtype, seed=4), randn((257, 96), dtype, seed=5)):
        expected = ops.nm_linear(x, layer.values.detach(), layer.meta, 2, 4, layer.bias.detach())
        with torch.no_grad():
            assert torch.equal(layer(x), expected)
        out = layer(x)  # values require grad: the op's autograd formula runs
        assert out.grad_fn is not None and torch.equal(out.detach(), expected)
    with pytest.raises(TypeError, match="x must have the layer's dtype"):
        layer(x.double())
    with pytest.raises(ValueError, match="x must be on the layer's device"):
        layer(x.to("meta"))
