/* Two no-grad kernels of the SOMA forward, for P bodies at once, in C (compiled for the host by
 * megatron_ext/soma/native.py):
 *
 * soma_lstm_block -- an LSTM block over one time chunk: the input projection norm(x) @ w_ih_t
 * for all rows of a pass, then per step z = zin + h @ whh_t and the cell in the arithmetic of
 * megatron_ext/soma/scan.py::lstm_scan_inplace (gates in the order i, f, o, g with the g columns
 * pre-scaled by 2, n = -2c carried instead of the cell state c):
 *
 *     i, f, o, s_g = sigmoid(z)              (each d wide)
 *     n <- f*n - 4*i*s_g + 2*i               (that is c <- f*c + i*g)
 *     h <- o - 2*o*sigmoid(n)                (that is o*tanh(c))
 *
 * then x1 = x + h and the MLP, out = x1 + gelu(norm(x1) @ fc1) @ fc2, again for all rows of the
 * pass (and for the last block the body's final norm). Each thread takes whole bodies; a pass's
 * rows (~64) keep their scratch in L2, so only the recurrent product runs b rows at a time, and
 * there is no kernel launch or thread barrier per step (the eager torch path has seven of each).
 * Widths may be padded to whole vectors (zero matrices in the padding; see soma_lstm_block).
 *
 * soma_head_nll -- the tied (or per-body) head's cross-entropy: per block of rows the logits
 * h @ wt and their log-sum-exp in cache, never stored.
 *
 * Products are register-tiled (tile_4/2/1 below). Vectors are GCC/Clang vector extensions; exp
 * (2^f by a polynomial, times 2^n) and GELU's erf (a rational) are fitted by
 * scripts/fit_kernel_approximations.py, so results match the torch path to float rounding
 * (tested against torch and float64).
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* AVX-512 only: rcp14, roundscale, scalef, min/max, reduce_max/add */
#endif
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* Floats per vector: 16 (one AVX-512 register) where the compiler targets AVX-512, else 8
 * (one AVX register, or two SSE ones). Measured on this project's AVX-512 host, the kernels'
 * time in one SPSA update (d = 32, 128 bodies, B = 16, T = 256): 0.23 s with 16, 0.32 s with 8.
 * -DSOMA_VW=8 forces 8. */
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

/* 2^f for |f| <= 1/2 by a degree-6 polynomial, fitted here (scripts/fit_kernel_approximations.py:
 * least maximum relative error on [-1/2, 1/2]): 1.9e-9 in float64, 9.6e-8 in float arithmetic. */
static inline vf exp2_poly(vf f) {
    vf p = splat(1.5345812196168425e-04f);
    p = p * f + 1.3399931881453082e-03f;
    p = p * f + 9.6184889622730040e-03f;
    p = p * f + 5.5503287753796662e-02f;
    p = p * f + 2.4022646890534879e-01f;
    p = p * f + 6.9314720573796207e-01f;
    return p * f + 1.0f;
}

#if defined(__AVX512F__) && VW == 16
/* exp(y), y <= 88.7 (above: inf): y*log2(e) = n + f with n an integer and |f| <= 1/2 (f by an
 * FMA with log2(e)'s float value and a correction for the rest of it), 2^f by exp2_poly, times
 * 2^n by vscalefps, which also gives 0 for n far below the normal range. 11 instructions. */
static inline vf vexp(vf y) {
    const __m512 x = (__m512)y;
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf f = (vf)_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269502162933349609375f),
                               _mm512_sub_ps(_mm512_setzero_ps(), n));
    f = f + y * 1.925962989e-08f; /* log2(e) - its float value */
    return (vf)_mm512_scalef_ps((__m512)exp2_poly(f), n);
}

static inline vf vmax(vf a, float b) { return (vf)_mm512_max_ps((__m512)a, _mm512_set1_ps(b)); }
static inline vf vmin(vf a, float b) { return (vf)_mm512_min_ps((__m512)a, _mm512_set1_ps(b)); }
#else
/* exp(y) for y in [-87, 88] (clamped): n = round(y log2 e); r = y - n ln2 with ln2 split in a
 * 9-bit high part (n times it is exact) and the rest; e^r = 2^(r log2 e) by exp2_poly; times 2^n
 * through the exponent bits. */
