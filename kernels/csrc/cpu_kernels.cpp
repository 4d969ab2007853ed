// pagedkv's CPU kernels: paged decode attention reading K/V blocks where they lie (no gather copy), and the
// fused per-token steps around it (residual add + RMSNorm, rotary embedding + KV-cache write, SiLU x up), each one
// pass over its rows where eager torch makes several. float32 activations; OpenMP over rows.
//
// Decode attention:
// One query token per row: out[token] = softmax(q . K^T * scale) V over the row's first `len` cached positions,
// whose blocks the row's block table names. Work items are (row, KV head) pairs, run in parallel by OpenMP
// (linked against the libgomp torch has loaded, so both share one thread pool). Each item walks its blocks once
// with an online softmax: per block, the scores of all its slots, one rescale of the running sum, then the
// weighted V rows. Slots past `len` are never read, so stale or NaN values in unwritten slots cannot matter.
// Accumulation is float32 whatever the cache dtype. Every index is checked before use: a bad table or length
// makes the call return an error code, never read outside the cache. Rows that share leading blocks (a cached
// prefix) read them once, as a group (attend_group).
#include <algorithm>
#include <atomic>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <omp.h>
#include <sched.h>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxHeads = 64;   // query heads one work item may take whole
constexpr int kMaxBlock = 256;  // tokens per block

enum Status : int { kOk = 0, kBadShape = 1, kBadBlock = 2, kBadLength = 3, kBadToken = 4 };

// e^x for x <= 0 (a score minus its running maximum), branch-free so loops over it vectorize: x = n ln2 + r with
// |r| <= ln2/2, e^r by a degree-6 polynomial (relative error < 2e-7), 2^n put into the exponent bits; x below -87
// gives 0 (e^-87 is below float's normal range, and a weight that small cannot move a sum of weights >= 1).
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  const float n = __builtin_rintf(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const float scale = __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
  return x < -87.f ? 0.f : p * scale;
}

// e^x for any x, vectorizable (the same polynomial; the input clamped to [-87, 88], where float is normal).
inline float exp_any(float x) {
  const float clamped = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_rintf(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

#if defined(__AVX512F__)
// The 16 horizontal sums of v[0..15] as one vector, by a shuffle-and-add tree (45 instructions where 16 separate
// reductions take about 130). Lane k of the result sums v[kTreeOrder[k]]: callers store the vector for slot t
// at v[kTreeOrder[t]] (the order is its own inverse).
constexpr int kTreeOrder[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

inline __m512 sum_each16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88), _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

// Scores of slots [0, n) of one block for query head q (already scaled) against its KV head's keys `k` (slot t
// at k + t * stride), 16 slots at a time: per slot D/16 vector FMAs, then one tree for the 16 sums.
template <int D>
inline void block_scores(const float* q, const float* k, int64_t stride, int n, float* s) {
  __m512 qv[D / 16];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int t0 = 0; t0 < n; t0 += 16) {
    __m512 part[16];
    for (int t = 0; t < 16; ++t) {
      if (t0 + t < n) {
        const float* kt = k + (t0 + t) * stride;
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
        for (int c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), a);
        part[kTreeOrder[t]] = a;
      } else {
        part[kTreeOrder[t]] = _mm512_setzero_ps();
      }
    }
    _mm512_storeu_ps(s + t0, sum_each16(part));
  }
}
#endif

