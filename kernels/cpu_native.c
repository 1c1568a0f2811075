/* slabserve's native CPU kernels: fp32, AVX2 + FMA, threaded with OpenMP.
 *
 * Built twice from this source (kernels/cpu_native.py): for AVX2, and with AVX-512 F/BW/VL/DQ enabled for the CPUs
 * that have it, where the quantized dot products run in 16 lanes, decode 4-bit blocks by table lookup (vpermps)
 * and tile 6 rows of x (32 registers). The rest is the same code in both builds.
 *
 * Built and loaded by kernels/cpu_native.py (ctypes), after torch is imported, so `#pragma omp` runs on the
 * OpenMP runtime torch already loaded: one thread pool for ATen, MKL and these kernels, never two competing
 * for the cores. The thread count is the calling thread's OpenMP setting, which torch.set_num_threads sets.
 *
 * Nothing here allocates: every buffer is the caller's.
 *
 * linear: y (M, N) = x (M, K) @ W (+ residual), with W packed by the plan as column panels:
 * W_packed[p, k, j] = W[k, 16 p + j], shape (ceil(N / 16), K, 16), the last panel zero-padded. A panel is one
 * contiguous stream of K * 64 bytes, so the weights are read front to back exactly once per call whatever M is,
 * and each panel is multiplied by up to six rows of x at a time held in twelve ymm accumulators. (MKL's sgemm
 * over the same weights stored (K, N) row-major reads 8 to 32 rows at a third of the memory bandwidth on the
 * 2-core AMD machine this was measured on.)
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
/* Panel rows (64 bytes each) to prefetch ahead of the row being multiplied: 2 KB, which on 2 AVX2 cores took the
 * batch-1 weight stream from 39 to 43 GB/s (the hardware prefetcher alone starts each panel late). Prefetching past
 * the end of a panel reads the next one, which this thread or its neighbour is about to read anyway; past the last
 * panel a prefetch of an unmapped address is dropped without a fault. */
#define PREFETCH_ROWS 32

/* The rows a row-wise kernel computes out of the M it was given: all of them when `qs` is NULL. Else qs is the
 * step's query_start (S + 1 entries, read at each call): the first qs[S] rows, its real token rows, or with
 * `per_seq` the first 1 + the last s whose run qs[s] .. qs[s+1] is not empty, its real sequences (the rows of a
 * logits gather). Clamped to [0, M]. So a padded bucket costs its tokens rather than its size; the rows past the
 * count are padding and are left as they were (nothing reads them: attention takes each sequence's rows from
 * query_start, and the logits of padding sequences are never sampled). */
static inline int64_t live_rows(int64_t M, const int32_t *qs, int64_t n_qs, int64_t per_seq) {
    if (!qs || n_qs < 1) return M;
    int64_t n = qs[n_qs - 1];
    if (per_seq) {
        n = 0;
        for (int64_t s = 0; s + 1 < n_qs; s++)
            if (qs[s + 1] > qs[s]) n = s + 1;
    }
    return n < 0 ? 0 : (n < M ? n : M);
}

