"""Model coverage beyond Llama/Qwen2 (issue 15, Models): generation_config.json (EOS ids and
sampling defaults), RoPE scaling through transformers' ROPE_INIT_FUNCTIONS (yarn, dynamic),
Qwen3 (q/k norm), and `org/name` from the local Hugging Face cache. Tiny random checkpoints,
fp32 greedy equality with transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from carpool.harness.synthetic import SyntheticBatches
from carpool.config import ModelConfig
from carpool.engine import LLMEngine
from carpool.llm import LLM
from carpool.model.llama import rope_parameters
from carpool.sampling_params import SamplingParams
from tests.helpers import run_greedy

VOCAB = 49152  # the embedded model's tokenizer is saved beside the weights
PROMPTS = ("Hello there, friend", "1 2 3 4 5 6 7 8 9 10 11 12")


def write_checkpoint(folder, tokenizer, arch: str = "Llama", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0)
    cfg.update(overrides)
    config = getattr(transformers, f"{arch}Config")(**cfg)  # arch "Gemma3Text": Gemma3TextConfig
    model = getattr(transformers, f"{arch.removesuffix('Text')}ForCausalLM")(config)
    with torch.no_grad():  # random init is too tame to tell layouts apart; make logits spread
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return model


def engine_for(path) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="float32", kv_cache_memory=16 << 20)


def assert_matches_transformers(engine: LLMEngine, ref: torch.nn.Module, max_tokens: int = 12) -> None:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = run_greedy(engine, prompts, max_tokens)
    for ids, mine in zip(prompts, ours):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        assert mine == out[0, len(ids):].tolist()
    manual = SyntheticBatches(engine)
    try:
        logits = manual.run([(manual.new(prompts[1]), len(prompts[1]))], all_logits=True)
    finally:
        manual.close()
    with torch.inference_mode():
        torch.testing.assert_close(logits, ref(torch.tensor([prompts[1]])).logits[0], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- generation_config.json

def test_generation_config_eos_ids_stop_generation(tmp_path, engine_fp32):
    """The Llama-3 "never stops" bug: an EOS id that only generation_config.json names ends
    a request."""
    write_checkpoint(tmp_path, engine_fp32.tokenizer)
    engine = engine_for(tmp_path)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    first = run_greedy(engine, [prompt], 3)[0][0]
    assert first not in engine.eos_token_ids
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, first]
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    engine = engine_for(tmp_path)
    assert engine.eos_token_ids == {2, first}
    req = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == [first]


def test_generation_config_sampling_defaults(tmp_path, engine_fp32):
    write_checkpoint(tmp_path, engine_fp32.tokenizer)
    assert engine_for(tmp_path).default_sampling_params() == SamplingParams()  # none given
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_new_tokens=5,
               do_sample=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20)
    sp = llm.llm_engine.default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (0.6, 0.9, 20, 1.1, 5)
    out = llm.generate(PROMPTS[0], use_tqdm=False)[0].outputs[0]  # no SamplingParams: the model's
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7  # a request's own SamplingParams win
    # vLLM's --generation-config: "vllm" ignores the model's defaults, a folder supplies its own
    assert LLMEngine(model=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20,
                     generation_config="vllm").default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    engine = LLMEngine(model=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, generation_config=str(other))
    assert engine.default_sampling_params() == SamplingParams(temperature=0.3)
    with pytest.raises(ValueError, match="generation_config"):
        LLMEngine(model=str(tmp_path), generation_config=str(tmp_path / "missing"))


# ---------------------------------------------------------------- RoPE scaling

@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_own_rope_tables_equal_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig("LlamaForCausalLM", VOCAB, 64, 128, 2, 8, 4, 8, 1e-6, 50000.0, 512, False,
                      rope_scaling=scaling)
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, max_position_embeddings=512,
                                  rope_parameters={**scaling, "rope_theta": 50000.0})
    ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, torch.device("cpu"))
    mine, scale = rope_parameters(cfg)
    assert scale == ref_scale == 1.0
    torch.testing.assert_close(mine, ref.float(), rtol=0, atol=0)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.3},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_rope_scaling_matches_transformers(tmp_path, engine_fp32, scaling):
    ref = write_checkpoint(tmp_path, engine_fp32.tokenizer, rope_scaling=scaling)
    engine = engine_for(tmp_path)
    assert engine.model_config.rope_scaling["rope_type"] == scaling["rope_type"]
    if scaling["rope_type"] == "yarn":
        assert engine.model.rotary.attention_scaling == pytest.approx(ref.model.rotary_emb.attention_scaling)
        assert engine.model.rotary.attention_scaling != 1.0
    assert_matches_transformers(engine, ref)


def test_unknown_rope_type_is_named():
    cfg = ModelConfig("LlamaForCausalLM", VOCAB, 64, 128, 2, 8, 4, 8, 1e-6, 1e4, 512, False,
                      rope_scaling={"rope_type": "wobbly", "factor": 2.0})
    with pytest.raises(ValueError, match="wobbly"):
        rope_parameters(cfg)


# ---------------------------------------------------------------- Qwen3

def test_qwen3_matches_transformers(tmp_path, engine_fp32):
    ref = write_checkpoint(tmp_path, engine_fp32.tokenizer, "Qwen3", head_dim=16, tie_word_embeddings=True,
                           rope_theta=1000000.0)
    engine = engine_for(tmp_path)
    cfg = engine.model_config
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and not cfg.attention_bias
    assert cfg.head_dim == 16
    assert_matches_transformers(engine, ref)


# ---------------------------------------------------------------- org/name from the HF cache

def test_model_from_local_hf_cache(tmp_path, monkeypatch, engine_fp32):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    ref = write_checkpoint(snapshot, engine_fp32.tokenizer)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no ./tiny-org/tiny-llama to find instead
    engine = LLMEngine(model="tiny-org/tiny-llama", dtype="float32", kv_cache_memory=16 << 20)
    assert engine.config.model == "tiny-org/tiny-llama"
    assert_matches_transformers(engine, ref, max_tokens=4)
    with pytest.raises(FileNotFoundError, match="tiny-org/not-cached"):
        LLMEngine(model="tiny-org/not-cached", dtype="float32")


# ---------------------------------------------------------------- Phi-3

def test_phi3_matches_transformers(tmp_path, engine_fp32):
    """Phi-3: the Llama layout with q/k/v and gate/up fused in the checkpoint."""
    ref = write_checkpoint(tmp_path, engine_fp32.tokenizer, "Phi3", pad_token_id=0, sliding_window=None)
    engine = engine_for(tmp_path)
    assert engine.model_config.architecture == "Phi3ForCausalLM"
    assert_matches_transformers(engine, ref)


def assert_window_matches_transformers(engine: LLMEngine, ref: torch.nn.Module, window: int) -> None:
    """Two prompts of 40+ tokens, prefilled in chunks of the engine's budget, the second one after
    the first's blocks are cached (two 16-token blocks), then 16 decodes each, one at a time and
    then both at once: greedy as transformers, whose outputs the window changes."""
    tokenizer = engine.tokenizer
    first = tokenizer.encode(" ".join(str(i) for i in range(1, 25)))
    assert len(first) >= 40 > 4 * window
    second = first[:36] + tokenizer.encode(" and then some more words to read")
    sp_tokens = 16
    outputs = []
    for prompt in (first, second):
        req = engine.add_request(prompt, SamplingParams(max_tokens=sp_tokens, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        outputs.append((prompt, req))
    assert outputs[1][1].num_cached_tokens == 32  # two full 16-token blocks of the first prompt
    unwindowed = type(ref)(type(ref.config)(**{**ref.config.to_dict(), "sliding_window": 4096}))
    unwindowed.load_state_dict(ref.state_dict())
    for prompt, req in outputs:
        x = torch.tensor([prompt])
        with torch.inference_mode():
            expected = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=sp_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert not torch.allclose(ref(x).logits, unwindowed(x).logits, atol=1e-3)  # the window matters
        assert req.output_token_ids == expected
    assert run_greedy(engine, [first, second], sp_tokens) == [req.output_token_ids for _, req in outputs]


@pytest.mark.parametrize("arch, source", [("Mistral", "hf"), *(
    pytest.param(*p, marks=pytest.mark.slow) for p in [("Phi3", "gguf"), ("Phi3", "hf"), ("Qwen2", "hf")])])
def test_sliding_window_on_llama_layers(tmp_path, engine_fp32, model_path, arch, source):
    """Mistral 7B v0.1 and Phi-3 mini 4k slide every layer (windows of 4096 and 2047 tokens); Qwen2
    with use_sliding_window the layers from max_window_layers on (here layer 1 of 2: a block table
    for layer 0 and a window table for layer 1). A window of 8 tokens."""
    from carpool.model.loader import open_gguf

    extra = {"Phi3": dict(pad_token_id=0), "Qwen2": dict(use_sliding_window=True, max_window_layers=1)}.get(arch, {})
    ref = write_checkpoint(tmp_path / "hf", engine_fp32.tokenizer, arch, sliding_window=8, **extra)
    path = tmp_path / "hf"
    if source == "gguf":  # llama.cpp's converter writes phi3's window (and slides every layer)
        path = tmp_path / "tiny-phi3.gguf"
        write_gguf(path, ref, "phi3", open_gguf(model_path), pre="llama-bpe")
    engine = LLMEngine(model=str(path), dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=6)
    cfg = engine.model_config
    assert (cfg.sliding_window, cfg.sliding_layers) == (8, [1] if arch == "Qwen2" else [0, 1])
    assert engine.block_manager.window_tables == (arch == "Qwen2")
    assert_window_matches_transformers(engine, ref, 8)


def test_llama_layers_leave_the_fast_paths_only_past_the_window(tmp_path, engine_fp32):
    """A window on Llama's layers keeps the fused and compiled paths for steps whose contexts fit
    it, where it changes nothing; a step past it runs eager, which applies it."""
    from carpool.model.attention import AttentionMetadata
    from carpool.model.paths import Path as StepPath

    write_checkpoint(tmp_path, engine_fp32.tokenizer, "Mistral", sliding_window=32)
    engine = LLMEngine(model=str(tmp_path), dtype="bfloat16", quantization="int8", kv_cache_memory=16 << 20)
    runner = engine.runner
    assert engine.model_config.llama_layers and runner.fused is not None and runner.window == 32
    meta = lambda longest: AttentionMetadata(torch.zeros(1, dtype=torch.long), 16, 1, None, None, None, [],  # noqa: E731
                                             longest_context=longest)
    assert runner.path(1, meta(32)) is StepPath.FUSED
    assert runner.path(1, meta(33)) is StepPath.EAGER


# ---------------------------------------------------------------- GGUF files of other families

_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm",
            "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # phi3: fused as in HF
# Gemma's post_attention_layernorm norms attention's output; ffn_norm is its pre-MLP norm.
_GEMMA_TO_GGUF = {**_TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(path, ref: torch.nn.Module, arch: str, tokenizer_reader=None, pre: str = "",
               vocab=None) -> None:
    """A float32 GGUF of `ref` as llama.cpp's converter lays it out (llama: Q/K rows interleaved
    per head; qwen2 / qwen3 / phi3 / gemma as in HF, phi3's QKV and gate/up fused; gemma norms
    stored as 1 + w, its sliding window and soft-caps in the metadata), with the embedded model's
    vocabulary under another pre-tokenizer name, or `vocab(writer)`'s."""
    import gguf

    cfg = ref.config
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # gemma3: the global layers'
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if gemma or (arch == "phi3" and cfg.sliding_window):  # as llama.cpp's converter writes them
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if vocab is None:
        field = lambda key: tokenizer_reader.fields[key].contents()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(field("tokenizer.ggml.tokens"))
        w.add_token_types(field("tokenizer.ggml.token_type"))
        w.add_token_merges(field("tokenizer.ggml.merges"))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        vocab(w)
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{(_GEMMA_TO_GGUF if gemma else _TO_GGUF)[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        t = t.float().numpy().copy()
        if gemma and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp's converter folds Gemma's x * (1 + w) into the stored weight
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape).copy()
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, pre", [("llama", "llama-bpe"),
                                       *(pytest.param(*p, marks=pytest.mark.slow)
                                         for p in [("phi3", "llama-bpe"), ("qwen2", "qwen2"), ("qwen3", "qwen2")])])
