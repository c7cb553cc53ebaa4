// opwatch: counts the ATen ops that enter the dispatcher, through one global RecordFunction
// callback. Loaded with ctypes by cudagym/sandbox/opwatch.py, which documents the contract;
// plain C ABI (no Python.h, no pybind11) so that it builds in seconds against ATen/c10.
//
// The callback is installed once per process and never removed, so every call of every job
// takes the same path through the dispatcher; arming only decides whether the callback counts.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <thread>
#include <time.h>
#include <unistd.h>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

struct OpCount {
  std::string name;      // "aten::add", as the dispatcher's schema names it
  std::string overload;  // "Tensor" ("" for the default overload)
  std::atomic<uint64_t> count{0};
};

// Entries are created once per distinct op and never freed, so the per-thread caches below can
// hold raw pointers to them; reset only zeroes the counts.
std::mutex table_mutex;
std::deque<OpCount> entries;
std::unordered_map<std::string, OpCount*> by_key;  // key: name + '\0' + overload

std::atomic<bool> armed{false};
std::atomic<uint64_t> state_changes{0};  // arm/disarm/reset calls: a caller that did not make one can tell
std::atomic<at::CallbackHandle> handle{at::INVALID_CALLBACK_HANDLE};

// The probe of opwatch_alive counts here, on its own thread only, so it never touches the table.
thread_local bool probing = false;
thread_local uint64_t probe_hits = 0;

// Per-thread direct-mapped cache from the name/overload pointers of an op to its entry. A hit
// is confirmed by comparing the strings, so a pointer that was reused for another name (or whose
// bytes changed) only costs a miss, never a wrong count.
struct CacheSlot {
  const char* name;
  const char* overload;
  OpCount* entry;
};
constexpr size_t kCacheSlots = 256;
thread_local CacheSlot cache[kCacheSlots];

OpCount* lookup_slow(const char* name, const char* overload) {
  std::string key = std::string(name) + '\0' + overload;
  std::lock_guard<std::mutex> lock(table_mutex);
  auto it = by_key.find(key);
  if (it != by_key.end()) {
    return it->second;
  }
  OpCount& e = entries.emplace_back();
  e.name = name;
  e.overload = overload;
  by_key.emplace(std::move(key), &e);
  return &e;
}

void count_op(const char* name, const char* overload) {
  auto bits = reinterpret_cast<uintptr_t>(name) ^ (reinterpret_cast<uintptr_t>(overload) >> 3);
  CacheSlot& slot = cache[(bits >> 4) % kCacheSlots];
  OpCount* e = slot.entry;
  if (!(e && slot.name == name && slot.overload == overload && e->name == name && e->overload == overload)) {
    e = lookup_slow(name, overload);
    slot = CacheSlot{name, overload, e};
  }
  e->count.fetch_add(1, std::memory_order_relaxed);
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (probing) {
    ++probe_hits;
  } else if (armed.load(std::memory_order_relaxed)) {
    const char* overload = fn.overload_name();
    count_op(fn.name(), overload ? overload : "");
  }
  return nullptr;
}

// True where the dispatcher runs `op` on dense, sparse, quantized, nested or mkldnn CPU/CUDA
// tensors as its CompositeImplicitAutograd kernel: a function that calls other ops through the
// dispatcher, which are counted themselves (so `aten::to` of a tensor that already has the
// dtype, or `aten::dropout` in eval mode, computes nothing). An op with a kernel of its own for
// any of these backends does its own work there and is not "decomposed".
bool decomposes(const std::string& name, const std::string& overload) {
  auto op = c10::Dispatcher::singleton().findOp(c10::OperatorName(name, overload));
  if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    return false;
  }
  static const c10::DispatchKeySet own_kernels = c10::DispatchKeySet({
      c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::SparseCPU,
      c10::DispatchKey::SparseCUDA, c10::DispatchKey::SparseCsrCPU, c10::DispatchKey::SparseCsrCUDA,
      c10::DispatchKey::QuantizedCPU, c10::DispatchKey::QuantizedCUDA,
      c10::DispatchKey::NestedTensorCPU, c10::DispatchKey::NestedTensorCUDA,
      c10::DispatchKey::MkldnnCPU});
  return !op->hasKernelForAnyDispatchKey(own_kernels) &&
         !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
}

}  // namespace

extern "C" {

// Registers the callback (once per process; later calls do nothing). Returns 0, or -1 if torch
// refused the registration.
int opwatch_install() {
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      handle = at::addGlobalCallback(at::RecordFunctionCallback(on_op_start)
                                         .needsInputs(false)
                                         .needsOutputs(false)
                                         .needsIds(false)
                                         .scopes({at::RecordScope::FUNCTION}));
    } catch (...) {
      handle = at::INVALID_CALLBACK_HANDLE;
    }
  });
  return handle == at::INVALID_CALLBACK_HANDLE ? -1 : 0;
}

