/* CPU kernels for the steps of a decode that torch runs as many small ops (model/cpu_kernels.py
   builds and loads this file).

   Decode attention reads carpool's paged KV cache in place. The SDPA path first gathers each decode's blocks into a padded copy (two index_selects per
   layer) and then runs a kernel whose fixed cost, at one decode, is most of the call. Here each
   (sequence, KV head) task walks its block table directly: one pass over K for the scores of
   the query heads sharing that KV head, a softmax, one pass over V, in segments of 512 tokens
   merged at the end (attend_segment; too few tasks for the threads, the segments are tasks).
   Accumulation is fp32, as in torch's CPU SDPA. Built with OpenMP against torch's own libgomp, so it shares torch's threads. */

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* A row of the cache as fp32: bf16 is widened into `buf`, fp32 is read in place. */
static inline const float *as_float(const char *src, int is_bf16, int64_t n, float *buf) {
    if (!is_bf16) return (const float *)src;
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_float(((const uint16_t *)src)[i]);
    return buf;
}

static inline void store_row(char *dst, int is_bf16, int64_t n, const float *src) {
    if (!is_bf16) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = float_to_bf16(src[i]);
}

/* Sixteen partial sums, so the FMAs form independent chains instead of one long one. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[16] = {0}, sum = 0.f;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int i = 0; i < 16; i++) part[i] += a[d + i] * b[d + i];
    for (; d < n; d++) sum += a[d] * b[d];
    for (int i = 0; i < 16; i++) sum += part[i];
    return sum;
}

/* The two passes over a cached row of K or V, for the `group` query heads sharing it: its
   scores (scale * q . k into scores[g * stride]) and its share of the output (acc_g += p_g * v).
   With AVX-512 (or AVX2) and a head_dim of whole vectors the row is read in place, widened in
   registers; otherwise (and before: ~3x slower at head_dim 64) it is widened into `buf` first,
   and the vector loads of `buf` that follow the narrower stores writing it stall. */
#ifdef __AVX512F__
static inline __m512 load16f(const char *row, int is_bf16, int64_t d) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)row + d);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#define IN_PLACE(dim) ((dim) % 16 == 0 && (dim) <= 256)
#elif defined(__AVX2__) && defined(__FMA__)
#define AVX2_ROWS 1  /* the same in 8-wide vectors (AVX2 alone, e.g. AMD Zen 1-3; kernels.h) */
#define IN_PLACE(dim) ((dim) % 8 == 0 && (dim) <= 128)
#endif

static inline __attribute__((always_inline)) void score_row(
        const float *qf, const char *row, int is_bf16, int64_t dim, int64_t group, float *scores, int64_t stride,
        float scale, float *buf) {
#ifdef __AVX512F__
    if (IN_PLACE(dim)) {
        __m512 k[16];
        for (int64_t d = 0; d < dim / 16; d++) k[d] = load16f(row, is_bf16, d * 16);
        for (int64_t g = 0; g < group; g++) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t d = 0; d < dim / 16; d++)
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * dim + d * 16), k[d], sum);
            scores[g * stride] = _mm512_reduce_add_ps(sum) * scale;
        }
        return;
    }
#elif defined(AVX2_ROWS)
    if (IN_PLACE(dim)) {
        __m256 k[16];
        for (int64_t d = 0; d < dim / 8; d++) k[d] = load8f(row, is_bf16, d * 8);
        for (int64_t g = 0; g < group; g++) {
            __m256 sum = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim / 8; d++)
                sum = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * dim + d * 8), k[d], sum);
            scores[g * stride] = sum8(sum) * scale;
        }
        return;
    }
#endif
    const float *k = as_float(row, is_bf16, dim, buf);
    for (int64_t g = 0; g < group; g++) scores[g * stride] = dot(qf + g * dim, k, dim) * scale;
}

static inline __attribute__((always_inline)) void accumulate_row(
        float *acc, const float *p, int64_t stride, const char *row, int is_bf16, int64_t dim, int64_t group,
        float *buf) {
#ifdef __AVX512F__
    if (IN_PLACE(dim)) {
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 v = load16f(row, is_bf16, d);
            for (int64_t g = 0; g < group; g++) {
                float *a = acc + g * dim + d;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g * stride]), v, _mm512_loadu_ps(a)));
            }
        }
        return;
    }
#elif defined(AVX2_ROWS)
    if (IN_PLACE(dim)) {
        for (int64_t d = 0; d < dim; d += 8) {
            const __m256 v = load8f(row, is_bf16, d);
            for (int64_t g = 0; g < group; g++) {
                float *a = acc + g * dim + d;
                _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(p[g * stride]), v, _mm256_loadu_ps(a)));
            }
        }
        return;
    }
#endif
    const float *v = as_float(row, is_bf16, dim, buf);
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) acc[g * dim + d] += p[g * stride] * v[d];
}

