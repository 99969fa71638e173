"""Shared test inputs and checks: dtypes, tolerances, devices, awkward shapes, tied scores."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

#: (implementation, device) of every native/Triton op implementation: the C++ kernel, the Triton
#: kernel in the interpreter (without a GPU) or on CUDA; IMPLEMENTATIONS adds the pure-PyTorch reference.
NATIVE_IMPLEMENTATIONS = [
    pytest.param(("cpu", "cpu"), id="cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpreter",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")),
    pytest.param(("triton", "cuda"), id="triton-cuda",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]),
]
IMPLEMENTATIONS = [pytest.param(("reference", "cpu"), id="reference")] + NATIVE_IMPLEMENTATIONS
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Value tolerances (rtol, atol) for ops whose rounding differs between implementations.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=rtol, atol=atol)


def linear_error_bound(x, weight, bias=None, dtype=None):
    """(fp64 reference of x @ weightᵀ + bias, per-element error bound) for a kernel that
    accumulates in fp32 and rounds to ``dtype`` (x's dtype by default).

    The reference uses the same, already rounded, inputs, so the only errors are the kernel's:
    rounding to the output dtype (at most twice, for a product rounded before the bias is
    added: u·(2|y| + |b|)) and the fp32 accumulation of K products, which stays below
    λ·√K·u₃₂·Σ|xᵢ·wᵢ| with high probability (Higham & Mary's probabilistic bound; λ = 2).
    """
    dtype = x.dtype if dtype is None else dtype
    x64, w64 = x.detach().double().cpu(), weight.detach().double().cpu()
    b64 = torch.zeros(w64.shape[0], dtype=torch.float64) if bias is None else bias.detach().double().cpu()
    reference = x64 @ w64.T + b64
    magnitude = x64.abs() @ w64.abs().T + b64.abs()
    terms = x64.shape[-1] + (bias is not None)
    u_out = torch.finfo(dtype).eps / 2
    u_acc = torch.finfo(torch.float32).eps / 2
    bound = u_out * (2 * reference.abs() + b64.abs()) + 2 * terms ** 0.5 * u_acc * magnitude
    return reference, bound


def assert_linear_close(actual, x, weight, bias=None):
    """actual ≈ x @ weightᵀ + bias within :func:`linear_error_bound`, with a readable failure."""
    reference, bound = linear_error_bound(x, weight, bias, actual.dtype)
    error = (actual.detach().double().cpu() - reference).abs()
    bad = error > bound
    if bool(bad.any()):
        worst = int((error / bound).argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
        raise AssertionError(f"{int(bad.sum())} of {error.numel()} outputs beyond the {actual.dtype} bound "
                             f"(K={x.shape[-1]}); worst at {at}: got {float(actual[at])}, exact "
                             f"{float(reference[at]):.6g}, error {float(error[at]):.3g} > bound {float(bound[at]):.3g}")


def tied_scores(shape, dtype=torch.float32, seed=0, levels=3):
    """Scores drawn from a few values, so ties are everywhere (and -0.0 sits next to +0.0)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, levels, shape, generator=g).to(dtype)
    negative = torch.randint(0, 2, shape, generator=g).bool()
    return torch.where((s == 0) & negative, torch.tensor(-0.0, dtype=dtype), s)


def randn(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def rand(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g)


def tiny_llama(seed=0, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=128, **config):
    """A small random-weight Llama causal LM (eval mode, fp32); ``config`` sets further LlamaConfig
    fields (e.g. tie_word_embeddings, attention_bias). Its 2048 positions (RoPE: no parameters)
    admit every command's default window, as a real model's do."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=2048, **config)
    return LlamaForCausalLM(config).eval()


def random_tokens(shape, vocab=128, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


WORDS = ["the", "a", "it", "that", "man", "woman", "house", "is", "was", "good", "fortune", "truth", "single",
         "in", "of", "must", "be", "want", "wife", "possession", "universally", "acknowledged", ",", "."]


def _word_level(words, pre_tokenizer):
    """A word-level tokenizer over ``words`` (after <unk>, <s>, </s>) splitting text by ``pre_tokenizer``."""
    from tokenizers import Tokenizer, models as tk_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")


#: the decoder families the tests build tiny random models of (see :func:`tiny_decoder`)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "opt", "gpt_neox", "mixtral",
            "qwen2_moe")


def tiny_decoder(family: str, seed=0, layers=4, hidden=64, heads=4, kv_heads=2, vocab=128, window=8,
                 attn_implementation=None):
    """A small random-weight causal LM of ``family`` (eval mode, fp32), with ``attn_implementation``
    (default: sdpa, or eager for Gemma 2 and gpt-oss, which transformers runs only eagerly). Families with sliding-window
    attention get a ``window`` shorter than the tests' sequences and alternate local and global
    layers where the family does (Gemma 2/3, Qwen2/3), so each block's attention mask and (Gemma 3)
    RoPE differ from the first block's."""
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  max_position_embeddings=256)
    gqa = dict(num_key_value_heads=kv_heads, intermediate_size=2 * hidden)
    alternating = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    configs = {
        "llama": lambda: (tf.LlamaConfig, tf.LlamaForCausalLM, dict(**common, **gqa)),
        "mistral": lambda: (tf.MistralConfig, tf.MistralForCausalLM, dict(**common, **gqa, sliding_window=window)),
        "qwen2": lambda: (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                          dict(**common, **gqa, use_sliding_window=True, sliding_window=window,
                               layer_types=alternating)),
        "qwen3": lambda: (tf.Qwen3Config, tf.Qwen3ForCausalLM,
                          dict(**common, **gqa, head_dim=32, use_sliding_window=True, sliding_window=window,
                               layer_types=alternating)),
        "gemma2": lambda: (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                           dict(**common, **gqa, head_dim=32, sliding_window=window, layer_types=alternating)),
        "gemma3": lambda: (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                           dict(**common, **gqa, head_dim=32, sliding_window=window, layer_types=alternating,
                                rope_local_base_freq=10_000.0)),
        "phi3": lambda: (tf.Phi3Config, tf.Phi3ForCausalLM, dict(**common, **gqa, pad_token_id=0)),
        "olmo2": lambda: (tf.Olmo2Config, tf.Olmo2ForCausalLM, dict(**common, **gqa, pad_token_id=0, eos_token_id=0)),
        "exaone4": lambda: (tf.Exaone4Config, tf.Exaone4ForCausalLM,
                            dict(**common, **gqa, head_dim=16, sliding_window=window, layer_types=alternating)),
        "cohere": lambda: (tf.CohereConfig, tf.CohereForCausalLM, dict(**common, **gqa, pad_token_id=0, eos_token_id=0,
                                                                       bos_token_id=1)),
        "glm4": lambda: (tf.Glm4Config, tf.Glm4ForCausalLM, dict(**common, **gqa, head_dim=16, pad_token_id=0)),
        "opt": lambda: (tf.OPTConfig, tf.OPTForCausalLM,
                        dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, ffn_dim=2 * hidden, max_position_embeddings=256,
                             word_embed_proj_dim=hidden, pad_token_id=1)),
        "gpt_neox": lambda: (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,
                             dict(**common, intermediate_size=2 * hidden)),
        "mixtral": lambda: (tf.MixtralConfig, tf.MixtralForCausalLM,
                            dict(**common, **gqa, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": lambda: (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                              dict(**common, **gqa, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden)),
        "gpt_oss": lambda: (tf.GptOssConfig, tf.GptOssForCausalLM,
                            dict(**common, num_key_value_heads=kv_heads, head_dim=16, intermediate_size=32,
                                 num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                                 layer_types=alternating, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
        "llama4": lambda: (tf.Llama4TextConfig, tf.Llama4ForCausalLM,
                           dict(**common, num_key_value_heads=kv_heads, head_dim=16, intermediate_size=32,
                                intermediate_size_mlp=2 * hidden, num_local_experts=4, num_experts_per_tok=1,
                                interleave_moe_layer_step=1, attention_chunk_size=window)),
        **_hybrid_configs(tf, common, gqa),
    }
    if family not in configs:
        raise ValueError(f"family must be one of {', '.join(configs)}; got {family!r}")
    config_class, model_class, fields = configs[family]()
    config = config_class(**fields)
    config._attn_implementation = attn_implementation or ("eager" if family in ("gemma2", "gpt_oss") else "sdpa")
    return model_class(config).eval()


#: hybrid families: a linear-attention (Gated DeltaNet), Mamba2 or short-conv mixer in some or all blocks
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "falcon_h1", "lfm2")

#: MoE families whose experts are fused 3-D parameters (one tensor per projection for all experts)
FUSED_MOE = ("gpt_oss", "llama4")


def _hybrid_configs(tf, common, gqa):
    """Config builders of the hybrid families: block 0 holds the recurrent mixer, block 1 full attention
    (Falcon-H1 runs Mamba2 beside attention in every block)."""
    hybrid = ["linear_attention", "full_attention"]
    delta = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    layers = common["num_hidden_layers"]
    return {
        "qwen3_5": lambda: (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM,
                            dict(**common, **gqa, **delta, layer_types=hybrid * (layers // 2))),
        "qwen3_5_moe": lambda: (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM,
                                dict(**common, **gqa, **delta, **moe, layer_types=hybrid * (layers // 2))),
        "qwen3_next": lambda: (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM,
                               dict(**common, **gqa, **delta, **moe, layer_types=hybrid * (layers // 2))),
        "falcon_h1": lambda: (tf.FalconH1Config, tf.FalconH1ForCausalLM,
                              dict(**common, **gqa, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                   mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)),
        "lfm2": lambda: (tf.Lfm2Config, tf.Lfm2ForCausalLM,
                         dict(**common, **gqa, layer_types=["conv", "full_attention"] * (layers // 2),
                              block_auto_adjust_ff_dim=False)),
    }


def tiny_tokenizer():
    """A word-level tokenizer over WORDS (no download needed)."""
    from tokenizers import pre_tokenizers
    return _word_level(WORDS, pre_tokenizers.Whitespace())


def text_tokenizer(texts):
    """A word-level tokenizer whose vocabulary is every word and punctuation run of ``texts``, each
    newline a token of its own: it maps nothing of ``texts`` to <unk>, and where a line breaks
    changes the tokens (no download needed)."""
    from tokenizers import Regex, pre_tokenizers
    split = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
    words = [piece for text in texts for piece, _ in split.pre_tokenize_str(text)]
    return _word_level(sorted(set(words)), split)


def kernel_dispatch_cache(monkeypatch, root, shapes, pattern="2:4"):
    """Point SparseLinear's per-user dispatch cache at the directory ``root`` and record there, as
    this environment's own measurements, the ``kernel`` implementation for layers of ``shapes`` ((out, in)
    pairs) at every token count and dtype, so that SparseLinear(implementation="auto") runs the sparse
    kernel here, as on a machine that measured it faster (a shipped table's row would be measured
    again first); returns ``root``."""
    from pyprune.nn import dispatch
    root = str(root)
    monkeypatch.setattr(dispatch, "cache_root", lambda: root)
    dispatch.record(torch.device("cpu"), {
        dispatch.entry_key(dtype, pattern, dispatch.shape_bucket(*shape), tokens): {"implementation": "kernel"}
        for dtype in DTYPES for shape in shapes for tokens in [str(b) for b in dispatch.TOKEN_BUCKETS] + ["many"]})
    return root


def tiny_bos_tokenizer():
    """:func:`tiny_tokenizer` that starts every text with ``<s>`` (as Gemma's starts with ``<bos>``)."""
    from tokenizers import processors
    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def hub_snapshot(cache, repo_id, commit, model, tokenizer=None, refs=(), card=None):
    """Lay ``model`` (and ``tokenizer``, and a ``README.md`` of text ``card``) out in the Hugging Face
    cache ``cache`` as the hub's download would: ``models--org--name/snapshots/<commit>/…``, with
    ``refs/<ref>`` holding ``commit`` for every name in ``refs`` (a branch or tag). Returns the snapshot."""
    from pathlib import Path
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    model.save_pretrained(snapshot)
    if tokenizer is not None:
        tokenizer.save_pretrained(snapshot)
    if card is not None:
        (snapshot / "README.md").write_text(card)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def offline_hub(monkeypatch, cache):
    """Point huggingface_hub at the cache ``cache`` with HF_HUB_OFFLINE=1, and make any socket
    connection of this process fail, so a test that reaches for the network fails instead."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to open a network connection")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return cache


class Stopped(Exception):
    """What stops a study mid-row in the resume tests (as a killed process would)."""


def stop_after_first_block(monkeypatch, study: str, output, **settings) -> dict:
    """Run ``study`` into ``output`` with the first saved block raising :class:`Stopped` (a run
    killed right after it), check that block is saved beside the results, then run it again with
    saving restored: the resumed result."""
    import json

    from pyprune import studies
    from pyprune.runtime import engine

    save = engine.BlockCheckpoint.save

    def save_then_stop(self, index, block, details):
        save(self, index, block, details)
        raise Stopped

    monkeypatch.setattr(engine.BlockCheckpoint, "save", save_then_stop)
    with pytest.raises(Stopped):
        studies.run(study, str(output), progress=False, **settings)
    [saves] = output.with_suffix(".checkpoints").iterdir()
    assert json.loads((saves / "blockwise.json").read_text())["finished"] == 1
    monkeypatch.setattr(engine.BlockCheckpoint, "save", save)
    return studies.run(study, str(output), progress=False, **settings)
