/* slabserve's native CPU kernels: fp32, AVX2 + FMA, threaded with OpenMP.
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

int slabserve_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* KV caches may hold fp32, bf16 or fp16 (the plan's kv_dtype); activations are fp32. Half rows are widened to fp32
 * as they are loaded (exactly) and fp32 rows rounded to nearest even as they are stored, as torch converts. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

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
 * each row's values are contiguous. */
void slabserve_linear_f32(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *w,
                          float *y, int64_t ldy, const float *residual, int64_t ldr) {
    int64_t full = N / PANEL, cols = N % PANEL;
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

/* The eight horizontal sums of v[0..7], as one vector. */
static inline __m256 hsum8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* scale * q . k for `len` keys (rows of k, stride ldkv elements, of `kind`) into sc: eight keys at a time, each its
 * own accumulator, so the FMAs of eight dot products interleave instead of waiting on one chain. */
static inline __attribute__((always_inline)) void block_scores(int D, const float *q, const void *k, int64_t ldkv,
                                                               int len, float scale, float *sc, int kind) {
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, load_kv8(k, (i + j) * ldkv + d, kind), acc[j]);
        }
        _mm256_storeu_ps(sc + i, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    }
    for (; i < len; i++) {
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load_kv8(k, i * ldkv + d, kind), acc);
        sc[i] = hsum256(acc) * scale;
    }
}

