// TurboQuant's cache write on CUDA (sm_80+): the slots of format.py, every preset (3- / 4-bit
// rotated keys with their norm, or fp8 e4m3 keys; 3- / 4-bit values with their scale and
// minimum), head dims 64 / 128 / 256, the keys' RoPE in the launch.
//
// The write is a few arithmetic steps a coordinate against 2-2.4 bytes moved, so its speed is
// its instruction count. Lane j of a vector's L = D / 16 lanes holds coordinates
// [16 j, 16 j + 16) of its key and value (one warp: 32 / L (token, KV head) pairs):
//   - the inputs arrive in 16-byte loads;
//   - RoPE: coordinate d's partner d +- D / 2 is the same register of lane j ^ L / 2;
//   - the norm, and the values' minimum and maximum: a lane's 16, then log2 L shuffles;
//   - the Hadamard rotation: a fast Walsh-Hadamard transform of the raw key (it is linear:
//     1 / (sqrt(D) ||k||) is applied after), four stages within a lane, log2 L across lanes
//     (a shuffle and one FMA a coordinate each);
//   - a key code: how many midpoints are at or below y, read from a table over a uniform grid
//     of y in [-1, 1] (format.code_lookup): u = y S + A picks cell round(u) by one add of
//     1.5 2^23, and a cell holds the count below it and the one midpoint inside it, if any --
//     one shared-memory read and one compare, not a search;
//   - a value code: (v - lo) / s by a reciprocal and two Markstein steps (the round-to-nearest
//     quotient, as torch's division gives), then floor(q + 0.5);
//   - the packing: a lane's 16 codes are 8 (4 bits) or 6 (3 bits) whole bytes of the stream,
//     stored as 16-bit words (slots are 2-byte aligned), two to a 4-byte store where the
//     address allows (4-bit codes and fp8 keys: store_words).
// The arithmetic is the torch write's (format.quantize_slots): IEEE sqrt, RoPE as two rounded
// products and a rounded sum, the key rounded to its dtype after it. Summation orders differ
// (the norm, the rotation), and the key is scaled after the rotation: a key index whose
// coordinate sits at a codebook midpoint may differ, as the Triton write's may.
//
// A token entering its page (row 0 of it) zeroes the page's rows no token of the call writes:
// row j is written when the token j places later has the entering slot + j (a request's new
// tokens are consecutive); no other vector writes a row cleared there. Its lanes clear each
// row together, in 4-byte words (clear_tail).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace attn_ops_tqw {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 4;      // (warps a block)
constexpr int kC = 16;         // (coordinates a lane)
constexpr int kMaxCells = 512; // (code-table cells; format.code_lookup keeps below)

template <typename T> struct Tag { using type = T; };

struct Params {
  const void* key;
  const void* value;
  uint8_t* cache;
  const int64_t* slots;
  const float2* cells;   // the key code table: (threshold on u, count below as int bits)
  const float* cos_sin;  // [tokens, D]: cos of the first half's frequencies, then sin; or null
  int pairs;             // tokens x KV heads
  int num_tokens, num_slots;
  int64_t stride_kt, stride_kh, stride_vt, stride_vh, stride_cst;  // (elements)
  int64_t stride_cb, stride_ch, stride_cs;                         // (bytes)
  int heads, page, slot_bytes, num_cells;
  float grid_scale, grid_offset;  // u = y S + A (format.code_lookup), y before 1 / sqrt(D)
  float inv_sqrt_d;
};

// two packed 16-bit elements as fp32
__device__ __forceinline__ float2 pair_f32(uint32_t w, const __nv_bfloat16*) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 pair_f32(uint32_t w, const __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// 16 elements from a 16-byte aligned address, as fp32
template <typename T> __device__ __forceinline__ void load16(const T* p, float (&x)[kC]) {
  static_assert(sizeof(T) == 2, "16-bit elements (fp32: the overload below)");
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 w = q[i];
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = pair_f32(ws[k], p);
      x[8 * i + 2 * k] = f.x;
      x[8 * i + 2 * k + 1] = f.y;
    }
  }
}
__device__ __forceinline__ void load16(const float* p, float (&x)[kC]) {
  const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = q[i];
    x[4 * i] = f.x;
    x[4 * i + 1] = f.y;
    x[4 * i + 2] = f.z;
    x[4 * i + 3] = f.w;
  }
}

