/* GGUF blocks straight into kquant.c's packed form: what model/gguf_codes.py's numpy
   pack(decode(...)) writes, byte for byte, without the canonical codes in between. A 1B Q4_K_M
   file loads in 2.3-2.6 s this way, 7.2-8.2 s through numpy; its first answer comes 10.2-10.4 s
   after `carpool serve` starts, 15.3-17.6 s through numpy (a 2-core AMD EPYC VM, two runs each:
       carpool bench startup --model llama1b-q4_k_m.gguf --output bench_results/startup_1b ).

   kq_pack decodes rows of one GGUF tensor (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL,
   IQ4_XS) block by block and writes them as rows first_row .. of a weight whose form (KQuantWeight: bits, offset,
   super-block size, which of sc / mn / m it has) may be wider than the tensor's own: a fused
   projection (q, k, v; gate, up) is packed by one call per part into the same arrays, in the
   form gguf_codes.concat_rows gives the parts together:
   - codes keep their value: a narrower code leaves its higher bits 0; the IQ4 types'
     codes stay 4-bit table indices in a lookup form (all parts IQ4), else become 8-bit codes;
   - d and m repeat over smaller super-blocks (a K-quant's 256 channels over 32-channel ones),
     and sub-scales over smaller sub-blocks (Q4_K's per 32 channels beside Q6_K's per 16);
   - absent sub-scales are 1 (sc; mn where the tensor has a min term);
   - a tensor with no min term whose offset the form lacks folds it into the min term,
     m = fp16(d * offset) and mn = sc, exact as the offsets are powers of two; one whose offset
     the form keeps gets m = 0, mn = 0.
   The layout (docs: carpool/model/gguf_codes.py's pack) takes 16 rows per block: every block
   is written by one thread, and the caller's arrays come zeroed, so rows of a block that other
   calls write (or that pad the last block) are left as they are. */

#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define PACK_ROWS 16
#define PACK_GROUP 32

/* A GGUF type as it decodes (gguf_codes.py's _TYPES): GGML's type number, channels and bytes
   per block, code bits, offset, which sub-scales and min term it has, and channels per sub-scale
   (32 where it has none). */
typedef struct {
    int qtype, block_size, type_size, bits, offset, has_sc, has_mn, has_min, sub_size;
} BlockType;

static const BlockType TYPES[] = {
    {2, 32, 18, 4, 8, 0, 0, 0, 32},      /* Q4_0 */
    {3, 32, 20, 4, 0, 0, 0, 1, 32},      /* Q4_1 */
    {6, 32, 22, 5, 16, 0, 0, 0, 32},     /* Q5_0 */
    {7, 32, 24, 5, 0, 0, 0, 1, 32},      /* Q5_1 */
    {8, 32, 34, 8, 128, 0, 0, 0, 32},    /* Q8_0 */
    {10, 256, 84, 4, 0, 1, 1, 1, 16},    /* Q2_K */
    {11, 256, 110, 4, 4, 1, 0, 0, 16},   /* Q3_K */
    {12, 256, 144, 4, 0, 1, 1, 1, 32},   /* Q4_K */
    {13, 256, 176, 5, 0, 1, 1, 1, 32},   /* Q5_K */
    {14, 256, 210, 6, 32, 1, 0, 0, 16},  /* Q6_K */
    {20, 32, 18, 8, 128, 0, 0, 0, 32},   /* IQ4_NL */
    {23, 256, 136, 8, 128, 1, 0, 0, 32}, /* IQ4_XS */
};

/* One block, decoded: codes, sub-scales per 16 channels (1 where the type has none), d, m (the
   min term's factor, raw fp16 bits; 0 where the type has none). */
typedef struct {
    uint8_t q[256];
    int8_t sc[16], mn[16];
    uint16_t d, m;
} Block;

