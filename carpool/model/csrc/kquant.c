/* Matrix products from GGUF's quantized weights as stored: the legacy types (Q4_0 .. Q5_1, Q8_0),
   the K-quants (Q2_K .. Q6_K), and carpool's own int4 / int8 forms, with no dense copy beside
   them (model/quant.py owns the Python side, model/gguf_codes.py the packing).

   Every type is one form (KQuantWeight in kernels.h):
       w = (d * sc) * (q - offset) + m_sign * (m * mn)
   q an unsigned code of 4..8 bits (with `lookup`, the 8-bit code a stored 4-bit one indexes in
   the IQ4 types' table, IQ4_CODES: the kernels look it up as they unpack, and from there on
   multiply it as 8-bit codes); sc, mn int8 per row and 16 or 32 input channels (`sub_size`: the
   file's own, so Q4_K's per-32 scales are not held twice; absent: 1); d, m
   fp16 per row and super-block of 32 or 256 channels (m absent: no min term). The 4-bit plane
   is quant_gemv.c's int4 layout (16 output rows per block, 4 channels of every row per 64 bytes;
   a group of 32 channels in 256 bytes, its second 16 in the high nibbles); 5 and 6 bits add
   their top P = bits - 4 bits in P vectors of 64 bytes per group: byte i of vector k holds, at
   bits P s .. P s + P - 1, those of byte i of the group's 64-byte code vector j = 8k / P + s, once
   unpacked. One 16-bit shift moves a field to bit 4 and a mask keeps it (what the shift brings
   over from the neighbouring byte falls outside the mask): 2-3 steps per 32 codes, where a 64-bit
   mask per code vector and plane took 6 per plane with AVX2 (a 2-core Zen 3: a 1B model's Q6_K
   LM head at one token 3.93 -> 2.48 ms, benchmarks/ab_kernel_shapes.py). 8 bits store the codes
   as bytes, 512 per group (quant_gemv.c's int8 layout). Unpacked, a group is 8 vectors of 64
   bytes, vector j holding channels 4j .. 4j + 3 of the 16 rows, row r's at bytes 4r .. 4r + 3.

   Two ways to multiply, by token count:
   - few tokens (decode): the weights stream from memory once and nothing is reused, so bytes
     read are the cost. The activations are quantized to int8 per group of 32 (as GGUF's Q8_0),
     and `vpdpbusd` multiplies the codes by them in integers, a group's two halves of 16 channels
     apart (each may have its own scale); the offset comes back out of the integer sums exactly
     (sum((q - o) x) = sum(q x) - o sum(x)), and the fp32 scales apply once per half. The result
     is the dequantized weights times the int8-rounded activations.
   - many tokens (prefill chunks): the work is the multiply-adds. A block of 16 rows (two at a
     time) is dequantized once into a bf16 tile in cache, then `vdpbf16ps` runs it against the
     chunk's tokens in tiles of 12, each weight vector reused 12 times from a register; the
     dequantization is spread over every token of the chunk. This is the dequantized weights,
     rounded to bf16, times the bf16 activations: the arithmetic of a bf16 GEMM. Where the CPU
     has AMX, the same tiles go through `tdpbf16ps` instead, 16 tokens at a time: a 256-token
     product of the default model's gate/up weight took 2.2 ms against 6.5 ms with vdpbf16ps
     (Intel Xeon with AMX, 2 threads; `carpool bench quant`, BENCHMARKS.md "Kernels").
     Where AVX-512 runs on 256-bit units (AMD Zen 4), `vpdpbusd`'s 64 multiply-adds an
     instruction against `vdpbf16ps`'s 32 keep the integer kernel the faster one at every size,
     and the layers run it at every size there (quant.tile_from() measures which, once per CPU).
   With AVX2 and no AVX-512 (AMD Zen 1-3, Intel before Ice Lake) the integer kernel runs on ymm
   vectors (see KQ_AVX2 below) at every size; without either, `kq_supported` says 0. Without
   AVX512-BF16 and VBMI (for the tile's byte shuffles) the integer kernel runs at every size. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_KQ 1
#define KQ_AVX512 1
#include <immintrin.h>
#include <omp.h>
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define HAVE_KQ_GEMM 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_KQ 1
#define KQ_AVX2 1
#include <immintrin.h>
#include <omp.h>
#endif

#define KQ_GROUP 32
#define KQ_ROWS 16
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 4096  /* bytes ahead: a step streams its weights from DRAM */
#endif
#ifndef KQ_TILE
#define KQ_TILE 8         /* tokens per pass of the integer kernel: accumulators in registers */
#endif
#define GEMM_TOKENS 12    /* tokens per pass of the bf16 kernel: 2 blocks x 12 = 24 accumulators */

int kq_supported(void) {
#ifdef HAVE_KQ
    return 1;
#else
    return 0;
#endif
}

int kq_gemm_supported(void) {
#ifdef HAVE_KQ_GEMM
    return 1;
#else
    return 0;
#endif
}

/* The CPU's integer multiply-add rate, the bound of the integer kernel's prefill: `vpdpbusd` on
   zmm vectors in 12 independent chains (its latency hidden), on `num_threads` threads at once, in
   GOP/s (a multiply-add is 2), the best of 3 passes; 0 without AVX512-VNNI. On a CPU that runs
   AVX-512 on 256-bit units (AMD Zen 4) a zmm instruction is two halves: the rate counts what the
   hardware delivers, whatever the width. */
#ifdef KQ_AVX512
static volatile int32_t peak_sink;  /* where the chains' results go, so that they are computed */
#endif

float int8_peak_gops(int num_threads) {
#ifdef KQ_AVX512
    const int64_t iters = 1 << 20;
    double best = 0;
    for (int pass = 0; pass < 3; pass++) {
        const double start = omp_get_wtime();
        int32_t sink = 0;
#pragma omp parallel num_threads(num_threads) reduction(^ : sink)
        {
            const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
            __m512i c[12];
            for (int i = 0; i < 12; i++) c[i] = _mm512_set1_epi32(i);  /* distinct: no chain folds into another */
            for (int64_t it = 0; it < iters; it++)
                for (int i = 0; i < 12; i++) c[i] = _mm512_dpbusd_epi32(c[i], a, b);
            for (int i = 1; i < 12; i++) c[0] = _mm512_xor_si512(c[0], c[i]);
            sink ^= _mm512_reduce_or_epi32(c[0]);
        }
        const double ops = 2.0 * 64 * 12 * (double)iters * num_threads, rate = ops / (omp_get_wtime() - start) / 1e9;
        peak_sink = sink;
        if (rate > best) best = rate;
    }
    return (float)best;
#else
    (void)num_threads;
    return 0;
#endif
}

static inline int64_t kq_groups(const KQuantWeight *w) { return w->k / KQ_GROUP; }

/* Bytes of one group of one block: the 4-bit plane or the bytes; and its codes' bits above 4, one
   64-byte vector of fields each (see the top). */
static inline int64_t code_bytes(const KQuantWeight *w) { return w->bits == 8 ? 512 : 256; }
static inline int64_t plane_count(const KQuantWeight *w) { return w->bits == 8 ? 0 : w->bits - 4; }

/* Where the sub-scales (sc, mn) of half u (channels 16u .. 16u + 15) of group bg start: 16 rows'
   worth per sub-scale, one per half or one for the group. */
static inline int64_t sub_at(const KQuantWeight *w, int64_t bg, int u) {
    return (w->sub_size == 32 ? bg : bg * 2 + u) * KQ_ROWS;
}

/* One weight's value, in the form's fp32 order (reference and embedding rows): the products
   are exact, so two roundings, as gguf-py's; no contraction into an FMA, which would make one. */
__attribute__((optimize("no-fast-math", "fp-contract=off")))
static float kq_value(const KQuantWeight *w, int64_t row, int64_t c) {
    const int64_t b = row / KQ_ROWS, r = row % KQ_ROWS, g = c / KQ_GROUP, within = c % KQ_GROUP;
    const int64_t bg = b * kq_groups(w) + g;
    int q;
    if (w->bits == 8) {
        q = w->lo[bg * 512 + (within / 4) * 64 + r * 4 + within % 4];
    } else {
        const int high = within >= 16, j = (int)(within % 16) / 4;
        const uint8_t byte = w->lo[bg * 256 + j * 64 + r * 4 + within % 4];
        q = high ? byte >> 4 : byte & 15;
        if (w->lookup) q = IQ4_CODES[q];
        const int64_t vec = high ? j + 4 : j, planes = plane_count(w);
        if (planes) {
            const uint8_t fields = w->hi[(bg * planes + vec * planes / 8) * 64 + r * 4 + within % 4];
            q |= ((fields >> (planes * (vec % (8 / planes)))) & ((1 << planes) - 1)) << 4;
        }
    }
    const int64_t supers = w->k / w->super_size, s = c / w->super_size, sub = sub_at(w, bg, (int)(within / 16)) + r;
    const float d = half_to_float(w->d[(b * supers + s) * KQ_ROWS + r]);
    float v = (d * (float)(w->sc ? w->sc[sub] : 1)) * (float)(q - w->offset);
    if (w->m) v += w->m_sign * (half_to_float(w->m[(b * supers + s) * KQ_ROWS + r]) * (float)(w->mn ? w->mn[sub] : 1));
    return v;
}

/* Rows `rows[i]` of the weight, dequantized into out [count, k] (fp32, or bf16 rounded from it):
   embedding lookups, and the reference the tests compare the packing with. */
void kq_rows(const KQuantWeight *w, const int64_t *rows, int64_t count, void *out, int is_bf16) {
    for (int64_t i = 0; i < count; i++) {
        const KQuantWeight *part = w;
        int64_t row = rows[i];
        while (row >= part->n && part->next) row -= part->n, part = part->next;
        for (int64_t c = 0; c < w->k; c++) {
            const float v = kq_value(part, row, c);
            if (is_bf16) ((uint16_t *)out)[i * w->k + c] = float_to_bf16(v);
            else ((float *)out)[i * w->k + c] = v;
        }
    }
}

