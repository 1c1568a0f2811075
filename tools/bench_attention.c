/* The slab attention kernel alone (kernels/cpu_native.c: slabserve_slab_attention_f32) at SmolLM2-135M's head
 * layout (9 query heads, 3 kv heads, head_dim 64, fp32 KV) or another: one prefill chunk at the end of a long
 * context, or a batch of decode rows, each its own sequence with its own slab (more than the last-level cache holds
 * at thousands of keys, as in a served decode step). K is the kernel's tiled cache (KV_TILE keys a tile), each slab
 * starting on a tile as planned slabs do; its values are random, so the layout changes nothing but the reads.
 *
 *     gcc -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -ffp-contract=off -fopenmp -I. \
 *         -DKERNELS='"kernels/cpu_native.c"' tools/bench_attention.c -o /tmp/battn -lm
 *     /tmp/battn ROWS KEYS [repeats = 5] [decode = 0] [heads = 9] [kv_heads = 3] [head_dim = 64]
 *
 * decode 0: one sequence whose last ROWS rows (a prefill chunk) attend over KEYS keys; decode 1: ROWS sequences of
 * one row each, each over KEYS keys. Prints the best time and the rate in GFLOP/s (4 x head_dim per (query row,
 * head, key) pair). With $DUMP set, also writes the output rows to that file, so that two builds can be compared
 * bit for bit with cmp. To compare two versions of the kernel, build one binary from each source
 * (-DKERNELS='"/path/to/other/cpu_native.c"') and run them alternately, with nothing else running. */
#include KERNELS
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float *random_floats(size_t n) {
    float *p = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    for (size_t i = 0; i < n; i++) p[i] = rand() / (float)RAND_MAX - 0.5f;
    return p;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ROWS KEYS [repeats] [decode] [heads] [kv_heads] [head_dim]\n", argv[0]);
        return 2;
    }
    int rows = atoi(argv[1]), keys = atoi(argv[2]), repeats = argc > 3 ? atoi(argv[3]) : 5;
    int decode = argc > 4 && atoi(argv[4]), H = argc > 5 ? atoi(argv[5]) : 9, Hkv = argc > 6 ? atoi(argv[6]) : 3;
    int D = argc > 7 ? atoi(argv[7]) : 64;
    if (rows < 1 || keys < rows || repeats < 1 || Hkv < 1 || H % Hkv || D % 8) {
        fprintf(stderr, "need 1 <= ROWS <= KEYS, repeats >= 1, heads a multiple of kv_heads, head_dim of 8s\n");
        return 2;
    }
    int seqs = decode ? rows : 1;
    int64_t slab = (keys + 64 + 15) / 16 * 16, cache = (int64_t)seqs * slab;  /* slabs start on K tiles, as planned */
    float *q = random_floats((size_t)rows * H * D), *k = random_floats((size_t)cache * Hkv * D);
    float *v = random_floats((size_t)cache * Hkv * D), *out = aligned_alloc(64, (size_t)rows * H * D * 4);
    int32_t *query_start = malloc(sizeof(int32_t) * (seqs + 1)), *context = malloc(sizeof(int32_t) * seqs);
    int64_t *offset = malloc(sizeof(int64_t) * seqs);
    query_start[0] = 0;
    for (int s = 0; s < seqs; s++) {
        query_start[s + 1] = decode ? s + 1 : rows;
        offset[s] = (int64_t)s * slab;
        context[s] = keys;
    }
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        double t = now();
        int rc = slabserve_slab_attention_f32(rows, seqs, H, Hkv, D, cache, q, H * D, k, v, query_start, offset,
                                              context, 1.0f / sqrtf((float)D), out, KV_F32);
        t = now() - t;
        if (rc) {
            fprintf(stderr, "the kernel refused these shapes (%d)\n", rc);
            return 1;
        }
        if (t < best) best = t;
    }
    /* pairs: every decode row sees all keys; chunk row j sees keys - rows + j + 1 */
    double pairs = decode ? (double)rows * keys : (double)rows * (keys - rows) + (double)rows * (rows + 1) / 2;
    printf("%s %d rows, %d keys: %.3f ms, %.1f GFLOP/s\n", decode ? "decode" : "chunk", rows, keys, best * 1e3,
           pairs * H * D * 4 / best / 1e9);
    const char *dump = getenv("DUMP");
    if (dump) {
        FILE *f = fopen(dump, "wb");
        if (!f || fwrite(out, sizeof(float), (size_t)rows * H * D, f) != (size_t)rows * H * D) return 1;
        fclose(f);
    }
    return 0;
}