static inline uint16_t read16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static void decode_legacy(const uint8_t *b, int has_min, int high_bits, Block *out) {
    const uint8_t *qs = b + (has_min ? 4 : 2) + (high_bits ? 4 : 0);
    uint32_t qh = 0;
    if (high_bits) {  /* a little-endian uint32: bit j is code j's bit 4 */
        const uint8_t *h = b + (has_min ? 4 : 2);
        qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
    }
    for (int j = 0; j < 16; j++) {
        out->q[j] = (uint8_t)((qs[j] & 15) | ((qh >> j) & 1) << 4);
        out->q[16 + j] = (uint8_t)((qs[j] >> 4) | ((qh >> (16 + j)) & 1) << 4);
    }
    out->d = read16(b);
    out->m = has_min ? (uint16_t)(read16(b + 2) ^ 0x8000u) : 0;  /* w = d q + m = d q - (-m) */
}

/* Bits 0-1, 2-3, 4-5, 6-7 of 32 bytes as 4 runs of 32 codes. */
static inline void crumbs(const uint8_t *x, uint8_t *q) {
    for (int s = 0; s < 4; s++)
        for (int l = 0; l < 32; l++) q[32 * s + l] = (x[l] >> (2 * s)) & 3;
}

/* Bit i / 32 of byte i % 32 into bit `shift` of code i (Q3_K's hmask, Q5_K's qh). */
static inline void bit_rows(const uint8_t *x, uint8_t *q, int shift) {
    for (int b = 0; b < 8; b++)
        for (int l = 0; l < 32; l++) q[32 * b + l] |= (uint8_t)(((x[l] >> b) & 1) << shift);
}

/* A 4-bit code as itself: the IQ4 types' codes, kept as table indices for a `lookup` form. */
static const uint8_t SAME_CODES[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* The IQ4 types' codes come out as `iq4`[table index]: their 8-bit codes (IQ4_CODES) or the
   indices themselves (SAME_CODES). */
static void decode_block(const BlockType *t, const uint8_t *b, const uint8_t *iq4, Block *out) {
    switch (t->qtype) {
    case 2: case 3: case 6: case 7:
        decode_legacy(b, t->has_min, t->bits == 5, out);
        return;
    case 8:  /* int8 codes + 128 */
        for (int j = 0; j < 32; j++) out->q[j] = b[2 + j] ^ 0x80u;
        out->d = read16(b), out->m = 0;
        return;
    case 10:  /* Q2_K: scales[16], qs[64], d, dmin */
        crumbs(b + 16, out->q), crumbs(b + 48, out->q + 128);
        for (int i = 0; i < 16; i++) out->sc[i] = (int8_t)(b[i] & 15), out->mn[i] = (int8_t)(b[i] >> 4);
        out->d = read16(b + 80), out->m = read16(b + 82);
        return;
    case 11: {  /* Q3_K: hmask[32], qs[64], scales[12], d */
        crumbs(b + 32, out->q), crumbs(b + 64, out->q + 128);
        bit_rows(b, out->q, 2);
        const uint8_t *s = b + 96;
        for (int i = 0; i < 16; i++) {
            const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4, high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
            out->sc[i] = (int8_t)((low | high << 4) - 32);
        }
        out->d = read16(b + 108), out->m = 0;
        return;
    }
    case 12: case 13: {  /* Q4_K / Q5_K: d, dmin, scales[12], (qh[32]), qs[128] */
        const uint8_t *s = b + 4, *qs = b + (t->bits == 5 ? 48 : 16);
        for (int i = 0; i < 8; i++) {  /* 6-bit scale and min per 32 channels */
            const int sc = i < 4 ? s[i] & 63 : (s[i + 4] & 15) | ((s[i - 4] >> 2) & 48);
            const int mn = i < 4 ? s[i + 4] & 63 : (s[i + 4] >> 4) | ((s[i] >> 2) & 48);
            out->sc[2 * i] = out->sc[2 * i + 1] = (int8_t)sc;
            out->mn[2 * i] = out->mn[2 * i + 1] = (int8_t)mn;
        }
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                out->q[64 * c + l] = qs[32 * c + l] & 15;
                out->q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
            }
        if (t->bits == 5) bit_rows(b + 16, out->q, 4);
        out->d = read16(b), out->m = read16(b + 2);
        return;
    }
    case 14: {  /* Q6_K: ql[128], qh[64], scales[16], d */
        uint8_t high[256];
        crumbs(b + 128, high), crumbs(b + 160, high + 128);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 64; l++) {
                const uint8_t x = b[64 * h + l];
                out->q[128 * h + l] = (uint8_t)((x & 15) | high[128 * h + l] << 4);
                out->q[128 * h + 64 + l] = (uint8_t)((x >> 4) | high[128 * h + 64 + l] << 4);
            }
        memcpy(out->sc, b + 192, 16);
        out->d = read16(b + 208), out->m = 0;
        return;
    }
    case 20:  /* IQ4_NL: d, qs[16] (table indices, low nibbles first) */
        for (int j = 0; j < 16; j++) out->q[j] = iq4[b[2 + j] & 15], out->q[16 + j] = iq4[b[2 + j] >> 4];
        out->d = read16(b), out->m = 0;
        return;
    case 23: {  /* IQ4_XS: d, scales_h (2 bits per 32 channels), scales_l[4] (4 bits each), qs[128] */
        const int high = read16(b + 2);
        for (int i = 0; i < 8; i++) {
            const int low = (b[4 + i / 2] >> (4 * (i % 2))) & 15;
            out->sc[2 * i] = out->sc[2 * i + 1] = (int8_t)((low | ((high >> (2 * i)) & 3) << 4) - 32);
            const uint8_t *qs = b + 8 + 16 * i;
            for (int j = 0; j < 16; j++)
                out->q[32 * i + j] = iq4[qs[j] & 15], out->q[32 * i + 16 + j] = iq4[qs[j] >> 4];
        }
        out->d = read16(b), out->m = 0;
        return;
    }
    }
}