#ifdef HAVE_KQ

/* ---------------------------------------------------------------- the integer kernel */

/* The activations of one call: x ~ q * scale per group of 32, with per-half sums. */
typedef struct {
    int8_t *q;       /* [tokens, k] */
    float *scale;    /* [tokens, groups] */
    float *sum;      /* [tokens, groups, 2]: the sum of x over each half (the min term) */
    int32_t *start;  /* [tokens, groups, 2]: -offset x the sum of q over each half, where each half's
                        integer sum starts, which takes the codes' offset back out */
    int64_t groups;
} HalfActivations;

static int alloc_halves(int64_t tokens, int64_t k, HalfActivations *a) {
    a->groups = k / KQ_GROUP;
    const int64_t values = tokens * a->groups;
    char *mem = malloc((sizeof(float) * 3 + sizeof(int32_t) * 2) * (size_t)values + (size_t)(tokens * k));
    if (!mem) return 0;
    a->scale = (float *)mem;
    a->sum = a->scale + values;
    a->start = (int32_t *)(a->sum + 2 * values);
    a->q = (int8_t *)(a->start + 2 * values);
    return 1;
}

#endif

#ifdef KQ_AVX512

/* The top `planes` bits of a group's codes OR-ed onto q[8] (their fields: see the top). */
static inline __attribute__((always_inline)) void group_top_bits(const KQuantWeight *w, int64_t bg, const int planes,
                                                                 __m512i q[8]) {
    const __m512i keep = _mm512_set1_epi8((char)(((1 << planes) - 1) << 4));
    for (int v = 0; v < planes; v++) {
        const __m512i fields = _mm512_loadu_si512(w->hi + (bg * planes + v) * 64);
#pragma GCC unroll 8
        for (int s = 0; s < 8 / planes; s++) {
            const int shift = 4 - planes * s, j = v * (8 / planes) + s;
            const __m512i moved = shift >= 0 ? _mm512_slli_epi16(fields, shift) : _mm512_srli_epi16(fields, -shift);
            q[j] = _mm512_or_si512(q[j], _mm512_and_si512(moved, keep));
        }
    }
}

/* A group's codes, unpacked to 8 vectors of bytes (see the top). */
static inline __attribute__((always_inline)) void group_codes(const KQuantWeight *w, int64_t bg, __m512i q[8]) {
    if (w->bits == 8) {
        for (int j = 0; j < 8; j++) q[j] = _mm512_loadu_si512(w->lo + bg * 512 + j * 64);
        return;
    }
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
        const __m512i p = _mm512_loadu_si512(w->lo + bg * 256 + j * 64);
        q[j] = _mm512_and_si512(p, nibble);
        q[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble);
    }
    if (w->lookup) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_CODES));
        for (int j = 0; j < 8; j++) q[j] = _mm512_shuffle_epi8(table, q[j]);
        return;
    }
    if (plane_count(w) == 1) group_top_bits(w, bg, 1, q);
    else if (plane_count(w) == 2) group_top_bits(w, bg, 2, q);
}

/* Super-block s of block b's fp16 factors per row, as fp32: d, and m_sign * m (0 without a min). */
static inline __attribute__((always_inline)) void super_factors(const KQuantWeight *w, int64_t b, int64_t s,
                                                                __m512 *d, __m512 *m) {
    const int64_t at = (b * (w->k / w->super_size) + s) * KQ_ROWS;
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->d + at)));
    *m = w->m ? _mm512_mul_ps(_mm512_set1_ps(w->m_sign), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->m + at))))
              : _mm512_setzero_ps();
}

/* Group bg's fp32 factors per row, from its super-block's (super_factors): scale[u] = d * sc and
   bias[u] = m_sign * m * mn for its halves u = 0, 1 (channels 0..15, 16..31). */
static inline __attribute__((always_inline)) void group_scales(const KQuantWeight *w, int64_t bg, __m512 d, __m512 m,
                                                               __m512 scale[2], __m512 bias[2]) {
    for (int u = 0; u < 2; u++) {
        if (u && w->sub_size == 32) {  /* one sub-scale for the group */
            scale[1] = scale[0], bias[1] = bias[0];
            break;
        }
        const int64_t sub = sub_at(w, bg, u);
        scale[u] = w->sc ? _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128((const __m128i *)(w->sc + sub))))) : d;
        bias[u] = w->mn ? _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128((const __m128i *)(w->mn + sub))))) : m;
    }
}

static int quantize_halves(const void *x, int is_bf16, int64_t tokens, int64_t k, int32_t offset,
                           HalfActivations *a) {
    if (!alloc_halves(tokens, k, a)) return 0;
    for (int64_t v = 0; v < tokens * a->groups; v++) {
        const int64_t i = v * KQ_GROUP;
        __m512 lo, hi;
        __m512i qlo, qhi;
        a->scale[v] = quantize_group32(x, i, is_bf16, a->q + i, &lo, &hi, &qlo, &qhi);
        a->sum[2 * v] = _mm512_reduce_add_ps(lo), a->sum[2 * v + 1] = _mm512_reduce_add_ps(hi);
        a->start[2 * v] = -offset * _mm512_reduce_add_epi32(qlo);
        a->start[2 * v + 1] = -offset * _mm512_reduce_add_epi32(qhi);
    }
    return 1;
}

/* Block b of the weight against `tn` tokens from t0. tn, and whether the form has an offset and a
   min term, are constants where inlined, so each form does only its own work: per group and
   token, 8 `vpdpbusd` (each with its quad of activations broadcast from memory) and, for the two
   halves' sums, 2 conversions and 3 multiply-adds (the weights' factors, then the token's scale),
   2 more for a min term. A super-block's factors are read once for its groups. */
static inline __attribute__((always_inline)) void int_block(const KQuantWeight *w, const HalfActivations *a,
                                                            int64_t b, int64_t t0, const int tn, const int has_offset,
                                                            const int has_min, __m512 acc[KQ_TILE]) {
    const int one_sub = w->sub_size == 32;
    const int64_t groups = a->groups, k = w->k, per_super = w->super_size / KQ_GROUP;
    for (int t = 0; t < tn; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += per_super) {
        __m512 d, m;
        super_factors(w, b, g0 / per_super, &d, &m);
        for (int64_t g = g0; g < g0 + per_super; g++) {
            const int64_t bg = b * groups + g;
            for (int64_t at = 0; at < code_bytes(w); at += 64)
                _mm_prefetch((const char *)(w->lo + bg * code_bytes(w) + KQ_PREFETCH + at), _MM_HINT_T0);
            __m512i q[8];
            __m512 scale[2], bias[2];
            group_codes(w, bg, q);
            group_scales(w, bg, d, m, scale, bias);
            for (int t = 0; t < tn; t++) {
                const int64_t v = (t0 + t) * groups + g;
                const int8_t *x = a->q + (t0 + t) * k + g * KQ_GROUP;
                __m512i h0 = has_offset ? _mm512_set1_epi32(a->start[2 * v]) : _mm512_setzero_si512();
                __m512i h1 = has_offset ? _mm512_set1_epi32(a->start[2 * v + 1]) : _mm512_setzero_si512();
                for (int j = 0; j < 4; j++) {
                    h0 = _mm512_dpbusd_epi32(h0, q[j], quad_at(x + 4 * j));
                    h1 = _mm512_dpbusd_epi32(h1, q[j + 4], quad_at(x + 16 + 4 * j));
                }
                const __m512 y = one_sub ? _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)), scale[0])
                                         : _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1), scale[1],
                                                           _mm512_mul_ps(_mm512_cvtepi32_ps(h0), scale[0]));
                acc[t] = _mm512_fmadd_ps(y, _mm512_set1_ps(a->scale[v]), acc[t]);
                if (has_min && one_sub) {
                    acc[t] = _mm512_fmadd_ps(bias[0], _mm512_set1_ps(a->sum[2 * v] + a->sum[2 * v + 1]), acc[t]);
                } else if (has_min) {
                    acc[t] = _mm512_fmadd_ps(bias[0], _mm512_set1_ps(a->sum[2 * v]), acc[t]);
                    acc[t] = _mm512_fmadd_ps(bias[1], _mm512_set1_ps(a->sum[2 * v + 1]), acc[t]);
                }
            }
        }
    }
}

#define INT_BLOCK_CASES(OFFSET, MIN)                                                   \
    switch (tn) {                                                                      \
        case 8: int_block(w, &a, b, t0, 8, OFFSET, MIN, acc); break;                    \
        case 7: int_block(w, &a, b, t0, 7, OFFSET, MIN, acc); break;                    \
        case 6: int_block(w, &a, b, t0, 6, OFFSET, MIN, acc); break;                    \
        case 5: int_block(w, &a, b, t0, 5, OFFSET, MIN, acc); break;                    \
        case 4: int_block(w, &a, b, t0, 4, OFFSET, MIN, acc); break;                    \
        case 3: int_block(w, &a, b, t0, 3, OFFSET, MIN, acc); break;                    \
        case 2: int_block(w, &a, b, t0, 2, OFFSET, MIN, acc); break;                    \
        default: int_block(w, &a, b, t0, 1, OFFSET, MIN, acc); break;                   \
    }

static int int_matmul(const KQuantWeight *w, const void *x, void *out, int64_t tokens, int is_bf16, int num_threads) {
    HalfActivations a;
    if (!quantize_halves(x, is_bf16, tokens, w->k, (int32_t)w->offset, &a)) return 0;
    const int64_t n = w->n;
    const int has_offset = w->offset != 0, has_min = w->m != NULL;
    BlockShares shares;
    share_blocks(&shares, (n + KQ_ROWS - 1) / KQ_ROWS, num_threads);
#pragma omp parallel num_threads(num_threads)
    for (int64_t b; (b = claim_block(&shares, omp_get_thread_num())) >= 0;) {
        for (int64_t t0 = 0; t0 < tokens; t0 += KQ_TILE) {
            __m512 acc[KQ_TILE];
            const int64_t tn = tokens - t0 < KQ_TILE ? tokens - t0 : KQ_TILE;
            if (has_offset) {
                if (has_min) { INT_BLOCK_CASES(1, 1) } else { INT_BLOCK_CASES(1, 0) }
            } else {
                if (has_min) { INT_BLOCK_CASES(0, 1) } else { INT_BLOCK_CASES(0, 0) }
            }
            for (int64_t t = 0; t < tn; t++) store16(out, (t0 + t) * n + b * KQ_ROWS, acc[t], n - b * KQ_ROWS, is_bf16);
        }
    }
    free(a.scale);
    return 1;
}

