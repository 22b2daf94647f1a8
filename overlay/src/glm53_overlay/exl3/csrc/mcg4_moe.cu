// EXL3 MoE decode path for K=4 mcg experts (GLM-5.3 Flash's format), for a few tokens per step.
//
// Every (token, routed expert) pair is one matrix-vector product per projection. Three launches:
//   gate_up: H(x*suh) per pair (prologue), gate and up                  -> gu [2, P, I] (rotated basis)
//   down:    H(.)*svh, act(g, u), H(a*suh) (prologue), down, H(.)*svh -> y [P, H]
//   combine: out[t] = sum_k w[t, k] * y[t*top_k + k]
//
// Why it beats exllamav3's kernels at decode sizes: there the time goes to trellis decoding, not bytes.
// Here a lane decodes its 8 positions of a 16x16 tile from one 32-bit word (plus its neighbour's, by
// shuffle) with funnel shifts and byte permutes, and the two fp16 halves of each mcg hash are never
// added on the ALU: the hash is an A element pair (lo, hi) of the MMA against the input value
// duplicated on the same k pair of B, so the tensor core sums lo*x + hi*x in fp32. That is the
// codebook value lo+hi without the fp16 rounding of the sum (within half an fp16 ulp of the
// reference decoder's weight); a lane's 8 hashes are exactly the A registers of two MMAs.

#include <torch/extension.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kTilesN = 8;             // 8 tiles of 16 columns: one 128-wide Hadamard block per block
constexpr int kCols = kTilesN * 16;
constexpr int kWordsPerTile = 32;      // K=4: 256 positions * 4 bits = 32 words, one per lane
constexpr uint32_t kMcgMul = 0xCBAC1FEDu;
constexpr float kHadScale = 0.08838834764831845f;  // 1/sqrt(128)

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

// 128-point Walsh-Hadamard transform (Sylvester order, scaled 1/sqrt(128)) of the warp's 128 values,
// element 4 * lane + i in v[i].
__device__ __forceinline__ void fwht128(float (&v)[4], int lane) {
  const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
  v[0] = a0 + a2; v[1] = a1 + a3; v[2] = a0 - a2; v[3] = a1 - a3;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = lane & m;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = upper ? other - v[i] : v[i] + other;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= kHadScale;
}

__device__ __forceinline__ uint32_t dup_half(float v) {
  const uint32_t h = __half_as_ushort(__float2half_rn(v));
  return h | (h << 16);
}

// The mcg hash of a 16-bit state s with exllamav3's mask/xor applied: two fp16 halves whose sum is the
// weight. `dup` is s in both 16-bit halves, s * (2^16 + 1), which one byte permute makes from any
// byte-aligned window with no masking; multiplying it by C * (1 - 2^16) gives s * C mod 2^32, since
// (2^16 + 1)(1 - 2^16) = 1 - 2^32. The mask comes in as a loaded value so that it stays in a register
// (an immediate would be re-materialized before every use).
constexpr uint32_t kMcgMulDup = kMcgMul * (1u - (1u << 16));
__device__ __forceinline__ uint32_t mcg_hash(uint32_t dup, uint32_t mask) {
  return ((dup * kMcgMulDup) & mask) ^ 0x3b603b60u;
}

// A lane's 8 positions of a K=4 tile: state j is bits [28 - 4j, 44 - 4j) of (prev:cur), the lane's word
// `cur` and, reaching back for j < 3, the previous lane's word `prev`. Selector nibble i of a byte
// permute picks result byte i from (src0 bytes 0-3, src1 bytes 4-7).
__device__ __forceinline__ void hashes8(uint32_t cur, uint32_t prev, uint32_t mask, uint32_t (&h)[8]) {
  const uint32_t t = __funnelshift_r(cur, prev, 4);  // (prev:cur) >> 4, so odd nibbles become bytes
  const uint32_t tp = prev >> 4;                      // its upper 32 bits
  h[0] = mcg_hash(__byte_perm(t, tp, 0x4343), mask);
  h[1] = mcg_hash(__byte_perm(cur, prev, 0x4343), mask);
  h[2] = mcg_hash(__byte_perm(t, 0, 0x3232), mask);
  h[3] = mcg_hash(__byte_perm(cur, 0, 0x3232), mask);
  h[4] = mcg_hash(__byte_perm(t, 0, 0x2121), mask);
  h[5] = mcg_hash(__byte_perm(cur, 0, 0x2121), mask);
  h[6] = mcg_hash(__byte_perm(t, 0, 0x1010), mask);
  h[7] = mcg_hash(__byte_perm(cur, 0, 0x1010), mask);
}

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The trellis words of one block's k-tiles, two k-steps ahead of the decode: warp w reads k-tiles
// w, w + WARPS, ... of n-tiles nb*8 .. nb*8+7, one 128-byte tile per load. Started before the prologue
// so the first loads overlap the input rotation.
template <int WARPS>
struct TileStream {
  const uint32_t* ptr;
  size_t step;
  int kt;
  int k_end;
  uint32_t w0[kTilesN], w1[kTilesN];

