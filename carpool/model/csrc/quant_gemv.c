/* Weight-only quantized matrix products for a few tokens (decode steps), with AVX-512 VNNI
   (model/quant.py packs the weights, model/cpu_kernels.py builds and loads this file).

   At one token a linear layer reads each weight once for one multiply-add, so its time is the
   time to stream the weights plus the work to unpack them. torch's int4 kernel widens every
   4-bit code to a float before its FMA. Here, as in llama.cpp, the activations are quantized to
   int8 once per call (a scale per group of 32 channels, like GGUF Q8_0), and `vpdpbusd`
   multiplies unsigned weight bytes by signed activation bytes, summing each four into an int32
   lane: 64 multiply-adds in one instruction. Each group's integer sums are scaled once, in fp32.

   Weights are stored in blocks of 16 output rows: one zmm holds 4 consecutive input channels
   of 16 rows, so a lane is a row and every product is against one broadcast activation quad.
   Lanes never need summing across, and a group's 16 scales are one vector load.

   int4: w = code * scale + min per row and group of 32 input channels (GGUF Q4_1's form),
   computed as (code - 8) * scale + zero with zero = min + 8 * scale. For each block and group,
   256 bytes: zmm j (0..3) holds channels 4j..4j+3 of the 16 rows in its low nibbles and
   channels 16 + 4j.. in its high ones. The codes are multiplied as unsigned 0..15 and the 8
   taken back out exactly, in integers, from the activations' own sum (sum((c - 8) x) =
   sum(c x) - 8 sum(x)): the rounding of x then meets weights centred on their group, as
   accurate as symmetric weights. scale and min: [blocks, groups, 16] fp16 (Q4_1's).
   int8: w = code * scale per row and group of 32 (GGUF Q8_0's form); codes stored as code + 128
   in the same block layout (64 bytes per 4 channels), the 128 taken back out like int4's 8;
   scales [blocks, groups, 16] fp16.

   With neither AVX-512 VNNI nor AVX2 `quant_gemv_supported` says 0 and quant.py keeps torch's
   kernels. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2 1
#include <immintrin.h>
#endif

#define GROUP 32
#define ROWS 16 /* output rows per block: one zmm lane each */
#define TILE 4  /* AVX2: tokens per pass over a block, their accumulators in registers */
#define UNPACK_FROM 5  /* AVX2 int4: tokens from which a block's codes are unpacked once a call (avx2_int4_tokens);
                          at 2-4 tokens the packed codes in tiles of TILE measured faster (Zen 3) */

#define TILE_TOKENS 16  /* tokens per AMX tile: AMX runs whole tiles, VNNI the rest */
#ifndef AMX_FROM_TOKENS
#define AMX_FROM_TOKENS TILE_TOKENS  /* `carpool bench quant`; BENCHMARKS.md "Hybrid steps in one C call" */
#endif

/* The activations of one call: x ~ q * scale per group of 32. */
typedef struct {
    int8_t *q;      /* [tokens, k] */
    float *scale;   /* [tokens, groups] */
    float *sum;     /* [tokens, groups]: the sum of x over the group (int4's zero term) */
    int32_t *qsum;  /* [tokens, groups]: the sum of q over the group (the codes' offsets) */
    int64_t groups;
} Activations;

/* One block for all of a call's activation arrays (freed through a->scale); 0 when out of memory. */
static inline int alloc_activations(int64_t tokens, int64_t k, Activations *a) {
    a->groups = k / GROUP;
    const int64_t values = tokens * a->groups;
    char *mem = malloc((sizeof(float) * 2 + sizeof(int32_t)) * (size_t)values + (size_t)(tokens * k));
    if (!mem) return 0;
    a->scale = (float *)mem;
    a->sum = a->scale + values;
    a->qsum = (int32_t *)(a->sum + values);
    a->q = (int8_t *)(a->qsum + values);
    return 1;
}