static inline vf vexp(vf y) {
    y = vselect(y < 88.0f, y, splat(88.0f));
    y = vselect(y > -87.0f, y, splat(-87.0f));
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const vf n = (y * 1.44269504088896341f + magic) - magic;
    const vf r = (y - n * 0.693359375f) - n * -2.12194440e-4f; /* ln2 = 0.693359375 - 2.12e-4 */
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return exp2_poly(r * 1.44269504088896341f) * scale;
}

static inline vf vmax(vf a, float b) { return vselect(a > b, a, splat(b)); }
static inline vf vmin(vf a, float b) { return vselect(a < b, a, splat(b)); }
#endif

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

/* 1 / (1 + e^-x); x >= -88 keeps e^-x finite (the reciprocal's Newton step needs it). */
static inline vf vsigmoid(vf x) { return vrecip(1.0f + vexp(-vmax(x, -88.0f))); }

/* GELU (the erf form, torch's default), 0.5 x (1 + erf(x / sqrt 2)), of a vector (vgelu), a float
 * (sgelu) or in place over n floats (gelu_row):
 * erf(x / sqrt 2) = x P(x^2) / Q(x^2), degree 5 over 5, |x| clamped to 4 sqrt 2 (where erf is 1
 * in float). Coefficients fitted here (scripts/fit_kernel_approximations.py: least maximum
 * error on [0, 4] for erf(u) = u P(u^2) / Q(u^2), then u = x / sqrt 2 folded in): 2.1e-8 in
 * float64, 4.3e-7 absolute in float arithmetic (GELU: within 1e-6 absolute everywhere, the most
 * near x = -5.5; 0 below the clamp). 23 instructions a vector where
 * Abramowitz & Stegun 7.1.26 (an exp and a reciprocal) took 38. */
static inline vf vgelu(vf x) {
    const vf c = vmin(vmax(x, -5.656854249f), 5.656854249f), s = c * c;
    vf p = splat(4.363321094e-08f), q = splat(1.171165844e-06f);
    p = p * s + 1.272868577e-05f;
    q = q * s + 7.601688917e-05f;
    p = p * s + 3.538570416e-04f;
    q = q * s + 1.930506835e-03f;
    p = p * s + 9.451696071e-03f;
    q = q * s + 2.911880285e-02f;
    p = p * s + 6.938370961e-02f;
    q = q * s + 2.536251676e-01f;
    p = p * s + 7.978844266e-01f;
    q = q * s + 1.0f;
    const vf half = 0.5f * x, y = half + half * (c * p * vrecip(q));
    return vselect(x > -5.656854249f, y, splat(0.0f)); /* not -x * 1 ulp, growing */
}

static inline float sgelu(float x) { return vgelu(splat(x))[0]; }

static void gelu_row(float *u, int n) {
    int j = 0;
    for (; j + VW <= n; j += VW) store(u + j, vgelu(load(u + j)));
    for (; j < n; ++j) u[j] = sgelu(u[j]);
}

static inline float ssigmoid(float x) {
    vf v = vsigmoid(splat(x));
    return v[0];
}

/* Register tiles of the matrix products: MR rows x NR vectors of the output in MR*NR
 * accumulators, each load of w feeding MR rows and each a[r, k] NR vectors. Measured on this
 * project's AVX-512 host, one thread, (48 x 64) @ (64 x 128): 6 rows x 4 vectors 214 GFLOP/s
 * where 2 rows x 8 vectors ran 144; (48 x 128) @ (128 x 32): 8 x 2 195, 12 x 2 203; 16 rows
 * (the recurrent product at B = 16), (16 x 32) @ (32 x 128): 8 x 2 181, 6 x 4 171 (it computes
 * 18 rows). AVX has 16 registers, not 32: half the rows. */
#if VW == 16
#define MR4 6
#define MR2 8
#define MR1 16
#else
#define MR4 3
#define MR2 6
#define MR1 8
#endif
#define UNROLL _Pragma("GCC unroll 16")

/* What a product applies to its outputs as it stores them (the gates' sigmoids, the MLP's GELU:
 * no second pass over them). */
enum { ACT_NONE, ACT_SIGMOID, ACT_GELU };

static inline vf activate(vf v, int act) {
    return act == ACT_SIGMOID ? vsigmoid(v) : act == ACT_GELU ? vgelu(v) : v;
}

/* tile_NR: z[r, :NR*VW] = act((init ? init[r, :] : 0) + sum_k a[r, k] w[k, :NR*VW]) for rows
 * r < mr (1 <= mr <= MR); rows at strides lda, ldw, ldz (init has z's layout and may be z). A
 * short tile repeats its last row in the spare accumulators and does not store them. */