/* Codes of one row's group of 32 channels into the block's layout at row r: lo (4-bit plane or,
   for 8 bits, the bytes) and the codes' bits 4.. in hi's fields, OR-ed in (gguf_codes.py's pack
   gives the layout); row r's bytes are 4r .. 4r + 3 of each 64. */
static inline void write_group(const uint8_t *q, int r, int bits, uint8_t *lo, uint8_t *hi) {
    if (bits == 8) {
        for (int j = 0; j < 8; j++) memcpy(lo + 64 * j + 4 * r, q + 4 * j, 4);
        return;
    }
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < 4; c++)
            lo[64 * j + 4 * r + c] = (uint8_t)((q[4 * j + c] & 15) | (q[16 + 4 * j + c] & 15) << 4);
    const int planes = bits - 4;
    for (int j = 0; planes > 0 && j < 8; j++)  /* quad j: channels 16 (j / 4) + 4 (j % 4) + c */
        for (int c = 0; c < 4; c++)
            hi[64 * (j * planes / 8) + 4 * r + c] |=
                (uint8_t)((q[16 * (j / 4) + 4 * (j % 4) + c] >> 4) << (planes * (j % (8 / planes))));
}

/* d * offset in fp16 (offset a power of two): exact, or inf past fp16's range. */
static inline uint16_t fold(uint16_t d, int offset) {
    return float_to_half(half_to_float(d) * (float)offset);
}