int quant_gemv_supported(void) {
#if defined(HAVE_VNNI) || defined(HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}

#ifndef PREFETCH_AHEAD  /* bytes: a step streams its weights from DRAM, and the hardware's own prefetch lags */
#define PREFETCH_AHEAD 4096
#endif

#ifdef HAVE_VNNI
#include <omp.h>

static int quantize_activations(const void *x, int is_bf16, int64_t tokens, int64_t k, Activations *a) {
    if (!alloc_activations(tokens, k, a)) return 0;
    const int64_t values = tokens * a->groups;
    for (int64_t v = 0; v < values; v++) {
        const int64_t i = v * GROUP;  /* tokens are rows of k = groups * GROUP */
        __m512 lo, hi;
        __m512i qlo, qhi;
        a->scale[v] = quantize_group32(x, i, is_bf16, a->q + i, &lo, &hi, &qlo, &qhi);
        a->sum[v] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        a->qsum[v] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
    return 1;
}

#ifndef VNNI_TILE
#define VNNI_TILE 8  /* AVX-512: tokens per pass over a block, each unpacking of its codes serving 8
                        (4: steps of 16 tokens 1.03-1.04x slower, Zen 4; BENCHMARKS.md "Kernels") */
#endif
_Static_assert(VNNI_TILE >= 1 && VNNI_TILE <= 8, "FOR_EACH_TILE has cases for up to 8 tokens");

/* The integer dot products of 16 rows with one group of `tn` tokens (tn constant where inlined):
   w[0..7] hold the group's 8 channel quads, start[t] the accumulator's first value. */
static inline __attribute__((always_inline)) void group_dots(
        const __m512i w[8], const int8_t *xq, int64_t k, const int tn, const __m512i start[VNNI_TILE], __m512i dot[VNNI_TILE]) {
    for (int t = 0; t < tn; t++) {
        const int8_t *x = xq + t * k;
        __m512i d0 = start[t], d1 = _mm512_setzero_si512();  /* two chains: half the latency */
        for (int j = 0; j < 8; j += 2) {
            d0 = _mm512_dpbusd_epi32(d0, w[j], quad_at(x + 4 * j));
            d1 = _mm512_dpbusd_epi32(d1, w[j + 1], quad_at(x + 4 * j + 4));
        }
        dot[t] = _mm512_add_epi32(d0, d1);
    }
}

/* One block of 16 rows of an int4 weight against `tn` tokens from t0. */
static inline __attribute__((always_inline)) void int4_block(
        const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const Activations *a,
        int64_t k, int64_t t0, const int tn, __m512 acc[VNNI_TILE]) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int t = 0; t < tn; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a->groups; g++) {
        const uint8_t *packed = codes + g * 256;
        for (int j = 0; j < 4; j++) _mm_prefetch((const char *)packed + PREFETCH_AHEAD + j * 64, _MM_HINT_T0);
        __m512i w[8], start[VNNI_TILE], dot[VNNI_TILE];
        for (int j = 0; j < 4; j++) {
            const __m512i p = _mm512_loadu_si512(packed + j * 64);
            w[j] = _mm512_and_si512(p, nibble);
            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble);
        }
        for (int t = 0; t < tn; t++) start[t] = _mm512_set1_epi32(-8 * a->qsum[(t0 + t) * a->groups + g]);
        group_dots(w, a->q + t0 * k + g * GROUP, k, tn, start, dot);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g * ROWS)));
        const __m512 z = _mm512_fmadd_ps(_mm512_set1_ps(8.f), s,
                                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(min + g * ROWS))));
        for (int t = 0; t < tn; t++) {
            const int64_t v = (t0 + t) * a->groups + g;
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(s, _mm512_set1_ps(a->scale[v])), acc[t]);
            acc[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(a->sum[v]), acc[t]);
        }
    }
}

/* One block of 16 rows of an int8 weight (codes + 128) against `tn` tokens from t0. */
static inline __attribute__((always_inline)) void int8_block(
        const uint8_t *codes, const uint16_t *scale, const Activations *a, int64_t k, int64_t t0, const int tn,
        __m512 acc[VNNI_TILE]) {
    for (int t = 0; t < tn; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a->groups; g++) {
        __m512i w[8], start[VNNI_TILE], dot[VNNI_TILE];
        for (int j = 0; j < 8; j++) {
            _mm_prefetch((const char *)codes + g * 512 + PREFETCH_AHEAD + j * 64, _MM_HINT_T0);
            w[j] = _mm512_loadu_si512(codes + g * 512 + j * 64);
        }
        for (int t = 0; t < tn; t++) start[t] = _mm512_set1_epi32(-128 * a->qsum[(t0 + t) * a->groups + g]);
        group_dots(w, a->q + t0 * k + g * GROUP, k, tn, start, dot);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g * ROWS)));
        for (int t = 0; t < tn; t++) {
            const __m512 dx = _mm512_set1_ps(a->scale[(t0 + t) * a->groups + g]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(s, dx), acc[t]);
        }
    }
}

#define FOR_EACH_TILE(BLOCK, from)                                                    \
    for (int64_t t0 = (from); t0 < tokens; t0 += VNNI_TILE) {                         \
        __m512 acc[VNNI_TILE];                                                        \
        const int64_t tn = tokens - t0 < VNNI_TILE ? tokens - t0 : VNNI_TILE;         \
        switch (tn) {                                                                 \
            case 8: BLOCK(8); break;                                                  \
            case 7: BLOCK(7); break;                                                  \
            case 6: BLOCK(6); break;                                                  \
            case 5: BLOCK(5); break;                                                  \
            case 4: BLOCK(4); break;                                                  \
            case 3: BLOCK(3); break;                                                  \
            case 2: BLOCK(2); break;                                                  \
            default: BLOCK(1); break;                                                 \
        }                                                                             \
        for (int64_t t = 0; t < tn; t++) store16(out, (t0 + t) * n + b * ROWS, acc[t], n - b * ROWS, is_bf16); \
    }

#endif