#define TILE(NR, MR)                                                                             \
    static inline __attribute__((always_inline)) void tile_##NR(                                \
        const float *a, int lda, const float *w, int ldw, int kdim, const float *init, float *z, \
        int ldz, int mr, int act) {                                                              \
        const float *ar[MR];                                                                     \
        vf c[MR][NR];                                                                            \
        UNROLL for (int r = 0; r < MR; ++r) {                                                    \
            const size_t row = (size_t)(r < mr ? r : mr - 1);                                    \
            ar[r] = a + row * lda;                                                               \
            UNROLL for (int v = 0; v < NR; ++v) c[r][v] =                                        \
                init ? load(init + row * ldz + v * VW) : splat(0.0f);                            \
        }                                                                                        \
        for (int k = 0; k < kdim; ++k) {                                                         \
            vf wv[NR];                                                                           \
            UNROLL for (int v = 0; v < NR; ++v) wv[v] = load(w + (size_t)k * ldw + v * VW);     \
            UNROLL for (int r = 0; r < MR; ++r) {                                                \
                const float s = ar[r][k];                                                        \
                UNROLL for (int v = 0; v < NR; ++v) c[r][v] += s * wv[v];                        \
            }                                                                                    \
        }                                                                                        \
        UNROLL for (int r = 0; r < MR; ++r) if (r < mr) UNROLL for (int v = 0; v < NR; ++v)     \
            store(z + (size_t)r * ldz + v * VW, activate(c[r][v], act));                         \
    }
TILE(4, MR4)
TILE(2, MR2)
TILE(1, MR1)

static inline int imin(int a, int b) { return a < b ? a : b; }

/* z (rows, n) = act((init ? init : 0) + a (rows, kdim) @ w (kdim, n)), row-major at row strides
 * lda, ldw, ldz (init: z's layout, may be z). Column blocks of 4, 2, 1 vectors outside, row
 * tiles inside (a block of w stays in L1 for all rows); the last n % VW columns scalar. */
static void gemm(const float *a, int lda, const float *w, int ldw, int kdim, int n,
                 const float *init, float *z, int ldz, int rows, int act) {
    int j = 0;
#define BLOCKS(NR, MR)                                                                           \
    for (; j + NR * VW <= n; j += NR * VW)                                                       \
        for (int r = 0; r < rows; r += MR)                                                       \
            tile_##NR(a + (size_t)r * lda, lda, w + j, ldw, kdim,                                \
                      init ? init + (size_t)r * ldz + j : NULL, z + (size_t)r * ldz + j, ldz,    \
                      imin(MR, rows - r), act);
    if (rows % MR4 == 0 || rows % MR2 || rows > 2 * MR2)
        BLOCKS(4, MR4)
    /* else (a batch of 8 or 16 rows: the recurrent product) 2-vector tiles, no spare rows */
    BLOCKS(2, MR2)
    BLOCKS(1, MR1)
#undef BLOCKS
    for (; j < n; ++j)
        for (int r = 0; r < rows; ++r) {
            float acc = init ? init[(size_t)r * ldz + j] : 0.0f;
            for (int k = 0; k < kdim; ++k) acc += a[(size_t)r * lda + k] * w[(size_t)k * ldw + j];
            z[(size_t)r * ldz + j] = activate(splat(acc), act)[0];
        }
}

/* The cell of one row: z (4d) the gates' sigmoids in i, f, o, s order (the product stored them
 * so); n (d) in place; h_out (d). */