// x rounded to T and back (the RoPE write leaves the key in its dtype)
template <typename T> __device__ __forceinline__ float round_to(float x);
template <> __device__ __forceinline__ float round_to<__nv_bfloat16>(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
template <> __device__ __forceinline__ float round_to<__half>(float x) {
  return __half2float(__float2half_rn(x));
}
template <> __device__ __forceinline__ float round_to<float>(float x) { return x; }

// reductions over a vector's L lanes (aligned groups of L: xor offsets below L stay inside)
template <int L> __device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = 1; o < L; o <<= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}
template <int L> __device__ __forceinline__ float group_min(float x) {
#pragma unroll
  for (int o = 1; o < L; o <<= 1) x = fminf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}
template <int L> __device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = 1; o < L; o <<= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

__device__ __forceinline__ void store_u16(uint8_t* at, uint32_t bits) {
  *reinterpret_cast<uint16_t*>(at) = static_cast<uint16_t>(bits);
}

// N 16-bit words (their low halves) at a 2-byte aligned address: two to a 4-byte store where
// the address is 4-byte aligned, one to a 2-byte store elsewhere. The vectors of a warp are
// one token's heads, a page of slots apart, so they take the same branch unless the warp
// spans two tokens; a 4-byte store halves the stores and the partial sectors they write.
template <int N>
__device__ __forceinline__ void store_words(uint8_t* at, const uint32_t (&words)[N]) {
  static_assert(N % 2 == 0, "an even count of 16-bit words");
  if ((reinterpret_cast<uintptr_t>(at) & 3) == 0) {
#pragma unroll
    for (int w = 0; w < N / 2; ++w)
      *reinterpret_cast<uint32_t*>(at + 4 * w) =
          (words[2 * w] & 0xffffu) | (words[2 * w + 1] << 16);
  } else {
#pragma unroll
    for (int w = 0; w < N; ++w) store_u16(at + 2 * w, words[w]);
  }
}

__device__ __forceinline__ uint32_t fp16_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// a lane's 16 BITS-bit codes: bytes [16 j BITS / 8, 16 (j + 1) BITS / 8) of the LSB-first
// stream at `out`, in 16-bit words
template <int BITS>
__device__ __forceinline__ void store_codes(uint8_t* out, const uint32_t (&code)[kC], int j) {
  uint8_t* at = out + j * (kC * BITS / 8);
  if constexpr (BITS == 4) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w)
      words[w] = code[4 * w] | (code[4 * w + 1] << 4) | (code[4 * w + 2] << 8) |
                (code[4 * w + 3] << 12);
    store_words(at, words);
  } else {
    static_assert(BITS == 3, "3- or 4-bit codes");
    uint64_t s = 0;
#pragma unroll
    for (int c = 0; c < kC; ++c) s |= static_cast<uint64_t>(code[c]) << (3 * c);
#pragma unroll
    for (int w = 0; w < 3; ++w) store_u16(at + 2 * w, static_cast<uint32_t>(s >> (16 * w)));
  }
}

// A token entering its page (its slot at row 0, its vector's lanes j = 0..L-1): zero the
// page's rows no token of the call writes -- row r is written when the token r places later
// has slot + r. The lanes read the later tokens' slots side by side (a row each, 32 rows a
// round), agree on the rows to clear, and clear each row together in 4-byte words (a 16-bit
// piece first where the row starts 2 bytes off a word, and last where one is left), so a
// store instruction covers 4 L contiguous bytes of one row.
template <int L>
__device__ __forceinline__ void clear_tail(const Params& p, uint8_t* base, int t, int slot,
                                           int j) {
  // (the vector's own lanes: other vectors of the warp may be elsewhere)
  const unsigned group =
      L == 32 ? kFull : ((1u << (L & 31)) - 1) << ((threadIdx.x & 31) & ~(L - 1));
  for (int r0 = 1; r0 < p.page; r0 += 32) {
    uint32_t clear = 0;
    for (int i = j; i < 32; i += L) {
      const int r = r0 + i, later = t + r;
      if (r < p.page && !(later < p.num_tokens && p.slots[later] == slot + r)) clear |= 1u << i;
    }
#pragma unroll
    for (int o = 1; o < L; o <<= 1) clear |= __shfl_xor_sync(group, clear, o);
    while (clear != 0) {
      const int i = __ffs(clear) - 1;
      clear &= clear - 1;
      uint8_t* row = base + (r0 + i) * p.stride_cs;
      const int lead = (reinterpret_cast<uintptr_t>(row) & 2) ? 2 : 0;
      if (lead != 0 && j == 0) store_u16(row, 0);
      const int words = (p.slot_bytes - lead) / 4;
      for (int w = j; w < words; w += L) *reinterpret_cast<uint32_t*>(row + lead + 4 * w) = 0;
      if ((p.slot_bytes - lead) % 4 != 0 && j == L - 1) store_u16(row + p.slot_bytes - 2, 0);
    }
  }
}

