// mha's CUDA attention kernel (crates/mha/kernels/attention.cu) compiled for the CPU, with
// the CUDA built-ins it uses emulated, so that tests/cuda_attention.rs can check its
// arithmetic against mha's reference attention on a machine without a GPU. Each block
// runs on its own, one system thread per CUDA thread, `__syncthreads` a barrier between
// them: the kernel's shared-memory tiles and barriers are exercised as on a GPU (what this
// cannot show: the PTX compiler's own work, the launch from Rust, speed). Launches run one
// at a time.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x, y, z;
};
static dim3 blockIdx;
static thread_local dim3 threadIdx;
static pthread_barrier_t* block_barrier;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { pthread_barrier_wait(block_barrier); }

struct f16_t {
    uint16_t bits;
};
struct bf16_t {
    uint16_t bits;
};
static inline float to_f32(float x) { return x; }
static inline float to_f32(f16_t x) {
    _Float16 h;
    std::memcpy(&h, &x.bits, 2);
    return (float)h;
}
static inline float to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline void from_f32(float x, float* y) { *y = x; }
static inline void from_f32(float x, f16_t* y) {
    _Float16 h = (_Float16)x;
    std::memcpy(&y->bits, &h, 2);
}
static inline void from_f32(float x, bf16_t* y) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7fff + ((u >> 16) & 1); // round to nearest even (finite values)
    y->bits = (uint16_t)(u >> 16);
}

#include "../../crates/mha/kernels/attention.cu"

typedef long long ll;

// Runs kernel `f` over a grid of (grid_x, h, b) blocks of `threads` threads.
template <typename TQ, typename TKV>
static void run(void (*f)(const TQ*, const TKV*, const TKV*, TQ*, int, int, int, int, ll, ll,
                          ll, ll, ll, ll, ll, ll, ll, int, int, int, float, float),
                int threads, int grid_x, const void* q, const void* k, const void* v,
                void* out, int b, int h, int h_kv, int tq, int tk, const ll* st, int causal,
                int offset, int window, float scale, float softcap) {
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, nullptr, threads);
    block_barrier = &barrier;
    for (int z = 0; z < b; ++z) {
        for (int y = 0; y < h; ++y) {
            for (int x = 0; x < grid_x; ++x) {
                blockIdx = dim3{(unsigned)x, (unsigned)y, (unsigned)z};
                std::vector<std::thread> team;
                for (int t = 0; t < threads; ++t) {
                    team.emplace_back([=] {
                        threadIdx = dim3{(unsigned)t, 0, 0};
                        f((const TQ*)q, (const TKV*)k, (const TKV*)v, (TQ*)out, h, h_kv, tq,
                          tk, st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7], st[8],
                          causal, offset, window, scale, softcap);
                    });
                }
                for (auto& t : team) {
                    t.join();
                }
            }
        }
    }
    pthread_barrier_destroy(&barrier);
}

#define MHA_CASE(TQ, TKV, NQ, NKV, D)                                                     \
    case D:                                                                                \
        if (decode) {                                                                      \
            run<TQ, TKV>(mha_attention_decode_##NQ##_##NKV##_d##D, MHA_DECODE_THREADS, tq, \
                         q, k, v, out, b, h, h_kv, tq, tk, strides, causal, offset, window, \
                         scale, softcap);                                                  \
        } else {                                                                           \
            run<TQ, TKV>(mha_attention_##NQ##_##NKV##_d##D, MHA_BQ,                        \
                         (tq + MHA_BQ - 1) / MHA_BQ, q, k, v, out, b, h, h_kv, tq, tk,     \
                         strides, causal, offset, window, scale, softcap);                 \
        }                                                                                  \
        return 0;

#define MHA_PICK(NQ, NKV, TQ, TKV)                               \
    switch (d) {                                                 \
        MHA_FOR_HEAD_DIMS(MHA_CASE, TQ, TKV, NQ, NKV)            \
    default:                                                     \
        return -1;                                               \
    }

// `kind`: 0 f32 queries and keys, 1 f32 queries with f16 keys and values, 2 the same
// with bf16, 3 all f16, 4 all bf16 (f16 and bf16 passed as their 16-bit patterns).
// `strides`: q's, k's, v's element strides for batch, head and position, in that order.
// `decode`: the kernel with a block per query (mha_attention_decode) instead of a thread.
// Returns -1 for a kind or head dimension the kernel has no instance for.
extern "C" int mha_attention_emulated(int kind, int decode, int d, const void* q, const void* k,
                                      const void* v, void* out, int b, int h, int h_kv,
                                      int tq, int tk, const ll* strides, int causal,
                                      int offset, int window, float scale, float softcap) {
    // One emulated launch at a time: the block's index, its barrier and the kernel's
    // shared tiles are process-wide here (tests run on several threads).
    static std::mutex one_launch;
    std::lock_guard<std::mutex> guard(one_launch);
    switch (kind) {
    case 0: MHA_PICK(f32, f32, float, float)
    case 1: MHA_PICK(f32, f16, float, f16_t)
    case 2: MHA_PICK(f32, bf16, float, bf16_t)
    case 3: MHA_PICK(f16, f16, f16_t, f16_t)
    case 4: MHA_PICK(bf16, bf16, bf16_t, bf16_t)
    default: return -1;
    }
}
