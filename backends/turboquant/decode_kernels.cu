// TurboQuant decode on the tensor cores (sm_80+): every preset -- 4-bit keys (4bit_nc), 3-bit
// keys (k3v4_nc, 3bit_nc), fp8 e4m3 keys (k8v4); 4-bit values, 3-bit under 3bit_nc.
//
// One CTA per (split of the context, KV head, decode row); its four warps each walk every
// fourth step of 16 keys of the split and keep their own online softmax (a split each for the
// combine, tq_combine_kernel). A warp's 16 query rows are the KV head's GQA group (up to 16
// heads; the rest zero).
//
//   scores  S[16 x 16] = Q_rot[16 x D] . C[D x 16]   (two m16n8k16 products a 16-coordinate chunk)
//   output  O[16 x D] += P'[16 x 16] . codes[16 x D] (one product an 8-column tile)
//
// A step's 16 slots are one contiguous run of its page (pages of 16 positions or more): the
// warp copies them into shared memory as 16-byte chunks (cp.async, kStages - 1 steps ahead),
// and its lanes read their fields from there. (Read from global memory in 2-byte words, a
// warp's load touches eight slots: a dozen L1 wavefronts, the L1 the busiest unit.)
//
// 4-bit keys: a byte of a slot's index field holds two coordinates' codes, and a B fragment
// register of the score product holds two consecutive coordinates of one key: one lookup of a
// 256-entry table (both centroids as a bf16 / fp16 pair) gives the register; the table is kept
// in 32 copies, lane l reading bank l, so a warp's lookup costs one wavefront. The norm
// correction sums the looked-up pairs' squares (on the tensor cores with
// ATTN_OPS_TQ_NORM_MMA). The coordinates are permuted so that lane t of a
// key reads the contiguous bytes [t D / 8, (t + 1) D / 8) of its field (the query is permuted
// alike when it is loaded: lane t's query words are coordinates [t D / 4, (t + 1) D / 4)).
// 3-bit keys: eight codes a group of three bytes, a register's pair six bits of it, looked up in
// a table of 64 entries. fp8 keys (not rotated, no norm): two bytes convert to the fp16
// pair of a B register. Either way lane t reads its key's codes of coordinates [t D / 4,
// (t + 1) D / 4).
// Values: a value is code * scale + min; the scale multiplies P (per key column) and the min
// adds sum_j P_j min_j to every column, so the product runs on the raw codes, exact in 16
// bits (kMagic + code: the code in a half's mantissa, no table). A B register holds two keys
// of one coordinate: one byte permute brings two keys' code words together, a shift and a mask
// give each register. Lane g of a warp owns the value codes of coordinates [g D / 8,
// (g + 1) D / 8) of its keys, so output tile 2p + s, column n holds coordinate n D / 8 + 2 p + s.
//
// Slot bytes (format.py, head dim D, LSB-first bit streams): [D KBITS / 8 key bytes | norm fp16 |
// D VBITS / 8 code bytes | scale fp16 | min fp16] (fp8 keys: no norm), only 2-byte aligned but
// for k8v4 (4), read in 16-bit words (k8v4's keys in 32-bit words).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace attn_ops_tq {

