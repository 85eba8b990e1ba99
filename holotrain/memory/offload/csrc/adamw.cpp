// The offload engine's CPU step (holotrain/memory/offload): AdamW and the gradient accumulation on flat host
// buffers, one pass over memory per bucket.
//
// AdamW reads the gradient in its own dtype (bf16 from the staging buffer) and writes the new weights in the
// working dtype into the upload buffer as it goes, with torch's fused CPU AdamW math: the same float operations in
// the same order, so the result is bitwise equal to torch._fused_adamw_ where the two compile alike. Built with
// -ffp-contract=off (no fused multiply-add beyond the explicit fmaf calls, as torch's kernel) and -fno-math-errno
// (sqrtf vectorizes). torch ops would need three passes per chunk (bf16 -> fp32 scratch, AdamW, fp32 -> bf16),
// each a parallel region forked from the worker thread, which also has to take the GIL back between them.
//
// Each entry point takes a whole bucket, releases the GIL for the whole call and runs the bucket on `threads`
// native threads: a training thread that runs Python all through backward never holds the update up (a pool of
// Python threads would each need the GIL back between slices).

// pybind11 with torch's at::Tensor caster: all this file needs, and half the compile time of torch/extension.h.
#include <torch/csrc/utils/pybind.h>

#include <pthread.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, NaN -> quiet NaN, as c10::BFloat16.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : r;
}

inline float load(const uint16_t* x, int64_t i) { return bf16_to_f32(x[i]); }
inline float load(const float* x, int64_t i) { return x[i]; }
inline void store(uint16_t* o, int64_t i, float val) { o[i] = f32_to_bf16(val); }
inline void store(float* o, int64_t i, float val) { o[i] = val; }

// AdamW's per-call constants, in the float32 the loop uses.
struct Hyper {
  float decay;      // 1 - lr * weight_decay (decoupled weight decay)
  float w1;         // 1 - beta1: exp_avg is lerped towards the gradient by w1, as torch's vectorized lerp
  int small;        // |w1| < 0.5: which of the lerp's two forms (the one torch picks for this weight)
  float b2, c2;     // beta2, 1 - beta2
  float step_size;  // lr / bias_correction1
  float bc2_sqrt;   // sqrt(bias_correction2)
  float eps;
  float scale;  // the gradient is divided by it (the clip)
};