  __device__ __forceinline__ TileStream(const uint32_t* trellis, int k_tiles, int n_tiles, int nb)
      : step(static_cast<size_t>(WARPS) * n_tiles * kWordsPerTile), kt(threadIdx.x >> 5), k_end(k_tiles) {
    ptr = trellis + (static_cast<size_t>(kt) * n_tiles + nb * kTilesN) * kWordsPerTile + (threadIdx.x & 31);
    load(w0, 0);
    load(w1, 1);
  }

  __device__ __forceinline__ void load(uint32_t (&w)[kTilesN], int ahead) const {
    if (kt + ahead * WARPS < k_end) {
#pragma unroll
      for (int i = 0; i < kTilesN; ++i) w[i] = __ldg(ptr + ahead * step + i * kWordsPerTile);
    }
  }
};

// One block's 128 output columns of x @ W, split over k-tiles by warp; leaves the 128
// sums (rotated basis) in red[0..127]. xdup[k] holds x[k] as fp16 in both halves.
//
// MMA roles: A (16x16) = the tile's 16 columns x 8 weight rows, each weight a k pair (lo, hi) of its
// mcg hash; B (16x8) = x duplicated on the same k pairs, token in column 0. Lane (g, t) = (lane / 4,
// lane % 4) holds slot j at row 2t + (j&1) + 8((j>>1)&1), column g + 8(j>>2).
template <int WARPS>
__device__ __forceinline__ void gemv_tiles(TileStream<WARPS>& s, const uint32_t* xdup, float* red, uint32_t mask) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[kTilesN][4];
#pragma unroll
  for (int i = 0; i < kTilesN; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;
  const int prev_lane = (lane + 31) & 31;
  for (; s.kt < s.k_end; s.kt += WARPS) {
    uint32_t w[kTilesN];
#pragma unroll
    for (int i = 0; i < kTilesN; ++i) {
      w[i] = s.w0[i];
      s.w0[i] = s.w1[i];
    }
    s.load(s.w1, 2);
    s.ptr += s.step;
    uint32_t b0 = 0, b1 = 0, b8 = 0, b9 = 0;
    if (lane < 4) {
      const uint32_t* xr = xdup + s.kt * 16 + 2 * lane;
      b0 = xr[0]; b1 = xr[1]; b8 = xr[8]; b9 = xr[9];
    }
#pragma unroll
    for (int i = 0; i < kTilesN; ++i) {
      uint32_t h[8];
      hashes8(w[i], __shfl_sync(0xffffffffu, w[i], prev_lane), mask, h);
      mma_16816(acc[i], h[0], h[4], h[1], h[5], b0, b1);  // weight rows 2t, 2t+1
      mma_16816(acc[i], h[2], h[6], h[3], h[7], b8, b9);  // weight rows 2t+8, 2t+9
    }
  }
  // Column 0 of C (the token) sits in lanes t = 0: c0 = column g, c2 = column g + 8 of each tile.
  if ((lane & 3) == 0) {
    const int g = lane >> 2;
#pragma unroll
    for (int i = 0; i < kTilesN; ++i) {
      red[warp * kCols + 16 * i + g] = acc[i][0];
      red[warp * kCols + 16 * i + g + 8] = acc[i][2];
    }
  }
  __syncthreads();
  if (threadIdx.x < kCols) {
    float sum = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < WARPS; ++w2) sum += red[w2 * kCols + threadIdx.x];
    red[threadIdx.x] = sum;  // each thread reads and writes only its own column
  }
  __syncthreads();
}