constexpr int kWarps = 4;
constexpr int kStages = 3;  // (a warp's tile buffers: steps in flight)
constexpr float kLog2e = 1.4426950408889634f;

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float fp16_at(const uint8_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

__device__ __forceinline__ uint32_t u16_at(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

// two e4m3 bytes (the low 16 bits of `w`) as an fp16 pair, the first byte low
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

struct Params {
  const uint16_t* q;          // [rows, num_heads, D] queries (bf16 / fp16 bits), rotated unless
                              // `rotate`
  const uint8_t* cache;       // [blocks, kv_heads, page, slot]
  const int32_t* block_table;  // [rows, max_blocks]
  const int32_t* seq_lens;    // [rows]: keys [0, seq_len) of each decode row
  const float* codebook;      // [16] centroids
  float* part_out;            // [rows, num_heads, splits * kWarps, D]
  float* part_lse;            // [rows, num_heads, splits * kWarps], natural log
  int64_t bt_stride;
  int num_blocks, kv_heads, group, page_shift, slot, splits, keys_per_split;  // (page 2^shift)
  float scale_log2;           // softmax scale * log2(e)
  int rotate;                 // 3- / 4-bit keys: rotate the queries here (q H)
};

// The slot of position `pos` of `row` for KV head `h` (pos < seq_len; a block id outside the
// cache reads block 0: slots are never trusted, and the row's result is then meaningless but
// no read leaves the cache).
__device__ __forceinline__ const uint8_t* slot_at(const Params& p, int row, int h, int pos) {
  int64_t blk = p.block_table[row * p.bt_stride + (pos >> p.page_shift)];
  blk = (blk < 0 || blk >= p.num_blocks) ? 0 : blk;
  const int64_t in_page = pos & ((1 << p.page_shift) - 1);
  return p.cache + (((blk * p.kv_heads + h) << p.page_shift) + in_page) * p.slot;
}

// A preset's slot at head dim D (format.py): the key field (codes then the fp16 norm; fp8 keys:
// D bytes), the value field (codes, fp16 scale, fp16 min), padded to an even size; a decode
// step's 16 slots (a tile) are a whole number of 16-byte chunks.
template <int D, int KBITS, int VBITS>
struct SlotLayout {
  static constexpr bool FP8K = KBITS == 8;
  static constexpr int KEY_BYTES = D * KBITS / 8;  // (the codes; fp8: the key)
  static constexpr int KEY_FIELD = FP8K ? D : KEY_BYTES + 2;
  static constexpr int VALUE_BYTES = D * VBITS / 8;
  static constexpr int FIELDS = KEY_FIELD + VALUE_BYTES + 4;
  static constexpr int SLOT = FIELDS + FIELDS % 2;
  static constexpr int TILE = 16 * SLOT;
  // the key table's entries (a byte of 4-bit codes, six bits of 3-bit ones; none for fp8)
  static constexpr int KLUT = FP8K ? 0 : (KBITS == 4 ? 256 : 64);
  // dynamic shared memory: the key table in 32 copies, then each warp's tile buffers
  static constexpr int SMEM = KLUT * 32 * 4 + kWarps * kStages * TILE;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// a bf16 / fp16 number's bits as a float
template <bool BF16>
__device__ __forceinline__ float half_bits_to_float(uint16_t x) {
  if constexpr (BF16) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  } else {
    return __half2float(__ushort_as_half(x));
  }
}

// a bf16 / fp16 pair as two floats, the low half first
template <bool BF16>
__device__ __forceinline__ void unpack2(uint32_t w, float& lo, float& hi) {
  if constexpr (BF16) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  } else {
    const __half2 h = *reinterpret_cast<const __half2*>(&w);
    lo = __low2float(h);
    hi = __high2float(h);
  }
}

// Value codes as numbers without a table: the code in a half's low mantissa bits under the
// exponent of kMagic (bf16 128, fp16 1024, whose unit in the last place is 1) reads kMagic +
// code exactly; the product's kMagic sum_j P'_j is taken off with the minima's term.
template <bool BF16>
constexpr float kMagic = BF16 ? 128.f : 1024.f;
template <bool BF16>
constexpr uint32_t kMagic2 = BF16 ? 0x43004300u : 0x64006400u;  // (kMagic, twice)
// bits 0.. and 16.. of x under kMagic2 (in a register: one LOP3, where the compiler would
// spend two on two immediates)
template <int BITS>
__device__ __forceinline__ uint32_t codes2(uint32_t x, uint32_t magic2) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;"  // (a & b) | c
      : "=r"(r)
      : "r"(x), "n"(BITS == 4 ? 0x000f000f : 0x00070007), "r"(magic2));
  return r;
}

// 2^x on the MUFU unit alone (exp2f adds a range check and a fix-up for results below
// 2^-126; probabilities that small flush to zero)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ATTN_OPS_TQ_NORM_MMA (Tuning.triton.turboquant_cuda_norm_mma, a build of its own): the norm
// correction's squared centroid norms on the tensor cores (two products a chunk) instead of
// four FP32 operations a B register.
#ifdef ATTN_OPS_TQ_NORM_MMA
constexpr bool kNormMma = true;
#else
constexpr bool kNormMma = false;
#endif

// ATTN_OPS_TQ_MIN_BLOCKS (Tuning.triton.turboquant_cuda_min_blocks, a build of its own): the
// CTAs an SM the decode's registers must allow; unset, the compiler's choice.
#ifdef ATTN_OPS_TQ_MIN_BLOCKS
#define ATTN_OPS_TQ_BOUNDS __launch_bounds__(kWarps * 32, ATTN_OPS_TQ_MIN_BLOCKS)
#else
#define ATTN_OPS_TQ_BOUNDS __launch_bounds__(kWarps * 32)
#endif

