"""The Hugging Face folder path: tiny random Llama / Qwen2 checkpoints written by the test."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from carpool.engine import LLMEngine
from carpool.model.loader import load_model
from carpool.harness.synthetic import SyntheticBatches
from tests.helpers import run_greedy

VOCAB = 49152  # the embedded model's tokenizer is saved beside the weights


def write_checkpoint(folder, kind: str, tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=50000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random init is too tame to tell layouts apart; make logits spread
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval()
    # Small shards so the index-file path is exercised.
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="2MB")
    tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_checkpoint_matches_transformers(tmp_path, kind, engine_fp32):
    ref = write_checkpoint(tmp_path, kind, engine_fp32.tokenizer)
    assert (tmp_path / "model.safetensors.index.json").exists()
    engine = LLMEngine(model=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20)
    assert engine.model_config.attention_bias == (kind == "qwen2")
    prompts = [engine.tokenizer.encode(p) for p in ("Hello there, friend", "1 2 3 4 5 6 7 8 9 10 11 12")]
    ours = run_greedy(engine, prompts, 12)
    for ids, mine in zip(prompts, ours):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        assert mine == out[0, len(ids):].tolist()
    manual = SyntheticBatches(engine)
    try:
        ours_logits = manual.run([(manual.new(prompts[1]), len(prompts[1]))], all_logits=True)
    finally:
        manual.close()
    with torch.inference_mode():
        torch.testing.assert_close(ours_logits, ref(torch.tensor([prompts[1]])).logits[0],
                                   rtol=1e-4, atol=1e-4)


def test_pipeline_slice_loads_only_its_layers(tmp_path, engine_fp32):
    write_checkpoint(tmp_path, "llama", engine_fp32.tokenizer)
    stage = load_model(str(tmp_path), torch.float32, torch.device("cpu"), first_layer=1, last_layer=3)
    assert stage.num_local_layers == 2 and not stage.is_first and stage.is_last
    assert not hasattr(stage, "embed_tokens")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLMEngine(model=str(tmp_path))


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLMEngine(model=str(tmp_path / "nope"))