template <typename T> inline float load(const T* p, int i);
template <> inline float load<float>(const float* p, int i) { return p[i]; }
struct bf16 { uint16_t bits; };
template <> inline float load<bf16>(const bf16* p, int i) {
  const uint32_t u = uint32_t(p[i].bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <> inline float load<_Float16>(const _Float16* p, int i) { return float(p[i]); }

struct Problem {
  const float* q;          // [tokens, heads, D]
  const void* key_cache;   // [blocks, block_size, kv_heads, D]
  const void* value_cache;
  const int32_t* tables;   // [seqs, width]
  const int32_t* lens;     // [seqs]
  const int64_t* tokens;   // [rows]: the query token of each decode row
  const int64_t* seqs;     // [rows]: its sequence (table row, length)
  float* out;              // [tokens, heads, D]
  int64_t rows, num_tokens, num_seqs, width, num_blocks;
  int block_size, heads, kv_heads;
  float scale;
  int threads;
};

// The online-softmax state of one row's query heads part-way through its blocks (see attend_group).
template <int D>
struct RowState {
  float acc[kMaxHeads][D], running_max[kMaxHeads], running_sum[kMaxHeads];
};

// One decode row over KV heads [kv_first, kv_last): walks the row's blocks once, reading each block's slots for
// those heads in memory order (a whole block is one contiguous run when all heads are taken), with the next
// block prefetched while this one is computed: the blocks lie anywhere, so the hardware cannot guess them.
// With `from`, the row's first `start` blocks are already folded into that state (all heads: kv_first 0).
template <typename T, int D>
int attend_row(const Problem& p, int64_t row, int kv_first, int kv_last, int start = 0,
               const RowState<D>* from = nullptr) {
  const int64_t token = p.tokens[row], seq = p.seqs[row];
  if (token < 0 || token >= p.num_tokens || seq < 0 || seq >= p.num_seqs) return kBadToken;
  const int len = p.lens[seq];
  const int bs = p.block_size, group = p.heads / p.kv_heads;
  if (len < 1 || len > p.width * bs) return kBadLength;
  const int32_t* table = p.tables + seq * p.width;
  const int nblocks = (len + bs - 1) / bs;
  for (int b = 0; b < nblocks; ++b)
    if (table[b] < 0 || table[b] >= p.num_blocks) return kBadBlock;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  const int heads = (kv_last - kv_first) * group;  // query heads of this item, in order
  const float* q = p.q + (token * p.heads + int64_t(kv_first) * group) * D;

  float qs[kMaxHeads][D], acc[kMaxHeads][D], running_max[kMaxHeads], running_sum[kMaxHeads];
  float s[kMaxHeads][kMaxBlock + 16];  // + 16: scores are stored 16 at a time
  for (int h = 0; h < heads; ++h) {
    for (int d = 0; d < D; ++d) {
      qs[h][d] = q[h * D + d] * p.scale;
      acc[h][d] = from ? from->acc[h][d] : 0.f;
    }
    running_max[h] = from ? from->running_max[h] : -std::numeric_limits<float>::infinity();
    running_sum[h] = from ? from->running_sum[h] : 0.f;
  }
  const int64_t slot_stride = int64_t(p.kv_heads) * D, block_stride = int64_t(bs) * slot_stride;
  const int span = (kv_last - kv_first) * D;  // elements of one slot this item reads
  for (int b = start; b < nblocks; ++b) {
    const int n = std::min(bs, len - b * bs);
    const int64_t base = table[b] * block_stride + int64_t(kv_first) * D;
    if (b + 1 < nblocks) {
      const int64_t next = table[b + 1] * block_stride + int64_t(kv_first) * D;
      for (int t = 0; t < bs; ++t)
        for (int e = 0; e < span; e += 64 / int(sizeof(T))) {
          __builtin_prefetch(kc + next + t * slot_stride + e);
          __builtin_prefetch(vc + next + t * slot_stride + e);
        }
    }


#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> && D % 16 == 0) {
      for (int h = 0; h < heads; ++h) block_scores<D>(qs[h], kc + base + (h / group) * D, slot_stride, n, s[h]);
    } else
#endif
    {
      for (int t = 0; t < n; ++t) {
        const T* k = kc + base + t * slot_stride;
        for (int h = 0; h < heads; ++h) {
          const T* kh = k + (h / group) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += qs[h][d] * load(kh, d);
          s[h][t] = dot;
        }
      }
    }
    for (int h = 0; h < heads; ++h) {
      float block_max = running_max[h];
      for (int t = 0; t < n; ++t) block_max = std::max(block_max, s[h][t]);
      const float rescale = exp_nonpositive(running_max[h] - block_max);
      running_max[h] = block_max;
      running_sum[h] *= rescale;
      for (int d = 0; d < D; ++d) acc[h][d] *= rescale;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < n; ++t) {
        s[h][t] = exp_nonpositive(s[h][t] - block_max);
        sum += s[h][t];
      }
      running_sum[h] += sum;
    }
    for (int t = 0; t < n; ++t) {
      const T* v = vc + base + t * slot_stride;
      for (int h = 0; h < heads; ++h) {
        const T* vh = v + (h / group) * D;
        const float w = s[h][t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[h][d] += w * load(vh, d);
      }
    }
  }
  float* out = p.out + (token * p.heads + int64_t(kv_first) * group) * D;
  for (int h = 0; h < heads; ++h) {
    const float inv = 1.f / running_sum[h];
    for (int d = 0; d < D; ++d) out[h * D + d] = acc[h][d] * inv;
  }
  return kOk;
}

// Rows that share a cached prefix (the same leading blocks: a system prompt, n-shot examples, a fork) read it once
// for the whole group: the group's queries are held transposed, one lane per row, so a block's scores for every
// row come from broadcast FMAs over the key's dims, with no horizontal sums, and the softmax runs lane-parallel.
// Then each row goes on alone from the first block it does not share (attend_row, from this state).
constexpr int kGroupRows = 16;   // lanes: rows one group pass takes
constexpr int kMinShared = 2;    // shared blocks that make a group pass worth it

struct Group {
  int64_t first;  // rows [first, first + count) of the call, in its order
  int count;
  int shared;  // leading blocks every row of the group has, full, at the same block ids
};

// Full blocks row `row` has, or -1 when its token, sequence or length is not one to trust (attend_row then
// reports what is wrong).
int full_blocks(const Problem& p, int64_t row) {
  const int64_t token = p.tokens[row], seq = p.seqs[row];
  if (token < 0 || token >= p.num_tokens || seq < 0 || seq >= p.num_seqs) return -1;
  const int len = p.lens[seq];
  if (len < 1 || len > p.width * p.block_size) return -1;
  return len / p.block_size;
}

// Consecutive rows whose tables start with at least kMinShared equal blocks, up to kGroupRows at a time.
std::vector<Group> find_groups(const Problem& p) {
  std::vector<Group> groups;
  int64_t i = 0;
  while (i < p.rows) {
    int shared = full_blocks(p, i);
    int64_t j = i + 1;
    if (shared >= kMinShared) {
      const int32_t* lead = p.tables + p.seqs[i] * p.width;
      for (; j < p.rows && j - i < kGroupRows; ++j) {
        const int full = full_blocks(p, j);
        const int32_t* other = p.tables + p.seqs[j] * p.width;
        int common = 0;
        const int limit = std::min(shared, full);
        while (common < limit && other[common] == lead[common]) ++common;
        if (common < kMinShared) break;
        shared = common;
      }
    }
    groups.push_back(j - i > 1 ? Group{i, int(j - i), shared} : Group{i, 1, 0});
    i = j;
  }
  return groups;
}

template <int D>
int attend_group(const Problem& p, const Group& g) {
  const int heads = p.heads, group = p.heads / p.kv_heads, bs = p.block_size, lanes = g.count;
  const int32_t* table = p.tables + p.seqs[g.first] * p.width;
  for (int b = 0; b < g.shared; ++b)
    if (table[b] < 0 || table[b] >= p.num_blocks) return kBadBlock;
  const float* kc = static_cast<const float*>(p.key_cache);
  const float* vc = static_cast<const float*>(p.value_cache);
  const int64_t slot_stride = int64_t(p.kv_heads) * D, block_stride = int64_t(bs) * slot_stride;
  // [head][dim][lane]: lanes past the group's rows stay zero (their scores are computed and never used).
  std::vector<float> qt(size_t(heads) * D * kGroupRows, 0.f), acc(size_t(heads) * D * kGroupRows, 0.f);
  std::vector<float> mx(size_t(heads) * kGroupRows, -std::numeric_limits<float>::infinity());
  std::vector<float> sum(size_t(heads) * kGroupRows, 0.f), s(size_t(bs) * kGroupRows);
  for (int r = 0; r < lanes; ++r) {
    const float* q = p.q + p.tokens[g.first + r] * heads * D;
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < D; ++d) qt[(size_t(h) * D + d) * kGroupRows + r] = q[h * D + d] * p.scale;
  }
  for (int b = 0; b < g.shared; ++b) {
    const int64_t base = table[b] * block_stride;
    for (int h = 0; h < heads; ++h) {
      const float* k = kc + base + (h / group) * D;
      const float* v = vc + base + (h / group) * D;
      const float* qh = &qt[size_t(h) * D * kGroupRows];
      float* ah = &acc[size_t(h) * D * kGroupRows];
      float* m = &mx[size_t(h) * kGroupRows];
      float* l = &sum[size_t(h) * kGroupRows];
      float block_max[kGroupRows], rescale[kGroupRows];
      for (int r = 0; r < kGroupRows; ++r) block_max[r] = m[r];
      for (int t = 0; t < bs; ++t) {
        const float* kt = k + t * slot_stride;
        float a[kGroupRows] = {};  // a local accumulator: the compiler keeps it in a register
        for (int d = 0; d < D; ++d) {
          const float kd = kt[d];
#pragma omp simd
          for (int r = 0; r < kGroupRows; ++r) a[r] += qh[d * kGroupRows + r] * kd;
        }
        float* st = &s[size_t(t) * kGroupRows];
#pragma omp simd
        for (int r = 0; r < kGroupRows; ++r) {
          st[r] = a[r];
          block_max[r] = std::max(block_max[r], a[r]);
        }
      }
#pragma omp simd
      for (int r = 0; r < kGroupRows; ++r) {
        rescale[r] = exp_nonpositive(m[r] - block_max[r]);
        m[r] = block_max[r];
      }
      float block_sum[kGroupRows] = {};
      for (int t = 0; t < bs; ++t) {
        float* st = &s[size_t(t) * kGroupRows];
#pragma omp simd
        for (int r = 0; r < kGroupRows; ++r) {
          st[r] = exp_nonpositive(st[r] - m[r]);
          block_sum[r] += st[r];
        }
      }
#pragma omp simd
      for (int r = 0; r < kGroupRows; ++r) l[r] = l[r] * rescale[r] + block_sum[r];
      // acc = acc * rescale + P V, four dims at a time held in registers across the block's slots.
      for (int d0 = 0; d0 < D; d0 += 4) {
        float a0[kGroupRows], a1[kGroupRows], a2[kGroupRows], a3[kGroupRows];
        float* row0 = ah + d0 * kGroupRows;
#pragma omp simd
        for (int r = 0; r < kGroupRows; ++r) {
          a0[r] = row0[r] * rescale[r];
          a1[r] = row0[kGroupRows + r] * rescale[r];
          a2[r] = row0[2 * kGroupRows + r] * rescale[r];
          a3[r] = row0[3 * kGroupRows + r] * rescale[r];
        }
        for (int t = 0; t < bs; ++t) {
          const float* vt = v + t * slot_stride + d0;
          const float* st = &s[size_t(t) * kGroupRows];
          const float v0 = vt[0], v1 = vt[1], v2 = vt[2], v3 = vt[3];
#pragma omp simd
          for (int r = 0; r < kGroupRows; ++r) {
            a0[r] += st[r] * v0;
            a1[r] += st[r] * v1;
            a2[r] += st[r] * v2;
            a3[r] += st[r] * v3;
          }
        }
#pragma omp simd
        for (int r = 0; r < kGroupRows; ++r) {
          row0[r] = a0[r];
          row0[kGroupRows + r] = a1[r];
          row0[2 * kGroupRows + r] = a2[r];
          row0[3 * kGroupRows + r] = a3[r];
        }
      }
    }
  }
  RowState<D> state;
  for (int r = 0; r < lanes; ++r) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < D; ++d) state.acc[h][d] = acc[(size_t(h) * D + d) * kGroupRows + r];
      state.running_max[h] = mx[size_t(h) * kGroupRows + r];
      state.running_sum[h] = sum[size_t(h) * kGroupRows + r];
    }
    const int rc = attend_row<float, D>(p, g.first + r, 0, p.kv_heads, g.shared, &state);
    if (rc != kOk) return rc;
  }
  return kOk;
}