static void cell_row(const float *z, float *n, float *h_out, int d) {
    int j = 0;
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

/* the sum of v's lanes: shuffles within the register on AVX-512 (the scalar tree below, through
 * memory, took 9% of the block kernel's time on an AMD Zen 5 host: two sums per norm) */
static float hsum(vf v) {
#if defined(__AVX512F__) && VW == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    float t[VW];
    memcpy(t, &v, sizeof t);
    for (int w = VW / 2; w > 0; w /= 2) /* a tree: log2(VW) dependent adds, not VW */
        for (int k = 0; k < w; ++k) t[k] += t[k + w];
    return t[0];
#endif
}

/* x - mean over the vector at column k, with the lanes at or past column dn zeroed */
static inline vf centred(const float *x, int k, int dn, float mean) {
    vf t = load(x + k) - mean;
    if (k + VW <= dn) return t;
    vf lane;
    for (int l = 0; l < VW; ++l) lane[l] = (float)(k + l);
    return vselect(lane < (float)dn, t, splat(0.0f));
}

/* Layer norm of one row over its first dn of d columns (the rest are padding, zero in x and
 * set to zero in y): y = (x - mean) / sqrt(var + eps) (biased variance, as torch's layer_norm)
 * times gain where gain is not NULL -- inside a block the gain is folded into the matrix that
 * follows instead. y may be x. */
static void norm_row(const float *x, int d, int dn, float eps, const float *gain, float *y) {
    vf acc = splat(0.0f);
    int k = 0;
    for (; k + VW <= d; k += VW) acc += load(x + k);
    float mean = hsum(acc);
    for (; k < d; ++k) mean += x[k];
    mean /= (float)dn;
    acc = splat(0.0f);
    for (k = 0; k + VW <= d; k += VW) {
        vf t = centred(x, k, dn, mean);
        acc += t * t;
    }
    float var = hsum(acc);
    for (; k < dn; ++k) var += (x[k] - mean) * (x[k] - mean);
    const float inv = 1.0f / sqrtf(var / (float)dn + eps);
    for (k = 0; k + VW <= d; k += VW) {
        const vf t = centred(x, k, dn, mean) * inv;
        store(y + k, gain ? t * load(gain + k) : t);
    }
    for (; k < d; ++k) y[k] = k < dn ? (x[k] - mean) * inv * (gain ? gain[k] : 1.0f) : 0.0f;
}

/* o = a + b over d floats */
static void add_row(const float *a, const float *b, int d, float *o) {
    int k = 0;
    for (; k + VW <= d; k += VW) store(o + k, load(a + k) + load(b + k));
    for (; k < d; ++k) o[k] = a[k] + b[k];
}

/* Rows (steps x batch rows) per pass of block_body: the passes' scratch, ~10 d floats a row,
 * stays in L2. */
#define BLOCK_ROWS 64

/* One body of an LSTM block over tc steps of b rows (time-major: row s*b + r; x and out (tc*b,
 * d)); wcat = [w_ih_t; whh_t] (2d, 4d), fc1 (d, 4d), fc2 (4d, d); h and n (b, d) in place.
 * In passes over ts steps at a time (ts*b ~ BLOCK_ROWS rows):
 *   zin = norm(x) @ w_ih_t                          all rows at once
 *   per step: z = zin + h @ whh_t, the cell -> h    the recurrence: b rows
 *   x1 = x + h; u = gelu(norm(x1) @ fc1)            all rows at once
 *   out = x1 + u @ fc2                              all rows at once
 * so that only the recurrent product is done b rows at a time; with final_norm, out rows are
 * then normed (times gain unless NULL): the body's final norm. xn: norm(x) already computed
 * (an x shared by all bodies), or NULL. Scratch: ts*b*10d floats. */
static void block_body(const float *x, float *out, const float *wcat, const float *fc1,
                       const float *fc2, float *h, float *n, int tc, int b, int d, int dn,
                       float eps, int final_norm, const float *gain, const float *xn,
                       float *scratch) {
    const int g = 4 * d, ts = b >= BLOCK_ROWS ? 1 : BLOCK_ROWS / b;
    const float *w_ih = wcat, *w_hh = wcat + (size_t)d * g;
    float *y = scratch, *zin = y + (size_t)ts * b * d, *x1 = zin + (size_t)ts * b * g;
    float *u = x1 + (size_t)ts * b * d; /* (ts*b, d), (ts*b, 4d), (ts*b, d), (ts*b, 4d) */
    for (int s0 = 0; s0 < tc; s0 += ts) {
        const int m = imin(ts, tc - s0), rows = m * b;
        const float *xs = x + (size_t)s0 * b * d;
        if (!xn)
            for (int r = 0; r < rows; ++r)
                norm_row(xs + (size_t)r * d, d, dn, eps, NULL, y + (size_t)r * d);
        gemm(xn ? xn + (size_t)s0 * b * d : y, d, w_ih, g, d, g, NULL, zin, g, rows, ACT_NONE);
        for (int s = 0; s < m; ++s) {
            float *zs = zin + (size_t)s * b * g, *hs = x1 + (size_t)s * b * d;
            gemm(s ? hs - (size_t)b * d : h, d, w_hh, g, d, g, zs, zs, g, b, ACT_SIGMOID);
            for (int r = 0; r < b; ++r)
                cell_row(zs + (size_t)r * g, n + (size_t)r * d, hs + (size_t)r * d, d);
        }
        memcpy(h, x1 + (size_t)(m - 1) * b * d, sizeof(float) * b * d);
        for (int r = 0; r < rows; ++r) {
            float *x1r = x1 + (size_t)r * d;
            add_row(xs + (size_t)r * d, x1r, d, x1r);
            norm_row(x1r, d, dn, eps, NULL, y + (size_t)r * d);
        }
        gemm(y, d, fc1, g, d, g, NULL, u, g, rows, ACT_GELU);
        float *os = out + (size_t)s0 * b * d;
        gemm(u, g, fc2, d, g, d, x1, os, d, rows, ACT_NONE);
        if (final_norm)
            for (int r = 0; r < rows; ++r)
                norm_row(os + (size_t)r * d, d, dn, eps, gain, os + (size_t)r * d);
    }
}

/* One LSTM block over one time chunk, for P bodies:
 *   x (P bodies at x_pstride floats apart -- 0 when all bodies read the same x; each (tc*B, d),
 *   time-major rows), wcat (P, 2d, 4d), fc1 (P, d, 4d), fc2 (P, 4d, d), h0 (body q's (B, d)
 *   at h0 + q * h0_pstride), n (P, B, d) in place -> h_last (P, B, d), out (P, tc*B, d) the
 *   block's output. Norms have no gain (folded into the matrix after them). With final_norm
 *   the output is normed, times body q's gain at gain + q * g_pstride (d floats) unless gain is
 *   NULL: the last block and the body's final norm in one pass.
 * d may be the model's width dn padded to whole vectors: the matrices are then zero in the
 * padding (its rows, and each gate's and the MLP's padded columns) and so are x, h0 and n there;
 * norms take their statistics over the first dn columns, and the padding stays zero.
 * Returns 0, or 1 when scratch memory is short. */
int soma_lstm_block(const float *x, long x_pstride, const float *wcat, const float *fc1,
                    const float *fc2, const float *h0, long h0_pstride, float *n, float *h_last,
                    float *out, int p, int tc, int b, int d, int dn, float eps, int final_norm,
                    const float *gain, long g_pstride, int threads) {
    const size_t g = 4 * (size_t)d, rows = (size_t)tc * b;
    int status = 0;
    float *xn = NULL; /* one x for all bodies: its first norm once, not once a body */
    if (x_pstride == 0 && p > 1) {
        if (!(xn = malloc(sizeof(float) * rows * d))) return 1;
        for (size_t r = 0; r < rows; ++r) norm_row(x + r * d, d, dn, eps, NULL, xn + r * d);
    }
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : status)
    {
        const size_t ts = b >= BLOCK_ROWS ? 1 : BLOCK_ROWS / b;
        float *scratch = malloc(sizeof(float) * ts * b * 10 * d);
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
                           d, dn, eps, final_norm, gain ? gain + (size_t)q * g_pstride : NULL, xn,
                           scratch);
            }
        }
        free(scratch);
    }
    free(xn);
    return status;
}