__device__ __forceinline__ int expert_of(const void* ids, bool ids64, int pair) {
  return ids64 ? static_cast<int>(static_cast<const int64_t*>(ids)[pair]) : static_cast<const int32_t*>(ids)[pair];
}

// Programmatic dependent launch (sm_90+): a kernel launched with it may start while the previous one
// finishes, and must wait before it reads what that one wrote. Elsewhere both are no-ops.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Resident blocks per SM the register budget is set for: 24 warps per SM.
template <int WARPS> constexpr int min_blocks() { return WARPS >= 16 ? 1 : 24 / WARPS; }

template <typename Tin, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, min_blocks<WARPS>()) gate_up_kernel(
    const Tin* __restrict__ x, const void* __restrict__ ids, bool ids64, const uint32_t* __restrict__ trellis_g,
    const uint32_t* __restrict__ trellis_u, const __half* __restrict__ suh_g, const __half* __restrict__ suh_u,
    float* __restrict__ gu, int top_k, int pairs, int experts, int hidden, int inter, const uint32_t* __restrict__ consts) {
  const uint32_t mcg_mask = __ldg(consts);
  extern __shared__ uint32_t smem[];
  uint32_t* xdup = smem;
  float* red = reinterpret_cast<float*>(smem + hidden);
  const int nb = blockIdx.x, pair = blockIdx.y, proj = blockIdx.z;
  allow_next_grid();  // down's blocks may start prefetching its trellis as ours finish
  const int token = pair / top_k, expert = expert_of(ids, ids64, pair);
  float* dst = gu + (static_cast<size_t>(proj) * pairs + pair) * inter + nb * kCols;
  if (expert < 0 || expert >= experts) {  // not routed to this rank: contributes nothing
    if (threadIdx.x < kCols) dst[threadIdx.x] = 0.f;
    return;
  }
  const int k_tiles = hidden / 16, n_tiles = inter / 16;
  TileStream<WARPS> stream(
      (proj ? trellis_u : trellis_g) + static_cast<size_t>(expert) * k_tiles * n_tiles * kWordsPerTile, k_tiles,
      n_tiles, nb);
  const __half* suh = (proj ? suh_u : suh_g) + static_cast<size_t>(expert) * hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const Tin* xt = x + static_cast<size_t>(token) * hidden;
  for (int b = warp; b < hidden / 128; b += WARPS) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = b * 128 + 4 * lane + i;
      v[i] = to_float(xt[k]) * __half2float(suh[k]);
    }
    fwht128(v, lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) xdup[b * 128 + 4 * lane + i] = dup_half(v[i]);
  }
  __syncthreads();
  gemv_tiles<WARPS>(stream, xdup, red, mcg_mask);
  if (threadIdx.x < kCols) dst[threadIdx.x] = red[threadIdx.x];
}

