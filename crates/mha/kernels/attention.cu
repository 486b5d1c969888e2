// Fused attention forward on CUDA: softmax(q·kᵀ·scale [soft-capped] + causal/window
// mask)·v in one pass over the keys, no score matrix in memory (the online softmax of
// FlashAttention). Built to PTX by mha's build script (feature `cuda`) and launched by
// `src/flash/cuda.rs`. The same source compiles as C++ for the CPU with the CUDA
// built-ins emulated (tests/support/cuda_emulation.cpp), which is how its arithmetic is
// tested on machines without a GPU.
//
// Layout: q [b, h, tq, D], k and v [b, h_kv, tk, D], each with its own element strides for
// batch, head and position and the head dimension contiguous; out [b, h, tq, D]
// contiguous. Query head i reads key/value head i / (h / h_kv) (grouped-query attention).
// Query i sits at absolute position `offset + i` (`offset` clamped to tk, as mha's masks
// clamp it); with `causal` it sees keys 0..=offset+i, and with `window > 0` only the
// `window` most recent of them; without `causal` every key. A query that sees no key
// gives zeros.
//
// One block of BQ threads takes BQ consecutive queries of one (batch, head), a thread
// per query: its q row and running sums live in registers. The block walks the keys in
// tiles of TK rows, which its threads load into shared memory together (converted to
// f32), so each key row is read from global memory once per block.

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef __half f16_t;
typedef __nv_bfloat16 bf16_t;
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(f16_t x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(bf16_t x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f32(float x, float* y) { *y = x; }
__device__ __forceinline__ void from_f32(float x, f16_t* y) { *y = __float2half(x); }
__device__ __forceinline__ void from_f32(float x, bf16_t* y) { *y = __float2bfloat16(x); }
#endif

#define MHA_BQ 64

// Key rows per shared-memory tile: 16 KiB of keys and as much of values in f32.
template <int D>
struct Tile {
    static const int TK = 4096 / D;
};

template <typename TQ, typename TKV, int D>
__device__ void mha_attention(
    const TQ* q, const TKV* k, const TKV* v, TQ* out,
    int h, int h_kv, int tq, int tk,
    long long q_sb, long long q_sh, long long q_st,
    long long k_sb, long long k_sh, long long k_st,
    long long v_sb, long long v_sh, long long v_st,
    int causal, int offset, int window, float scale, float softcap)
{
    const int TK = Tile<D>::TK;
    // As mha's masks read it: an offset from tk on shows every key (the positions clamped).
    offset = offset < tk ? offset : tk;
    __shared__ float ks[Tile<D>::TK * D];
    __shared__ float vs[Tile<D>::TK * D];
    const int tid = threadIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int q0 = blockIdx.x * MHA_BQ;
    const int i = q0 + tid;
    const int kv_head = head / (h / h_kv);
    const TKV* kb = k + batch * k_sb + kv_head * k_sh;
    const TKV* vb = v + batch * v_sb + kv_head * v_sh;

    // The keys any query of the block sees: [lo, hi).
    const int last_q = (q0 + MHA_BQ < tq ? q0 + MHA_BQ : tq) - 1;
    int hi = tk;
    int lo = 0;
    if (causal) {
        hi = offset + last_q + 1 < tk ? offset + last_q + 1 : tk;
        if (window > 0) {
            lo = offset + q0 + 1 - window;
            lo = lo > 0 ? lo : 0;
        }
    }
    // This thread's keys: [mine_lo, mine_hi).
    int mine_lo = lo, mine_hi = hi;
    if (causal && i < tq) {
        mine_hi = offset + i + 1 < tk ? offset + i + 1 : tk;
        if (window > 0) {
            mine_lo = offset + i + 1 - window;
            mine_lo = mine_lo > 0 ? mine_lo : 0;
        }
    }

    float qr[D];
    float acc[D];
    float m = -INFINITY;
    float l = 0.0f;
    if (i < tq) {
        const TQ* qrow = q + batch * q_sb + head * q_sh + i * q_st;
        for (int d = 0; d < D; ++d) {
            qr[d] = to_f32(qrow[d]) * scale;
            acc[d] = 0.0f;
        }
    }
    for (int k0 = lo - lo % TK; k0 < hi; k0 += TK) {
        // Every thread of the block reaches both barriers: the loop's bounds are the
        // block's, not the thread's.
        for (int e = tid; e < TK * D; e += MHA_BQ) {
            const int j = k0 + e / D;
            const int d = e % D;
            ks[e] = j < tk ? to_f32(kb[j * k_st + d]) : 0.0f;
            vs[e] = j < tk ? to_f32(vb[j * v_st + d]) : 0.0f;
        }
        __syncthreads();
        if (i < tq) {
            const int j0 = k0 > mine_lo ? k0 : mine_lo;
            const int j1 = k0 + TK < mine_hi ? k0 + TK : mine_hi;
            for (int j = j0; j < j1; ++j) {
                const float* kr = ks + (j - k0) * D;
                // Four partial sums: four chains of dependent adds instead of one (D is a
                // multiple of 4).
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                for (int d = 0; d < D; d += 4) {
                    s0 += qr[d] * kr[d];
                    s1 += qr[d + 1] * kr[d + 1];
                    s2 += qr[d + 2] * kr[d + 2];
                    s3 += qr[d + 3] * kr[d + 3];
                }
                float s = (s0 + s1) + (s2 + s3);
                if (softcap > 0.0f) {
                    s = softcap * tanhf(s / softcap);
                }
                if (s > m) {
                    // A new maximum: rescale what was summed against the old one.
                    const float c = expf(m - s);
                    l *= c;
                    for (int d = 0; d < D; ++d) {
                        acc[d] *= c;
                    }
                    m = s;
                }
                const float p = expf(s - m);
                l += p;
                const float* vr = vs + (j - k0) * D;
                for (int d = 0; d < D; ++d) {
                    acc[d] += p * vr[d];
                }
            }
        }
        __syncthreads();
    }
    if (i < tq) {
        TQ* orow = out + ((long long)(batch * h + head) * tq + i) * D;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int d = 0; d < D; ++d) {
            from_f32(acc[d] * inv, orow + d);
        }
    }
}

#define MHA_DECODE_THREADS 128
// Scores held in shared memory per pass over the keys (8 KiB); longer caches take several
// passes, joined by the online softmax.
#define MHA_DECODE_CHUNK 2048

// The same attention for a few queries against a long cache (decoding), where a thread
// per query would walk every key alone: a block of MHA_DECODE_THREADS threads per query
// (grid: queries, heads, batch rows) splits the keys between its threads for the scores,
// reduces their maximum and sum in shared memory, then splits the head dimension for the
// weighted sum of the values. Arguments as for mha_attention.
template <typename TQ, typename TKV, int D>
__device__ void mha_attention_decode(
    const TQ* q, const TKV* k, const TKV* v, TQ* out,
    int h, int h_kv, int tq, int tk,
    long long q_sb, long long q_sh, long long q_st,
    long long k_sb, long long k_sh, long long k_st,
    long long v_sb, long long v_sh, long long v_st,
    int causal, int offset, int window, float scale, float softcap)
{
    const int T = MHA_DECODE_THREADS;
    // The output dimensions a thread sums: tid, tid + T, ...
    const int R = (D + MHA_DECODE_THREADS - 1) / MHA_DECODE_THREADS;
    __shared__ float qs[D];
    __shared__ float ps[MHA_DECODE_CHUNK];
    __shared__ float red[MHA_DECODE_THREADS];
    offset = offset < tk ? offset : tk;
    const int tid = threadIdx.x;
    const int i = blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (h / h_kv);
    const TKV* kb = k + batch * k_sb + kv_head * k_sh;
    const TKV* vb = v + batch * v_sb + kv_head * v_sh;
    int lo = 0, hi = tk;
    if (causal) {
        hi = offset + i + 1 < tk ? offset + i + 1 : tk;
        if (window > 0) {
            lo = offset + i + 1 - window;
            lo = lo > 0 ? lo : 0;
        }
    }
    const TQ* qrow = q + batch * q_sb + head * q_sh + i * q_st;
    for (int d = tid; d < D; d += T) {
        qs[d] = to_f32(qrow[d]) * scale;
    }
    float acc[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    // The running maximum and sum: the same in every thread (read from `red` after the
    // reductions).
    float m = -INFINITY;
    float l = 0.0f;
    __syncthreads();
    for (int c0 = lo; c0 < hi; c0 += MHA_DECODE_CHUNK) {
        const int n = hi - c0 < MHA_DECODE_CHUNK ? hi - c0 : MHA_DECODE_CHUNK;
        float mx = -INFINITY;
        for (int j = tid; j < n; j += T) {
            const TKV* kr = kb + (long long)(c0 + j) * k_st;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            for (int d = 0; d < D; d += 4) {
                s0 += qs[d] * to_f32(kr[d]);
                s1 += qs[d + 1] * to_f32(kr[d + 1]);
                s2 += qs[d + 2] * to_f32(kr[d + 2]);
                s3 += qs[d + 3] * to_f32(kr[d + 3]);
            }
            float s = (s0 + s1) + (s2 + s3);
            if (softcap > 0.0f) {
                s = softcap * tanhf(s / softcap);
            }
            ps[j] = s;
            mx = s > mx ? s : mx;
        }
        red[tid] = mx;
        __syncthreads();
        for (int w = T / 2; w > 0; w /= 2) {
            if (tid < w) {
                red[tid] = red[tid + w] > red[tid] ? red[tid + w] : red[tid];
            }
            __syncthreads();
        }
        const float m_new = red[0] > m ? red[0] : m;
        __syncthreads(); // every thread has read red[0] before it is written again
        float sum = 0.0f;
        for (int j = tid; j < n; j += T) {
            const float p = expf(ps[j] - m_new);
            ps[j] = p;
            sum += p;
        }
        red[tid] = sum;
        __syncthreads();
        for (int w = T / 2; w > 0; w /= 2) {
            if (tid < w) {
                red[tid] += red[tid + w];
            }
            __syncthreads();
        }
        const float c = expf(m - m_new);
        l = l * c + red[0];
        m = m_new;
        for (int r = 0; r < R; ++r) {
            const int d = tid + r * T;
            if (d < D) {
                float a = acc[r] * c;
                for (int j = 0; j < n; ++j) {
                    a += ps[j] * to_f32(vb[(long long)(c0 + j) * v_st + d]);
                }
                acc[r] = a;
            }
        }
        __syncthreads(); // before the next pass writes ps and red
    }
    TQ* orow = out + ((long long)(batch * h + head) * tq + i) * D;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int r = 0; r < R; ++r) {
        const int d = tid + r * T;
        if (d < D) {
            from_f32(acc[r] * inv, orow + d);
        }
    }
}

// The instances `src/flash/cuda.rs` launches: mha_attention_<q>_<kv>_d<D> (a thread per
// query) and mha_attention_decode_<q>_<kv>_d<D> (a block per query).
#define MHA_KERNEL(KIND, TQ, TKV, NQ, NKV, D)                                             \
    extern "C" __global__ void KIND##_##NQ##_##NKV##_d##D(                                \
        const TQ* q, const TKV* k, const TKV* v, TQ* out, int h, int h_kv, int tq, int tk, \
        long long q_sb, long long q_sh, long long q_st, long long k_sb, long long k_sh,    \
        long long k_st, long long v_sb, long long v_sh, long long v_st, int causal,        \
        int offset, int window, float scale, float softcap) {                             \
        KIND<TQ, TKV, D>(q, k, v, out, h, h_kv, tq, tk, q_sb, q_sh, q_st, k_sb, k_sh,     \
                         k_st, v_sb, v_sh, v_st, causal, offset, window, scale, softcap); \
    }