/* acc[0..D) += sum_i p[i] * v_i over `len` rows of v (of `kind`): 32 columns at a time held in four registers. */
static inline __attribute__((always_inline)) void block_values(int D, const float *p, const void *v, int64_t ldkv,
                                                               int len, float *acc, int kind) {
    int d = 0;
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

/* Softmax bookkeeping of one head for one block of scores: raise the running max *m (rescaling the running sum *l
 * and the accumulator when it grows), turn the scores into exp(score - max) in place, add them to *l. */
static void block_softmax(int D, float *sc, int len, float *m, float *l, float *acc) {
    float bm = *m;
    for (int i = 0; i < len; i++) bm = sc[i] > bm ? sc[i] : bm;
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

/* `R` consecutive query rows of one sequence, each with its G heads (row r: G rows of D at q + r * ldq), over
 * the keys starting at element `first` of k/v (row stride ldkv elements, of `kind`): row r sees n0 + r keys. Each
 * block of KEY_BLOCK keys is loaded once for all R rows and G heads while it sits in L1, and every row takes the
 * blocks at the same key offsets (0, 64, 128, ...) in the same order with the same code, whatever R is and
 * whichever row of its chunk it is: a row's result depends only on its query and its keys, never on how the
 * prompt was cut into chunks or what else shares the step (the exactness prefix reuse relies on). */
static inline __attribute__((always_inline)) void attend_rows_kind(int R, int G, int D, const float *q, int64_t ldq,
                                                                   const void *k, const void *v, int64_t first,
                                                                   int64_t ldkv, int64_t n0, float scale,
                                                                   float *out, int64_t ldo, int kind) {
    float acc[TILE_FLOATS], m[MAX_ROW_TILE * MAX_GROUP], l[MAX_ROW_TILE * MAX_GROUP], sc[KEY_BLOCK];
    size_t item = kind == KV_F32 ? 4 : 2;
    for (int i = 0; i < R * G; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, (size_t)R * G * D * sizeof(float));
    int64_t n_last = n0 + R - 1;
    for (int64_t start = 0; start < n_last; start += KEY_BLOCK) {
        const char *kb = (const char *)k + (first + start * ldkv) * item;
        const char *vb = (const char *)v + (first + start * ldkv) * item;
        for (int r = 0; r < R; r++) {
            int64_t n = n0 + r;
            if (start >= n) continue;
            int len = n - start < KEY_BLOCK ? (int)(n - start) : KEY_BLOCK;
            for (int h = 0; h < G; h++) {
                int i = r * G + h;
                block_scores(D, q + r * ldq + h * D, kb, ldkv, len, scale, sc, kind);
                block_softmax(D, sc, len, &m[i], &l[i], acc + (size_t)i * D);
                block_values(D, sc, vb, ldkv, len, acc + (size_t)i * D, kind);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < G; h++) {
            int i = r * G + h;
            float inv = 1.0f / l[i];
            for (int d = 0; d < D; d++) out[r * ldo + h * D + d] = acc[(size_t)i * D + d] * inv;
        }
}

/* attend_rows_kind with `kind` a constant in each branch, so each gets its own loads inlined. */
static void attend_rows(int R, int G, int D, const float *q, int64_t ldq, const void *k, const void *v,
                        int64_t first, int64_t ldkv, int64_t n0, float scale, float *out, int64_t ldo, int kind) {
    if (kind == KV_BF16) attend_rows_kind(R, G, D, q, ldq, k, v, first, ldkv, n0, scale, out, ldo, KV_BF16);
    else if (kind == KV_F16) attend_rows_kind(R, G, D, q, ldq, k, v, first, ldkv, n0, scale, out, ldo, KV_F16);
    else attend_rows_kind(R, G, D, q, ldq, k, v, first, ldkv, n0, scale, out, ldo, KV_F32);
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

/* Attends every sequence that has at least as many keys as rows (decode rows and prefill chunks of any length),
 * and zeroes the rows that see no key (those of sequences with fewer keys than rows, and the padding rows from
 * query_start[num_seqs] to num_rows). The work is split into tasks of up to `row_tile` flat rows per kv head, so
 * a long chunk spreads over every thread. Returns 0; or, having done nothing, -1 when the head layout is beyond
 * this kernel and -2 when the metadata points outside the rows of q or past the caches' cache_rows. */
int slabserve_slab_attention_f32(int64_t num_rows, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t cache_rows, const float *q, int64_t ldq,
                                 const void *k_cache,
                                 const void *v_cache, const int32_t *query_start, const int64_t *slab_offset,
                                 const int32_t *context_len, float scale, float *out, int64_t kv_kind) {
    int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (group < 1 || group > MAX_GROUP || num_heads % num_kv_heads || head_dim % 8 || head_dim > MAX_HEAD_DIM)
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
    int64_t tiles = (real_rows + row_tile - 1) / row_tile;
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
                                scale, out + r * ldo + g * group * head_dim, ldo, (int)kv_kind);
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
                            float *out, int64_t ldo) {
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

void slabserve_silu_mul_f32(int64_t T, int64_t I, const float *gate_up, int64_t ldg, float *out, int64_t ldo) {
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

/* Row t of k and v (`width` floats each) into cache row slot_mapping[t], stored as the caches' `kv_kind`; a negative
 * slot (-1: padding) skips the row. Returns 0, or -1 (having written nothing) when a slot lies past the caches'
 * num_slots rows. */
int slabserve_kv_write_f32(int64_t T, int64_t width, const float *k, int64_t ldk, const float *v, int64_t ldv,
                           void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t num_slots,
                           int64_t kv_kind) {
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] >= num_slots) return -1;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (kv_kind == KV_F32) {
            memcpy((float *)k_cache + slot * width, k + t * ldk, width * sizeof(float));
            memcpy((float *)v_cache + slot * width, v + t * ldv, width * sizeof(float));
            continue;
        }
        uint16_t *kd = (uint16_t *)k_cache + slot * width, *vd = (uint16_t *)v_cache + slot * width;
        const float *ks = k + t * ldk, *vs = v + t * ldv;
        int64_t i = 0;
        if (kv_kind == KV_F16) {
            for (; i + 8 <= width; i += 8) {
                __m128i kh = _mm256_cvtps_ph(_mm256_loadu_ps(ks + i), _MM_FROUND_TO_NEAREST_INT);
                __m128i vh = _mm256_cvtps_ph(_mm256_loadu_ps(vs + i), _MM_FROUND_TO_NEAREST_INT);
                _mm_storeu_si128((__m128i *)(kd + i), kh);
                _mm_storeu_si128((__m128i *)(vd + i), vh);
            }
            for (; i < width; i++) {
                kd[i] = _cvtss_sh(ks[i], _MM_FROUND_TO_NEAREST_INT);
                vd[i] = _cvtss_sh(vs[i], _MM_FROUND_TO_NEAREST_INT);
            }
        } else {
            for (; i < width; i++) {
                kd[i] = bf16_from_f32(ks[i]);
                vd[i] = bf16_from_f32(vs[i]);
            }
        }
    }
    return 0;
}