#if defined(HAVE_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* AMX: the same integer products, 16 tokens x 16 rows x 32 channels per instruction.
   A tile holds 16 tokens' codes of one group (the activations' own rows, k bytes apart); B holds
   one block's group in the layout above, which is AMX's (a row per channel quad, a row's 64
   bytes the 16 output rows' 4 channels), so int8 weights load in place and int4's are only split
   into bytes. Each group's int32 sums then go through the same fp32 arithmetic as the VNNI
   kernel, in the same order: the two kernels' outputs are equal bit for bit. The sums leave the
   tile unit once per group, since every group has its own scales; that fp32 pass and the tile
   stores, not the products, are most of the time: 0.7-1.0x the VNNI kernel's time from 16 tokens
   (slower below: a part-used tile costs a whole one), so it runs whole tiles only. From
   quant.tile_from() tokens the layers take kquant.c's tile kernel instead, which widens a block's
   codes to bf16 once and, on AMX, multiplies them on the bf16 unit: no per-group step, and the
   widening is spread over the chunk's tokens. */

/* Linux gives the 8 KB of tile state only to a process that asks (once; then every thread). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

/* Two sets of tiles (sums, activations, weights), for two groups in flight. */
static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int set = 0; set < 2; set++) {
        cfg.rows[set] = TILE_TOKENS, cfg.colsb[set] = ROWS * 4;          /* int32 sums [token][row] */
        cfg.rows[2 + set] = TILE_TOKENS, cfg.colsb[2 + set] = GROUP;     /* int8 codes [token][channel] */
        cfg.rows[4 + set] = GROUP / 4, cfg.colsb[4 + set] = ROWS * 4;    /* weight bytes [quad][row, 4] */
    }
    _tile_loadconfig(&cfg);
}

/* An int4 block's codes as bytes, groups of 8 quads x 64 bytes (the int8 layout, less the 128). */
static void unpack_int4(const uint8_t *codes, uint8_t *bytes, int64_t groups) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++)
        for (int j = 0; j < 4; j++) {
            const __m512i p = _mm512_loadu_si512(codes + g * 256 + j * 64);
            _mm512_store_si512(bytes + g * 512 + j * 64, _mm512_and_si512(p, nibble));
            _mm512_store_si512(bytes + g * 512 + (j + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble));
        }
}

#define CHUNK_GROUPS 8  /* groups whose sums are stored at once: 8 KB, in L1 with the weights */

/* The int32 sums of 16 tokens from q with groups g0..g0+count-1 of a block: sums[g - g0] =
   [16 tokens][16 rows]. Two groups in flight, each in its own tiles. */
static inline void tile_sums(const int8_t *q, int64_t k, const uint8_t *w, int64_t g0, int64_t count, int32_t *sums) {
    int64_t g = 0;
    for (; g + 2 <= count; g += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, q + (g0 + g) * GROUP, k);
        _tile_loadd(4, w + (g0 + g) * 512, 64);
        _tile_loadd(3, q + (g0 + g + 1) * GROUP, k);
        _tile_loadd(5, w + (g0 + g + 1) * 512, 64);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
        _tile_stored(0, sums + g * 256, 64);
        _tile_stored(1, sums + (g + 1) * 256, 64);
    }
    if (g < count) {
        _tile_zero(0);
        _tile_loadd(2, q + (g0 + g) * GROUP, k);
        _tile_loadd(4, w + (g0 + g) * 512, 64);
        _tile_dpbsud(0, 2, 4);
        _tile_stored(0, sums + g * 256, 64);
    }
}

/* Tokens t..t+15 against block b (w: its codes as bytes; s, z: its scales and zeros in fp32),
   through the VNNI kernel's fp32 steps, into out: 16 independent chains of FMAs, where one token
   at a time would wait on each FMA's latency. */
static inline __attribute__((always_inline)) void amx_tile(
        const uint8_t *w, const float *s, const float *z, const Activations *a, const int32_t *start, int64_t k,
        int64_t t, int32_t *sums, void *out, int64_t n, int64_t b, int is_bf16, const int int4) {
    __m512 acc[TILE_TOKENS];
    for (int i = 0; i < TILE_TOKENS; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < a->groups; g0 += CHUNK_GROUPS) {
        const int64_t count = a->groups - g0 < CHUNK_GROUPS ? a->groups - g0 : CHUNK_GROUPS;
        tile_sums(a->q + t * k, k, w, g0, count, sums);
        for (int64_t g = g0; g < g0 + count; g++) {
            const __m512 sg = _mm512_loadu_ps(s + g * ROWS), zg = int4 ? _mm512_loadu_ps(z + g * ROWS) : sg;
            for (int i = 0; i < TILE_TOKENS; i++) {
                const int64_t v = (t + i) * a->groups + g;
                const __m512i dot = _mm512_add_epi32(_mm512_set1_epi32(start[v]),
                                                     _mm512_load_si512(sums + (g - g0) * 256 + i * ROWS));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sg, _mm512_set1_ps(a->scale[v])),
                                         acc[i]);
                if (int4) acc[i] = _mm512_fmadd_ps(zg, _mm512_set1_ps(a->sum[v]), acc[i]);
            }
        }
    }
    for (int i = 0; i < TILE_TOKENS; i++) store16(out, (t + i) * n + b * ROWS, acc[i], n - b * ROWS, is_bf16);
}