int slabserve_cpu_supported(void) {
    __builtin_cpu_init();
#ifdef __AVX512F__
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return 0;
#endif
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* KV caches may hold fp32, bf16 or fp16 (the plan's kv_dtype); activations are fp32. Half rows are widened to fp32
 * as they are loaded (exactly) and fp32 rows rounded to nearest even as they are stored, as torch converts. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* Asks for the `bytes` from p, a 64-byte line at a time, to be brought into L2 (a prefetch never faults). */
static inline __attribute__((always_inline)) void prefetch_l2(const void *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}

static inline __attribute__((always_inline)) __m256 load_kv8(const void *base, int64_t index, int kind) {
    if (kind == KV_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (kind == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
    return _mm256_loadu_ps((const float *)base + index);
}

static inline uint16_t bf16_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0; /* NaN, as c10::BFloat16 */
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* `mr` (1..6, a constant after inlining) rows of x times one panel, into y (row stride ldy). */
static inline __attribute__((always_inline)) void tile(int mr, int64_t K, const float *x, int64_t ldx,
                                                       const float *p, float *y, int64_t ldy) {
    __m256 c[6][2];
    for (int i = 0; i < mr; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(p + (k + PREFETCH_ROWS) * PANEL), _MM_HINT_T0);
        __m256 b0 = _mm256_loadu_ps(p + k * PANEL), b1 = _mm256_loadu_ps(p + k * PANEL + 8);
        for (int i = 0; i < mr; i++) {
            __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(y + i * ldy, c[i][0]);
        _mm256_storeu_ps(y + i * ldy + 8, c[i][1]);
    }
}

/* Up to six rows of x times one panel into y, 16 columns wide. */
static inline __attribute__((always_inline)) void rows_times_panel(int mr, int64_t K, const float *x, int64_t ldx,
                                                                   const float *p, float *y, int64_t ldy) {
    switch (mr) {
        case 6: tile(6, K, x, ldx, p, y, ldy); break;
        case 5: tile(5, K, x, ldx, p, y, ldy); break;
        case 4: tile(4, K, x, ldx, p, y, ldy); break;
        case 3: tile(3, K, x, ldx, p, y, ldy); break;
        case 2: tile(2, K, x, ldx, p, y, ldy); break;
        default:
            if (mr == 1) tile(1, K, x, ldx, p, y, ldy);
            break;
    }
}

/* How many rows the next tile takes: six while it can, and 4 + 4 or 4 + 3 at the end rather than a lone row. */
static inline int tile_rows(int64_t left) {
    if (left == 7 || left == 8) return 4;
    return left >= 6 ? 6 : (int)left;
}

/* All M rows times one full panel, into y (16 columns). */
static void panel_rows(int64_t M, int64_t K, const float *x, int64_t ldx, const float *p, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M;) {
        int mr = tile_rows(M - m);
        rows_times_panel(mr, K, x + m * ldx, ldx, p, y + m * ldy, ldy);
        m += mr;
    }
}

/* The padded last panel: each tile goes through the stack, and only its first `cols` columns reach y. */
static void partial_panel_rows(int64_t M, int64_t K, const float *x, int64_t ldx, const float *p, float *y,
                               int64_t ldy, int cols) {
    float tile_out[6 * PANEL];
    for (int64_t m = 0; m < M;) {
        int mr = tile_rows(M - m);
        rows_times_panel(mr, K, x + m * ldx, ldx, p, tile_out, PANEL);
        for (int i = 0; i < mr; i++) memcpy(y + (m + i) * ldy, tile_out + i * PANEL, cols * sizeof(float));
        m += mr;
    }
}

/* y[:, :cols] += r[:, :cols] over M rows (the residual, added to a panel's columns while they are in cache). */
static void add_rows(int64_t M, float *y, int64_t ldy, const float *r, int64_t ldr, int cols) {
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < cols; j++) y[m * ldy + j] += r[m * ldr + j];
}

/* y = x @ W (+ residual when `residual` is not NULL; it must not overlap y). Row strides ldx, ldy, ldr in floats;
 * each row's values are contiguous. qs, n_qs, per_seq: see live_rows. */
void slabserve_linear_f32(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *w,
                          float *y, int64_t ldy, const float *residual, int64_t ldr, const int32_t *qs, int64_t n_qs,
                          int64_t per_seq) {
    int64_t full = N / PANEL, cols = N % PANEL;
    M = live_rows(M, qs, n_qs, per_seq);
    if (M <= 0 || N <= 0) return;
    #pragma omp parallel for schedule(static) if (full > 1)
    for (int64_t j = 0; j < full; j++) {
        panel_rows(M, K, x, ldx, w + j * K * PANEL, y + j * PANEL, ldy);
        if (residual) add_rows(M, y + j * PANEL, ldy, residual + j * PANEL, ldr, PANEL);
    }
    if (cols) {
        partial_panel_rows(M, K, x, ldx, w + full * K * PANEL, y + full * PANEL, ldy, (int)cols);
        if (residual) add_rows(M, y + full * PANEL, ldy, residual + full * PANEL, ldr, (int)cols);
    }
}

/* ------------------------------------------------------------------------------------------------ attention
 *
 * slab attention of decode rows and prefill chunks of any length: sequence s owns query rows query_start[s] ..
 * query_start[s+1]-1; its row j sits at position p = context_len[s] - q_len + j and sees cache rows
 * slab_offset[s] + [0, p]. A task takes up to a tile of consecutive rows for one kv head: the rows and the G =
 * H / Hkv query heads of the group take each block of 64 K and V rows in turn while it sits in L1, with the softmax
 * computed online (running max and sum per row and head, accumulator rescaled when the max grows), so nothing but
 * the stack is needed whatever the context. Sequences with fewer keys than rows see nothing (zeroed). */

#define KEY_BLOCK 64
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
/* Query rows a task takes through each block of keys: as many as keep its accumulators (rows x group x head_dim
 * floats) within TILE_FLOATS on the stack (64 KB), at most MAX_ROW_TILE; 4 at the largest group and head_dim. */
#define TILE_FLOATS (MAX_GROUP * MAX_HEAD_DIM * 4)
#define MAX_ROW_TILE 16
#define TASKS_PER_THREAD 4  /* attention tasks a thread gets at least, when there are rows for them */

/* exp(x) for 8 floats: Cephes' range reduction and degree-5 polynomial (relative error about 2e-7); inputs
 * below -87.3 give 0. */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The K cache is stored in tiles of KV_TILE keys (slabserve.kernels.contracts.KV_TILE): tile t holds cache rows
 * 16t .. 16t+15, and for each of a row's ldkv elements e (kv head g's dimension d: e = g * head_dim + d) the 16 rows'
 * values side by side, so element e of row r lies at ((r / 16) * ldkv + e) * 16 + r % 16. V stays one row after
 * another. A key's score is then a column of FMAs in its own lane (below), with no sum across lanes; stored so by
 * slabserve_kv_write_f32, read in place. */
#define KV_TILE 16

static inline int64_t k_tile_index(int64_t row, int64_t e, int64_t ldkv) {
    return ((row / KV_TILE) * ldkv + e) * KV_TILE + row % KV_TILE;
}

#ifdef __AVX512F__
#define SCORE_HEADS 3  /* 3 x 4 accumulators, 4 key registers and a broadcast, of the 32 zmm AVX-512 gives */
/* 16 KV elements from `index` as floats (exact), or with `half` the 8 there and zeros above (a head_dim's tail of
 * 8: the zeros add exact zeros to lanes 8..15). */
static inline __attribute__((always_inline)) __m512 load_kv16(const void *base, int64_t index, int kind, int half) {
    if (half) return _mm512_insertf32x8(_mm512_setzero_ps(), load_kv8(base, index, kind), 0);
    if (kind == KV_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (kind == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
    return _mm512_loadu_ps((const float *)base + index);
}

/* `x` kept in a register: without this the compiler folds a load shared by several FMAs (one key or value vector
 * for three heads) into each of them, which loads it three times; with three broadcasts beside them the loops
 * were bound by loads rather than FMAs. Only where a value lives changes, never the arithmetic. */
static inline __attribute__((always_inline)) __m512 in_register(__m512 x) {
    __asm__("" : "+v"(x));
    return x;
}

/* scale * q . k for the keys of `nv` (1..4) vectors of 16 (vector t: element d of its keys at tiles[t] + d * 16, of
 * `kind`), for `nq` (1..SCORE_HEADS) query heads (head h: q + h * D, into sc + h * KEY_BLOCK + 16 t): for d = 0,
 * 1, ..., D - 1 in order, one FMA per head and vector, each key's chain in its own lane from zero, then one
 * multiply by scale. Each step over d loads the keys once for all nq heads. */
static inline __attribute__((always_inline)) void scores_tiles(int nq, int nv, int D, const float *q,
                                                               const void *const *tiles, float scale, float *sc,
                                                               int kind) {
    __m512 acc[SCORE_HEADS][4];
    for (int h = 0; h < nq; h++)
        for (int t = 0; t < nv; t++) acc[h][t] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 kv[4];
        for (int t = 0; t < nv; t++) kv[t] = in_register(load_kv16(tiles[t], (int64_t)d * KV_TILE, kind, 0));
        for (int h = 0; h < nq; h++) {
            __m512 qb = _mm512_set1_ps(q[h * D + d]);
            for (int t = 0; t < nv; t++) acc[h][t] = _mm512_fmadd_ps(qb, kv[t], acc[h][t]);
        }
    }
    __m512 s = _mm512_set1_ps(scale);
    for (int h = 0; h < nq; h++)
        for (int t = 0; t < nv; t++) _mm512_storeu_ps(sc + h * KEY_BLOCK + 16 * t, _mm512_mul_ps(acc[h][t], s));
}
#else
#define SCORE_HEADS 1
/* The same chains in 8 lanes: each vector of 16 keys is two halves, each key's chain the AVX-512 build's (FMAs
 * over d in order from zero, then the multiply by scale), so both builds give the same scores bit for bit. */
static inline __attribute__((always_inline)) void scores_tiles(int nq, int nv, int D, const float *q,
                                                               const void *const *tiles, float scale, float *sc,
                                                               int kind) {
    (void)nq;  /* one head a call: 8 accumulators of the 16 ymm registers */
    __m256 acc[8];
    for (int t = 0; t < 2 * nv; t++) acc[t] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m256 qb = _mm256_set1_ps(q[d]);
        for (int t = 0; t < nv; t++) {
            acc[2 * t] = _mm256_fmadd_ps(qb, load_kv8(tiles[t], (int64_t)d * KV_TILE, kind), acc[2 * t]);
            acc[2 * t + 1] = _mm256_fmadd_ps(qb, load_kv8(tiles[t], (int64_t)d * KV_TILE + 8, kind), acc[2 * t + 1]);
        }
    }
    __m256 s = _mm256_set1_ps(scale);
    for (int t = 0; t < 2 * nv; t++) _mm256_storeu_ps(sc + 8 * t, _mm256_mul_ps(acc[t], s));
}
#endif

/* scores_tiles with the vector count a constant in each branch, so each gets its own unrolled loop. */
static inline __attribute__((always_inline)) void block_scores(int nq, int nv, int D, const float *q,
                                                               const void *const *tiles, float scale, float *sc,
                                                               int kind) {
    switch (nv) {
    case 1: scores_tiles(nq, 1, D, q, tiles, scale, sc, kind); break;
    case 2: scores_tiles(nq, 2, D, q, tiles, scale, sc, kind); break;
    case 3: scores_tiles(nq, 3, D, q, tiles, scale, sc, kind); break;
    default: scores_tiles(nq, 4, D, q, tiles, scale, sc, kind); break;
    }
}

/* The scores of all G heads of one query row over the first `len` keys of a block (its vectors in tiles):
 * sc[h * KEY_BLOCK + i]; the lanes from len to the end of the last vector hold scores of keys past the row's (or
 * zeros) and are never read. A key's score is the same bits whatever nq, nv, row, chunk or step computes it. */
static inline __attribute__((always_inline)) void group_scores(int G, int D, const float *q, const void *const *tiles,
                                                               int len, float scale, float *sc, int kind) {
    int nv = (len + 15) / 16, h = 0;
#if SCORE_HEADS >= 3
    for (; h + 3 <= G; h += 3) block_scores(3, nv, D, q + h * D, tiles, scale, sc + h * KEY_BLOCK, kind);
    for (; h + 2 <= G; h += 2) block_scores(2, nv, D, q + h * D, tiles, scale, sc + h * KEY_BLOCK, kind);
#endif
    for (; h < G; h++) block_scores(1, nv, D, q + h * D, tiles, scale, sc + h * KEY_BLOCK, kind);
}

/* Points tiles[0..3] at the 16-key vectors of kv head `goff / D`'s keys at cache rows a .. a + 63 (`keys` of them
 * used): in place when a is the first row of a tile (slabs start on one when their sizes are multiples of 16, as
 * planned slab classes are), else copied lane run by lane run into `kt` (4 x D x 16 elements, zeros past `keys`).
 * Either way element d of vector t's key j is at tiles[t] + d * 16 + j. */
static inline __attribute__((always_inline)) void block_tiles(const char *k, int64_t a, int64_t goff, int64_t ldkv,
                                                              int D, int keys, size_t item, char *kt,
                                                              const void *tiles[4]) {
    int nv = (keys + 15) / 16;
    if (a % KV_TILE == 0) {
        for (int t = 0; t < nv; t++) tiles[t] = k + k_tile_index(a + 16 * t, goff, ldkv) * item;
        return;
    }
    memset(kt, 0, (size_t)nv * D * KV_TILE * item);
    for (int j = 0; j < keys;) {  /* keys j .. j + run - 1 lie in one tile of the cache and one vector here */
        int64_t row = a + j;
        int lane = (int)(row % KV_TILE), dst = j % 16;
        int run = KV_TILE - lane < 16 - dst ? KV_TILE - lane : 16 - dst;
        if (run > keys - j) run = keys - j;
        const char *src = k + k_tile_index(row, goff, ldkv) * item;
        char *out = kt + ((size_t)(j / 16) * D * KV_TILE + dst) * item;
        for (int d = 0; d < D; d++) memcpy(out + (size_t)d * KV_TILE * item, src + (size_t)d * KV_TILE * item,
                                           (size_t)run * item);
        j += run;
    }
    for (int t = 0; t < nv; t++) tiles[t] = kt + (size_t)t * D * KV_TILE * item;
}

/* acc[0..D) += sum_i p[i] * v_i over `len` rows of v (of `kind`): 64 columns at a time held in eight registers,
 * eight independent FMA chains (four would wait on the FMA latency), then 32 and 8. Every column is the same chain
 * over i in order whatever the width it is computed in. */
static inline __attribute__((always_inline)) void block_values(int D, const float *p, const void *v, int64_t ldkv,
                                                               int len, float *acc, int kind) {
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + d + 8 * j);
        for (int i = 0; i < len; i++) {
            int64_t row = i * ldkv + d;
            __m256 pi = _mm256_set1_ps(p[i]);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(pi, load_kv8(v, row + 8 * j, kind), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + d + 8 * j, a[j]);
    }
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int i = 0; i < len; i++) {
            int64_t row = i * ldkv + d;
            __m256 pi = _mm256_set1_ps(p[i]);
            a0 = _mm256_fmadd_ps(pi, load_kv8(v, row, kind), a0);
            a1 = _mm256_fmadd_ps(pi, load_kv8(v, row + 8, kind), a1);
            a2 = _mm256_fmadd_ps(pi, load_kv8(v, row + 16, kind), a2);
            a3 = _mm256_fmadd_ps(pi, load_kv8(v, row + 24, kind), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < D; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        for (int i = 0; i < len; i++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), load_kv8(v, i * ldkv + d, kind), a);
        _mm256_storeu_ps(acc + d, a);
    }
}

/* block_values for the G heads of one query row (head h: p + h * KEY_BLOCK into acc + h * D), SCORE_HEADS heads at a
 * time over each 64 columns, so each row of v is loaded once for all of them; every column of every head is
 * block_values' chain, so the same bits. */
static inline __attribute__((always_inline)) void group_values(int G, int D, const float *p, const void *v,
                                                               int64_t ldkv, int len, float *acc, int kind) {
    int h = 0;
#ifdef __AVX512F__
    /* 16 lanes: each column the same chain over the keys in order as the 8-lane code below, so the same bits */
    if (D % 64 == 0)
        for (; h + 3 <= G; h += 3)
            for (int d = 0; d < D; d += 64) {
                __m512 a[3][4];
                for (int t = 0; t < 3; t++)
                    for (int j = 0; j < 4; j++) a[t][j] = _mm512_loadu_ps(acc + (h + t) * D + d + 16 * j);
                for (int i = 0; i < len; i++) {
                    int64_t row = i * ldkv + d;
                    __m512 p0 = _mm512_set1_ps(p[h * KEY_BLOCK + i]), p1 = _mm512_set1_ps(p[(h + 1) * KEY_BLOCK + i]);
                    __m512 p2 = _mm512_set1_ps(p[(h + 2) * KEY_BLOCK + i]);
                    for (int j = 0; j < 4; j++) {
                        __m512 vv = in_register(load_kv16(v, row + 16 * j, kind, 0));
                        a[0][j] = _mm512_fmadd_ps(p0, vv, a[0][j]);
                        a[1][j] = _mm512_fmadd_ps(p1, vv, a[1][j]);
                        a[2][j] = _mm512_fmadd_ps(p2, vv, a[2][j]);
                    }
                }
                for (int t = 0; t < 3; t++)
                    for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + (h + t) * D + d + 16 * j, a[t][j]);
            }
