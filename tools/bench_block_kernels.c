/* The block kernels alone (kernels/cpu_native.c: slabserve_linear_q) over SmolLM2-135M's real shapes: 30 layers of
 * Q4_1 projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and the 49152x576 Q8_0 head, each in
 * its own buffer (97 MB, more than the last-level cache holds, as in a decode step), random valid blocks.
 *
 *     gcc -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -ffp-contract=off -fopenmp -I. \
 *         -DKERNELS='"kernels/cpu_native.c"' tools/bench_block_kernels.c -o /tmp/bbk -lm
 *     /tmp/bbk [rows of x = 1] [repeats = 50] [layers = 30] [nohead]
 *
 * (drop the -mavx512* flags for the AVX2 build). Prints the best time of the projections and of the head, and
 * the rate at which each read its blocks. To compare two versions of the kernels, build one binary from each
 * source (-DKERNELS='"/path/to/other/cpu_native.c"') and run them alternately, on a machine with nothing else
 * running. With `layers` 1 and `nohead` the blocks stay in cache: the kernels' arithmetic rate alone. */
#include KERNELS
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* n rows of k weights in `type` blocks: random bytes, with finite scales (f16 around 2^-7 for d, -2^-7 for m) */
static uint8_t *random_blocks(int type, int64_t n, int64_t k) {
    int64_t rb = slabserve_quant_row_bytes(type, k);
    int bb = type == WT_Q8_0 ? 34 : type == WT_Q4_1 ? 20 : 18;
    uint8_t *w = aligned_alloc(64, (n * rb + 63) / 64 * 64);
    for (int64_t i = 0; i < n * rb; i++) w[i] = (uint8_t)rand();
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < k / 32; b++) {
            uint8_t *p = w + r * rb + b * bb;
            uint16_t h = 0x2000 | (rand() & 0x3ff);
            memcpy(p, &h, 2);
            if (type == WT_Q4_1) {
                h = 0xa000 | (rand() & 0x3ff);
                memcpy(p + 2, &h, 2);
            }
        }
    return w;
}

int main(int argc, char **argv) {
    int m = argc > 1 ? atoi(argv[1]) : 1, repeats = argc > 2 ? atoi(argv[2]) : 50;
    int layers = argc > 3 ? atoi(argv[3]) : 30, head = argc <= 4;
    const int64_t H = 576, I = 1536, V = 49152;
    struct { int64_t n, k; } shape[4] = {{960, H}, {H, H}, {2 * I, H}, {H, I}};
    if (m < 1 || m > 256 || repeats < 2 || layers < 1 || layers > 64) {
        fprintf(stderr, "rows of x 1..256, repeats >= 2, layers 1..64\n");
        return 2;
    }
    uint8_t *w[64][4];
    double layer_bytes = 0, head_bytes = (double)V * slabserve_quant_row_bytes(WT_Q8_0, H);
    for (int l = 0; l < layers; l++)
        for (int s = 0; s < 4; s++) {
            w[l][s] = random_blocks(WT_Q4_1, shape[s].n, shape[s].k);
            layer_bytes += (double)shape[s].n * slabserve_quant_row_bytes(WT_Q4_1, shape[s].k);
        }
    uint8_t *w_head = head ? random_blocks(WT_Q8_0, V, H) : NULL;
    float *x = aligned_alloc(64, (size_t)m * I * 4), *y = aligned_alloc(64, (size_t)m * V * 4);
    for (int64_t i = 0; i < (int64_t)m * I; i++) x[i] = (float)(rand() % 1000) / 1000.0f - 0.5f;
    double best_layers = 1e9, best_head = 1e9;
    for (int r = 0; r < repeats; r++) {
        double t0 = now();
        for (int l = 0; l < layers; l++)
            for (int s = 0; s < 4; s++)
                slabserve_linear_q(m, shape[s].n, shape[s].k, x, shape[s].k, w[l][s],
                                   slabserve_quant_row_bytes(WT_Q4_1, shape[s].k), WT_Q4_1, y, shape[s].n, NULL, 0,
                                   NULL, 0, 0);
        double t1 = now();
        if (head)
            slabserve_linear_q(m, V, H, x, H, w_head, slabserve_quant_row_bytes(WT_Q8_0, H), WT_Q8_0, y, V, NULL, 0,
                               NULL, 0, 0);
        double t2 = now();
        if (r >= 2) {  /* the first two warm the thread pool and the page tables */
            best_layers = t1 - t0 < best_layers ? t1 - t0 : best_layers;
            best_head = t2 - t1 < best_head ? t2 - t1 : best_head;
        }
    }
    printf("rows %d: %d layers' projections %.2f ms (%.1f GB/s)", m, layers, best_layers * 1e3,
           layer_bytes / best_layers / 1e9);
    if (head) printf(", head %.2f ms (%.1f GB/s)", best_head * 1e3, head_bytes / best_head / 1e9);
    printf("\n");
    return 0;
}
