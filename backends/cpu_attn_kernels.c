/* CPU_ATTN kernel: paged attention read straight from the KV cache, no gather.
 *
 * Compiled on first use by backends/cpu_attn.py (plain C, no torch headers, ~1 s) and called
 * through ctypes. One call serves a whole mixed batch. For every (request, KV head, chunk of
 * query tokens) it keeps the chunk's query rows of all query heads sharing that KV head
 * (GQA/MQA packing), walks the request's visible keys page by page, converts each K/V row to
 * float once (fp32, fp16, bf16 or fp8 through a 256-entry table with the per-tensor scale
 * folded in) and runs an online softmax over tiles of keys. Work items are spread over
 * torch's OpenMP threads.
 *
 * Semantics are REFERENCE's (backends/reference.py): score = scale * q.k, then soft-cap, then
 * ALiBi slope * (j - p); causal / sliding-window visibility; sinks add probability mass only;
 * lse = natural log over the visible keys (sinks excluded).
 *
 * Block ids and lengths come from tensors and are never trusted: a key whose block id is
 * outside the cache is absent (its K/V are not read, it is masked out of the softmax like an
 * invisible key), and so are the keys past the end of the request's block-table row. A row
 * that sees no key gets out 0 and lse -inf.
 *
 * Where the time goes (benchmarks/bench_cpu_attn.py): at decode sizes, in staging K/V rows
 * (the K tile is transposed with scalar stores so that scores vectorize over keys) -- the
 * demo's decode step runs within 1.2x of dense SDPA on pre-gathered data; at prefill sizes and
 * head dim 32, in the fixed per-(row, tile) cost of the online softmax (mask, exp, rescale of
 * 32 keys), which a GEMM-blocked kernel amortizes better: prefill is ~1.9x the dense anchor.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_BF16 = 2, CACHE_U8_LUT = 3 };
enum { Q_ROWS = 32, KEY_TILE = 32 };

/* 8 floats in one register (GCC/Clang vector extension; AVX2 with -march=native). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f ld8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

typedef struct {
    const float *q;            /* [T, Hq, D] float32, strides below (elements) */
    int64_t q_st, q_sh;
    const void *k_cache, *v_cache; /* [blocks, block_size, Hkv, D or Dv], shared strides */
    int64_t c_sb, c_st, c_sh;
    int cache_kind;
    const float *lut;          /* 256 floats for CACHE_U8_LUT */
    float k_scale, v_scale;
    const int32_t *block_table; /* [B, width] */
    int64_t bt_stride;
    const int32_t *qsl, *seq_lens; /* [B+1], [B] */
    int num_reqs;
    float *out;                /* [T, Hq, Dv] float32 */
    int64_t o_st, o_sh;
    float *lse;                /* [T, Hq] or NULL */
    const float *sinks, *alibi; /* [Hq] or NULL */
    int hq, hkv, d, dv, block_size;
    float scale, soft_cap;     /* soft_cap <= 0: off */
    int window;                /* <= 0: off */
    int causal;
    int64_t num_blocks;        /* block ids outside [0, num_blocks): keys absent, never read */
    int64_t bt_width;          /* block-table columns: keys past a row's end are absent */
} Args;

typedef struct { int32_t req, head, t0, tokens; } Item;

/* exp(x) to ~2 ulp for x in [-87, 88] (0 below), written so that loops over it vectorize
 * (libm's expf does not): 2^n * poly(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cephes). */
static inline float fast_expf(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x <= -87.f ? 0.f : p * scale;
}

static inline float fast_tanhf(float y) {
    const float e = fast_expf(-2.f * fabsf(y));
    const float t = (1.f - e) / (1.f + e);
    return y < 0.f ? -t : t;
}

