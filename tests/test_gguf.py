"""GGUF files (llama.cpp's ``deepseek2``) served as they are: config from the metadata, both
kv_b layouts, block types repacked losslessly or dequantized per tensor, tokenizer from the
metadata, split files, clear errors. Files are written by ``tests/gguf_files.py``; the
reference is transformers on exactly the weights the file holds (``gguf.quants.dequantize``).

Tolerances: F32 files and types dequantized at load (Q4_1, Q5_1) run fp32 dense linears:
logprobs within 1e-4 of transformers. Q8_0 / Q4_0 / Q5_0 and the K-quants Q4_K / Q5_K / Q6_K
run mlafx's int8/int4 and k8/k4 kernels, whose semantics quantize activations per group of 32
to int8 (W8A8, as llama.cpp's ``vec_dot_q8_0_q8_0``): on these random tiny models that moves
logprobs by up to ~0.08, so they are compared within 0.15 (and a divergence only at a near-tie
within 0.15)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
import transformers
from gguf_files import Q, block_type, f32_only, write_gguf
from greedy_compare import compare_greedy, random_transformers_model, transformers_greedy
from stored_generation import TINY_V3

import mlafx
from mlafx.config import ModelConfig
from mlafx.config.model_config import ConfigError
from mlafx.models.weights import WeightLoadError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
NEW = 6


def _tiny_v3(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{**TINY_V3, "moe_intermediate_size": 64, **overrides})
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    return model


def _tiny_v2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    keys = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "q_lora_rank")
    cfg = transformers.DeepseekV2Config(
        **{k: v for k, v in TINY_V3.items() if k not in keys},
        moe_intermediate_size=64,
        q_lora_rank=None,
        topk_method="greedy",
    )
    return transformers.DeepseekV2ForCausalLM(cfg).eval()


def _reference(hf_model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    ref = type(hf_model)(hf_model.config).eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ref


def _check(path, ref, tol: float, compile: bool = False) -> None:
    llm = mlafx.LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64,
                    progress=False, compile=compile)  # fmt: skip
    params = mlafx.SamplingParams(max_tokens=NEW, logprobs=1, ignore_eos=True)
    got = llm.generate([PROMPT], params)[0].outputs[0]
    got_lp = [top[t] for t, top in zip(got.token_ids, got.logprobs, strict=True)]
    with torch.no_grad():
        want, want_lp = transformers_greedy(ref, PROMPT, NEW)
    compare_greedy(want, want_lp, got.token_ids, got_lp, logprob_tol=tol, tie_tol=tol,
                   label=str(path.name))  # fmt: skip


@pytest.mark.parametrize("kv_b", ["split", "joined"])
@pytest.mark.parametrize("family", ["v3", "v2"])
def test_f32_file_matches_transformers(tmp_path, kv_b, family):
    hf = _tiny_v3() if family == "v3" else _tiny_v2()
    path = tmp_path / f"{family}-{kv_b}.gguf"
    state = write_gguf(path, hf, kv_b=kv_b, types=f32_only)
    cfg = ModelConfig.from_model(path)
    assert cfg.q_lora_rank == hf.config.q_lora_rank
    assert cfg.scoring_func == ("sigmoid" if family == "v3" else "softmax")
    assert cfg.topk_method == ("noaux_tc" if family == "v3" else "greedy")
    _check(path, _reference(hf, state), 1e-4)


@pytest.mark.parametrize(
    "qtype, tol",
    [(Q.Q8_0, 0.15), (Q.Q4_0, 0.15), (Q.Q5_0, 0.15), (Q.Q4_1, 1e-4), (Q.Q5_1, 1e-4)],
)
def test_block_types_match_transformers_on_the_dequantized_weights(tmp_path, qtype, tol, caplog):
    hf = _tiny_v3()
    path = tmp_path / f"{qtype.name}.gguf"
    state = write_gguf(path, hf, types=block_type(qtype))
    with caplog.at_level("WARNING"):
        _check(path, _reference(hf, state), tol)
    widened = "dequantized to the model dtype" in caplog.text
    assert widened == (qtype in (Q.Q4_1, Q.Q5_1)), caplog.text  # logged, by tensor name
    if widened:
        assert "blk.0.attn_q_a.weight" in caplog.text and "token_embd" not in caplog.text


# in_features of every matrix a multiple of 256 (K-quant super-blocks); the embedding too
_K_SIZES = dict(hidden_size=256, q_lora_rank=32, moe_intermediate_size=256, intermediate_size=256)


def _quantized_modules(model):
    from mlafx.models.quantized import QuantizedExperts, QuantizedLinear

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedExperts)]
    return linears, experts


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_files_run_from_their_own_bytes(tmp_path, qtype, caplog):
    """Every linear and expert stack repacked (k4 / k8, lossless: its dequantized values are
    the file's), nothing widened; the engine's tokens are transformers' on the file's values
    (W8A8 tolerance, as Q8_0 / Q4_0)."""
    from mlafx.kernels.quant_format import dequantize_weight
    from mlafx.models.loader import build_model

    hf = _tiny_v3(**_K_SIZES)
    path = tmp_path / f"{qtype.name}.gguf"
    state = write_gguf(path, hf, types=block_type(qtype))
    with caplog.at_level("WARNING"):
        model = build_model(ModelConfig.from_model(path), "float32", "auto", path, progress=False)
    assert "dequantized to the model dtype" not in caplog.text
    linears, experts = _quantized_modules(model)
    assert len(linears) >= 10 and len(experts) == 1
    want_bytes = 2496 if qtype == Q.Q4_K else 4544
    for name, module in linears:
        assert module.qweight.shape[-1] == want_bytes, name
        w = dequantize_weight(module.qweight, module.out_features, module.in_features)
        assert torch.equal(w, state[f"{name}.weight"]), name
    _check(path, _reference(hf, state), 0.15)


def test_a_q4_k_m_like_file_matches_transformers(tmp_path):
    """llama.cpp's Q4_K_M mix: Q6_K for the output and the experts' down rows, Q4_K elsewhere;
    the stack's gate/up (k4) and down (k8) keep their own formats."""
    from mlafx.kernels.quant_format import dequantize_weight
    from mlafx.models.loader import build_model

    def types(name, shape):
        if "ffn_down_exps" in name or name == "output.weight":
            return Q.Q6_K
        return block_type(Q.Q4_K)(name, shape)

    hf = _tiny_v3(**_K_SIZES)
    path = tmp_path / "q4_k_m.gguf"
    state = write_gguf(path, hf, types=types)
    model = build_model(ModelConfig.from_model(path), "float32", "auto", path, progress=False)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_qweight.shape[-1] == 2496 and experts.down_qweight.shape[-1] == 4544
    for e in range(experts.down_qweight.shape[0]):
        w = dequantize_weight(experts.down_qweight[e], 256, 256)
        assert torch.equal(w, state["model.layers.1.mlp.experts.down_proj"][e])
    _check(path, _reference(hf, state), 0.15)


def test_repacked_modules_hold_the_files_values_and_compiled_equals_reference(tmp_path):
    """A file of five block types (attention Q4_0, shared expert Q8_0, dense MLP Q5_0, expert
    gate/up Q4_K, expert down and output Q6_K): every repacked linear and stack holds exactly
    the file's values, and the compiled engine over those bytes gives the eager path's tokens."""
    from mlafx.kernels.quant_format import dequantize_weight
    from mlafx.models.loader import build_model

    def types(name, shape):
        if "ffn_down_exps" in name or name == "output.weight":
            return Q.Q6_K
        if "_exps" in name:
            return Q.Q4_K
        for part, qtype in (("attn_", Q.Q4_0), ("_shexp", Q.Q8_0), ("ffn_", Q.Q5_0)):
            if part in name:
                return block_type(qtype)(name, shape)
        return Q.F32

    hf = _tiny_v3(**_K_SIZES)
    path = tmp_path / "mixed.gguf"
    state = write_gguf(path, hf, types=types)
    model = build_model(ModelConfig.from_model(path), "float32", "auto", path, progress=False)
    linears, experts = _quantized_modules(model)
    assert len(linears) >= 10 and len(experts) == 1
    formats = set()
    for name, module in linears:
        formats.add(module.qweight.shape[-1])
        w = dequantize_weight(module.qweight, module.out_features, module.in_features)
        assert torch.equal(w, state[f"{name}.weight"]), name
    assert formats == {288, 544, 4544}  # int4, int8 (Q8_0, Q5_0), k8 (the output)
    name, module = experts[0]
    for e in range(module.gate_up_qweight.shape[0]):
        w = dequantize_weight(module.gate_up_qweight[e], 512, 256)
        assert torch.equal(w, state[f"{name}.gate_up_proj"][e])
    # the compiled engine over the same bytes: the same tokens as the eager reference path
    runs = []
    for compiled in (False, True):
        llm = mlafx.LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64,
                        progress=False, compile=compiled)  # fmt: skip
        params = mlafx.SamplingParams(max_tokens=NEW, logprobs=1, ignore_eos=True)
        runs.append(llm.generate([PROMPT], params)[0].outputs[0])
    eager, compiled_out = runs
    assert compiled_out.token_ids == eager.token_ids
    for a, b, t in zip(eager.logprobs, compiled_out.logprobs, eager.token_ids, strict=True):
        # fp32 summation order can move one activation across an int8 rounding step, which
        # these large random weights (init 0.2) amplify
        assert abs(a[t] - b[t]) < 0.05