template <int D, typename T, int KBITS, int VBITS>
__global__ void __launch_bounds__(kWarps * 32) tq_write_kernel(Params p) {
  constexpr int L = D / kC;   // lanes a vector
  constexpr int G = 32 / L;   // vectors a warp
  constexpr int kHalf = D / 2;
  static_assert(L >= 2 && L <= 32 && (L & (L - 1)) == 0, "head dims 32 to 512");

  __shared__ float2 cells[KBITS == 8 ? 1 : kMaxCells];
  if constexpr (KBITS != 8) {
    for (int i = threadIdx.x; i < p.num_cells; i += kWarps * 32) cells[i] = p.cells[i];
    __syncthreads();
  }

  const int lane = threadIdx.x & 31;
  const int j = lane % L;
  const int pair = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * G + lane / L;
  // (every lane takes part in the shuffles; a vector with nothing to write stores nothing)
  const bool live = pair < p.pairs;
  const int t = live ? pair / p.heads : 0;
  const int h = live ? pair - t * p.heads : 0;
  const int64_t wide = live ? p.slots[t] : -1;
  // (-1 and slots outside the cache: skipped; the cache has fewer than 2^31 slots)
  const bool write = wide >= 0 && wide < p.num_slots;
  const int slot = write ? static_cast<int>(wide) : 0;
  const int in_page = write ? slot % p.page : 1;
  uint8_t* base = p.cache + (write ? (slot / p.page) * p.stride_cb + h * p.stride_ch +
                                         in_page * p.stride_cs : 0);

  float k[kC], v[kC];
  if (write) {
    load16(static_cast<const T*>(p.key) + t * p.stride_kt + h * p.stride_kh + j * kC, k);
    load16(static_cast<const T*>(p.value) + t * p.stride_vt + h * p.stride_vh + j * kC, v);
  } else {
#pragma unroll
    for (int c = 0; c < kC; ++c) k[c] = v[c] = 0.f;
  }
  if (p.cos_sin != nullptr) {  // RoPE: k d cos - k (d + D/2) sin, then k (d - D/2) sin + k d cos
    float cs[kC], sn[kC];
    const float* row = p.cos_sin + t * p.stride_cst + (j % (L / 2)) * kC;
    load16(row, cs);
    load16(row + kHalf, sn);
    const bool first = j < L / 2;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const float partner = __shfl_xor_sync(kFull, k[c], L / 2);
      const float rot = __fmul_rn(first ? -partner : partner, sn[c]);
      k[c] = round_to<T>(__fadd_rn(__fmul_rn(k[c], cs[c]), rot));
    }
  }

  uint8_t* vbase;
  if constexpr (KBITS == 8) {  // fp8 e4m3 keys, saturated, not rotated
    uint32_t two[kC / 2];
#pragma unroll
    for (int c = 0; c < kC; c += 2)
      two[c / 2] = __nv_cvt_float2_to_fp8x2(
          make_float2(fminf(fmaxf(k[c], -448.f), 448.f), fminf(fmaxf(k[c + 1], -448.f), 448.f)),
          __NV_SATFINITE, __NV_E4M3);
    if (write) store_words(base + j * kC, two);
    vbase = base + D;
  } else {
    float sq = 0.f;
#pragma unroll
    for (int c = 0; c < kC; ++c) sq = __fmaf_rn(k[c], k[c], sq);
    const float norm = __fsqrt_rn(group_sum<L>(sq));
    // the transform of the raw key: index 16 j + c, its low four bits within the lane
#pragma unroll
    for (int b = 1; b < kC; b <<= 1) {
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        if ((c & b) == 0) {
          const float a = k[c], e = k[c | b];
          k[c] = a + e;
          k[c | b] = a - e;
        }
      }
    }