static int amx_matmul(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const Activations *a,
                      void *out, int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads) {
    const int64_t groups = a->groups, blocks = (n + ROWS - 1) / ROWS;
    const int32_t offset = min ? 8 : 128;  /* the codes' offset, taken back out as in the VNNI kernel */
    /* Per thread: a chunk of sums, a block's unpacked int4 codes, its scales in fp32. */
    const size_t per_thread = CHUNK_GROUPS * 1024 + (size_t)groups * (512 + 2 * ROWS * sizeof(float));
    char *scratch = aligned_alloc(64, per_thread * (size_t)num_threads);
    int32_t *start = malloc(sizeof(int32_t) * (size_t)(tokens * groups));  /* each sum's first value */
    if (!scratch || !start) {
        free(scratch), free(start);
        return 0;
    }
    for (int64_t v = 0; v < tokens * groups; v++) start[v] = -offset * a->qsum[v];
#pragma omp parallel num_threads(num_threads)
    {
        char *mine = scratch + per_thread * (size_t)omp_get_thread_num();
        int32_t *sums = (int32_t *)mine;
        uint8_t *unpacked = (uint8_t *)mine + CHUNK_GROUPS * 1024;
        float *s = (float *)(unpacked + groups * 512), *z = s + groups * ROWS;
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t first = b * groups * ROWS;  /* the block's first (row, group) */
            const uint8_t *w = codes + first * GROUP;
            if (min) {
                unpack_int4(codes + first * GROUP / 2, unpacked, groups);
                w = unpacked;
            }
            for (int64_t g = 0; g < groups; g++) {
                const __m512 sg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + first + g * ROWS)));
                _mm512_storeu_ps(s + g * ROWS, sg);
                if (min) _mm512_storeu_ps(z + g * ROWS, _mm512_fmadd_ps(_mm512_set1_ps(8.f), sg, _mm512_cvtph_ps(
                                              _mm256_loadu_si256((const __m256i *)(min + first + g * ROWS)))));
            }
            int64_t t = 0;
            for (; t + TILE_TOKENS <= tokens; t += TILE_TOKENS)
                min ? amx_tile(w, s, z, a, start, k, t, sums, out, n, b, is_bf16, 1)
                    : amx_tile(w, s, z, a, start, k, t, sums, out, n, b, is_bf16, 0);
            /* The last < 16 tokens: the VNNI kernel, while the block is in cache (a part-used tile
               costs as much as a whole one). */
#define BLOCK(tn) (min ? int4_block(codes + first * GROUP / 2, scale + first, min + first, a, k, t0, tn, acc) \
                       : int8_block(codes + first * GROUP, scale + first, a, k, t0, tn, acc))
            FOR_EACH_TILE(BLOCK, t)
#undef BLOCK
        }
        _tile_release();
    }
    free(scratch), free(start);
    return 1;
}

#endif

#ifdef HAVE_AVX2
#include <omp.h>

/* AVX2 without AVX-512 (e.g. AMD Zen 1-3): the same weight layout and arithmetic, each block of 16
   rows taken as two halves of 8 (a ymm lane per row), and vpdpbusd as vpmaddubsw (u8 x s8 pairs
   to saturating int16) then vpmaddwd by ones (int16 pairs to int32). int4's codes (0..15) times
   activations (-127..127) stay below the saturation even summed in int16 over a group's 8 quads
   (8 x 2 x 15 x 127 = 30,480), so a group costs one widening; int8's offset codes (0..255) would
   saturate, so they are multiplied as signed codes by the activations' magnitudes, |x| x sign(w, x)
   (llama.cpp's trick, the other way round), each quad widened on its own and no offset taken back
   out. The outputs differ from the VNNI kernel's only in the order of the activations' fp32 sums. */

static int quantize_activations(const void *x, int is_bf16, int64_t tokens, int64_t k, Activations *a) {
    if (!alloc_activations(tokens, k, a)) return 0;
    const int64_t values = tokens * a->groups;
    for (int64_t v = 0; v < values; v++) {
        __m256 f[4];
        __m256i q[4];
        a->scale[v] = quantize_group32_avx2(x, v * GROUP, is_bf16, a->q + v * GROUP, f, q);
        a->sum[v] = sum8(_mm256_add_ps(_mm256_add_ps(f[0], f[1]), _mm256_add_ps(f[2], f[3])));
        a->qsum[v] = sum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    }
    return 1;
}

/* The activation quads of a chunk of tokens, each broadcast to a ymm, and their magnitudes, built
   once per call and chunk rather than once per block: the kernels below take them from memory. */
typedef struct {
    __m256i *quads, *magnitudes;  /* [tokens of the chunk, groups * 8] */
    int64_t t0, per_token;        /* the chunk's first token; groups * 8 */
} Broadcasts;

#define CHUNK_TOKENS 16  /* a chunk's table: 16 x 64 bytes per 4 channels, in L2 */

static int broadcast_quads(const Activations *a, int64_t k, int64_t t0, int64_t tn, Broadcasts *b) {
    const int64_t n = tn * 8 * a->groups;
    b->quads = aligned_alloc(32, sizeof(__m256i) * 2 * (size_t)n);
    if (!b->quads) return 0;
    b->magnitudes = b->quads + n, b->t0 = t0, b->per_token = 8 * a->groups;
    for (int64_t i = 0; i < n; i++) {
        int32_t quad;
        memcpy(&quad, a->q + t0 * k + 4 * i, sizeof quad);
        b->quads[i] = _mm256_set1_epi32(quad);
        b->magnitudes[i] = _mm256_abs_epi8(b->quads[i]);
    }
    return 1;
}

/* Half `h` (rows 8h..8h+7) of one block of an int4 weight against `tn` tokens from t0. Each group
   holds 4 chunks of 64 bytes, row r's 4 channels at 4r; a half is 32 bytes of each chunk. */