#elif SCORE_HEADS >= 3
    if (D % 64 == 0)
        for (; h + 3 <= G; h += 3)
            for (int d = 0; d < D; d += 64) {
                __m256 a[3][8];
                for (int t = 0; t < 3; t++)
                    for (int j = 0; j < 8; j++) a[t][j] = _mm256_loadu_ps(acc + (h + t) * D + d + 8 * j);
                for (int i = 0; i < len; i++) {
                    int64_t row = i * ldkv + d;
                    __m256 p0 = _mm256_set1_ps(p[h * KEY_BLOCK + i]), p1 = _mm256_set1_ps(p[(h + 1) * KEY_BLOCK + i]);
                    __m256 p2 = _mm256_set1_ps(p[(h + 2) * KEY_BLOCK + i]);
                    for (int j = 0; j < 8; j++) {
                        __m256 vv = load_kv8(v, row + 8 * j, kind);
                        a[0][j] = _mm256_fmadd_ps(p0, vv, a[0][j]);
                        a[1][j] = _mm256_fmadd_ps(p1, vv, a[1][j]);
                        a[2][j] = _mm256_fmadd_ps(p2, vv, a[2][j]);
                    }
                }
                for (int t = 0; t < 3; t++)
                    for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + (h + t) * D + d + 8 * j, a[t][j]);
            }
#endif
    for (; h < G; h++) block_values(D, p + h * KEY_BLOCK, v, ldkv, len, acc + h * D, kind);
}

#ifdef __AVX512F__
/* exp256's arithmetic in 16 lanes (the same value in every lane as exp256 gives). */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, y, _mm512_castsi512_ps(e));
}

/* block_softmax below in 16 lanes (the AVX-512 build): a block's max, its exps and their sum over 16 lanes, the
 * tail masked; the running max, the rescaling and the sum's fold are the same steps. */
static void block_softmax(int D, float *sc, int len, float *m, float *l, float *acc) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= len; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sc + i));
    __mmask16 tail = (__mmask16)((1u << (len - i)) - 1);
    if (i < len) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, sc + i));
    float bm = _mm512_reduce_max_ps(mv);
    if (bm > *m) {
        float corr = *m == -INFINITY ? 0.0f : expf(*m - bm);
        *l *= corr;
        for (int d = 0; d < D; d++) acc[d] *= corr;
        *m = bm;
    }
    __m512 mx = _mm512_set1_ps(*m), total = _mm512_setzero_ps();
    for (i = 0; i + 16 <= len; i += 16) {
        __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + i), mx));
        _mm512_storeu_ps(sc + i, p);
        total = _mm512_add_ps(total, p);
    }
    if (i < len) {
        __m512 p = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc + i), mx)));
        _mm512_mask_storeu_ps(sc + i, tail, p);
        total = _mm512_add_ps(total, p);
    }
    __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(total), _mm512_extractf32x8_ps(total, 1));
    *l += hsum256(folded);
}
#else
/* Softmax bookkeeping of one head for one block of scores: raise the running max *m (rescaling the running sum *l
 * and the accumulator when it grows), turn the scores into exp(score - max) in place, add them to *l. */
static void block_softmax(int D, float *sc, int len, float *m, float *l, float *acc) {
    float bm = *m;
    int j = 0;
    if (len >= 8) {  /* the block's max, eight lanes at a time (a max is exact in any order) */
        __m256 mv = _mm256_loadu_ps(sc);
        for (j = 8; j + 8 <= len; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float vm = _mm_cvtss_f32(h);
        bm = vm > bm ? vm : bm;
    }
    for (; j < len; j++) bm = sc[j] > bm ? sc[j] : bm;
    if (bm > *m) {
        float corr = *m == -INFINITY ? 0.0f : expf(*m - bm);
        *l *= corr;
        for (int d = 0; d < D; d++) acc[d] *= corr;
        *m = bm;
    }
    __m256 mx = _mm256_set1_ps(*m), total = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mx));
        _mm256_storeu_ps(sc + i, p);
        total = _mm256_add_ps(total, p);
    }
    float rest = 0.0f;
    for (; i < len; i++) {
        sc[i] = expf(sc[i] - *m);
        rest += sc[i];
    }
    *l += hsum256(total) + rest;
}
#endif

/* Asks for the V rows of the next block, KEY_BLOCK keys past b (up to KEY_BLOCK of the `left` keys there, D
 * elements of `item` bytes each), to be brought into L2 while the current block is computed: after the first row's
 * scores, while the next block's key tiles (each D x 16 elements in one run) were asked for before them, so that the
 * requests go out in two bursts between computing rather than one. A decode row reads each block once, so without this it waits on memory (one kv head reads 256 of
 * every 768 bytes of a SmolLM2 cache row, a pattern the hardware prefetchers did not keep up with). On an AMD EPYC
 * (Zen 4), 32 decode rows at 1,000-3,000 keys ran 1.5-1.6x faster with one burst (prefetching into L1 instead:
 * 1.05-1.1x), and 16 rows at 3,000 keys 2.8 against 3.4 ms with two; two blocks ahead was slower. Prefill chunks,
 * which reuse each block for many rows, ran as fast as without. */
static inline __attribute__((always_inline)) void prefetch_next_block(const char *b, int64_t left, int64_t ldkv,
                                                                      int D, size_t item) {
    size_t stride = (size_t)ldkv * item;
    int64_t rows = left < KEY_BLOCK ? left : KEY_BLOCK;
    for (int64_t i = 0; i < rows; i++) prefetch_l2(b + (KEY_BLOCK + i) * stride, (size_t)D * item);
}

/* Keys per partition of a row's keys: a row over more than KEY_PART keys is attended one partition at a time, each
 * with its own online-softmax state from empty, and the states are merged in key order (merge_state). Every row
 * does this whatever its step holds, so that a decode step with few rows can give the partitions of one row to
 * different threads (slabserve_slab_attention_f32) and still produce the bits a prefill chunk gives for the same
 * row. A multiple of KEY_BLOCK, so the partitions cut the blocks at the offsets every row uses. */
#define KEY_PART 512
/* Floats of partial states (m, l and head_dim accumulators per row, head and partition) the calling thread keeps
 * on its stack for a split step: 128 KB, SmolLM2's 9 heads at 8,192 keys for up to 3 rows. */
#define SPLIT_FLOATS 32768

/* Merges an online-softmax state b (max mb, sum lb, accumulator accb) into a (a's max -INFINITY: empty, b copied);
 * the one way states are combined, so a row's bits do not depend on which thread computed which partition. */
static inline void merge_state(int D, float *ma, float *la, float *acca, float mb, float lb, const float *accb) {
    if (mb == -INFINITY) return;
    if (*ma == -INFINITY) {
        *ma = mb;
        *la = lb;
        memcpy(acca, accb, (size_t)D * sizeof(float));
        return;
    }
    float mx = *ma > mb ? *ma : mb, ca = expf(*ma - mx), cb = expf(mb - mx);
    *la = *la * ca + lb * cb;
    for (int d = 0; d < D; d++) acca[d] = acca[d] * ca + accb[d] * cb;
    *ma = mx;
}

/* At the block starting at key `start`, the first of a partition: for each row with keys there (row r sees n0 + r),
 * merges the state of the partition before into the merged state (mm, ml, macc) and starts the new one empty. Out
 * of line, so the block loop's code stays as it was without partitions. */
static __attribute__((noinline)) void next_partition(int R, int G, int D, int64_t n0, int64_t start, float *m,
                                                     float *l, float *acc, float *mm, float *ml, float *macc) {
    for (int r = 0; r < R; r++) {
        if (start >= n0 + r) continue;
        for (int h = 0; h < G; h++) {
            int i = r * G + h;
            merge_state(D, &mm[i], &ml[i], macc + (size_t)i * D, m[i], l[i], acc + (size_t)i * D);
            m[i] = -INFINITY;
            l[i] = 0.0f;
            memset(acc + (size_t)i * D, 0, (size_t)D * sizeof(float));
        }
    }
}

/* `R` consecutive query rows of one sequence, each with its G heads (row r: G rows of D at q + r * ldq), over
 * the keys starting at element `first` of v (row stride ldkv elements, of `kind`) and at the same cache row and kv
 * head in k's tiles (KV_TILE): row r sees n0 + r keys. Each
 * block of KEY_BLOCK keys is loaded once for all R rows and G heads while it sits in L1, and every row takes the
 * blocks at the same key offsets (0, 64, 128, ...) in the same order with the same code, its partitions of KEY_PART
 * keys each from an empty state, merged in order, whatever R is and whichever row of its chunk it is: a row's result
 * depends only on its query and its keys, never on how the prompt was cut into chunks or what else shares the step
 * (the exactness prefix reuse relies on).
 *
 * With `part` NULL: every partition, merged, normalized into out (row r, head h at out + r * ldo + h * D). Else only
 * the keys of partition `p`, and the unnormalized state of each row and head goes to part + r * pstride + h * (D + 2)
 * (m, l, then D accumulators; m = -INFINITY for a row with no key there), for the caller to merge. */