#pragma unroll
    for (int o = 1; o < L; o <<= 1) {  // its high bits across the lanes: the upper partner
      const float sign = (j & o) ? -1.f : 1.f;  // takes other - own, the lower own + other
#pragma unroll
      for (int c = 0; c < kC; ++c) k[c] = __fmaf_rn(k[c], sign, __shfl_xor_sync(kFull, k[c], o));
    }
    // u = y S + A with y = k H / (sqrt(D) (||k|| + 1e-8)); cell round(u), which is at least 0
    // for |y| <= 1 (an unsigned clamp keeps a NaN's cell inside the table)
    const float to_grid = __fdiv_rn(p.grid_scale * p.inv_sqrt_d, __fadd_rn(norm, 1e-8f));
    const unsigned last = static_cast<unsigned>(p.num_cells - 1);
    uint32_t code[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const float u = __fmaf_rn(k[c], to_grid, p.grid_offset);
      const unsigned cell = min(
          static_cast<unsigned>(__float_as_int(__fadd_rn(u, 12582912.f)) - 0x4B400000), last);
      const float2 e = cells[cell];
      code[c] = static_cast<uint32_t>(__float_as_int(e.y)) + (u >= e.x ? 1u : 0u);
    }
    if (write) {
      store_codes<KBITS>(base, code, j);
      if (j == 0) store_u16(base + D * KBITS / 8, fp16_bits(norm));
    }
    vbase = base + D * KBITS / 8 + 2;
  }

  float lo = v[0], hi = v[0];
#pragma unroll
  for (int c = 1; c < kC; ++c) {
    lo = fminf(lo, v[c]);
    hi = fmaxf(hi, v[c]);
  }
  lo = group_min<L>(lo);
  hi = group_max<L>(hi);
  constexpr int kTop = (1 << VBITS) - 1;
  const float scale = fmaxf(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(kTop)), 1e-8f);
  // (v - lo) / scale rounded to nearest: the reciprocal's product, then two Markstein steps --
  // the residual a - s q is exact in an FMA, and q + r / s rounds to the correctly rounded
  // quotient once q is within an ulp (the first step brings it there)
  const float inv = __frcp_rn(scale);
  uint32_t vcode[kC];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const float a = __fsub_rn(v[c], lo);
    float q = __fmul_rn(a, inv);
    q = __fmaf_rn(__fmaf_rn(-q, scale, a), inv, q);
    q = __fmaf_rn(__fmaf_rn(-q, scale, a), inv, q);
    // (floor as the conversion's rounding; a NaN converts to 0)
    vcode[c] = static_cast<uint32_t>(min(max(__float2int_rd(__fadd_rn(q, 0.5f)), 0), kTop));
  }
  if (!write) return;
  store_codes<VBITS>(vbase, vcode, j);
  uint8_t* tail = vbase + D * VBITS / 8;
  if (j == 0) {
    store_u16(tail, fp16_bits(scale));
    store_u16(tail + 2, fp16_bits(lo));
    if (tail + 4 < base + p.slot_bytes) tail[4] = 0;  // (the byte making the slot's size even)
  }

  if (in_page == 0) clear_tail<L>(p, base, t, slot, j);
}

}  // namespace attn_ops_tqw

#ifndef ATTN_OPS_KERNEL_ONLY
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <type_traits>