void opwatch_arm() {
  state_changes.fetch_add(1);
  armed.store(true);
}

void opwatch_disarm() {
  state_changes.fetch_add(1);
  armed.store(false);
}

void opwatch_reset() {
  state_changes.fetch_add(1);
  std::lock_guard<std::mutex> lock(table_mutex);
  for (OpCount& e : entries) {
    e.count.store(0);
  }
}

uint64_t opwatch_state_changes() {
  return state_changes.load();
}

// Writes "name\toverload\tcount\tdecomposes\n" for every op counted since the last reset
// (decomposes: 1 or 0, see `decomposes`) into buf, NUL-terminated, as far as cap allows.
// Returns the length of the whole text without the NUL: call again with a larger buffer when
// it is >= cap.
size_t opwatch_dump(char* buf, size_t cap) {
  std::vector<std::pair<const OpCount*, uint64_t>> counted;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    for (const OpCount& e : entries) {
      if (uint64_t n = e.count.load()) {
        counted.emplace_back(&e, n);
      }
    }
  }
  // the dispatcher is asked outside the table's lock: it takes its own
  // a name is the candidate's to choose (RECORD_FUNCTION): a control character in it (a tab, a
  // newline, a NUL) is written as '?', so the dump's fields and lines stay the harness's
  auto field = [](const std::string& s) {
    std::string out = s;
    for (char& c : out) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        c = '?';
      }
    }
    return out;
  };
  std::string text;
  for (const auto& [e, n] : counted) {
    text += field(e->name) + '\t' + field(e->overload) + '\t' + std::to_string(n) + '\t' +
            (decomposes(e->name, e->overload) ? '1' : '0') + '\n';
  }
  if (cap > 0) {
    size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

// Whether the callback still sees ops on the calling thread: 0 if it does; 1 if RecordFunction
// is switched off on this thread; 2 if it is on but an op run here did not reach the callback
// (the callback was removed or disabled); 3 if the callback was never installed.
int opwatch_alive() {
  if (handle == at::INVALID_CALLBACK_HANDLE) {
    return 3;
  }
  if (!at::isRecordFunctionEnabled()) {
    return 1;
  }
  probing = true;
  probe_hits = 0;
  try {
    at::empty({0});
  } catch (...) {
  }
  probing = false;
  return probe_hits > 0 ? 0 : 2;
}


// Handles of RecordFunction callbacks (global or thread-local) that code other than this function
// registered so far in this process: torch numbers every registration from one counter, so a
// probe registration (ours, removed at once, not counted) tells how many there were. The harness
// reads it before any candidate code loads and after each timed call: a callback the candidate
// registered in between (an observer of the harness's own ops) shows, even if it was removed or
// disabled since. Not seen: code that edits RecordFunction's lists or torch's counter in memory.
uint64_t opwatch_callbacks_registered() {
  static std::atomic<uint64_t> own{0};
  at::CallbackHandle h = at::INVALID_CALLBACK_HANDLE;
  try {
    h = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
          return nullptr;
        }).scopes({at::RecordScope::USER_SCOPE}));
  } catch (...) {
    return ~0ull;
  }
  at::removeCallback(h);
  return static_cast<uint64_t>(h) - own.fetch_add(1) - 1;
}

}  // extern "C"

// The CPU target's close of a timed call (`cudagym.sandbox.timing.DeviceTimer.call`): one call,
// inside the call's interval, with no ATen op, no Python and no callback of anyone's in it. It
// draws a seed with getrandom(), then for each of `n` outputs makes one pass over every element,
// read once, in chunks, in an order drawn from the seed (a random rotation and stride of the
// chunks): each chunk is projected as the GPU's close kernel projects
// (`cudagym.sandbox.timing.projection`: 4 sums of +-1 weights from a hash of (seed, index,
// component) times each real component, in fp64) into `proj` (if `kind` is not 0), and the values
// at `count` positions drawn from the seed that lie in it are copied from the same read into
// `values` (count * elem_size bytes; all elements in row-major order, and no positions, if count ==
// numel). The positions (int64, into `positions`) and the seed (into each output's `seed`, for
// the parent) are written only after every pass: nothing of the candidate's can learn them, or
// the chunks' order, from the harness's memory while the outputs are read, so work racing the
// pass cannot keep ahead of it. A contiguous output is read through process_vm_readv on this
// process: a page the candidate protected fails the read (-2) instead of reaching a fault
// handler of its (where the kernel refuses the syscall, ENOSYS or EPERM under a seccomp filter,
// plain reads); the harness makes its outputs contiguous before the close (strided reads, plain,
// are left for tools and tests). `*phase_ns` gets the whole pass's duration (CLOCK_MONOTONIC),
// which the parent leaves out of the call up to the job's calibration (`Calibration`).
// Sizes and strides in elements. Returns 0; -1 if getrandom failed; -2 if an output could not be
// read (unmapped or protected memory).
struct CpuClose {
  uint64_t src, values, positions;
  int64_t numel, count, elem_size, ndim;
  int64_t sizes[64], strides[64];
  uint64_t proj;       // 4 doubles (0: no projection)
  int64_t kind, index;  // `PROJECTED_KINDS` (0: none); the output's place among the call's outputs
  uint64_t seed;       // written by the close: the call's seed of positions and weights
};

