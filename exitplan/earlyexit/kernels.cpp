// Decode-step kernels of the engine's serving form, bfloat16 (see native.py): what vLLM's CPU backend runs as
// hand-written C++ (rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, reshape_and_cache and paged
// attention), written here from the maths of the transformers Qwen2/Llama layer, not from vLLM's code.
//
// Each kernel rounds to bfloat16 where torch's bfloat16 ops of that layer round (a product of two bfloat16 tensors
// is rounded once, a float32 softmax is rounded when cast back), so its results equal the torch path's up to the
// order of float32 sums and the last bit of exp. Sixteen floats at a time through GCC's vector extensions (AVX-512
// where the compiler is told -march=native on such a CPU, narrower vectors elsewhere).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

constexpr int W = 16;

inline float bf2f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet (c10::BFloat16's rounding).
inline uint16_t f2bf(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float round_bf(float f) { return bf2f(f2bf(f)); }

inline v16f load(const uint16_t* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  return (v16f)u;
}

inline void store(uint16_t* p, v16f f) {
  v16u u = (v16u)f;
  v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  v16i nan = f != f;
  rounded = nan ? v16u{} + 0x7fc0u : rounded;
  v16h h = __builtin_convertvector(rounded, v16h);
  std::memcpy(p, &h, sizeof h);
}

inline v16f round_bf(v16f f) {
  alignas(64) uint16_t tmp[W];
  store(tmp, f);
  return load(tmp);
}

inline float sum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

inline v16f splat(float f) { return v16f{} + f; }

// exp of 16 floats: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p degree 6 (relative error below 2e-7);
// below -87.3 it is 0 (far-below-max scores), above 88 it is exp(88).
inline v16f exp16(v16f x) {
  const v16f lo = splat(-87.3f), hi = splat(88.f);
  v16i under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v16f t = x * 1.44269504088896341f;
  v16i n = __builtin_convertvector(t + (t >= 0 ? splat(0.5f) : splat(-0.5f)), v16i);
  v16f nf = __builtin_convertvector(n, v16f);
  v16f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16f p = splat(1.f / 720);
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  v16f scale = (v16f)((n + 127) << 23);
  v16f out = p * scale;
  return under ? v16f{} : out;
}

inline float exp1(float x) { return exp16(splat(x))[0]; }

const uint16_t* bf(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bf_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have unit stride in its last dimension");
}

// One row: y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), the transformers RMS norm in bfloat16.
void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t d, float eps) {
  v16f acc{};
  int64_t i = 0;
  for (; i + W <= d; i += W) {
    v16f v = load(x + i);
    acc += v * v;
  }
  float ss = sum(acc);
  for (; i < d; ++i) ss += bf2f(x[i]) * bf2f(x[i]);
  float r = 1.f / std::sqrt(ss / float(d) + eps);
  i = 0;
  for (; i + W <= d; i += W) store(y + i, load(w + i) * round_bf(load(x + i) * r));
  for (; i < d; ++i) y[i] = f2bf(bf2f(w[i]) * round_bf(bf2f(x[i]) * r));
}

}  // namespace

// RMS norm of each row of x (N x d).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, "x");
  check(weight, "weight");
  x = x.contiguous();
  auto out = torch::empty_like(x);
  int64_t d = x.size(-1), n = x.numel() / d;
  for (int64_t r = 0; r < n; ++r) norm_row(bf(x) + r * d, bf(weight), bf_mut(out) + r * d, d, float(eps));
  return out;
}