/* Rows of logits per pass of soma_head_nll (a multiple of the widest tile's rows). */
#define HEAD_ROWS (2 * MR4)

/* the largest lane of v */
static float hmax(vf v) {
#if defined(__AVX512F__) && VW == 16
    return _mm512_reduce_max_ps((__m512)v);
#else
    float t[VW];
    memcpy(t, &v, sizeof t);
    for (int w = VW / 2; w > 0; w /= 2)
        for (int k = 0; k < w; ++k) t[k] = t[k + w] > t[k] ? t[k + w] : t[k];
    return t[0];
#endif
}

/* log(sum(exp(z))) - z[t] over nc logits; four accumulators per pass, so that neither the
 * maximum nor the sum is one long chain of dependent instructions. */
static float nll_row(const float *z, int nc, long t) {
    int j = 0;
    float m = z[0];
    if (nc >= 4 * VW) {
        vf m0 = load(z), m1 = load(z + VW), m2 = load(z + 2 * VW), m3 = load(z + 3 * VW);
        for (j = 4 * VW; j + 4 * VW <= nc; j += 4 * VW) {
            m0 = vselect(load(z + j) > m0, load(z + j), m0);
            m1 = vselect(load(z + j + VW) > m1, load(z + j + VW), m1);
            m2 = vselect(load(z + j + 2 * VW) > m2, load(z + j + 2 * VW), m2);
            m3 = vselect(load(z + j + 3 * VW) > m3, load(z + j + 3 * VW), m3);
        }
        m0 = vselect(m1 > m0, m1, m0);
        m2 = vselect(m3 > m2, m3, m2);
        m = hmax(vselect(m2 > m0, m2, m0));
    }
    for (; j < nc; ++j) m = z[j] > m ? z[j] : m;
    vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (j = 0; j + 4 * VW <= nc; j += 4 * VW) {
        a0 += vexp(load(z + j) - m);
        a1 += vexp(load(z + j + VW) - m);
        a2 += vexp(load(z + j + 2 * VW) - m);
        a3 += vexp(load(z + j + 3 * VW) - m);
    }
    for (; j + VW <= nc; j += VW) a0 += vexp(load(z + j) - m);
    float sum = hsum((a0 + a1) + (a2 + a3));
    for (; j < nc; ++j) sum += vexp(splat(z[j] - m))[0];
    return logf(sum) + m - z[t];
}