def test_gguf_of_other_families(tmp_path, engine_fp32, model_path, arch, pre):
    """phi3: llama.cpp keeps Phi-3's fused attn_qkv and stacks gate and up in one ffn_up."""
    from transformers import AutoTokenizer

    from carpool.model.loader import open_gguf

    extra = {"qwen3": {"head_dim": 16}, "phi3": {"pad_token_id": 0, "sliding_window": None}}.get(arch, {})
    ref = write_checkpoint(tmp_path / "hf", engine_fp32.tokenizer, arch.capitalize(), tie_word_embeddings=True,
                           **extra)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, ref, arch, open_gguf(model_path), pre=pre)
    engine = engine_for(path)
    cfg = engine.model_config
    assert cfg.architecture == f"{arch.capitalize()}ForCausalLM"
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    if arch == "phi3":
        from gguf import GGUFReader

        names = {t.name for t in GGUFReader(str(path)).tensors}
        assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_gate.weight" not in names
    # carpool's own reader knows only the embedded model's pre-tokenizers; transformers reads these
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "Hello there, friend: 12345 tokens!"
    assert engine.tokenizer.encode(text) == theirs.encode(text)
    assert_matches_transformers(engine, ref)


# ---------------------------------------------------------------- Mistral GGUF with a SentencePiece vocabulary