/* Ask for the rows o0..o1 - 1 of the next block (`ahead_bytes` of each from `ahead`) while this
   block's rows are worked on: a row or two at a time, so that the requests go out as the earlier
   ones come back, instead of a block's worth at once stalling on the core's few misses in flight
   (AVX2: decode attention 1.12-1.45x faster at 4 and 16 decodes of context 800 and 3200, from
   DRAM, against the whole next block asked for at the start of each: Zen 3, two builds alternated
   in benchmarks/decode_attention.py). The block passes below take it on both paths. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *ahead, int64_t ahead_bytes,
                                                                 int64_t slot_bytes, int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; o++)
        for (int64_t b = 0; b < ahead_bytes; b += 64) __builtin_prefetch(ahead + o * slot_bytes + b);
}

#ifdef __AVX512F__
/* A whole block at once, for every query row of the run. The per-row passes above spend most of
   their time on one horizontal sum per (key, query) and on loading and storing the outputs per
   key; here a query row's 16 keys reduce together (sum16) and a slice of four rows' outputs stays
   in registers over the block. Rows that see only part of the block score every key of it: the
   softmax reads only what a row sees and zeroes the rest, so those keys add nothing to its output
   and each row's output equals what a decode of it alone computes. With AVX512-BF16 and a bf16
   cache and a head_dim of whole 32-lane vectors the scores multiply the bf16 query and keys
   directly (`vdpbf16ps`: exact products, fp32 sums); fp32 otherwise. */
#define IN_BLOCKS(dim) IN_PLACE(dim)
#if defined(__AVX512BF16__)
#define DOT_BF16 1
#endif

/* Lane o of the result is the horizontal sum of v[SUM16_SLOT[o]]: four rounds of halving. */
static const int SUM16_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int o = 0; o < 8; o++)
        w[o] = _mm512_add_ps(_mm512_shuffle_f32x4(v[o], v[o + 8], 0x44), _mm512_shuffle_f32x4(v[o], v[o + 8], 0xee));
    for (int o = 0; o < 4; o++)
        x[o] = _mm512_add_ps(_mm512_shuffle_f32x4(w[o], w[o + 4], 0x88), _mm512_shuffle_f32x4(w[o], w[o + 4], 0xdd));
    for (int o = 0; o < 2; o++)
        y[o] = _mm512_add_ps(_mm512_shuffle_ps(x[o], x[o + 2], 0x44), _mm512_shuffle_ps(x[o], x[o + 2], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));
}

/* scores[g * stride + o] = scale * q_g . k_o for the block's n (<= 16 per pass) rows. `qb` is the
   queries in the cache's own type (bf16 rows for DOT_BF16, else fp32 rows). Row o of the next
   block (`ahead_bytes` of it from `ahead`; 0: none) is asked for in query row o % queries's pass,
   so the requests spread over all of them (in the first pass only: 1.13-1.17x slower at 4 and 16
   decodes, blocks in order; Zen 4, benchmarks/decode_attention.py). */
static inline __attribute__((always_inline)) void score_block(
        const float *qf, const uint16_t *qb, const char *first_row, int64_t slot_bytes, int64_t n, int is_bf16,
        int64_t dim, int64_t queries, float *scores, int64_t stride, float scale, const char *ahead,
        int64_t ahead_bytes) {
    for (int64_t o0 = 0; o0 < n; o0 += 16) {
        const int64_t keys = n - o0 < 16 ? n - o0 : 16;
        const __mmask16 mask = (__mmask16)((1u << keys) - 1);
        for (int64_t g = 0; g < queries; g++) {
            __m512 part[16];
            int64_t due = g;  /* the next row this pass asks for: g, g + queries, ... (no division) */
#pragma GCC unroll 16
            for (int o = 0; o < 16; o++) {  /* unrolled, so that part[] stays in registers */
                const char *row = first_row + (o0 + o) * slot_bytes;
                __m512 sum = _mm512_setzero_ps();
                if (o < keys) {
                    if (o == due) {
                        prefetch_ahead(ahead, ahead_bytes, slot_bytes, o0 + o, o0 + o + 1);
                        due += queries;
                    }
#ifdef DOT_BF16
                    if (is_bf16 && dim % 32 == 0) {
                        for (int64_t d = 0; d < dim; d += 32)
                            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(qb + g * dim + d),
                                                   (__m512bh)_mm512_loadu_si512((const uint16_t *)row + d));
                    } else
#endif
                        for (int64_t d = 0; d < dim; d += 16)
                            sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * dim + d), load16f(row, is_bf16, d), sum);
                }
                part[SUM16_SLOT[o]] = sum;
            }
            _mm512_mask_storeu_ps(scores + g * stride + o0, mask, _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
        }
    }
}

/* acc_g += sum_o p[g * stride + o] v_o over the block's n rows, for `nr` (<= 4) query rows; 64
   dims of the outputs at a time stay in registers. Row o of the next block is asked for in the
   pass over dims 64 (o % passes) on (at head_dim 128, all in the first pass: 1.07-1.30x slower at
   1-16 decodes; Zen 4, benchmarks/decode_attention.py). */
