"""Gemma 2 and Gemma 3 (text): tiny random checkpoints as HF folders and GGUF files, fp32 greedy
equality with transformers. A sliding window of 8 tokens, shorter than the prompts and the
generations, so the window decides the outputs; chunked prefill, a cached prefix and decodes
all attend through it."""

from __future__ import annotations

import pytest
import torch
import transformers

from carpool.engine import LLMEngine
from carpool.model.attention import AttentionMetadata, PrefillChunk, masked_paged_attention
from carpool.model.compiled import can_compile
from carpool.model.loader import load_model_config
from carpool.model_runner import kv_bytes_per_token
from carpool.sampling_params import SamplingParams
from tests.model.test_hf_models import (
    assert_matches_transformers,
    assert_window_matches_transformers,
    engine_for,
    write_checkpoint,
    write_gguf,
)

WINDOW = 8


def gemma_checkpoint(folder, tokenizer, family: str, **overrides) -> torch.nn.Module:
    """Gemma 2: layer 0 slides, layer 1 is global, both soft-capped. Gemma 3: layers 0 and 2 slide
    (RoPE base 10000), 1 and 3 are global (base 1e6), q/k norms. Queries scaled by 24^-1/2, not
    head_dim's 16^-1/2 (GGUF files hold no scale: llama.cpp takes head_dim's)."""
    extra = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, pad_token_id=0,
                 tie_word_embeddings=True)
    if family == "gemma3":
        extra.update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    extra.update(overrides)
    return write_checkpoint(folder, tokenizer, "Gemma2" if family == "gemma2" else "Gemma3Text", **extra)


def gemma_gguf(tmp_path, tokenizer, model_path, family: str) -> tuple[torch.nn.Module, str]:
    """The GGUF llama.cpp's converter writes, and the HF model it came from, shaped as llama.cpp
    reads such a file: query scale head_dim^-1/2; Gemma 3's sliding layers five in six (all four
    here, so every layer rotates with the local base)."""
    from carpool.model.loader import open_gguf

    overrides = dict(query_pre_attn_scalar=16)
    if family == "gemma3":
        overrides["layer_types"] = ["sliding_attention"] * 4
    ref = gemma_checkpoint(tmp_path / "hf", tokenizer, family, **overrides)
    path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(path, ref, family, open_gguf(model_path), pre="smollm")
    return ref, str(path)


def assert_norms_hold_one_plus_w(engine: LLMEngine, ref: torch.nn.Module) -> None:
    """Gemma computes x * (1 + w): carpool's norms hold 1 + w, from HF's w or GGUF's stored 1 + w."""
    ours, theirs = engine.model.layers[1], ref.model.layers[1]
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        torch.testing.assert_close(getattr(ours, name).weight, 1 + getattr(theirs, name).weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(engine.model.norm.weight, 1 + ref.model.norm.weight, rtol=0, atol=1e-6)


def naive_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int, window: int,
                   softcap: float | None, scale: float) -> torch.Tensor:
    """One query at `position` over keys max(0, position - window + 1)..position, in fp64."""
    group = q.shape[0] // k.shape[1]
    first = max(0, position - window + 1)
    ks = k[first:position + 1].double().repeat_interleave(group, dim=1)
    vs = v[first:position + 1].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,chd->hc", q.double(), ks) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hc,chd->hd", scores.softmax(-1), vs)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_masked_paged_attention_against_a_naive_window(softcap):
    """One step of two decodes (the C kernel's metadata: no decode mask), a chunk with nothing
    cached and a chunk over a cached prefix, with 4-token blocks and a window of 5: every query
    sees its last 5 keys only, soft-capped or not, from the blocks its window reaches."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block, window, num_blocks = 4, 2, 8, 4, 5, 16
    # (tokens cached before the step, tokens in the step); decodes first, as the runner lays them out
    seqs = [(12, 1), (2, 1), (0, 7), (9, 6)]
    cache = torch.zeros(2, (num_blocks + 1) * block, kv_heads, dim)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values, slots, step_k, step_v = [], [], [], [], [], []
    for cached, n in seqs:
        used = -(-(cached + n) // block)
        table, perm = perm[:used], perm[used:]
        k, v = (torch.randn(cached + n, kv_heads, dim, generator=gen) for _ in range(2))
        seq_slots = torch.tensor([table[i // block] * block + i % block for i in range(cached + n)])
        cache[0, seq_slots[:cached]], cache[1, seq_slots[:cached]] = k[:cached], v[:cached]
        tables.append(table)
        keys.append(k)
        values.append(v)
        slots.append(seq_slots[cached:])
        step_k.append(k[cached:])
        step_v.append(v[cached:])
    width = max(len(t) for t in tables[:2])
    chunk_table = torch.tensor(tables[3])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), block_size=block, num_decodes=2,
        decode_block_tables=torch.tensor([t + [num_blocks] * (width - len(t)) for t in tables[:2]]),
        decode_context_lens=torch.tensor([13, 3]), decode_mask=None,
        prefills=[PrefillChunk(2, 9, None, None),
                  PrefillChunk(9, 15, chunk_table, torch.arange(len(tables[3]) * block)[None, :]
                               <= torch.arange(9, 15)[:, None])])
    q = torch.randn(15, heads, dim, generator=gen)
    got = masked_paged_attention(q, torch.cat(step_k), torch.cat(step_v), cache, meta, 0.3, window, softcap)
    row = 0
    for (cached, n), k, v in zip(seqs, keys, values):
        for position in range(cached, cached + n):
            expected = naive_windowed(q[row], k, v, position, window, softcap, 0.3)
            torch.testing.assert_close(got[row].double(), expected, rtol=1e-5, atol=1e-5)
            row += 1
    assert set(meta.masks) == {window}  # built once for the step, then shared by its layers
    # a window of 5 reaches at most 3 blocks of 4 back: the 13-token decode reads 3 of its 4
    assert meta.masks[window].decode_tables.shape[1] == 3 and len(meta.masks[window].chunk_tables[1]) == 3

@pytest.mark.parametrize("family, source", [
    ("gemma2", "gguf"), ("gemma3", "hf"),
    pytest.param("gemma2", "hf", marks=pytest.mark.slow), pytest.param("gemma3", "gguf", marks=pytest.mark.slow)])
def test_gemma_matches_transformers(tmp_path, engine_fp32, model_path, family, source):
    if source == "hf":
        ref = gemma_checkpoint(tmp_path, engine_fp32.tokenizer, family)
        path = str(tmp_path)
    else:
        ref, path = gemma_gguf(tmp_path, engine_fp32.tokenizer, model_path, family)
    engine = engine_for(path)
    cfg = engine.model_config
    assert cfg.architecture == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
    assert cfg.sliding_window == WINDOW and cfg.qk_norm == (family == "gemma3")
    assert cfg.sliding_layers == ([0] if family == "gemma2" else [0, 2] if source == "hf" else [0, 1, 2, 3])
    assert cfg.query_pre_attn_scalar == (24 if source == "hf" else 16)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == ((50.0, 30.0) if family == "gemma2" else (None, None))
    assert cfg.rope_local_theta == (10000.0 if family == "gemma3" else None)
    assert not cfg.llama_layers and not can_compile(engine.model)  # eager: masked attention, sandwich norms
    assert_norms_hold_one_plus_w(engine, ref)
    assert_matches_transformers(engine, ref)


@pytest.mark.slow
def test_gemma_gguf_norms_read_back_by_transformers(tmp_path, engine_fp32, model_path):
    """The GGUF writer stores Gemma's norms as llama.cpp's converter does: transformers' GGUF
    reader, which undoes llama.cpp's +1, gets the HF weights back."""
    ref, path = gemma_gguf(tmp_path, engine_fp32.tokenizer, model_path, "gemma2")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.rsplit("/", 1)[1])
    for name in ("model.layers.0.post_attention_layernorm.weight", "model.layers.0.pre_feedforward_layernorm.weight",
                 "model.layers.1.post_feedforward_layernorm.weight", "model.norm.weight"):
        torch.testing.assert_close(theirs.state_dict()[name], ref.state_dict()[name])