static inline __attribute__((always_inline)) void attend_rows_kind(int R, int G, int D, const float *q, int64_t ldq,
                                                                   const void *k, const void *v, int64_t first,
                                                                   int64_t ldkv, int64_t n0, float scale,
                                                                   float *out, int64_t ldo, int kind, int64_t p,
                                                                   float *part, int64_t pstride) {
    float acc[TILE_FLOATS], m[MAX_ROW_TILE * MAX_GROUP], l[MAX_ROW_TILE * MAX_GROUP], sc[MAX_GROUP * KEY_BLOCK];
    float macc[TILE_FLOATS], mm[MAX_ROW_TILE * MAX_GROUP], ml[MAX_ROW_TILE * MAX_GROUP];  /* merged partitions */
    char kt[4 * MAX_HEAD_DIM * KV_TILE * sizeof(float)] __attribute__((aligned(64)));  /* keys off a tile's start */
    const void *tiles[4];
    size_t item = kind == KV_F32 ? 4 : 2;
    int64_t row0 = first / ldkv, goff = first % ldkv;  /* the slab's first cache row; the kv head's first element */
    for (int i = 0; i < R * G; i++) {
        m[i] = mm[i] = -INFINITY;
        l[i] = ml[i] = 0.0f;
    }
    memset(acc, 0, (size_t)R * G * D * sizeof(float));
    int64_t n_last = n0 + R - 1;
    int64_t lo = part ? p * KEY_PART : 0, hi = part ? (p + 1) * KEY_PART : n_last;
    if (hi > n_last) hi = n_last;
    for (int64_t start = lo; start < hi; start += KEY_BLOCK) {
        const char *vb = (const char *)v + (first + start * ldkv) * item;
        int64_t left = hi - start - KEY_BLOCK;  /* keys past this block: the next block's are asked for */
        block_tiles((const char *)k, row0 + start, goff, ldkv, D, left > 0 ? KEY_BLOCK : (int)(hi - start), item,
                    kt, tiles);
        if (left > 0)  /* the next block's key vectors, each D x 16 elements in one run */
            for (int64_t j = 0; j < left && j < KEY_BLOCK; j += 16)
                prefetch_l2((const char *)k + k_tile_index(row0 + start + KEY_BLOCK + j, goff, ldkv) * item,
                            (size_t)D * KV_TILE * item);
        if (!part && start > 0 && start % KEY_PART == 0)  /* a new partition: merge the last, start empty */
            next_partition(R, G, D, n0, start, m, l, acc, mm, ml, macc);
        for (int r = 0; r < R; r++) {
            int64_t n = n0 + r;
            if (start >= n) continue;
            int len = n - start < KEY_BLOCK ? (int)(n - start) : KEY_BLOCK;
            group_scores(G, D, q + r * ldq, tiles, len, scale, sc, kind);
            if (left > 0 && r == 0) prefetch_next_block(vb, left, ldkv, D, item);
            for (int h = 0; h < G; h++) {
                int i = r * G + h;
                block_softmax(D, sc + h * KEY_BLOCK, len, &m[i], &l[i], acc + (size_t)i * D);
            }
            group_values(G, D, sc, vb, ldkv, len, acc + (size_t)r * G * D, kind);
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < G; h++) {
            int i = r * G + h;
            if (part) {
                float *st = part + r * pstride + h * (D + 2);
                st[0] = m[i];
                st[1] = l[i];
                memcpy(st + 2, acc + (size_t)i * D, (size_t)D * sizeof(float));
                continue;
            }
            const float *final = acc + (size_t)i * D;  /* one partition: its state is the row's (merging into an
                                                        * empty state would copy it) */
            if (mm[i] != -INFINITY) {
                merge_state(D, &mm[i], &ml[i], macc + (size_t)i * D, m[i], l[i], final);
                final = macc + (size_t)i * D;
                l[i] = ml[i];
            }
            float inv = 1.0f / l[i];
            for (int d = 0; d < D; d++) out[r * ldo + h * D + d] = final[d] * inv;
        }
}

/* attend_rows_kind with `kind` a constant in each branch, so each gets its own loads inlined. */
static void attend_rows(int R, int G, int D, const float *q, int64_t ldq, const void *k, const void *v,
                        int64_t first, int64_t ldkv, int64_t n0, float scale, float *out, int64_t ldo, int kind,
                        int64_t p, float *part, int64_t pstride) {
    if (kind == KV_BF16)
        attend_rows_kind(R, G, D, q, ldq, k, v, first, ldkv, n0, scale, out, ldo, KV_BF16, p, part, pstride);
    else if (kind == KV_F16)
        attend_rows_kind(R, G, D, q, ldq, k, v, first, ldkv, n0, scale, out, ldo, KV_F16, p, part, pstride);
    else attend_rows_kind(R, G, D, q, ldq, k, v, first, ldkv, n0, scale, out, ldo, KV_F32, p, part, pstride);
}

/* The sequence owning flat row `row` (query_start ascending, row < query_start[num_seqs]). */
static int64_t seq_of_row(const int32_t *query_start, int64_t num_seqs, int64_t row) {
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {  /* the last s with query_start[s] <= row; empty sequences before it are skipped */
        int64_t mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= row) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* slabserve_slab_attention_f32's split step: tasks of (kv head, tile, key partition), each writing its rows'
 * partial states into `states` on this thread's stack, then each row and head merged in partition order and
 * normalized into out. Its own function, so that the stack it takes is taken only by the steps that split. */
static __attribute__((noinline)) void attend_split(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                                   int64_t group, int64_t head_dim, const float *q, int64_t ldq,
                                                   const void *k_cache, const void *v_cache,
                                                   const int32_t *query_start, const int64_t *slab_offset,
                                                   const int32_t *context_len, float scale, float *out, int64_t ldo,
                                                   int64_t kv_kind, int64_t ldkv, int64_t row_tile, int64_t tiles,
                                                   int64_t parts, int64_t real_rows, int64_t pstride) {
    float states[SPLIT_FLOATS];
    int64_t first_row = query_start[0];
    #pragma omp parallel
    {
        #pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t g = 0; g < num_kv_heads; g++)
            for (int64_t t = 0; t < tiles; t++)
                for (int64_t p = 0; p < parts; p++) {
                    int64_t r = first_row + t * row_tile, r_end = r + row_tile;
                    if (r_end > query_start[num_seqs]) r_end = query_start[num_seqs];
                    int64_t s = seq_of_row(query_start, num_seqs, r);
                    while (r < r_end) {
                        while (query_start[s + 1] <= r) s++;
                        int64_t begin = query_start[s], rows = query_start[s + 1] - begin;
                        int64_t context = context_len[s];
                        int64_t run_end = query_start[s + 1] < r_end ? query_start[s + 1] : r_end;
                        if (context >= rows)
                            attend_rows((int)(run_end - r), (int)group, (int)head_dim,
                                        q + r * ldq + g * group * head_dim, ldq, k_cache, v_cache,
                                        slab_offset[s] * ldkv + g * head_dim, ldkv,
                                        context - rows + (r - begin) + 1, scale, NULL, 0, (int)kv_kind, p,
                                        states + (p * real_rows + r - first_row) * pstride
                                            + g * group * (head_dim + 2), pstride);
                        r = run_end;
                    }
                }
        #pragma omp for collapse(2) schedule(static)
        for (int64_t r = first_row; r < query_start[num_seqs]; r++)
            for (int64_t h = 0; h < num_heads; h++) {
                int64_t s = seq_of_row(query_start, num_seqs, r);
                if (context_len[s] < query_start[s + 1] - query_start[s]) continue;  /* zeroed above */
                float m = -INFINITY, l = 0.0f, *o = out + r * ldo + h * head_dim;
                for (int64_t p = 0; p < parts; p++) {
                    const float *st = states + (p * real_rows + r - first_row) * pstride + h * (head_dim + 2);
                    merge_state((int)head_dim, &m, &l, o, st[0], st[1], st + 2);
                }
                float inv = 1.0f / l;
                for (int64_t d = 0; d < head_dim; d++) o[d] = o[d] * inv;
            }
    }
}

/* Attends every sequence that has at least as many keys as rows (decode rows and prefill chunks of any length),
 * and zeroes the rows that see no key (those of sequences with fewer keys than rows, and the padding rows from
 * query_start[num_seqs] to num_rows). The work is split into tasks of up to `row_tile` flat rows per kv head, so
 * a long chunk spreads over every thread, and when that gives fewer than two tasks a thread, further by key
 * partition (attend_split). Returns 0; or, having done nothing, -1 when the head layout is beyond
 * this kernel and -2 when the metadata points outside the rows of q or past the caches' cache_rows. */
int slabserve_slab_attention_f32(int64_t num_rows, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t cache_rows, const float *q, int64_t ldq,
                                 const void *k_cache,
                                 const void *v_cache, const int32_t *query_start, const int64_t *slab_offset,
                                 const int32_t *context_len, float scale, float *out, int64_t kv_kind) {
    int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (group < 1 || group > MAX_GROUP || num_heads % num_kv_heads || head_dim % 8 || head_dim > MAX_HEAD_DIM
        || cache_rows % KV_TILE)
        return -1;
    int64_t ldkv = num_kv_heads * head_dim, ldo = num_heads * head_dim;
    if (query_start[0] < 0 || query_start[num_seqs] > num_rows) return -2;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t rows = query_start[s + 1] - query_start[s];
        if (rows < 0) return -2;
        if (rows >= 1 && context_len[s] >= rows
            && (slab_offset[s] < 0 || slab_offset[s] + context_len[s] > cache_rows))
            return -2;
    }
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t rows = query_start[s + 1] - query_start[s];
        if (rows >= 1 && context_len[s] < rows)
            memset(out + query_start[s] * ldo, 0, rows * ldo * sizeof(float));
    }
    int64_t real_rows = query_start[num_seqs] - query_start[0];
    if (query_start[num_seqs] < num_rows)
        memset(out + query_start[num_seqs] * ldo, 0, (num_rows - query_start[num_seqs]) * ldo * sizeof(float));
    int64_t row_tile = TILE_FLOATS / (group * head_dim);
    if (row_tile > MAX_ROW_TILE) row_tile = MAX_ROW_TILE;
    /* Rows of one sequence share each block of keys, so a tile's rows cost less together; but decode rows are
     * sequences of their own, and 16 of them in one tile made 3 tasks (SmolLM2's 3 kv heads) for 2 threads: one
     * waited a third of the step. Tiles small enough for TASKS_PER_THREAD tasks a thread, when there are rows for
     * them (16 decode rows at 3,000 keys: 3.5 against 4.6 ms on an AMD EPYC, with the prefetch above). */
    int64_t tiles_wanted = (TASKS_PER_THREAD * omp_get_max_threads() + num_kv_heads - 1) / num_kv_heads;
    if (real_rows < row_tile * tiles_wanted) row_tile = (real_rows + tiles_wanted - 1) / tiles_wanted;
    if (row_tile < 1) row_tile = 1;  /* no real rows: no tiles, and no division by zero below */
    int64_t tiles = (real_rows + row_tile - 1) / row_tile;
    /* Fewer than two tasks a thread (a decode step of one row: SmolLM2's 3 kv heads are 3 tasks for 2 threads, one
     * of which waits half the attention): the rows' key partitions become tasks of their own, their states kept
     * here and merged afterwards, which gives the bits the rows get unsplit (attend_rows_kind). Batch-1 decode after
     * a 3,000-token prompt went from 69-71 to 76-77 tok/s on an AMD EPYC; two rows (6 tasks, already even) ran 5%
     * slower split, so they are not. */
    int64_t parts = 1, threads = omp_get_max_threads();
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t rows = query_start[s + 1] - query_start[s], n = (context_len[s] + KEY_PART - 1) / KEY_PART;
        if (rows >= 1 && context_len[s] >= rows && n > parts) parts = n;
    }
    int64_t pstride = num_heads * (head_dim + 2);  /* a row's states in one partition */
    if (threads > 1 && parts > 1 && num_kv_heads * tiles < 2 * threads
        && parts * real_rows * pstride <= SPLIT_FLOATS) {
        attend_split(num_seqs, num_heads, num_kv_heads, group, head_dim, q, ldq, k_cache, v_cache, query_start,
                     slab_offset, context_len, scale, out, ldo, kv_kind, ldkv, row_tile, tiles, parts, real_rows,
                     pstride);
        return 0;
    }
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t g = 0; g < num_kv_heads; g++) {
        for (int64_t t = 0; t < tiles; t++) {
            int64_t r = query_start[0] + t * row_tile, r_end = r + row_tile;
            if (r_end > query_start[num_seqs]) r_end = query_start[num_seqs];
            int64_t s = seq_of_row(query_start, num_seqs, r);
            while (r < r_end) {  /* one run per sequence the tile touches */
                while (query_start[s + 1] <= r) s++;
                int64_t begin = query_start[s], rows = query_start[s + 1] - begin, context = context_len[s];
                int64_t run_end = query_start[s + 1] < r_end ? query_start[s + 1] : r_end;
                if (context >= rows) {
                    const float *qr = q + r * ldq + g * group * head_dim;
                    attend_rows((int)(run_end - r), (int)group, (int)head_dim, qr, ldq, k_cache, v_cache,
                                slab_offset[s] * ldkv + g * head_dim, ldkv, context - rows + (r - begin) + 1,
                                scale, out + r * ldo + g * group * head_dim, ldo, (int)kv_kind, 0, NULL, 0);
                }
                r = run_end;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ elementwise
 *
 * The small ops of a step, each one pass over its rows (threaded when there are enough of them), with the
 * references' numerics in fp32: RMSNorm's statistic summed in fp32 and applied as x * (1 / sqrt(mean + eps)) *
 * weight; SiLU as g / (1 + exp(-g)); RoPE in the neox "rotate_half" form. Row strides are in floats. */

#define ROWS_PER_THREAD 4

void slabserve_rms_norm_f32(int64_t T, int64_t N, const float *x, int64_t ldx, const float *w, float eps,
                            float *out, int64_t ldo, const int32_t *qs, int64_t n_qs) {
    T = live_rows(T, qs, n_qs, 0);
    #pragma omp parallel for schedule(static) if (T >= 2 * ROWS_PER_THREAD)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *o = out + t * ldo;
        __m256 sq = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            sq = _mm256_fmadd_ps(v, v, sq);
        }
        float sum = hsum256(sq);
        for (; i < N; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)N + eps);
        __m256 vinv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= N; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv),
                                                  _mm256_loadu_ps(w + i)));
        for (; i < N; i++) o[i] = xr[i] * inv * w[i];
    }
}