static inline __attribute__((always_inline)) void accumulate_rows(
        float *acc, const float *p, int64_t stride, const int nr, const char *first_row, int64_t slot_bytes,
        int64_t n, int is_bf16, int64_t dim, const char *ahead, int64_t ahead_bytes) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int slices = dim - d0 >= 64 ? 4 : (int)((dim - d0) / 16);
        __m512 sum[4][4];
        for (int g = 0; g < nr; g++)
            for (int j = 0; j < slices; j++) sum[g][j] = _mm512_loadu_ps(acc + g * dim + d0 + 16 * j);
        int64_t due = d0 / 64;  /* the next row this pass asks for: d0 / 64, + passes, ... */
        for (int64_t o = 0; o < n; o++) {
            const char *row = first_row + o * slot_bytes;
            if (o == due) {
                prefetch_ahead(ahead, ahead_bytes, slot_bytes, o, o + 1);
                due += (dim + 63) / 64;
            }
            for (int j = 0; j < slices; j++) {
                const __m512 v = load16f(row, is_bf16, d0 + 16 * j);
                for (int g = 0; g < nr; g++)
                    sum[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * stride + o]), v, sum[g][j]);
            }
        }
        for (int g = 0; g < nr; g++)
            for (int j = 0; j < slices; j++) _mm512_storeu_ps(acc + g * dim + d0 + 16 * j, sum[g][j]);
    }
}

static inline __attribute__((always_inline)) void accumulate_block(
        float *acc, const float *p, int64_t stride, const char *first_row, int64_t slot_bytes, int64_t n, int is_bf16,
        int64_t dim, int64_t queries, const char *ahead, int64_t ahead_bytes) {
    for (int64_t g = 0; g < queries; g += 4) {
        float *a = acc + g * dim;
        const float *pg = p + g * stride;
        const int64_t bytes = g ? 0 : ahead_bytes;  /* the first pass asks for the next block */
#define ACCUMULATE(nr) accumulate_rows(a, pg, stride, nr, first_row, slot_bytes, n, is_bf16, dim, ahead, bytes)
        if (queries - g >= 4) ACCUMULATE(4);
        else if (queries - g == 3) ACCUMULATE(3);
        else if (queries - g == 2) ACCUMULATE(2);
        else ACCUMULATE(1);
#undef ACCUMULATE
    }
}
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The scores on AMX's bf16 unit, where Linux grants it (quant_amx_supported): one `tdpbf16ps`
   takes 16 keys (A: the block's rows, loaded in place from the cache) against 16 query rows
   (B: the queries packed once per task) over 32 dims. The product comes out [key][row] and is
   copied out row by row. Every query row's scores come from the same instructions whatever rows
   share its tile, so runs and decodes agree as on the other paths. */
#define HAVE_ATTENTION_AMX 1
#define AMX_SCORES(is_bf16, dim, block_size) ((is_bf16) && (dim) % 32 == 0 && (block_size) % 16 == 0)

static void configure_score_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;  /* sums, keys, queries */
    _tile_loadconfig(&cfg);
}

/* The bf16 queries qb [rows, dim] as B tiles: per 16 rows and 32 dims, [16 dim pairs][16 rows]
   of 32-bit pairs, rows past `rows` zero. */
static void pack_query_tiles(const uint16_t *qb, int64_t rows, int64_t dim, uint32_t *tiles) {
    const int64_t chunks = dim / 32;
    memset(tiles, 0, sizeof(uint32_t) * 256 * (size_t)(((rows + 15) / 16) * chunks));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t p = 0; p < 16; p++)
                tiles[((r / 16) * chunks + c) * 256 + p * 16 + r % 16] = ((const uint32_t *)(qb + r * dim))[c * 16 + p];
}

