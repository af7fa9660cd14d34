/* A small step's decoder layers in one call (model/fused_layers.py drives it).

   At one token a layer is ten small steps (norm, QKV, RoPE, attention, output projection,
   residual + norm, gate/up, SiLU * up, down, residual), each a C kernel already; between them
   eager PyTorch spends a few microseconds of Python apiece (module calls, views, empty
   tensors): ~1,000 calls per step, which at one token cost more than the matmuls. This file
   strings the same kernels together, in the same order and with the same roundings, so a step
   makes one call for all its layers and its outputs equal the eager path's bit for bit (for a
   decode-only step; a prefill chunk's attention is paged_attention_runs, not SDPA). */

#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define PREFETCH_NEXT_TOKENS 8  /* up to this many tokens a product streams its weights (quantized_matmul_then) */

/* Whether w runs kquant.c's tiles at this many tokens, rather than the int4/int8 kernel. */
static inline int uses_tiles(const QuantizedWeight *w, int64_t tokens) {
    return w->tiles && (!w->codes || (w->tile_from > 0 && tokens >= w->tile_from));
}

/* y[tokens, n] = x @ W.T (+ bias, rounded after the product, as torch's `y + bias`), by the
   kernel QuantizedLinear.forward picks for this many tokens. `next` (k_next x n_next, or NULL):
   the product after this one, whose first lines the threads prefetch where both run the int4/int8
   kernel at a decode's few tokens. */
static int linear(const QuantizedWeight *w, const uint16_t *x, uint16_t *y, int64_t tokens, int64_t k, int64_t n,
                  int num_threads, const QuantizedWeight *next, int64_t k_next, int64_t n_next) {
    int ok;
    if (uses_tiles(w, tokens)) {
        ok = kq_matmul(w->tiles, x, y, tokens, 1, num_threads, w->tile_from);
    } else if (next && tokens <= PREFETCH_NEXT_TOKENS && !uses_tiles(next, tokens)) {
        const NextWeight then = {next->codes, next->scale, next->min, k_next, n_next};
        ok = quantized_matmul_then(w->codes, w->scale, w->min, x, y, tokens, k, n, 1, num_threads, &then);
    } else {
        ok = quantized_matmul(w->codes, w->scale, w->min, x, y, tokens, k, n, 1, num_threads);
    }
    if (!ok) return 0;
    if (w->bias)
        for (int64_t i = 0; i < tokens * n; i++) y[i] = float_to_bf16(bf16_to_float(y[i]) + bf16_to_float(w->bias[i % n]));
    return 1;
}

/* x: [tokens, hidden] bf16, the residual stream entering layer 0. out: the stream after the
   last layer (it holds the stream in between), RMSNorm-ed by final_norm unless that is NULL.
   cos, sin: [tokens, head_dim]. kv_cache: [layers, 2, cache_slots, kv_heads, head_dim]; the
   tokens' new k, v go to `slots`. Attention runs as paged_attention_runs lays out: block_tables
   and context_lens per run, query_starts NULL for decodes only (a run per token). Returns 0
   when out of memory. */
int fused_layers(const DecoderLayerWeights *layers, int64_t num_layers, const DecoderShape *shape,
                 const uint16_t *x, uint16_t *out, const uint16_t *final_norm, int64_t tokens,
                 const uint16_t *cos, const uint16_t *sin, uint16_t *kv_cache, int64_t cache_slots,
                 const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                 const int64_t *query_starts, int64_t num_runs, const int64_t *slots, int num_threads) {
    const int64_t hidden = shape->hidden, dim = shape->head_dim, inter = shape->intermediate;
    const int64_t q_size = shape->num_heads * dim, kv_size = shape->num_kv_heads * dim;
    const int64_t qkv_width = q_size + 2 * kv_size, cache_half = cache_slots * kv_size;
    const int64_t widest = qkv_width > 2 * inter ? qkv_width : 2 * inter;
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)(tokens * hidden));
    uint16_t *wide = malloc(sizeof(uint16_t) * (size_t)(tokens * widest));  /* qkv, then gate|up */
    uint16_t *narrow = malloc(sizeof(uint16_t) * (size_t)(tokens * (q_size > inter ? q_size : inter)));
    uint16_t *delta = malloc(sizeof(uint16_t) * (size_t)(tokens * hidden));  /* o, then down's output */
    int ok = normed && wide && narrow && delta && num_layers > 0;
    const uint16_t *stream = x;  /* out, from the first residual add on */
    for (int64_t i = 0; ok && i < num_layers; i++) {
        const DecoderLayerWeights *w = layers + i;
        uint16_t *k_cache = kv_cache + 2 * i * cache_half, *v_cache = k_cache + cache_half;
        rms_norm_bf16(stream, i ? delta : NULL, i ? out : NULL, normed, w->input_norm, tokens, hidden, shape->eps);
        ok = linear(&w->qkv, normed, wide, tokens, hidden, qkv_width, num_threads, &w->o, q_size, hidden);
        if (!ok) break;
        rope_bf16(wide, tokens, qkv_width, shape->num_heads + shape->num_kv_heads, dim, cos, sin);
        ok = paged_attention_runs(wide, qkv_width, narrow, q_size, k_cache, v_cache, block_tables, table_width,
                                  context_lens, query_starts, query_starts ? num_runs : tokens, shape->num_heads,
                                  shape->num_kv_heads, dim, shape->block_size, shape->scale, 1, num_threads,
                                  wide + q_size, qkv_width, wide + q_size + kv_size, qkv_width, slots);
        if (!ok) break;
        ok = linear(&w->o, narrow, delta, tokens, q_size, hidden, num_threads, &w->gate_up, hidden, 2 * inter);
        if (!ok) break;
        rms_norm_bf16(stream, delta, out, normed, w->post_attention_norm, tokens, hidden, shape->eps);
        stream = out;
        ok = linear(&w->gate_up, normed, wide, tokens, hidden, 2 * inter, num_threads, &w->down, inter, hidden);
        if (!ok) break;
        silu_mul_bf16(wide, narrow, tokens, inter);
        ok = linear(&w->down, narrow, delta, tokens, inter, hidden, num_threads,
                    i + 1 < num_layers ? &w[1].qkv : NULL, hidden, qkv_width);
    }
    if (ok && final_norm) {
        rms_norm_bf16(out, delta, out, out, final_norm, tokens, hidden, shape->eps);
    } else if (ok) {
        for (int64_t i = 0; i < tokens * hidden; i++)
            out[i] = float_to_bf16(bf16_to_float(out[i]) + bf16_to_float(delta[i]));
    }
    free(normed), free(wide), free(narrow), free(delta);
    return ok;
}