#endif

#ifdef KQ_AVX2

/* AVX2 without AVX-512 (AMD Zen 1-3, Intel before Ice Lake): the integer kernel's arithmetic on
   ymm vectors. A block of 16 rows is taken as two halves of 8 (bytes 32h .. 32h + 31 of each
   64-byte vector, a 32-bit lane per row), and `vpdpbusd` as `vpmaddubsw` (u8 x s8 pairs to
   saturating int16) then `vpmaddwd` by ones (int16 pairs to int32), as quant_gemv.c's AVX2 kernel
   does. Codes of up to 6 bits times activations (-127..127) stay below the saturation in int16
   (CodeWidth says how many products add there before widening). 8-bit codes (0..255) would not,
   so they are taken as signed codes q - 128 (Q8_0's own values), multiplied as |q - 128| x
   sign(x, q - 128) (llama.cpp's trick: the magnitude is at most 128 and the signed side is the
   activation's, which never meets -128), each product widened on its own; the 128 comes
   back out with the offset (sum((q - o) x) = sum((q - 128) x) + (128 - o) sum(x)). The integer
   sums are the AVX-512 kernel's exactly, the fp32 steps its steps in its order; only the
   activations' fp32 sums over a half add in another order. On a 2-core AMD EPYC (Zen 3) a
   1B model's gate/up weight (2048 x 16384) took, in Q4_K / Q6_K: 1.25 / 1.68 ms at one token
   against 4.43 ms for bf16 F.linear, and 92 / 79 ms at 256 tokens against 835 ms in bf16 and
   177 ms in fp32 (`carpool bench quant`, BENCHMARKS.md "Kernels"); with the tokens in pairs
   (block_tile) a 1B up projection (8192 x 2048) in Q4_K took 37.1 ms at 256 tokens against 43.7
   before, on another Zen 3 (benchmarks/ab_kernel_shapes.py). */

#define HALF_TILE 4  /* tokens per pass: 8 codes, 4 accumulators and the temporaries fill 16 ymm */

/* The top `planes` bits of half h of a group's codes OR-ed onto q[8] (their fields: see the top). */
static inline __attribute__((always_inline)) void half_top_bits(const KQuantWeight *w, int64_t bg, int h,
                                                                const int planes, __m256i q[8]) {
    const __m256i keep = _mm256_set1_epi8((char)(((1 << planes) - 1) << 4));
    for (int v = 0; v < planes; v++) {
        const __m256i fields = _mm256_loadu_si256((const __m256i *)(w->hi + (bg * planes + v) * 64 + 32 * h));
#pragma GCC unroll 8
        for (int s = 0; s < 8 / planes; s++) {
            const int shift = 4 - planes * s, j = v * (8 / planes) + s;
            const __m256i moved = shift >= 0 ? _mm256_slli_epi16(fields, shift) : _mm256_srli_epi16(fields, -shift);
            q[j] = _mm256_or_si256(q[j], _mm256_and_si256(moved, keep));
        }
    }
}

/* Half h of a group's codes (8 vectors of 32 bytes), 8-bit codes (and looked-up ones) as q - 128. */
static inline __attribute__((always_inline)) void half_codes(const KQuantWeight *w, int64_t bg, int h, __m256i q[8]) {
    if (w->bits == 8) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int j = 0; j < 8; j++)
            q[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w->lo + bg * 512 + j * 64 + 32 * h)), flip);
        return;
    }
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)(w->lo + bg * 256 + j * 64 + 32 * h));
        q[j] = _mm256_and_si256(p, nibble);
        q[j + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), nibble);
    }
    if (w->lookup) {  /* the table's values q - 128, as the 8-bit codes above */
        const __m256i values = _mm256_xor_si256(
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_CODES)), _mm256_set1_epi8((char)0x80));
        for (int j = 0; j < 8; j++) q[j] = _mm256_shuffle_epi8(values, q[j]);
        return;
    }
    if (plane_count(w) == 1) half_top_bits(w, bg, h, 1, q);
    else if (plane_count(w) == 2) half_top_bits(w, bg, h, 2, q);
}

/* Half h's fp16 super-block factors for group g of block b, as fp32: d, and m_sign * m (0 without
   a min). */
static inline __attribute__((always_inline)) void half_super(const KQuantWeight *w, int64_t b, int64_t g, int h,
                                                             __m256 *d, __m256 *m) {
    const int64_t at = (b * (w->k / w->super_size) + g * KQ_GROUP / w->super_size) * KQ_ROWS + 8 * h;
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + at)));
    *m = w->m ? _mm256_mul_ps(_mm256_set1_ps(w->m_sign), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->m + at))))
              : _mm256_setzero_ps();
}

/* group_scales for the 8 rows of half h, from the group's super-block factors (half_super). */
static inline __attribute__((always_inline)) void half_subs(const KQuantWeight *w, int64_t b, int64_t g, int h,
                                                            __m256 d, __m256 m, __m256 scale[2], __m256 bias[2]) {
    const int64_t bg = b * kq_groups(w) + g;
    for (int u = 0; u < 2; u++) {
        if (u && w->sub_size == 32) {  /* one sub-scale for the group */
            scale[1] = scale[0], bias[1] = bias[0];
            break;
        }
        const int64_t sub = sub_at(w, bg, u) + 8 * h;
        scale[u] = w->sc ? _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64((const __m128i *)(w->sc + sub))))) : d;
        bias[u] = w->mn ? _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                              _mm_loadl_epi64((const __m128i *)(w->mn + sub))))) : m;
    }
}

static inline __attribute__((always_inline)) void half_scales(const KQuantWeight *w, int64_t b, int64_t g, int h,
                                                              __m256 scale[2], __m256 bias[2]) {
    __m256 d, m;
    half_super(w, b, g, h, &d, &m);
    half_subs(w, b, g, h, d, m, scale, bias);
}

static int quantize_halves(const void *x, int is_bf16, int64_t tokens, int64_t k, int32_t offset,
                           HalfActivations *a) {
    if (!alloc_halves(tokens, k, a)) return 0;
    for (int64_t v = 0; v < tokens * a->groups; v++) {
        __m256 f[4];
        __m256i q[4];
        a->scale[v] = quantize_group32_avx2(x, v * KQ_GROUP, is_bf16, a->q + v * KQ_GROUP, f, q);
        a->sum[2 * v] = sum8(_mm256_add_ps(f[0], f[1])), a->sum[2 * v + 1] = sum8(_mm256_add_ps(f[2], f[3]));
        a->start[2 * v] = -offset * sum8i(_mm256_add_epi32(q[0], q[1]));
        a->start[2 * v + 1] = -offset * sum8i(_mm256_add_epi32(q[2], q[3]));
    }
    return 1;
}

/* How a form's codes multiply, by their width: up to 5 bits, a half-group's 4 quads add in int16
   (4 x 2 x 31 x 127 = 31,496) and widen once; 6 bits widen in pairs (2 x 2 x 63 x 127 = 32,004);
   8 bits (signed, see above) widen each product. */
typedef enum { CODES_NARROW, CODES_6BIT, CODES_8BIT } CodeWidth;

/* The integer sum of 4 quads (channels of one half of a group) for 8 rows: 8-bit codes are signed
   (q - 128) with their magnitudes in m, others unsigned. */
static inline __attribute__((always_inline)) __m256i quad_dots(const __m256i *q, const __m256i *m, const int8_t *x,
                                                               const int width) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[4];
    for (int j = 0; j < 4; j++) {
        int32_t quad;
        memcpy(&quad, x + 4 * j, sizeof quad);
        const __m256i xj = _mm256_set1_epi32(quad);
        p[j] = width == CODES_8BIT ? _mm256_maddubs_epi16(m[j], _mm256_sign_epi8(xj, q[j]))
                                   : _mm256_maddubs_epi16(q[j], xj);
    }
    if (width == CODES_8BIT)
        return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones)),
                                _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones)));
    if (width == CODES_6BIT)
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                                _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
}

/* A group's two halves' integer sums h0, h1 (8 rows) times the weights' factors. With one
   sub-scale for the group (`one_sub`) the integers add first, as the AVX-512 kernel does, and
   convert once. Every path of a form takes the same steps, so a token's output does not depend on
   the tokens beside it. */
static inline __attribute__((always_inline)) __m256 half_sums(__m256i h0, __m256i h1, const __m256 scale[2],
                                                              int one_sub) {
    if (one_sub) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(h0, h1)), scale[0]);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), scale[1], _mm256_mul_ps(_mm256_cvtepi32_ps(h0), scale[0]));
}

/* acc plus the min term: each half's bias times the activations' sum over it (`sum`: the two). */
static inline __attribute__((always_inline)) __m256 min_term(__m256 acc, const __m256 bias[2], const float *sum,
                                                             int one_sub) {
    if (one_sub) return _mm256_fmadd_ps(bias[0], _mm256_set1_ps(sum[0] + sum[1]), acc);
    acc = _mm256_fmadd_ps(bias[0], _mm256_set1_ps(sum[0]), acc);
    return _mm256_fmadd_ps(bias[1], _mm256_set1_ps(sum[1]), acc);
}