template <int D, bool BF16, bool NC, int KBITS, int VBITS>
__global__ void ATTN_OPS_TQ_BOUNDS tq_decode_kernel(Params p) {
  static_assert(D % 64 == 0 && D <= 256, "head dim: 64, 128 or 256");
  static_assert(KBITS == 3 || KBITS == 4 || KBITS == 8, "keys: 3 or 4 bits, or fp8");
  static_assert(VBITS == 3 || VBITS == 4, "values: 3 or 4 bits");
  using L = SlotLayout<D, KBITS, VBITS>;
  constexpr bool FP8K = L::FP8K;
  static_assert(!FP8K || (!BF16 && !NC), "fp8 keys: fp16 products, no norm correction");
  constexpr int KC = D / 16;        // 16-coordinate chunks of the score product
  constexpr int KEY_BYTES = L::KEY_BYTES, SLOT = L::SLOT, TILE = L::TILE;
  constexpr int KB = KEY_BYTES / 4;  // key bytes a lane of a key reads
  constexpr int VALUE_BYTES = L::VALUE_BYTES;
  constexpr int VB = VALUE_BYTES / 8;  // value bytes a lane reads of each of its keys
  constexpr int VSTART = L::KEY_FIELD;  // (the value codes; then scale, min)

  extern __shared__ __align__(16) uint8_t smem[];
  // klut[e * 32 + lane]: entry e (a pair of codes, the low one first) as a bf16 / fp16 pair of
  // centroids, one copy a bank: a warp's 32 lookups are one shared-memory wavefront
  uint32_t* klut = reinterpret_cast<uint32_t*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // entry e of this lane's copy at shared address kbase + 128 e: a byte permute takes e out
  // of the codes' word, one multiply-add makes the address
  const uint32_t kbase = static_cast<uint32_t>(__cvta_generic_to_shared(klut)) + 4 * lane;
  auto klookup = [kbase](uint32_t e) {
    uint32_t v;
    asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(kbase + e * 128u));
    return v;
  };
  uint8_t* const tiles = smem + L::KLUT * 32 * 4 + warp * kStages * TILE;  // this warp's
  const int split = blockIdx.x, h = blockIdx.y, row = blockIdx.z;
  const int g = lane >> 2, t = lane & 3;
  const int num_heads = p.kv_heads * p.group;
  const int seq = p.seq_lens[row];
  const int lo_key = split * p.keys_per_split;
  const int hi_key = min(seq, lo_key + p.keys_per_split);

  // The warp's steps (16 keys each, every fourth of the split) arrive by cp.async, kStages - 1
  // ahead: a step's 16 slots are contiguous in their page (a page of at least 16 positions, a
  // step starting at a multiple of 16), read as 16-byte chunks. Slots past the context in the
  // step's page are read too and never used: their keys are masked, their factors zeroed.
  auto fetch = [&](int step) {
    const int key0 = lo_key + 16 * (warp + kWarps * step);
    if (key0 < hi_key) {
      const uint8_t* src = slot_at(p, row, h, key0);
      uint8_t* dst = tiles + (step % kStages) * TILE;
#pragma unroll
      for (int c = lane; c < SLOT; c += 32) cp_async16(dst + 16 * c, src + 16 * c);
    }
    cp_async_commit();
  };
  // the query fragments: rows g and g + 8 of the group, lane t's coordinates [t D/4, (t+1) D/4)
  uint32_t qa[KC][4];
  const bool ok0 = g < p.group, ok1 = g + 8 < p.group;
  if (!FP8K && p.rotate) {
    // The group's queries rotated here: q H (Sylvester's H / sqrt(D)) as a fast Walsh-Hadamard
    // transform in fp32, in the tile buffers' space before the first fetch; rounded once.
    static_assert(16 * D * 4 <= kWarps * kStages * TILE, "the tile buffers hold 16 queries");
    float* qs = reinterpret_cast<float*>(smem + L::KLUT * 32 * 4);
    const uint16_t* qg = p.q + ((int64_t)row * num_heads + h * p.group) * D;
    const int n = p.group * D;
    for (int i = threadIdx.x; i < n; i += kWarps * 32) qs[i] = half_bits_to_float<BF16>(qg[i]);
#pragma unroll
    for (int len = 1; len < D; len <<= 1) {
      __syncthreads();
      for (int pr = threadIdx.x; pr < n / 2; pr += kWarps * 32) {
        const int i0 = (pr / (D / 2)) * D + (pr % (D / 2)) / len * 2 * len + pr % len;
        const float a = qs[i0], b = qs[i0 + len];
        qs[i0] = a + b;
        qs[i0 + len] = a - b;
      }
    }
    __syncthreads();
    const float rs = rsqrtf(float(D));
    const float* q0 = qs + g * D + t * (D / 4);
    const float* q1 = q0 + 8 * D;
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      qa[c][0] = ok0 ? pack2<BF16>(q0[4 * c] * rs, q0[4 * c + 1] * rs) : 0u;
      qa[c][1] = ok1 ? pack2<BF16>(q1[4 * c] * rs, q1[4 * c + 1] * rs) : 0u;
      qa[c][2] = ok0 ? pack2<BF16>(q0[4 * c + 2] * rs, q0[4 * c + 3] * rs) : 0u;
      qa[c][3] = ok1 ? pack2<BF16>(q1[4 * c + 2] * rs, q1[4 * c + 3] * rs) : 0u;
    }
    __syncthreads();  // (the space is the tiles' again)
  } else {
    const uint32_t* q0 = reinterpret_cast<const uint32_t*>(
        p.q + ((int64_t)row * num_heads + h * p.group + g) * D) + t * (D / 8);
    const uint32_t* q1 = q0 + 8 * D / 2;
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      qa[c][0] = ok0 ? q0[2 * c] : 0u;
      qa[c][1] = ok1 ? q1[2 * c] : 0u;
      qa[c][2] = ok0 ? q0[2 * c + 1] : 0u;
      qa[c][3] = ok1 ? q1[2 * c + 1] : 0u;
    }
  }

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) fetch(s);

  if constexpr (!FP8K) {
    constexpr int KMASK = (1 << KBITS) - 1;
    const float centroid = p.codebook[lane & KMASK];
    for (int e = warp; e < L::KLUT; e += kWarps) {
      const float lo = __shfl_sync(0xffffffffu, centroid, e & KMASK);
      const float hi = __shfl_sync(0xffffffffu, centroid, (e >> KBITS) & KMASK);
      klut[e * 32 + lane] = pack2<BF16>(lo, hi);
    }
  }
  __syncthreads();

  float o[2 * KC][4];
