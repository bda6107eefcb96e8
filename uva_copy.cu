// NOSI transfer kernels (docs/METHOD.md §6), built on first use by offload_kernels.py with
// torch.utils.cpp_extension.load as a plain library (no torch or pybind11 headers: nvcc compiles it in
// seconds) and called through ctypes with raw pointers, sizes and the caller's CUDA stream; offload_kernels.py
// checks shapes, dtypes and layouts before each call. They never wait for the host.
//
// Notation: R rows = (sequence, KV head) pairs of one layer; k slots per row on the GPU;
// a *unit* is one KV block, K then V: 2 * B * d elements, contiguous in the host store and in a slot.
//
// set_difference: per row, given the blocks the new selection needs (ascending block ids, -1 padded)
//   and the tables slot -> block and block -> slot, free the slots whose block is no longer needed,
//   give the i-th missing block the i-th free slot, and write fetch[row, slot] = block to load (or -1).
//   One CUDA block per row and one thread per slot: each evicts or keeps its own slot (a binary search
//   of the need list), then ranks give the i-th miss the i-th free slot, all in shared memory.
// gather_units: for every (row, slot) with fetch >= 0, copy host[row, fetch] -> pool[row, slot].
//   The host store is pinned, so with unified virtual addressing a kernel reads it directly through
//   its device pointer (cudaHostGetDevicePointer): one launch moves every missed block of a layer
//   as 16-byte vector reads, many PCIe requests in flight, instead of one memcpy per block. With
//   ctas > 0 at most that many thread blocks share the misses, leaving the other SMs to kernels
//   running beside the gather on another stream (micro-batches, fast.GraphedDecode).
// flush_tails: for every row whose tail block (pool slot k) has just been filled (pos % B == B - 1),
//   write it to host[row, pos / B] through the same mapping and copy it into the first free slot,
//   updating both tables. Rows whose tail is not full return at once, so the host never has to
//   look at the positions: the whole decode step stays free of syncs (and can be a CUDA graph).
#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int MAX_K = 1024;  // slots per row the set difference handles (one thread each)

__global__ void set_difference_kernel(const int64_t* __restrict__ need,  // (R, n_need) ascending, -1 pad
                                      int64_t* __restrict__ slot_block,  // (R, k)
                                      int64_t* __restrict__ block_slot,  // (R, cap)
                                      int64_t* __restrict__ fetch,       // (R, k) out
                                      int64_t n_need, int64_t k, int64_t cap) {
  // one CUDA block per row, one thread per slot (and per entry of the need list)
  __shared__ int64_t nd[MAX_K];
  __shared__ int free_slots[MAX_K];
  __shared__ bool is_free[MAX_K], is_miss[MAX_K];
  const int64_t r = blockIdx.x;
  const int t = threadIdx.x;
  int64_t* sb = slot_block + r * k;
  int64_t* bs = block_slot + r * cap;
  if (t < n_need) nd[t] = need[r * n_need + t];
  __syncthreads();
  // 1. evict: a resident block that is not needed any more frees its slot (binary search of the list)
  if (t < k) {
    fetch[r * k + t] = -1;
    int64_t b = sb[t];
    if (b >= 0) {
      int lo = 0, hi = n_need;  // first entry >= b; -1 padding sorts last in our lists
      while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (nd[mid] >= 0 && nd[mid] < b) lo = mid + 1; else hi = mid;
      }
      if (!(lo < n_need && nd[lo] == b)) { bs[b] = -1; sb[t] = -1; }
    }
  }
  __syncthreads();
  // 2. the free slots in ascending order, and the misses in ascending block order: the i-th miss
  //    takes the i-th free slot (ranks by counting flags in shared memory: k is small)
  if (t < k) is_free[t] = sb[t] < 0;
  if (t < n_need) is_miss[t] = nd[t] >= 0 && bs[nd[t]] < 0;
  __syncthreads();
  if (t < k && is_free[t]) {
    int rank = 0;
    for (int s = 0; s < t; ++s) rank += is_free[s];
    free_slots[rank] = t;
  }
  __syncthreads();
  if (t < n_need && is_miss[t]) {
    int rank = 0, n_free = 0;
    for (int i = 0; i < t; ++i) rank += is_miss[i];
    for (int s = 0; s < k; ++s) n_free += is_free[s];
    if (rank < n_free) {  // always, when the selection respects the slot count
      int s = free_slots[rank];
      fetch[r * k + s] = nd[t];
      sb[s] = nd[t];
    }
  }
  __syncthreads();
  if (t < k && is_free[t] && sb[t] >= 0) bs[sb[t]] = t;  // block -> slot for the blocks that just arrived
}