/* Half h of block b against `tn` tokens from t0: int_block's work on 8 rows. */
static inline __attribute__((always_inline)) void int_half(const KQuantWeight *w, const HalfActivations *a,
                                                           int64_t b, int h, int64_t t0, const int tn, const int width,
                                                           const int has_offset, const int has_min,
                                                           __m256 acc[HALF_TILE]) {
    const int64_t groups = a->groups, k = w->k;
    const int one_sub = w->sub_size == 32;
    for (int t = 0; t < tn; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t bg = b * groups + g;
        if (h == 0)
            for (int64_t at = 0; at < code_bytes(w); at += 64)
                _mm_prefetch((const char *)(w->lo + bg * code_bytes(w) + KQ_PREFETCH + at), _MM_HINT_T0);
        __m256i q[8], m[8];
        __m256 scale[2], bias[2];
        half_codes(w, bg, h, q);
        if (width == CODES_8BIT)
            for (int j = 0; j < 8; j++) m[j] = _mm256_abs_epi8(q[j]);
        half_scales(w, b, g, h, scale, bias);
#pragma GCC unroll 4  /* acc[] in registers: a loop would keep them in memory */
        for (int t = 0; t < tn; t++) {
            const int64_t v = (t0 + t) * groups + g;
            const int8_t *quads = a->q + (t0 + t) * k + g * KQ_GROUP;
            __m256i h0 = quad_dots(q, m, quads, width), h1 = quad_dots(q + 4, m + 4, quads + 16, width);
            if (has_offset) {
                h0 = _mm256_add_epi32(h0, _mm256_set1_epi32(a->start[2 * v]));
                h1 = _mm256_add_epi32(h1, _mm256_set1_epi32(a->start[2 * v + 1]));
            }
            acc[t] = _mm256_fmadd_ps(half_sums(h0, h1, scale, one_sub), _mm256_set1_ps(a->scale[v]), acc[t]);
            if (has_min) acc[t] = min_term(acc[t], bias, a->sum + 2 * v, one_sub);
        }
    }
}

/* One token's 16 rows of block b: int_half's sums for both halves, in its order, with the block
   streamed once, a group's activation terms read once and a super-block's factors once for its
   groups. At one token the second pass of int_half would find the block gone from L1; and with
   AVX2 the steps per byte, not the bytes, bound it (on a Zen 3 a Q4_K weight held in L3 streams at
   the rate it streams from memory): there, hoisting the factors made Q4_K's one-token products
   1.07-1.08x faster and a 1B Q4_K_M decode step 1.05x (benchmarks/ab_kernel_shapes.py, ab_kernels.py). */
static inline __attribute__((always_inline)) void int_rows1(const KQuantWeight *w, const HalfActivations *a,
                                                            int64_t b, int64_t t, const int width, const int has_offset,
                                                            const int has_min, __m256 acc[2]) {
    const int64_t groups = a->groups, k = w->k;
    const int one_sub = w->sub_size == 32;
    __m256 d[2], m[2];  /* the super-block's factors, read once for its groups */
    acc[0] = acc[1] = _mm256_setzero_ps();
    for (int64_t g = 0, next_super = 0; g < groups; g++) {
        const int64_t bg = b * groups + g, v = t * groups + g;
        if (g == next_super) {
            for (int h = 0; h < 2; h++) half_super(w, b, g, h, d + h, m + h);
            next_super += w->super_size / KQ_GROUP;
        }
        for (int64_t at = 0; at < code_bytes(w); at += 64)
            _mm_prefetch((const char *)(w->lo + bg * code_bytes(w) + KQ_PREFETCH + at), _MM_HINT_T0);
        const int8_t *quads = a->q + t * k + g * KQ_GROUP;
        const __m256 dx = _mm256_set1_ps(a->scale[v]);
        for (int h = 0; h < 2; h++) {
            __m256i q[8], mag[8];
            __m256 scale[2], bias[2];
            half_codes(w, bg, h, q);
            if (width == CODES_8BIT)
                for (int j = 0; j < 8; j++) mag[j] = _mm256_abs_epi8(q[j]);
            half_subs(w, b, g, h, d[h], m[h], scale, bias);
            __m256i h0 = quad_dots(q, mag, quads, width), h1 = quad_dots(q + 4, mag + 4, quads + 16, width);
            if (has_offset) {
                h0 = _mm256_add_epi32(h0, _mm256_set1_epi32(a->start[2 * v]));
                h1 = _mm256_add_epi32(h1, _mm256_set1_epi32(a->start[2 * v + 1]));
            }
            acc[h] = _mm256_fmadd_ps(half_sums(h0, h1, scale, one_sub), dx, acc[h]);
            if (has_min) acc[h] = min_term(acc[h], bias, a->sum + 2 * v, one_sub);
        }
    }
}

#define FORM(WIDTH, OFFSET, MIN) ((WIDTH) * 4 + (OFFSET) * 2 + (MIN))  /* a form's index */

/* From HALF_TILE + 1 tokens, codes of up to 6 bits take another form of the same sums, as
   quant_gemv.c's int4 does on AVX2: the activations as unsigned q + 128 and the codes as signed
   c - centre (centre = 2^(bits - 1)), unpacked with the block's factors once per call and block
   into scratch. A token's broadcast quads then serve both halves of the block, the codes are
   memory operands, not registers, and no code is unpacked per token tile.
   sum((q + 128)(c - centre)) - 128 sum(c - centre) = sum(q (c - centre)), and the activations'
   starts take the offset's rest out, -(o - centre) sum(q): the integer sums above, exactly, so the
   outputs are the same bit for bit. The int16 pairs cannot saturate: 4 x 2 x 255 x 16 = 32,640
   up to 5 bits, 2 x 2 x 255 x 32 = 32,640 at 6. */
typedef struct {
    __m256i *codes;       /* [groups, 8 quads, 2 row halves]: c - centre */
    int32_t *offset;      /* [groups, 2 channel halves, 16 rows]: 128 sum(c - centre) */
    float *scale, *bias;  /* [groups, 2 channel halves, 16 rows]: half_scales' */
} UnpackedBlock;

#define TOKEN_PAIR 2  /* tokens per pass of the unpacked form */

static const size_t UNPACKED_GROUP = 16 * sizeof(__m256i) + 2 * KQ_ROWS * (sizeof(int32_t) + 2 * sizeof(float));

static void unpack_block(const KQuantWeight *w, int64_t b, int64_t groups, const UnpackedBlock *u) {
    const __m256i centre = _mm256_set1_epi8((char)(1 << (w->bits - 1)));
    const __m256i unit = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++)
        for (int h = 0; h < 2; h++) {
            __m256i q[8];
            __m256 scale[2], bias[2];
            half_codes(w, b * groups + g, h, q);
            half_scales(w, b, g, h, scale, bias);
            for (int c = 0; c < 2; c++) {
                __m256i pairs = _mm256_setzero_si256();
                for (int j = 4 * c; j < 4 * c + 4; j++) {
                    const __m256i signed_codes = _mm256_sub_epi8(q[j], centre);
                    u->codes[g * 16 + 2 * j + h] = signed_codes;
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(unit, signed_codes));
                }
                const int64_t at = (g * 2 + c) * KQ_ROWS + 8 * h;
                _mm256_storeu_si256((__m256i *)(u->offset + at), _mm256_slli_epi32(_mm256_madd_epi16(pairs, ones), 7));
                _mm256_storeu_ps(u->scale + at, scale[c]);
                _mm256_storeu_ps(u->bias + at, bias[c]);
            }
        }
}

/* `tt` tokens from t of one unpacked block of `bits`-bit codes, 16 rows from row0; `flipped` holds
   the activations as q + 128. Each code vector and each group's factors, read once, serve the tile's
   tokens: one token per pass spent about as many loads and steps on the block as on its products
   (three tokens a pass spilled registers and measured no faster; slices of the block kept in L1
   measured slower: L2 is not the bound). With one sub-scale for the group (`one_sub`) the two
   halves' integer sums add before they convert, as in half_sums; 4-bit codes add them in int16
   (8 x 2 x 255 x 8 = 32,640) and widen once. A token's integer sums, and the fp32 steps after
   them, are those of every other path of its form, bit for bit. */