static int64_t offset_of(const CpuClose& o, uint64_t flat) {
  int64_t off = 0;
  for (int64_t d = o.ndim - 1; d >= 0; --d) {
    uint64_t size = static_cast<uint64_t>(o.sizes[d]);
    off += static_cast<int64_t>(flat % size) * o.strides[d];
    flat /= size;
  }
  return off;
}

static bool random_bytes(void* buf, size_t n) {
  auto* p = static_cast<unsigned char*>(buf);
  while (n) {
    long got = syscall(SYS_getrandom, p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}

// process_vm_readv on this process, or plain reads where the kernel refuses the syscall
static int vm_mode = 0;  // 0: untried, 1: process_vm_readv, 2: plain reads

static bool read_remote(const struct iovec* local, const struct iovec* remote, size_t n, size_t bytes) {
  if (vm_mode != 2) {
    ssize_t got = process_vm_readv(getpid(), local, n, remote, n, 0);
    if (got == static_cast<ssize_t>(bytes)) { vm_mode = 1; return true; }
    if (got < 0 && (errno == ENOSYS || errno == EPERM) && vm_mode == 0) {
      vm_mode = 2;
    } else {
      return false;  // EFAULT, or a short read: memory the process cannot read
    }
  }
  for (size_t k = 0; k < n; ++k) {
    const volatile unsigned char* s = static_cast<const volatile unsigned char*>(remote[k].iov_base);
    auto* d = static_cast<unsigned char*>(local[k].iov_base);
    for (size_t b = 0; b < remote[k].iov_len; ++b) d[b] = s[b];
  }
  return true;
}

static double half_value(uint16_t h) {
  int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v = exp == 0 ? std::ldexp(static_cast<double>(man), -24)
           : exp == 31 ? (man ? std::nan("") : HUGE_VAL)
           : std::ldexp(static_cast<double>(man | 0x400), exp - 25);
  return (h & 0x8000) ? -v : v;
}

// One real component (`component` in the GPU close's source): kinds 1 f32, 2 f64, 3 f16, 4 bf16,
// 5 u8/bool, 6 i8, 7 i16, 8 i32, 9 i64
template <int KIND>
static inline double component(const unsigned char* p) {
  if constexpr (KIND == 1) { float v; std::memcpy(&v, p, 4); return v; }
  if constexpr (KIND == 2) { double v; std::memcpy(&v, p, 8); return v; }
  if constexpr (KIND == 3) { uint16_t v; std::memcpy(&v, p, 2); return half_value(v); }
  if constexpr (KIND == 4) { uint16_t v; std::memcpy(&v, p, 2); uint32_t u = static_cast<uint32_t>(v) << 16;
                             float f; std::memcpy(&f, &u, 4); return f; }
  if constexpr (KIND == 5) return static_cast<double>(*p);
  if constexpr (KIND == 6) return static_cast<double>(static_cast<signed char>(*p));
  if constexpr (KIND == 7) { int16_t v; std::memcpy(&v, p, 2); return v; }
  if constexpr (KIND == 8) { int32_t v; std::memcpy(&v, p, 4); return v; }
  if constexpr (KIND == 9) { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
  return 0.0;
}

struct Sums { double a[4] = {0, 0, 0, 0}; };

static inline double flipped(double x, uint32_t bit) {  // x, or -x if bit is 1 (no branch: the bits are random)
  uint64_t u;
  std::memcpy(&u, &x, 8);
  u ^= static_cast<uint64_t>(bit) << 63;
  std::memcpy(&x, &u, 8);
  return x;
}

// components [first, first + m) of an output, read into `buf`, added to `acc`
template <int KIND, int SIZE>
static void project_chunk(const unsigned char* buf, uint64_t first, uint64_t m, uint32_t s0, uint32_t s1,
                          Sums& acc) {
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (uint64_t j = 0; j < m; ++j) {
    const uint64_t i = first + j;
    const double x = component<KIND>(buf + j * SIZE);
    uint32_t h = mix32(static_cast<uint32_t>(i) ^ s0);
    if (i >> 32) h = mix32(h ^ static_cast<uint32_t>(i >> 32) ^ s1);
    a0 += flipped(x, h & 1u);
    a1 += flipped(x, (h >> 1) & 1u);
    a2 += flipped(x, (h >> 2) & 1u);
    a3 += flipped(x, (h >> 3) & 1u);
  }
  acc.a[0] += a0; acc.a[1] += a1; acc.a[2] += a2; acc.a[3] += a3;
}

static void project(int64_t kind, const unsigned char* buf, uint64_t first, uint64_t m, uint32_t s0, uint32_t s1,
                    Sums& acc) {
  switch (kind) {
  case 1: case 11: project_chunk<1, 4>(buf, first, m, s0, s1, acc); break;
  case 2: case 12: project_chunk<2, 8>(buf, first, m, s0, s1, acc); break;
  case 3: case 10: project_chunk<3, 2>(buf, first, m, s0, s1, acc); break;
  case 4: project_chunk<4, 2>(buf, first, m, s0, s1, acc); break;
  case 5: project_chunk<5, 1>(buf, first, m, s0, s1, acc); break;
  case 6: project_chunk<6, 1>(buf, first, m, s0, s1, acc); break;
  case 7: project_chunk<7, 2>(buf, first, m, s0, s1, acc); break;
  case 8: project_chunk<8, 4>(buf, first, m, s0, s1, acc); break;
  case 9: project_chunk<9, 8>(buf, first, m, s0, s1, acc); break;
  default: break;
  }
}

constexpr uint64_t kProjectStep = 1 << 14;  // components per partial sum of `project_measured`

// A reference output's projections, as the close makes a call's (`cudagym_cpu_project` below),
// and its three measures the parent's bound on honest differences uses: the sum of |x| and of x^2
// over the finite components and the number of components that are not finite. Components
// [lo, hi) of `src` into `out` (7 doubles).
template <int KIND, int SIZE>
static void project_measured(const unsigned char* src, uint64_t lo, uint64_t hi, uint32_t s0, uint32_t s1,
                             double* out) {
  Sums acc;
  double a = 0, q = 0, bad = 0;
  for (uint64_t at = lo; at < hi; at += kProjectStep) {
    const uint64_t k = std::min<uint64_t>(kProjectStep, hi - at);
    project_chunk<KIND, SIZE>(src + at * SIZE, at, k, s0, s1, acc);
    for (uint64_t i = at; i < at + k; ++i) {
      const double x = component<KIND>(src + i * SIZE);
      if (std::isfinite(x)) { a += std::fabs(x); q += x * x; } else { bad += 1; }
    }
  }
  for (int k = 0; k < 4; ++k) out[k] = acc.a[k];
  out[4] = a; out[5] = q; out[6] = bad;
}

template <int KIND, int SIZE>
static void project_measured_on(const unsigned char* src, uint64_t m, uint32_t s0, uint32_t s1, double* out) {
  const uint64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t threads = std::max<uint64_t>(1, std::min<uint64_t>({hw, 8, m / (16 * kProjectStep)}));
  std::vector<std::array<double, 7>> parts(threads);
  auto part = [&](uint64_t t) {
    project_measured<KIND, SIZE>(src, m * t / threads, m * (t + 1) / threads, s0, s1, parts[t].data());
  };
  std::vector<std::thread> pool;
  for (uint64_t t = 1; t < threads; ++t) pool.emplace_back(part, t);
  part(0);
  for (auto& th : pool) th.join();
  for (int k = 0; k < 7; ++k) {
    out[k] = 0;
    for (const auto& p : parts) out[k] += p[k];
  }
}

constexpr uint64_t kChunk = 1 << 16;  // bytes per read of the projection pass
constexpr uint64_t kStridedChunk = 4096;  // elements per step of a strided output's pass

static uint64_t gcd64(uint64_t a, uint64_t b) { while (b) { uint64_t t = a % b; a = b; b = t; } return a; }

// Every element of `o`, read once in an order drawn from `stream`, projected into `acc` (kind 0:
// read only). Returns false if a read failed.
// One pass over every element of `o`, read once, in an order drawn from `stream`: each chunk is
// projected into `acc` (kind 0: read only) and the sampled elements that lie in it (`picks`:
// (flat position, sample index), sorted) are copied from the same read into `values`. Returns
// false if a read failed.
static bool read_all(const CpuClose& o, uint64_t stream, uint32_t s0, uint32_t s1, Sums& acc,
                     const std::vector<std::pair<uint64_t, uint64_t>>& picks, bool everything,
                     std::vector<unsigned char>& buf) {
  const uint64_t es = static_cast<uint64_t>(o.elem_size), numel = static_cast<uint64_t>(o.numel);
  const uint64_t parts = (o.kind >= 10 && o.kind <= 12) ? 2 : 1;  // complex: two components an element
  const bool contiguous = o.ndim == 1 && o.strides[0] == 1;
  const uint64_t per = contiguous ? std::max<uint64_t>(kChunk / es, 1) : kStridedChunk;  // elements per step
  const uint64_t chunks = (numel + per - 1) / per;
  auto* values = reinterpret_cast<unsigned char*>(o.values);
  buf.resize(per * es);
  // chunk j is read at step (a * j + b) mod chunks, a coprime with chunks
  uint64_t a = chunks > 1 ? 1 + mix64(stream) % (chunks - 1) : 1, b = chunks ? mix64(stream + 1) % chunks : 0;
  while (chunks > 1 && gcd64(a, chunks) != 1) a = a % (chunks - 1) + 1;
  struct iovec remote[1], local[1];
  for (uint64_t step = 0; step < chunks; ++step) {
    const uint64_t c = (a * step + b) % chunks, lo = c * per, m = std::min(per, numel - lo);
    if (contiguous) {
      remote[0] = {reinterpret_cast<void*>(o.src + lo * es), m * es};
      local[0] = {buf.data(), m * es};
      if (!read_remote(local, remote, 1, m * es)) return false;
    } else {  // element by element (a syscall's iovec per element costs ~1 us; the harness makes
              // its outputs contiguous first, so only tools and tests come here)
      const volatile unsigned char* src = reinterpret_cast<const volatile unsigned char*>(o.src);
      for (uint64_t j = 0; j < m; ++j) {
        const volatile unsigned char* e = src + offset_of(o, lo + j) * static_cast<int64_t>(es);
        for (uint64_t b = 0; b < es; ++b) buf[j * es + b] = e[b];
      }
    }
    if (o.kind != 0) project(o.kind, buf.data(), lo * parts, m * parts, s0, s1, acc);
    if (o.count <= 0) continue;
    if (everything) {
      std::memcpy(values + lo * es, buf.data(), m * es);
      continue;
    }
    auto it = std::lower_bound(picks.begin(), picks.end(), std::make_pair(lo, uint64_t{0}));
    for (; it != picks.end() && it->first < lo + m; ++it)
      std::memcpy(values + it->second * es, buf.data() + (it->first - lo) * es, es);
  }
  return true;
}

// The clock of the timed calls' stamps, read by the syscall itself: no slot of a library (this one's
// or libc's, red team 33's hook on `clock_gettime`) and no vDSO page lies between it and the kernel.
static int64_t now_ns() {
  struct timespec ts;
#if defined(__x86_64__)
  long ret;
  __asm__ volatile("syscall" : "=a"(ret) : "0"(SYS_clock_gettime), "D"(CLOCK_MONOTONIC), "S"(&ts)
                   : "rcx", "r11", "memory");
  (void)ret;
#elif defined(__aarch64__)
  register long x8 __asm__("x8") = SYS_clock_gettime;
  register long x0 __asm__("x0") = CLOCK_MONOTONIC;
  register long x1 __asm__("x1") = reinterpret_cast<long>(&ts);
  __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1) : "memory");
#else
  clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
  return static_cast<int64_t>(ts.tv_sec) * 1000000000ll + ts.tv_nsec;
}

// The CPU target's cache flush before a timed call (`DeviceTimer.flush`): a word of every cache
// line of `words` read, by `threads` threads started here and joined before it returns. torch's
// own sum did it on its OpenMP pool, whose workers then spin for milliseconds, into the call, on
// cores the candidate's threads need: an own OpenMP kernel read 5-6 ms a call instead of 3
// whenever the call began less than ~3 ms after the flush.
extern "C" int64_t cudagym_cpu_flush(const int64_t* words, int64_t n, int64_t threads) {
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, 256));
  std::vector<int64_t> sums(static_cast<size_t>(threads), 0);
  auto part = [&](int64_t t) {
    const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
    int64_t s = 0;
    for (int64_t i = lo; i < hi; i += 8) s += words[i];  // 8 words: one 64-byte line
    sums[static_cast<size_t>(t)] = s;
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(part, t);
  part(0);
  for (auto& th : pool) th.join();
  int64_t total = 0;
  for (int64_t s : sums) total += s;
  return total;
}