#define MHA_INSTANCE(TQ, TKV, NQ, NKV, D)                     \
    MHA_KERNEL(mha_attention, TQ, TKV, NQ, NKV, D)            \
    MHA_KERNEL(mha_attention_decode, TQ, TKV, NQ, NKV, D)

// X(TQ, TKV, NQ, NKV, D) for every head dimension D with instances (the list
// `src/flash/cuda.rs` holds as HEAD_DIMS; the CPU emulation's launcher takes it too).
#define MHA_FOR_HEAD_DIMS(X, TQ, TKV, NQ, NKV)                              \
    X(TQ, TKV, NQ, NKV, 8) X(TQ, TKV, NQ, NKV, 16) X(TQ, TKV, NQ, NKV, 32)  \
    X(TQ, TKV, NQ, NKV, 64) X(TQ, TKV, NQ, NKV, 80) X(TQ, TKV, NQ, NKV, 96) \
    X(TQ, TKV, NQ, NKV, 128) X(TQ, TKV, NQ, NKV, 256)

#define MHA_HEAD_DIMS(TQ, TKV, NQ, NKV) MHA_FOR_HEAD_DIMS(MHA_INSTANCE, TQ, TKV, NQ, NKV)

MHA_HEAD_DIMS(float, float, f32, f32)
MHA_HEAD_DIMS(float, f16_t, f32, f16)
MHA_HEAD_DIMS(float, bf16_t, f32, bf16)
MHA_HEAD_DIMS(f16_t, f16_t, f16, f16)
MHA_HEAD_DIMS(bf16_t, bf16_t, bf16, bf16)