static inline __attribute__((always_inline)) void block_tile(const UnpackedBlock *u, const HalfActivations *a,
                                                             const uint8_t *flipped, int64_t k, int64_t t, const int tt,
                                                             void *out, int64_t n, int64_t row0, int is_bf16,
                                                             const int bits, const int one_sub, const int has_offset,
                                                             const int has_min) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int merge16 = one_sub && bits == 4;
    __m256 acc[TOKEN_PAIR][2];  /* [token][row half] */
    for (int i = 0; i < tt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->groups; g++) {
        const __m256i *wq = u->codes + g * 16;
        __m256i lo[TOKEN_PAIR][2], hi[TOKEN_PAIR][2];  /* int16 pairs; hi: 6-bit codes' quads 2 and 3 */
        __m256i dot[TOKEN_PAIR][2];                    /* one_sub: both halves' integer sums */
        __m256 y[TOKEN_PAIR][2];                       /* otherwise: the sums times the weights' factors */
        for (int c = 0; c < 2; c++) {
            for (int j = 0; j < 4; j++) {
                const __m256i w0 = _mm256_load_si256(wq + 2 * (4 * c + j));
                const __m256i w1 = _mm256_load_si256(wq + 2 * (4 * c + j) + 1);
                for (int i = 0; i < tt; i++) {
                    int32_t quad;
                    memcpy(&quad, flipped + (t + i) * k + g * KQ_GROUP + 4 * (4 * c + j), sizeof quad);
                    const __m256i x = _mm256_set1_epi32(quad);
                    const __m256i p0 = _mm256_maddubs_epi16(x, w0), p1 = _mm256_maddubs_epi16(x, w1);
                    __m256i *to = bits == 6 && j >= 2 ? hi[i] : lo[i];
                    const int first = bits == 6 && j >= 2 ? j == 2 : j == 0 && (c == 0 || !merge16);
                    to[0] = first ? p0 : _mm256_add_epi16(to[0], p0);
                    to[1] = first ? p1 : _mm256_add_epi16(to[1], p1);
                }
            }
            if (merge16 && c == 0) continue;
            for (int i = 0; i < tt; i++) {
                const int64_t v = (t + i) * a->groups + g;
                for (int h = 0; h < 2; h++) {
                    const int64_t at = (g * 2 + c) * KQ_ROWS + 8 * h;
                    __m256i d = _mm256_madd_epi16(lo[i][h], ones);
                    if (bits == 6) d = _mm256_add_epi32(d, _mm256_madd_epi16(hi[i][h], ones));
                    d = _mm256_sub_epi32(d, _mm256_loadu_si256((const __m256i *)(u->offset + at)));
                    if (merge16) d = _mm256_sub_epi32(d, _mm256_loadu_si256((const __m256i *)(u->offset + at - KQ_ROWS)));
                    if (has_offset)
                        d = _mm256_add_epi32(d, _mm256_set1_epi32(merge16 ? a->start[2 * v] + a->start[2 * v + 1]
                                                                          : a->start[2 * v + c]));
                    if (one_sub) {
                        dot[i][h] = c == 0 || merge16 ? d : _mm256_add_epi32(dot[i][h], d);
                    } else {
                        const __m256 f = _mm256_cvtepi32_ps(d), scale = _mm256_loadu_ps(u->scale + at);
                        y[i][h] = c == 0 ? _mm256_mul_ps(f, scale) : _mm256_fmadd_ps(f, scale, y[i][h]);
                    }
                }
            }
        }
        for (int i = 0; i < tt; i++) {
            const int64_t v = (t + i) * a->groups + g;
            const __m256 dx = _mm256_set1_ps(a->scale[v]);
            for (int h = 0; h < 2; h++) {
                const int64_t at0 = g * 2 * KQ_ROWS + 8 * h, at1 = at0 + KQ_ROWS;
                if (one_sub) y[i][h] = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[i][h]), _mm256_loadu_ps(u->scale + at0));
                acc[i][h] = _mm256_fmadd_ps(y[i][h], dx, acc[i][h]);
                if (has_min) {
                    const __m256 bias[2] = {_mm256_loadu_ps(u->bias + at0), _mm256_loadu_ps(u->bias + at1)};
                    acc[i][h] = min_term(acc[i][h], bias, a->sum + 2 * v, one_sub);
                }
            }
        }
    }
    for (int i = 0; i < tt; i++) {
        store8(out, (t + i) * n + row0, acc[i][0], n - row0, is_bf16);
        store8(out, (t + i) * n + row0 + 8, acc[i][1], n - row0 - 8, is_bf16);
    }
}

/* Every token's 16 rows from row0 of one unpacked block, in pairs. */
static inline __attribute__((always_inline)) void block_tokens(const UnpackedBlock *u, const HalfActivations *a,
                                                               const uint8_t *flipped, int64_t k, int64_t tokens,
                                                               void *out, int64_t n, int64_t row0, int is_bf16,
                                                               const int bits, const int one_sub, const int has_offset,
                                                               const int has_min) {
    int64_t t = 0;
    for (; t + TOKEN_PAIR <= tokens; t += TOKEN_PAIR)
        block_tile(u, a, flipped, k, t, TOKEN_PAIR, out, n, row0, is_bf16, bits, one_sub, has_offset, has_min);
    if (t < tokens) block_tile(u, a, flipped, k, t, 1, out, n, row0, is_bf16, bits, one_sub, has_offset, has_min);
}

/* The prefill form for codes of up to 6 bits (see above); 0 when out of memory. */
static int unpacked_matmul(const KQuantWeight *w, const HalfActivations *a, void *out, int64_t tokens, int is_bf16,
                           int num_threads, int form) {
    const int64_t groups = a->groups, k = w->k, n = w->n;
    const size_t per_thread = (size_t)groups * UNPACKED_GROUP;
    char *scratch = aligned_alloc(32, per_thread * (size_t)num_threads);
    uint8_t *flipped = flipped_codes(a->q, tokens * k);
    if (!scratch || !flipped) {
        free(scratch), free(flipped);
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    {
        char *mine = scratch + per_thread * (size_t)omp_get_thread_num();
        const size_t rows = (size_t)groups * 2 * KQ_ROWS;
        const UnpackedBlock u = {(__m256i *)mine, (int32_t *)(mine + groups * 16 * sizeof(__m256i)),
                                 (float *)(mine + groups * 16 * sizeof(__m256i) + rows * sizeof(int32_t)),
                                 (float *)(mine + groups * 16 * sizeof(__m256i) + rows * (sizeof(int32_t) + sizeof(float)))};
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (n + KQ_ROWS - 1) / KQ_ROWS; b++) {
            unpack_block(w, b, groups, &u);
            /* each form compiled on its own: code bits, one sub-scale, offset, min term */
            switch (((w->bits - 4) * 2 + (w->sub_size == 32)) * 4 + (form & 3)) {
#define TOKENS_CASE(BITS, ONE_SUB, OFFSET, MIN)                                                           \
                case ((BITS - 4) * 2 + ONE_SUB) * 4 + OFFSET * 2 + MIN:                                     \
                    block_tokens(&u, a, flipped, k, tokens, out, n, b * KQ_ROWS, is_bf16, BITS, ONE_SUB, OFFSET, MIN); \
                    break;
#define TOKENS_CASES(BITS, ONE_SUB) TOKENS_CASE(BITS, ONE_SUB, 0, 0) TOKENS_CASE(BITS, ONE_SUB, 0, 1) \
                                    TOKENS_CASE(BITS, ONE_SUB, 1, 0) TOKENS_CASE(BITS, ONE_SUB, 1, 1)
                TOKENS_CASES(4, 0) TOKENS_CASES(4, 1) TOKENS_CASES(5, 0) TOKENS_CASES(5, 1)
                TOKENS_CASES(6, 0) TOKENS_CASES(6, 1)
#undef TOKENS_CASES
#undef TOKENS_CASE
            }
        }
    }
    free(scratch), free(flipped);
    return 1;
}

/* Every form (code width, offset or not, min term or not) compiled on its own, by FORM's index. */
#define EACH_FORM(X) X(0, 0, 0) X(0, 0, 1) X(0, 1, 0) X(0, 1, 1) X(1, 0, 0) X(1, 0, 1) X(1, 1, 0) X(1, 1, 1) \
                     X(2, 0, 0) X(2, 0, 1) X(2, 1, 0) X(2, 1, 1)
#define ROWS1_CASE(WIDTH, OFFSET, MIN) \
    case FORM(WIDTH, OFFSET, MIN): int_rows1(w, a, b, t, WIDTH, OFFSET, MIN, acc); break;
#define HALF_CASE(WIDTH, OFFSET, MIN)                                                     \
    case FORM(WIDTH, OFFSET, MIN):                                                        \
        switch (tn) {                                                                     \
            case 4: int_half(w, a, b, h, t0, 4, WIDTH, OFFSET, MIN, acc); break;          \
            case 3: int_half(w, a, b, h, t0, 3, WIDTH, OFFSET, MIN, acc); break;          \
            case 2: int_half(w, a, b, h, t0, 2, WIDTH, OFFSET, MIN, acc); break;          \
            default: int_half(w, a, b, h, t0, 1, WIDTH, OFFSET, MIN, acc); break;         \
        }                                                                                 \
        break;

static void rows1_any(const KQuantWeight *w, const HalfActivations *a, int64_t b, int64_t t, int form,
                      __m256 acc[2]) {
    switch (form) { EACH_FORM(ROWS1_CASE) }
}

static void half_any(const KQuantWeight *w, const HalfActivations *a, int64_t b, int h, int64_t t0, int64_t tn,
                     int form, __m256 acc[HALF_TILE]) {
    switch (form) { EACH_FORM(HALF_CASE) }
}

static int int_matmul(const KQuantWeight *w, const void *x, void *out, int64_t tokens, int is_bf16, int num_threads) {
    const int width = w->bits == 8 || w->lookup ? CODES_8BIT : w->bits == 6 ? CODES_6BIT : CODES_NARROW;
    const int unpacked = width != CODES_8BIT && tokens > HALF_TILE;
    /* the offset the activations' starts take out: relative to the signed codes' zero, 128 for
       8-bit codes and the centre for the unpacked form */
    const int32_t start_offset = (int32_t)w->offset - (width == CODES_8BIT ? 128 : unpacked ? 1 << (w->bits - 1) : 0);
    HalfActivations a;
    if (!quantize_halves(x, is_bf16, tokens, w->k, start_offset, &a)) return 0;
    const int64_t n = w->n;
    const int form = FORM(width, start_offset != 0, w->m != NULL);
    if (unpacked) {
        const int ok = unpacked_matmul(w, &a, out, tokens, is_bf16, num_threads, form);
        free(a.scale);
        return ok;
    }
    BlockShares shares;
    share_blocks(&shares, (n + KQ_ROWS - 1) / KQ_ROWS, num_threads);
#pragma omp parallel num_threads(num_threads)
    for (int64_t b; (b = claim_block(&shares, omp_get_thread_num())) >= 0;) {
        if (tokens == 1) {
            __m256 acc[2];
            rows1_any(w, &a, b, 0, form, acc);
            for (int h = 0; h < 2; h++) store8(out, b * KQ_ROWS + 8 * h, acc[h], n - b * KQ_ROWS - 8 * h, is_bf16);
            continue;
        }
        for (int h = 0; h < 2; h++)
            for (int64_t t0 = 0; t0 < tokens; t0 += HALF_TILE) {
                __m256 acc[HALF_TILE];
                const int64_t tn = tokens - t0 < HALF_TILE ? tokens - t0 : HALF_TILE;
                half_any(w, &a, b, h, t0, tn, form, acc);
                const int64_t row = b * KQ_ROWS + 8 * h;
                for (int64_t t = 0; t < tn; t++) store8(out, (t0 + t) * n + row, acc[t], n - row, is_bf16);
            }
    }
    free(a.scale);
    return 1;
}

#endif

/* ---------------------------------------------------------------- the bf16 tile kernel */

#ifdef HAVE_KQ_GEMM

/* Group g of block b dequantized into a bf16 tile: the group's channel pair p has its 16 rows at
   tile + p * stride (bytes), row r's two channels in 32-bit lane r, as vdpbf16ps takes them. */
