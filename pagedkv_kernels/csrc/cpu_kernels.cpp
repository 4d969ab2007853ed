// pagedkv's CPU kernels: paged decode attention reading K/V blocks where they lie (no gather copy), and the
// fused per-token steps around it (residual add + RMSNorm, rotary embedding + KV-cache write, SiLU x up), each one
// pass over its rows where eager torch makes several. float32 activations; OpenMP over rows.
//
// Decode attention:
// One query token per row: out[token] = softmax(q . K^T * scale) V over the row's first `len` cached positions,
// whose blocks the row's block table names. Work items are rows or (row, KV head) pairs, run in parallel by OpenMP
// (linked against the libgomp torch has loaded, so both share one thread pool). Each item walks its blocks with an
// online softmax: per block, the scores of all its slots, one rescale of the running sum, then the weighted V
// rows. With AVX-512 and a float32 cache it walks them once per pair of query heads of a KV head (walk_heads),
// whose accumulators then stay in registers. Slots past `len` are never read, so stale or NaN values in unwritten
// slots cannot matter. Accumulation is float32 whatever the cache dtype. Every index is checked before use: a bad
// table or length makes the call return an error code, never read outside the cache. Rows that share leading
// blocks (a cached prefix) read them once, as a group (attend_group).
// Options, each off (and out of the loops' way) when unset: a sliding window (the row sees positions
// [len - window, len); blocks wholly before that are neither read nor even looked up in the table, since they may
// have been freed; slots of the first block before it are masked), logit softcapping (scores = cap * tanh(scores
// / cap), before the mask) and attention sinks (one logit per query head that joins the softmax denominator).
#include <algorithm>
#include <array>
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
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// cap * tanh(x / cap), vectorizable: tanh(y) = sign(y) (1 - e) / (1 + e) with e = e^(-2|y|) <= 1 (no overflow).
// Its absolute error is a few float ulps of 1, so the capped score's is about cap * 1e-7.
inline float softcap_of(float x, float cap) {
  const float y = x / cap;
  const float e = exp_nonpositive(-2.f * std::fabs(y));
  const float t = (1.f - e) / (1.f + e);
  return cap * (y < 0.f ? -t : t);
}

// The options of a call, applied to one block's scores s[0, n) of slots whose first is at position `at`: the
// softcap, then -inf for slots before `first` (the window's first position; 0 without a window).
inline void adjust_scores(float* s, int n, int at, int first, float softcap) {
  if (softcap != 0.f) {
#pragma omp simd
    for (int t = 0; t < n; ++t) s[t] = softcap_of(s[t], softcap);
  }
  for (int t = 0; t < first - at && t < n; ++t) s[t] = kNegInf;
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

// FP8 caches (float8_e4m3fn, float8_e5m2): each byte decoded by a 256-entry table built from the formats' bit
// layouts (sign, exponent, mantissa; subnormals at exponent 0). The per-tensor scales are folded in by the caller
// (into the softmax scale and the output), so these are the stored values as they are.
struct e4m3 { uint8_t bits; };
struct e5m2 { uint8_t bits; };
std::array<float, 256> fp8_table(int mantissa_bits, int bias, bool has_inf) {
  std::array<float, 256> table{};
  const int exp_max = (1 << (7 - mantissa_bits)) - 1, mant_max = (1 << mantissa_bits) - 1;
  for (int b = 0; b < 256; ++b) {
    const int exp = (b & 0x7f) >> mantissa_bits, mant = b & mant_max;
    float v;
    if (exp == 0)
      v = std::ldexp(float(mant), 1 - bias - mantissa_bits);
    else if (exp == exp_max && (has_inf || mant == mant_max))  // e5m2: inf / NaN; e4m3fn: NaN at S.1111.111 only
      v = (has_inf && mant == 0) ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    else
      v = std::ldexp(float(mant_max + 1 + mant), exp - bias - mantissa_bits);
    table[b] = (b & 0x80) ? -v : v;
  }
  return table;
}
const std::array<float, 256> kE4m3 = fp8_table(3, 7, false);
const std::array<float, 256> kE5m2 = fp8_table(2, 15, true);
template <> inline float load<e4m3>(const e4m3* p, int i) { return kE4m3[p[i].bits]; }
template <> inline float load<e5m2>(const e5m2* p, int i) { return kE5m2[p[i].bits]; }

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
  int window;              // sliding window, 0: none
  float softcap;           // 0: none
  const float* sinks;      // [heads], nullptr: none
};