void slabserve_silu_mul_f32(int64_t T, int64_t I, const float *gate_up, int64_t ldg, float *out, int64_t ldo,
                            const int32_t *qs, int64_t n_qs) {
    T = live_rows(T, qs, n_qs, 0);
    #pragma omp parallel for schedule(static) if (T >= 2 * ROWS_PER_THREAD)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * ldg, *u = g + I;
        float *o = out + t * ldo;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate `heads` heads of D values in each of T rows (row stride ld) in place, row t at positions[t]. */
static void rotate_rows(int64_t T, int64_t heads, int64_t D, float *x, int64_t ld, const int64_t *positions,
                        const float *cos_sin) {
    int64_t half = D / 2;
    #pragma omp parallel for schedule(static) if (T >= 2 * ROWS_PER_THREAD)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * ld + h * D, *x2 = x1 + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(x1 + i, _mm256_fnmadd_ps(b, sv, _mm256_mul_ps(a, cv)));
                _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(a, sv, _mm256_mul_ps(b, cv)));
            }
            for (; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* Returns 0, or -1 (having done nothing) when a position lies outside the table's num_positions rows. */
int slabserve_rope_f32(int64_t T, int64_t H, int64_t Hkv, int64_t D, float *q, int64_t ldq, float *k, int64_t ldk,
                       const int64_t *positions, const float *cos_sin, int64_t num_positions) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    rotate_rows(T, H, D, q, ldq, positions, cos_sin);
    rotate_rows(T, Hkv, D, k, ldk, positions, cos_sin);
    return 0;
}

/* One KV element of `kind` from a float (torch's rounding: to nearest even). */
static inline void store_kv(void *cache, int64_t index, float x, int kind) {
    if (kind == KV_F32) ((float *)cache)[index] = x;
    else if (kind == KV_F16) ((uint16_t *)cache)[index] = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    else ((uint16_t *)cache)[index] = bf16_from_f32(x);
}

/* Row t of k and v (`width` floats each) into cache row slot_mapping[t], stored as the caches' `kv_kind`: v as a
 * row, k into its lane of the K cache's tiles (KV_TILE); a negative slot (-1: padding) skips the row. Returns 0, or
 * -1 (having written nothing) when a slot lies past the caches' num_slots rows. */
int slabserve_kv_write_f32(int64_t T, int64_t width, const float *k, int64_t ldk, const float *v, int64_t ldv,
                           void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t num_slots,
                           int64_t kv_kind) {
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] >= num_slots) return -1;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *ks = k + t * ldk, *vs = v + t * ldv;
        int64_t kbase = k_tile_index(slot, 0, width);
        for (int64_t i = 0; i < width; i++) store_kv(k_cache, kbase + i * KV_TILE, ks[i], (int)kv_kind);
        if (kv_kind == KV_F32) {
            memcpy((float *)v_cache + slot * width, vs, width * sizeof(float));
            continue;
        }
        uint16_t *vd = (uint16_t *)v_cache + slot * width;
        int64_t i = 0;
        if (kv_kind == KV_F16)
            for (; i + 8 <= width; i += 8)
                _mm_storeu_si128((__m128i *)(vd + i), _mm256_cvtps_ph(_mm256_loadu_ps(vs + i),
                                                                      _MM_FROUND_TO_NEAREST_INT));
        for (; i < width; i++) store_kv(v_cache, slot * width + i, vs[i], (int)kv_kind);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ GGUF blocks
 *
 * Weights kept in the GGUF file's own block formats (the plan's `weight_format: gguf`): a (N, K) projection is N rows
 * of K / block_size blocks each, as the file stores them (row n is output feature n). linear_q computes y (M, N)
 * = x (M, K) @ W^T (+ residual) with fp32 activations: each task dequantizes a group of rows into fp32 on its stack
 * and multiplies them by every row of x while they sit in L1/L2, so a prefill chunk dequantizes each row once, not
 * once per token; a lone row (decode) decodes each block in registers instead (gemv_blocks32), to the same values.
 * Those values are the `gguf` package's except that Q4_1's d * q + m and Q4_K's (d * sc) * q - dmin * m are one fused
 * multiply-add (within half an ulp of the weight; results stay within 1e-5 relative of the gguf package's
 * dequantization followed by an fp32 matmul); the embedding (embed_q) gives the package's values exactly. Row (i, n) of the result is one 8-lane FMA chain over k in order, summed across lanes the same way,
 * whatever M is and however the rows are tiled: a token's result never depends on the chunk or batch it sits in. */

enum { WT_F32 = 0, WT_F16 = 1, WT_Q4_0 = 2, WT_Q4_1 = 3, WT_Q8_0 = 8, WT_Q4_K = 12, WT_Q6_K = 14, WT_BF16 = 30 };

/* Every half-precision value as a float (256 KB, filled when the library loads): a block's scales are read with
 * two loads instead of an insert, a convert and a broadcast, which all compete for the shuffle port the nibble
 * lookups need. The values are exactly vcvtph2ps's. */
static float f16_table[1 << 16];

__attribute__((constructor)) static void fill_f16_table(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) f16_table[h] = _cvtsh_ss((uint16_t)h);
}

static inline __attribute__((always_inline)) float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_table[h];
}

/* 16 bytes of packed nibbles -> their 32 values in two 16-byte vectors: low nibbles (elements 0..15), high
 * nibbles (elements 16..31). */
static inline void nibbles(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    *lo = _mm_and_si128(q, mask);
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
}

/* 16 unsigned bytes -> two vectors of 8 floats (exact). */
static inline void u8x16_to_f32(__m128i b, __m256 *a, __m256 *c) {
    *a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    *c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}

/* 16 bytes of packed nibbles -> their 32 values minus 8 as signed bytes (Q4_0's q - 8, exact). */
static inline void nibbles_minus8(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    const __m128i eight = _mm_set1_epi8(8);
    nibbles(qs, lo, hi);
    *lo = _mm_sub_epi8(*lo, eight);
    *hi = _mm_sub_epi8(*hi, eight);
}

