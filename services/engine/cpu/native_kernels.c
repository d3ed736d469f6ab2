/* CPU kernels the engine compiles at start with the host's C compiler (services/engine/cpu/native.py) and calls
 * through ctypes. Plain C, no torch headers: a build takes about a second. OpenMP comes from the libgomp.so.1
 * torch has already loaded, so these loops share torch's thread pool instead of starting a second one.
 *
 * paged_decode_attention_{bf16,f32}: one query token per sequence against that sequence's keys in the paged KV
 * cache, read in place (no gather, no padding). One task per sequence: it converts each token's key and value
 * rows to fp32 once and uses them for every query head (GQA), with an online softmax over the pages.
 * Layouts (all contiguous):
 *   q, out      [B, H, D]
 *   k, v        [num_blocks, block_size, KVH, D]   (one layer's half of the engine's KV tensor)
 *   tables      int32 [B, table_stride]            (each sequence's blocks)
 *   first, ctx  int32 [B]                          (keys first[b] .. ctx[b]-1 are attended; first = 0 unless
 *                                                   the layer has a sliding window)
 * Query head h reads KV head h / (H / KVH), as torch's scaled_dot_product_attention(enable_gqa=True) does.
 *
 * paged_prefill_attention_{bf16,f32}: a prompt's (or a chunk's) new tokens against the same pages, causal (and
 * windowed), tiled over blocks of tokens x KV heads (below, above DEFINE_PREFILL).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 64        /* the largest page (block_size) these kernels take */
#define MAX_HEADS 64   /* query heads of one sequence */
#define MAX_HD 16384   /* query heads x head dim */

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* round to nearest even */
    uint32_t quiet = (u >> 16) | 0x40u;                         /* NaN stays NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded); /* a select: loops stay vectorized */
}

/* One sequence, every head: its pages are read front to back (each token's K row of all KV heads is one
 * contiguous run), so the hardware prefetcher streams them; a task per (sequence, KV head) would read 1/KVH of
 * every row and wait on memory per key. */