def test_split_files_load_as_one(tmp_path):
    hf = _tiny_v3()
    path = tmp_path / "model.gguf"
    state = write_gguf(path, hf, types=f32_only, split_max_tensors=12)
    parts = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(parts) > 1
    _check(parts[0], _reference(hf, state), 1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_memory_estimate_is_the_loaded_bytes(tmp_path, qtype):
    from mlafx.config.gguf_file import open_gguf
    from mlafx.config.memory import weight_bytes
    from mlafx.models.loader import build_model

    path = tmp_path / f"{qtype.name}.gguf"
    hf = _tiny_v3() if qtype == Q.Q4_0 else _tiny_v3(**_K_SIZES)
    write_gguf(path, hf, types=block_type(qtype))
    model = build_model(ModelConfig.from_model(path), "float32", "auto", path, progress=False)
    seen, loaded = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen and "rope" not in name and "inv_freq" not in name:
            seen.add(id(t))
            loaded += t.numel() * t.element_size()
    estimate = weight_bytes(ModelConfig.from_model(path), "float32", stored=open_gguf(path))
    assert abs(estimate - loaded) <= 0.02 * loaded, (estimate, loaded)


def test_batch_invariant_mode_serves_a_k_quant_file(tmp_path):
    """A Q4_K file (k4 linears and experts): a prompt alone equals it inside a batch, chunked at
    other boundaries and partly from the prefix cache."""
    from tests.test_batch_invariant import assert_stored_checkpoint_is_invariant

    path = tmp_path / "Q4_K.gguf"
    write_gguf(path, _tiny_v3(**_K_SIZES), types=block_type(Q.Q4_K))
    rng = random.Random(5)  # 160 tokens, 256 positions
    targets = [[rng.randrange(2, 160) for _ in range(n)] for n in (9, 140)]
    others = [[rng.randrange(2, 160) for _ in range(n)] for n in (70, 2, 180, 33)]
    params = mlafx.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3)
    assert_stored_checkpoint_is_invariant(path, targets, others, 20, params)