/* 16 signed bytes -> two vectors of 8 floats (exact). */
static inline void i8x16_to_f32(__m128i b, __m256 *a, __m256 *c) {
    *a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    *c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

/* a * b + c: the gguf package's two roundings when `exact`, else one fused multiply-add (what the matmul kernels
 * decode: within half an ulp of the exact weight, and one instruction instead of two in the innermost loop). */
static inline __attribute__((always_inline)) __m256 mul_add(int exact, __m256 a, __m256 b, __m256 c) {
    return exact ? _mm256_add_ps(_mm256_mul_ps(a, b), c) : _mm256_fmadd_ps(a, b, c);
}

/* The four 8-float vectors of one 32-weight block of Q4_0 (18 bytes: d, 16 bytes of nibbles; w = d * (q - 8)),
 * Q4_1 (20 bytes: d, m, nibbles; w = d * q + m, fused unless `exact`) or Q8_0 (34 bytes: d, 32 int8; w = d * q);
 * `type` and `exact` constants after inlining. */
static inline __attribute__((always_inline)) void block32(int type, const uint8_t *blk, __m256 v[4], int exact) {
    __m256 d = _mm256_set1_ps(f16_to_f32(blk));
    if (type == WT_Q8_0) {
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i)))), d);
        return;
    }
    __m128i lo, hi;
    if (type == WT_Q4_0) {
        nibbles_minus8(blk + 2, &lo, &hi);
        i8x16_to_f32(lo, &v[0], &v[1]);
        i8x16_to_f32(hi, &v[2], &v[3]);
        for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(d, v[i]);
        return;
    }
    __m256 m = _mm256_set1_ps(f16_to_f32(blk + 2));
    nibbles(blk + 4, &lo, &hi);
    u8x16_to_f32(lo, &v[0], &v[1]);
    u8x16_to_f32(hi, &v[2], &v[3]);
    for (int i = 0; i < 4; i++) v[i] = mul_add(exact, d, v[i], m);
}

/* One row of K weights of `type` (K a multiple of the type's block size) -> K floats: exactly the `gguf` package's
 * values when `exact` (the embedding), else the values the matmul kernels multiply (block32's: Q4_1 and Q4_K
 * weights as one fused multiply-add each; every other type is exact either way). */
static void dequant_row(int type, const uint8_t *src, int64_t K, float *dst, int exact) {
    if (type == WT_F32) {
        memcpy(dst, src, K * sizeof(float));
    } else if (type == WT_F16) {
        for (int64_t k = 0; k < K; k += 8)
            _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * k))));
    } else if (type == WT_BF16) {
        for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(dst + k, load_kv8(src, k, KV_BF16));
    } else if (type == WT_Q8_0) {  /* 34 bytes: d (f16), 32 int8; w = q * d */
        for (int64_t b = 0; b < K / 32; b++, src += 34, dst += 32) {
            __m256 d = _mm256_set1_ps(f16_to_f32(src));
            for (int i = 0; i < 32; i += 8) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(src + 2 + i));
                _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
    } else if (type == WT_Q4_0 || type == WT_Q4_1) {
        for (int64_t b = 0; b < K / 32; b++, dst += 32) {
            __m256 v[4];
            block32(type, src, v, exact);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 8 * i, v[i]);
            src += type == WT_Q4_0 ? 18 : 20;
        }
    } else if (type == WT_Q4_K) {
        /* 144 bytes per 256: d, dmin (f16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
         * nibbles: bytes 32j..32j+31 hold sub-block 2j (low nibbles) and 2j+1 (high). w = (d * sc) * q - dmin * m (fused: see mul_add) */
        for (int64_t b = 0; b < K / 256; b++, src += 144, dst += 256) {
            float d = f16_to_f32(src), dmin = f16_to_f32(src + 2);
            const uint8_t *s = src + 4, *qs = src + 16;
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                if (j < 4) {
                    sc = s[j] & 0x3F;
                    mn = s[j + 4] & 0x3F;
                } else {
                    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
                    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
                }
                __m256 ds = _mm256_set1_ps(d * (float)sc), dm = _mm256_set1_ps(-(dmin * (float)mn));
                const uint8_t *q = qs + 32 * (j / 2);
                int shift = 4 * (j % 2);
                for (int i = 0; i < 32; i += 8) {
                    __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + i));
                    __m256i v = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(bytes), shift),
                                                 _mm256_set1_epi32(0x0F));
                    _mm256_storeu_ps(dst + 32 * j + i, mul_add(exact, ds, _mm256_cvtepi32_ps(v), dm));
                }
            }
        }
    } else if (type == WT_Q6_K) {
        /* 210 bytes per 256: ql (128: low 4 bits), qh (64: high 2 bits), 16 int8 scales, d (f16). Element
         * 128h + 32s + l (h < 2, s < 4, l < 32): low bits in nibble s / 2 of ql[64h + 32(s % 2) + l], high bits
         * at bit 2s of qh[32h + l]; w = (d * scale[element / 16]) * (q - 32) */
        for (int64_t b = 0; b < K / 256; b++, src += 210, dst += 256) {
            const uint8_t *ql = src, *qh = src + 128;
            const int8_t *sc = (const int8_t *)(src + 192);
            float d = f16_to_f32(src + 208);
            const __m256 bias = _mm256_set1_ps(32.0f);
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++)
                    for (int l = 0; l < 32; l += 8) {
                        int e = 128 * h + 32 * s + l;
                        __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 64 * h + 32 * (s % 2) + l)));
                        __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + 32 * h + l)));
                        lo = _mm256_and_si256(_mm256_srli_epi32(lo, 4 * (s / 2)), _mm256_set1_epi32(0x0F));
                        hi = _mm256_and_si256(_mm256_srli_epi32(hi, 2 * s), _mm256_set1_epi32(0x03));
                        __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4))), bias);
                        _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_set1_ps(d * (float)sc[e / 16]), q));
                    }
        }
    }
}

/* Bytes of one row of K weights of `type`; 0 for a type this file does not read or a K its blocks do not divide. */
int64_t slabserve_quant_row_bytes(int64_t type, int64_t K) {
    switch (type) {
        case WT_F32: return K % 8 ? 0 : 4 * K;
        case WT_F16: case WT_BF16: return K % 8 ? 0 : 2 * K;
        case WT_Q8_0: return K % 32 ? 0 : K / 32 * 34;
        case WT_Q4_0: return K % 32 ? 0 : K / 32 * 18;
        case WT_Q4_1: return K % 32 ? 0 : K / 32 * 20;
        case WT_Q4_K: return K % 256 ? 0 : K / 256 * 144;
        case WT_Q6_K: return K % 256 ? 0 : K / 256 * 210;
        default: return 0;
    }
}

/* The dot products below run in the widest vectors the build has: 16 lanes where it is compiled for AVX-512 (the
 * library cpu_native.py loads on a CPU with AVX-512 F/BW/VL), else 8. Within one build every product takes the same
 * lanes in the same order, whichever kernel computes it. */
#ifdef __AVX512F__
typedef __m512 vf;
#define VL 16
static inline __attribute__((always_inline)) vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
/* The last 8 floats of a row of K = 8 mod 16, zero-filled to 16 lanes: they add exact zeros to lanes 8..15. */
static inline __attribute__((always_inline)) vf vf_load8(const float *p) { return _mm512_maskz_loadu_ps(0x00FF, p); }
static inline __attribute__((always_inline)) vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf vf_set1(float f) { return _mm512_set1_ps(f); }
static inline __attribute__((always_inline)) vf vf_i32(__m512i v) { return _mm512_cvtepi32_ps(v); }
static inline __attribute__((always_inline)) float vf_sum(vf v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
/* A block of 32 weights as 2 vectors: elements 0..15, 16..31. */
static inline __attribute__((always_inline)) void block32v(int type, const uint8_t *blk, vf v[2]) {
    vf d = vf_set1(f16_to_f32(blk));
    if (type == WT_Q8_0) {
        for (int i = 0; i < 2; i++)
            v[i] = vf_mul(vf_i32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * i)))), d);
        return;
    }
    /* 4-bit blocks: the block's 16 possible weights as a table (one multiply or fused multiply-add for 16 values,
     * the same values block32 computes per weight), looked up by each nibble (vpermps reads an index's low 4 bits):
     * a widen, a shift and two lookups per 32 weights instead of a widen, a convert and a multiply per 16. */
    const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (type == WT_Q4_1 ? 4 : 2))));
    vf table;
    if (type == WT_Q4_0) {
        table = vf_mul(d, _mm512_sub_ps(iota, vf_set1(8.0f)));
    } else {
        table = vf_fma(d, iota, vf_set1(f16_to_f32(blk + 2)));
    }
    v[0] = _mm512_permutexvar_ps(q, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}
#define GEMV_ROWS 8  /* weight rows per pass of gemv_blocks32: 8 accumulators, of 32 registers */
#define FEW_ROWS 4   /* rows of x that gemm_few_blocks32 takes: 4 x 4 accumulators, 8 x vectors, of 32 registers */
#define TILE_M 6     /* rows of x per dot_tile: 6 x 4 accumulators, of 32 registers */
#else
typedef __m256 vf;
#define VL 8
static inline __attribute__((always_inline)) vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) vf vf_load8(const float *p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline __attribute__((always_inline)) vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) float vf_sum(vf v) { return hsum256(v); }
static inline __attribute__((always_inline)) void block32v(int type, const uint8_t *blk, vf v[4]) {
    block32(type, blk, v, 0);
}
#define GEMV_ROWS 4  /* 8 rows spill the 16 ymm registers */
#define FEW_ROWS 2   /* rows of x that gemm_few_blocks32 takes: 2 x 2 accumulators, 8 x vectors, of 16 registers */
#define TILE_M 3     /* rows of x per dot_tile: 3 x 4 accumulators, of 16 registers */
#endif

#ifdef __AVX512F__
/* out[t] = vf_sum(v[t]) for t < n (1..16), bit for bit, in one tree over all of them: vf_sum adds lanes l and l + 8,
 * then l and l + 4, l and l + 2, l and l + 1; here each level adds the same pairs of lanes for several vectors at
 * once (shuffles bring the two halves of each vector side by side), so 16 sums cost 15 adds and 31 shuffles instead
 * of 16 x 8 instructions. A batch of 32 rows spends a tenth of its block-path time summing lanes at K = 576. */
