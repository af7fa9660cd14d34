/* The largest value of each row of logits and its first index: torch.max(x, dim=-1), the
   sampler's greedy tokens (model/cpu_kernels.py `row_max`).

   torch's CPU reduction carries an index with every element: in the embedded model's decode
   steps it took 76 us for one row of its 49,152-token vocabulary and 418 us for a 16-request
   batch's 16 rows, this kernel 36 and 114 (benchmarks/row_max.py, 2-core AMD EPYC Zen 4). Each
   vector lane keeps its own running maximum and the index where it first reached it, and the
   lanes are merged at the end: the smallest index among those holding the maximum, so ties go
   to the first index as torch's do. A NaN makes its row's value NaN at the first NaN's index, as torch propagates it
   (the sampler then fails that row alone). The library is built with -ffast-math, under which
   the compiler may assume no NaN: they are found from their bits, never by comparing. */

#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#elif defined(__AVX2__)
#include <immintrin.h>
#define LANES 8
#endif

static inline int is_nan(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

/* The first NaN of a row from `from` (there is one). */
static int64_t first_nan(const float *x, int64_t from, int64_t n) {
    for (int64_t i = from; i < n; i++)
        if (is_nan(x[i])) return i;
    return n;  /* not reached */
}

/* Elements from..n-1 into the running (best, at); returns the first NaN's index, or -1. */
static int64_t scalar_max(const float *x, int64_t from, int64_t n, float *best, int64_t *at) {
    for (int64_t i = from; i < n; i++) {
        if (is_nan(x[i])) return i;
        if (x[i] > *best) *best = x[i], *at = i;
    }
    return -1;
}

static void max_of_row(const float *x, int64_t n, float *value, int64_t *index) {
    float best = x[0];
    int64_t at = 0, nan_at = is_nan(best) ? 0 : -1;
#ifdef LANES
    const int64_t whole = n / LANES * LANES;
    if (nan_at < 0 && whole >= 2 * LANES) {
#if LANES == 16
        const __m512i exponent = _mm512_set1_epi32(0x7f800000), magnitude = _mm512_set1_epi32(0x7fffffff);
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 top = _mm512_loadu_ps(x);
        __m512i where = lane;
        int any_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(top), magnitude), exponent) != 0;
        for (int64_t i = LANES; !any_nan && i < whole; i += LANES) {
            const __m512 v = _mm512_loadu_ps(x + i);  /* a NaN is never above: it ends the loop, no more */
            any_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude), exponent) != 0;
            const __mmask16 above = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
            top = _mm512_mask_mov_ps(top, above, v);
            where = _mm512_mask_mov_epi32(where, above, _mm512_add_epi32(_mm512_set1_epi32((int)i), lane));
        }
        float tops[LANES];
        int32_t wheres[LANES];
        _mm512_storeu_ps(tops, top), _mm512_storeu_si512(wheres, where);
#else
        const __m256i exponent = _mm256_set1_epi32(0x7f800000), magnitude = _mm256_set1_epi32(0x7fffffff);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256 top = _mm256_loadu_ps(x);
        __m256i where = lane;
        int any_nan = _mm256_movemask_epi8(_mm256_cmpgt_epi32(
            _mm256_and_si256(_mm256_castps_si256(top), magnitude), exponent)) != 0;
        for (int64_t i = LANES; !any_nan && i < whole; i += LANES) {
            const __m256 v = _mm256_loadu_ps(x + i);  /* a NaN is never above: it ends the loop, no more */
            any_nan = _mm256_movemask_epi8(_mm256_cmpgt_epi32(
                _mm256_and_si256(_mm256_castps_si256(v), magnitude), exponent)) != 0;
            const __m256 above = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
            top = _mm256_blendv_ps(top, v, above);
            where = _mm256_blendv_epi8(where, _mm256_add_epi32(_mm256_set1_epi32((int)i), lane),
                                       _mm256_castps_si256(above));
        }
        float tops[LANES];
        int32_t wheres[LANES];
        _mm256_storeu_ps(tops, top), _mm256_storeu_si256((__m256i *)wheres, where);
#endif
        if (any_nan) {
            nan_at = first_nan(x, 0, n);
        } else {
            best = tops[0], at = wheres[0];
            for (int j = 1; j < LANES; j++)
                if (tops[j] > best || (tops[j] == best && wheres[j] < at)) best = tops[j], at = wheres[j];
            nan_at = scalar_max(x, whole, n, &best, &at);
        }
    } else if (nan_at < 0) {
        nan_at = scalar_max(x, 1, n, &best, &at);
    }
#else
    if (nan_at < 0) nan_at = scalar_max(x, 1, n, &best, &at);
#endif
    if (nan_at >= 0) best = x[nan_at], at = nan_at;
    *value = best, *index = at;
}

/* Rows rows[0..count-1] of x [?, n] (rows NULL: rows 0..count-1): the row picked in place, where
   torch would gather a copy first. */
void row_max(const float *x, const int64_t *rows, int64_t count, int64_t n, float *values, int64_t *indices,
             int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count > 1)
    for (int64_t r = 0; r < count; r++) max_of_row(x + (rows ? rows[r] : r) * n, n, values + r, indices + r);
}
