// TurboQuant's cache write on CUDA (sm_80+): the slots of format.py written one warp a (token,
// KV head), every preset (3- / 4-bit rotated keys with their norm, or fp8 e4m3 keys; 3- / 4-bit
// values with their scale and minimum), head dims 64 / 128 / 256, the keys' RoPE in the launch.
//
// Lane l holds coordinates [l C, (l + 1) C), C = D / 32, so every per-key step stays in
// registers and shuffles:
//   - RoPE: coordinate d's partner d +- D / 2 is the same register of lane l ^ 16;
//   - the norm, and the values' minimum and maximum: warp reductions;
//   - the Hadamard rotation: a fast Walsh-Hadamard transform, its log2 C low stages within a
//     lane, its five high ones across lanes (shfl_xor 1 ... 16);
//   - the codes: each coordinate's count of codebook midpoints at or below it, by a binary
//     search over the midpoints held one a lane (lookups by shuffle);
//   - the packing: a lane's codes at their bit offsets of the LSB-first stream; 3-bit codes
//     come in 3-byte groups of eight, OR-ed together over the lanes a group spans, then stored
//     by the group's first lane.
// The arithmetic follows the torch write (format.quantize_slots): IEEE sqrt and division,
// RoPE as two rounded products and a rounded sum, the key rounded to its dtype after it.
// Summation orders differ (the norm, the rotation): a key index whose coordinate sits at a
// codebook midpoint may differ, as the Triton write's may.
//
// A token entering its page (row 0 of it) zeroes the page's rows no token of the call writes:
// row j is written when the token j places later has the entering slot + j (a request's new
// tokens are consecutive); no other warp writes a row cleared there.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace attn_ops_tqw {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 4;  // (warps a block: four (token, head) pairs)

template <typename T> struct Tag { using type = T; };

struct Params {
  const void* key;
  const void* value;
  uint8_t* cache;
  const int64_t* slots;
  const float* mid;      // the key codebook's midpoints, ascending (2^KBITS - 1)
  const float* cos_sin;  // [tokens, D]: cos of the first half's frequencies, then sin; or null
  int64_t pairs;         // tokens x KV heads
  int64_t num_tokens, num_slots;
  int64_t stride_kt, stride_kh, stride_vt, stride_vh, stride_cst;  // (elements)
  int64_t stride_cb, stride_ch, stride_cs;                         // (bytes)
  int heads, page, slot_bytes;
  float inv_sqrt_d;
};

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32(float x) { return x; }

// x rounded to T and back (the RoPE write leaves the key in its dtype)
template <typename T> __device__ __forceinline__ float round_to(float x);
template <> __device__ __forceinline__ float round_to<__nv_bfloat16>(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
template <> __device__ __forceinline__ float round_to<__half>(float x) {
  return __half2float(__float2half_rn(x));
}
template <> __device__ __forceinline__ float round_to<float>(float x) { return x; }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

__device__ __forceinline__ float warp_min(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

__device__ __forceinline__ void store_fp16(uint8_t* at, float x) {
  const unsigned short bits = __half_as_ushort(__float2half_rn(x));
  at[0] = static_cast<uint8_t>(bits & 0xff);
  at[1] = static_cast<uint8_t>(bits >> 8);
}

// Lane `lane`'s C codes (coordinates [lane C, (lane + 1) C)) into the LSB-first stream of D
// BITS-bit codes at `out`.
template <int C, int BITS>
__device__ __forceinline__ void store_codes(uint8_t* out, const int (&code)[C], int lane) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int c = 0; c < C; c += 2)
      out[(lane * C + c) / 2] = static_cast<uint8_t>(code[c] | (code[c + 1] << 4));
  } else if constexpr (BITS == 8) {
#pragma unroll
    for (int c = 0; c < C; ++c) out[lane * C + c] = static_cast<uint8_t>(code[c]);
  } else {  // 3 bits: eight codes a 3-byte group, spanning 8 / C lanes (C <= 8)
    static_assert(BITS == 3 && C <= 8 && 8 % C == 0, "3-bit codes: C of 2, 4 or 8");
    constexpr int kLanes = 8 / C;
    uint32_t word = 0;
#pragma unroll
    for (int c = 0; c < C; ++c)
      word |= static_cast<uint32_t>(code[c]) << (3 * ((lane * C + c) % 8));
#pragma unroll
    for (int o = 1; o < kLanes; o <<= 1) word |= __shfl_xor_sync(kFull, word, o);
    if (lane % kLanes == 0) {
      uint8_t* g = out + 3 * (lane * C / 8);
      g[0] = static_cast<uint8_t>(word & 0xff);
      g[1] = static_cast<uint8_t>((word >> 8) & 0xff);
      g[2] = static_cast<uint8_t>(word >> 16);
    }
  }
}