static inline __attribute__((always_inline)) void vf_sums16(const vf *v, int n, float *out) {
    vf a[16], b[8], c[4], d[2];
    for (int t = 0; t < 16; t++) a[t] = t < n ? v[t] : _mm512_setzero_ps();
    /* b[p]: a[2p]'s lanes l + (l + 8) in lanes 0..7, a[2p + 1]'s in 8..15 */
    for (int p = 0; p < 8; p++)
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    /* c[p]: 128-bit lane L holds a[4p + L]'s four partial sums, l + (l + 4) */
    for (int p = 0; p < 4; p++)
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
    /* d[p]: lane L holds two partial sums (l + (l + 2)) of a[8p + L], then two of a[8p + 4 + L] */
    for (int p = 0; p < 2; p++)
        d[p] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0xEE));
    /* element 4L + e: the sum of a[4e + L]; put back in order */
    vf r = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    r = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), r);
}
#endif

/* out[t] = vf_sum(v[t]) for t < n, bit for bit. */
static inline __attribute__((always_inline)) void vf_sums(const vf *v, int n, float *out) {
#ifdef __AVX512F__
    for (int t = 0; t < n; t += 16) vf_sums16(v + t, n - t < 16 ? n - t : 16, out + t);
#else
    for (int t = 0; t < n; t++) out[t] = vf_sum(v[t]);
#endif
}

/* y[i * ldy + j] = vf_sum(acc[i * nr + j]) (+ r[i * ldr + j]) for an mr x nr tile of accumulators, the lanes
 * summed by vf_sums. */
static inline __attribute__((always_inline)) void store_sums(const vf *acc, int mr, int nr, float *y, int64_t ldy,
                                                             const float *r, int64_t ldr) {
    float sums[TILE_M * 8];
    vf_sums(acc, mr * nr, sums);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = r ? sums[i * nr + j] + r[i * ldr + j] : sums[i * nr + j];
}

/* One row of K weights of `type` -> the K floats the matmul kernels multiply (dequant_row's, not exact). The 32-weight
 * blocks go through block32v, the in-register decoding of the one-row kernels: on the AVX-512 build 16 lanes and a
 * table lookup per 16 weights rather than dequant_row's 8 lanes and a convert and FMA per 8, the same values (each
 * weight is fma(d, q, m) or q * d either way). */
static void dequant_row_matmul(int type, const uint8_t *src, int64_t K, float *dst) {
#ifdef __AVX512F__
    if (type == WT_Q4_0 || type == WT_Q4_1 || type == WT_Q8_0) {
        int bb = type == WT_Q8_0 ? 34 : type == WT_Q4_1 ? 20 : 18;
        for (int64_t b = 0; b < K / 32; b++, src += bb, dst += 32) {
            vf v[32 / VL];
            if (type == WT_Q4_0) block32v(WT_Q4_0, src, v);
            else if (type == WT_Q4_1) block32v(WT_Q4_1, src, v);
            else block32v(WT_Q8_0, src, v);
            for (int i = 0; i < 32 / VL; i++) _mm512_storeu_ps(dst + VL * i, v[i]);
        }
        return;
    }
#endif
    dequant_row(type, src, K, dst, 0);
}

/* Weight rows ahead that the block kernels prefetch: while a task multiplies rows n..n+7 it asks for the bytes of rows
 * n+16.., at the same block. A decode step streams ~100 MB of blocks that no cache holds between steps, and the
 * hardware prefetcher alone leaves the kernels waiting on memory at half the bandwidth (batch 1: 5.6 ms of SmolLM2's
 * projections and head at 17 GB/s; with this, 3.0 ms at 32 GB/s). A prefetch past the last row is a hint that
 * cannot fault. One row of x (gemv_blocks32) prefetches into L2 only (PF_LONE): on an AMD EPYC (Zen 4) prefetches
 * into L1 held its few fill buffers and SmolLM2's batch-1 projections and head streamed at 18-19 GB/s, against
 * 22.5 (projections, then bound by the lookups) and 35 GB/s (the Q8_0 head) into L2. The scratch path (more than
 * FEW_ROWS rows of x) prefetches whole rows into L2 too, at every batch: at 32 rows its steps had waited on the
 * rows they dequantize (4-6% faster with, where prefetching into L1 had been 5% slower); 6 to 256 rows as fast or
 * faster. The few-rows kernels, bound by arithmetic, keep L1 (as good as or 2-5% better than L2). */
#define PF_ROWS 16
#define PF_LONE _MM_HINT_T1

/* `mr` rows of x (1..TILE_M) times `nr` dequantized rows of w (1..8 when mr is 1, else 1..4), each (i, j) one VL-lane
 * FMA chain over k in order then summed across lanes by vf_sum: the arithmetic of a result never depends on the
 * tile it is computed in. K is a multiple of 8. */
static inline __attribute__((always_inline)) void dot_tile(int mr, int nr, int64_t K, const float *x, int64_t ldx,
                                                           const float *w, float *y, int64_t ldy,
                                                           const float *r, int64_t ldr) {
    vf c[TILE_M][8];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) c[i][j] = vf_zero();
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf a[TILE_M];
        for (int i = 0; i < mr; i++) a[i] = vf_load(x + i * ldx + k);
        for (int j = 0; j < nr; j++) {
            vf b = vf_load(w + j * K + k);
            for (int i = 0; i < mr; i++) c[i][j] = vf_fma(a[i], b, c[i][j]);
        }
    }
    if (k < K) {  /* AVX-512 only: 8 floats left */
        vf a[TILE_M];
        for (int i = 0; i < mr; i++) a[i] = vf_load8(x + i * ldx + k);
        for (int j = 0; j < nr; j++) {
            vf b = vf_load8(w + j * K + k);
            for (int i = 0; i < mr; i++) c[i][j] = vf_fma(a[i], b, c[i][j]);
        }
    }
    vf flat[TILE_M * 8];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) flat[i * nr + j] = c[i][j];
    store_sums(flat, mr, nr, y, ldy, r, ldr);
}

/* One row of x times `nr` (<= GEMV_ROWS) rows of 32-weight blocks, dequantized in registers: each (row, n) is the
 * VL-lane FMA chain over k in order of dot_tile, on the values dequant_row gives, so the result is the same bits the
 * scratch path computes for the same row in any batch. */
static inline __attribute__((always_inline)) void gemv_blocks32(int type, int nr, int64_t K, const float *x,
                                                                const uint8_t *w, int64_t row_bytes, float *y,
                                                                const float *r) {
    int bb = type == WT_Q8_0 ? 34 : type == WT_Q4_1 ? 20 : 18;
    vf acc[GEMV_ROWS];
    for (int j = 0; j < nr; j++) acc[j] = vf_zero();
    for (int64_t b = 0; b < K / 32; b++) {
        vf xv[32 / VL];
        for (int i = 0; i < 32 / VL; i++) xv[i] = vf_load(x + 32 * b + VL * i);
        for (int j = 0; j < nr; j++) {
            vf v[32 / VL];
            _mm_prefetch((const char *)(w + (PF_ROWS + j) * row_bytes + b * bb), PF_LONE);
            block32v(type, w + j * row_bytes + b * bb, v);
            for (int i = 0; i < 32 / VL; i++) acc[j] = vf_fma(xv[i], v[i], acc[j]);
        }
    }
    for (int j = 0; j < nr; j++) {  /* lane by lane: vf_sums' tree made batch 1 6-8% slower (Zen 4) */
        float s = vf_sum(acc[j]);
        y[j] = r ? s + r[j] : s;
    }
}

/* `mr` (<= FEW_ROWS) rows of x times `nr` (<= FEW_ROWS) rows of 32-weight blocks, each block dequantized in registers
 * once for all mr rows: each (row, n) is gemv_blocks32's chain (dot_tile's), so the same bits as one row alone. */