#define DEFINE_TASK(NAME, T, LOAD, STORE, DC)                                                                     \
    static void NAME(const T *q, const T *k, const T *v, const int32_t *table, int first, int ctx, T *out,        \
                     int H, int KVH, int Dr, int bs, float scale) {                                               \
        const int D = DC ? DC : Dr; /* a constant head dim unrolls the row loops */                               \
        const int G = H / KVH;                                                                                    \
        float qf[MAX_HD], acc[MAX_HD], row[MAX_HD / 4 > 4096 ? 4096 : MAX_HD / 4];                                \
        float s[MAX_HEADS][TILE], m[MAX_HEADS], l[MAX_HEADS];                                                     \
        for (int i = 0; i < H * D; i++) { qf[i] = LOAD(q[i]) * scale; acc[i] = 0.0f; }                           \
        for (int h = 0; h < H; h++) { m[h] = -FLT_MAX; l[h] = 0.0f; }                                            \
        const size_t tok = (size_t)KVH * D; /* one token's row: every KV head */                                  \
        for (int t0 = first; t0 < ctx;) { /* one page (or the part of it in [first, ctx)) per tile */          \
            int page = t0 / bs, n = (page + 1) * bs < ctx ? (page + 1) * bs - t0 : ctx - t0;                      \
            size_t base = ((size_t)table[page] * bs + t0 % bs) * tok;                                             \
            if (page + 1 < (ctx + bs - 1) / bs) __builtin_prefetch(k + (size_t)table[page + 1] * bs * tok);       \
            for (int j = 0; j < n; j++) {                                                                         \
                const T *kr = k + base + j * tok;                                                                 \
                for (int i = 0; i < KVH * D; i++) row[i] = LOAD(kr[i]);                                           \
                for (int h = 0; h < H; h++) {                                                                     \
                    const float *qh = qf + h * D, *rk = row + (h / G) * D;                                        \
                    float dot = 0.0f;                                                                             \
                    _Pragma("omp simd reduction(+ : dot)")                                                        \
                    for (int d = 0; d < D; d++) dot += qh[d] * rk[d];                                             \
                    s[h][j] = dot;                                                                                \
                }                                                                                                 \
            }                                                                                                     \
            for (int h = 0; h < H; h++) {                                                                         \
                float mt = m[h];                                                                                  \
                for (int j = 0; j < n; j++) mt = s[h][j] > mt ? s[h][j] : mt;                                     \
                float corr = expf(m[h] - mt); /* m = -FLT_MAX at the first tile: exp underflows to 0 */                     \
                float sum = 0.0f;                                                                                 \
                _Pragma("omp simd reduction(+ : sum)")                                                            \
                for (int j = 0; j < n; j++) { s[h][j] = expf(s[h][j] - mt); sum += s[h][j]; }                     \
                l[h] = l[h] * corr + sum;                                                                         \
                m[h] = mt;                                                                                        \
                if (corr != 1.0f) for (int d = 0; d < D; d++) acc[h * D + d] *= corr;                             \
            }                                                                                                     \
            for (int j = 0; j < n; j++) {                                                                         \
                const T *vr = v + base + j * tok;                                                                 \
                for (int i = 0; i < KVH * D; i++) row[i] = LOAD(vr[i]);                                           \
                for (int h = 0; h < H; h++) {                                                                     \
                    const float p = s[h][j], *rv = row + (h / G) * D;                                             \
                    float *ah = acc + h * D;                                                                      \
                    for (int d = 0; d < D; d++) ah[d] += p * rv[d];                                               \
                }                                                                                                 \
            }                                                                                                     \
            t0 += n;                                                                                              \
        }                                                                                                         \
        for (int h = 0; h < H; h++) {                                                                             \
            float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;                                                         \
            for (int d = 0; d < D; d++) out[h * D + d] = STORE(acc[h * D + d] * inv);                             \
        }                                                                                                         \
    }

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                                       \
    DEFINE_TASK(NAME##_any, T, LOAD, STORE, 0)                                                                    \
    DEFINE_TASK(NAME##_d64, T, LOAD, STORE, 64)                                                                   \
    DEFINE_TASK(NAME##_d128, T, LOAD, STORE, 128)                                                                 \
    int NAME(const T *q, const T *k, const T *v, const int32_t *tables, int table_stride, const int32_t *first,   \
             const int32_t *ctx, T *out, int B, int H, int KVH, int D, int bs, float scale, int threads) {       \
        if (KVH <= 0 || H % KVH || H > MAX_HEADS || H * D > MAX_HD || KVH * D > 4096 || bs > TILE) return -1;     \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                                     \
        for (int b = 0; b < B; b++) {                                                                             \
            const T *qb = q + (size_t)b * H * D;                                                                  \
            const int32_t *tb = tables + (size_t)b * table_stride;                                                \
            int f = first ? first[b] : 0;                                                                         \
            T *ob = out + (size_t)b * H * D;                                                                      \
            if (D == 64) NAME##_d64(qb, k, v, tb, f, ctx[b], ob, H, KVH, D, bs, scale);                           \
            else if (D == 128) NAME##_d128(qb, k, v, tb, f, ctx[b], ob, H, KVH, D, bs, scale);                    \
            else NAME##_any(qb, k, v, tb, f, ctx[b], ob, H, KVH, D, bs, scale);                                   \
        }                                                                                                         \
        return 0;                                                                                                 \
    }

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_DECODE(paged_decode_attention_f32, float, F32_LOAD, F32_STORE)

/* paged_prefill_attention_{bf16,f32}: the N new tokens of one sequence (positions q0 .. q0+N-1) against that
 * sequence's keys in the paged cache, which holds the new tokens' K/V already: token i attends keys
 * [lo, q0+i] with lo = 0, or q0+i-window+1 (at least 0) for a sliding window. Serves a whole prompt and a
 * chunk after a cached prefix alike, reading the pages in place.
 *   q, out   [N, H, D] (contiguous)       table  int32 [>= blocks of key q0+N-1]
 * One task per (block of tokens, KV head): the G query heads of that KV head for those tokens are the
 * task's rows. Keys go in tiles of PKT: each tile's K rows of the KV head are converted to fp32 once and
 * transposed to [D][PKT] (zero past the keys there are), so a row's scores over the tile are one fixed-width
 * vector per head-dim element, and its V rows once for every row's P*V; an online softmax per row over the
 * tiles (keys past a row's position, or before its window, get no weight and are never exponentiated). Rows
 * go through a tile PRB at a time, so each K and V vector loaded feeds PRB rows' multiply-adds. */
#define PQB 16 /* a block's tokens: a multiple of PQB (prefill_block_tokens) */
#define PRB_ROWS 192
#define PKT 32 /* keys per tile */

/* Tokens per block: a tile's K and V are converted and transposed once per task and serve the task's rows (tokens
 * x G), so blocks of about PRB_ROWS rows (64 tokens at G = 3) spread that cost over more rows than 16 tokens would;
 * shorter while there would be fewer than four tasks per thread, never under PQB. */
static inline int prefill_block_tokens(int N, int G, int KVH, int threads) {
    int t = G >= PRB_ROWS / PQB ? PQB : PRB_ROWS / G / PQB * PQB;
    if (t > 4 * PQB) t = 4 * PQB;
    if (t < PQB) t = PQB;
    while (t > PQB && (long)((N + t - 1) / t) * KVH < 4L * (threads > 0 ? threads : 1)) t -= PQB;
    return t;
}

/* One row, any head dim (one not a multiple of 64): acc = acc * corr + sum over keys j0..j1-1 of p[j] * v[j]
 * (v [PKT][D]). */
static inline void prefill_pv_any(float *acc, const float *p, const float *vf, float corr, int j0, int j1, int D) {
    _Pragma("omp simd")
    for (int d = 0; d < D; d++) acc[d] *= corr;
    for (int j = j0; j < j1; j++) {
        const float pj = p[j], *vj = vf + (size_t)j * D;
        _Pragma("omp simd")
        for (int d = 0; d < D; d++) acc[d] = fmaf(pj, vj[d], acc[d]);
    }
}

/* PRB rows at a time: a tile's K (or V) vectors are loaded once for PRB rows' fused multiply-adds instead of
 * once per row, so the loads no longer bound the multiply-adds (one load per multiply-add before). */
#define PRB 4

/* sc[i][j] = q_i . kt[:, j] for the PRB rows at q (row i at q + i*D): two accumulator chains per row (even and
 * odd head-dim elements), so no sum waits on the one before; fused multiply-adds (explicit fmaf: the library
 * compiles with -ffp-contract=off for the elementwise ops' torch-equal rounding). */
static inline void prefill_scores_rows(const float *q, const float *kt, int D, float sc[PRB][PKT]) {
    float a[PRB][PKT] __attribute__((aligned(64))) = {{0}}, b[PRB][PKT] __attribute__((aligned(64))) = {{0}};
    int d = 0;
    for (; d + 2 <= D; d += 2) {
        const float *k0 = kt + (size_t)d * PKT, *k1 = k0 + PKT;
        _Pragma("GCC unroll 4")
        for (int i = 0; i < PRB; i++) {
            const float x0 = q[(size_t)i * D + d], x1 = q[(size_t)i * D + d + 1];
            _Pragma("omp simd")
            for (int j = 0; j < PKT; j++) {
                a[i][j] = fmaf(x0, k0[j], a[i][j]);
                b[i][j] = fmaf(x1, k1[j], b[i][j]);
            }
        }
    }
    for (; d < D; d++) {
        _Pragma("GCC unroll 4")
        for (int i = 0; i < PRB; i++) {
            const float x = q[(size_t)i * D + d];
            _Pragma("omp simd")
            for (int j = 0; j < PKT; j++) a[i][j] = fmaf(x, kt[(size_t)d * PKT + j], a[i][j]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < PRB; i++) {
        _Pragma("omp simd")
        for (int j = 0; j < PKT; j++) sc[i][j] = a[i][j] + b[i][j];
    }
}

/* One row's online softmax over one tile: the scores of keys [j0, j1) become their weights exp(score - new max),
 * every other key's 0 (those may score above the max: never exponentiated); the row's max m and sum l move on;
 * returns the factor exp(old max - new max) its earlier P*V sum must take. A tile whole for the row (every tile
 * but a row's first and last few) takes the loops without masks. */
static inline float prefill_softmax_tile(float *sc, int j0, int j1, float *m, float *l) {
    float mt = *m, sum = 0.0f;
    if (j0 == 0 && j1 == PKT) {
        _Pragma("omp simd reduction(max : mt)")
        for (int j = 0; j < PKT; j++) mt = sc[j] > mt ? sc[j] : mt;
        _Pragma("omp simd reduction(+ : sum)")
        for (int j = 0; j < PKT; j++) {
            sc[j] = expf(sc[j] - mt);
            sum += sc[j];
        }
    } else {
        _Pragma("omp simd reduction(max : mt)")
        for (int j = 0; j < PKT; j++) {
            const float x = (j >= j0 && j < j1) ? sc[j] : -FLT_MAX;
            mt = x > mt ? x : mt;
        }
        _Pragma("omp simd reduction(+ : sum)")
        for (int j = 0; j < PKT; j++) {
            const int in = j >= j0 && j < j1;
            const float e = expf(in ? sc[j] - mt : -80.0f);
            sc[j] = in ? e : 0.0f;
            sum += sc[j];
        }
    }
    const float corr = mt == *m ? 1.0f : expf(*m - mt);
    *l = *l * corr + sum;
    *m = mt;
    return corr;
}

/* acc_i = acc_i * corr_i + sum over keys j0..j1-1 of p_i[j] * v[j] for the PRB rows at acc (row i at
 * acc + i*D), 64 head-dim elements at a time (D a multiple of 64): 16 accumulator vectors, each V vector loaded
 * once for the PRB rows. A row's p is zero outside its own keys. */
static inline void prefill_pv_rows(float *acc, const float p[PRB][PKT], const float *vf, const float corr[PRB],
                                   int j0, int j1, int D) {
    for (int dc = 0; dc < D; dc += 64) {
        float a[PRB][64] __attribute__((aligned(64)));
        _Pragma("GCC unroll 4")
        for (int i = 0; i < PRB; i++) {
            _Pragma("omp simd")
            for (int d = 0; d < 64; d++) a[i][d] = acc[(size_t)i * D + dc + d] * corr[i];
        }
        for (int j = j0; j < j1; j++) {
            const float *vj = vf + (size_t)j * D + dc;
            _Pragma("GCC unroll 4")
            for (int i = 0; i < PRB; i++) {
                const float pj = p[i][j];
                _Pragma("omp simd")
                for (int d = 0; d < 64; d++) a[i][d] = fmaf(pj, vj[d], a[i][d]);
            }
        }
        _Pragma("GCC unroll 4")
        for (int i = 0; i < PRB; i++) {
            _Pragma("omp simd")
            for (int d = 0; d < 64; d++) acc[(size_t)i * D + dc + d] = a[i][d];
        }
    }
}
#define DEFINE_PREFILL(NAME, T, LOAD, STORE)                                                                      \
    int NAME(const T *q, const T *k, const T *v, const int32_t *table, int q0, int N, int window, T *out,        \
             int H, int KVH, int D, int bs, float scale, int threads) {                                           \
        if (KVH <= 0 || H % KVH || H > MAX_HEADS || D > 512 || bs <= 0 || N <= 0 || q0 < 0) return -1;           \
        const int G = H / KVH, bt = prefill_block_tokens(N, G, KVH, threads), nqb = (N + bt - 1) / bt;          \
        const size_t tok = (size_t)KVH * D;                                                                        \
        int bad = 0;                                                                                              \
        _Pragma("omp parallel for schedule(dynamic, 1) collapse(2) num_threads(threads) reduction(| : bad)")       \
        for (int qb = 0; qb < nqb; qb++) {                                                                        \
            for (int kh = 0; kh < KVH; kh++) {                                                                    \
                const int t0 = qb * bt, tn = N - t0 < bt ? N - t0 : bt, R = tn * G;                              \
                const int Rp = (R + PRB - 1) / PRB * PRB; /* rows past R: zero queries that attend nothing */      \
                const size_t floats = (size_t)D * PKT * 2 + (size_t)Rp * D * 2 + (size_t)Rp * 2;                  \
                float *ws = (float *)aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);                  \
                if (!ws) { bad = 1; continue; }                                                                   \
                float *kt = ws, *vf = kt + (size_t)D * PKT; /* 64-byte aligned: PKT floats per head-dim row */     \
                float *qf = vf + (size_t)PKT * D, *acc = qf + (size_t)Rp * D, *m = acc + (size_t)Rp * D;            \
                float *l = m + Rp;                                                                                \
                memset(qf + (size_t)R * D, 0, sizeof(float) * (size_t)(Rp - R) * D);                              \
                for (int ti = 0; ti < tn; ti++)                                                                   \
                    for (int g = 0; g < G; g++) {                                                                 \
                        const T *qr = q + ((size_t)(t0 + ti) * H + kh * G + g) * D;                               \
                        float *qd = qf + (size_t)(ti * G + g) * D;                                                \
                        for (int d = 0; d < D; d++) { qd[d] = LOAD(qr[d]) * scale; }                              \
                    }                                                                                             \
                for (int r = 0; r < Rp; r++) { m[r] = -FLT_MAX; l[r] = 0.0f; }                                   \
                memset(acc, 0, sizeof(float) * (size_t)Rp * D);                                                   \
                const int last = q0 + t0 + tn - 1; /* the block's last query position: its last key */           \
                int lo = window > 0 ? q0 + t0 - window + 1 : 0;                                                   \
                if (lo < 0) lo = 0;                                                                               \
                for (int k0 = lo; k0 <= last; k0 += PKT) {                                                        \
                    const int n = last + 1 - k0 < PKT ? last + 1 - k0 : PKT;                                      \
                    for (int j = 0; j < PKT; j++) {                                                               \
                        if (j < n) {                                                                              \
                            const int key = k0 + j;                                                               \
                            const size_t at = ((size_t)table[key / bs] * bs + key % bs) * tok + (size_t)kh * D;  \
                            for (int d = 0; d < D; d++) { kt[(size_t)d * PKT + j] = LOAD(k[at + d]); }           \
                            for (int d = 0; d < D; d++) { vf[(size_t)j * D + d] = LOAD(v[at + d]); }             \
                        } else {                                                                                  \
                            for (int d = 0; d < D; d++) { kt[(size_t)d * PKT + j] = 0.0f; }                      \
                        }                                                                                         \
                    }                                                                                             \
                    for (int rb = 0; rb < Rp; rb += PRB) {                                                        \
                        /* rows run in position order: the row block's last real row reaching no key of this    \
                           tile means none of its rows does (causal: the tiles past a block's early rows), and   \
                           its first row's window starting past the tile means every row's does (the tiles     \
                           before a sliding window's start for a block's later rows) */                         \
                        const int rl = rb + PRB - 1 < R ? rb + PRB - 1 : R - 1;                                   \
                        if (q0 + t0 + rl / G < k0 || (window > 0 && q0 + t0 + rb / G - window + 1 > k0 + n - 1)) \
                            continue;                                                                             \
                        float sc[PRB][PKT] __attribute__((aligned(64))), corr[PRB];                               \
                        int jlo = PKT, jhi = 0;                                                                   \
                        prefill_scores_rows(qf + (size_t)rb * D, kt, D, sc);                                      \
                        for (int i = 0; i < PRB; i++) {                                                           \
                            const int r = rb + i, pos = q0 + t0 + r / G;                                          \
                            int j0 = window > 0 ? pos - window + 1 - k0 : 0, j1 = pos + 1 - k0;                  \
                            if (j0 < 0) j0 = 0;                                                                   \
                            if (j1 > n) j1 = n;                                                                   \
                            corr[i] = 1.0f;                                                                       \
                            if (r >= R || j0 >= j1) { /* a padding row, or every key of the tile is past this   \
                                                         row or before its window: no weight, acc unchanged */ \
                                memset(sc[i], 0, sizeof(sc[i]));                                                  \
                                continue;                                                                         \
                            }                                                                                     \
                            corr[i] = prefill_softmax_tile(sc[i], j0, j1, m + r, l + r);                          \
                            jlo = j0 < jlo ? j0 : jlo;                                                            \
                            jhi = j1 > jhi ? j1 : jhi;                                                            \
                        }                                                                                         \
                        if (jlo >= jhi) continue; /* no row of this block has a key in this tile */              \
                        float *ab = acc + (size_t)rb * D;                                                         \
                        if (D % 64 == 0) prefill_pv_rows(ab, sc, vf, corr, jlo, jhi, D);                          \
                        else                                                                                      \
                            for (int i = 0; i < PRB; i++)                                                         \
                                prefill_pv_any(ab + (size_t)i * D, sc[i], vf, corr[i], jlo, jhi, D);              \
                    }                                                                                             \
                }                                                                                                 \
                for (int r = 0; r < R; r++) {                                                                     \
                    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;                                           \
                    T *o = out + ((size_t)(t0 + r / G) * H + kh * G + r % G) * D;                                 \
                    for (int d = 0; d < D; d++) o[d] = STORE(acc[(size_t)r * D + d] * inv);                       \
                }                                                                                                 \
                free(ws);                                                                                         \
            }                                                                                                     \
        }                                                                                                         \
        return bad ? -2 : 0;                                                                                      \
    }

DEFINE_PREFILL(paged_prefill_attention_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_PREFILL(paged_prefill_attention_f32, float, F32_LOAD, F32_STORE)

/* Elementwise ops of the Llama-family layers, each rounding exactly where the torch ops they replace round (so a
 * bf16 model computes the same bits up to the last-place differences of expf/sqrtf):
 *   rms_norm:  y = w * T(x * 1/sqrt(mean(x^2) + eps))        (HF's RMSNorm: fp32 inside, cast, then the weight)
 *   add_rms_norm: s = T(x + d), y = rms_norm(s)               (a residual add and the next norm, one pass)
 *   silu_mul:  out = T(T(silu(gate)) * up)                   (gate, up = the two halves of each row)
 *   rope:      out = T(T(x * T(cos)) + T(rotate_half(x) * T(sin)))   (cos/sin fp32 [positions, D])
 * x rows may be strided (views of a fused projection); outputs are contiguous. */
#define DEFINE_ELEMENTWISE(SUF, T, LOAD, STORE)                                                                   \
    int rms_norm_##SUF(const T *x, long x_stride, const T *w, T *out, int rows, int dim, float eps,              \
                       int threads) {                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows > 1)")                           \
        for (int r = 0; r < rows; r++) {                                                                          \
            const T *xr = x + (size_t)r * x_stride;                                                               \
            T *o = out + (size_t)r * dim;                                                                         \
            float ss = 0.0f;                                                                                      \
            _Pragma("omp simd reduction(+ : ss)")                                                                 \
            for (int i = 0; i < dim; i++) { float v = LOAD(xr[i]); ss += v * v; }                                 \
            float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                                      \
            for (int i = 0; i < dim; i++) o[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(xr[i]) * inv)));              \
        }                                                                                                         \
        return 0;                                                                                                 \
    }                                                                                                             \
    int add_rms_norm_##SUF(const T *x, long x_stride, const T *d, long d_stride, const T *w, T *sum, T *out,     \
                           int rows, int dim, float eps, int threads) {                                           \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows > 1)")                           \
        for (int r = 0; r < rows; r++) {                                                                          \
            const T *xr = x + (size_t)r * x_stride, *dr = d + (size_t)r * d_stride;                               \
            T *s = sum + (size_t)r * dim, *o = out + (size_t)r * dim;                                             \
            float ss = 0.0f;                                                                                      \
            _Pragma("omp simd reduction(+ : ss)")                                                                 \
            for (int i = 0; i < dim; i++) {                                                                       \
                T v = STORE(LOAD(xr[i]) + LOAD(dr[i]));                                                           \
                s[i] = v;                                                                                         \
                float f = LOAD(v);                                                                                \
                ss += f * f;                                                                                      \
            }                                                                                                     \
            float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                                      \
            for (int i = 0; i < dim; i++) o[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(s[i]) * inv)));               \
        }                                                                                                         \
        return 0;                                                                                                 \
    }                                                                                                             \
    int silu_mul_##SUF(const T *gu, long gu_stride, T *out, int rows, int inter, int threads) {                  \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows > 1)")                           \
        for (int r = 0; r < rows; r++) {                                                                          \
            const T *g = gu + (size_t)r * gu_stride, *u = g + inter;                                              \
            T *o = out + (size_t)r * inter;                                                                       \
            float act[256];                                                                                       \
            for (int i0 = 0; i0 < inter; i0 += 256) { /* expf over a float buffer: glibc's vector expf */         \
                int n = inter - i0 < 256 ? inter - i0 : 256;                                                      \
                _Pragma("omp simd")                                                                               \
                for (int i = 0; i < n; i++) { float a = LOAD(g[i0 + i]); act[i] = a / (1.0f + expf(-a)); }       \
                for (int i = 0; i < n; i++) o[i0 + i] = STORE(LOAD(STORE(act[i])) * LOAD(u[i0 + i]));             \
            }                                                                                                     \
        }                                                                                                         \
        return 0;                                                                                                 \
    }                                                                                                             \
    int rope_##SUF(const T *x, long x_stride, const int64_t *pos, const float *cos, const float *sin, T *out,     \
                   int tokens, int heads, int dim, int threads) {                                                 \
        int half = dim / 2;                                                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (tokens > 1)")                         \
        for (int t = 0; t < tokens; t++) {                                                                        \
            const float *c = cos + (size_t)pos[t] * dim, *sn = sin + (size_t)pos[t] * dim;                        \
            for (int h = 0; h < heads; h++) {                                                                     \
                const T *xh = x + (size_t)t * x_stride + (size_t)h * dim;                                         \
                T *o = out + ((size_t)t * heads + h) * dim;                                                       \
                for (int i = 0; i < dim; i++) {                                                                   \
                    float rot = i < half ? -LOAD(xh[i + half]) : LOAD(xh[i - half]);                              \
                    float a = LOAD(STORE(LOAD(xh[i]) * LOAD(STORE(c[i]))));                                       \
                    float b = LOAD(STORE(rot * LOAD(STORE(sn[i]))));                                              \
                    o[i] = STORE(a + b);                                                                          \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        return 0;                                                                                                 \
    }

DEFINE_ELEMENTWISE(bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ELEMENTWISE(f32, float, F32_LOAD, F32_STORE)

int native_abi_version(void) { return 4; }