static inline __attribute__((always_inline)) void int4_half(
        const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const Activations *a,
        const Broadcasts *x, int64_t t0, const int tn, int h, __m256 acc[TILE]) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int t = 0; t < tn; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->groups; g++) {
        const uint8_t *packed = codes + g * 256 + 32 * h;
        __m256i w[8];
        for (int j = 0; j < 4; j++) {
            _mm_prefetch((const char *)packed + PREFETCH_AHEAD + j * 64, _MM_HINT_T0);
            const __m256i p = _mm256_loadu_si256((const __m256i *)(packed + j * 64));
            w[j] = _mm256_and_si256(p, nibble);
            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), nibble);
        }
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * ROWS + 8 * h)));
        const __m256 z = _mm256_fmadd_ps(_mm256_set1_ps(8.f), s,
                                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(min + g * ROWS + 8 * h))));
        for (int t = 0; t < tn; t++) {
            const int64_t v = (t0 + t) * a->groups + g;
            const __m256i *quads = x->quads + (t0 + t - x->t0) * x->per_token + 8 * g;
            __m256i pairs = _mm256_maddubs_epi16(w[0], quads[0]);
            for (int j = 1; j < 8; j++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], quads[j]));
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(-8 * a->qsum[v]));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, _mm256_set1_ps(a->scale[v])), acc[t]);
            acc[t] = _mm256_fmadd_ps(z, _mm256_set1_ps(a->sum[v]), acc[t]);
        }
    }
}

/* Half `h` of one block of an int8 weight (codes + 128: 8 chunks of 64 bytes per group), as
   |x| times sign(w, x): the magnitudes and quads come from the table, so a quad costs a sign, a
   maddubs, a widening and an add per token. The codes lie within +-127 (quant.quantize_int8
   clamps them), so sign(w, x) never meets -128, whose negation overflows. */
static inline __attribute__((always_inline)) void int8_half(
        const uint8_t *codes, const uint16_t *scale, const Activations *a, const Broadcasts *x, int64_t t0,
        const int tn, int h, __m256 acc[TILE]) {
    const __m256i offset = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int t = 0; t < tn; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->groups; g++) {
        __m256i w[8];
        for (int j = 0; j < 8; j++) {
            _mm_prefetch((const char *)codes + g * 512 + PREFETCH_AHEAD + j * 64, _MM_HINT_T0);
            w[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + g * 512 + j * 64 + 32 * h)), offset);
        }
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * ROWS + 8 * h)));
        for (int t = 0; t < tn; t++) {
            const int64_t at = (t0 + t - x->t0) * x->per_token + 8 * g;
            const __m256i *quads = x->quads + at, *magnitudes = x->magnitudes + at;
            __m256i dot = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++)
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitudes[j], _mm256_sign_epi8(w[j], quads[j])), ones));
            const __m256 dx = _mm256_set1_ps(a->scale[(t0 + t) * a->groups + g]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, dx), acc[t]);
        }
    }
}

/* One token's 16 rows of one int4 block: int4_half's sums in int4_half's order, bit for bit, with
   less work per weight byte, which at one token is what bounds the step on Zen 1 (a core there
   streamed int4 weights at ~7 GB/s, well under DRAM's rate): both halves take one pass, so a
   group's fp32 terms are broadcast once. */
static inline __attribute__((always_inline)) void int4_rows1(
        const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const Activations *a,
        const Broadcasts *b, int64_t t, __m256 *acc0, __m256 *acc1) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->groups; g++) {
        const uint8_t *packed = codes + g * 256;
        const int64_t v = t * a->groups + g;
        const __m256i *x = b->quads + (t - b->t0) * b->per_token + 8 * g;
        __m256i pairs0 = _mm256_setzero_si256(), pairs1 = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {  /* integer sums: any order gives the same */
            _mm_prefetch((const char *)packed + PREFETCH_AHEAD + j * 64, _MM_HINT_T0);
            const __m256i p0 = _mm256_loadu_si256((const __m256i *)(packed + j * 64));
            const __m256i p1 = _mm256_loadu_si256((const __m256i *)(packed + j * 64 + 32));
            pairs0 = _mm256_add_epi16(pairs0, _mm256_add_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(p0, nibble), x[j]),
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p0, 4), nibble), x[j + 4])));
            pairs1 = _mm256_add_epi16(pairs1, _mm256_add_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(p1, nibble), x[j]),
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p1, 4), nibble), x[j + 4])));
        }
        const __m256i offset = _mm256_set1_epi32(-8 * a->qsum[v]);
        const __m256 dx = _mm256_set1_ps(a->scale[v]), sum = _mm256_set1_ps(a->sum[v]), eight = _mm256_set1_ps(8.f);
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * ROWS)));
        const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * ROWS + 8)));
        const __m256 low0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(min + g * ROWS)));
        const __m256 low1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(min + g * ROWS + 8)));
        const __m256 z0 = _mm256_fmadd_ps(eight, s0, low0), z1 = _mm256_fmadd_ps(eight, s1, low1);
        sum0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(pairs0, ones), offset)),
                               _mm256_mul_ps(s0, dx), sum0);
        sum0 = _mm256_fmadd_ps(z0, sum, sum0);
        sum1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(pairs1, ones), offset)),
                               _mm256_mul_ps(s1, dx), sum1);
        sum1 = _mm256_fmadd_ps(z1, sum, sum1);
    }
    *acc0 = sum0, *acc1 = sum1;
}

