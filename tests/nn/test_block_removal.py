"""keep_blocks_: the config of the smaller model rebuilds the same blocks (attention types, dense
or MoE MLPs) in plain transformers."""
import copy

import pytest
import torch
import transformers

from pyprune.nn.compact import keep_blocks_
from tests.helpers import random_tokens


def _roundtrip_logits(model, tmp_path, tokens):
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        return loaded, loaded(input_ids=tokens).logits


def test_qwen2_window_layers_follow_the_kept_blocks(tmp_path):
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                      sliding_window=4, max_window_layers=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    types = list(model.config.layer_types)
    keep_blocks_(model, [0, 2, 3, 4])
    assert model.config.max_window_layers == 1 and model.config.layer_types == [types[i] for i in (0, 2, 3, 4)]
    assert [block.self_attn.layer_idx for block in model.model.layers] == [0, 1, 2, 3]
    tokens = random_tokens((1, 12))
    loaded, logits = _roundtrip_logits(model, tmp_path, tokens)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=tokens).logits)


def test_qwen_moe_keeps_each_block_dense_or_sparse(tmp_path):
    config = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, decoder_sparse_step=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    sparse = [hasattr(block.mlp, "experts") for block in model.model.layers]
    assert sparse == [False, True, False, True]
    keep_blocks_(model, [0, 1, 3])  # the sparse step no longer holds: the dense block is listed instead
    assert model.config.decoder_sparse_step == 1 and model.config.mlp_only_layers == [0]
    tokens = random_tokens((1, 10))
    loaded, logits = _roundtrip_logits(model, tmp_path, tokens)
    assert [hasattr(block.mlp, "experts") for block in loaded.model.layers] == [False, True, True]
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=tokens).logits)


def test_bad_indices_leave_the_model_untouched():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    before = copy.deepcopy(model.state_dict())
    for keep, message in (([], "cannot keep nothing"), ([0, 3], r"must lie in \[0, 3\)"), ([1, 1], "distinct")):
        with pytest.raises(ValueError, match=message):
            keep_blocks_(model, keep)
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