def spm_tokenizer(corpus: str):
    """A small SentencePiece-style BPE as Llama 2 / Mistral ship one (`▁` for spaces, byte
    fallback, <unk> <s> </s>), trained here, as transformers' LlamaTokenizer; and its vocabulary
    as llama.cpp stores it (tokenizer model "llama": tokens, scores ranking the merges, types)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    special = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator(corpus.splitlines(), trainers.BpeTrainer(
        vocab_size=1000, special_tokens=special + byte_tokens, show_progress=False))
    vocab = tok.get_vocab()
    merges = [tuple(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    hf = transformers.LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tokens = sorted(vocab, key=vocab.get)

    def write_vocab(w) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) for i in range(len(tokens))])  # a later token merges later
        w.add_token_types([2, 3, 3] + [6] * len(byte_tokens) + [1] * (len(tokens) - 3 - len(byte_tokens)))
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
    return hf, len(tokens), write_vocab


def test_mistral_gguf_with_sentencepiece_vocab(tmp_path):
    """llama.cpp converts Mistral to a `llama` GGUF (Q/K rows interleaved) with a SentencePiece
    vocabulary: carpool tokenizes as the source tokenizer and transformers' GGUF reader do, and
    generates as transformers."""
    from pathlib import Path

    from transformers import AutoTokenizer

    hf_tok, vocab_size, write_vocab = spm_tokenizer((Path(__file__).parent / "data" / "alice.txt").read_text())
    ref = write_checkpoint(tmp_path / "hf", hf_tok, "Mistral", vocab_size=vocab_size, sliding_window=None)
    path = tmp_path / "tiny-mistral.gguf"
    write_gguf(path, ref, "llama", vocab=write_vocab)
    engine = engine_for(path)
    assert engine.model_config.vocab_size == vocab_size
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in (*PROMPTS, "Alice was beginning to get very tired of sitting by her sister", "  two\nlines é"):
        ids = engine.tokenizer.encode(text)
        assert ids[0] == 1 and ids == hf_tok.encode(text) == theirs.encode(text)
    assert engine.tokenizer.decode(engine.tokenizer.encode(PROMPTS[0]), skip_special_tokens=True) == PROMPTS[0]
    assert_matches_transformers(engine, ref)


# ---------------------------------------------------------------- what does not load

def test_unsupported_architecture_is_named(tmp_path, engine_fp32):
    import gguf
    import numpy as np

    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "vocab_size": 16}))
    engine_fp32.tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'.*Gemma2ForCausalLM"):
        LLMEngine(model=str(folder), dtype="float32")
    path = tmp_path / "tiny-mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'.*gemma3"):
        LLMEngine(model=str(path), dtype="float32")