template <int D, typename T, int KBITS, int VBITS>
__global__ void __launch_bounds__(kWarps * 32) tq_write_kernel(Params p) {
  constexpr int C = D / 32;
  constexpr int kHalf = D / 2;
  const int lane = threadIdx.x & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (pair >= p.pairs) return;
  const int64_t t = pair / p.heads;
  const int h = static_cast<int>(pair % p.heads);
  const int64_t slot = p.slots[t];
  if (slot < 0 || slot >= p.num_slots) return;  // (-1 and slots outside the cache: skipped)
  const int64_t in_page = slot % p.page;
  uint8_t* base = p.cache + (slot / p.page) * p.stride_cb + h * p.stride_ch + in_page * p.stride_cs;

  const T* krow = static_cast<const T*>(p.key) + t * p.stride_kt + h * p.stride_kh + lane * C;
  const T* vrow = static_cast<const T*>(p.value) + t * p.stride_vt + h * p.stride_vh + lane * C;
  float k[C], v[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    k[c] = to_f32(krow[c]);
    v[c] = to_f32(vrow[c]);
  }
  if (p.cos_sin != nullptr) {  // RoPE: k d cos - k (d + D/2) sin, then k (d - D/2) sin + k d cos
    const float* cs = p.cos_sin + t * p.stride_cst + (lane & 15) * C;
    const bool first = lane < 16;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const float partner = __shfl_xor_sync(kFull, k[c], 16);
      const float rot = __fmul_rn(first ? -partner : partner, cs[kHalf + c]);
      k[c] = round_to<T>(__fadd_rn(__fmul_rn(k[c], cs[c]), rot));
    }
  }

  uint8_t* vbase;
  if constexpr (KBITS == 8) {  // fp8 e4m3 keys, saturated, not rotated
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const __nv_fp8_e4m3 q(fminf(fmaxf(k[c], -448.f), 448.f));
      base[lane * C + c] = *reinterpret_cast<const uint8_t*>(&q);
    }
    vbase = base + D;
  } else {
    float sq = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) sq = __fmaf_rn(k[c], k[c], sq);
    const float norm = __fsqrt_rn(warp_sum(sq));
    const float denom = __fadd_rn(norm, 1e-8f);
    float y[C];
#pragma unroll
    for (int c = 0; c < C; ++c) y[c] = __fdiv_rn(k[c], denom);
    // the fast Walsh-Hadamard transform over index lane * C + c: low bits in the lane