// A row's first visible position: blocks before its block are never touched.
inline int first_visible(const Problem& p, int len) { return p.window > 0 ? std::max(0, len - p.window) : 0; }

// The online-softmax state of one row's query heads part-way through its blocks (see attend_group).
template <int D>
struct RowState {
  float acc[kMaxHeads][D], running_max[kMaxHeads], running_sum[kMaxHeads];
};

#if defined(__AVX512F__)
// NH query heads of one KV head over a row's blocks [start, end of row), a float32 cache: the heads' accumulators
// stay in registers across the blocks, and each key and value slot is loaded once for all NH heads. kc and vc
// point at the KV head's first element in block 0 (offset by table[b] * block_stride per block); qs holds the NH
// heads' scaled queries; acc_io, mx and sum carry the online-softmax state in and out.
template <int D, int NH>
void walk_heads(const float* qs, const float* kc, const float* vc, const int32_t* table, int start, int len, int bs,
                int64_t slot_stride, int64_t block_stride, float* acc_io, float* mx, float* sum, int first,
                float softcap) {
  constexpr int C = D / 16;
  __m512 acc[NH][C];
#pragma GCC unroll 16
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_loadu_ps(acc_io + h * D + 16 * c);
  float s[NH][kMaxBlock + 16];  // + 16: scores are stored 16 at a time
  const int nblocks = (len + bs - 1) / bs;
  for (int b = start; b < nblocks; ++b) {
    const int n = std::min(bs, len - b * bs);
    const int64_t base = table[b] * block_stride;
    if (b + 1 < nblocks) {
      const int64_t next = table[b + 1] * block_stride;
      for (int t = 0; t < bs; ++t)
        for (int e = 0; e < D; e += 16) {
          __builtin_prefetch(kc + next + t * slot_stride + e);
          __builtin_prefetch(vc + next + t * slot_stride + e);
        }
    }
    __m512 rescale[NH];
    for (int h = 0; h < NH; ++h) {
      float* sh = s[h];
      block_scores<D>(qs + h * D, kc + base, slot_stride, n, sh);
      if (softcap != 0.f || b * bs < first) adjust_scores(sh, n, b * bs, first, softcap);
      float block_max = mx[h];
#pragma omp simd reduction(max : block_max)
      for (int t = 0; t < n; ++t) block_max = std::max(block_max, sh[t]);
      const float r = exp_nonpositive(mx[h] - block_max);
      mx[h] = block_max;
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int t = 0; t < n; ++t) {
        sh[t] = exp_nonpositive(sh[t] - block_max);
        block_sum += sh[t];
      }
      sum[h] = sum[h] * r + block_sum;
      rescale[h] = _mm512_set1_ps(r);
    }
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_mul_ps(acc[h][c], rescale[h]);
    for (int t = 0; t < n; ++t) {
      const float* vt = vc + base + t * slot_stride;
      __m512 v[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vt + 16 * c);
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h) {
        const __m512 w = _mm512_set1_ps(s[h][t]);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
      }
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_io + h * D + 16 * c, acc[h][c]);
}
#endif