def test_errors_name_the_tensor_or_key(tmp_path):
    import gguf

    hf = _tiny_v3()
    path = tmp_path / "ok.gguf"
    write_gguf(path, hf, types=f32_only)
    # a file missing a tensor: rewrite it without blk.0.attn_norm.weight
    reader = gguf.GGUFReader(path)
    bad = tmp_path / "missing.gguf"
    writer = gguf.GGUFWriter(bad, "deepseek2")
    for field in reader.fields.values():
        if field.name.startswith("deepseek2."):
            value = field.contents()
            writer.add_key_value(field.name, value, field.types[0])
    for t in reader.tensors:
        if t.name != "blk.0.attn_norm.weight":
            writer.add_tensor(t.name, t.data)
    writer.add_uint32("deepseek2.made_up_key", 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="deepseek2.made_up_key"):
        ModelConfig.from_model(bad)
    from mlafx.config.gguf_config import gguf_config_dict
    from mlafx.config.gguf_file import open_gguf
    from mlafx.models.deepseek import MLAForCausalLM
    from mlafx.models.gguf_checkpoint import plan_gguf

    opened = open_gguf(bad)
    del opened.metadata["deepseek2.made_up_key"]
    cfg = ModelConfig.from_hf_dict(gguf_config_dict(opened))
    with torch.device("meta"):
        model = MLAForCausalLM(cfg)
    with pytest.raises(WeightLoadError, match="blk.0.attn_norm.weight: missing"):
        plan_gguf(model, opened, cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_model(tmp_path / "nope.gguf")


def _byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, trainers

    from mlafx.config.gguf_tokenizer import pre_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer("deepseek-v3")
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "Hello world! The quick brown fox jumps over 1234 lazy dogs.",
        "def f(x):\n    return x ** 2  # squares",
        "日本語のテキストと中文文本, ünïcödé ßtraße, émigré café.",
        "Multi-head latent attention stores one latent row per token.",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        initial_alphabet=__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<think>"])
    return tok


def test_tokenizer_from_the_metadata_encodes_like_the_hf_one(tmp_path):
    import random

    from mlafx.runtime.tokenizer import load_tokenizer

    hf_tok = _byte_level_bpe()
    hf = _tiny_v3(vocab_size=hf_tok.get_vocab_size())
    path = tmp_path / "tok.gguf"
    write_gguf(path, hf, tokenizer=hf_tok, pre="deepseek-v3", chat_template=GGUF_TEMPLATE,
               special_ids={"bos": 0, "eos": 1}, add_bos=False)  # fmt: skip
    tok = load_tokenizer(path)
    rng = random.Random(0)
    pieces = ["Hello", " world", "123456", "日本語", "ünï", "\n", "  ", "<think>", "café", "x**2",
              "<｜end▁of▁sentence｜>", "🙂", "Ωmega", "\t", "fox."]  # fmt: skip
    strings = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(300)]
    for s in strings:
        want = hf_tok.encode(s).ids
        assert tok.encode(s).ids == want, s
        assert tok.decode(want, skip_special_tokens=False) == hf_tok.decode(
            want, skip_special_tokens=False
        )
    from mlafx.runtime.chat_template import load_chat_template

    template = load_chat_template(path)
    assert template.source == GGUF_TEMPLATE
    bos, eos = (hf_tok.id_to_token(i) for i in (0, 1))
    assert template.special_tokens == {"bos_token": bos, "eos_token": eos}
    assert template.render([{"role": "user", "content": "hi"}]) == f"{bos}user:hi{eos}"
    # an artifact exported from the file ships the same tokenizer and template as files
    out = tmp_path / "artifact"
    mlafx.export(str(path), str(out), format="pt2", dtype="float32", progress=False)
    shipped = load_tokenizer(out)
    assert [shipped.encode(s).ids for s in strings] == [tok.encode(s).ids for s in strings]
    assert load_chat_template(out) == template