// The channel's frames (`cudagym.sandbox.worker.wire`): a 4-byte header length, the JSON
// header, an 8-byte payload length, the payload. Written whole (a pipe may take a long frame in
// parts); false if the pipe refused (closed, or not a pipe the parent reads).
static bool write_frame(int fd, const std::string& header, std::vector<struct iovec> payload) {
  const uint32_t hl = static_cast<uint32_t>(header.size());
  uint64_t pl = 0;
  for (const auto& v : payload) pl += v.iov_len;
  std::vector<struct iovec> iov = {{const_cast<uint32_t*>(&hl), sizeof hl},
                                   {const_cast<char*>(header.data()), header.size()}, {&pl, sizeof pl}};
  for (const auto& v : payload)
    if (v.iov_len) iov.push_back(v);
  size_t at = 0;
  while (at < iov.size()) {
    const int count = static_cast<int>(std::min<size_t>(iov.size() - at, IOV_MAX));
    ssize_t wrote = writev(fd, iov.data() + at, count);
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    while (at < iov.size() && static_cast<size_t>(wrote) >= iov[at].iov_len) wrote -= iov[at++].iov_len;
    if (at < iov.size()) {
      iov[at].iov_base = static_cast<char*>(iov[at].iov_base) + wrote;
      iov[at].iov_len -= static_cast<size_t>(wrote);
    }
  }
  return true;
}

