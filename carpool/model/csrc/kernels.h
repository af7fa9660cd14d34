/* What the C kernels share: bf16 <-> fp32 as torch rounds, fused_layers' argument structs, and
   a prototype for every entry point of the library. model/cpu_kernels.py compiles every .c file
   here into one library (this header is part of its cache key) and, when it loads it, checks
   its own table of signatures, which ctypes calls with, against these prototypes. */

#ifndef CARPOOL_KERNELS_H
#define CARPOOL_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
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

static inline float half_to_float(uint16_t h) {  /* IEEE fp16 -> fp32, exact */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t u;
    if (exponent == 0x1fu) {
        u = sign | 0x7f800000u | (mantissa << 13);  /* inf, nan */
    } else if (exponent) {
        u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {  /* subnormal: normalise */
        int e = -1;
        uint32_t m = mantissa;
        do { e++; m <<= 1; } while (!(m & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f) {  /* fp32 -> IEEE fp16, to nearest even, as numpy's astype */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t exponent = (u >> 23) & 0xffu, mantissa = u & 0x7fffffu;
    if (exponent == 0xffu)  /* inf; nan stays a quiet nan with its payload's top bits */
        return (uint16_t)(sign | 0x7c00u | (mantissa ? 0x200u | (mantissa >> 13) : 0));
    if (exponent > 142) return sign | 0x7c00u;  /* >= 2^16: inf */
    if (exponent < 102) return sign;  /* < 2^-25: rounds to 0 */
    uint32_t m = mantissa | 0x800000u, shift = 13;  /* the 24-bit significand, to 11 bits */
    int32_t e = (int32_t)exponent - 112;  /* fp16's biased exponent */
    if (e <= 0) shift += (uint32_t)(1 - e), e = 0;  /* subnormal */
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    m >>= shift;
    if (rest > half || (rest == half && (m & 1))) m++;  /* a carry moves into the exponent */
    return (uint16_t)(sign + ((uint32_t)e << 10) + (e ? m - 0x400u : m));
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 values of a row of fp32 or bf16 (is_bf16) from index i, as fp32. */
static inline __m256 load8f(const void *row, int is_bf16, int64_t i) {
    if (!is_bf16) return _mm256_loadu_ps((const float *)row + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t sum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* quantize_group32 (below) with AVX2: the same codes, to nearest even; f and qi get the group's
   values and codes, 8 channels a vector, for the callers' sums. */
static inline float quantize_group32_avx2(const void *x, int64_t i, int is_bf16, int8_t *q, __m256 f[4],
                                          __m256i qi[4]) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int j = 0; j < 4; j++) f[j] = load8f(x, is_bf16, i + 8 * j);
    const __m256 top8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])));
    const float top = max8(top8);
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    for (int j = 0; j < 4; j++) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(f[j], inv));
    /* 32 int32 to 32 int8 (saturating, as AVX-512's cvtsepi32), back in order: the packs
       interleave 128-bit lanes, the permutation undoes it. */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return top / 127.f;
}

/* The activations' int8 codes as unsigned q + 128 (`vpmaddubsw` takes its unsigned operand first), in
   a new buffer; NULL when out of memory. */
static inline uint8_t *flipped_codes(const int8_t *q, int64_t count) {
    uint8_t *flipped = malloc((size_t)count);
    if (flipped)
        for (int64_t i = 0; i < count; i++) flipped[i] = (uint8_t)q[i] ^ 0x80;
    return flipped;
}

