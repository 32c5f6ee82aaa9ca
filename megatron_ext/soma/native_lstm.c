/* Two no-grad kernels of the SOMA forward, for P bodies at once, in C (compiled for the host by
 * megatron_ext/soma/native.py):
 *
 * soma_lstm_block -- the mixing half of an LSTM block over one time chunk: per step and batch
 * row, a = [norm(x), h], z = a @ [w_ih_t; whh_t], and the cell in the arithmetic of
 * megatron_ext/soma/scan.py::lstm_scan_inplace (gates in the order i, f, o, g with the g columns
 * pre-scaled by 2, n = -2c carried instead of the cell state c):
 *
 *     i, f, o, s_g = sigmoid(z)              (each d wide)
 *     n <- f*n - 4*i*s_g + 2*i               (that is c <- f*c + i*g)
 *     h <- o - 2*o*sigmoid(n)                (that is o*tanh(c))
 *
 * then x1 = x + h and y = norm(x1) for the MLP that follows (in torch). Batch rows are
 * independent, so each thread takes whole bodies and each pair of rows runs every step of the
 * chunk with its state in registers and L1 and the body's matrices in L1/L2: no (P, rows, 4d)
 * input projection in memory, no kernel launch or thread barrier per step (the eager torch path
 * has seven of each per step).
 *
 * soma_head_nll -- the tied (or per-body) head's cross-entropy: per row the logits h @ wt and
 * their log-sum-exp in cache, never stored.
 *
 * Vectors are GCC/Clang vector extensions. exp is a Cephes-style polynomial on [-ln2/2, ln2/2]
 * (relative error ~1e-7), so results match the torch path to float rounding (tested).
 */
#include <math.h>
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

/* z[j] = (x ? x[j] : 0) + sum_k a[k] * w[k, j] for columns j0 <= j < nc of one row; w
 * row-major (kdim, nc); x, w and z indexed from column 0. */
static void matvec_cols(const float *x, const float *a, const float *w, int kdim, int nc, int j0,
                        float *z) {
    int j = j0;
    for (; j + VW <= nc; j += VW) {
        vf acc = x ? load(x + j) : splat(0.0f);
        for (int k = 0; k < kdim; ++k) acc += a[k] * load(w + (size_t)k * nc + j);
        store(z + j, acc);
    }
    for (; j < nc; ++j) {
        float acc = x ? x[j] : 0.0f;
        for (int k = 0; k < kdim; ++k) acc += a[k] * w[(size_t)k * nc + j];
        z[j] = acc;
    }
}

/* matvec_cols of two rows at once (x0, a0 -> z0; x1, a1 -> z1; x0, x1 may be NULL): each load
 * of w feeds both rows, and 2 x 4 accumulators are eight independent FMA chains (enough to
 * hide the FMA latency); the columns left over go one row at a time. */