// One decode row over KV heads [kv_first, kv_last), with the next block prefetched while this one is computed: the
// blocks lie anywhere, so the hardware cannot guess them. The portable path walks the row's blocks once, reading
// each block's slots for those heads in memory order; the AVX-512 float32 path walks them per head pair.
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
  const int first = first_visible(p, len);
  start = std::max(start, first / bs);
  for (int b = start; b < nblocks; ++b)
    if (table[b] < 0 || table[b] >= p.num_blocks) return kBadBlock;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  const int heads = (kv_last - kv_first) * group;  // query heads of this item, in order
  const float* q = p.q + (token * p.heads + int64_t(kv_first) * group) * D;

  float qs[kMaxHeads][D], acc[kMaxHeads][D], running_max[kMaxHeads], running_sum[kMaxHeads];
  for (int h = 0; h < heads; ++h) {
    for (int d = 0; d < D; ++d) {
      qs[h][d] = q[h * D + d] * p.scale;
      acc[h][d] = from ? from->acc[h][d] : 0.f;
    }
    running_max[h] = from ? from->running_max[h] : kNegInf;
    running_sum[h] = from ? from->running_sum[h] : 0.f;
  }
  const int64_t slot_stride = int64_t(p.kv_heads) * D, block_stride = int64_t(bs) * slot_stride;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && D % 16 == 0) {
    // KV head by KV head, its query heads four at a time where four share one (two, or one past D 128, where
    // more heads' accumulators would not fit the registers), each walking all the row's blocks. Every walk reads
    // the blocks from memory again (a row's K/V outgrows the cache), so fewer walks is less traffic: four heads a
    // walk were 27 % faster than two on 48 rows of 700 tokens with mid's heads, though their 32 accumulators
    // spill.
    for (int h = 0; h < heads;) {
      const int64_t kv = int64_t(kv_first + h / group) * D;
      const int left = group - h % group;  // heads of this KV head from h on
      const int take = D > 128 ? 1 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      const auto walk = [&](auto nh) {
        walk_heads<D, decltype(nh)::value>(qs[h], kc + kv, vc + kv, table, start, len, bs, slot_stride,
                                           block_stride, acc[h], running_max + h, running_sum + h, first, p.softcap);
      };
      if (take == 4)
        walk(std::integral_constant<int, 4>{});
      else if (take == 2)
        walk(std::integral_constant<int, 2>{});
      else
        walk(std::integral_constant<int, 1>{});
      h += take;
    }
  } else
#endif
  {
    float s[kMaxHeads][kMaxBlock];  // the scores of one block's slots, per query head
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
      if (p.softcap != 0.f || b * bs < first)
        for (int h = 0; h < heads; ++h) adjust_scores(s[h], n, b * bs, first, p.softcap);
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
  }
  float* out = p.out + (token * p.heads + int64_t(kv_first) * group) * D;
  if (p.sinks != nullptr) {  // the sink joins the denominator: the sum and the accumulator, rescaled to a new max
    const float* sink = p.sinks + int64_t(kv_first) * group;
    for (int h = 0; h < heads; ++h) {
      const float m = std::max(running_max[h], sink[h]);
      const float r = std::exp(running_max[h] - m);
      running_sum[h] = running_sum[h] * r + std::exp(sink[h] - m);
      for (int d = 0; d < D; ++d) acc[h][d] *= r;
    }
  }
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

// A group's shared blocks, per KV head, take its lane sets (query heads, see attend_group) two at a time (one,
// when the count is odd): each key or value element is broadcast once for both sets of a pair, and each score or
// weight vector is loaded once for a run of slots or dims held in registers, so the loops are bound by FMAs rather
// than by loads. Layouts: queries and accumulators [dim][lane], scores [slot][lane], one array of each per set.
#if defined(__AVX512F__)
// s[h][t] = q[h] . k[t] for slots t in [0, J), per lane: J * NH accumulators, one key element broadcast per FMA pair.
template <int D, int NH, int J>
inline void group_scores(const float* const* qh, const float* k, int64_t stride, float* const* sh) {
  __m512 a[NH][J];
#pragma GCC unroll 16
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) a[h][j] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 qv[NH];
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h) qv[h] = _mm512_loadu_ps(qh[h] + d * kGroupRows);
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) {
      const __m512 kb = _mm512_set1_ps(k[j * stride + d]);
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h) a[h][j] = _mm512_fmadd_ps(qv[h], kb, a[h][j]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(sh[h] + j * kGroupRows, a[h][j]);
}