/* One token's 16 rows of one int8 block: int8_half's sums, bit for bit, both halves in one pass. */
static inline __attribute__((always_inline)) void int8_rows1(
        const uint8_t *codes, const uint16_t *scale, const Activations *a, const Broadcasts *b, int64_t t,
        __m256 *acc0, __m256 *acc1) {
    const __m256i offset = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->groups; g++) {
        const uint8_t *packed = codes + g * 512;
        const int64_t at = (t - b->t0) * b->per_token + 8 * g;
        const __m256i *x = b->quads + at, *magnitude = b->magnitudes + at;
        __m256i dot0 = _mm256_setzero_si256(), dot1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            _mm_prefetch((const char *)packed + PREFETCH_AHEAD + j * 64, _MM_HINT_T0);
            const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(packed + j * 64)), offset);
            const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(packed + j * 64 + 32)), offset);
            dot0 = _mm256_add_epi32(dot0, _mm256_madd_epi16(
                _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(w0, x[j])), ones));
            dot1 = _mm256_add_epi32(dot1, _mm256_madd_epi16(
                _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(w1, x[j])), ones));
        }
        const __m256 dx = _mm256_set1_ps(a->scale[t * a->groups + g]);
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * ROWS)));
        const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * ROWS + 8)));
        sum0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_mul_ps(s0, dx), sum0);
        sum1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_mul_ps(s1, dx), sum1);
    }
    *acc0 = sum0, *acc1 = sum1;
}

/* From TILE + 1 tokens int4 takes another form of the same sums, which does less work per product
   on such CPUs (1.3-1.5x on Zen 1, where integer multiplies have one pipe): the activations as
   unsigned q + 128 and the weights as signed c - 8, unpacked once per call and block into scratch.
   Each token's broadcast quads then serve both halves of a block, and the weights are memory
   operands, not registers. sum((q + 128)(c - 8)) - 128 sum(c - 8) = sum(q (c - 8)), the int32 sum
   above, exactly, so the outputs are the same bit for bit. The int16 pairs cannot saturate:
   8 quads x 2 x 255 x 8 = 32,640. */
typedef struct {
    __m256i *codes;      /* [groups, 8 quads, 2 halves]: c - 8 */
    int32_t *offset;     /* [groups, 16 rows]: 128 sum(c - 8) */
    float *scale, *zero; /* [groups, 16 rows]: zero = min + 8 scale, as int4_half's */
} UnpackedInt4;

static const size_t UNPACKED_INT4_GROUP = 512 + ROWS * (sizeof(int32_t) + 2 * sizeof(float));

static void unpack_int4(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, int64_t groups,
                        const UnpackedInt4 *u) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
    const __m256i unit = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *packed = codes + g * 256 + 32 * h;
            __m256i pairs = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                _mm_prefetch((const char *)packed + PREFETCH_AHEAD + j * 64, _MM_HINT_T0);
                const __m256i p = _mm256_loadu_si256((const __m256i *)(packed + j * 64));
                const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(p, nibble), eight);
                const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(p, 4), nibble), eight);
                u->codes[g * 16 + 2 * j + h] = lo;
                u->codes[g * 16 + 2 * (j + 4) + h] = hi;
                pairs = _mm256_add_epi16(pairs, _mm256_add_epi16(_mm256_maddubs_epi16(unit, lo),
                                                                 _mm256_maddubs_epi16(unit, hi)));
            }
            const int64_t i = g * ROWS + 8 * h;
            _mm256_storeu_si256((__m256i *)(u->offset + i), _mm256_slli_epi32(_mm256_madd_epi16(pairs, ones), 7));
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + i)));
            _mm256_storeu_ps(u->scale + i, s);
            const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(min + i)));
            _mm256_storeu_ps(u->zero + i, _mm256_fmadd_ps(_mm256_set1_ps(8.f), s, low));
        }
    }
}

/* All tokens' 16 rows from row0 of one unpacked block; `flipped` holds the activations as q + 128,
   flipped once per call, not per block. The two halves are written out: as a loop over h the same
   code measured ~8% slower on Zen 1 (gcc 12), and so did two blocks per pass, each broadcast quad
   serving four products. Each quad is broadcast straight from `flipped` (one load): copied first
   into an array, gcc stored the group's quads to the stack and read each back, and the product
   ran 1.2x slower (Zen 3). */