// x + residual (rounded to bfloat16) and the RMS norm of that sum: the layer's `x = residual + h` followed by its
// post-attention norm, one pass over the rows. Returns (sum, norm).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check(x, "x");
  check(residual, "residual");
  check(weight, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have one shape");
  x = x.contiguous();
  residual = residual.contiguous();
  auto total = torch::empty_like(x), out = torch::empty_like(x);
  int64_t d = x.size(-1), n = x.numel() / d;
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* a = bf(x) + r * d;
    const uint16_t* b = bf(residual) + r * d;
    uint16_t* s = bf_mut(total) + r * d;
    int64_t i = 0;
    for (; i + W <= d; i += W) store(s + i, load(b + i) + load(a + i));
    for (; i < d; ++i) s[i] = f2bf(bf2f(b[i]) + bf2f(a[i]));
    norm_row(s, bf(weight), bf_mut(out) + r * d, d, float(eps));
  }
  return {total, out};
}

// silu(gate) * up of a gate_up row (N x 2I) -> N x I, each product rounded as torch's bfloat16 ops round.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check(gate_up, "gate_up");
  gate_up = gate_up.contiguous();
  int64_t two = gate_up.size(-1), half = two / 2, n = gate_up.numel() / two;
  TORCH_CHECK(two % 2 == 0, "gate_up's width must be even");
  auto out = torch::empty({n, half}, gate_up.options());
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* g = bf(gate_up) + r * two;
    const uint16_t* u = g + half;
    uint16_t* y = bf_mut(out) + r * half;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      v16f x = load(g + i);
      store(y + i, round_bf(x / (1.f + exp16(-x))) * load(u + i));
    }
    for (; i < half; ++i) {
      float x = bf2f(g[i]);
      y[i] = f2bf(round_bf(x / (1.f + exp1(-x))) * bf2f(u[i]));
    }
  }
  return out;
}

namespace {

// One head of one token, in place: x * cos + rotate_half(x) * sin, each product and the sum rounded.
void rotate(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t hd) {
  int64_t h = hd / 2;
  alignas(64) uint16_t out[512];
  int64_t i = 0;
  for (; i + W <= h; i += W) {
    v16f a = load(x + i), b = load(x + h + i);
    store(out + i, round_bf(a * load(cos + i)) + round_bf(-b * load(sin + i)));
    store(out + h + i, round_bf(b * load(cos + h + i)) + round_bf(a * load(sin + h + i)));
  }
  for (; i < h; ++i) {
    float a = bf2f(x[i]), b = bf2f(x[h + i]);
    out[i] = f2bf(round_bf(a * bf2f(cos[i])) + round_bf(-b * bf2f(sin[i])));
    out[h + i] = f2bf(round_bf(b * bf2f(cos[h + i])) + round_bf(a * bf2f(sin[h + i])));
  }
  std::memcpy(x, out, hd * sizeof(uint16_t));
}

}  // namespace

// Rotary embedding of the queries and keys in a qkv projection (N x (H + 2 KV) hd), queries rotated in place, and
// each token's rotated key and value stored in a head-major pool layer (KV x slots x hd) at its slot.
void rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                    torch::Tensor values, torch::Tensor slots, int64_t heads) {
  check(qkv, "qkv");
  check(cos, "cos");
  check(sin, "sin");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16, "the pool layer must be contiguous bfloat16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be contiguous int64");
  int64_t n = qkv.size(0), kv = keys.size(0), capacity = keys.size(1), hd = keys.size(2);
  TORCH_CHECK(hd <= 512 && hd % 2 == 0, "head_dim must be even and at most 512");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv) * hd && cos.size(-1) == hd && slots.numel() == n,
              "qkv, cos/sin and slots disagree with the pool's shape");
  cos = cos.reshape({n, hd}).contiguous();
  sin = sin.reshape({n, hd}).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  int64_t row = qkv.stride(0);
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot out of the pool");
  for (int64_t t = 0; t < n; ++t) {  // every slot checked first: nothing is half-written
    uint16_t* x = bf_mut(qkv) + t * row;
    const uint16_t* c = bf(cos) + t * hd;
    const uint16_t* s = bf(sin) + t * hd;
    for (int64_t h = 0; h < heads + kv; ++h) rotate(x + h * hd, c, s, hd);
    for (int64_t g = 0; g < kv; ++g) {
      std::memcpy(bf_mut(keys) + (g * capacity + slot[t]) * hd, x + (heads + g) * hd, hd * sizeof(uint16_t));
      std::memcpy(bf_mut(values) + (g * capacity + slot[t]) * hd, x + (heads + kv + g) * hd, hd * sizeof(uint16_t));
    }
  }
}