#pragma unroll
  for (int j = 0; j < 2 * KC; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running maxima of rows g, g + 8 (log2 units)
  float l0 = 0.f, l1 = 0.f;              // this lane's part of the rows' sums
  float n0 = 0.f, n1 = 0.f;              // this lane's part of sum_j P_j min_j - kMagic P'_j

  // The slot words of a step this lane reads from the tile: its score keys' (g, 8 + g) index
  // codes (KW words of its KB bytes; 32-bit words for fp8 keys, whose slots are 4-byte
  // aligned) and factors, its value keys' (2t, 2t + 1, 8 + 2t, 9 + 2t) code bytes (VW 16-bit
  // words from the even byte at or before g VB).
  constexpr int KW = FP8K ? KB / 4 : KB / 2;
  constexpr int VW = VB / 2 + (VB & 1);
  static_assert(KB % (FP8K ? 4 : 2) == 0, "a lane's key bytes: whole words");
  static_assert(VB % 2 == 0 || VB == 3, "an odd value field a lane: one group of three bytes");
  const int vodd = (g * VB) & 1;  // (a lane's value bytes from an odd byte: D 64, 3 bits)
  const uint32_t magic2 = kMagic2<BF16>;

  int step = 0;
  for (int key0 = lo_key + 16 * warp; key0 < hi_key; key0 += 16 * kWarps, ++step) {
    fetch(step + kStages - 1);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const uint8_t* tile = tiles + (step % kStages) * TILE;
    uint32_t kw[2][KW];
    float kscale[2], vscale[2], vmin[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint8_t* sl = tile + (8 * nt + g) * SLOT;
#pragma unroll
      for (int i = 0; i < KW; ++i) {
        if constexpr (FP8K) {
          kw[nt][i] = *reinterpret_cast<const uint32_t*>(sl + t * KB + 4 * i);
        } else {
          kw[nt][i] = u16_at(sl + t * KB + 2 * i);
        }
      }
      const bool mine = key0 + 8 * nt + g < hi_key;
      kscale[nt] = mine ? (FP8K ? 1.f : fp16_at(sl + KEY_BYTES)) * p.scale_log2 : 0.f;
      vscale[nt] = mine ? fp16_at(sl + VSTART + VALUE_BYTES) : 0.f;
      vmin[nt] = mine ? fp16_at(sl + VSTART + VALUE_BYTES + 2) : 0.f;
    }

    // S = Q C^T over this lane's own keys (the product's columns g and 8 + g); b[nt] the
    // B fragment of chunk c, keys 8 nt + g
    float s[2][4], sq[2] = {0.f, 0.f}, nsq[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      nsq[nt][0] = nsq[nt][1] = nsq[nt][2] = nsq[nt][3] = 0.f;
    }
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      uint32_t b[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if constexpr (FP8K) {
          const uint32_t w = kw[nt][c];
          b[nt][0] = e4m3x2_to_f16x2(w);
          b[nt][1] = e4m3x2_to_f16x2(w >> 16);
        } else if constexpr (KBITS == 3) {  // (chunk c: group c / 2's pairs 2 (c % 2), +1)
          const int g3 = 3 * (c >> 1);  // (the group's first byte in the lane's field)
          const uint32_t bits = ((kw[nt][g3 >> 1] | (kw[nt][(g3 >> 1) + 1] << 16)) >>
                                 (8 * (g3 & 1))) >> (12 * (c & 1));
          b[nt][0] = klookup(bits & 63);
          b[nt][1] = klookup((bits >> 6) & 63);
        } else {
          const uint32_t w = kw[nt][c];
          b[nt][0] = klookup(__byte_perm(w, 0u, 0x4440));  // (byte 0 of w, zero-extended)
          b[nt][1] = klookup(__byte_perm(w, 0u, 0x4441));  // (byte 1)
        }
        if constexpr (NC && !kNormMma) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            float lo, hi;
            unpack2<BF16>(b[nt][i], lo, hi);
            sq[nt] = fmaf(lo, lo, fmaf(hi, hi, sq[nt]));
          }
        }
        mma16816<BF16>(s[nt], qa[c], b[nt][0], b[nt][1]);
      }
      if constexpr (NC && kNormMma) {
        // A = the two tiles' B fragments transposed (rows g: key g, rows 8 + g: key 8 + g --
        // a lane's own registers): A B's diagonal is each key's squared centroid norm, D[g][g]
        // of tile 0 and D[8 + g][g] of tile 1, at lane (g, g / 2)
        const uint32_t at[4] = {b[0][0], b[1][0], b[0][1], b[1][1]};
        mma16816<BF16>(nsq[0], at, b[0][0], b[0][1]);
        mma16816<BF16>(nsq[1], at, b[1][0], b[1][1]);
      }
    }
    if constexpr (NC) {  // (the key's centroid vector to unit length)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float n2;
        if constexpr (kNormMma) {  // (right at lane (g, g / 2) only: the columns read there)
          n2 = (g & 1) ? nsq[nt][2 * nt + 1] : nsq[nt][2 * nt];
        } else {  // (over the lanes of a key)
          n2 = sq[nt] + __shfl_xor_sync(0xffffffffu, sq[nt], 1);
          n2 += __shfl_xor_sync(0xffffffffu, n2, 2);
        }
        kscale[nt] *= rsqrtf(n2 + 1e-16f);
      }
    }
    // each column's factors from a lane owning its key (lanes 4 k to 4 k + 3 hold key k of a
    // tile; its norm by the tensor cores at 4 k + k / 2)
    float mx0 = -INFINITY, mx1 = -INFINITY;
    float cvs[2][2], cvm[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = 2 * t + e, src = 4 * key + (NC && kNormMma ? key >> 1 : 0);
        const float ks = __shfl_sync(0xffffffffu, kscale[nt], src);
        cvs[nt][e] = __shfl_sync(0xffffffffu, vscale[nt], src);
        cvm[nt][e] = __shfl_sync(0xffffffffu, vmin[nt], src);
        const bool ok = key0 + 8 * nt + 2 * t + e < hi_key;
        s[nt][e] = ok ? s[nt][e] * ks : -INFINITY;
        s[nt][2 + e] = ok ? s[nt][2 + e] * ks : -INFINITY;
        mx0 = fmaxf(mx0, s[nt][e]);
        mx1 = fmaxf(mx1, s[nt][2 + e]);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
    // (a row that has seen only masked keys keeps -inf: its factors stay finite at 0)
    const float base0 = new0 == -INFINITY ? 0.f : new0, base1 = new1 == -INFINITY ? 0.f : new1;
    const float a0 = fast_exp2(m0 - base0), a1 = fast_exp2(m1 - base1);
    m0 = new0;
    m1 = new1;
    l0 *= a0;
    l1 *= a1;
    n0 *= a0;
    n1 *= a1;
    if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {  // (a new maximum: rarely, later)
#pragma unroll
      for (int j = 0; j < 2 * KC; ++j) {
        o[j][0] *= a0;
        o[j][1] *= a0;
        o[j][2] *= a1;
        o[j][3] *= a1;
      }
    }
    // P' = P scale, rounded as the product reads it: kMagic sum_j P'_j leaves with n
    uint32_t pfrag[4];  // (A fragment order: rows g / g + 8 of keys 2t, 2t+1, then 8+2t, 9+2t)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float pr[4];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        pr[e] = fast_exp2(s[nt][e] - base0);
        pr[2 + e] = fast_exp2(s[nt][2 + e] - base1);
        l0 += pr[e];
        l1 += pr[2 + e];
        n0 += pr[e] * cvm[nt][e];
        n1 += pr[2 + e] * cvm[nt][e];
        pr[e] *= cvs[nt][e];
        pr[2 + e] *= cvs[nt][e];
      }
      pfrag[2 * nt] = pack2<BF16>(pr[0], pr[1]);
      pfrag[2 * nt + 1] = pack2<BF16>(pr[2], pr[3]);
      float r0, r1, r2, r3;
      unpack2<BF16>(pfrag[2 * nt], r0, r1);
      unpack2<BF16>(pfrag[2 * nt + 1], r2, r3);
      n0 -= kMagic<BF16> * (r0 + r1);
      n1 -= kMagic<BF16> * (r2 + r3);
    }
    uint32_t v[4][VW];  // (read here, after the softmax: fewer registers live across it)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint8_t* vp = tile + (2 * t + (k & 1) + 8 * (k >> 1)) * SLOT + VSTART + g * VB - vodd;