static inline __attribute__((always_inline)) void gemm_few_blocks32(int type, int mr, int nr, int64_t K,
                                                                    const float *x, int64_t ldx, const uint8_t *w,
                                                                    int64_t row_bytes, float *y, int64_t ldy,
                                                                    const float *r, int64_t ldr) {
    int bb = type == WT_Q8_0 ? 34 : type == WT_Q4_1 ? 20 : 18;
    vf acc[FEW_ROWS][FEW_ROWS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = vf_zero();
    for (int64_t b = 0; b < K / 32; b++) {
        vf xv[FEW_ROWS][32 / VL];
        for (int i = 0; i < mr; i++)
            for (int t = 0; t < 32 / VL; t++) xv[i][t] = vf_load(x + i * ldx + 32 * b + VL * t);
        for (int j = 0; j < nr; j++) {
            vf v[32 / VL];
            _mm_prefetch((const char *)(w + (PF_ROWS + j) * row_bytes + b * bb), _MM_HINT_T0);
            block32v(type, w + j * row_bytes + b * bb, v);
            for (int i = 0; i < mr; i++)
                for (int t = 0; t < 32 / VL; t++) acc[i][j] = vf_fma(xv[i][t], v[t], acc[i][j]);
        }
    }
    vf flat[FEW_ROWS * FEW_ROWS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) flat[i * nr + j] = acc[i][j];
    store_sums(flat, mr, nr, y, ldy, r, ldr);
}

/* `M` (1..FEW_ROWS) rows of x times `nr` rows of 32-weight blocks of `type` (Q4_0, Q4_1, Q8_0), dequantized in
 * registers: one row through gemv_blocks32, a few through gemm_few_blocks32; no scratch, and the bits the scratch
 * path gives. */
static void few_rows_blocks32(int type, int64_t M, int nr, int64_t K, const float *x, int64_t ldx,
                              const uint8_t *w, int64_t row_bytes, float *y, int64_t ldy, const float *r,
                              int64_t ldr) {
#define FEW_CASE(T)                                                                                             \
    if (type == T) {                                                                                            \
        int j = 0;                                                                                              \
        if (M == 1) {                                                                                           \
            for (; j + GEMV_ROWS <= nr; j += GEMV_ROWS)                                                         \
                gemv_blocks32(T, GEMV_ROWS, K, x, w + j * row_bytes, row_bytes, y + j, r ? r + j : NULL);       \
            for (; j < nr; j++) gemv_blocks32(T, 1, K, x, w + j * row_bytes, row_bytes, y + j, r ? r + j : NULL); \
            return;                                                                                             \
        }                                                                                                       \
        for (; j + FEW_ROWS <= nr; j += FEW_ROWS)                                                               \
            gemm_few_blocks32(T, (int)M, FEW_ROWS, K, x, ldx, w + j * row_bytes, row_bytes, y + j, ldy,         \
                              r ? r + j : NULL, ldr);                                                           \
        for (; j < nr; j++)                                                                                     \
            gemm_few_blocks32(T, (int)M, 1, K, x, ldx, w + j * row_bytes, row_bytes, y + j, ldy,                \
                              r ? r + j : NULL, ldr);                                                           \
        return;                                                                                                 \
    }
    FEW_CASE(WT_Q4_0)
    FEW_CASE(WT_Q4_1)
    FEW_CASE(WT_Q8_0)
#undef FEW_CASE
}

#define QROWS 8  /* weight rows a task dequantizes and multiplies at once */

/* All M rows of x times `nr` (<= QROWS) dequantized rows: lone rows take eight weight rows per pass, more rows
 * take tiles of three x rows by four weight rows. */
static void rows_times_dequantized(int64_t M, int nr, int64_t K, const float *x, int64_t ldx, const float *w,
                                   float *y, int64_t ldy, const float *r, int64_t ldr) {
    if (M == 1) {
        switch (nr) {
            case 8: dot_tile(1, 8, K, x, ldx, w, y, ldy, r, ldr); return;
            default:
                for (int j = 0; j < nr; j += 4) {
                    int n = nr - j < 4 ? nr - j : 4;
                    const float *rj = r ? r + j : NULL;
                    if (n == 4) dot_tile(1, 4, K, x, ldx, w + j * K, y + j, ldy, rj, ldr);
                    else for (int t = 0; t < n; t++) dot_tile(1, 1, K, x, ldx, w + (j + t) * K, y + j + t, ldy,
                                                              rj ? rj + t : NULL, ldr);
                }
                return;
        }
    }
    for (int j = 0; j < nr; j += 4) {
        int n = nr - j < 4 ? nr - j : 4;
        for (int64_t m = 0, mr; m < M; m += mr) {
            mr = M - m >= TILE_M ? TILE_M : M - m >= 3 ? 3 : (int)(M - m);  /* a tail of 4 or 5 rows: 3, then 1-2 */
            const float *xm = x + m * ldx, *rm = r ? r + m * ldr + j : NULL;
            float *ym = y + m * ldy + j;
            const float *wj = w + j * K;
            if (mr == TILE_M && n == 4) dot_tile(TILE_M, 4, K, xm, ldx, wj, ym, ldy, rm, ldr);
#if TILE_M > 3
            else if (mr == 3 && n == 4) dot_tile(3, 4, K, xm, ldx, wj, ym, ldy, rm, ldr);
#endif
            else if (mr == 2 && n == 4) dot_tile(2, 4, K, xm, ldx, wj, ym, ldy, rm, ldr);
            else if (mr == 1 && n == 4) dot_tile(1, 4, K, xm, ldx, wj, ym, ldy, rm, ldr);
            else
                for (int i = 0; i < mr; i++)
                    for (int t = 0; t < n; t++)
                        dot_tile(1, 1, K, xm + i * ldx, ldx, wj + t * K, ym + i * ldy + t, ldy,
                                 rm ? rm + i * ldr + t : NULL, ldr);
        }
    }
}

/* y (M, N) = x (M, K) @ W^T (+ residual), W N rows of `row_bytes` bytes of `type` blocks. Returns 0, or -1 (having
 * done nothing) when `type` and K do not give `row_bytes` or K is beyond the stack scratch (MAX_QUANT_K). */
#define MAX_QUANT_K 65536
#define QSCRATCH_FLOATS 65536  /* 256 KB of stack per task at most: QROWS rows up to K = 8192, fewer beyond */
int slabserve_linear_q(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const uint8_t *w,
                       int64_t row_bytes, int64_t type, float *y, int64_t ldy, const float *residual, int64_t ldr,
                       const int32_t *qs, int64_t n_qs, int64_t per_seq) {
    if (K <= 0 || K > MAX_QUANT_K || slabserve_quant_row_bytes(type, K) != row_bytes) return -1;
    M = live_rows(M, qs, n_qs, per_seq);
    if (M <= 0 || N <= 0) return 0;
    int64_t rows = QSCRATCH_FLOATS / K < QROWS ? QSCRATCH_FLOATS / K : QROWS;
    int64_t groups = (N + rows - 1) / rows;
    #pragma omp parallel for schedule(static) if (groups > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * rows;
        int nr = N - n0 < rows ? (int)(N - n0) : (int)rows;
        if (M <= FEW_ROWS && (type == WT_Q4_0 || type == WT_Q4_1 || type == WT_Q8_0)) {  /* no scratch: same bits */
            few_rows_blocks32((int)type, M, nr, K, x, ldx, w + n0 * row_bytes, row_bytes, y + n0, ldy,
                              residual ? residual + n0 : NULL, ldr);
            continue;
        }
        float buf[rows * K];
        for (int j = 0; j < nr; j++) {
            prefetch_l2(w + (n0 + PF_ROWS + j) * row_bytes, (size_t)row_bytes);
            dequant_row_matmul((int)type, w + (n0 + j) * row_bytes, K, buf + j * K);
        }
        rows_times_dequantized(M, nr, K, x, ldx, buf, y + n0, ldy, residual ? residual + n0 : NULL, ldr);
    }
    return 0;
}

/* out[t] = row ids[t] of W (V rows of `row_bytes` bytes of `type`), dequantized. Returns 0; -1 (having written
 * nothing) when an id lies outside [0, V) or the row size does not match. */
int slabserve_embed_q(int64_t T, const int64_t *ids, int64_t V, int64_t K, const uint8_t *w, int64_t row_bytes,
                      int64_t type, float *out, int64_t ldo) {
    if (slabserve_quant_row_bytes(type, K) != row_bytes) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= V) return -1;
    #pragma omp parallel for schedule(static) if (T >= 2 * ROWS_PER_THREAD)
    for (int64_t t = 0; t < T; t++) dequant_row((int)type, w + ids[t] * row_bytes, K, out + t * ldo, 1);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- a step's calls */

/* The functions slabserve_run_calls dispatches to; cpu_native.py numbers them in the same order (_CALL_OPS). */
enum { OP_LINEAR_F32 = 1, OP_SLAB_ATTENTION = 2, OP_RMS_NORM = 3, OP_SILU_MUL = 4, OP_ROPE = 5, OP_KV_WRITE = 6,
       OP_LINEAR_Q = 7, OP_EMBED_Q = 8 };
#define CALL_SLOTS 20  /* int64 slots a call takes: its op, then its arguments in order (a float in the low 32 bits) */

static inline float slot_float(int64_t s) {
    uint32_t bits = (uint32_t)s;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Runs `n` prepared calls (CALL_SLOTS int64 each) in order, each exactly as its own foreign call would: one call
 * from Python for a step's run of native ops instead of one per op (about 3 us each through ctypes: a third of a
 * SmolLM2 decode step's non-matmul time). Returns -1 when every call ran, else the index of the first call that
 * refused its arguments (having done nothing, as each function documents); the calls before it have run. */
#define P(i, T) ((T)(intptr_t)a[i])
int64_t slabserve_run_calls(const int64_t *calls, int64_t n) {
    for (int64_t c = 0; c < n; c++) {
        const int64_t *a = calls + c * CALL_SLOTS + 1;
        int bad = 0;
        switch (calls[c * CALL_SLOTS]) {
            case OP_LINEAR_F32:
                slabserve_linear_f32(a[0], a[1], a[2], P(3, const float *), a[4], P(5, const float *),
                                     P(6, float *), a[7], P(8, const float *), a[9], P(10, const int32_t *), a[11],
                                     a[12]);
                break;
            case OP_SLAB_ATTENTION:
                bad = slabserve_slab_attention_f32(a[0], a[1], a[2], a[3], a[4], a[5], P(6, const float *), a[7],
                                                   P(8, const void *), P(9, const void *), P(10, const int32_t *),
                                                   P(11, const int64_t *), P(12, const int32_t *),
                                                   slot_float(a[13]), P(14, float *), a[15]) < 0;
                break;
            case OP_RMS_NORM:
                slabserve_rms_norm_f32(a[0], a[1], P(2, const float *), a[3], P(4, const float *),
                                       slot_float(a[5]), P(6, float *), a[7], P(8, const int32_t *), a[9]);
                break;
            case OP_SILU_MUL:
                slabserve_silu_mul_f32(a[0], a[1], P(2, const float *), a[3], P(4, float *), a[5],
                                       P(6, const int32_t *), a[7]);
                break;
            case OP_ROPE:
                bad = slabserve_rope_f32(a[0], a[1], a[2], a[3], P(4, float *), a[5], P(6, float *), a[7],
                                         P(8, const int64_t *), P(9, const float *), a[10]) != 0;
                break;
            case OP_KV_WRITE:
                bad = slabserve_kv_write_f32(a[0], a[1], P(2, const float *), a[3], P(4, const float *), a[5],
                                             P(6, void *), P(7, void *), P(8, const int64_t *), a[9], a[10]) != 0;
                break;
            case OP_LINEAR_Q:
                bad = slabserve_linear_q(a[0], a[1], a[2], P(3, const float *), a[4], P(5, const uint8_t *), a[6],
                                         a[7], P(8, float *), a[9], P(10, const float *), a[11],
                                         P(12, const int32_t *), a[13], a[14]) != 0;
                break;
            case OP_EMBED_Q:
                bad = slabserve_embed_q(a[0], P(1, const int64_t *), a[2], a[3], P(4, const uint8_t *), a[5], a[6],
                                        P(7, float *), a[8]) != 0;
                break;
            default:
                bad = 1;
        }
        if (bad) return c;
    }
    return -1;
}
#undef P