/* 8 rows (`live` of them real) of one token's output at out + i (bf16 rounded to nearest even). */
static inline void store8(void *out, int64_t i, __m256 v, int64_t live, int is_bf16) {
    float rows[8];
    if (!is_bf16 && live >= 8) {
        _mm256_storeu_ps((float *)out + i, v);
        return;
    }
    _mm256_storeu_ps(rows, v);
    for (int64_t r = 0; r < live && r < 8; r++) {
        if (is_bf16) ((uint16_t *)out)[i + r] = float_to_bf16(rows[r]);
        else ((float *)out)[i + r] = rows[r];
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* 16 values of fp32 or bf16 (is_bf16) from index i, as fp32. */
static inline __m512 load16(const void *x, int64_t i, int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* A group of 32 activations from index i rounded to int8 at q: codes round(x * 127 / max|x|),
   to nearest even. Gives the values (lo, hi: channels 0..15, 16..31) and codes as vectors, for
   the callers' sums; returns the group's scale, max|x| / 127. */
static inline float quantize_group32(const void *x, int64_t i, int is_bf16, int8_t *q, __m512 *lo, __m512 *hi,
                                     __m512i *qlo, __m512i *qhi) {
    *lo = load16(x, i, is_bf16), *hi = load16(x, i + 16, is_bf16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(*lo), _mm512_abs_ps(*hi)));
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    *qlo = _mm512_cvtps_epi32(_mm512_mul_ps(*lo, inv));
    *qhi = _mm512_cvtps_epi32(_mm512_mul_ps(*hi, inv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(*qlo));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(*qhi));
    return top / 127.f;
}

/* 16 rows of one token's output at out + i (fp32 or bf16, rounded to nearest even as torch
   does); the rows past `live` (a last, partial block of rows) are not written. */
/* Four int8 activations (one quad) in every 32-bit lane: a broadcast from memory. Copied to an
   array first, gcc read the quads into general registers and moved each over. */
static inline __m512i quad_at(const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, sizeof quad);
    return _mm512_set1_epi32(quad);
}

static inline void store16(void *out, int64_t i, __m512 v, int64_t live, int is_bf16) {
    const __mmask16 mask = live >= 16 ? 0xffff : (__mmask16)((1u << live) - 1);
    if (!is_bf16) {
        _mm512_mask_storeu_ps((float *)out + i, mask, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_mask_storeu_epi16((uint16_t *)out + i, mask, _mm512_cvtepi32_epi16(rounded));
}
#endif

#if defined(__AMX_TILE__)
/* AMX's tile configuration (palette 1): rows and bytes per row of each of the 8 tiles. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
#endif

/* Blocks of output rows handed to a parallel region's threads: thread t first takes the blocks
   schedule(static) would give it (a contiguous share, the first blocks % shares one longer), in
   order, one sequential stream; done with them, it takes the last untaken blocks of the other
   shares, from their ends. With a static split alone, a decode step's two threads waited for
   each other at the end of every product (13% of their time: perf, the embedded model, Zen 4),
   whichever one the memory served slower that time. Each share is one word, next | end << 32,
   claimed with an atomic add from the front (its owner) or a subtraction from the back (a
   thief): the two can never take one block. Threads past MAX_SHARES own nothing and only take. */
#define MAX_SHARES 64

typedef struct {
    struct { _Alignas(64) int64_t word; } share[MAX_SHARES];
    int count;
} BlockShares;

static inline void share_blocks(BlockShares *s, int64_t blocks, int num_threads) {
    s->count = num_threads < 1 ? 1 : num_threads < MAX_SHARES ? num_threads : MAX_SHARES;
    const int64_t each = blocks / s->count, longer = blocks % s->count;
    for (int64_t t = 0, at = 0; t < s->count; t++) {
        const int64_t end = at + each + (t < longer);
        s->share[t].word = at | end << 32;
        at = end;
    }
}

/* The next block thread `me` runs, or -1 once every block is taken. */
static inline int64_t claim_block(BlockShares *s, int me) {
    if (me < s->count) {
        const int64_t own = __atomic_fetch_add(&s->share[me].word, 1, __ATOMIC_RELAXED);
        if ((int32_t)own < (int32_t)(own >> 32)) return (int32_t)own;
    }
    for (int i = 1; i <= s->count; i++) {
        const int other = (me + i) % s->count;
        const int64_t seen = __atomic_load_n(&s->share[other].word, __ATOMIC_RELAXED);
        if ((int32_t)seen >= (int32_t)(seen >> 32)) continue;
        const int64_t old = __atomic_fetch_sub(&s->share[other].word, (int64_t)1 << 32, __ATOMIC_RELAXED);
        if ((int32_t)old < (int32_t)(old >> 32)) return (int32_t)(old >> 32) - 1;
    }
    return -1;
}

/* The layout of fused_layers' arguments (model/fused_layers.py mirrors these as ctypes Structures). */

/* A weight in kquant.c's form: w = (d * sc) * (q - offset) + m_sign * (m * mn), per row; with
   `lookup`, q = IQ4_CODES[the stored 4-bit code] (the IQ4 types' table), an 8-bit code. `next`:
   the rows after these n, another part in its own form (a fused q/k/v whose v has wider codes). */
typedef struct KQuantWeight {
    const uint8_t *lo, *hi;   /* the 4-bit plane (bits 8: the codes as bytes), the top bits' fields */
    const int8_t *sc, *mn;    /* per sub_size (16 or 32) input channels, or NULL (1) */
    const uint16_t *d, *m;    /* fp16 per super-block of input channels; m NULL: no min term */
    int64_t n, k, bits, offset, super_size, lookup, sub_size;
    float m_sign;
    const struct KQuantWeight *next;  /* NULL: none */
} KQuantWeight;

/* GGUF's IQ4_NL / IQ4_XS table (gguf.quants.IQ4_NL.kvalues) as 8-bit codes, value + 128: a 4-bit
   code of those types stands for the int8 value IQ4_CODES[code] - 128. */
static const uint8_t IQ4_CODES[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* A linear layer's weight: packed for quantized_matmul (min NULL: int8), and/or in kquant.c's
   form (`tiles`: the same codes viewed so, or a GGUF's own K-quant codes with `codes` NULL), which
   runs from `tile_from` tokens (0: never; a K-quant's integer kernel below it), with an optional
   bf16 bias: the kernels the eager layer (QuantizedLinear) would pick. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scale, *min, *bias;
    const KQuantWeight *tiles;
    int64_t tile_from;
} QuantizedWeight;

/* The int4/int8 weight a step multiplies next (see quantized_matmul_then). */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scale, *min;
    int64_t k, n;
} NextWeight;

typedef struct {
    const uint16_t *input_norm, *post_attention_norm;
    QuantizedWeight qkv, o, gate_up, down;
} DecoderLayerWeights;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} DecoderShape;


/* The library's entry points: model/cpu_kernels.py reads these prototypes. */

int quant_gemv_supported(void);
int quant_amx_supported(void);
int quantized_matmul(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                     int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads);
int quantized_matmul_using(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                           int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads, int64_t amx_from);
int quantized_matmul_then(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                          int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads, const NextWeight *next);
int kq_supported(void);
int kq_gemm_supported(void);
/* GOP/s of vpdpbusd alone on num_threads threads (0 without AVX512-VNNI): the integer kernel's bound. */
float int8_peak_gops(int num_threads);
void kq_rows(const KQuantWeight *w, const int64_t *rows, int64_t count, void *out, int is_bf16);
/* Rows of a GGUF tensor's blocks into `out`'s packed arrays (written through, zeroed by the caller). */
int kq_pack(const uint8_t *blocks, int64_t row_stride, int qtype, const int64_t *rows, int64_t count,
            const KQuantWeight *out, int64_t first_row, int num_threads);
int kq_matmul(const KQuantWeight *w, const void *x, void *out, int64_t tokens, int is_bf16, int num_threads,
              int64_t tile_from);
void bf16_tiles_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *tiles);
int bf16_tiles_supported(void);
int bf16_tiles_matmul(const uint16_t *tiles, const uint16_t *x, uint16_t *out, int64_t tokens, int64_t n, int64_t k,
                      int num_threads, int64_t amx_from);
int paged_attention_runs(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                         void *k_cache, void *v_cache, const int64_t *block_tables,
                         int64_t table_width, const int64_t *context_lens, const int64_t *query_starts,
                         int64_t num_runs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int is_bf16, int num_threads,
                         const void *k_new, int64_t k_stride, const void *v_new, int64_t v_stride,
                         const int64_t *slots);
int paged_decode_attention(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                           void *k_cache, void *v_cache, const int64_t *block_tables,
                           int64_t table_width, const int64_t *context_lens, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int is_bf16, int num_threads,
                           const void *k_new, int64_t k_stride, const void *v_new, int64_t v_stride,
                           const int64_t *slots);
void rms_norm_bf16(const uint16_t *x, const uint16_t *delta, uint16_t *x_out, uint16_t *out,
                   const uint16_t *weight, int64_t rows, int64_t dim, float eps);
void rope_bf16(uint16_t *qk, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
               const uint16_t *cos, const uint16_t *sin);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter);
void row_max(const float *x, const int64_t *rows, int64_t count, int64_t n, float *values, int64_t *indices,
             int num_threads);
int fused_layers(const DecoderLayerWeights *layers, int64_t num_layers, const DecoderShape *shape,
                 const uint16_t *x, uint16_t *out, const uint16_t *final_norm, int64_t tokens,
                 const uint16_t *cos, const uint16_t *sin, uint16_t *kv_cache, int64_t cache_slots,
                 const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                 const int64_t *query_starts, int64_t num_runs, const int64_t *slots, int num_threads);

#endif
