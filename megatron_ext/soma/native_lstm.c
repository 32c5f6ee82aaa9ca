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
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* only for the AVX-512 reciprocal estimate; elsewhere plain C */
#endif
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* Floats per vector: 16 (one AVX-512 register) where the compiler targets AVX-512, else 8
 * (one AVX register, or two SSE ones). Measured on this project's AVX-512 host, one SPSA
 * update's forward: 16 took 0.38 s where 8 took 0.42 s. -DSOMA_VW=8 forces 8. */
#ifndef SOMA_VW
#ifdef __AVX512F__
#define SOMA_VW 16
#else
#define SOMA_VW 8
#endif
#endif
#define VW SOMA_VW
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

/* 1/x: the 14-bit hardware estimate and one Newton step (relative error ~1e-7) where AVX-512
 * has it -- a division costs several times more -- else a division. */
static inline vf vrecip(vf x) {
#if defined(__AVX512F__) && VW == 16
    vf y = (vf)_mm512_rcp14_ps((__m512)x);
    return y * (2.0f - x * y);
#elif defined(__AVX512VL__) && VW == 8
    vf y = (vf)_mm256_rcp14_ps((__m256)x);
    return y * (2.0f - x * y);
#else
    return 1.0f / x;
#endif
}

static inline vf vsigmoid(vf x) { return vrecip(1.0f + vexp(-x)); }

/* erf(x) by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7), odd in x. */
static inline vf verf(vf x) {
    vi neg = x < 0.0f;
    vf ax = vselect(neg, -x, x);
    vf t = vrecip(1.0f + 0.3275911f * ax);
    vf p = splat(1.061405429f);
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    vf e = 1.0f - p * t * vexp(-ax * ax);
    return vselect(neg, -e, e);
}

/* GELU (the erf form, as torch's default): 0.5 x (1 + erf(x / sqrt 2)), in place over n. */
static void gelu_row(float *u, int n) {
    int j = 0;
    for (; j + VW <= n; j += VW) {
        vf x = load(u + j);
        store(u + j, 0.5f * x * (1.0f + verf(x * 0.70710678118654752f)));
    }
    for (; j < n; ++j) u[j] = 0.5f * u[j] * (1.0f + erff(u[j] * 0.70710678118654752f));
}

static inline float ssigmoid(float x) {
    vf v = vsigmoid(splat(x));
    return v[0];
}

/* z[j] = (x ? x[j] : 0) + sum_k a[k] * w[k, j] for columns j0 <= j < nc of one row; w
 * row-major (kdim, nc); x, w and z indexed from column 0. */
static void matvec_cols(const float *x, const float *a, const float *w, int kdim, int nc, int j0,
                        float *z) {
    int j = j0;
    for (; j + VW <= nc; j += VW) { /* four partial sums over k: four FMA chains, not one */
        vf c0 = x ? load(x + j) : splat(0.0f), c1 = splat(0.0f), c2 = c1, c3 = c1;
        int k = 0;
        for (; k + 4 <= kdim; k += 4) {
            const float *wk = w + (size_t)k * nc + j;
            c0 += a[k] * load(wk);
            c1 += a[k + 1] * load(wk + nc);
            c2 += a[k + 2] * load(wk + 2 * (size_t)nc);
            c3 += a[k + 3] * load(wk + 3 * (size_t)nc);
        }
        for (; k < kdim; ++k) c0 += a[k] * load(w + (size_t)k * nc + j);
        store(z + j, (c0 + c1) + (c2 + c3));
    }
    for (; j < nc; ++j) {
        float acc = x ? x[j] : 0.0f;
        for (int k = 0; k < kdim; ++k) acc += a[k] * w[(size_t)k * nc + j];
        z[j] = acc;
    }
}

/* Vectors per row in one pass of matvec2: 2 rows x NV accumulators are the independent FMA
 * chains that hide the FMA latency (16 of the 32 AVX-512 registers; 8 of AVX's 16). */
#if VW == 16
#define NV 8
#else
#define NV 4
#endif