@pytest.mark.parametrize("family", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_sliding_window_through_chunks_prefix_cache_and_decode(tmp_path, engine_fp32, family):
    """Chunks of 6 tokens, a cached prefix, decodes: every attention path keeps each query to its
    last 8 keys, as transformers does."""
    ref = gemma_checkpoint(tmp_path, engine_fp32.tokenizer, family)
    engine = LLMEngine(model=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=6)
    assert_window_matches_transformers(engine, ref, WINDOW)


@pytest.mark.parametrize("family", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_sliding_layers_keep_only_their_window(tmp_path, engine_fp32, family):
    """The KV memory of 6 blocks of every layer: with the sliding layers' KV kept to their window
    (core/block_manager.py), a prompt longer than the whole cache would hold otherwise runs in
    16-token chunks, greedy as transformers, and gives every block back."""
    ref = gemma_checkpoint(tmp_path, engine_fp32.tokenizer, family)
    prompt = engine_fp32.tokenizer.encode(" ".join(str(i) for i in range(1, 80)))[:120]
    memory = 6 * 16 * kv_bytes_per_token(load_model_config(str(tmp_path)), torch.float32)
    args = dict(model=str(tmp_path), dtype="float32", kv_cache_memory=memory, max_num_batched_tokens=16)
    plain = LLMEngine(**args, disable_hybrid_kv_cache_manager=True)
    assert plain.block_manager.capacity_tokens == 96 and plain.block_manager.window_tables == 0
    with pytest.raises(ValueError, match="at most 95 fit"):
        plain.add_request(prompt, SamplingParams(max_tokens=16))
    engine = LLMEngine(**args)
    bm = engine.block_manager
    # Gemma 2's layers alternate, Gemma 3's here too: a block is half the layers, a window
    # table the other half, 3 of its 12 blocks the windows of a 16-token step
    assert (bm.num_blocks, bm.window_tables, bm.window, bm.capacity_tokens) == (12, 1, WINDOW, 144)
    sp_tokens = 16
    req = engine.add_request(prompt, SamplingParams(max_tokens=sp_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():  # the window tables hold at most a step's reach
            assert sum(b != bm.pad_block for b in req.window_block_ids[0]) <= 3
    x = torch.tensor([prompt])
    with torch.inference_mode():
        expected = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=sp_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert req.output_token_ids == expected
    assert bm.num_free_blocks == bm.num_blocks and bm.holders() == {}
    # a cache that holds no more than a step's windows is refused at start, naming why
    too_small = 3 * 16 * kv_bytes_per_token(load_model_config(str(tmp_path)), torch.float32, num_layers=1)
    with pytest.raises(ValueError, match="fewer than the 3 a step's sliding windows take"):
        LLMEngine(**{**args, "kv_cache_memory": too_small})