namespace {

const v16i LO8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
const v16i HI8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
const v16i LO4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
const v16i HI4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
const v16i LO2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
const v16i HI2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
const v16i LO1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
const v16i HI1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
constexpr int BITREV[W] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// Lane i of the result is the sum of the lanes of v[BITREV[i]]: sixteen horizontal sums in 15 shuffle-adds.
inline v16f reduce16(v16f* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], LO8) + __builtin_shuffle(v[2 * i], v[2 * i + 1], HI8);
  for (int i = 0; i < 4; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], LO4) + __builtin_shuffle(v[2 * i], v[2 * i + 1], HI4);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], LO2) + __builtin_shuffle(v[2 * i], v[2 * i + 1], HI2);
  return __builtin_shuffle(v[0], v[1], LO1) + __builtin_shuffle(v[0], v[1], HI1);
}

// Softmax of p[0..len) in place, the probabilities rounded to bfloat16 (the torch path casts them back).
void softmax_bf(float* p, int64_t len) {
  const int64_t full = len / W * W;
  float m = p[0];
  v16f mv = splat(p[0]);
  for (int64_t j = 0; j < full; j += W) {
    v16f e;
    std::memcpy(&e, p + j, sizeof e);
    mv = e > mv ? e : mv;
  }
  for (int i = 0; i < W; ++i) m = std::max(m, mv[i]);
  for (int64_t j = full; j < len; ++j) m = std::max(m, p[j]);
  v16f total{};
  for (int64_t j = 0; j < full; j += W) {
    v16f e;
    std::memcpy(&e, p + j, sizeof e);
    e = exp16(e - m);
    total += e;
    std::memcpy(p + j, &e, sizeof e);
  }
  float t = sum(total);
  for (int64_t j = full; j < len; ++j) t += (p[j] = exp1(p[j] - m));
  for (int64_t j = 0; j < full; j += W) {
    v16f e;
    std::memcpy(&e, p + j, sizeof e);
    e = round_bf(e / t);
    std::memcpy(p + j, &e, sizeof e);
  }
  for (int64_t j = full; j < len; ++j) p[j] = round_bf(p[j] / t);
}

}  // namespace

namespace {

// One sequence's attention for the query heads of KV head g: C = head_dim / 16 (a compile-time constant, so a
// head's accumulators stay in registers). kf/vf: scratch for the context's keys and values as floats.
template <int C>
void attend_group(const uint16_t* qs, const uint16_t* kb, const uint16_t* vb, const int64_t* slot, int64_t len,
                  int64_t group, float scale, float* scores, v16f* kf, v16f* vf, uint16_t* out) {
  const int64_t hd = C * W, padded = (len + W - 1) / W * W;
  for (int64_t j = 0; j < len; ++j)
    for (int c = 0; c < C; ++c) {
      kf[j * C + c] = load(kb + slot[j] * hd + c * W);
      vf[j * C + c] = load(vb + slot[j] * hd + c * W);
    }
  v16f dots[W];
  for (int64_t h = 0; h < group; ++h) {
    v16f q[C];
    for (int c = 0; c < C; ++c) q[c] = load(qs + h * hd + c * W);
    float* p = scores + h * padded;
    for (int64_t j0 = 0; j0 < len; j0 += W) {  // sixteen positions' scores at a time
      const int64_t n = std::min<int64_t>(W, len - j0);
      for (int i = 0; i < W; ++i) {
        const int64_t at = BITREV[i];
        v16f dot{};
        if (at < n)
          for (int c = 0; c < C; ++c) dot += q[c] * kf[(j0 + at) * C + c];
        dots[i] = dot;
      }
      v16f r = round_bf(reduce16(dots)) * scale;
      std::memcpy(p + j0, &r, sizeof r);
    }
    softmax_bf(p, len);
    v16f acc[C] = {};
    for (int64_t j = 0; j < len; ++j) {
      const float w = p[j];
      for (int c = 0; c < C; ++c) acc[c] += w * vf[j * C + c];
    }
    for (int c = 0; c < C; ++c) store(out + h * hd + c * W, acc[c]);
  }
}

}  // namespace