static void dequantize_group(const KQuantWeight *w, int64_t b, int64_t g, uint8_t *tile, int64_t stride) {
    /* (channel 2p's 16 rows, channel 2p + 1's) -> row r's two channels in 32-bit lane r */
    static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_loadu_si512(pairs), byte = _mm512_set1_epi32(0xff);
    __m512i q[8];
    __m512 d, m, scale[2], bias[2];
    super_factors(w, b, g * KQ_GROUP / w->super_size, &d, &m);
    group_codes(w, b * kq_groups(w) + g, q);
    group_scales(w, b * kq_groups(w) + g, d, m, scale, bias);
    for (int u = 0; u < 2; u++)  /* w = scale * q + (bias - scale * offset) */
        bias[u] = _mm512_fnmadd_ps(scale[u], _mm512_set1_ps((float)w->offset), bias[u]);
    for (int j = 0; j < 8; j++) {  /* q[j]: row r's channels 4j .. 4j + 3 in the bytes of 32-bit lane r */
        __m512 v[4];
        for (int c = 0; c < 4; c++) {
            const __m512i codes = c == 0 ? _mm512_and_si512(q[j], byte)
                                : c == 3 ? _mm512_srli_epi32(q[j], 24)
                                         : _mm512_and_si512(_mm512_srli_epi32(q[j], 8 * c), byte);
            v[c] = _mm512_fmadd_ps(scale[j / 4], _mm512_cvtepi32_ps(codes), bias[j / 4]);
        }
        for (int p = 0; p < 2; p++) {
            const __m512i both = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(v[2 * p + 1], v[2 * p]));
            _mm512_storeu_si512(tile + (2 * j + p) * stride, both);
        }
    }
}

/* Groups g0 .. g1 - 1 of block b dequantized into a bf16 tile (channel pairs from channel
   g0 * KQ_GROUP on, `stride` bytes apart). */
static void dequantize_block(const KQuantWeight *w, int64_t b, int64_t g0, int64_t g1, uint8_t *tile,
                             int64_t stride) {
    for (int64_t g = g0; g < g1; g++) dequantize_group(w, b, g, tile + (g - g0) * (KQ_GROUP / 2) * stride, stride);
}

/* Where a product's bf16 tiles come from: a quantized weight's blocks, dequantized into the
   thread's scratch as they are needed, or tiles stored in that layout (bf16 weights: `stored`,
   block b's channel pair p at stored + (b * k / 2 + p) * 16 rows x 2 channels). */
typedef struct {
    const KQuantWeight *w;
    const uint16_t *stored;
    int64_t n, k;
} TileSource;

/* Blocks b .. b + nb - 1's tiles (tiles[i]) over channels c0 .. c1 - 1 (multiples of KQ_GROUP);
   returns the bytes from one channel pair to the next. */
static inline int64_t block_tiles(const TileSource *src, int64_t b, int nb, int64_t c0, int64_t c1, uint8_t *scratch,
                                  const uint8_t *tiles[2]) {
    if (src->stored) {
        for (int i = 0; i < nb; i++) tiles[i] = (const uint8_t *)(src->stored + (b + i) * KQ_ROWS * src->k + c0 * KQ_ROWS);
        return 64;
    }
    for (int i = 0; i < nb; i++) {
        dequantize_block(src->w, b + i, c0 / KQ_GROUP, c1 / KQ_GROUP, scratch + i * 64, 64 * nb);
        tiles[i] = scratch + i * 64;
    }
    return 64 * nb;
}

/* `tn` tokens of one token tile against `nb` blocks' tiles (constants where inlined): block i's
   channel pair p at tile[i] + p * stride. xp holds the token tile's channel pairs token-minor
   ([pair][GEMM_TOKENS] 32-bit values), so that every broadcast is at a constant offset from one
   pointer. */
static inline __attribute__((always_inline)) void tile_tokens(const uint8_t *const tile[2], int64_t stride,
                                                              int64_t pairs, const uint32_t *xp, const int tn,
                                                              const int nb, void *out, int64_t n, int64_t t0,
                                                              int64_t row0) {
    __m512 acc[2][GEMM_TOKENS];
    for (int i = 0; i < nb; i++)
        for (int t = 0; t < tn; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile[0] + p * stride);
        const __m512bh w1 = nb == 2 ? (__m512bh)_mm512_loadu_si512(tile[1] + p * stride) : w0;
        const uint32_t *x = xp + p * GEMM_TOKENS;
        for (int t = 0; t < tn; t++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[t]);
            acc[0][t] = _mm512_dpbf16_ps(acc[0][t], w0, xb);
            if (nb == 2) acc[1][t] = _mm512_dpbf16_ps(acc[1][t], w1, xb);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int t = 0; t < tn; t++)
            store16(out, (t0 + t) * n + row0 + i * KQ_ROWS, acc[i][t], n - row0 - i * KQ_ROWS, 1);
}

#define TOKENS_CASES(NB)                                                                           \
    switch (tn) {                                                                                  \
        case 12: tile_tokens(tiles, stride, pairs, xp, 12, NB, out, n, t0, row0); break;           \
        case 11: tile_tokens(tiles, stride, pairs, xp, 11, NB, out, n, t0, row0); break;           \
        case 10: tile_tokens(tiles, stride, pairs, xp, 10, NB, out, n, t0, row0); break;           \
        case 9: tile_tokens(tiles, stride, pairs, xp, 9, NB, out, n, t0, row0); break;             \
        case 8: tile_tokens(tiles, stride, pairs, xp, 8, NB, out, n, t0, row0); break;             \
        case 7: tile_tokens(tiles, stride, pairs, xp, 7, NB, out, n, t0, row0); break;             \
        case 6: tile_tokens(tiles, stride, pairs, xp, 6, NB, out, n, t0, row0); break;             \
        case 5: tile_tokens(tiles, stride, pairs, xp, 5, NB, out, n, t0, row0); break;             \
        case 4: tile_tokens(tiles, stride, pairs, xp, 4, NB, out, n, t0, row0); break;             \
        case 3: tile_tokens(tiles, stride, pairs, xp, 3, NB, out, n, t0, row0); break;             \
        case 2: tile_tokens(tiles, stride, pairs, xp, 2, NB, out, n, t0, row0); break;             \
        default: tile_tokens(tiles, stride, pairs, xp, 1, NB, out, n, t0, row0); break;            \
    }

/* One token against stored tiles: a decode step's bf16 weights, streamed from memory. Each thread
   reads its blocks in order, one sequential stream (block b + 1's tiles follow block b's), in four
   chains of vdpbf16ps so that no load waits on the one before (k is a multiple of 32, so the
   pairs come in fours). On a Zen 4 a 1B model's bf16 decode ran a median 1.18x faster than on
   the token tile loop (two blocks, one chain each), alternated in one process
   (benchmarks/ab_kernels.py); software prefetch made it slower. */
static void stored_tiles1(const TileSource *src, const uint32_t *x, uint16_t *out, int num_threads) {
    const int64_t n = src->n, k = src->k, pairs = k / 2;
    BlockShares shares;
    share_blocks(&shares, (n + KQ_ROWS - 1) / KQ_ROWS, num_threads);
#pragma omp parallel num_threads(num_threads)
    for (int64_t b; (b = claim_block(&shares, omp_get_thread_num())) >= 0;) {
        const uint8_t *tile = (const uint8_t *)(src->stored + b * KQ_ROWS * k);
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t p = 0; p < pairs; p += 4)
            for (int j = 0; j < 4; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(tile + (p + j) * 64),
                                          (__m512bh)_mm512_set1_epi32((int)x[p + j]));
        store16(out, b * KQ_ROWS, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                n - b * KQ_ROWS, 1);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_KQ_AMX 1
#define AMX_TOKENS 16  /* rows of an A tile: tokens per tile product */

/* The same dequantized tiles multiplied on AMX's bf16 unit: one `tdpbf16ps` is 16 tokens x 16 rows
   x 32 channels, 256x the multiply-adds of a `vdpbf16ps`, and the tile layout above is its B
   operand's (a row per channel pair, the 16 rows' two channels in 32-bit lanes). Tiles 0-3 sum
   two token tiles against two blocks over the whole of k (bf16 products summed in fp32, as the
   vdpbf16ps kernel, in another order); 4-5 hold the tokens, 6-7 the blocks. The tokens are
   copied into whole tiles (the last one zero-padded), so any token count runs. */
static void configure_bf16_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = AMX_TOKENS, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
}

/* The next block pair's tiles, dequantized a few groups at a time between the current pair's tile
   products, so that the vector units dequantize while AMX multiplies; one after the other, each
   waited for the other (dequantizing was a quarter of a 256-token call, the tile products the rest).
   Group `done` of the job is group done % groups of block b + done / groups, from group g0. */
typedef struct {
    const KQuantWeight *w;
    int64_t b, g0, groups, total, done;
    uint8_t *tile;
    int64_t stride;
} DequantJob;

static void dequantize_until(DequantJob *job, int64_t upto) {
    for (; job->done < upto; job->done++) {
        const int64_t i = job->done / job->groups, g = job->done % job->groups;
        dequantize_group(job->w, job->b + i, job->g0 + g, job->tile + i * 64 + g * (KQ_GROUP / 2) * job->stride,
                         job->stride);
    }
}

/* Tokens t0..t0+31 (x: whole tiles, rows ld apart, from the pass's first channel) against the nb
   blocks' tiles (block i's channel pair p at tile[i] + p * stride) over `channels` channels, adding
   to the sums in `acc` (4 tiles of 16 x 16 fp32) or, on the first pass, starting them. Between
   steps, `job` (if any) is brought to its share of `steps` steps, this call's first being `step`. */