#pragma unroll
      for (int i = 0; i < VW; ++i) v[k][i] = u16_at(vp + 2 * i);
    }
    // O += P' codes: lane g owns coordinates [g D / 8, (g + 1) D / 8) of its value keys; pair
    // q (coordinates g D / 8 + 2 q, + 1) goes to tiles 2 q, 2 q + 1; a B register holds two
    // keys' codes of one coordinate: x01 (keys 2t, 2t + 1) and x23 (8 + 2t, 9 + 2t) hold a
    // code field of each key in their low and high halves
    auto pair_product = [&](int q, uint32_t x01, uint32_t x23, int lo_bit, int hi_bit) {
      mma16816<BF16>(o[2 * q], pfrag, codes2<VBITS>(x01 >> lo_bit, magic2),
                     codes2<VBITS>(x23 >> lo_bit, magic2));
      mma16816<BF16>(o[2 * q + 1], pfrag, codes2<VBITS>(x01 >> hi_bit, magic2),
                     codes2<VBITS>(x23 >> hi_bit, magic2));
    };
    if constexpr (VBITS == 4) {  // (a 16-bit word: two bytes, each two coordinates' codes)
#pragma unroll
      for (int w = 0; w < VB / 2; ++w) {
        const uint32_t x01 = __byte_perm(v[0][w], v[1][w], 0x5410);
        const uint32_t x23 = __byte_perm(v[2][w], v[3][w], 0x5410);
        pair_product(2 * w, x01, x23, 0, 4);
        pair_product(2 * w + 1, x01, x23, 8, 12);
      }
    } else {  // (3-bit: a group of eight codes in three bytes, four pairs)
#pragma unroll
      for (int grp = 0; grp < VB / 3; ++grp) {
        // (the group's first byte from the lane's first word: 3 grp, one more where the field
        // starts at an odd byte -- only when VB is 3, a single group)
        const int wi = (3 * grp) >> 1, sh = 8 * (((3 * grp) & 1) + vodd);
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (v[k][wi] | (v[k][wi + 1] << 16)) >> sh;
        // bits 0-15 of each key's group (pairs 0, 1), then bits 8-23 (pairs 2, 3)
        const uint32_t y01 = __byte_perm(w[0], w[1], 0x5410), y23 = __byte_perm(w[2], w[3], 0x5410);
        const uint32_t z01 = __byte_perm(w[0], w[1], 0x6521), z23 = __byte_perm(w[2], w[3], 0x6521);
        pair_product(4 * grp, y01, y23, 0, 3);
        pair_product(4 * grp + 1, y01, y23, 6, 9);
        pair_product(4 * grp + 2, z01, z23, 4, 7);
        pair_product(4 * grp + 3, z01, z23, 10, 13);
      }
    }
    __syncwarp();  // (every lane done with the buffer before a later fetch refills it)
  }

  // the warp's split: rows' sums across the lanes of a row, then out = (O + n) / l
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  n0 += __shfl_xor_sync(0xffffffffu, n0, 1);
  n0 += __shfl_xor_sync(0xffffffffu, n0, 2);
  n1 += __shfl_xor_sync(0xffffffffu, n1, 1);
  n1 += __shfl_xor_sync(0xffffffffu, n1, 2);
  const int splits = p.splits * kWarps, part = split * kWarps + warp;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head_in_group = g + 8 * r;
    if (head_in_group >= p.group) continue;
    const float l = r ? l1 : l0, n = r ? n1 : n0, m = r ? m1 : m0;
    const int64_t at = ((int64_t)row * num_heads + h * p.group + head_in_group) * splits + part;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* out = p.part_out + at * D;