def test_kimi_k2_pre_tokenizer_splits_as_its_tiktoken_pattern():
    """``kimi-k2`` (Kimi's tiktoken ``pat_str``, whose Han-excluding class intersections
    Oniguruma runs inside ``tokenizers``) against the same pattern in the ``regex`` module
    (tiktoken's own semantics), on a few hundred mixed-script strings."""
    import random

    import regex
    from tokenizers import Regex, pre_tokenizers

    from mlafx.config.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    (pattern,) = PRE_TOKENIZER_SPLITS["kimi-k2"]
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    reference = regex.compile(pattern, flags=regex.V1)
    rng = random.Random(0)
    pieces = ["Hello", " world", "123456", "日本語", "中文字", "ünï", "\n", "  ", "I'll", "DON'T",
              "café", "x**2", "🙂", "Ωmega", "\t", "fox.", "ÀBc", "ａｂｃ", "カタカナ", "한국어",
              "\r\n", " ?!", "abcDEF", "٣٤٥", "don't"]  # fmt: skip
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        got = [piece for piece, _ in split.pre_tokenize_str(text)]
        assert got == reference.findall(text), text


GGUF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}{{ eos_token }}"
)


def test_cli_run_prints_text_from_a_gguf(tmp_path):
    hf_tok = _byte_level_bpe()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, _tiny_v3(vocab_size=hf_tok.get_vocab_size()), tokenizer=hf_tok,
               types=block_type(Q.Q8_0), special_ids={"bos": 0, "eos": 1})  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "mlafx.cli", "run", "--model", str(path),
         "--prompt-token-ids", "5,6,7", "--max-tokens", "4", "--dtype", "float32",
         "--no-compile"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip(), out.stderr[-2000:]


