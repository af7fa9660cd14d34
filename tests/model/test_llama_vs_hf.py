"""carpool's model against Hugging Face transformers on the embedded GGUF model."""

from __future__ import annotations

import pytest
import torch

from carpool.engine import LLMEngine
from tests.conftest import PROMPTS
from carpool.harness.synthetic import SyntheticBatches
from tests.helpers import run_greedy

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids(engine_fp32):
    return [engine_fp32.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids):
    hf_model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, like ignore_eos
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            # An explicit mask: the pad id (2) is also <|im_end|>, which generate would mask out.
            x = torch.tensor([ids])
            out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=2)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.slow
def test_greedy_fp32_matches_transformers_generate(engine_fp32, prompt_ids, hf_greedy):
    assert len(prompt_ids) >= 8
    ours = run_greedy(engine_fp32, prompt_ids, NEW_TOKENS)  # all prompts batched together
    for prompt, mine, ref in zip(PROMPTS, ours, hf_greedy):
        assert len(ref) == NEW_TOKENS
        assert mine == ref, f"prompt {prompt!r} diverged"


@pytest.mark.slow
def test_prefill_logits_fp32_close_to_transformers(engine_fp32, hf_model, prompt_ids):
    ids = prompt_ids[2]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0]
    manual = SyntheticBatches(engine_fp32)
    try:
        ours = manual.run([(manual.new(ids), len(ids))], all_logits=True)
    finally:
        manual.close()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-3)


@pytest.mark.slow
def test_bf16_top1_agreement_with_fp32(model_path, engine_fp32, prompt_ids, hf_greedy):
    """Teacher-forced over prompt + reference continuation: the bf16 argmax at each position
    agrees with fp32's on at least 95% of positions."""
    bf16 = LLMEngine(model=model_path, dtype="bfloat16", quantization="none", kv_cache_memory=64 << 20)
    agree = total = 0
    for ids, cont in zip(prompt_ids, hf_greedy):
        seq = ids + cont
        per_engine = []
        for engine in (engine_fp32, bf16):
            manual = SyntheticBatches(engine)
            try:
                per_engine.append(manual.run([(manual.new(seq), len(seq))], all_logits=True).argmax(-1))
            finally:
                manual.close()
        agree += (per_engine[0] == per_engine[1]).sum().item()
        total += len(seq)
    rate = agree / total
    print(f"bf16 top-1 agreement with fp32: {rate:.4f} over {total} positions")
    assert rate >= 0.95
