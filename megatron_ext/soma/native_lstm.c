/* The no-grad LSTM recurrence of the SOMA body over one time chunk, for P bodies, in C.
 *
 * Same arithmetic as megatron_ext/soma/scan.py::lstm_scan_inplace (gates in the order i, f, o,
 * g with the g columns pre-scaled by 2, n = -2c carried instead of the cell state c):
 *
 *     z = xw[s] + h @ whh_t                  (B, 4d)
 *     i, f, o, s_g = sigmoid(z)              (each d wide)
 *     n <- f*n - 4*i*s_g + 2*i               (that is c <- f*c + i*g)
 *     h <- o - 2*o*sigmoid(n)                (that is o*tanh(c))
 *
 * but each thread takes whole bodies and runs all steps of the chunk for one body before the
 * next: the body's recurrent matrix (d x 4d), its state and one step's gates stay in the core's
 * cache, the step's matmul and gate arithmetic are one pass, and there is no thread barrier per
 * step (the eager torch path has seven kernels and seven barriers per step).
 *
 * Written with GCC/Clang vector extensions (16 floats; one AVX-512 register, two AVX ones,
 * compiled for the host by megatron_ext/soma/native.py). exp is a Cephes-style polynomial on
 * [-ln2/2, ln2/2] (relative error ~1e-7), so results match the torch path to float rounding.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* Floats per vector: 8 (one AVX register). Measured on this project's 2-core AVX-512 host: 16
 * (AVX-512) was faster on one thread but slower on two (145 -> 126 ms against 175 -> 107 ms for
 * one update's recurrences), the wide units throttling. */
#define VW 8
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int vi __attribute__((vector_size(VW * sizeof(int))));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* a constant vector (scalars in vector arithmetic are broadcast by the compiler) */
static inline vf splat(float x) { return (vf){0} + x; }