/* matvec_cols of two rows at once (x0, a0 -> z0; x1, a1 -> z1; x0, x1 may be NULL): each load
 * of w feeds both rows; the columns left over go one row at a time. */
static void matvec2(const float *x0, const float *x1, const float *a0, const float *a1,
                    const float *w, int kdim, int nc, float *z0, float *z1) {
    int j = 0;
    for (; j + NV * VW <= nc; j += NV * VW) {
        vf c[NV], e[NV];
        for (int v = 0; v < NV; ++v) {
            c[v] = x0 ? load(x0 + j + v * VW) : splat(0.0f);
            e[v] = x1 ? load(x1 + j + v * VW) : splat(0.0f);
        }
        for (int k = 0; k < kdim; ++k) {
            const float *wk = w + (size_t)k * nc + j;
            const float p = a0[k], q = a1[k];
            for (int v = 0; v < NV; ++v) {
                vf wv = load(wk + v * VW);
                c[v] += p * wv;
                e[v] += q * wv;
            }
        }
        for (int v = 0; v < NV; ++v) {
            store(z0 + j + v * VW, c[v]);
            store(z1 + j + v * VW, e[v]);
        }
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
static float hsum(vf v) {
    float s = 0.0f;
    for (int k = 0; k < VW; ++k) s += v[k];
    return s;
}

static void norm_row(const float *x, int d, float eps, float *y) {
    vf acc = splat(0.0f);
    int k = 0;
    for (; k + VW <= d; k += VW) acc += load(x + k);
    float mean = hsum(acc);
    for (; k < d; ++k) mean += x[k];
    mean /= (float)d;
    acc = splat(0.0f);
    for (k = 0; k + VW <= d; k += VW) {
        vf t = load(x + k) - mean;
        acc += t * t;
    }
    float var = hsum(acc);
    for (; k < d; ++k) var += (x[k] - mean) * (x[k] - mean);
    const float inv = 1.0f / sqrtf(var / (float)d + eps);
    for (k = 0; k + VW <= d; k += VW) store(y + k, (load(x + k) - mean) * inv);
    for (; k < d; ++k) y[k] = (x[k] - mean) * inv;
}

/* o = a + b over d floats */
static void add_row(const float *a, const float *b, int d, float *o) {
    int k = 0;
    for (; k + VW <= d; k += VW) store(o + k, load(a + k) + load(b + k));
    for (; k < d; ++k) o[k] = a[k] + b[k];
}

/* One body of an LSTM block over tc steps; per step, for each batch row
 *   a = [norm(x), h], z = a @ wcat (wcat = [w_ih_t; whh_t], (2d, 4d)), the cell -> h;
 *   x1 = x + h; u = gelu(norm(x1) @ fc1 (d, 4d)); out = x1 + u @ fc2 (4d, d)
 * in three passes over the B rows, two rows at a time, so that each pass's matrix is read from
 * L1 for all rows (the three together do not fit). Rows of the chunk are time-major (row s*B +
 * r): x and out are (tc*B, d). h and n (B, d) in place. Scratch: 2 x (2d + 4d) + B x 6d. */
static void block_body(const float *x, float *out, const float *wcat, const float *fc1,
                       const float *fc2, float *h, float *n, int tc, int b, int d, float eps,
                       float *scratch) {
    const int g = 4 * d;
    float *a0 = scratch, *a1 = a0 + 2 * d, *z0 = a1 + 2 * d, *z1 = z0 + g;
    float *x1 = z1 + g, *y = x1 + (size_t)b * d, *u = y + (size_t)b * d; /* (B,d) (B,d) (B,4d) */
    for (int s = 0; s < tc; ++s) {
        const float *xs = x + (size_t)s * b * d;
        float *os = out + (size_t)s * b * d;
        for (int r = 0; r < b; r += 2) { /* the LSTM: wcat */
            const size_t o = (size_t)r * d;
            norm_row(xs + o, d, eps, a0);
            memcpy(a0 + d, h + o, sizeof(float) * d);
            if (r + 1 < b) {
                norm_row(xs + o + d, d, eps, a1);
                memcpy(a1 + d, h + o + d, sizeof(float) * d);
                matvec2(NULL, NULL, a0, a1, wcat, 2 * d, g, z0, z1);
                cell_row(z1, n + o + d, h + o + d, d);
            } else {
                matvec_cols(NULL, a0, wcat, 2 * d, g, 0, z0);
            }
            cell_row(z0, n + o, h + o, d);
            for (int q = 0; q < 2 && r + q < b; ++q) {
                add_row(xs + o + q * d, h + o + q * d, d, x1 + o + q * d);
                norm_row(x1 + o + q * d, d, eps, y + o + q * d);
            }
        }
        for (int r = 0; r < b; r += 2) { /* the MLP's first layer: fc1 */
            float *u0 = u + (size_t)r * g;
            if (r + 1 < b) {
                matvec2(NULL, NULL, y + (size_t)r * d, y + (size_t)(r + 1) * d, fc1, d, g, u0,
                        u0 + g);
                gelu_row(u0, 2 * g);
            } else {
                matvec_cols(NULL, y + (size_t)r * d, fc1, d, g, 0, u0);
                gelu_row(u0, g);
            }
        }
        for (int r = 0; r < b; r += 2) { /* its second layer and the residual: fc2 */
            const size_t o = (size_t)r * d;
            if (r + 1 < b)
                matvec2(x1 + o, x1 + o + d, u + (size_t)r * g, u + (size_t)(r + 1) * g, fc2, g, d,
                        os + o, os + o + d);
            else
                matvec_cols(x1 + o, u + (size_t)r * g, fc2, g, d, 0, os + o);
        }
    }
}

/* One LSTM block over one time chunk, for P bodies:
 *   x (P bodies at x_pstride floats apart -- 0 when all bodies read the same x; each (tc*B, d),
 *   time-major rows), wcat (P, 2d, 4d), fc1 (P, d, 4d), fc2 (P, 4d, d), h0 (body q's (B, d)
 *   at h0 + q * h0_pstride), n (P, B, d) in place -> h_last (P, B, d), out (P, tc*B, d) the
 *   block's output. Norms have no gain (folded into the matrix after them).
 * Returns 0, or 1 when scratch memory is short. */
int soma_lstm_block(const float *x, long x_pstride, const float *wcat, const float *fc1,
                    const float *fc2, const float *h0, long h0_pstride, float *n, float *h_last,
                    float *out, int p, int tc, int b, int d, float eps, int threads) {
    const size_t g = 4 * (size_t)d, rows = (size_t)tc * b;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : status)
    {
        float *scratch = malloc(sizeof(float) * (2 * (2 * (size_t)d + g) + (size_t)b * 6 * d));
        if (!scratch) {
            status = 1;
        } else {
#pragma omp for schedule(static)
            for (int q = 0; q < p; ++q) {
                float *hq = h_last + (size_t)q * b * d;
                memcpy(hq, h0 + (size_t)q * h0_pstride, sizeof(float) * b * d);
                block_body(x + (size_t)q * x_pstride, out + (size_t)q * rows * d,
                           wcat + (size_t)q * 2 * d * g, fc1 + (size_t)q * d * g,
                           fc2 + (size_t)q * g * d, hq, n + (size_t)q * b * d, (int)(rows / b), b,
                           d, eps, scratch);
            }
        }
        free(scratch);
    }
    return status;
}

/* log(sum(exp(z))) - z[t] over nc logits. */
static float nll_row(const float *z, int nc, long t) {
    float m = z[0];
    int j = 0;
    if (nc >= VW) {
        vf vm = load(z);
        for (j = VW; j + VW <= nc; j += VW) {
            vf v = load(z + j);
            vm = vselect(v > vm, v, vm);
        }
        for (int k = 0; k < VW; ++k) m = vm[k] > m ? vm[k] : m;
    }
    for (; j < nc; ++j) m = z[j] > m ? z[j] : m;
    vf acc = splat(0.0f);
    for (j = 0; j + VW <= nc; j += VW) acc += vexp(load(z + j) - m);
    float sum = hsum(acc);
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