#pragma unroll
    for (int j = 0; j < 2 * KC; ++j) {
      const int pair = j >> 1, odd = j & 1;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 2 * t + e;  // the tile's column: coordinate col D / 8 + 2 pair + odd
        out[col * (D / 8) + 2 * pair + odd] = (o[j][2 * r + e] + n) * inv;
      }
    }
    if (t == 0) p.part_lse[at] = l > 0.f ? (m + log2f(l)) / kLog2e : -INFINITY;
  }
}

// The output's dtype from fp32, rounded to nearest (torch builds extensions without the
// implicit half / bfloat16 conversions).
__device__ __forceinline__ void store_out(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_out(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

// The splits merged: out[row, head] = sum_p w_p o_p / sum_p w_p with w_p = exp(lse_p - max),
// lse = max + log sum_p w_p; rows from query_start_loc[-1] on (padding) and rows without keys
// zero. One CTA a (head, row); `out` [rows, heads, D] at its strides, in its dtype.
template <typename T>
__global__ void tq_combine_kernel(const float* __restrict__ part_out,
                                  const float* __restrict__ part_lse, const int32_t* live_rows,
                                  T* out, float* lse, int parts, int d, int64_t out_row,
                                  int64_t out_head) {
  const int head = blockIdx.x, row = blockIdx.y, heads = gridDim.x;
  const int64_t at = (int64_t)row * heads + head;
  const float* l = part_lse + at * parts;
  float top = -INFINITY;
  for (int i = 0; i < parts; ++i) top = fmaxf(top, l[i]);
  const bool live = row < *live_rows && top > -INFINITY;
  float total = 0.f;
  for (int i = 0; i < parts; ++i) total += live ? __expf(l[i] - top) : 0.f;
  const float inv = live ? 1.f / total : 0.f;
  T* dst = out + row * out_row + head * out_head;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    if (live) {
      const float* o = part_out + at * parts * d + c;
      for (int i = 0; i < parts; ++i) acc += __expf(l[i] - top) * o[(int64_t)i * d];
    }
    store_out(dst + c, acc * inv);
  }
  if (lse != nullptr && threadIdx.x == 0) lse[at] = live ? top + __logf(total) : 0.f;
}

}  // namespace attn_ops_tq