// acc[h][d] = acc[h][d] * rescale[h] + sum over slots t < n of s[h][t] * v[t][d], eight dims at a time in registers.
template <int D, int NH>
inline void group_values(const float* const* sh, const float* v, int64_t stride, int n, const float* const* rescale,
                         float* const* ah) {
  __m512 r[NH];
#pragma GCC unroll 16
  for (int h = 0; h < NH; ++h) r[h] = _mm512_loadu_ps(rescale[h]);
  for (int d0 = 0; d0 < D; d0 += 8) {
    __m512 a[NH][8];
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
      for (int j = 0; j < 8; ++j) a[h][j] = _mm512_mul_ps(_mm512_loadu_ps(ah[h] + (d0 + j) * kGroupRows), r[h]);
    for (int t = 0; t < n; ++t) {
      __m512 w[NH];
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h) w[h] = _mm512_loadu_ps(sh[h] + t * kGroupRows);
      const float* vt = v + t * stride + d0;
#pragma GCC unroll 16
      for (int j = 0; j < 8; ++j) {
        const __m512 vb = _mm512_set1_ps(vt[j]);
#pragma GCC unroll 16
        for (int h = 0; h < NH; ++h) a[h][j] = _mm512_fmadd_ps(w[h], vb, a[h][j]);
      }
    }
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
      for (int j = 0; j < 8; ++j) _mm512_storeu_ps(ah[h] + (d0 + j) * kGroupRows, a[h][j]);
  }
}
#else
template <int D, int NH, int J>
inline void group_scores(const float* const* qh, const float* k, int64_t stride, float* const* sh) {
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < J; ++j) {
      float a[kGroupRows] = {};
      for (int d = 0; d < D; ++d) {
        const float kd = k[j * stride + d];
#pragma omp simd
        for (int r = 0; r < kGroupRows; ++r) a[r] += qh[h][d * kGroupRows + r] * kd;
      }
      for (int r = 0; r < kGroupRows; ++r) sh[h][j * kGroupRows + r] = a[r];
    }
}

template <int D, int NH>
inline void group_values(const float* const* sh, const float* v, int64_t stride, int n, const float* const* rescale,
                         float* const* ah) {
  for (int h = 0; h < NH; ++h)
    for (int d = 0; d < D; ++d) {
      float a[kGroupRows];
#pragma omp simd
      for (int r = 0; r < kGroupRows; ++r) a[r] = ah[h][d * kGroupRows + r] * rescale[h][r];
      for (int t = 0; t < n; ++t) {
        const float vd = v[t * stride + d];
#pragma omp simd
        for (int r = 0; r < kGroupRows; ++r) a[r] += sh[h][t * kGroupRows + r] * vd;
      }
      for (int r = 0; r < kGroupRows; ++r) ah[h][d * kGroupRows + r] = a[r];
    }
}
#endif

// No mask: every slot of the block is visible to every lane (a decode group's shared, full blocks).
struct NoMask {
  void operator()(float*, int) const {}
};

// Slots [0, n) of one block for NH lane sets of one KV head: scores, the softcap, `mask` (which sets a set's
// scores [slot][lane] of slots a lane must not see to -inf), the online-softmax update, the weighted values.
// q, acc, m (running max), l (running sum) and s (scores) point at each set's own arrays. A lane whose scores are
// all masked keeps its state only if its running max is finite (callers that mask start it at lowest(), not -inf:
// -inf - -inf would be NaN).
template <int D, int NH, typename Mask = NoMask>
inline void group_block(const float* const* q, const float* k, const float* v, int64_t stride, int n,
                        float* const* acc, float* const* m, float* const* l, float* const* s, float softcap,
                        const Mask& mask = Mask{}) {
  constexpr int kRun = 8;  // slots whose scores one pass keeps in registers
  int t = 0;
  for (; t + kRun <= n; t += kRun) {
    float* st[NH];
    for (int h = 0; h < NH; ++h) st[h] = s[h] + t * kGroupRows;
    group_scores<D, NH, kRun>(q, k + t * stride, stride, st);
  }
  for (; t < n; ++t) {
    float* st[NH];
    for (int h = 0; h < NH; ++h) st[h] = s[h] + t * kGroupRows;
    group_scores<D, NH, 1>(q, k + t * stride, stride, st);
  }
  for (int h = 0; h < NH; ++h) {
    if (softcap != 0.f) adjust_scores(s[h], n * kGroupRows, 0, 0, softcap);
    mask(s[h], n);
  }
  float rescale[NH][kGroupRows];
  const float* rescale_of[NH];
  for (int h = 0; h < NH; ++h) {
    float block_max[kGroupRows];
#pragma omp simd
    for (int r = 0; r < kGroupRows; ++r) block_max[r] = m[h][r];
    for (int u = 0; u < n; ++u) {
#pragma omp simd
      for (int r = 0; r < kGroupRows; ++r) block_max[r] = std::max(block_max[r], s[h][u * kGroupRows + r]);
    }
    float block_sum[kGroupRows] = {};
    for (int u = 0; u < n; ++u) {
      float* su = s[h] + u * kGroupRows;
#pragma omp simd
      for (int r = 0; r < kGroupRows; ++r) {
        su[r] = exp_nonpositive(su[r] - block_max[r]);
        block_sum[r] += su[r];
      }
    }
#pragma omp simd
    for (int r = 0; r < kGroupRows; ++r) {
      rescale[h][r] = exp_nonpositive(m[h][r] - block_max[r]);
      m[h][r] = block_max[r];
      l[h][r] = l[h][r] * rescale[h][r] + block_sum[r];
    }
    rescale_of[h] = rescale[h];
  }
  group_values<D, NH>(s, v, stride, n, rescale_of, acc);
}