def test_a_stack_of_two_block_types_is_stacked_losslessly_as_int8(tmp_path):
    from mlafx.kernels.quant_format import bits_of, dequantize_weight
    from mlafx.models.loader import build_model

    def types(name, shape):  # gate Q8_0, up and down Q4_0: the stack needs int8
        if "ffn_gate_exps" in name:
            return Q.Q8_0
        return block_type(Q.Q4_0)(name, shape)

    path = tmp_path / "mixed.gguf"
    state = write_gguf(path, _tiny_v3(), types=types)
    model = build_model(ModelConfig.from_model(path), "float32", "auto", path, progress=False)
    experts = model.model.layers[1].mlp.experts
    assert bits_of(experts.gate_up_qweight[0]) == 8
    for e in range(experts.gate_up_qweight.shape[0]):
        w = dequantize_weight(experts.gate_up_qweight[e], 2 * experts.intermediate_size, 64)
        assert torch.equal(w, state["model.layers.1.mlp.experts.gate_up_proj"][e])


def test_a_glm_4_7_flash_file_matches_transformers(tmp_path):
    """GLM-4.7-Flash as llama.cpp writes it (arch deepseek2): P != V, q LoRA, sigmoid routing
    with a correction bias, a dense first layer (from its mlp_layer_types)."""
    keys = ("first_k_dense_replace", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group")
    config = transformers.Glm4MoeLiteConfig(
        **{k: v for k, v in TINY_V3.items() if k not in keys},
        moe_intermediate_size=64,
        qk_nope_head_dim=24,
        v_head_dim=32,
        n_group=1,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
    )
    hf = random_transformers_model(config, transformers.Glm4MoeLiteForCausalLM, seed=0)
    path = tmp_path / "glm.gguf"
    state = write_gguf(path, hf, types=f32_only)
    cfg = ModelConfig.from_model(path)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim) == (24, 32)
    assert cfg.mlp_layer_types == ("dense", "sparse") and cfg.topk_method == "noaux_tc"
    _check(path, _reference(hf, state), 1e-4)


@pytest.mark.parametrize("qtype, dtype", [(Q.BF16, torch.bfloat16), (Q.F16, torch.float16)])
def test_16_bit_files_are_mapped_in_their_own_dtype(tmp_path, qtype, dtype):
    """An engine whose dtype is the file's serves its BF16 / F16 matrices over private
    mappings of the file (no copy), and computes what transformers computes on them."""
    from tests.test_mapped_weights import _mapped_from

    hf = _tiny_v3()
    path = tmp_path / f"{qtype.name}.gguf"
    state = write_gguf(path, hf, types=block_type(qtype))
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    llm = mlafx.LLM(str(path), dtype=name, block_size=4, num_kv_blocks=64, progress=False,
                    compile=False)  # fmt: skip
    attn = llm.model.model.layers[1].self_attn
    for weight in (attn.q_b_proj.weight, attn.o_proj.weight, llm.model.lm_head.weight):
        assert weight.dtype == dtype and _mapped_from(weight, path)
    # the values: the file's, exactly (the reference holds them widened to float32)
    want = state["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(attn.o_proj.weight.float(), want)
    params = mlafx.SamplingParams(max_tokens=NEW, ignore_eos=True)
    got = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len(got) == NEW