static inline __attribute__((always_inline)) void amx_tokens(const uint8_t *const tile[2], int64_t stride,
                                                             const uint16_t *x, int64_t ld, int64_t channels,
                                                             const int nb, const int two, float *acc, int first,
                                                             DequantJob *job, int64_t step, int64_t steps) {
    const int64_t row = 2 * ld;
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, acc, 64);
        _tile_loadd(1, acc + 256, 64);
        _tile_loadd(2, acc + 512, 64);
        _tile_loadd(3, acc + 768, 64);
    }
    for (int64_t c = 0; c < channels; c += 32) {
        _tile_loadd(4, x + c, row);
        _tile_loadd(6, tile[0] + (c / 2) * stride, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (nb == 2) {
            _tile_loadd(7, tile[1] + (c / 2) * stride, stride);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
            _tile_loadd(5, x + AMX_TOKENS * ld + c, row);
            _tile_dpbf16ps(2, 5, 6);
            if (nb == 2) _tile_dpbf16ps(3, 5, 7);
        }
        if (job) dequantize_until(job, job->total * ++step / steps);
    }
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    _tile_stored(2, acc + 512, 64);
    _tile_stored(3, acc + 768, 64);
}

/* Every block pair reads all of the tokens' channels, so where they outgrow a core's L2 (256
   tokens x 8192 channels of a 1B model's down projection are 4 MB) the product runs in passes over
   as many channels as fit AMX_PASS_BYTES (half of a 2 MB L2: the two block pairs' tiles need the
   rest; a 1B down projection at 256 tokens took 0.85x the time of 2 MB passes), each pass's sums
   kept in memory for the next: the same fp32 sums in the same order, so the result is unchanged.
   A token pair's sums are written out while the next pair's tile products run. The tokens' rows are AMX_ROW_PAD
   channels longer than k: rows a multiple of 4 KiB apart put a tile's 16 row loads in one L1
   set. Both together: 1.05-1.3x per 1B weight shape at 256 tokens, alternated in one process;
   within the host's noise in `carpool bench quant` (BENCHMARKS.md "Kernels", Xeon 480M). Those
   sums are the output in fp32; past AMX_SUMS_BYTES of them (a chunk of thousands of tokens) the
   tokens run in slices, each dequantizing the weights again. */
#define AMX_PASS_BYTES (1 << 20)
#define AMX_ROW_PAD 32
#define AMX_SUMS_BYTES (64 << 20)

/* Token pair t0's fp32 sums (acc: 4 tiles, from amx_tokens) against blocks row0 / 16 .. + nb - 1,
   as bf16 into out. */
static void amx_output(void *out, const float *acc, int64_t t0, int64_t tokens, int64_t n, int64_t row0, int nb) {
    for (int64_t t = t0; t < tokens && t < t0 + 2 * AMX_TOKENS; t++) {
        const float *s = acc + ((t - t0) / AMX_TOKENS) * 512 + ((t - t0) % AMX_TOKENS) * 16;
        for (int i = 0; i < nb; i++)
            store16(out, t * n + row0 + i * KQ_ROWS, _mm512_loadu_ps(s + i * 256), n - row0 - i * KQ_ROWS, 1);
    }
}

static int amx_slice_matmul(const TileSource *src, const uint16_t *x, void *out, int64_t tokens, int num_threads) {
    const int64_t n = src->n, k = src->k, blocks = (n + KQ_ROWS - 1) / KQ_ROWS, block_pairs = (blocks + 1) / 2;
    const int64_t padded = (tokens + AMX_TOKENS - 1) / AMX_TOKENS * AMX_TOKENS;
    const int64_t token_pairs = (padded + 2 * AMX_TOKENS - 1) / (2 * AMX_TOKENS);
    const int64_t ld = k + AMX_ROW_PAD;  /* the tokens' row length in xs */
    int64_t pass = AMX_PASS_BYTES / (2 * padded) / 256 * 256;  /* channels per pass */
    if (pass < 256) pass = 256;
    if (pass >= k) pass = k;
    const size_t per_thread = (size_t)pass * 128 + 8192;  /* two block pairs' tiles, then two token pairs' sums */
    uint8_t *scratch = aligned_alloc(64, per_thread * (size_t)num_threads);
    uint16_t *xs = calloc((size_t)(padded * ld), sizeof(uint16_t));
    float *sums = pass < k ? aligned_alloc(64, (size_t)(block_pairs * token_pairs) * 4096) : NULL;
    if (!scratch || !xs || (pass < k && !sums)) {
        free(scratch), free(xs), free(sums);
        return 0;
    }
    for (int64_t t = 0; t < tokens; t++) memcpy(xs + t * ld, x + t * k, sizeof(uint16_t) * (size_t)k);
#pragma omp parallel num_threads(num_threads)
    {
        /* each thread its own block pairs, the same ones in every pass (their sums stay its own) */
        const int64_t id = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t from = block_pairs * id / threads, to = block_pairs * (id + 1) / threads;
        uint8_t *buffer[2] = {scratch + per_thread * (size_t)id, scratch + per_thread * (size_t)id + (size_t)pass * 64};
        float *own = (float *)(buffer[0] + (size_t)pass * 128);
        configure_bf16_tiles();
        for (int64_t c0 = 0; c0 < k; c0 += pass) {
            const int64_t c1 = c0 + pass < k ? c0 + pass : k;
            const int64_t steps = token_pairs * ((c1 - c0) / 32);
            const uint8_t *tiles[2];
            int64_t stride = 0;
            for (int64_t two = from; two < to; two++) {
                const int64_t b = 2 * two, row0 = b * KQ_ROWS;
                const int nb = b + 1 < blocks ? 2 : 1, next_nb = b + 3 < blocks ? 2 : 1;
                if (two == from || src->stored) stride = block_tiles(src, b, nb, c0, c1, buffer[two & 1], tiles);
                DequantJob job = {src->w, b + 2, c0 / KQ_GROUP, (c1 - c0) / KQ_GROUP, 0, 0, buffer[(two + 1) & 1],
                                  64 * next_nb};
                job.total = two + 1 < to && !src->stored ? job.groups * next_nb : 0;
                DequantJob *next = job.total ? &job : NULL;
                const float *done = NULL;  /* the sums of the token pair before, written out one pair late */
                for (int64_t t0 = 0; t0 < tokens; t0 += 2 * AMX_TOKENS) {
                    const int both = t0 + AMX_TOKENS < tokens;
                    const int64_t step = t0 / (2 * AMX_TOKENS) * ((c1 - c0) / 32);
                    float *acc = sums ? sums + (two * token_pairs + t0 / (2 * AMX_TOKENS)) * 1024
                                      : own + (t0 / (2 * AMX_TOKENS) % 2) * 1024;
                    const uint16_t *xt = xs + t0 * ld + c0;
                    if (nb == 2) amx_tokens(tiles, stride, xt, ld, c1 - c0, 2, both, acc, c0 == 0, next, step, steps);
                    else amx_tokens(tiles, stride, xt, ld, c1 - c0, 1, both, acc, c0 == 0, next, step, steps);
                    if (c1 < k) continue;
                    if (done) amx_output(out, done, t0 - 2 * AMX_TOKENS, tokens, n, row0, nb);
                    done = acc;
                }
                if (done) amx_output(out, done, (tokens - 1) / (2 * AMX_TOKENS) * (2 * AMX_TOKENS), tokens, n, row0, nb);
                if (next) {
                    dequantize_until(next, next->total);
                    tiles[0] = buffer[(two + 1) & 1], tiles[1] = tiles[0] + 64, stride = 64 * next_nb;
                }
            }
        }
        _tile_release();
    }
    free(scratch), free(xs), free(sums);
    return 1;
}

static int amx_tile_matmul(const TileSource *src, const uint16_t *x, void *out, int64_t tokens, int num_threads) {
    const int64_t per_token = 4 * ((src->n + 2 * KQ_ROWS - 1) / (2 * KQ_ROWS) * 2 * KQ_ROWS);  /* its fp32 sums */
    int64_t slice = AMX_SUMS_BYTES / per_token / (2 * AMX_TOKENS) * (2 * AMX_TOKENS);
    if (slice < 2 * AMX_TOKENS) slice = 2 * AMX_TOKENS;
    for (int64_t t = 0; t < tokens; t += slice)  /* out is bf16 */
        if (!amx_slice_matmul(src, x + t * src->k, (uint16_t *)out + t * src->n, tokens - t < slice ? tokens - t : slice,
                              num_threads))
            return 0;
    return 1;
}
#endif

/* The tiles of `src` against `tokens` bf16 tokens: on AMX from `amx_from` tokens (0: never), else
   with vdpbf16ps in token tiles of GEMM_TOKENS. */
static int tile_matmul(const TileSource *src, const uint16_t *x, void *out, int64_t tokens, int num_threads,
                       int64_t amx_from) {
#ifdef HAVE_KQ_AMX
    if (amx_from > 0 && tokens >= amx_from && quant_amx_supported())
        return amx_tile_matmul(src, x, out, tokens, num_threads);
#endif
    (void)amx_from;
    if (src->stored && tokens == 1) {
        stored_tiles1(src, (const uint32_t *)x, out, num_threads);
        return 1;
    }
    const int64_t n = src->n, k = src->k, pairs = k / 2, blocks = (n + KQ_ROWS - 1) / KQ_ROWS;
    const int64_t token_tiles = (tokens + GEMM_TOKENS - 1) / GEMM_TOKENS;
    const size_t per_thread = src->stored ? 64 : (size_t)pairs * 128;
    uint8_t *scratch = aligned_alloc(64, per_thread * (size_t)num_threads);
    uint32_t *packed_x = calloc((size_t)(token_tiles * pairs * GEMM_TOKENS), sizeof(uint32_t));
    if (!scratch || !packed_x) {
        free(scratch), free(packed_x);
        return 0;
    }
    for (int64_t t = 0; t < tokens; t++)  /* x's pairs, token-minor within each token tile */
        for (int64_t p = 0; p < pairs; p++)
            memcpy(packed_x + ((t / GEMM_TOKENS) * pairs + p) * GEMM_TOKENS + t % GEMM_TOKENS, x + t * k + 2 * p, 4);
#pragma omp parallel num_threads(num_threads)
    {
        uint8_t *tile = scratch + per_thread * (size_t)omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t two = 0; two < (blocks + 1) / 2; two++) {
            const int64_t b = 2 * two, row0 = b * KQ_ROWS;
            const int nb = b + 1 < blocks ? 2 : 1;
            const uint8_t *tiles[2];
            const int64_t stride = block_tiles(src, b, nb, 0, k, tile, tiles);
            for (int64_t t0 = 0; t0 < tokens; t0 += GEMM_TOKENS) {
                const int64_t tn = tokens - t0 < GEMM_TOKENS ? tokens - t0 : GEMM_TOKENS;
                const uint32_t *xp = packed_x + (t0 / GEMM_TOKENS) * pairs * GEMM_TOKENS;
                if (nb == 2) { TOKENS_CASES(2) } else { TOKENS_CASES(1) }
            }
        }
    }
    free(scratch), free(packed_x);
    return 1;
}