static void int4_tokens(const UnpackedInt4 *u, const Activations *a, const uint8_t *flipped, int64_t k,
                        int64_t tokens, void *out, int64_t n, int64_t row0, int is_bf16) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t t = 0; t < tokens; t++) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t g = 0; g < a->groups; g++) {
            const int64_t v = t * a->groups + g, i = g * ROWS;
            const float *quads = (const float *)(flipped + t * k + g * GROUP);
            const __m256i *w = u->codes + g * 16;
            __m256i pairs0 = _mm256_setzero_si256(), pairs1 = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i x = _mm256_castps_si256(_mm256_broadcast_ss(quads + j));
                pairs0 = _mm256_add_epi16(pairs0, _mm256_maddubs_epi16(x, w[2 * j]));
                pairs1 = _mm256_add_epi16(pairs1, _mm256_maddubs_epi16(x, w[2 * j + 1]));
            }
            const __m256i dot0 = _mm256_sub_epi32(_mm256_madd_epi16(pairs0, ones),
                                                  _mm256_loadu_si256((const __m256i *)(u->offset + i)));
            const __m256i dot1 = _mm256_sub_epi32(_mm256_madd_epi16(pairs1, ones),
                                                  _mm256_loadu_si256((const __m256i *)(u->offset + i + 8)));
            const __m256 dx = _mm256_set1_ps(a->scale[v]), sum = _mm256_set1_ps(a->sum[v]);
            const __m256 scale0 = _mm256_mul_ps(_mm256_loadu_ps(u->scale + i), dx);
            const __m256 scale1 = _mm256_mul_ps(_mm256_loadu_ps(u->scale + i + 8), dx);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), scale0, acc0);
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(u->zero + i), sum, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), scale1, acc1);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(u->zero + i + 8), sum, acc1);
        }
        store8(out, t * n + row0, acc0, n - row0, is_bf16);
        if (row0 + 8 < n) store8(out, t * n + row0 + 8, acc1, n - row0 - 8, is_bf16);
    }
}

static int avx2_int4_tokens(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const Activations *a,
                            void *out, int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads) {
    const size_t per_thread = (size_t)a->groups * UNPACKED_INT4_GROUP;
    char *scratch = aligned_alloc(32, per_thread * (size_t)num_threads);
    uint8_t *flipped = flipped_codes(a->q, tokens * k);
    if (!scratch || !flipped) {
        free(scratch), free(flipped);
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    {
        char *mine = scratch + per_thread * (size_t)omp_get_thread_num();
        const UnpackedInt4 u = {(__m256i *)mine, (int32_t *)(mine + a->groups * 512),
                                (float *)(mine + a->groups * (512 + ROWS * sizeof(int32_t))),
                                (float *)(mine + a->groups * (512 + ROWS * (sizeof(int32_t) + sizeof(float))))};
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (n + ROWS - 1) / ROWS; b++) {
            const int64_t first = b * a->groups * ROWS;
            unpack_int4(codes + first * GROUP / 2, scale + first, min + first, a->groups, &u);
            int4_tokens(&u, a, flipped, k, tokens, out, n, b * ROWS, is_bf16);
        }
    }
    free(scratch), free(flipped);
    return 1;
}

/* Tokens t0..t0 + tn - 1 (one chunk), whose quads `x` holds: a lone token's 16-row blocks in one
   pass each, more tokens by halves and tiles of TILE. int4 given `min`, else int8. */
static void avx2_chunk(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const Activations *a,
                       const Broadcasts *x, int64_t t0, int64_t tn, void *out, int64_t n, int is_bf16,
                       int num_threads) {
    const int64_t blocks = (n + ROWS - 1) / ROWS;
    if (tn == 1) {
        BlockShares shares;
        share_blocks(&shares, blocks, num_threads);
#pragma omp parallel num_threads(num_threads)
        for (int64_t b; (b = claim_block(&shares, omp_get_thread_num())) >= 0;) {
            const int64_t first = b * a->groups * ROWS, row = b * ROWS;
            __m256 acc0, acc1;
            if (min) int4_rows1(codes + first * GROUP / 2, scale + first, min + first, a, x, t0, &acc0, &acc1);
            else int8_rows1(codes + first * GROUP, scale + first, a, x, t0, &acc0, &acc1);
            store8(out, t0 * n + row, acc0, n - row, is_bf16);
            if (row + 8 < n) store8(out, t0 * n + row + 8, acc1, n - row - 8, is_bf16);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t u = 0; u < 2 * blocks; u++) {
        const int64_t b = u / 2, first = b * a->groups * ROWS, row = b * ROWS + (u % 2) * 8;
        const int h = (int)(u % 2);
        if (row >= n) continue;
        for (int64_t t = t0; t < t0 + tn; t += TILE) {
            __m256 acc[TILE];
            const int64_t tiled = t0 + tn - t < TILE ? t0 + tn - t : TILE;
#define HALF(tiled) (min ? int4_half(codes + first * GROUP / 2, scale + first, min + first, a, x, t, tiled, h, acc) \
                         : int8_half(codes + first * GROUP, scale + first, a, x, t, tiled, h, acc))
            if (tiled == 4) HALF(4);
            else if (tiled == 3) HALF(3);
            else if (tiled == 2) HALF(2);
            else HALF(1);
#undef HALF
            for (int64_t i = 0; i < tiled; i++) store8(out, (t + i) * n + row, acc[i], n - row, is_bf16);
        }
    }
}