// A CPU timed call's start (`DeviceTimer.call`): the clock read, then (`fd` >= 0) sent to the
// parent on the channel before anything of the candidate's runs; the reading, or -1 if the
// channel refused it.
// Where a CPU timed call's stamps and evidence go: the worker's result pipe, put at this fixed
// descriptor by the harness before any candidate code (`timed.job_timer`), where the channel guard
// (`cudagym_guard_channel`) keeps it. A number in the code, not in data the candidate could rewrite;
// nothing is sent where it is not a pipe (a process that is not a timing job's worker).
static constexpr int CHANNEL_FD = 1000;

static bool channel_open() {
  struct stat st;
  return fstat(CHANNEL_FD, &st) == 0 && S_ISFIFO(st.st_mode);
}

// A CPU timed call's start (`DeviceTimer.call`): the clock read, then sent to the parent on the
// channel (where there is one) before anything of the candidate's runs; the reading, or -1 if the
// channel refused it.
extern "C" int64_t cudagym_cpu_open() {
  const int64_t t0 = now_ns();
  if (channel_open() &&
      !write_frame(CHANNEL_FD, "{\"type\": \"stamp\", \"what\": \"open\", \"ns\": " + std::to_string(t0) + "}", {}))
    return -1;
  return t0;
}

// The channel guard of a CPU profile job (`timed.run_profile`, before the candidate's code loads):
// a seccomp filter on this process and all it starts from then on that refuses (EPERM) to put
// anything else at the descriptors `fds` (`dup2`, `dup3`) or to close them (`close`,
// `close_range` over one), io_uring (whose operations pass no filter), another seccomp filter
// (`seccomp`, `prctl(PR_SET_SECCOMP)`), tracing (`ptrace`), writing another process's memory or
// taking its descriptors (`process_vm_writev`, `pidfd_getfd`), and any syscall of another ABI
// (i386's `int 0x80`, x32). The channel's frames then reach the parent through the descriptors
// the harness opened, as the harness wrote them. Returns 0, or -errno (no filter installed).
extern "C" int cudagym_guard_channel(const int* fds, int n) {
#if defined(__x86_64__)
  constexpr uint32_t arch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
  constexpr uint32_t arch = AUDIT_ARCH_AARCH64;
#else
  return -ENOSYS;
#endif
  if (n < 1 || n > 8) return -EINVAL;
  const uint32_t deny = SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA);
  std::vector<struct sock_filter> f;
  auto jump = [&](uint16_t code, uint32_t k, uint8_t jt, uint8_t jf) { f.push_back(sock_filter{code, jt, jf, k}); };
  auto stmt = [&](uint16_t code, uint32_t k) { f.push_back(sock_filter{code, 0, 0, k}); };
  auto lo = [](int i) { return static_cast<uint32_t>(offsetof(struct seccomp_data, args) + 8 * i); };
  // each check is a block that ends in `ret`: a compare against every protected descriptor
  auto deny_if_arg = [&](int i) {
    stmt(BPF_LD | BPF_W | BPF_ABS, lo(i));  // the low half: the kernel reads these arguments as 32-bit
    for (int k = 0; k < n; ++k) {
      jump(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(fds[k]), 0, 1);
      stmt(BPF_RET | BPF_K, deny);
    }
    stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  };
  stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
  jump(BPF_JMP | BPF_JEQ | BPF_K, arch, 1, 0);
  stmt(BPF_RET | BPF_K, deny);
  stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
  jump(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1);  // x32
  stmt(BPF_RET | BPF_K, deny);