// SiLU(g) clamped from above, u clamped symmetrically (exllamav3's act_limit; 0 = off).
__device__ __forceinline__ float swiglu(float g, float u, float limit) {
  float a = g / (1.f + __expf(-g));
  if (limit > 0.f) {
    a = fminf(a, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return a * u;
}

template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32, min_blocks<WARPS>()) down_kernel(
    const float* __restrict__ gu, const void* __restrict__ ids, bool ids64,
    const __half* __restrict__ svh_g, const __half* __restrict__ svh_u, const uint32_t* __restrict__ trellis_d,
    const __half* __restrict__ suh_d, const __half* __restrict__ svh_d, float* __restrict__ y, int pairs,
    int experts, int hidden, int inter, float act_limit, const uint32_t* __restrict__ consts) {
  const uint32_t mcg_mask = __ldg(consts);
  extern __shared__ uint32_t smem[];
  uint32_t* xdup = smem;
  float* red = reinterpret_cast<float*>(smem + inter);
  const int nb = blockIdx.x, pair = blockIdx.y;
  allow_next_grid();
  // ids were written before gate_up started, so they (and the trellis) can be read before the wait.
  const int expert = expert_of(ids, ids64, pair);
  float* dst = y + static_cast<size_t>(pair) * hidden + nb * kCols;
  if (expert < 0 || expert >= experts) {
    wait_for_previous_grid();
    if (threadIdx.x < kCols) dst[threadIdx.x] = 0.f;
    return;
  }
  const int k_tiles = inter / 16, n_tiles = hidden / 16;
  TileStream<WARPS> stream(trellis_d + static_cast<size_t>(expert) * k_tiles * n_tiles * kWordsPerTile, k_tiles, n_tiles,
                           nb);
  wait_for_previous_grid();  // gate_up's sums
  const size_t e_inter = static_cast<size_t>(expert) * inter;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int b = warp; b < inter / 128; b += WARPS) {
    float g[4], u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const size_t k = b * 128 + 4 * lane + i;
      g[i] = gu[static_cast<size_t>(pair) * inter + k];
      u[i] = gu[(static_cast<size_t>(pairs) + pair) * inter + k];
    }
    fwht128(g, lane);
    fwht128(u, lane);
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const size_t k = b * 128 + 4 * lane + i;
      const float a = swiglu(g[i] * __half2float(svh_g[e_inter + k]), u[i] * __half2float(svh_u[e_inter + k]), act_limit);
      v[i] = a * __half2float(suh_d[e_inter + k]);
    }
    fwht128(v, lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) xdup[b * 128 + 4 * lane + i] = dup_half(v[i]);
  }
  __syncthreads();
  gemv_tiles<WARPS>(stream, xdup, red, mcg_mask);
  // Warp 0 rotates the block's 128 sums back (H, then svh).
  if (threadIdx.x < 32) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = red[4 * lane + i];
    fwht128(v, lane);
    const __half* svh = svh_d + static_cast<size_t>(expert) * hidden + nb * kCols;
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[4 * lane + i] = v[i] * __half2float(svh[4 * lane + i]);
  }
}

template <typename Tout>
__global__ void combine_kernel(const float* __restrict__ y, const float* __restrict__ weights, Tout* __restrict__ out,
                               int top_k, int hidden) {
  wait_for_previous_grid();  // down's y
  const int token = blockIdx.y;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= hidden) return;
  float s = 0.f;
  for (int k = 0; k < top_k; ++k) {
    const int pair = token * top_k + k;
    s += weights[pair] * y[static_cast<size_t>(pair) * hidden + col];
  }
  out[static_cast<size_t>(token) * hidden + col] = from_float<Tout>(s);
}

void check_projection(const torch::Tensor& trellis, const torch::Tensor& suh, const torch::Tensor& svh, int64_t k,
                      int64_t n, const char* name) {
  TORCH_CHECK(trellis.is_cuda() && trellis.scalar_type() == torch::kInt16 && trellis.is_contiguous(), name,
              ": trellis must be a contiguous CUDA int16 tensor");
  TORCH_CHECK(trellis.dim() == 4 && trellis.size(1) * 16 == k && trellis.size(2) * 16 == n && trellis.size(3) == 64,
              name, ": trellis must be [E, ", k / 16, ", ", n / 16, ", 64] (K=4)");
  TORCH_CHECK(suh.scalar_type() == torch::kHalf && suh.is_contiguous() && suh.size(0) == trellis.size(0) && suh.size(1) == k,
              name, ": suh must be contiguous fp16 [E, ", k, "]");
  TORCH_CHECK(svh.scalar_type() == torch::kHalf && svh.is_contiguous() && svh.size(0) == trellis.size(0) && svh.size(1) == n,
              name, ": svh must be contiguous fp16 [E, ", n, "]");
}

const uint32_t* words(const torch::Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr()); }
const __half* halves(const torch::Tensor& t) { return reinterpret_cast<const __half*>(t.data_ptr()); }

// Launches with programmatic stream serialization when `pdl` (the kernel waits for its predecessor itself).
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem, cudaStream_t stream, bool pdl,
            Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
  TORCH_CHECK(err == cudaSuccess, "mcg4_moe launch failed: ", cudaGetErrorString(err));
}