constexpr int THREADS = 256;
constexpr int UNROLL = 8;      // 16-byte loads each thread keeps in flight before it stores (32 KiB a block)
constexpr int PER_THREAD = 4;  // fetch entries each thread reads per chunk
constexpr int CHUNK = THREADS * PER_THREAD;

__global__ void gather_units_kernel(const int4* __restrict__ host,    // (R, cap, U16) in pinned memory
                                    int4* __restrict__ pool,          // (R, n_slots >= k, U16) on the device
                                    const int64_t* __restrict__ fetch,  // (R, k)
                                    int64_t n_rs, int64_t k, int64_t n_slots, int64_t cap, int64_t U16) {
  if (gridDim.x >= n_rs) {  // one block per (row, slot)
    int64_t rs = blockIdx.x, b = fetch[rs];
    if (b < 0) return;
    const int4* src = host + (rs / k * cap + b) * U16;
    int4* dst = pool + (rs / k * n_slots + rs % k) * U16;
    for (int64_t base = threadIdx.x; base < U16; base += (int64_t)THREADS * UNROLL) {
      int4 buf[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (base + u * THREADS < U16) buf[u] = src[base + u * THREADS];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (base + u * THREADS < U16) dst[base + u * THREADS] = buf[u];
    }
    return;
  }
  // Fewer blocks than units. Most entries of fetch are hits (-1), so the blocks do not walk the list:
  // every block reads it CHUNK entries at a time, ranks the misses among them (the same ranks in every
  // block), and copies those whose rank, modulo the grid, is its own. A block's misses of a chunk are
  // then one stream of 16-byte words, cut into rounds of THREADS * UNROLL loads whatever the unit
  // size, so 32 KiB stay in flight even for small units. The next chunk's entries are loaded before
  // the copy, so their latency hides behind it.
  __shared__ int warp_misses[THREADS / 32];
  __shared__ int64_t mine_src[CHUNK], mine_dst[CHUNK];  // word offsets of this block's misses
  __shared__ int n_mine;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t next[PER_THREAD];
  auto load = [&](int64_t c0) {  // entry c0 + e * THREADS + threadIdx.x: coalesced
#pragma unroll
    for (int e = 0; e < PER_THREAD; ++e) {
      int64_t rs = c0 + e * THREADS + threadIdx.x;
      next[e] = rs < n_rs ? fetch[rs] : -1;
    }
  };
  load(0);
  int64_t seen = 0;  // misses in the chunks before this one
  for (int64_t c0 = 0; c0 < n_rs; c0 += CHUNK) {
    int64_t b[PER_THREAD];
    int mine = 0;
#pragma unroll
    for (int e = 0; e < PER_THREAD; ++e) {
      b[e] = next[e];
      mine += b[e] >= 0;
    }
    int before = mine;  // inclusive prefix of the misses over the warp's threads
    for (int o = 1; o < 32; o *= 2) {
      int x = __shfl_up_sync(0xffffffffu, before, o);
      if (lane >= o) before += x;
    }
    if (lane == 31) warp_misses[warp] = before;
    if (threadIdx.x == 0) n_mine = 0;
    __syncthreads();
    int64_t rank = seen + before - mine, total = 0;  // this thread's first miss, over the whole list
    for (int w = 0; w < THREADS / 32; ++w) {
      rank += w < warp ? warp_misses[w] : 0;
      total += warp_misses[w];
    }
#pragma unroll
    for (int e = 0; e < PER_THREAD; ++e) {
      if (b[e] < 0) continue;
      if (rank % gridDim.x == blockIdx.x) {
        int64_t rs = c0 + e * THREADS + threadIdx.x;
        int i = atomicAdd(&n_mine, 1);
        mine_src[i] = (rs / k * cap + b[e]) * U16;
        mine_dst[i] = (rs / k * n_slots + rs % k) * U16;
      }
      ++rank;
    }
    __syncthreads();
    load(c0 + CHUNK);
    const unsigned n_words = n_mine * (unsigned)U16;  // < 2^31 (gather_units checks the unit size)
    for (unsigned base = threadIdx.x; base < n_words; base += THREADS * UNROLL) {
      int4 buf[UNROLL];
      int64_t dst[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        unsigned w = base + u * THREADS, i = w / (unsigned)U16;
        if (w < n_words) {
          buf[u] = host[mine_src[i] + (w - i * U16)];
          dst[u] = mine_dst[i] + (w - i * U16);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (base + u * THREADS < n_words) pool[dst[u]] = buf[u];
    }
    __syncthreads();  // the shared lists are rewritten by the next chunk
    seen += total;
  }
}

__global__ void flush_tails_kernel(int4* __restrict__ host,              // (R, cap, U16) in pinned memory
                                   int4* __restrict__ pool,              // (R, k + 1, U16), slot k = tail
                                   int64_t* __restrict__ slot_block,     // (R, k)
                                   int64_t* __restrict__ block_slot,     // (R, cap)
                                   const int64_t* __restrict__ pos,      // (Bz,) position just written
                                   int64_t H_kv, int64_t B, int64_t k, int64_t cap, int64_t U16) {
  int64_t row = blockIdx.x, p = pos[row / H_kv];
  if (p % B != B - 1) return;
  int64_t b = p / B;
  __shared__ int64_t free_slot;
  if (threadIdx.x == 0) {
    int64_t s = 0;
    while (s < k && slot_block[row * k + s] >= 0) ++s;  // there is one: at most k - 1 blocks besides the tail
    free_slot = s;
  }
  __syncthreads();
  int64_t s = free_slot;
  const int4* tail = pool + (row * (k + 1) + k) * U16;
  int4* dst_host = host + (row * cap + b) * U16;
  int4* dst_slot = pool + (row * (k + 1) + s) * U16;
  for (int64_t i = threadIdx.x; i < U16; i += THREADS) {
    int4 x = tail[i];
    dst_host[i] = x;
    if (s < k) dst_slot[i] = x;
  }
  if (threadIdx.x == 0 && s < k) {
    slot_block[row * k + s] = b;
    block_slot[row * cap + b] = s;
  }
}

}  // namespace

// The entry points: each returns a cudaError_t (0 = success); uva_error_string says what it means.
extern "C" {

const char* uva_error_string(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }

// the device address of pinned host memory (UVA) at `offset` bytes into the allocation at `base`
static cudaError_t device_pointer(void* base, int64_t offset, void** dev) {
  cudaError_t e = cudaHostGetDevicePointer(dev, base, 0);
  *dev = static_cast<char*>(*dev) + offset;
  return e;
}

int uva_set_difference(const int64_t* need, int64_t* slot_block, int64_t* block_slot, int64_t* fetch, int64_t R,
                       int64_t n_need, int64_t k, int64_t cap, void* stream) {
  if (k > MAX_K || n_need > k) return cudaErrorInvalidValue;  // at most MAX_K slots, no more needed blocks
  if (R == 0) return cudaSuccess;
  int threads = (int)((k + 31) / 32 * 32);
  set_difference_kernel<<<R, threads, 0, static_cast<cudaStream_t>(stream)>>>(need, slot_block, block_slot, fetch,
                                                                               n_need, k, cap);
  return cudaGetLastError();
}

int uva_gather_units(void* host_base, int64_t host_offset, void* pool, const int64_t* fetch, int64_t R, int64_t k,
                     int64_t n_slots, int64_t cap, int64_t U16, int64_t ctas, void* stream) {
  if (R * k == 0) return cudaSuccess;
  void* host = nullptr;
  cudaError_t e = device_pointer(host_base, host_offset, &host);
  if (e != cudaSuccess) return e;
  int64_t grid = ctas > 0 ? (ctas < R * k ? ctas : R * k) : R * k;  // ctas: at most that many blocks, each loops
  gather_units_kernel<<<grid, THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const int4*>(host), static_cast<int4*>(pool), fetch, R * k, k, n_slots, cap, U16);
  return cudaGetLastError();
}

int uva_flush_tails(void* host_base, int64_t host_offset, void* pool, int64_t* slot_block, int64_t* block_slot,
                    const int64_t* pos, int64_t R, int64_t H_kv, int64_t B, int64_t k, int64_t cap, int64_t U16,
                    void* stream) {
  if (R == 0) return cudaSuccess;
  void* host = nullptr;
  cudaError_t e = device_pointer(host_base, host_offset, &host);
  if (e != cudaSuccess) return e;
  flush_tails_kernel<<<R, THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<int4*>(host), static_cast<int4*>(pool), slot_block, block_slot, pos, H_kv, B, k, cap, U16);
  return cudaGetLastError();
}

}  // extern "C"