template <int D>
int attend_group(const Problem& p, const Group& g) {
  const int heads = p.heads, group = p.heads / p.kv_heads, bs = p.block_size, rows = g.count;
  const int32_t* table = p.tables + p.seqs[g.first] * p.width;
  for (int b = 0; b < g.shared; ++b)
    if (table[b] < 0 || table[b] >= p.num_blocks) return kBadBlock;
  const float* kc = static_cast<const float*>(p.key_cache);
  const float* vc = static_cast<const float*>(p.value_cache);
  const int64_t slot_stride = int64_t(p.kv_heads) * D, block_stride = int64_t(bs) * slot_stride;
  // A lane set holds `packed` query heads of one KV head side by side, `width` lanes each (one per row): a group
  // of at most 8 rows fills the 16 lanes with two heads, not half of them with one, and so takes half the work.
  int packed = 1;
  while (packed * 2 <= group && group % (packed * 2) == 0 && rows <= kGroupRows / (packed * 2)) packed *= 2;
  const int width = kGroupRows / packed, sets = heads / packed, sets_per_kv = group / packed;
  // Per lane set: queries and accumulators [dim][lane], running max and sum [lane], scores [slot][lane]. Lanes
  // past the group's rows hold zero queries: their scores are computed and never used.
  const size_t per_set = size_t(D) * kGroupRows;
  std::vector<float> qt(sets * per_set, 0.f), acc(sets * per_set, 0.f);
  std::vector<float> mx(size_t(sets) * kGroupRows, kNegInf);
  std::vector<float> sum(size_t(sets) * kGroupRows, 0.f), s(size_t(sets) * bs * kGroupRows);
  const auto lane_of = [&](int h, int r) { return size_t(h / packed) * per_set + (h % packed) * width + r; };
  for (int r = 0; r < rows; ++r) {
    const float* q = p.q + p.tokens[g.first + r] * heads * D;
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < D; ++d) qt[lane_of(h, r) + size_t(d) * kGroupRows] = q[h * D + d] * p.scale;
  }
  for (int b = 0; b < g.shared; ++b) {
    const int64_t base = table[b] * block_stride;
    for (int i = 0; i < sets;) {
      const int64_t kv = base + (i / sets_per_kv) * D;
      const int pair = (i % sets_per_kv + 1 < sets_per_kv) ? 2 : 1;  // two sets of the same KV head, or the last
      const float* q[2];
      float *a[2], *m[2], *l[2], *sc[2];
      for (int j = 0; j < pair; ++j) {
        q[j] = &qt[(i + j) * per_set];
        a[j] = &acc[(i + j) * per_set];
        m[j] = &mx[size_t(i + j) * kGroupRows];
        l[j] = &sum[size_t(i + j) * kGroupRows];
        sc[j] = &s[size_t(i + j) * bs * kGroupRows];
      }
      if (pair == 2)
        group_block<D, 2>(q, kc + kv, vc + kv, slot_stride, bs, a, m, l, sc, p.softcap);
      else
        group_block<D, 1>(q, kc + kv, vc + kv, slot_stride, bs, a, m, l, sc, p.softcap);
      i += pair;
    }
  }
  RowState<D> state;
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      const size_t lane = lane_of(h, r);
      for (int d = 0; d < D; ++d) state.acc[h][d] = acc[lane + size_t(d) * kGroupRows];
      const size_t at = size_t(h / packed) * kGroupRows + (h % packed) * width + r;
      state.running_max[h] = mx[at];
      state.running_sum[h] = sum[at];
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
    if (per_item == p.kv_heads && p.window == 0) {  // a window reads no shared prefix past it: no groups
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

// Prefill attention: chunks of several query tokens (a prompt, or its next part over a cached prefix), each query
// at position len - q_len + i seeing cached positions [0 or its window's first, itself]. Work items are (chunk,
// tile of query tokens, KV head): a tile's query heads of that KV head are lane sets as in attend_group, one lane
// per (packed head, query token), so each K/V block is read once for the tile's tokens and heads and every score is
// a broadcast FMA. Blocks are walked from the tile's first visible one to the one holding its last query; slots
// past that query are never read (nor, so, a partial last block's unwritten slots), and only the blocks that cross
// the causal diagonal or the window's edge are masked. Caches of other dtypes are upcast a block at a time.
struct Prefill {
  const float* q;         // [tokens, heads, D]
  const void* key_cache;  // [blocks, block_size, kv_heads, D]
  const void* value_cache;
  const int32_t* tables;  // [seqs, width]
  const int32_t* lens;    // [seqs]: cached positions, the chunk's own included
  const int64_t* seqs;    // [chunks]: the chunk's sequence (table row, length)
  const int64_t* begins;  // [chunks]: its first query token
  const int64_t* q_lens;  // [chunks]: its query tokens
  float* out;             // [tokens, heads, D]
  int64_t chunks, num_tokens, num_seqs, width, num_blocks;
  int block_size, heads, kv_heads;
  float scale;
  int threads;
  int window;
  float softcap;
  const float* sinks;
};

// Query heads of a KV head packed side by side in one lane set: short chunks (speculative verification, the last
// few tokens of a prompt) fill the 16 lanes with several heads rather than leave most of them idle.
int prefill_packing(int group, int64_t q_len) {
  int packed = 1;
  while (packed * 2 <= group && group % (packed * 2) == 0 && q_len <= kGroupRows / (packed * 2)) packed *= 2;
  return packed;
}

struct PrefillTile {
  int64_t chunk;
  int first;  // its first query token, counted in the chunk
};

// A chunk's sequence, tokens, length and every table entry its queries see, checked before any work is done, so a
// refused call writes nothing.
int check_chunk(const Prefill& p, int64_t c) {
  const int64_t seq = p.seqs[c], begin = p.begins[c], q_len = p.q_lens[c];
  if (seq < 0 || seq >= p.num_seqs) return kBadToken;
  if (begin < 0 || q_len < 1 || begin > p.num_tokens - q_len) return kBadToken;
  const int64_t len = p.lens[seq];
  if (len < q_len || len > p.width * p.block_size) return kBadLength;
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, len - q_len - p.window + 1) : 0;
  const int32_t* table = p.tables + seq * p.width;
  for (int64_t b = first / p.block_size; b <= (len - 1) / p.block_size; ++b)
    if (table[b] < 0 || table[b] >= p.num_blocks) return kBadBlock;
  return kOk;
}