#endif

/* out[tokens, n] = x[tokens, k] @ W.T (x, out fp32 or bf16 by is_bf16, rows dense): the bf16
   tile kernel from `tile_from` tokens up (bf16 only, where the CPU has it; 0: never), the integer
   kernel below. Returns 0 when out of memory or when this CPU runs neither. */
static int part_matmul(const KQuantWeight *w, const void *x, void *out, int64_t tokens, int is_bf16,
                       int num_threads, int64_t tile_from) {
#ifdef HAVE_KQ_GEMM
    if (is_bf16 && tile_from > 0 && tokens >= tile_from) {
        const TileSource src = {w, NULL, w->n, w->k};
        return tile_matmul(&src, (const uint16_t *)x, out, tokens, num_threads, 1);
    }
#endif
#ifdef HAVE_KQ
    (void)tile_from;
    return int_matmul(w, x, out, tokens, is_bf16, num_threads);
#else
    (void)w, (void)x, (void)out, (void)tokens, (void)is_bf16, (void)num_threads, (void)tile_from;
    return 0;
#endif
}

/* Parts stacked by rows (`next`), each in its own form: part by part into their columns of out.
   One token's columns of a part are contiguous; more tokens' go through a buffer. */
int kq_matmul(const KQuantWeight *w, const void *x, void *out, int64_t tokens, int is_bf16, int num_threads,
              int64_t tile_from) {
    if (!w->next) return part_matmul(w, x, out, tokens, is_bf16, num_threads, tile_from);
    const size_t size = is_bf16 ? 2 : 4;
    int64_t n = 0;
    for (const KQuantWeight *part = w; part; part = part->next) n += part->n;
    int64_t row0 = 0;
    for (const KQuantWeight *part = w; part; row0 += part->n, part = part->next) {
        if (tokens == 1) {
            if (!part_matmul(part, x, (char *)out + row0 * size, 1, is_bf16, num_threads, tile_from)) return 0;
            continue;
        }
        char *columns = malloc((size_t)(tokens * part->n) * size);
        if (!columns || !part_matmul(part, x, columns, tokens, is_bf16, num_threads, tile_from)) {
            free(columns);
            return 0;
        }
        for (int64_t t = 0; t < tokens; t++)
            memcpy((char *)out + (t * n + row0) * size, columns + t * part->n * size, (size_t)part->n * size);
        free(columns);
    }
    return 1;
}

/* ---------------------------------------------------------------- bf16 weights as stored tiles */

#if !defined(HAVE_KQ_GEMM) && defined(KQ_AVX2)
#define HAVE_TILES_AVX2 1
#define F32_TOKENS 4  /* tokens per pass: 2 accumulators each, 4 weight vectors and a broadcast */
#define TILES_L2 (256 << 10)  /* bytes of tiles a pass over a token tile keeps in cache */

/* The stored tiles with AVX2 and FMA, which have no bf16 arithmetic. A tile's 32-bit lane holds
   one row's two channels, and a bf16 is the high half of an fp32: a shift and a mask give both
   as fp32, and an FMA multiplies each by a token's channel (widened the same way). A product of
   two bf16 values is exact in fp32, as in vdpbf16ps; only the sums round, in another order.
   Block b's tiles (16 rows, every channel pair: 64 bytes a pair) against tokens t0 .. t0 + tn - 1,
   whose channels xp holds as fp32, [pair][F32_TOKENS][2]. */
static inline __attribute__((always_inline)) void tiles_tokens_avx2(const uint8_t *tile, int64_t pairs,
                                                                    const float *xp, const int tn, uint16_t *out,
                                                                    int64_t n, int64_t t0, int64_t row0) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[F32_TOKENS][2];
    for (int t = 0; t < tn; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(tile + 64 * p));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(tile + 64 * p + 32));
        const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
        const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
        const float *x = xp + p * 2 * F32_TOKENS;
        for (int t = 0; t < tn; t++) {
            const __m256 xe = _mm256_broadcast_ss(x + 2 * t), xo = _mm256_broadcast_ss(x + 2 * t + 1);
            acc[t][0] = _mm256_fmadd_ps(odd0, xo, _mm256_fmadd_ps(even0, xe, acc[t][0]));
            acc[t][1] = _mm256_fmadd_ps(odd1, xo, _mm256_fmadd_ps(even1, xe, acc[t][1]));
        }
    }
    for (int t = 0; t < tn; t++)
        for (int h = 0; h < 2; h++) store8(out, (t0 + t) * n + row0 + 8 * h, acc[t][h], n - row0 - 8 * h, 1);
}

/* Blocks are taken in groups whose tiles fit TILES_L2, each token tile running over the whole
   group while its channels stay in L1: the tiles are read from memory once, the tokens once per
   group. */
static int tiles_matmul_avx2(const uint16_t *tiles, const uint16_t *x, uint16_t *out, int64_t tokens, int64_t n,
                             int64_t k, int num_threads) {
    const int64_t pairs = k / 2, blocks = (n + KQ_ROWS - 1) / KQ_ROWS, block_bytes = pairs * 64;
    const int64_t token_tiles = (tokens + F32_TOKENS - 1) / F32_TOKENS;
    const int64_t per_group = block_bytes >= TILES_L2 ? 1 : TILES_L2 / block_bytes;
    float *xp = calloc((size_t)(token_tiles * pairs * 2 * F32_TOKENS), sizeof(float));
    if (!xp) return 0;
    for (int64_t t = 0; t < tokens; t++)  /* [token tile][pair][token][2], bf16 widened to fp32 */
        for (int64_t c = 0; c < k; c++) {
            const uint32_t bits = (uint32_t)x[t * k + c] << 16;
            memcpy(xp + (((t / F32_TOKENS) * pairs + c / 2) * F32_TOKENS + t % F32_TOKENS) * 2 + c % 2, &bits, 4);
        }
    BlockShares shares;
    share_blocks(&shares, (blocks + per_group - 1) / per_group, num_threads);
#pragma omp parallel num_threads(num_threads)
    for (int64_t g; (g = claim_block(&shares, omp_get_thread_num())) >= 0;)
        for (int64_t t0 = 0; t0 < tokens; t0 += F32_TOKENS) {
            const float *xt = xp + (t0 / F32_TOKENS) * pairs * 2 * F32_TOKENS;
            const int tn = tokens - t0 < F32_TOKENS ? (int)(tokens - t0) : F32_TOKENS;
            for (int64_t b = g * per_group; b < blocks && b < (g + 1) * per_group; b++) {
                const uint8_t *tile = (const uint8_t *)(tiles + b * KQ_ROWS * k);
                switch (tn) {  /* constant token counts: the accumulators stay in registers */
                    case 4: tiles_tokens_avx2(tile, pairs, xt, 4, out, n, t0, b * KQ_ROWS); break;
                    case 3: tiles_tokens_avx2(tile, pairs, xt, 3, out, n, t0, b * KQ_ROWS); break;
                    case 2: tiles_tokens_avx2(tile, pairs, xt, 2, out, n, t0, b * KQ_ROWS); break;
                    default: tiles_tokens_avx2(tile, pairs, xt, 1, out, n, t0, b * KQ_ROWS); break;
                }
            }
        }
    free(xp);
    return 1;
}
#endif

/* Whether bf16_tiles_matmul runs here: AVX512-BF16 (and AMX where present), or AVX2 and FMA. */
int bf16_tiles_supported(void) {
#if defined(HAVE_KQ_GEMM) || defined(HAVE_TILES_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* w [n, k] bf16 (rows dense) rewritten as tiles (see TileSource): [ceil(n / 16)][k / 2][16][2], the
   rows past n zero. */
void bf16_tiles_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *tiles) {
    const int64_t blocks = (n + KQ_ROWS - 1) / KQ_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < k / 2; p++)
            for (int64_t r = 0; r < KQ_ROWS; r++) {
                const int64_t row = b * KQ_ROWS + r;
                uint16_t *at = tiles + ((b * (k / 2) + p) * KQ_ROWS + r) * 2;
                at[0] = row < n ? w[row * k + 2 * p] : 0;
                at[1] = row < n ? w[row * k + 2 * p + 1] : 0;
            }
}

/* out[tokens, n] = x[tokens, k] @ W.T for W stored as tiles, x and out bf16: bf16 products summed
   in fp32, each weight read once per call. Below `amx_from` tokens (or without AMX) with
   vdpbf16ps, which at one token streams the tiles at the memory's rate; from it on AMX; with
   FMA on CPUs that have AVX2 and no AVX-512 (amx_from unused). Returns 0 when out of memory or
   when this CPU has neither (bf16_tiles_supported). */
int bf16_tiles_matmul(const uint16_t *tiles, const uint16_t *x, uint16_t *out, int64_t tokens, int64_t n, int64_t k,
                      int num_threads, int64_t amx_from) {
#ifdef HAVE_KQ_GEMM
    const TileSource src = {NULL, tiles, n, k};
    return tile_matmul(&src, x, out, tokens, num_threads, amx_from);
#elif defined(HAVE_TILES_AVX2)
    (void)amx_from;
    return tiles_matmul_avx2(tiles, x, out, tokens, n, k, num_threads);
#else
    (void)tiles, (void)x, (void)out, (void)tokens, (void)n, (void)k, (void)num_threads, (void)amx_from;
    return 0;
#endif
}
