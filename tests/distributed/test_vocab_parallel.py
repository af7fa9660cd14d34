"""Vocabulary-parallel embedding and LM head shards, in one process (no all-reduce needed):
a vocabulary that does not divide by the TP size is padded on the last rank."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from carpool.model.llama import TensorParallel
from carpool.model.loader import load_model

VOCAB = 1001  # odd: rank 1 of 2 holds 500 real rows and one zero row


def write_odd_vocab_checkpoint(folder) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def test_shards_cover_the_vocabulary(tmp_path):
    ref = write_odd_vocab_checkpoint(tmp_path)
    embed = ref.model.embed_tokens.weight.detach()
    head = ref.lm_head.weight.detach()
    ids = torch.tensor([0, 1, 499, 500, 501, 502, 1000])
    shards = [load_model(str(tmp_path), torch.float32, torch.device("cpu"), tp=TensorParallel(r, 2))
              for r in range(2)]

    looked_up = torch.zeros(len(ids), 32)
    logits = []
    hidden = torch.randn(3, 32)
    for shard in shards:
        start, rows = shard.tp.vocab_range(VOCAB)
        assert rows == 501 and shard.lm_head.weight.shape == (501, 32)
        real = min(VOCAB, start + rows) - start
        torch.testing.assert_close(shard.lm_head.weight[:real], head[start:start + real])
        assert not shard.lm_head.weight[real:].any()  # padding rows give logits 0, cut after the gather
        shard.tp.all_reduce = lambda x: x  # no process group here: sum the ranks' partial lookups by hand
        looked_up += shard.embed_tokens(ids)
        logits.append(shard.lm_head(hidden))
    torch.testing.assert_close(looked_up, embed[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :VOCAB], hidden @ head.T)