static inline float load_elem(const void *base, int64_t idx, int kind, const float *lut) {
    switch (kind) {
    case CACHE_F32: return ((const float *)base)[idx];
    case CACHE_F16: return (float)((const _Float16 *)base)[idx];
    case CACHE_BF16: {
        uint32_t bits = (uint32_t)((const uint16_t *)base)[idx] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    default: return lut[((const uint8_t *)base)[idx]];
    }
}

static inline __attribute__((always_inline)) void load_row(float *dst, const void *base,
                                                           int64_t off, int n, int kind,
                                                           const float *lut, float scale) {
    switch (kind) {
    case CACHE_F32: {
        const float *src = (const float *)base + off;
        for (int i = 0; i < n; i++) dst[i] = src[i];
        break;
    }
    case CACHE_F16: {
        const _Float16 *src = (const _Float16 *)base + off;
        for (int i = 0; i < n; i++) dst[i] = (float)src[i];
        break;
    }
    case CACHE_BF16:
        for (int i = 0; i < n; i++) dst[i] = load_elem(base, off + i, kind, lut);
        break;
    default: {
        const uint8_t *src = (const uint8_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = lut[src[i]] * scale;
    }
    }
}

static int tokens_per_item(const Args *a) {
    const int group = a->hq / a->hkv;
    return Q_ROWS / group > 0 ? Q_ROWS / group : 1;
}

static size_t scratch_floats(const Args *a) {
    const size_t rows = (size_t)tokens_per_item(a) * (a->hq / a->hkv);
    /* two int64 bounds (= 4 floats) + q, acc, m, l, slope per row; one K/V tile; one K row */
    return rows * (4 + a->d + a->dv + 3) + (size_t)KEY_TILE * (a->d + a->dv) + a->d;
}

/* One work item: `it->tokens` query tokens from `it->t0` of request `it->req`, all query
 * heads of KV head `it->head`. */
static void run_item(const Args *a, const Item *it, float *buf) {
    const int group = a->hq / a->hkv, d = a->d, dv = a->dv, r = it->req, h = it->head;
    const int64_t t0_rel = it->t0;
    const int64_t q0 = a->qsl[r], n = a->qsl[r + 1] - q0, s = a->seq_lens[r];
    const int rows = it->tokens * group;
    int64_t *lo_row = (int64_t *)buf;      /* [rows] */
    int64_t *hi_row = lo_row + rows;       /* [rows] */
    float *qf = (float *)(hi_row + rows);  /* [rows, d] */
    float *acc = qf + (size_t)rows * d;    /* [rows, dv] */
    float *m = acc + (size_t)rows * dv;    /* [rows] */
    float *l = m + rows;                   /* [rows] */
    float *slope = l + rows;               /* [rows] */
    float *kt = slope + rows;              /* [KEY_TILE, d] */
    float *vt = kt + KEY_TILE * d;         /* [KEY_TILE, dv] */
    float *krow = vt + KEY_TILE * dv;      /* [d] */

    for (int i = 0; i < rows; i++) {
        const int64_t t = q0 + t0_rel + i / group;
        const int head = h * group + i % group;
        const float *src = a->q + t * a->q_st + head * a->q_sh;
        for (int c = 0; c < d; c++) qf[i * d + c] = src[c] * a->scale;
        for (int c = 0; c < dv; c++) acc[i * dv + c] = 0.f;
        m[i] = -INFINITY;
        l[i] = 0.f;
        const int64_t p = s - n + t0_rel + i / group;
        int64_t lo = 0, hi = a->causal ? p : s - 1;
        if (a->window > 0) {
            lo = p - a->window + 1 > 0 ? p - a->window + 1 : 0;
            if (!a->causal && p + a->window - 1 < hi) hi = p + a->window - 1;
        }
        if (hi > a->bt_width * a->block_size - 1) hi = a->bt_width * a->block_size - 1;
        lo_row[i] = lo;
        hi_row[i] = hi;
        slope[i] = a->alibi ? a->alibi[head] : 0.f;
    }
    int64_t lo = lo_row[0], hi = hi_row[0];
    for (int i = 1; i < rows; i++) {
        if (lo_row[i] < lo) lo = lo_row[i];
        if (hi_row[i] > hi) hi = hi_row[i];
    }
    const int32_t *table = a->block_table + (int64_t)r * a->bt_stride;
    int64_t page = lo / a->block_size, slot = lo % a->block_size;
    for (int64_t j0 = lo; j0 <= hi; j0 += KEY_TILE) {
        const int nk = (int)(hi - j0 + 1 < KEY_TILE ? hi - j0 + 1 : KEY_TILE);
        /* K tile transposed to [d, KEY_TILE] so scores vectorize over keys (no horizontal
         * sums); columns past nk stay zero and are masked below. */
        if (nk < KEY_TILE) memset(kt, 0, sizeof(float) * KEY_TILE * d);
        const float *vrow[KEY_TILE];  /* fp32 caches are read in place, others converted */
        unsigned char present[KEY_TILE] = {0};  /* 0: its block id is outside the cache */
        for (int jj = 0; jj < nk; jj++) {
            const int64_t block = table[page];
            const int64_t off = block * a->c_sb + slot * a->c_st + (int64_t)h * a->c_sh;
            if (++slot == a->block_size) {
                slot = 0;
                page++;
            }
            present[jj] = block >= 0 && block < a->num_blocks;
            if (!present[jj]) {  /* zeros, masked below: never read */
                memset(vt + jj * dv, 0, sizeof(float) * dv);
                vrow[jj] = vt + jj * dv;
                for (int c = 0; c < d; c++) kt[c * KEY_TILE + jj] = 0.f;
                continue;
            }
            const float *kj = (const float *)a->k_cache + off;
            if (a->cache_kind != CACHE_F32) {
                load_row(krow, a->k_cache, off, d, a->cache_kind, a->lut, a->k_scale);
                kj = krow;
                load_row(vt + jj * dv, a->v_cache, off, dv, a->cache_kind, a->lut, a->v_scale);
                vrow[jj] = vt + jj * dv;
            } else {
                vrow[jj] = (const float *)a->v_cache + off;
            }
            for (int c = 0; c < d; c++) kt[c * KEY_TILE + jj] = kj[c];
        }
        for (int i = 0; i < rows; i++) {
            const float *restrict qi = qf + i * d;
            const int64_t p = s - n + t0_rel + i / group;
            float srow[KEY_TILE];
            v8f s0 = splat8(0.f), s1 = s0, s2 = s0, s3 = s0;  /* KEY_TILE = 4 x 8 */
            for (int c = 0; c < d; c++) {
                const v8f qc = splat8(qi[c]);
                const float *restrict kc = kt + c * KEY_TILE;
                s0 += qc * ld8(kc);
                s1 += qc * ld8(kc + 8);
                s2 += qc * ld8(kc + 16);
                s3 += qc * ld8(kc + 24);
            }
            st8(srow, s0);
            st8(srow + 8, s1);
            st8(srow + 16, s2);
            st8(srow + 24, s3);
            if (a->soft_cap > 0.f) {
                const float cap = a->soft_cap, inv_cap = 1.f / a->soft_cap;
                for (int jj = 0; jj < KEY_TILE; jj++)
                    srow[jj] = cap * fast_tanhf(srow[jj] * inv_cap);
            }
            const int64_t vis_lo = lo_row[i] - j0, vis_hi = hi_row[i] - j0;
            const float base = slope[i] * (float)(j0 - p), sl = slope[i];
            float tile_max = -INFINITY;
            for (int jj = 0; jj < KEY_TILE; jj++) {
                float x = srow[jj] + base + sl * (float)jj;
                x = (jj >= vis_lo && jj <= vis_hi && jj < nk && present[jj]) ? x : -INFINITY;
                srow[jj] = x;
                tile_max = x > tile_max ? x : tile_max;
            }
            if (tile_max == -INFINITY) continue;
            const float m_new = tile_max > m[i] ? tile_max : m[i];
            const float correction = m[i] == -INFINITY ? 0.f : fast_expf(m[i] - m_new);
            float sum = 0.f;
            for (int jj = 0; jj < KEY_TILE; jj++) {
                const float x = srow[jj];
                const float pj = x == -INFINITY ? 0.f : fast_expf(x - m_new);
                srow[jj] = pj;
                sum += pj;
            }
            float *restrict ai = acc + i * dv;
            int c0 = 0;
            for (; c0 + 16 <= dv; c0 += 16) {  /* accumulators stay in registers */
                const v8f corr = splat8(correction);
                v8f r0 = ld8(ai + c0) * corr, r1 = ld8(ai + c0 + 8) * corr;
                for (int jj = 0; jj < nk; jj++) {
                    const v8f pj = splat8(srow[jj]);
                    const float *restrict vj = vrow[jj] + c0;
                    r0 += pj * ld8(vj);
                    r1 += pj * ld8(vj + 8);
                }
                st8(ai + c0, r0);
                st8(ai + c0 + 8, r1);
            }
            for (; c0 < dv; c0++) {
                float r1 = ai[c0] * correction;
                for (int jj = 0; jj < nk; jj++) r1 += srow[jj] * vrow[jj][c0];
                ai[c0] = r1;
            }
            l[i] = l[i] * correction + sum;
            m[i] = m_new;
        }
    }
    for (int i = 0; i < rows; i++) {
        const int64_t t = q0 + t0_rel + i / group;
        const int head = h * group + i % group;
        float *dst = a->out + t * a->o_st + head * a->o_sh;
        if (l[i] == 0.f) {  /* no key (all absent): out 0, lse -inf */
            for (int c = 0; c < dv; c++) dst[c] = 0.f;
            if (a->lse) a->lse[t * a->hq + head] = -INFINITY;
            continue;
        }
        float denom = l[i];
        if (a->sinks) denom += expf(a->sinks[head] - m[i]);
        const float inv = 1.f / denom;
        for (int c = 0; c < dv; c++) dst[c] = acc[i * dv + c] * inv;
        if (a->lse) a->lse[t * a->hq + head] = m[i] + logf(l[i]);
    }
}

/* Per-thread scratch, grown on demand and kept across calls (no malloc in the hot path). */
static __thread float *scratch;
static __thread size_t scratch_size;

static float *get_scratch(size_t floats) {
    if (floats > scratch_size) {
        free(scratch);
        scratch = (float *)malloc(floats * sizeof(float));
        scratch_size = scratch ? floats : 0;
    }
    return scratch;
}

/* Runs the whole batch. Work items are (request, KV head, chunk of query tokens), handed out
 * dynamically to the OpenMP threads. Linked against libgomp.so.1, the kernel joins the thread
 * pool torch already runs (the loader resolves that soname to torch's copy), so it neither
 * creates threads nor competes with torch's spinning workers. Small batches run on the calling
 * thread. Returns 0 on success, 1 when out of memory, 2 on bad arguments. */
int attn_ops_cpu_paged_attention(Args *a, int num_threads) {
    if (a->hkv <= 0 || a->hq % a->hkv) return 2;
    const int tpi = tokens_per_item(a), group = a->hq / a->hkv;
    int64_t num_items = 0;
    for (int r = 0; r < a->num_reqs; r++) {
        const int64_t n = a->qsl[r + 1] - a->qsl[r];
        num_items += a->hkv * ((n + tpi - 1) / tpi);
    }
    if (num_items == 0) return 0;
    Item *items = (Item *)malloc(num_items * sizeof(Item));
    if (!items) return 1;
    int64_t w = 0, total = 0;
    for (int r = 0; r < a->num_reqs; r++) {
        const int64_t n = a->qsl[r + 1] - a->qsl[r], s = a->seq_lens[r];
        for (int64_t t0 = 0; t0 < n; t0 += tpi) {
            const int tokens = (int)(n - t0 < tpi ? n - t0 : tpi);
            int64_t keys = a->causal ? s - n + t0 + tokens : s;
            if (a->window > 0 && keys > a->window + tokens) keys = a->window + tokens;
            if (keys > a->bt_width * a->block_size) keys = a->bt_width * a->block_size;
            /* staging a K/V row costs about as much as 8 query rows using it */
            total += keys * ((int64_t)tokens * group + 8);
            for (int h = 0; h < a->hkv; h++) items[w++] = (Item){r, h, (int32_t)t0, tokens};
        }
    }
    total *= a->hkv;
    /* below ~20 us of work, waking other threads costs more than it saves */
    if (total < 4000) num_threads = 1;
    if (num_threads > num_items) num_threads = (int)num_items;
    const size_t floats = scratch_floats(a);
    int rc = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < num_items; i++) {
        if (rc) continue;
        float *buf = get_scratch(floats);
        if (!buf)
            rc = 1;
        else
            run_item(a, &items[i], buf);
    }
    free(items);
    return rc;
}