template <typename Tin, int WARPS>
void launch_gate_up(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& tg, const torch::Tensor& tu,
                    const torch::Tensor& sg, const torch::Tensor& su, torch::Tensor& gu, int top_k, int pairs,
                    int experts, int hidden, int inter, const torch::Tensor& consts, cudaStream_t stream) {
  const size_t smem = sizeof(uint32_t) * hidden + sizeof(float) * WARPS * kCols;
  gate_up_kernel<Tin, WARPS><<<dim3(inter / kCols, pairs, 2), WARPS * 32, smem, stream>>>(
      reinterpret_cast<const Tin*>(x.data_ptr()), ids.data_ptr(), ids.scalar_type() == torch::kLong, words(tg),
      words(tu), halves(sg), halves(su), gu.data_ptr<float>(), top_k, pairs, experts, hidden, inter, words(consts));
}

template <int WARPS>
void launch_down(const torch::Tensor& gu, const torch::Tensor& ids, const torch::Tensor& vg,
                 const torch::Tensor& vu, const torch::Tensor& td, const torch::Tensor& sd, const torch::Tensor& vd,
                 torch::Tensor& y, int pairs, int experts, int hidden, int inter, float act_limit,
                 const torch::Tensor& consts, cudaStream_t stream, bool pdl) {
  const size_t smem = sizeof(uint32_t) * inter + sizeof(float) * WARPS * kCols;
  launch(down_kernel<WARPS>, dim3(hidden / kCols, pairs), WARPS * 32, smem, stream, pdl, gu.data_ptr<float>(), ids.data_ptr(), ids.scalar_type() == torch::kLong, halves(vg), halves(vu), words(td), halves(sd), halves(vd),
         y.data_ptr<float>(), pairs, experts, hidden, inter, act_limit, words(consts));
}

template <typename Tin>
void dispatch_gate_up(int warps, const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& tg,
                      const torch::Tensor& tu, const torch::Tensor& sg, const torch::Tensor& su, torch::Tensor& gu,
                      int top_k, int pairs, int experts, int hidden, int inter, const torch::Tensor& consts,
                      cudaStream_t stream) {
  switch (warps) {
    case 4: return launch_gate_up<Tin, 4>(x, ids, tg, tu, sg, su, gu, top_k, pairs, experts, hidden, inter, consts, stream);
    case 8: return launch_gate_up<Tin, 8>(x, ids, tg, tu, sg, su, gu, top_k, pairs, experts, hidden, inter, consts, stream);
    case 16: return launch_gate_up<Tin, 16>(x, ids, tg, tu, sg, su, gu, top_k, pairs, experts, hidden, inter, consts, stream);
    default: TORCH_CHECK(false, "gate_up warps must be 4, 8 or 16, got ", warps);
  }
}

}  // namespace