// One AdamW step of p, m, v over n elements; with kStore, also writes the new weights into out. out may be g's own
// buffer (the delayed update writes the weights over the gradient): out[i] is computed from g[i], so each value
// is read before it is written whatever the compiler reorders across elements (tests check it bit for bit).
template <typename G, typename O, bool kStore>
void adamw_loop(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v, const G* __restrict__ g,
                O* __restrict__ out, int64_t n, const Hyper& h) {
  // Scalars into locals: the loop keeps them in registers.
  const float decay = h.decay, w1 = h.w1, b2 = h.b2, c2 = h.c2, step_size = h.step_size, bc2_sqrt = h.bc2_sqrt,
              eps = h.eps, scale = h.scale;
  const int small = h.small;
  const float coeff = small ? w1 : w1 - 1.0f;
  for (int64_t i = 0; i < n; i++) {
    const float gi = load(g, i) / scale;
    const float mi = fmaf(coeff, gi - m[i], small ? m[i] : gi);
    const float vi = fmaf(c2 * gi, gi, v[i] * b2);
    const float pi = p[i] * decay - (step_size * mi) / (sqrtf(vi) / bc2_sqrt + eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if constexpr (kStore) store(out, i, pi);
  }
}

// acc = s (first) or acc + s, in fp32; returns the sum of squares of the new acc (fp64, 16 partial sums).
template <typename S>
double accumulate_loop(float* __restrict__ acc, const S* __restrict__ s, int64_t n, int first) {
  double part[16] = {0};
  const int64_t nb = n - n % 16;
  int64_t i = 0;
  if (first) {
    for (; i < nb; i += 16)
      for (int j = 0; j < 16; j++) {
        const float x = load(s, i + j);
        acc[i + j] = x;
        part[j] += static_cast<double>(x) * x;
      }
  } else {
    for (; i < nb; i += 16)
      for (int j = 0; j < 16; j++) {
        const float x = acc[i + j] + load(s, i + j);
        acc[i + j] = x;
        part[j] += static_cast<double>(x) * x;
      }
  }
  for (; i < n; i++) {
    const float x = first ? load(s, i) : acc[i] + load(s, i);
    acc[i] = x;
    part[0] += static_cast<double>(x) * x;
  }
  double total = 0.0;
  for (int j = 0; j < 16; j++) total += part[j];
  return total;
}

// The threaded drivers: one call per bucket runs it on `threads` native threads (the caller and threads - 1
// helpers). Blocks of BLOCK elements (a multiple of 64, cache-line aligned in every buffer) are handed out by an
// atomic counter, so a thread that loses its core delays only the block it holds. The accumulation's sums of
// squares are kept per block and added in block order: the same result whatever the thread count or timing.
constexpr int64_t BLOCK = int64_t{1} << 16;

enum Kind : int {
  // adamw_g{16,32}_o{0,16,32}: gradient bf16 / fp32; no output, bf16 or fp32 output
  ADAMW_G16_O0, ADAMW_G16_O16, ADAMW_G16_O32, ADAMW_G32_O0, ADAMW_G32_O16, ADAMW_G32_O32,
  ACCUMULATE_G16, ACCUMULATE_G32,
};

struct Job {
  Kind kind;
  float *p, *m, *v;
  const float *sp, *sm, *sv;  // AdamW out of place: p, m and v are first copied from these (null: in place)
  const void* g;
  void* out;
  int64_t n;
  Hyper h;
  int first;
  double* block_sq;
  std::atomic<int64_t> next{0};  // the next block to take
};

void run_block(Job* j, int64_t b) {
  const int64_t lo = b * BLOCK, len = (j->n - lo < BLOCK) ? j->n - lo : BLOCK;
  const uint16_t* g16 = static_cast<const uint16_t*>(j->g) + lo;
  const float* g32 = static_cast<const float*>(j->g) + lo;
  float *p = j->p + lo, *m = j->m + lo, *v = j->v + lo;
  if (j->sp != nullptr) {
    // Block by block, so the loop below reads the copies from cache: as many passes over memory as in place.
    std::memcpy(p, j->sp + lo, len * sizeof(float));
    std::memcpy(m, j->sm + lo, len * sizeof(float));
    std::memcpy(v, j->sv + lo, len * sizeof(float));
  }
  uint16_t* o16 = static_cast<uint16_t*>(j->out);
  float* o32 = static_cast<float*>(j->out);
  switch (j->kind) {
    case ADAMW_G16_O0: adamw_loop<uint16_t, uint16_t, false>(p, m, v, g16, o16, len, j->h); break;
    case ADAMW_G16_O16: adamw_loop<uint16_t, uint16_t, true>(p, m, v, g16, o16 + lo, len, j->h); break;
    case ADAMW_G16_O32: adamw_loop<uint16_t, float, true>(p, m, v, g16, o32 + lo, len, j->h); break;
    case ADAMW_G32_O0: adamw_loop<float, uint16_t, false>(p, m, v, g32, o16, len, j->h); break;
    case ADAMW_G32_O16: adamw_loop<float, uint16_t, true>(p, m, v, g32, o16 + lo, len, j->h); break;
    case ADAMW_G32_O32: adamw_loop<float, float, true>(p, m, v, g32, o32 + lo, len, j->h); break;
    case ACCUMULATE_G16: j->block_sq[b] = accumulate_loop(p, g16, len, j->first); break;
    case ACCUMULATE_G32: j->block_sq[b] = accumulate_loop(p, g32, len, j->first); break;
  }
}

void* drain(void* arg) {
  Job* j = static_cast<Job*>(arg);
  const int64_t blocks = (j->n + BLOCK - 1) / BLOCK;
  for (;;) {
    const int64_t b = j->next.fetch_add(1, std::memory_order_relaxed);
    if (b >= blocks) return nullptr;
    run_block(j, b);
  }
}

// Runs the job on up to `threads` threads: the caller drains blocks too, so the job completes even if no helper
// thread could be started.
void run_job(Job* j, int64_t threads) {
  const int64_t blocks = (j->n + BLOCK - 1) / BLOCK;
  if (threads > blocks) threads = blocks;
  if (threads > 256) threads = 256;
  pthread_t helpers[256];
  int started = 0;
  j->next.store(0, std::memory_order_relaxed);
  for (int64_t t = 1; t < threads; t++) {
    if (pthread_create(&helpers[started], nullptr, drain, j) == 0) started++;
  }
  drain(j);
  for (int t = 0; t < started; t++) pthread_join(helpers[t], nullptr);
}

// 0 for bf16, 1 for fp32 (the kinds' order), -1 for any other dtype.
int dtype_index(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return 0;
  if (t.scalar_type() == at::kFloat) return 1;
  return -1;
}

void check_flat(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), "offload kernel: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "offload kernel: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, "offload kernel: ", name, " has ", t.numel(), " elements, expected ", n);
}

void check_fp32(const at::Tensor& t, const char* name, int64_t n) {
  check_flat(t, name, n);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "offload kernel: ", name, " must be float32, got ", t.scalar_type());
}