// Work items are whole rows when there are enough of them to keep every thread busy, else (row, KV head) pairs;
// with whole rows of a float32 cache, rows sharing a cached prefix go as one item (attend_group).
template <typename T, int D>
int attend_all(const Problem& p) {
  std::atomic<int> status{kOk};
  const int per_item = (p.rows >= 4 * p.threads && p.heads <= kMaxHeads) ? p.kv_heads : 1;
  if constexpr (std::is_same_v<T, float>) {
    if (per_item == p.kv_heads) {
      const std::vector<Group> groups = find_groups(p);
      if (groups.size() < size_t(p.rows)) {
        const int64_t items = int64_t(groups.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
        for (int64_t item = 0; item < items; ++item) {
          if (status.load(std::memory_order_relaxed) != kOk) continue;
          const Group& g = groups[item];
          const int rc = g.count > 1 ? attend_group<D>(p, g) : attend_row<T, D>(p, g.first, 0, p.kv_heads);
          if (rc != kOk) status.store(rc, std::memory_order_relaxed);
        }
        return status.load();
      }
    }
  }
  const int64_t splits = p.kv_heads / per_item, items = p.rows * splits;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (int64_t item = 0; item < items; ++item) {
    if (status.load(std::memory_order_relaxed) != kOk) continue;
    const int first = int(item % splits) * per_item;
    const int rc = attend_row<T, D>(p, item / splits, first, first + per_item);
    if (rc != kOk) status.store(rc, std::memory_order_relaxed);
  }
  return status.load();
}

template <typename T>
int by_head_dim(const Problem& p, int head_dim) {
  switch (head_dim) {
    case 32: return attend_all<T, 32>(p);
    case 64: return attend_all<T, 64>(p);
    case 80: return attend_all<T, 80>(p);
    case 96: return attend_all<T, 96>(p);
    case 128: return attend_all<T, 128>(p);
    case 256: return attend_all<T, 256>(p);
    default: return kBadShape;
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16 (of the caches; q and out are float32).
int pagedkv_decode_attention(const float* q, const void* key_cache, const void* value_cache, int dtype,
                             const int32_t* tables, const int32_t* lens, const int64_t* tokens, const int64_t* seqs,
                             float* out, int64_t rows, int64_t num_tokens, int64_t num_seqs, int64_t width,
                             int64_t num_blocks, int block_size, int heads, int kv_heads, int head_dim, float scale,
                             int threads) {
  if (block_size < 1 || block_size > kMaxBlock || kv_heads < 1 || heads % kv_heads != 0 ||
      heads / kv_heads > kMaxGroup || width < 1 || rows < 0 || threads < 1)
    return kBadShape;
  const Problem p{q,        key_cache, value_cache, tables,     lens,       tokens, seqs,     out,   rows,
                  num_tokens, num_seqs, width,       num_blocks, block_size, heads,  kv_heads, scale, threads};
  switch (dtype) {
    case 0: return by_head_dim<float>(p, head_dim);
    case 1: return by_head_dim<bf16>(p, head_dim);
    case 2: return by_head_dim<_Float16>(p, head_dim);
    default: return kBadShape;
  }
}

// residual += delta (when delta is given), then out = residual * rsqrt(mean(residual^2) + eps) * weight, per row.
int pagedkv_add_rms_norm(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                         int64_t hidden, float eps, int threads) {
  if (rows < 0 || hidden < 1 || threads < 1) return kBadShape;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * hidden > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    float* x = residual + r * hidden;
    if (delta != nullptr) {
      const float* dx = delta + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) x[i] += dx[i];
    }
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += x[i] * x[i];
    const float inv = 1.f / std::sqrt(squares / float(hidden) + eps);
    float* y = out + r * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) y[i] = weight[i] * (x[i] * inv);
  }
  return kOk;
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]: the gated MLP's activation, gate and up fused.
int pagedkv_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter, int threads) {
  if (rows < 0 || inter < 1 || threads < 1) return kBadShape;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    float* y = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) y[i] = g[i] / (1.f + exp_any(-g[i])) * u[i];
  }
  return kOk;
}