static void matvec2(const float *x0, const float *x1, const float *a0, const float *a1,
                    const float *w, int kdim, int nc, float *z0, float *z1) {
    int j = 0;
    for (; j + 4 * VW <= nc; j += 4 * VW) {
        vf c0, c1, c2, c3, e0, e1, e2, e3;
        if (x0) {
            c0 = load(x0 + j), c1 = load(x0 + j + VW), c2 = load(x0 + j + 2 * VW);
            c3 = load(x0 + j + 3 * VW);
            e0 = load(x1 + j), e1 = load(x1 + j + VW), e2 = load(x1 + j + 2 * VW);
            e3 = load(x1 + j + 3 * VW);
        } else {
            c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = splat(0.0f);
        }
        for (int k = 0; k < kdim; ++k) {
            const float *wk = w + (size_t)k * nc + j;
            vf w0 = load(wk), w1 = load(wk + VW), w2 = load(wk + 2 * VW), w3 = load(wk + 3 * VW);
            const float p = a0[k], q = a1[k];
            c0 += p * w0, c1 += p * w1, c2 += p * w2, c3 += p * w3;
            e0 += q * w0, e1 += q * w1, e2 += q * w2, e3 += q * w3;
        }
        store(z0 + j, c0), store(z0 + j + VW, c1), store(z0 + j + 2 * VW, c2);
        store(z0 + j + 3 * VW, c3);
        store(z1 + j, e0), store(z1 + j + VW, e1), store(z1 + j + 2 * VW, e2);
        store(z1 + j + 3 * VW, e3);
    }
    matvec_cols(x0, a0, w, kdim, nc, j, z0);
    matvec_cols(x1, a1, w, kdim, nc, j, z1);
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

/* Layer norm of one row without gain (the gain is folded into the matrix that follows):
 * y = (x - mean) / sqrt(var + eps), biased variance, as torch's layer_norm. */
static void norm_row(const float *x, int d, float eps, float *y) {
    float mean = 0.0f, var = 0.0f;
    for (int k = 0; k < d; ++k) mean += x[k];
    mean /= (float)d;
    for (int k = 0; k < d; ++k) var += (x[k] - mean) * (x[k] - mean);
    const float inv = 1.0f / sqrtf(var / (float)d + eps);
    for (int k = 0; k < d; ++k) y[k] = (x[k] - mean) * inv;
}

/* One LSTM block's mixing half for `nr` (1 or 2) batch rows of one body, over tc steps: per step
 * a = [norm(x), h], z = a @ wcat (wcat = [w_ih_t; whh_t], (2d, 4d)), the cell, then
 * x1 = x + h and y = norm(x1). Rows of the chunk are time-major (row s*B + r); x, x1, y point at
 * row r of step 0, `step` floats apart. h (d per row) and n (d per row, `nstride` apart) in
 * place. Scratch: 2 x 2d + 2 x 4d floats. */
static void block_rows(const float *x, float *x1, float *y, const float *wcat, float *h,
                       float *n, int nr, int tc, size_t step, int d, float eps, float *scratch) {
    const int g = 4 * d;
    float *a0 = scratch, *a1 = a0 + 2 * d, *z0 = a1 + 2 * d, *z1 = z0 + g;
    float *h1 = h + d, *n1 = n + d;
    for (int s = 0; s < tc; ++s) {
        const float *xr = x + s * step;
        norm_row(xr, d, eps, a0);
        memcpy(a0 + d, h, sizeof(float) * d);
        if (nr == 2) {
            norm_row(xr + d, d, eps, a1);
            memcpy(a1 + d, h1, sizeof(float) * d);
            matvec2(NULL, NULL, a0, a1, wcat, 2 * d, g, z0, z1);
            cell_row(z1, n1, h1, d);
        } else {
            matvec_cols(NULL, a0, wcat, 2 * d, g, 0, z0);
        }
        cell_row(z0, n, h, d);
        for (int q = 0; q < nr; ++q) {
            float *o = x1 + s * step + (size_t)q * d;
            for (int k = 0; k < d; ++k) o[k] = xr[(size_t)q * d + k] + h[(size_t)q * d + k];
            norm_row(o, d, eps, y + s * step + (size_t)q * d);
        }
    }
}

/* The mixing half of one LSTM block over one time chunk, for P bodies:
 *   x (P bodies at x_pstride floats apart -- 0 when all bodies read the same x; each (tc*B, d),
 *   time-major rows), wcat (P, 2d, 4d), h0 (body q's (B, d) at h0 + q * h0_pstride), n (P, B, d)
 *   in place -> h_last (P, B, d), x1 = x + LSTM(norm(x)) and y = norm(x1), both (P, tc*B, d).
 * Batch rows are independent, so each pair of rows runs all tc steps with its state in
 * registers and L1. Returns 0, or 1 when scratch memory is short. */
int soma_lstm_block(const float *x, long x_pstride, const float *wcat, const float *h0,
                    long h0_pstride, float *n, float *h_last, float *x1, float *y, int p, int tc,
                    int b, int d, float eps, int threads) {
    const size_t g = 4 * (size_t)d, rows = (size_t)tc * b, step = (size_t)b * d;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : status)
    {
        float *scratch = malloc(sizeof(float) * (4 * (size_t)d + 2 * g));
        if (!scratch) {
            status = 1;
        } else {
#pragma omp for schedule(static)
            for (int q = 0; q < p; ++q) {
                const float *xq = x + (size_t)q * x_pstride;
                float *x1q = x1 + (size_t)q * rows * d, *yq = y + (size_t)q * rows * d;
                float *hq = h_last + (size_t)q * b * d, *nq = n + (size_t)q * b * d;
                memcpy(hq, h0 + (size_t)q * h0_pstride, sizeof(float) * b * d);
                for (int r = 0; r < b; r += 2) {
                    const int nr = r + 1 < b ? 2 : 1;
                    const size_t o = (size_t)r * d;
                    block_rows(xq + o, x1q + o, yq + o, wcat + (size_t)q * 2 * d * g, hq + o,
                               nq + o, nr, tc, step, d, eps, scratch);
                }
            }
        }
        free(scratch);
    }
    return status;
}

/* log(sum(exp(z))) - z[t] over nc logits. */
static float nll_row(const float *z, int nc, long t) {
    float m = z[0];
    for (int j = 1; j < nc; ++j) m = z[j] > m ? z[j] : m;
    vf acc = splat(0.0f);
    int j = 0;
    for (; j + VW <= nc; j += VW) acc += vexp(load(z + j) - m);
    float sum = 0.0f;
    for (int k = 0; k < VW; ++k) sum += acc[k];
    for (; j < nc; ++j) sum += vexp(splat(z[j] - m))[0];
    return logf(sum) + m - z[t];
}

/* The head and cross-entropy of one time chunk, for P bodies: hidden states (body q's (rows, e)
 * at hid + q * h_pstride), decoder wt (e, v) row-major (body q's at wt + q * w_pstride; 0: one
 * shared), targets (body q's rows at tgt + q * t_pstride) -> out (P, rows) negative
 * log-likelihoods (nats). The (rows, v) logits are never stored: each pair of rows is one
 * matrix-vector pass and one log-sum-exp in cache. Returns 0, 1 when scratch memory is short,
 * 2 for a target outside 0..v-1. */
int soma_head_nll(const float *hid, long h_pstride, const float *wt, long w_pstride,
                  const long *tgt, long t_pstride, float *out, int p, int rows, int e, int v,
                  int threads) {
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : status)
    {
        float *z = malloc(sizeof(float) * 2 * (size_t)v);
        if (!z) {
            status = 1;
        } else {
#pragma omp for schedule(static)
            for (int q = 0; q < p; ++q) {
                const float *hq = hid + (size_t)q * h_pstride, *wq = wt + (size_t)q * w_pstride;
                const long *tq = tgt + (size_t)q * t_pstride;
                for (int r = 0; r < rows; r += 2) {
                    const int nr = r + 1 < rows ? 2 : 1;
                    const float *h0 = hq + (size_t)r * e;
                    if (nr == 2)
                        matvec2(NULL, NULL, h0, h0 + e, wq, e, v, z, z + v);
                    else
                        matvec_cols(NULL, h0, wq, e, v, 0, z);
                    for (int k = 0; k < nr; ++k) {
                        const long t = tq[r + k];
                        if (t < 0 || t >= v) {
                            status |= 2;
                            continue;
                        }
                        out[(size_t)q * rows + r + k] = nll_row(z + (size_t)k * v, v, t);
                    }
                }
            }
        }
        free(z);
    }
    return status;
}