#endif
  // the dispatch: each syscall jumps to its block, laid out below in this order
  std::vector<std::pair<uint32_t, int>> blocks = {
#ifdef __NR_dup2
      {__NR_dup2, 1},
#endif
      {__NR_dup3, 1}, {__NR_close, 0}, {__NR_close_range, -1}, {__NR_io_uring_setup, -2},
      // no filter after this one (a filter of the candidate's could hold the harness's writes and hand them
      // to a thread of its own: red team 32's user notifications), no tracing or writing of another process
      {__NR_seccomp, -2}, {__NR_prctl, -3}, {__NR_ptrace, -2}, {__NR_process_vm_writev, -2},
      {__NR_pidfd_getfd, -2}};
  const size_t dispatch = f.size();
  for (size_t b = 0; b < blocks.size(); ++b) jump(BPF_JMP | BPF_JEQ | BPF_K, blocks[b].first, 0, 0);
  stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const size_t at = f.size(), from = dispatch + b + 1;
    f[dispatch + b].jt = static_cast<uint8_t>(at - from);
    if (blocks[b].second >= 0) {
      deny_if_arg(blocks[b].second);
    } else if (blocks[b].second == -1) {  // close_range(first, last, flags): one of them in [first, last]
      for (int k = 0; k < n; ++k) {
        const uint32_t fd = static_cast<uint32_t>(fds[k]);
        stmt(BPF_LD | BPF_W | BPF_ABS, lo(0));
        jump(BPF_JMP | BPF_JGT | BPF_K, fd, 3, 0);  // first > fd: not this one
        stmt(BPF_LD | BPF_W | BPF_ABS, lo(1));
        jump(BPF_JMP | BPF_JGE | BPF_K, fd, 0, 1);  // last >= fd
        stmt(BPF_RET | BPF_K, deny);
      }
      stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    } else if (blocks[b].second == -3) {  // prctl(PR_SET_SECCOMP, ...)
      stmt(BPF_LD | BPF_W | BPF_ABS, lo(0));
      jump(BPF_JMP | BPF_JEQ | BPF_K, PR_SET_SECCOMP, 0, 1);
      stmt(BPF_RET | BPF_K, deny);
      stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    } else {
      stmt(BPF_RET | BPF_K, deny);
    }
  }
  if (f.size() > 255) return -E2BIG;  // the dispatch's jumps are 8-bit
  struct sock_fprog prog = {static_cast<unsigned short>(f.size()), f.data()};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -errno;
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) return -errno;
  return 0;
}