// out[T, hidden] (x's dtype or fp32) = routed-expert sum. ids int32/int64 [T, top_k], weights fp32 [T, top_k].
// gu: fp32 scratch [2, T*top_k, intermediate]; y: fp32 scratch [T*top_k, hidden].
// gate_up_warps / down_warps: warps per block of the two kernels (4, 8 or 16).
// consts: int32 CUDA tensor [1] = 0x8fff8fff (the mcg mask; see mcg_hash). pdl: launch down and combine as
// programmatic dependents (sm_90+).
void mcg4_moe(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor trellis_g, torch::Tensor suh_g,
              torch::Tensor svh_g, torch::Tensor trellis_u, torch::Tensor suh_u, torch::Tensor svh_u,
              torch::Tensor trellis_d, torch::Tensor suh_d, torch::Tensor svh_d, torch::Tensor gu, torch::Tensor y,
              torch::Tensor out, torch::Tensor consts, double act_limit, int64_t gate_up_warps, int64_t down_warps,
              bool pdl, int64_t stream_ptr) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CUDA [T, hidden] tensor");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK((ids.scalar_type() == torch::kInt || ids.scalar_type() == torch::kLong) && ids.is_contiguous() &&
                  ids.dim() == 2 && ids.size(0) == tokens,
              "topk ids must be contiguous int32 or int64 [T, top_k]");
  const int64_t top_k = ids.size(1), pairs = tokens * top_k;
  TORCH_CHECK(weights.scalar_type() == torch::kFloat && weights.is_contiguous() && weights.numel() == pairs,
              "topk weights must be contiguous fp32 [T, top_k]");
  const int64_t inter = trellis_g.size(2) * 16;
  // 128-wide Hadamard blocks; the rotated input (4 bytes per feature) and the split-K sums fit the
  // default 48 KiB of shared memory up to 8192 features.
  TORCH_CHECK(hidden % 128 == 0 && inter % 128 == 0 && hidden <= 8192 && inter <= 8192, "hidden ", hidden,
              " and intermediate ", inter, " must be multiples of 128, at most 8192");
  check_projection(trellis_g, suh_g, svh_g, hidden, inter, "gate");
  check_projection(trellis_u, suh_u, svh_u, hidden, inter, "up");
  check_projection(trellis_d, suh_d, svh_d, inter, hidden, "down");
  const int64_t experts = trellis_g.size(0);
  TORCH_CHECK(trellis_u.size(0) == experts && trellis_d.size(0) == experts, "projections differ in expert count");
  TORCH_CHECK(gu.scalar_type() == torch::kFloat && gu.is_contiguous() && gu.numel() >= 2 * pairs * inter,
              "gu scratch must be fp32 with 2 * T * top_k * intermediate elements");
  TORCH_CHECK(y.scalar_type() == torch::kFloat && y.is_contiguous() && y.numel() >= pairs * hidden,
              "y scratch must be fp32 with T * top_k * hidden elements");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == tokens && out.size(1) == hidden, "out must be [T, hidden]");
  TORCH_CHECK(consts.is_cuda() && consts.scalar_type() == torch::kInt && consts.numel() >= 1,
              "consts must be a CUDA int32 tensor holding the mcg mask 0x8fff8fff");
  if (tokens == 0) return;
  auto stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  const int p = static_cast<int>(pairs), e = static_cast<int>(experts);
  const int h = static_cast<int>(hidden), i = static_cast<int>(inter), k = static_cast<int>(top_k);
  if (x.scalar_type() == torch::kHalf) {
    dispatch_gate_up<__half>(gate_up_warps, x, ids, trellis_g, trellis_u, suh_g, suh_u, gu, k, p, e, h, i, consts,
                             stream);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be fp16 or bf16");
    dispatch_gate_up<__nv_bfloat16>(gate_up_warps, x, ids, trellis_g, trellis_u, suh_g, suh_u, gu, k, p, e, h, i, consts,
                                    stream);
  }
  const float limit = static_cast<float>(act_limit);
  switch (down_warps) {
    case 4: launch_down<4>(gu, ids, svh_g, svh_u, trellis_d, suh_d, svh_d, y, p, e, h, i, limit, consts, stream, pdl); break;
    case 8: launch_down<8>(gu, ids, svh_g, svh_u, trellis_d, suh_d, svh_d, y, p, e, h, i, limit, consts, stream, pdl); break;
    case 16: launch_down<16>(gu, ids, svh_g, svh_u, trellis_d, suh_d, svh_d, y, p, e, h, i, limit, consts, stream, pdl); break;
    default: TORCH_CHECK(false, "down warps must be 4, 8 or 16, got ", down_warps);
  }
  const dim3 c_grid((hidden + 255) / 256, tokens);
  const float* yp = y.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  switch (out.scalar_type()) {
    case torch::kHalf:
      launch(combine_kernel<__half>, c_grid, 256, 0, stream, pdl, yp, wp, reinterpret_cast<__half*>(out.data_ptr()), k, h);
      break;
    case torch::kBFloat16:
      launch(combine_kernel<__nv_bfloat16>, c_grid, 256, 0, stream, pdl, yp, wp,
             reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), k, h);
      break;
    case torch::kFloat:
      launch(combine_kernel<float>, c_grid, 256, 0, stream, pdl, yp, wp, out.data_ptr<float>(), k, h);
      break;
    default:
      TORCH_CHECK(false, "out must be fp16, bf16 or fp32");
  }
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "mcg4_moe launch failed: ", cudaGetErrorString(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mcg4_moe", &mcg4_moe, "EXL3 K=4 mcg MoE for decode-sized batches (gate/up, down, combine)");
}