// tq_write(key, value [tokens, Hk, D] bf16 / fp16 / fp32 (16-byte aligned rows of unit last
// stride), cache uint8 [blocks, Hk, page, slot] (unit last stride, even slots), slot_mapping
// int64 [tokens], cells fp32 [n, 2] (format.code_lookup's table; any for fp8 keys), grid_scale,
// grid_offset, cos_sin fp32 [tokens, D] (16-byte aligned rows) or None, key_bits (3, 4; 8:
// fp8), value_bits (3, 4)): tq_write_kernel, one launch (inputs checked by the caller).
void tq_write(torch::Tensor key, torch::Tensor value, torch::Tensor cache, torch::Tensor slots,
              torch::Tensor cells, double grid_scale, double grid_offset,
              c10::optional<torch::Tensor> cos_sin, int64_t key_bits, int64_t value_bits) {
  using namespace attn_ops_tqw;
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && cache.stride(3) == 1 &&
                  cache.size(3) % 2 == 0 && slots.scalar_type() == at::kLong &&
                  key.scalar_type() == value.scalar_type() &&
                  cells.scalar_type() == at::kFloat && cells.is_contiguous() &&
                  (key_bits == 8 || cells.numel() <= 2 * kMaxCells) &&
                  key.size(0) * key.size(1) < (int64_t{1} << 31) &&
                  cache.size(0) * cache.size(2) < (int64_t{1} << 31) &&
                  (!cos_sin.has_value() || (cos_sin->scalar_type() == at::kFloat &&
                                            cos_sin->stride(1) == 1)),
              "turboquant write: unit last strides, even slots, int64 slots, one dtype for key "
              "and value, fp32 cells and cos_sin, fewer than 2^31 (token, head) pairs and slots");
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  Params p;
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.cache = cache.data_ptr<uint8_t>();
  p.slots = slots.data_ptr<int64_t>();
  p.cells = reinterpret_cast<const float2*>(cells.data_ptr<float>());
  p.cos_sin = cos_sin.has_value() ? cos_sin->data_ptr<float>() : nullptr;
  p.pairs = static_cast<int>(tokens * heads);
  p.num_tokens = static_cast<int>(tokens);
  p.num_slots = static_cast<int>(cache.size(0) * cache.size(2));
  p.stride_kt = key.stride(0);
  p.stride_kh = key.stride(1);
  p.stride_vt = value.stride(0);
  p.stride_vh = value.stride(1);
  p.stride_cst = cos_sin.has_value() ? cos_sin->stride(0) : 0;
  p.stride_cb = cache.stride(0);
  p.stride_ch = cache.stride(1);
  p.stride_cs = cache.stride(2);
  p.heads = static_cast<int>(heads);
  p.page = static_cast<int>(cache.size(2));
  p.slot_bytes = static_cast<int>(cache.size(3));
  p.num_cells = static_cast<int>(cells.numel() / 2);
  p.grid_scale = static_cast<float>(grid_scale);
  p.grid_offset = static_cast<float>(grid_offset);
  p.inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int per_block = kWarps * (32 / static_cast<int>(d / kC));
  const dim3 grid(static_cast<unsigned>((p.pairs + per_block - 1) / per_block)),
      block(kWarps * 32);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  bool launched = false;
  auto run = [&](auto d_tag, auto t_tag, auto kb_tag, auto vb_tag) {
    tq_write_kernel<decltype(d_tag)::value, typename decltype(t_tag)::type,
                    decltype(kb_tag)::value, decltype(vb_tag)::value>
        <<<grid, block, 0, stream>>>(p);
    launched = true;
  };
  auto by_preset = [&](auto d_tag, auto t_tag) {
    if (key_bits == 8 && value_bits == 4)
      run(d_tag, t_tag, std::integral_constant<int, 8>{}, std::integral_constant<int, 4>{});
    else if (key_bits == 4 && value_bits == 4)
      run(d_tag, t_tag, std::integral_constant<int, 4>{}, std::integral_constant<int, 4>{});
    else if (key_bits == 3 && value_bits == 4)
      run(d_tag, t_tag, std::integral_constant<int, 3>{}, std::integral_constant<int, 4>{});
    else if (key_bits == 3 && value_bits == 3)
      run(d_tag, t_tag, std::integral_constant<int, 3>{}, std::integral_constant<int, 3>{});
  };
  auto by_dtype = [&](auto d_tag) {
    if (key.scalar_type() == at::kBFloat16) by_preset(d_tag, Tag<__nv_bfloat16>{});
    else if (key.scalar_type() == at::kHalf) by_preset(d_tag, Tag<__half>{});
    else if (key.scalar_type() == at::kFloat) by_preset(d_tag, Tag<float>{});
  };
  if (d == 64) by_dtype(std::integral_constant<int, 64>{});
  else if (d == 128) by_dtype(std::integral_constant<int, 128>{});
  else if (d == 256) by_dtype(std::integral_constant<int, 256>{});
  TORCH_CHECK(launched, "turboquant write: no build for head_dim=", d, ", ", key.scalar_type(),
              ", ", key_bits, "-bit keys and ", value_bits, "-bit values");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("write", &tq_write); }
#else
namespace attn_ops_tqw {
using bf16 = __nv_bfloat16;
template __global__ void tq_write_kernel<128, bf16, 4, 4>(Params);
template __global__ void tq_write_kernel<128, bf16, 3, 4>(Params);
template __global__ void tq_write_kernel<128, bf16, 3, 3>(Params);
template __global__ void tq_write_kernel<128, bf16, 8, 4>(Params);
template __global__ void tq_write_kernel<64, __half, 3, 3>(Params);
template __global__ void tq_write_kernel<256, float, 4, 4>(Params);
}  // namespace attn_ops_tqw
#endif