static inline __attribute__((always_inline)) void score_block_amx(
        const uint32_t *tiles, const char *first_row, int64_t slot_bytes, int64_t n, int64_t dim, int64_t rows,
        float *scores, int64_t stride, float scale, float *sums) {
    const int64_t chunks = dim / 32;
    for (int64_t o0 = 0; o0 < n; o0 += 16) {  /* a block of whole 16s: the rows past n are read, not used */
        const int64_t keys = n - o0 < 16 ? n - o0 : 16;
        for (int64_t t = 0; t < rows; t += 16) {
            _tile_zero(0);
            for (int64_t c = 0; c < chunks; c++) {
                _tile_loadd(1, first_row + o0 * slot_bytes + c * 64, slot_bytes);
                _tile_loadd(2, tiles + ((t / 16) * chunks + c) * 256, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, sums, 64);
            for (int64_t r = t; r < rows && r < t + 16; r++)
                for (int64_t o = 0; o < keys; o++) scores[r * stride + o0 + o] = sums[o * 16 + r - t] * scale;
        }
    }
}
#endif

#ifdef AVX2_ROWS
/* A whole block at once, where every query row sees all of its rows (always, for decodes). With
   AVX2 the per-row passes above are bound by their horizontal sums and by the loads and stores of
   accumulators that 16 registers cannot hold (a GQA group's outputs are 24 registers). Here up to
   three query rows go together: each widened K row serves all of them, two K rows share each
   query load and one reduction, and a 16-wide slice of their outputs stays in registers over the
   block. Each score and output element is computed in the same order as the per-row passes, so
   the two paths agree bit for bit (a chunk's partly visible blocks take the per-row ones). */
#define IN_BLOCKS(dim) (IN_PLACE(dim) && (dim) % 16 == 0)  /* the per-row passes' order: theirs in place */
#define QUERIES 3  /* query rows per pass: a GQA group of 3 shares one, larger groups take turns */

static inline __attribute__((always_inline)) void score_queries(
        const float *qf, const int nq, const char *first_row, int64_t slot_bytes, int64_t n, int is_bf16, int64_t dim,
        float *scores, int64_t stride, float scale, const char *ahead, int64_t ahead_bytes) {
    for (int64_t o = 0; o < n; o += 2) {
        const char *r0 = first_row + o * slot_bytes, *r1 = o + 1 < n ? r0 + slot_bytes : r0;
        prefetch_ahead(ahead, ahead_bytes, slot_bytes, o, o + 2);
        __m256 acc[QUERIES][2];
        for (int g = 0; g < nq; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8) {
            const __m256 k0 = load8f(r0, is_bf16, d), k1 = load8f(r1, is_bf16, d);
            for (int g = 0; g < nq; g++) {
                const __m256 q = _mm256_loadu_ps(qf + g * dim + d);
                acc[g][0] = _mm256_fmadd_ps(q, k0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(q, k1, acc[g][1]);
            }
        }
        for (int g = 0; g < nq; g++) {  /* both sums in sum8's order: lanes 0 and 4 */
            const __m256 a = acc[g][0], b = acc[g][1];
            const __m256 x = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
            const __m256 y = _mm256_add_ps(x, _mm256_permute_ps(x, 0x4e));
            float sums[8];
            _mm256_storeu_ps(sums, _mm256_mul_ps(_mm256_add_ps(y, _mm256_permute_ps(y, 0xb1)), _mm256_set1_ps(scale)));
            scores[g * stride + o] = sums[0];
            if (o + 1 < n) scores[g * stride + o + 1] = sums[4];
        }
    }
}

static inline __attribute__((always_inline)) void accumulate_queries(
        float *acc, const float *p, int64_t stride, const int nq, const char *first_row, int64_t slot_bytes, int64_t n,
        int is_bf16, int64_t dim, const char *ahead, int64_t ahead_bytes) {
    for (int64_t d = 0; d < dim; d += 16) {
        __m256 sum[QUERIES][2];
        for (int g = 0; g < nq; g++)
            for (int j = 0; j < 2; j++) sum[g][j] = _mm256_loadu_ps(acc + g * dim + d + 8 * j);
        for (int64_t o = 0; o < n; o++) {
            const char *row = first_row + o * slot_bytes;
            if (d == 0) prefetch_ahead(ahead, ahead_bytes, slot_bytes, o, o + 1);
            const __m256 v0 = load8f(row, is_bf16, d), v1 = load8f(row, is_bf16, d + 8);
            for (int g = 0; g < nq; g++) {
                const __m256 weight = _mm256_set1_ps(p[g * stride + o]);
                sum[g][0] = _mm256_fmadd_ps(weight, v0, sum[g][0]);
                sum[g][1] = _mm256_fmadd_ps(weight, v1, sum[g][1]);
            }
        }
        for (int g = 0; g < nq; g++)
            for (int j = 0; j < 2; j++) _mm256_storeu_ps(acc + g * dim + d + 8 * j, sum[g][j]);
    }
}

/* scores[g * stride + o] = scale * q_g . k_o, and acc_g += sum_o p[g * stride + o] v_o, over the
   block's n rows for `queries` query rows; `ahead_bytes` of each of the next block's rows from
   `ahead` asked for on the way (0: none). */
static inline __attribute__((always_inline)) void score_block(
        const float *qf, const char *first_row, int64_t slot_bytes, int64_t n, int is_bf16, int64_t dim,
        int64_t queries, float *scores, int64_t stride, float scale, const char *ahead, int64_t ahead_bytes) {
    for (int64_t g = 0; g < queries; g += QUERIES) {
        const float *q = qf + g * dim;
        float *s = scores + g * stride;
        const int64_t bytes = g ? 0 : ahead_bytes;  /* the first pass asks for the next block */
#define SCORE(nq) score_queries(q, nq, first_row, slot_bytes, n, is_bf16, dim, s, stride, scale, ahead, bytes)
        if (queries - g >= 3) SCORE(3);
        else if (queries - g == 2) SCORE(2);
        else SCORE(1);
#undef SCORE
    }
}

static inline __attribute__((always_inline)) void accumulate_block(
        float *acc, const float *p, int64_t stride, const char *first_row, int64_t slot_bytes, int64_t n, int is_bf16,
        int64_t dim, int64_t queries, const char *ahead, int64_t ahead_bytes) {
    for (int64_t g = 0; g < queries; g += QUERIES) {
        float *a = acc + g * dim;
        const float *pg = p + g * stride;
        const int64_t bytes = g ? 0 : ahead_bytes;
#define ACCUMULATE(nq) accumulate_queries(a, pg, stride, nq, first_row, slot_bytes, n, is_bf16, dim, ahead, bytes)
        if (queries - g >= 3) ACCUMULATE(3);
        else if (queries - g == 2) ACCUMULATE(2);
        else ACCUMULATE(1);
#undef ACCUMULATE
    }
}
#endif

/* Ask for a block's rows of one KV head ahead of their use: a head's rows are strided through
   the block (the other heads sit between them) and the blocks are scattered over the cache, so
   the hardware prefetcher alone leaves the loads waiting on memory. */
static inline void prefetch_rows(const char *first, int64_t rows, int64_t stride, int64_t row_bytes) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(first + r * stride + b);
}

/* Whether attend_kv_head takes a block whose last row is `last_row` with the block passes, which
   ask for the next block themselves as they go. The AVX-512 ones take every block, the AVX2 ones
   those that every query row sees whole. */
static inline int whole_block_passes(int64_t dim, int64_t last_row, int64_t first_run_row) {
#ifdef __AVX512F__
    (void)last_row, (void)first_run_row;
    return IN_BLOCKS(dim);
#elif defined(AVX2_ROWS)
    return IN_BLOCKS(dim) && last_row <= first_run_row;
#else
    (void)dim, (void)last_row, (void)first_run_row;
    return 0;
#endif
}

/* The first `seen` (>= 1) scores of a row to probabilities, in place; their largest score and
   the sum of their exponentials (relative to it) to *top and *total. */
static inline void softmax(float *row, int64_t seen, float *top, float *total) {
    float high = row[0], sum = 0.f;
    for (int64_t t = 0; t < seen; t++) high = row[t] > high ? row[t] : high;
    for (int64_t t = 0; t < seen; t++) {
        row[t] = expf(row[t] - high);
        sum += row[t];
    }
    for (int64_t t = 0; t < seen; t++) row[t] /= sum;
    *top = high, *total = sum;
}

/* A context is attended in segments of SEGMENT_BLOCKS blocks at fixed positions (512 tokens at
   16-token blocks): each segment's softmax and sums of V on their own, then the segments merged,
   in order, each weighted by its share of the exponentials (flash-decoding's split). A segment's
   arithmetic does not depend on who runs it, so a (sequence, KV head) task that runs its
   segments one after another and segments run as tasks of their own give the same outputs,
   bit for bit; contexts of one segment are computed as before segments existed. Decodes too few
   for the threads (paged_attention_runs) run their segments as tasks: one decode of the embedded
   model has 3 KV heads for 2 threads, and one thread sat out a third of its attention. */
#ifndef SEGMENT_BLOCKS
#define SEGMENT_BLOCKS 32
#endif

static inline int64_t num_segments(int64_t len, int64_t block_size) {
    const int64_t blocks = (len + block_size - 1) / block_size;
    return (blocks + SEGMENT_BLOCKS - 1) / SEGMENT_BLOCKS;
}

/* One segment's results for `rows` query rows: acc [rows, dim] (the segment's probabilities times
   V), top and total [rows] (softmax's; total 0 where a row sees none of the segment). */
typedef struct {
    float *acc, *top, *total;
} SegmentSums;

static inline SegmentSums segment_sums(float *base, int64_t segment, int64_t rows, int64_t dim) {
    float *at = base + segment * rows * (dim + 2);
    return (SegmentSums){at, at + rows * dim, at + rows * dim + rows};
}

/* One run of `nq` consecutive tokens of a sequence (a decode: nq = 1) and one KV head, over the
   context's segment `segment`: the nq * group query rows (token i's `group` heads, rows q_row
   apart) against its tokens, causally: token i sees the first len - nq + 1 + i of the context's
   `len`. Each cached row of K and V is read once for all the queries that see it (the rows from
   `from` on), so a chunk's queries share the passes over its prefix. Returns 0 when out of
   memory for its scores. Blocks are walked block by block, so finding a token's slot needs no
   division. Always inlined, so the calls below with a constant head_dim and dtype get loops the
   compiler unrolls and vectorises for them. */
static inline __attribute__((always_inline)) int attend_segment(
        const char *q, int64_t q_row, int64_t nq, const char *k_head, const char *v_head, const int64_t *table,
        int64_t len, int64_t segment, int64_t group, int64_t slot_bytes, int64_t block_size, float scale,
        const int is_bf16, const int64_t dim, const int amx, SegmentSums sums) {
    const int64_t elem = is_bf16 ? 2 : 4, rows = nq * group, first_run_row = len - nq;
    const int64_t begin = segment * SEGMENT_BLOCKS * block_size;
    const int64_t end = len < begin + SEGMENT_BLOCKS * block_size ? len : begin + SEGMENT_BLOCKS * block_size;
    const int64_t span = end - begin;  /* a row's scores: stride `span`, the segment's first token at 0 */
    const size_t tile_bytes = 1024 * (size_t)(((rows + 15) / 16) * (dim / 32) + 1);  /* query tiles, sums */
    float *scores = malloc(sizeof(float) * (size_t)(rows * span + (rows + 1) * dim) + 2 * (size_t)(rows * dim) +
                           (amx ? tile_bytes : 0));
    if (!scores) return 0;
    float *qf = scores + rows * span, *acc = sums.acc, *buf = qf + rows * dim;
    uint16_t *qb = (uint16_t *)(buf + dim);  /* the queries as bf16, where they are */
    uint32_t *query_tiles = (uint32_t *)(qb + rows * dim);
    float *tile_sums = (float *)(query_tiles + (tile_bytes - 1024) / 4);
    prefetch_rows(k_head + table[begin / block_size] * block_size * slot_bytes, block_size, slot_bytes, dim * elem);
    for (int64_t i = 0; i < nq; i++)
        for (int64_t g = 0; g < group; g++) {
            memcpy(qf + (i * group + g) * dim, as_float(q + i * q_row + g * dim * elem, is_bf16, dim, buf),
                   sizeof(float) * (size_t)dim);
            if (is_bf16) memcpy(qb + (i * group + g) * dim, q + i * q_row + g * dim * elem, 2 * (size_t)dim);
        }
#ifdef HAVE_ATTENTION_AMX
    if (amx) pack_query_tiles(qb, rows, dim, query_tiles);
#endif
    /* Each pass's last block asks for what is read next: V's first block, then the next segment's
       first K block (a task of its own may read that one: then the request was wasted, 2 KB). */
    const char *v_first = v_head + table[begin / block_size] * block_size * slot_bytes;
    const char *k_after = end < len ? k_head + table[end / block_size] * block_size * slot_bytes : NULL;
    for (int64_t first = begin; first < end; first += block_size) {
        const char *cached = k_head + table[first / block_size] * block_size * slot_bytes;
        const int64_t n = end - first < block_size ? end - first : block_size;
        const char *next = first + block_size < end ? k_head + table[first / block_size + 1] * block_size * slot_bytes
                                                    : v_first;
        const int in_blocks = !amx && whole_block_passes(dim, first + n - 1, first_run_row);
        if (next && !in_blocks) prefetch_rows(next, block_size, slot_bytes, dim * elem);
#ifdef HAVE_ATTENTION_AMX
        if (amx) {
            score_block_amx(query_tiles, cached, slot_bytes, n, dim, rows, scores + first - begin, span, scale,
                            tile_sums);
            continue;
        }
#endif
#ifdef __AVX512F__
        if (in_blocks) {
            score_block(qf, qb, cached, slot_bytes, n, is_bf16, dim, rows, scores + first - begin, span, scale, next,
                        next ? dim * elem : 0);
            continue;
        }
#elif defined(AVX2_ROWS)
        if (in_blocks) {
            score_block(qf, cached, slot_bytes, n, is_bf16, dim, rows, scores + first - begin, span, scale, next,
                        next ? dim * elem : 0);
            continue;
        }
#endif
        for (int64_t o = 0; o < n; o++) {
            const int64_t t = first + o, from = (t > first_run_row ? t - first_run_row : 0) * group;
            score_row(qf + from * dim, cached + o * slot_bytes, is_bf16, dim, rows - from,
                      scores + from * span + t - begin, span, scale, buf);
        }
    }
    for (int64_t r = 0; r < rows; r++) {  /* and a row's unseen keys weigh 0 (blocks go whole) */
        const int64_t seen_to = first_run_row + 1 + r / group, seen = seen_to < end ? seen_to - begin : span;
        sums.total[r] = 0.f, sums.top[r] = 0.f;
        if (seen > 0) softmax(scores + r * span, seen, sums.top + r, sums.total + r);
        if (seen < span) memset(scores + r * span + (seen > 0 ? seen : 0), 0,
                                sizeof(float) * (size_t)(span - (seen > 0 ? seen : 0)));
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * dim));
    for (int64_t first = begin; first < end; first += block_size) {
        const char *cached = v_head + table[first / block_size] * block_size * slot_bytes;
        const int64_t n = end - first < block_size ? end - first : block_size;
        const char *next = first + block_size < end ? v_head + table[first / block_size + 1] * block_size * slot_bytes
                                                    : k_after;
        const int in_blocks = whole_block_passes(dim, first + n - 1, first_run_row);
        if (next && !in_blocks) prefetch_rows(next, block_size, slot_bytes, dim * elem);
#if defined(__AVX512F__) || defined(AVX2_ROWS)
        if (in_blocks) {
            accumulate_block(acc, scores + first - begin, span, cached, slot_bytes, n, is_bf16, dim, rows, next,
                             next ? dim * elem : 0);
            continue;
        }
#endif
        for (int64_t o = 0; o < n; o++) {
            const int64_t t = first + o, from = (t > first_run_row ? t - first_run_row : 0) * group;
            accumulate_row(acc + from * dim, scores + from * span + t - begin, span, cached + o * slot_bytes, is_bf16,
                           dim, rows - from, buf);
        }
    }
    free(scores);
    return 1;
}