// out[r] = the first index of the largest value of row r of logits [rows, cols], a NaN counting as largest (as
// torch.argmax has it): greedy sampling. Two vectorized passes over each row (its max, then where it first is),
// where torch's generic reduction makes one slow pass.
int pagedkv_argmax(const float* logits, int64_t rows, int64_t cols, int64_t* out, int threads) {
  if (rows < 0 || cols < 1 || threads < 1) return kBadShape;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * cols;
    float best = x[0];
    bool nan = false;
#pragma omp simd reduction(max : best) reduction(|| : nan)
    for (int64_t i = 0; i < cols; ++i) {
      best = std::max(best, x[i]);
      nan = nan || x[i] != x[i];
    }
    int64_t at = 0;
    if (nan) {
      while (x[at] == x[at]) ++at;
    } else {
      while (x[at] != best) ++at;
    }
    out[r] = at;
  }
  return kOk;
}

// The rotary embedding (rotate-half form) of each token's q and k heads, then k and v into the paged cache at the
// token's slot (-1: a padding token, not written) and the rotated q into q_out [tokens, heads, D].
// qkv [tokens, (heads + 2 kv_heads) D]; cos, sin [max_position, D]; caches float32 [slots, kv_heads, D].
int pagedkv_rope_write_kv(const float* qkv, const int64_t* positions, const float* cos, const float* sin,
                          const int64_t* slots, float* key_cache, float* value_cache, float* q_out, int64_t tokens,
                          int heads, int kv_heads, int head_dim, int64_t max_position, int64_t num_slots,
                          int threads) {
  if (tokens < 0 || heads < 1 || kv_heads < 1 || head_dim < 2 || head_dim % 2 || threads < 1) return kBadShape;
  for (int64_t t = 0; t < tokens; ++t) {  // all checked before anything is written
    if (positions[t] < 0 || positions[t] >= max_position) return kBadToken;
    if (slots[t] < -1 || slots[t] >= num_slots) return kBadBlock;
  }
  const int half = head_dim / 2;
  const int64_t width = int64_t(heads + 2 * kv_heads) * head_dim, kv_width = int64_t(kv_heads) * head_dim;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens * width > 16384)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = qkv + t * width;
    const float* c = cos + positions[t] * head_dim;
    const float* s = sin + positions[t] * head_dim;
    auto rotate = [&](const float* x, float* y) {
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        y[i] = x[i] * c[i] - x[i + half] * s[i];
        y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
    };
    for (int h = 0; h < heads; ++h) rotate(row + h * head_dim, q_out + (t * heads + h) * head_dim);
    if (slots[t] < 0) continue;
    float* k_out = key_cache + slots[t] * kv_width;
    for (int h = 0; h < kv_heads; ++h) rotate(row + int64_t(heads + h) * head_dim, k_out + h * head_dim);
    std::memcpy(value_cache + slots[t] * kv_width, row + int64_t(heads + kv_heads) * head_dim,
                sizeof(float) * kv_width);
  }
  return kOk;
}

// Pins the worker threads of the OpenMP team torch's parallel regions run on: team thread i (i >= 1) to cpus[i].
// A worker the kernel may move between cores is also one it may park on a core another process is using, and
// the whole team then waits for it. Thread 0 is the caller (the engine's Python thread) and is left free, and so
// are threads it starts later, which would otherwise inherit its mask. Returns how many workers failed to pin.
int pagedkv_pin_workers(const int* cpus, int count) {
  if (count < 1) return 0;
  int failures = 0;
#pragma omp parallel num_threads(count) reduction(+ : failures)
  {
    const int i = omp_get_thread_num();
    if (i > 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[i], &set);
      if (sched_setaffinity(0, sizeof set, &set) != 0) failures += 1;
    }
  }
  return failures;
}

// The ABI version this source implements; the loader refuses a library that answers another.
int pagedkv_native_abi() { return 4; }
}