// The CPU close of a timed call (`DeviceTimer._close_cpu`): every output page read, the positions
// drawn and the values gathered, each output projected; then the clock read (`stamps[1]`; the
// projection pass in `stamps[0]`). Where the channel is open (`CHANNEL_FD`), the call's end and
// everything the close read go to the parent on it in one frame before this returns, so that
// nothing of the candidate's runs between the reads and the send: the header holds `layout` (the harness's JSON of what each output is, made as the outputs were registered), the
// stamps, the seed and each output's bytes (values, positions, projections; `[0, 0, 0]`: none
// read); the payload, those bytes in that order. Returns 0; -1 (no random bytes), -2 (an output's
// memory could not be read), -3 (the channel refused the frame).
extern "C" int cudagym_cpu_close(CpuClose* outs, int64_t n, int64_t* stamps, const char* layout,
                                 int64_t layout_len) {
  uint64_t seed = 0;
  if (!random_bytes(&seed, sizeof seed)) return -1;
  const int64_t t0 = now_ns();
  std::vector<unsigned char> buf;
  std::vector<std::pair<uint64_t, uint64_t>> picks;
  int code = 0;
  for (int64_t k = 0; k < n && code == 0; ++k) {
    CpuClose& o = outs[k];
    if (o.numel <= 0) continue;
    const bool everything = o.count >= o.numel;
    picks.clear();
    if (o.count > 0 && !everything) {  // the positions, kept here until every value is read
      uint64_t stream = mix64(seed ^ mix64(static_cast<uint64_t>(o.index) + 0x5151));
      for (int64_t i = 0; i < o.count; ++i)
        picks.emplace_back(mix64(stream += 0x9e3779b97f4a7c15ull) % static_cast<uint64_t>(o.numel),
                           static_cast<uint64_t>(i));
      std::sort(picks.begin(), picks.end());
    }
    const uint32_t idx = static_cast<uint32_t>(o.index);
    const uint32_t s0 = static_cast<uint32_t>(seed) ^ mix32(2 * idx + 1);
    const uint32_t s1 = static_cast<uint32_t>(seed >> 32) ^ mix32(2 * idx + 2);
    Sums acc;
    if (!read_all(o, mix64(seed ^ (0xc105e + static_cast<uint64_t>(k))), s0, s1, acc, picks, everything, buf)) {
      code = -2;
      break;
    }
    if (o.proj && o.kind != 0) std::memcpy(reinterpret_cast<void*>(o.proj), acc.a, sizeof acc.a);
    auto* positions = reinterpret_cast<int64_t*>(o.positions);
    if (positions)
      for (const auto& [flat, i] : picks) positions[i] = static_cast<int64_t>(flat);
  }
  const int64_t t1 = now_ns();
  if (stamps) {
    stamps[0] = t1 - t0;
    stamps[1] = t1;
  }
  if (code == 0 && channel_open()) {
    std::vector<struct iovec> payload;
    std::string sizes;
    int64_t dense = 0;
    for (int64_t k = 0; k < n; ++k) {
      const CpuClose& o = outs[k];
      const bool everything = o.count >= o.numel;
      const size_t v = o.count > 0 ? static_cast<size_t>(everything ? o.numel : o.count) * o.elem_size : 0;
      const size_t p = o.count > 0 && o.positions ? static_cast<size_t>(o.count) * sizeof(int64_t) : 0;
      const size_t j = o.proj && o.kind != 0 ? sizeof(Sums{}.a) : 0;
      payload.push_back({reinterpret_cast<void*>(o.values), v});
      payload.push_back({reinterpret_cast<void*>(o.positions), p});
      payload.push_back({reinterpret_cast<void*>(o.proj), j});
      dense += std::max<int64_t>(o.numel, o.numel * o.elem_size / 4);
      sizes += (k ? ", [" : "[") + std::to_string(v) + ", " + std::to_string(p) + ", " + std::to_string(j) + "]";
    }
    // the layout first: a key it repeated comes before the close's own, which the parent's JSON reader keeps
    std::string header = "{\"layout\": ";
    header.append(layout && layout_len > 0 ? std::string(layout, static_cast<size_t>(layout_len)) : "null");
    header += ", \"type\": \"stamp\", \"what\": \"close\", \"ns\": " + std::to_string(t1) +
              ", \"phase_ns\": " + std::to_string(t1 - t0) + ", \"dense\": " + std::to_string(dense) +
              ", \"seed\": " + std::to_string(seed) + ", \"sizes\": [" + sizes + "]}";
    if (!write_frame(CHANNEL_FD, header, payload)) code = -3;
  }
  if (code == 0)  // published last: nothing of the candidate's could read the seed while the pass ran
    for (int64_t k = 0; k < n; ++k) outs[k].seed = seed;
  seed = 0;
  return code;
}