/* The outputs of `rows` query rows (row r = token r / group's head r % group) from the context's
   `count` segments: each segment's sums weighted by its exponentials' total relative to the
   largest top, in segment order. One segment is its own output. */
static int merge_segments(const float *partials, int64_t count, int64_t rows, int64_t group, int64_t dim, char *out,
                          int64_t out_row, int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    float *row = count > 1 ? malloc(sizeof(float) * (size_t)dim) : NULL;
    if (count > 1 && !row) return 0;
    for (int64_t r = 0; r < rows; r++) {
        char *to = out + (r / group) * out_row + (r % group) * dim * elem;
        if (count == 1) {
            store_row(to, is_bf16, dim, segment_sums((float *)partials, 0, rows, dim).acc + r * dim);
            continue;
        }
        float high = -INFINITY, weight = 0.f;
        for (int64_t s = 0; s < count; s++) {
            const SegmentSums p = segment_sums((float *)partials, s, rows, dim);
            if (p.total[r] > 0.f && p.top[r] > high) high = p.top[r];
        }
        memset(row, 0, sizeof(float) * (size_t)dim);
        for (int64_t s = 0; s < count; s++) {
            const SegmentSums p = segment_sums((float *)partials, s, rows, dim);
            if (!(p.total[r] > 0.f)) continue;
            const float w = p.total[r] * expf(p.top[r] - high);
            weight += w;
            for (int64_t d = 0; d < dim; d++) row[d] += w * p.acc[r * dim + d];
        }
        for (int64_t d = 0; d < dim; d++) row[d] /= weight;
        store_row(to, is_bf16, dim, row);
    }
    free(row);
    return 1;
}