// One AdamW step of master, exp_avg and exp_avg_sq (flat fp32), the gradient (bf16 or fp32) divided by `scale`;
// with `out` (bf16 or fp32), also writes the new weights into it. With `source` (three flat fp32 tensors: master,
// exp_avg, exp_avg_sq), the step reads the old state from there and writes the new one into the first three, which
// leaves the source untouched (a checkpoint may be reading it). The constants are AdamW's as the caller derived
// them for this step (see Hyper); they are rounded to float32 here, as the loop uses them.
void adamw(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& grad,
           const std::optional<at::Tensor>& out, const std::optional<std::vector<at::Tensor>>& source, double decay, double w1, double b2, double c2, double step_size,
           double bc2_sqrt, double eps, double scale, int64_t threads) {
  const int64_t n = master.numel();
  check_fp32(master, "master", n);
  check_fp32(exp_avg, "exp_avg", n);
  check_fp32(exp_avg_sq, "exp_avg_sq", n);
  check_flat(grad, "grad", n);
  const int g = dtype_index(grad);
  TORCH_CHECK(g >= 0, "offload kernel: grad must be bfloat16 or float32, got ", grad.scalar_type());
  int o = 0;  // no output
  void* out_ptr = nullptr;
  if (out.has_value()) {
    check_flat(*out, "out", n);
    const int index = dtype_index(*out);
    TORCH_CHECK(index >= 0, "offload kernel: out must be bfloat16 or float32, got ", out->scalar_type());
    o = 1 + index;
    out_ptr = out->data_ptr();
  }
  Job j;
  j.kind = static_cast<Kind>(g * 3 + o);
  j.p = master.data_ptr<float>();
  j.m = exp_avg.data_ptr<float>();
  j.v = exp_avg_sq.data_ptr<float>();
  j.sp = j.sm = j.sv = nullptr;
  if (source.has_value()) {
    const auto& src = *source;
    TORCH_CHECK(src.size() == 3, "offload kernel: source must be [master, exp_avg, exp_avg_sq]");
    check_fp32(src[0], "source master", n);
    check_fp32(src[1], "source exp_avg", n);
    check_fp32(src[2], "source exp_avg_sq", n);
    j.sp = src[0].data_ptr<float>();
    j.sm = src[1].data_ptr<float>();
    j.sv = src[2].data_ptr<float>();
  }
  j.g = grad.data_ptr();
  j.out = out_ptr;
  j.n = n;
  const float w1f = static_cast<float>(w1);
  j.h = Hyper{static_cast<float>(decay), w1f, std::fabs(w1f) < 0.5f ? 1 : 0, static_cast<float>(b2),
              static_cast<float>(c2), static_cast<float>(step_size), static_cast<float>(bc2_sqrt),
              static_cast<float>(eps), static_cast<float>(scale)};
  j.first = 0;
  j.block_sq = nullptr;
  run_job(&j, threads < 1 ? 1 : threads);
}

// acc = src (first) or acc + src, in fp32 (src bf16 or fp32); returns the sum of squares of the new acc.
double accumulate(const at::Tensor& acc, const at::Tensor& src, bool first, int64_t threads) {
  const int64_t n = acc.numel();
  check_fp32(acc, "acc", n);
  check_flat(src, "src", n);
  const int s = dtype_index(src);
  TORCH_CHECK(s >= 0, "offload kernel: src must be bfloat16 or float32, got ", src.scalar_type());
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<double> block_sq(blocks > 0 ? blocks : 1, 0.0);
  Job j;
  j.kind = s == 0 ? ACCUMULATE_G16 : ACCUMULATE_G32;
  j.p = acc.data_ptr<float>();
  j.m = j.v = nullptr;
  j.sp = j.sm = j.sv = nullptr;
  j.g = src.data_ptr();
  j.out = nullptr;
  j.n = n;
  j.h = Hyper{0, 0, 0, 0, 0, 0, 0, 0, 1.0f};
  j.first = first ? 1 : 0;
  j.block_sq = block_sq.data();
  run_job(&j, threads < 1 ? 1 : threads);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; b++) total += block_sq[b];
  return total;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "holotrain offload: the CPU step's AdamW and accumulation loops (GIL released, native threads)";
  m.attr("BLOCK") = BLOCK;
  m.def("adamw", &adamw, py::call_guard<py::gil_scoped_release>(), py::arg("master"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("grad"), py::arg("out"), py::arg("source"), py::arg("decay"), py::arg("w1"), py::arg("b2"),
        py::arg("c2"), py::arg("step_size"), py::arg("bc2_sqrt"), py::arg("eps"), py::arg("scale"),
        py::arg("threads"));
  m.def("accumulate", &accumulate, py::call_guard<py::gil_scoped_release>(), py::arg("acc"), py::arg("src"),
        py::arg("first"), py::arg("threads"));
}