// `cudagym.sandbox.timing.projection` of a contiguous output in this process's memory (`src`,
// `components` real components of `kind`, `PROJECTED_KINDS`) with a seed the caller gives: the
// reference-only worker's side of the parent's re-check of timed calls, which projects each
// call's reference output with the weights the close drew for that call. `out`: 7 doubles.
// Returns 0; -1 for a kind it does not project.
extern "C" int cudagym_cpu_project(const void* src, int64_t components, int64_t kind, int64_t index,
                                   uint64_t seed, double* out) {
  const uint32_t idx = static_cast<uint32_t>(index);
  const uint32_t s0 = static_cast<uint32_t>(seed) ^ mix32(2 * idx + 1);
  const uint32_t s1 = static_cast<uint32_t>(seed >> 32) ^ mix32(2 * idx + 2);
  const auto* p = static_cast<const unsigned char*>(src);
  const uint64_t m = components > 0 ? static_cast<uint64_t>(components) : 0;
  switch (kind) {
  case 1: case 11: project_measured_on<1, 4>(p, m, s0, s1, out); break;
  case 2: case 12: project_measured_on<2, 8>(p, m, s0, s1, out); break;
  case 3: case 10: project_measured_on<3, 2>(p, m, s0, s1, out); break;
  case 4: project_measured_on<4, 2>(p, m, s0, s1, out); break;
  case 5: project_measured_on<5, 1>(p, m, s0, s1, out); break;
  case 6: project_measured_on<6, 1>(p, m, s0, s1, out); break;
  case 7: project_measured_on<7, 2>(p, m, s0, s1, out); break;
  case 8: project_measured_on<8, 4>(p, m, s0, s1, out); break;
  case 9: project_measured_on<9, 8>(p, m, s0, s1, out); break;
  default: return -1;
  }
  return 0;
}