/* where mask (all ones / all zeros per lane): a, else b */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* exp(y) for y in [-88, 88] (clamped): y = m*ln2 + r, e^r by a degree-7 polynomial. */
static inline vf vexp(vf y) {
    y = vselect(y < 88.0f, y, splat(88.0f));
    y = vselect(y > -88.0f, y, splat(-88.0f));
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    vf m = (y * 1.44269504088896341f + magic) - magic;
    vf r = y - m * 0.693359375f;     /* ln2, high part (exact product) */
    r = r - m * -2.12194440e-4f;     /* ln2, low part */
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    vi bits = (__builtin_convertvector(m, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline vf vsigmoid(vf x) { return 1.0f / (1.0f + vexp(-x)); }

static inline float ssigmoid(float x) {
    vf v = vsigmoid(splat(x));
    return v[0];
}

/* z[j] = x[j] + sum_k h[k] * w[k, j] for columns j0 <= j < 4d of one row; w row-major (d, 4d),
 * x, w and z indexed from column 0. */
static void gates_cols(const float *x, const float *h, const float *w, int d, int j0, float *z) {
    const int g = 4 * d;
    int j = j0;
    for (; j + VW <= g; j += VW) {
        vf a = load(x + j);
        for (int k = 0; k < d; ++k) a += h[k] * load(w + (size_t)k * g + j);
        store(z + j, a);
    }
    for (; j < g; ++j) {
        float a = x[j];
        for (int k = 0; k < d; ++k) a += h[k] * w[(size_t)k * g + j];
        z[j] = a;
    }
}

/* gates_cols of two rows at once (x0, h0 -> z0; x1, h1 -> z1): each load of w feeds both
 * rows, and 2 x 4 accumulators are eight independent FMA chains (enough to hide the FMA
 * latency); the columns left over go one row at a time. */
static void gates_rows2(const float *x0, const float *x1, const float *h0, const float *h1,
                        const float *w, int d, float *z0, float *z1) {
    const int g = 4 * d;
    int j = 0;
    for (; j + 4 * VW <= g; j += 4 * VW) {
        vf a0 = load(x0 + j), a1 = load(x0 + j + VW), a2 = load(x0 + j + 2 * VW);
        vf a3 = load(x0 + j + 3 * VW);
        vf b0 = load(x1 + j), b1 = load(x1 + j + VW), b2 = load(x1 + j + 2 * VW);
        vf b3 = load(x1 + j + 3 * VW);
        for (int k = 0; k < d; ++k) {
            const float *wk = w + (size_t)k * g + j;
            vf w0 = load(wk), w1 = load(wk + VW), w2 = load(wk + 2 * VW), w3 = load(wk + 3 * VW);
            const float p = h0[k], q = h1[k];
            a0 += p * w0, a1 += p * w1, a2 += p * w2, a3 += p * w3;
            b0 += q * w0, b1 += q * w1, b2 += q * w2, b3 += q * w3;
        }
        store(z0 + j, a0), store(z0 + j + VW, a1), store(z0 + j + 2 * VW, a2);
        store(z0 + j + 3 * VW, a3);
        store(z1 + j, b0), store(z1 + j + VW, b1), store(z1 + j + 2 * VW, b2);
        store(z1 + j + 3 * VW, b3);
    }
    gates_cols(x0, h0, w, d, j, z0);
    gates_cols(x1, h1, w, d, j, z1);
}

/* The gate arithmetic of one row: z (4d) in i, f, o, s order; n (d) in place; h_out (d). */
static void cell_row(float *z, float *n, float *h_out, int d) {
    const int g = 4 * d;
    int j = 0;
    for (; j + VW <= g; j += VW) store(z + j, vsigmoid(load(z + j)));
    for (; j < g; ++j) z[j] = ssigmoid(z[j]);
    const float *i_g = z, *f_g = z + d, *o_g = z + 2 * d, *s_g = z + 3 * d;
    j = 0;
    for (; j + VW <= d; j += VW) {
        vf i = load(i_g + j), nn = load(f_g + j) * load(n + j) - 4.0f * i * load(s_g + j) + 2.0f * i;
        vf o = load(o_g + j);
        store(n + j, nn);
        store(h_out + j, o - 2.0f * o * vsigmoid(nn));
    }
    for (; j < d; ++j) {
        float nn = f_g[j] * n[j] - 4.0f * i_g[j] * s_g[j] + 2.0f * i_g[j];
        n[j] = nn;
        h_out[j] = o_g[j] - 2.0f * o_g[j] * ssigmoid(nn);
    }
}

/* One body through the tc steps of a chunk: xw (tc, B, 4d), whh (d, 4d), initial h (B, d),
 * n (B, d) in place, out (tc, B, d); z scratch of 2 x 4d floats. */
static void run_body(const float *xw, const float *whh, const float *h, float *n, float *out,
                     int tc, int b, int d, float *z) {
    const int g = 4 * d;
    for (int s = 0; s < tc; ++s) {
        const float *x = xw + (size_t)s * b * g;
        float *o = out + (size_t)s * b * d;
        int r = 0;
        for (; r + 2 <= b; r += 2) {
            const size_t r0 = (size_t)r * g, r1 = r0 + g;
            gates_rows2(x + r0, x + r1, h + (size_t)r * d, h + (size_t)(r + 1) * d, whh, d, z,
                        z + g);
            cell_row(z, n + (size_t)r * d, o + (size_t)r * d, d);
            cell_row(z + g, n + (size_t)(r + 1) * d, o + (size_t)(r + 1) * d, d);
        }
        if (r < b) {
            gates_cols(x + (size_t)r * g, h + (size_t)r * d, whh, d, 0, z);
            cell_row(z, n + (size_t)r * d, o + (size_t)r * d, d);
        }
        h = o;
    }
}

/* All P bodies, split over `threads` OpenMP threads. Built with -fopenmp this runs on the
 * process's OpenMP pool -- torch's own libgomp, already loaded, so no second set of threads
 * competes with torch's (spinning) workers. Returns 0, or 1 when scratch memory is short. */
int soma_lstm_scan(const float *xw, const float *whh, const float *h0, long h0_stride, float *n,
                   float *out, int p, int tc, int b, int d, int threads) {
    const size_t g = 4 * (size_t)d;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : status)
    {
        float *z = malloc(sizeof(float) * 2 * g);
        if (!z) {
            status = 1;
        } else {
#pragma omp for schedule(static)
            for (int q = 0; q < p; ++q)
                run_body(xw + (size_t)q * tc * b * g, whh + (size_t)q * d * g,
                         h0 + (size_t)q * h0_stride, n + (size_t)q * b * d,
                         out + (size_t)q * tc * b * d, tc, b, d, z);
        }
        free(z);
    }
    return status;
}