/* Runs of queries over their cached contexts, read from the blocks in place.
   q: [tokens, heads, head_dim] rows `q_stride` elements apart; out likewise with `out_stride`.
   k_cache, v_cache: [slots, kv_heads, head_dim], slot = block * block_size + offset.
   block_tables: [runs, table_width]; context_lens: [runs], the run's own tokens included.
   query_starts: [runs + 1], run r's tokens are query_starts[r]..query_starts[r + 1] - 1; NULL:
   run r is token r alone (decodes). k_new, v_new (NULL: already in the cache): the tokens' new
   [tokens, kv_heads, head_dim], rows k_stride / v_stride elements apart, written to `slots`
   first: a decode's own task writes the rows it then reads; runs of several tokens, which read
   each other's rows, have them all written before any is read. Returns 0 when out of memory. */
int paged_attention_runs(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                         void *k_cache, void *v_cache, const int64_t *block_tables,
                         int64_t table_width, const int64_t *context_lens, const int64_t *query_starts,
                         int64_t num_runs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int is_bf16, int num_threads,
                         const void *k_new, int64_t k_stride, const void *v_new, int64_t v_stride,
                         const int64_t *slots) {
    const int64_t group = num_heads / num_kv_heads, elem = is_bf16 ? 2 : 4, row_bytes = head_dim * elem;
    const int64_t slot_bytes = num_kv_heads * row_bytes, pairs = num_runs * num_kv_heads;
    int ok = 1;
    if (k_new && query_starts) {
        const int64_t tokens = query_starts[num_runs];
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 16)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                memcpy((char *)k_cache + slots[t] * slot_bytes + h * row_bytes,
                       (const char *)k_new + (t * k_stride + h * head_dim) * elem, (size_t)row_bytes);
                memcpy((char *)v_cache + slots[t] * slot_bytes + h * row_bytes,
                       (const char *)v_new + (t * v_stride + h * head_dim) * elem, (size_t)row_bytes);
            }
    }
    int amx = 0;