static int avx2_matmul(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                       int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads) {
    Activations a;
    if (!quantize_activations(x, is_bf16, tokens, k, &a)) return 0;
    int ok = 1;
    if (min && tokens >= UNPACK_FROM) {
        ok = avx2_int4_tokens(codes, scale, min, &a, out, tokens, k, n, is_bf16, num_threads);
    } else {
        for (int64_t t0 = 0; ok && t0 < tokens; t0 += CHUNK_TOKENS) {
            const int64_t tn = tokens - t0 < CHUNK_TOKENS ? tokens - t0 : CHUNK_TOKENS;
            Broadcasts quads;
            ok = broadcast_quads(&a, k, t0, tn, &quads);
            if (ok) avx2_chunk(codes, scale, min, &a, &quads, t0, tn, out, n, is_bf16, num_threads);
            if (ok) free(quads.quads);
        }
    }
    free(a.scale);
    return ok;
}

#endif

int quant_amx_supported(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

#ifdef HAVE_VNNI
#ifndef NEXT_BYTES
#define NEXT_BYTES 8192  /* of codes, and an eighth of that of each factor array (int4's are 1/8 its codes) */
#endif

/* The first lines of the rows that thread t of nt takes in `next` (schedule(static): contiguous
   shares, the first n % nt one block longer, as libgomp splits them), prefetched into its cache. */
static void prefetch_share(const NextWeight *next, int t, int nt) {
    const int64_t blocks = (next->n + ROWS - 1) / ROWS, share = blocks / nt, longer = blocks % nt;
    const int64_t first = (t * share + (t < longer ? t : longer)) * (next->k / GROUP) * ROWS;  /* (row, group) */
    const char *codes = (const char *)(next->codes + first * (next->min ? GROUP / 2 : GROUP));
    for (int64_t i = 0; i < NEXT_BYTES; i += 64) _mm_prefetch(codes + i, _MM_HINT_T0);
    for (int64_t i = 0; i < NEXT_BYTES / 8; i += 64) {
        _mm_prefetch((const char *)(next->scale + first) + i, _MM_HINT_T0);
        if (next->min) _mm_prefetch((const char *)(next->min + first) + i, _MM_HINT_T0);
    }
}
#endif

/* out[tokens, n] = x[tokens, k] @ W.T for a W packed as above: int4 given `min`, int8 when
   min is NULL (n is padded to blocks of 16 in the weights, not in out). x and out are fp32 or
   bf16 (is_bf16), rows dense. From `amx_from` tokens up (0: never) the AMX kernel runs where the
   CPU has it; both give the same outputs. `next`, or NULL: see quantized_matmul_then. Returns 0
   when out of memory. */
static int matmul(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                  int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads, int64_t amx_from,
                  const NextWeight *next) {
#ifdef HAVE_VNNI
    Activations a;
    if (!quantize_activations(x, is_bf16, tokens, k, &a)) return 0;
#ifdef HAVE_AMX
    if (amx_from > 0 && tokens >= amx_from && amx_permitted()) {
        const int ok = amx_matmul(codes, scale, min, &a, out, tokens, k, n, is_bf16, num_threads);
        free(a.scale);
        return ok;
    }
#endif
    const int64_t blocks = (n + ROWS - 1) / ROWS;
    BlockShares shares;
    share_blocks(&shares, blocks, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t b; (b = claim_block(&shares, me)) >= 0;) {
            const int64_t first = b * a.groups * ROWS;  /* the block's first (row, group) */
#define BLOCK(tn) (min ? int4_block(codes + first * GROUP / 2, scale + first, min + first, &a, k, t0, tn, acc) \
                       : int8_block(codes + first * GROUP, scale + first, &a, k, t0, tn, acc))
            FOR_EACH_TILE(BLOCK, 0)
#undef BLOCK
        }
        if (next) prefetch_share(next, me, nt);
    }
    free(a.scale);
    return 1;
#elif defined(HAVE_AVX2)
    (void)amx_from, (void)next;
    return avx2_matmul(codes, scale, min, x, out, tokens, k, n, is_bf16, num_threads);
#else
    (void)x, (void)codes, (void)scale, (void)min, (void)out, (void)tokens, (void)k, (void)n, (void)is_bf16;
    (void)num_threads, (void)amx_from, (void)next;
    return 0;
#endif
}

int quantized_matmul_using(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                           int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads, int64_t amx_from) {
    return matmul(codes, scale, min, x, out, tokens, k, n, is_bf16, num_threads, amx_from, NULL);
}

int quantized_matmul(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                     int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads) {
    return matmul(codes, scale, min, x, out, tokens, k, n, is_bf16, num_threads, AMX_FROM_TOKENS, NULL);
}

/* quantized_matmul, then each thread, done with its rows, prefetches the first lines of those it
   will take in `next`, the step's next product (fused_layers, at a few tokens). A decode step of a
   small model is ~120 products of 0.2-0.9 MB streamed from DRAM, and between two of them the
   memory sits idle: the barrier, the activations' quantization, norms, RoPE, attention. Each
   product then started cold, waiting on its first misses while the hardware prefetcher
   trained; now they are on their way. The embedded model's decode: 1.04-1.05x (benchmarks/
   ab_kernels.py, 2-core AMD EPYC Zen 4; docs/kernels.md). */
int quantized_matmul_then(const uint8_t *codes, const uint16_t *scale, const uint16_t *min, const void *x, void *out,
                          int64_t tokens, int64_t k, int64_t n, int is_bf16, int num_threads, const NextWeight *next) {
    return matmul(codes, scale, min, x, out, tokens, k, n, is_bf16, num_threads, AMX_FROM_TOKENS, next);
}