// Attention of one new token per sequence over its cached context, read in place from a head-major pool layer
// (KV x slots x hd): queries are the first H heads of qkv's rows (B x ...), table B x C the context's slots (only
// the first lengths[b] of row b are read). Scores are rounded to bfloat16 before the float32 scale and softmax, the
// probabilities after it, as the torch path's bfloat16 matmuls do. Each key and value row is read once for the
// query heads that share it (grouped-query attention); scores are summed sixteen positions at a time (reduce16).
// Returns B x H hd.
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, torch::Tensor table,
                               torch::Tensor lengths, int64_t heads, double scale) {
  check(qkv, "qkv");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16, "the pool layer must be contiguous bfloat16");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous(), "table must be contiguous int64");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous(), "lengths must be contiguous int64");
  int64_t b = qkv.size(0), kv = keys.size(0), capacity = keys.size(1), hd = keys.size(2), width = table.size(1);
  TORCH_CHECK(hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256, "head_dim must be 16, 32, 64, 128 or 256");
  TORCH_CHECK(heads % kv == 0 && table.size(0) == b && lengths.numel() == b, "heads, table and lengths disagree");
  TORCH_CHECK(qkv.size(1) >= heads * hd, "qkv holds fewer than heads x head_dim queries");
  const int64_t group = heads / kv, row = qkv.stride(0);
  auto out = torch::empty({b, heads * hd}, qkv.options());
  std::vector<float> scores;
  std::vector<v16f> kf, vf;
  for (int64_t s = 0; s < b; ++s) {
    const int64_t len = lengths.data_ptr<int64_t>()[s];
    TORCH_CHECK(len >= 1 && len <= width, "a context length is outside its table");
    const int64_t* slot = table.data_ptr<int64_t>() + s * width;
    for (int64_t j = 0; j < len; ++j) TORCH_CHECK(slot[j] >= 0 && slot[j] < capacity, "slot out of the pool");
    scores.resize(group * ((len + W - 1) / W * W));
    kf.resize(len * hd / W);
    vf.resize(len * hd / W);
    for (int64_t g = 0; g < kv; ++g) {
      const uint16_t* qs = bf(qkv) + s * row + g * group * hd;
      const uint16_t* kb = bf(keys) + g * capacity * hd;
      const uint16_t* vb = bf(values) + g * capacity * hd;
      uint16_t* o = bf_mut(out) + s * heads * hd + g * group * hd;
      const float sc = float(scale);
      switch (hd) {
        case 16: attend_group<1>(qs, kb, vb, slot, len, group, sc, scores.data(), kf.data(), vf.data(), o); break;
        case 32: attend_group<2>(qs, kb, vb, slot, len, group, sc, scores.data(), kf.data(), vf.data(), o); break;
        case 64: attend_group<4>(qs, kb, vb, slot, len, group, sc, scores.data(), kf.data(), vf.data(), o); break;
        case 128: attend_group<8>(qs, kb, vb, slot, len, group, sc, scores.data(), kf.data(), vf.data(), o); break;
        default: attend_group<16>(qs, kb, vb, slot, len, group, sc, scores.data(), kf.data(), vf.data(), o);
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMS norm of rows (bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "x + residual and the RMS norm of it (bfloat16)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (bfloat16)");
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding of q and k in place; k and v into a pool layer");
  m.def("decode_attention", &decode_attention, "one new token per sequence over its pool context (bfloat16)");
}