#ifdef HAVE_ATTENTION_AMX
    amx = AMX_SCORES(is_bf16, head_dim, block_size) && quant_amx_supported();
#endif
    /* Each (run, KV head) pair's segments and where their sums go: pair p's segments are tasks
       task_of[p] .. task_of[p + 1] - 1, its sums at offset_of[p]. */
    int64_t *task_of = malloc(sizeof(int64_t) * (size_t)(2 * pairs + 2)), *offset_of = task_of + pairs + 1;
    if (!task_of) return 0;
    task_of[0] = offset_of[0] = 0;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t s = p / num_kv_heads, nq = query_starts ? query_starts[s + 1] - query_starts[s] : 1;
        const int64_t count = num_segments(context_lens[s], block_size);
        task_of[p + 1] = task_of[p] + count;
        offset_of[p + 1] = offset_of[p] + count * nq * group * (head_dim + 2);
    }
    /* Segments are tasks of their own where the pairs are too few to keep the threads busy. */
    const int64_t tasks = pairs < 2 * num_threads ? task_of[pairs] : pairs;
    float *partials = malloc(sizeof(float) * (size_t)(tasks == pairs ? 0 : offset_of[pairs]) + 1);
    if (!partials) {
        free(task_of);
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    {
#ifdef HAVE_ATTENTION_AMX
    if (amx) configure_score_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t p = task;  /* the pair; split, the one whose segments hold this task (pairs are few) */
        if (tasks != pairs)
            for (p = 0; task_of[p + 1] <= task; p++) {}
        const int64_t s = p / num_kv_heads, h = p % num_kv_heads, count = task_of[p + 1] - task_of[p];
        const int64_t t0 = query_starts ? query_starts[s] : s, nq = query_starts ? query_starts[s + 1] - t0 : 1;
        const int64_t rows = nq * group, first = tasks == pairs ? 0 : task - task_of[p];
        const int64_t last = tasks == pairs ? count : first + 1;
        const char *qs = (const char *)q + (t0 * q_stride + h * group * head_dim) * elem;
        const char *k_head = (const char *)k_cache + h * row_bytes, *v_head = (const char *)v_cache + h * row_bytes;
        const int64_t *table = block_tables + s * table_width;
        if (k_new && !query_starts && last == count) {  /* the new row, read by the last segment only */
            const int64_t to = slots[s] * slot_bytes;
            memcpy((char *)k_head + to, (const char *)k_new + (s * k_stride + h * head_dim) * elem, (size_t)row_bytes);
            memcpy((char *)v_head + to, (const char *)v_new + (s * v_stride + h * head_dim) * elem, (size_t)row_bytes);
        }
        float *sums = tasks == pairs ? malloc(sizeof(float) * (size_t)(count * rows * (head_dim + 2)))
                                     : partials + offset_of[p];
        int done = sums != NULL;
        for (int64_t j = first; done && j < last; j++) {
            const SegmentSums into = segment_sums(sums, j, rows, head_dim);
#define ATTEND(bf16, dim) attend_segment(qs, q_stride * elem, nq, k_head, v_head, table, context_lens[s], j, group, \
                                         slot_bytes, block_size, scale, bf16, dim, amx, into)
            if (is_bf16 && head_dim == 64) done = ATTEND(1, 64);
            else if (is_bf16 && head_dim == 128) done = ATTEND(1, 128);
            else if (!is_bf16 && head_dim == 64) done = ATTEND(0, 64);
            else if (!is_bf16 && head_dim == 128) done = ATTEND(0, 128);
            else done = ATTEND(is_bf16, head_dim);
#undef ATTEND
        }
        if (done && tasks == pairs)
            done = merge_segments(sums, count, rows, group, head_dim,
                                  (char *)out + (t0 * out_stride + h * group * head_dim) * elem, out_stride * elem, is_bf16);
        if (tasks == pairs) free(sums);
        if (!done) {
#pragma omp atomic write
            ok = 0;
        }
    }
    if (tasks != pairs) {  /* the split pairs' segments merged, once all are done (the barrier above) */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t s = p / num_kv_heads, h = p % num_kv_heads;
            const int64_t t0 = query_starts ? query_starts[s] : s, nq = query_starts ? query_starts[s + 1] - t0 : 1;
            if (!merge_segments(partials + offset_of[p], task_of[p + 1] - task_of[p], nq * group, group, head_dim,
                                (char *)out + (t0 * out_stride + h * group * head_dim) * elem, out_stride * elem,
                                is_bf16)) {
#pragma omp atomic write
                ok = 0;
            }
        }
    }