#ifndef ATTN_OPS_KERNEL_ONLY
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

// The decode kernel of a (head dim, query dtype, preset), its dynamic shared memory allowed
// once a device (above 48 KB).
template <int D, bool BF16, bool NC, int KBITS, int VBITS>
const void* decode_kernel() {
  using namespace attn_ops_tq;
  static bool allowed[64] = {};
  const int dev = c10::cuda::current_device();
  const void* kernel = reinterpret_cast<const void*>(tq_decode_kernel<D, BF16, NC, KBITS, VBITS>);
  if (dev >= 64 || !allowed[dev]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        SlotLayout<D, KBITS, VBITS>::SMEM));
    if (dev < 64) allowed[dev] = true;
  }
  return kernel;
}

struct Launch {  // one decode launch
  const attn_ops_tq::Params& p;
  dim3 grid;
  cudaStream_t stream;
  template <int D, bool BF16, bool NC, int KBITS, int VBITS>
  void run() const {
    using namespace attn_ops_tq;
    using L = SlotLayout<D, KBITS, VBITS>;
    TORCH_CHECK(p.slot == L::SLOT, "turboquant decode: slot of ", p.slot, " bytes, expected ",
                L::SLOT, " at head dim ", D);
    decode_kernel<D, BF16, NC, KBITS, VBITS>();
    tq_decode_kernel<D, BF16, NC, KBITS, VBITS><<<grid, kWarps * 32, L::SMEM, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

struct Occupancy {  // the decode kernel's CTAs an SM
  int* blocks;
  template <int D, bool BF16, bool NC, int KBITS, int VBITS>
  void run() const {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks, decode_kernel<D, BF16, NC, KBITS, VBITS>(), attn_ops_tq::kWarps * 32,
        attn_ops_tq::SlotLayout<D, KBITS, VBITS>::SMEM));
  }
};

// f.run<D, BF16, NC, KBITS, VBITS>() for a head dim, query dtype and preset (3- and 4-bit keys
// norm-corrected; fp8 keys with fp16 queries)
template <typename F>
void dispatch(int64_t d, bool bf16, int64_t key_bits, int64_t value_bits, const F& f) {
  TORCH_CHECK(key_bits != 8 || !bf16, "turboquant decode: fp8 keys take an fp16 query");
#define ATTN_OPS_TQ_PRESETS(D_, B_)                                                        \
  if (key_bits == 4 && value_bits == 4) f.template run<D_, B_, true, 4, 4>();               \
  else if (key_bits == 3 && value_bits == 4) f.template run<D_, B_, true, 3, 4>();          \
  else if (key_bits == 3 && value_bits == 3) f.template run<D_, B_, true, 3, 3>();          \
  else TORCH_CHECK(false, "turboquant decode: no preset of ", key_bits, "-bit keys and ",   \
                   value_bits, "-bit values");
#define ATTN_OPS_TQ_DISPATCH(D_)                                                           \
  if (d == D_) {                                                                           \
    if (key_bits == 8 && value_bits == 4) f.template run<D_, false, false, 8, 4>();         \
    else if (bf16) { ATTN_OPS_TQ_PRESETS(D_, true) }                                       \
    else { ATTN_OPS_TQ_PRESETS(D_, false) }                                                \
    return;                                                                                \
  }
  ATTN_OPS_TQ_DISPATCH(64)
  ATTN_OPS_TQ_DISPATCH(128)
  ATTN_OPS_TQ_DISPATCH(256)
#undef ATTN_OPS_TQ_DISPATCH
#undef ATTN_OPS_TQ_PRESETS
  TORCH_CHECK(false, "turboquant decode: head_dim=", d, " must be 64, 128 or 256");
}

// blocks_per_sm(device, head_dim, bf16, key_bits, value_bits): the decode's CTAs an SM of CUDA
// device `device` at its registers and shared memory (the splits are chosen to fill whole waves
// of them).
int64_t blocks_per_sm(int64_t device, int64_t d, bool bf16, int64_t key_bits,
                      int64_t value_bits) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  int blocks = 0;
  dispatch(d, bf16, key_bits, value_bits, Occupancy{&blocks});
  return blocks;
}