int kq_pack(const uint8_t *blocks, int64_t row_stride, int qtype, const int64_t *rows, int64_t count,
            const KQuantWeight *out, int64_t first_row, int num_threads) {
    const BlockType *t = NULL;
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].qtype == qtype) t = &TYPES[i];
    if (!t) return 0;
    const int64_t k = out->k, s = out->super_size;
    const int folds = t->offset == out->offset ? 0 : t->offset;  /* the offset goes into the min term */
    const int planes = out->bits > 4 && out->bits < 8 ? (int)out->bits - 4 : 0;
    const int iq4 = t->qtype == 20 || t->qtype == 23;
    /* The form must hold the tensor's values: codes as wide, super-blocks no larger, every
       sub-scale and min term it has, and its offset kept or folded (a power of two, into a
       form with no offset of its own); a lookup form takes the IQ4 types' 4-bit codes alone. */
    if ((out->lookup ? !iq4 || out->bits != 4 || out->offset != t->offset : t->bits > out->bits)
        || (out->bits != 8 && out->bits > 6) || k <= 0 || k % t->block_size
        || (s != 32 && s != 256) || s > t->block_size || first_row < 0 || count < 0 || first_row + count > out->n
        || (out->sub_size != 16 && out->sub_size != 32) || out->sub_size > t->sub_size
        || !out->lo || !out->d || (planes && !out->hi) || (t->has_sc && !out->sc) || (t->has_mn && !out->mn)
        || (t->has_min && !out->m)
        || (t->offset != out->offset && (out->offset || t->has_min || (folds & (folds - 1)) || !out->m || !out->mn)))
        return 0;
    const int64_t groups = k / PACK_GROUP, supers = k / s, blocks_per_row = k / t->block_size;
    const int64_t lo_bytes = out->bits == 8 ? 512 : 256, subs = PACK_GROUP / out->sub_size;
    uint8_t *lo = (uint8_t *)out->lo, *hi = (uint8_t *)out->hi;
    int8_t *sc = (int8_t *)out->sc, *mn = (int8_t *)out->mn;
    uint16_t *d = (uint16_t *)out->d, *m = (uint16_t *)out->m;
    const int64_t first_block = first_row / PACK_ROWS, end_block = (first_row + count + PACK_ROWS - 1) / PACK_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t rb = first_block; rb < end_block; rb++) {
        Block blk;
        memset(&blk, 0, sizeof blk);
        const int64_t lo_row = rb * PACK_ROWS > first_row ? rb * PACK_ROWS : first_row;
        const int64_t hi_row = (rb + 1) * PACK_ROWS < first_row + count ? (rb + 1) * PACK_ROWS : first_row + count;
        for (int64_t row = lo_row; row < hi_row; row++) {
            const int r = (int)(row % PACK_ROWS);
            const uint8_t *src = blocks + (rows ? rows[row - first_row] : row - first_row) * row_stride;
            for (int64_t i = 0; i < blocks_per_row; i++) {
                if (!t->has_sc) memset(blk.sc, 1, sizeof blk.sc);
                if (!t->has_mn) memset(blk.mn, t->has_min ? 1 : 0, sizeof blk.mn);
                decode_block(t, src + i * t->type_size, out->lookup ? SAME_CODES : IQ4_CODES, &blk);
                if (folds) {
                    blk.m = fold(blk.d, folds);
                    memcpy(blk.mn, blk.sc, sizeof blk.mn);
                }
                const int64_t c0 = i * t->block_size;
                for (int64_t g = c0 / PACK_GROUP; g < (c0 + t->block_size) / PACK_GROUP; g++) {
                    const int64_t at = rb * groups + g;
                    write_group(blk.q + (g * PACK_GROUP - c0), r, (int)out->bits, lo + at * lo_bytes,
                                planes ? hi + at * planes * 64 : NULL);
                    for (int u = 0; u < subs; u++) {  /* blk's per 16: a per-32 type's repeat */
                        const int sub = (int)((g * PACK_GROUP - c0) / 16) + u;
                        if (sc) sc[(at * subs + u) * PACK_ROWS + r] = blk.sc[sub];
                        if (mn) mn[(at * subs + u) * PACK_ROWS + r] = blk.mn[sub];
                    }
                }
                for (int64_t j = c0 / s; j < (c0 + t->block_size) / s; j++) {
                    d[(rb * supers + j) * PACK_ROWS + r] = blk.d;
                    if (m) m[(rb * supers + j) * PACK_ROWS + r] = blk.m;
                }
            }
        }
    }
    return 1;
}