#pragma unroll
    for (int b = 1; b < C; b <<= 1) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        if ((c & b) == 0) {
          const float a = y[c], e = y[c | b];
          y[c] = a + e;
          y[c | b] = a - e;
        }
      }
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {  // high bits across the lanes
      const bool upper = (lane & o) != 0;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const float other = __shfl_xor_sync(kFull, y[c], o);
        y[c] = upper ? other - y[c] : y[c] + other;
      }
    }
    // a coordinate's code: how many midpoints are at or below it, by a binary search whose
    // midpoint lookups are shuffles (lane m holds midpoint m) -- the same predicates as the
    // count, so the same code
    constexpr int kMids = (1 << KBITS) - 1;
    const float my_mid = __ldg(p.mid + (lane < kMids ? lane : 0));
    int code[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const float r = y[c] * p.inv_sqrt_d;
      int n = 0;
#pragma unroll
      for (int step = 1 << (KBITS - 1); step > 0; step >>= 1)
        n += r >= __shfl_sync(kFull, my_mid, n + step - 1) ? step : 0;
      code[c] = n;
    }
    store_codes<C, KBITS>(base, code, lane);
    if (lane == 0) store_fp16(base + D * KBITS / 8, norm);
    vbase = base + D * KBITS / 8 + 2;
  }

  float lo = v[0], hi = v[0];
#pragma unroll
  for (int c = 1; c < C; ++c) {
    lo = fminf(lo, v[c]);
    hi = fmaxf(hi, v[c]);
  }
  lo = warp_min(lo);
  hi = warp_max(hi);
  constexpr int kTop = (1 << VBITS) - 1;
  const float scale = fmaxf(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(kTop)), 1e-8f);
  int vcode[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const float q = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(v[c], lo), scale), 0.5f));
    vcode[c] = static_cast<int>(fminf(fmaxf(q, 0.f), static_cast<float>(kTop)));
  }
  store_codes<C, VBITS>(vbase, vcode, lane);
  uint8_t* tail = vbase + D * VBITS / 8;
  if (lane == 0) {
    store_fp16(tail, scale);
    store_fp16(tail + 2, lo);
    if (tail + 4 < base + p.slot_bytes) tail[4] = 0;  // (the byte making the slot's size even)
  }

  if (in_page == 0) {  // entering its page: clear the rows no token of this call writes
    uint8_t* page0 = base;
    for (int j = 1 + lane; j < p.page; j += 32) {
      const int64_t later = t + j;
      if (later < p.num_tokens && p.slots[later] == slot + j) continue;
      uint8_t* row = page0 + j * p.stride_cs;
      for (int b = 0; b < p.slot_bytes; ++b) row[b] = 0;
    }
  }
}

}  // namespace attn_ops_tqw

#ifndef ATTN_OPS_KERNEL_ONLY
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <type_traits>

// tq_write(key, value [tokens, Hk, D] bf16 / fp16 / fp32 (unit last stride), cache uint8 [blocks,
// Hk, page, slot] (unit last stride), slot_mapping int64 [tokens], midpoints fp32 [2^key_bits -
// 1] (any for fp8 keys), cos_sin fp32 [tokens, D] (unit last stride) or None, key_bits (3, 4;
// 8: fp8), value_bits (3, 4)): tq_write_kernel, one launch (inputs checked by the caller).
void tq_write(torch::Tensor key, torch::Tensor value, torch::Tensor cache, torch::Tensor slots,
              torch::Tensor mid, c10::optional<torch::Tensor> cos_sin, int64_t key_bits,
              int64_t value_bits) {
  using namespace attn_ops_tqw;
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && cache.stride(3) == 1 &&
                  slots.scalar_type() == at::kLong && key.scalar_type() == value.scalar_type() &&
                  (!cos_sin.has_value() || (cos_sin->scalar_type() == at::kFloat &&
                                            cos_sin->stride(1) == 1)),
              "turboquant write: unit last strides, int64 slots, one dtype for key and value, "
              "fp32 cos_sin");
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  Params p;
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.cache = cache.data_ptr<uint8_t>();
  p.slots = slots.data_ptr<int64_t>();
  p.mid = mid.data_ptr<float>();
  p.cos_sin = cos_sin.has_value() ? cos_sin->data_ptr<float>() : nullptr;
  p.pairs = tokens * heads;
  p.num_tokens = tokens;
  p.num_slots = cache.size(0) * cache.size(2);
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
  p.inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const dim3 grid(static_cast<unsigned>((p.pairs + kWarps - 1) / kWarps)), block(kWarps * 32);
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