// decode(q [rows, Hq, D] bf16 / fp16 (for 3- / 4-bit keys rotated unless `rotate`; fp16 for
// fp8 keys), cache uint8 [blocks, Hk, page, slot], block_table int32 [rows, max_blocks],
// seq_lens int32 [rows], codebook fp32 [2^key_bits], part_out fp32 [rows, Hq, splits * 4, D],
// part_lse fp32 [rows, Hq, splits * 4], splits, keys_per_split, scale, key_bits (3, 4; 8: fp8),
// value_bits (3, 4), rotate (3- and 4-bit keys: q comes unrotated, the kernel rotates it)):
// every decode row's splits (inputs checked by the caller).
void decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
            torch::Tensor seq_lens, torch::Tensor codebook, torch::Tensor part_out,
            torch::Tensor part_lse, int64_t splits, int64_t keys_per_split, double scale,
            int64_t key_bits, int64_t value_bits, bool rotate) {
  using namespace attn_ops_tq;
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && block_table.stride(1) == 1 &&
                  part_out.is_contiguous() && part_lse.is_contiguous() &&
                  (key_bits == 8 || codebook.numel() == (1 << key_bits)),
              "turboquant decode: contiguous inputs and a codebook of 2^key_bits centroids");
  const int rows = q.size(0), heads = q.size(1);
  const int kv_heads = cache.size(1);
  Params p;
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  p.cache = cache.data_ptr<uint8_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.codebook = codebook.data_ptr<float>();
  p.part_out = part_out.data_ptr<float>();
  p.part_lse = part_lse.data_ptr<float>();
  p.bt_stride = block_table.stride(0);
  p.num_blocks = cache.size(0);
  p.kv_heads = kv_heads;
  p.group = heads / kv_heads;
  const int page = cache.size(2);
  TORCH_CHECK(page >= 16 && (page & (page - 1)) == 0, "turboquant decode: page ", page,
              " must be a power of two of at least 16 (a step's 16 slots in one page)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p.cache) % 16 == 0,
              "turboquant decode: the cache must start at a 16-byte aligned address");
  p.page_shift = __builtin_ctz(page);
  p.slot = cache.size(3);
  p.splits = splits;
  p.keys_per_split = keys_per_split;
  p.scale_log2 = float(scale) * kLog2e;
  p.rotate = rotate ? 1 : 0;
  if (rows == 0) return;
  dispatch(q.size(2), q.scalar_type() == at::kBFloat16, key_bits, value_bits,
           Launch{p, dim3(splits, kv_heads, rows), c10::cuda::getCurrentCUDAStream()});
}

// combine(part_out, part_lse, query_start_loc, out [rows, Hq, D] (any float dtype, unit last
// stride), lse [rows, Hq] fp32 or None): tq_combine_kernel, one launch.
void combine(torch::Tensor part_out, torch::Tensor part_lse, torch::Tensor query_start_loc,
             torch::Tensor out, c10::optional<torch::Tensor> lse) {
  using namespace attn_ops_tq;
  const int rows = out.size(0), heads = out.size(1), d = out.size(2);
  TORCH_CHECK(out.stride(2) == 1 && part_out.is_contiguous() && part_lse.is_contiguous() &&
                  query_start_loc.scalar_type() == at::kInt &&
                  (!lse.has_value() || (lse->is_contiguous() && lse->numel() == rows * heads)),
              "turboquant combine: contiguous partials, unit-stride out, int32 query_start_loc");
  if (rows == 0) return;
  const int parts = part_lse.size(2);
  const int32_t* live = query_start_loc.data_ptr<int32_t>() + (query_start_loc.numel() - 1);
  float* lse_ptr = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  const dim3 grid(heads, rows), block(128);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
#define ATTN_OPS_TQ_COMBINE(T_, C_)                                                          \
  tq_combine_kernel<T_><<<grid, block, 0, stream>>>(                                        \
      part_out.data_ptr<float>(), part_lse.data_ptr<float>(), live,                          \
      reinterpret_cast<T_*>(out.data_ptr<C_>()), lse_ptr, parts, d, out.stride(0),            \
      out.stride(1))
  if (out.scalar_type() == at::kBFloat16) ATTN_OPS_TQ_COMBINE(__nv_bfloat16, at::BFloat16);
  else if (out.scalar_type() == at::kHalf) ATTN_OPS_TQ_COMBINE(__half, at::Half);
  else ATTN_OPS_TQ_COMBINE(float, float);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode);
  m.def("blocks_per_sm", &blocks_per_sm);
  m.def("combine", &combine);
}
#else
template __global__ void attn_ops_tq::tq_decode_kernel<128, true, true, 4, 4>(attn_ops_tq::Params);
template __global__ void attn_ops_tq::tq_decode_kernel<128, true, true, 3, 4>(attn_ops_tq::Params);
template __global__ void attn_ops_tq::tq_decode_kernel<128, true, true, 3, 3>(attn_ops_tq::Params);
template __global__ void attn_ops_tq::tq_decode_kernel<128, false, false, 8, 4>(
    attn_ops_tq::Params);
template __global__ void attn_ops_tq::tq_decode_kernel<64, false, true, 3, 3>(attn_ops_tq::Params);
template __global__ void attn_ops_tq::tq_decode_kernel<256, true, true, 4, 4>(attn_ops_tq::Params);
template __global__ void attn_ops_tq::tq_combine_kernel<__nv_bfloat16>(
    const float*, const float*, const int32_t*, __nv_bfloat16*, float*, int, int, int64_t,
    int64_t);
#endif