// One tile of a checked chunk (check_chunk).
template <typename T, int D>
void prefill_tile(const Prefill& p, const PrefillTile& tile, int kv) {
  const int64_t c = tile.chunk, seq = p.seqs[c], begin = p.begins[c], q_len = p.q_lens[c], len = p.lens[seq];
  const int bs = p.block_size, group = p.heads / p.kv_heads;
  const int packed = prefill_packing(group, q_len), width = kGroupRows / packed, sets = group / packed;
  const int count = int(std::min<int64_t>(width, q_len - tile.first));  // the tile's query tokens
  const int pos0 = int(len - q_len) + tile.first, last = pos0 + count - 1;
  const int first = p.window > 0 ? std::max(0, pos0 - p.window + 1) : 0;
  const int32_t* table = p.tables + seq * p.width;
  const int b0 = first / bs, b1 = last / bs + 1;

  // Per lane set: queries and accumulators [dim][lane], running max and sum [lane], scores [slot][lane]. Lanes
  // past the tile's tokens repeat its last token's position (so their masks are sane) with zero queries; they are
  // computed and never written.
  const size_t per_set = size_t(D) * kGroupRows;
  std::vector<float> qt(sets * per_set, 0.f), acc(sets * per_set, 0.f);
  std::vector<float> mx(size_t(sets) * kGroupRows, std::numeric_limits<float>::lowest());
  std::vector<float> sum(size_t(sets) * kGroupRows, 0.f), s(size_t(sets) * bs * kGroupRows);
  int lane_pos[kGroupRows];
  for (int lane = 0; lane < kGroupRows; ++lane) lane_pos[lane] = pos0 + std::min(lane % width, count - 1);
  for (int r = 0; r < count; ++r) {
    const float* q = p.q + ((begin + tile.first + r) * p.heads + int64_t(kv) * group) * D;
    for (int h = 0; h < group; ++h)
      for (int d = 0; d < D; ++d)
        qt[size_t(h / packed) * per_set + size_t(d) * kGroupRows + (h % packed) * width + r] = q[h * D + d] * p.scale;
  }
  const int64_t slot_stride = int64_t(p.kv_heads) * D, block_stride = int64_t(bs) * slot_stride;
  std::vector<float> upcast(std::is_same_v<T, float> ? 0 : size_t(2) * bs * D);
  for (int b = b0; b < b1; ++b) {
    const int at = b * bs, n = std::min(bs, last + 1 - at);
    const float *k, *v;
    int64_t stride;
    const T* kb = static_cast<const T*>(p.key_cache) + table[b] * block_stride + int64_t(kv) * D;
    const T* vb = static_cast<const T*>(p.value_cache) + table[b] * block_stride + int64_t(kv) * D;
    if constexpr (std::is_same_v<T, float>) {
      k = kb, v = vb, stride = slot_stride;
    } else {
      float* ku = upcast.data();
      float* vu = ku + size_t(bs) * D;
      for (int t = 0; t < n; ++t)
        for (int d = 0; d < D; ++d) {
          ku[t * D + d] = load(kb + t * slot_stride, d);
          vu[t * D + d] = load(vb + t * slot_stride, d);
        }
      k = ku, v = vu, stride = D;
    }
    const bool causal_edge = at + n - 1 > pos0, window_edge = p.window > 0 && at < last - p.window + 1;
    const auto mask = [&](float* sc, int slots) {
      if (!causal_edge && !window_edge) return;
      for (int u = 0; u < slots; ++u)
        for (int lane = 0; lane < kGroupRows; ++lane) {
          const int ahead = lane_pos[lane] - (at + u);  // how far the key is behind the query
          if (ahead < 0 || (p.window > 0 && ahead >= p.window)) sc[u * kGroupRows + lane] = kNegInf;
        }
    };
    for (int i = 0; i < sets;) {
      const int pair = i + 1 < sets ? 2 : 1;
      const float* qs[2];
      float *a[2], *m[2], *l[2], *sc[2];
      for (int j = 0; j < pair; ++j) {
        qs[j] = &qt[(i + j) * per_set];
        a[j] = &acc[(i + j) * per_set];
        m[j] = &mx[size_t(i + j) * kGroupRows];
        l[j] = &sum[size_t(i + j) * kGroupRows];
        sc[j] = &s[size_t(i + j) * bs * kGroupRows];
      }
      if (pair == 2)
        group_block<D, 2>(qs, k, v, stride, n, a, m, l, sc, p.softcap, mask);
      else
        group_block<D, 1>(qs, k, v, stride, n, a, m, l, sc, p.softcap, mask);
      i += pair;
    }
  }
  for (int h = 0; h < group; ++h) {
    const int head = kv * group + h;
    for (int r = 0; r < count; ++r) {
      const size_t lane = size_t(h / packed) * kGroupRows + (h % packed) * width + r;
      float l = sum[lane], rescale = 1.f;
      if (p.sinks != nullptr) {  // the sink joins the denominator, the sum and accumulator rescaled to a new max
        const float m = std::max(mx[lane], p.sinks[head]);
        rescale = std::exp(mx[lane] - m);
        l = l * rescale + std::exp(p.sinks[head] - m);
      }
      const float inv = rescale / l;
      const float* a = &acc[size_t(h / packed) * per_set + (h % packed) * width + r];
      float* out = p.out + ((begin + tile.first + r) * p.heads + head) * D;
      for (int d = 0; d < D; ++d) out[d] = a[size_t(d) * kGroupRows] * inv;
    }
  }
}