/* The head and cross-entropy of one time chunk, for P bodies: hidden states (body q's (rows, e)
 * at hid + q * h_pstride), decoder wt (e, v) row-major (body q's at wt + q * w_pstride; 0: one
 * shared), targets (body q's rows at tgt + q * t_pstride) -> out (P, rows) negative
 * log-likelihoods (nats). The (rows, v) logits are never stored: each block of HEAD_ROWS rows
 * is one product into scratch and one log-sum-exp a row, in cache. Returns 0, 1 when scratch memory is short,
 * 2 for a target outside 0..v-1. */
int soma_head_nll(const float *hid, long h_pstride, const float *wt, long w_pstride,
                  const long *tgt, long t_pstride, float *out, int p, int rows, int e, int v,
                  int threads) {
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : status)
    {
        float *z = malloc(sizeof(float) * HEAD_ROWS * (size_t)v);
        if (!z) {
            status = 1;
        } else {
#pragma omp for schedule(static)
            for (int q = 0; q < p; ++q) {
                const float *hq = hid + (size_t)q * h_pstride, *wq = wt + (size_t)q * w_pstride;
                const long *tq = tgt + (size_t)q * t_pstride;
                for (int r = 0; r < rows; r += HEAD_ROWS) {
                    const int nr = imin(HEAD_ROWS, rows - r);
                    gemm(hq + (size_t)r * e, e, wq, v, e, v, NULL, z, v, nr, ACT_NONE);
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

/* The kernels' own GELU (kind 0) or sigmoid (kind 1) over n floats in place: what the block
 * computes, exposed for the tests of its approximations. */
void soma_pointwise(float *u, long n, int kind) {
    long j = 0;
    if (kind == 0) {
        for (; j + 4096 <= n; j += 4096) gelu_row(u + j, 4096);
        gelu_row(u + j, (int)(n - j));
        return;
    }
    for (; j + VW <= n; j += VW) store(u + j, vsigmoid(load(u + j)));
    for (; j < n; ++j) u[j] = ssigmoid(u[j]);
}

/* For bench soma: the FMA rate of this build's vectors with no memory traffic, the arithmetic
 * peak any kernel here could reach. On each of `threads` threads, FMA_CHAINS independent
 * accumulators (enough to hide the FMA latency on two pipes) each take iters steps
 * c <- c * a + b, 2 * FMA_CHAINS * VW * iters flops a thread: their total is written to
 * *flops. Returns the sum of thread 0's accumulators' lanes, so that the work is kept and a test
 * can check it was done. */
#define FMA_CHAINS 12
float soma_fma_peak(long iters, int threads, double *flops) {
    float result = 0.0f;
    threads = threads > 0 ? threads : 1;
    *flops = 2.0 * FMA_CHAINS * VW * (double)iters * threads;
#pragma omp parallel num_threads(threads)
    {
        vf c[FMA_CHAINS];
        const vf a = splat(0.999f), b = splat(0.001f);
        UNROLL for (int k = 0; k < FMA_CHAINS; ++k) c[k] = splat((float)k);
        for (long i = 0; i < iters; ++i)
            UNROLL for (int k = 0; k < FMA_CHAINS; ++k) c[k] = c[k] * a + b;
        vf sum = splat(0.0f);
        UNROLL for (int k = 0; k < FMA_CHAINS; ++k) sum += c[k];
#ifdef _OPENMP
        if (omp_get_thread_num() == 0)
#endif
            result = hsum(sum);
    }
    return result;
}

/* Floats per vector of this build: callers pad widths to a multiple of it. */
int soma_vector_width(void) { return VW; }