#ifdef HAVE_ATTENTION_AMX
    if (amx) _tile_release();
#endif
    }
    free(partials), free(task_of);
    return ok;
}

/* Decodes (one token per sequence): paged_attention_runs with a run per token. */
int paged_decode_attention(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                           void *k_cache, void *v_cache, const int64_t *block_tables,
                           int64_t table_width, const int64_t *context_lens, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int is_bf16, int num_threads,
                           const void *k_new, int64_t k_stride, const void *v_new, int64_t v_stride,
                           const int64_t *slots) {
    return paged_attention_runs(q, q_stride, out, out_stride, k_cache, v_cache, block_tables, table_width,
                                context_lens, NULL, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                is_bf16, num_threads, k_new, k_stride, v_new, v_stride, slots);
}

/* The small element-wise steps of a decoder layer, bf16 only (fp32 keeps torch's ops: the
   reference arithmetic). At a few tokens each is dominated by the fixed cost of launching it
   (~19 us for torch's RMSNorm of one 576-value row, ~16 us for RoPE's six ops); here each is one
   pass, computed in fp32 and rounded once. Rows are split over threads from 16 rows up. */

/* out = RMSNorm(x) * weight over rows of `dim`. With `delta`, first x_out = x + delta (rounded
   to bf16, as torch's add) and the norm is taken of x_out: the residual add fused in. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *delta, uint16_t *x_out, uint16_t *out,
                   const uint16_t *weight, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        float *buf = malloc(sizeof(float) * (size_t)dim);
        const uint16_t *xr = x + r * dim;
        float sum = 0.f;
        for (int64_t d = 0; d < dim; d++) {
            float v = bf16_to_float(xr[d]);
            if (delta) {
                const uint16_t rounded = float_to_bf16(v + bf16_to_float(delta[r * dim + d]));
                x_out[r * dim + d] = rounded;
                v = bf16_to_float(rounded);
            }
            buf[d] = v;
            sum += v * v;
        }
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = float_to_bf16(buf[d] * inv * bf16_to_float(weight[d]));
        free(buf);
    }
}

/* RoPE (the rotate-half form) in place on `heads` heads of each of `rows` tokens; token r's
   heads start at qk + r * row_stride; cos/sin: [rows, dim]. */
static inline void rotate_half(const float *restrict x, float *restrict y, const float *restrict c,
                               const float *restrict s, int64_t half) {
    for (int64_t d = 0; d < half; d++) {
        y[d] = x[d] * c[d] - x[d + half] * s[d];
        y[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
    }
}

void rope_bf16(uint16_t *qk, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
               const uint16_t *cos, const uint16_t *sin) {
#pragma omp parallel for if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        float c[dim], s[dim], x[dim], y[dim];
        for (int64_t d = 0; d < dim; d++) {
            c[d] = bf16_to_float(cos[r * dim + d]);
            s[d] = bf16_to_float(sin[r * dim + d]);
        }
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *head = qk + r * row_stride + h * dim;
            for (int64_t d = 0; d < dim; d++) x[d] = bf16_to_float(head[d]);
            rotate_half(x, y, c, s, dim / 2);
            for (int64_t d = 0; d < dim; d++) head[d] = float_to_bf16(y[d]);
        }
    }
}

/* out[r] = silu(gate) * up, where row r of gate_up is [gate | up], each `inter` wide. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        for (int64_t d = 0; d < inter; d++) {
            const float a = bf16_to_float(g[d]);
            out[r * inter + d] = float_to_bf16(a / (1.f + expf(-a)) * bf16_to_float(u[d]));
        }
    }
}
