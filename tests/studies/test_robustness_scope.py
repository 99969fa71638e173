"""robustness.linear_arithmetic is scoped: a torch function mode of the calling thread, not a
patch of nn.Linear for the process; gone after the block, also after an exception; and the
study's results equal those of the former class patch exactly."""
import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyprune.studies import robustness
from tests.helpers import random_tokens, tiny_llama


def _layer_and_input(dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    return nn.Linear(256, 32).to(dtype), torch.randn(4, 256, generator=gen).to(dtype)


def _fp32_product(layer, x):
    return F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(x.dtype)


@pytest.fixture
def calls(monkeypatch):
    """How many linears ran through the fp32-accumulate product."""
    count = []
    product = robustness._fp32_accumulate_linear
    monkeypatch.setattr(robustness, "_fp32_accumulate_linear", lambda *args: count.append(1) or product(*args))
    return count


def test_restored_after_an_exception(calls):
    layer, x = _layer_and_input()
    expected = _fp32_product(layer, x)
    with pytest.raises(RuntimeError, match="inside"):
        with robustness.linear_arithmetic("fp32-accumulate"):
            assert torch.equal(layer(x), expected) and len(calls) == 1
            raise RuntimeError("inside")
    layer(x)
    assert len(calls) == 1 and nn.Linear.forward.__module__ == "torch.nn.modules.linear"


def test_other_threads_compute_natively(calls):
    layer, x = _layer_and_input()
    with robustness.linear_arithmetic("fp32-accumulate"):
        thread = threading.Thread(target=lambda: layer(x))
        thread.start()
        thread.join()
        assert len(calls) == 0
        layer(x)
    assert len(calls) == 1
    with robustness.linear_arithmetic("native"):
        layer(x)
    assert len(calls) == 1


def test_gradients_flow_through_the_fp32_product():
    layer, x = _layer_and_input(torch.bfloat16)
    x.requires_grad_(True)
    with robustness.linear_arithmetic("fp32-accumulate"):
        layer(x).float().sum().backward()
    expected = torch.ones(4, 32).to(torch.bfloat16).float() @ layer.weight.float()
    assert torch.equal(x.grad, expected.to(torch.bfloat16))


@contextlib.contextmanager
def _class_patch():
    """The former implementation: nn.Linear.forward replaced for the whole process."""
    def forward(self, x):
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)

    original = nn.Linear.forward
    nn.Linear.forward = forward
    try:
        yield
    finally:
        nn.Linear.forward = original


def test_study_equals_the_former_class_patch(monkeypatch):
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    calib, tokens = random_tokens((4, 16)), random_tokens((256,), seed=3)
    scoped = robustness.study(model, "taylor", 0.5, calib, tokens, eval_seqlen=32, progress=False,
                              arithmetic="fp32-accumulate")
    monkeypatch.setattr(robustness, "linear_arithmetic", lambda arithmetic: _class_patch())
    patched = robustness.study(model, "taylor", 0.5, calib, tokens, eval_seqlen=32, progress=False,
                               arithmetic="fp32-accumulate")
    for key in ("ppl_bf16", "ppl_fp16", "ppl_diff", "agreement"):
        assert scoped[key] == patched[key], key