// Every chunk checked, then its tiles, those with the most blocks to read first, so that the last ones left for
// the threads are short.
template <typename T, int D>
int prefill_all(const Prefill& p) {
  std::vector<PrefillTile> tiles;
  std::vector<int64_t> work;
  const int group = p.heads / p.kv_heads;
  for (int64_t c = 0; c < p.chunks; ++c) {
    const int rc = check_chunk(p, c);
    if (rc != kOk) return rc;
    const int64_t q_len = p.q_lens[c], seq = p.seqs[c];
    const int width = kGroupRows / prefill_packing(group, q_len);
    for (int64_t f = 0; f < q_len; f += width) {
      tiles.push_back(PrefillTile{c, int(f)});
      work.push_back(int64_t(p.lens[seq]) - q_len + std::min<int64_t>(f + width, q_len));
    }
  }
  std::vector<int64_t> order(tiles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  const int64_t items = int64_t(tiles.size()) * p.kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (int64_t item = 0; item < items; ++item)
    prefill_tile<T, D>(p, tiles[order[item / p.kv_heads]], int(item % p.kv_heads));
  return kOk;
}

template <typename T>
int prefill_by_head_dim(const Prefill& p, int head_dim) {
  switch (head_dim) {
    case 32: return prefill_all<T, 32>(p);
    case 64: return prefill_all<T, 64>(p);
    case 80: return prefill_all<T, 80>(p);
    case 96: return prefill_all<T, 96>(p);
    case 128: return prefill_all<T, 128>(p);
    case 256: return prefill_all<T, 256>(p);
    default: return kBadShape;
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16, 3 float8_e4m3fn, 4 float8_e5m2 (of the caches; q and out are float32). window 0 and softcap 0: off;
// sinks [heads] float32 or null.
int pagedkv_decode_attention(const float* q, const void* key_cache, const void* value_cache, int dtype,
                             const int32_t* tables, const int32_t* lens, const int64_t* tokens, const int64_t* seqs,
                             float* out, int64_t rows, int64_t num_tokens, int64_t num_seqs, int64_t width,
                             int64_t num_blocks, int block_size, int heads, int kv_heads, int head_dim, float scale,
                             int threads, int window, float softcap, const float* sinks) {
  if (block_size < 1 || block_size > kMaxBlock || kv_heads < 1 || heads % kv_heads != 0 ||
      heads / kv_heads > kMaxGroup || width < 1 || rows < 0 || threads < 1 || window < 0 || !(softcap >= 0.f) ||
      std::isinf(softcap))
    return kBadShape;
  const Problem p{q,        key_cache,  value_cache, tables, lens,     tokens, seqs,    out,    rows,    num_tokens,
                  num_seqs, width,      num_blocks,  block_size, heads, kv_heads, scale, threads, window, softcap,
                  sinks};
  switch (dtype) {
    case 0: return by_head_dim<float>(p, head_dim);
    case 1: return by_head_dim<bf16>(p, head_dim);
    case 2: return by_head_dim<_Float16>(p, head_dim);
    case 3: return by_head_dim<e4m3>(p, head_dim);
    case 4: return by_head_dim<e5m2>(p, head_dim);
    default: return kBadShape;
  }
}

// Prefill attention (see Prefill): chunk i's q_lens[i] query tokens from begins[i] over sequence seqs[i]'s first
// lens[seqs[i]] cached positions, causal. Arguments as pagedkv_decode_attention's.
int pagedkv_prefill_attention(const float* q, const void* key_cache, const void* value_cache, int dtype,
                              const int32_t* tables, const int32_t* lens, const int64_t* seqs, const int64_t* begins,
                              const int64_t* q_lens, float* out, int64_t chunks, int64_t num_tokens,
                              int64_t num_seqs, int64_t width, int64_t num_blocks, int block_size, int heads,
                              int kv_heads, int head_dim, float scale, int threads, int window, float softcap,
                              const float* sinks) {
  if (block_size < 1 || block_size > kMaxBlock || kv_heads < 1 || heads % kv_heads != 0 ||
      heads / kv_heads > kMaxGroup || width < 1 || chunks < 0 || threads < 1 || window < 0 || !(softcap >= 0.f) ||
      std::isinf(softcap))
    return kBadShape;
  const Prefill p{q,          key_cache,  value_cache, tables, lens,  seqs,     begins, q_lens,  out,
                  chunks,     num_tokens, num_seqs,    width,  num_blocks, block_size, heads, kv_heads, scale,
                  threads,    window,     softcap,     sinks};
  switch (dtype) {
    case 0: return prefill_by_head_dim<float>(p, head_dim);
    case 1: return prefill_by_head_dim<bf16>(p, head_dim);
    case 2: return prefill_by_head_dim<_Float16>(p, head_dim);
    case 3: return prefill_by_head_dim<e4m3>(p, head_dim);
    case 4: return prefill_by_head_dim<e5m2>(p, head_dim);
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
int pagedkv_native_abi() { return 7; }
}
