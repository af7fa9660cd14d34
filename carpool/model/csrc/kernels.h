/* What the C kernels share: bf16 <-> fp32 as torch rounds, and the entry points that
   fused_layers.c strings together (model/cpu_kernels.py compiles every .c file here into one
   library; a change to this header changes its cache key too). */

#ifndef CARPOOL_KERNELS_H
#define CARPOOL_KERNELS_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

int quantized_matmul(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                     int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads);
int paged_attention_runs(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                         void *k_cache, void *v_cache, const int64_t *block_tables,
                         int64_t table_width, const int64_t *context_lens, const int64_t *query_starts,
                         int64_t num_runs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int is_bf16, int num_threads,
                         const void *k_new, int64_t k_stride, const void *v_new, int64_t v_stride,
                         const int64_t *slots);
void rms_norm_bf16(const uint16_t *x, const uint16_t *delta, uint16_t *x_out, uint16_t *out,
                   const uint16_t *weight, int64_t rows, int64_t dim, float eps);
void rope_bf16(uint16_t *qk, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
               const uint16_t *cos, const uint16_t *sin);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter);

#endif
