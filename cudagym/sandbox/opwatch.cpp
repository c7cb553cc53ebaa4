// opwatch: counts the ATen ops that enter the dispatcher, through one global RecordFunction
// callback. Loaded with ctypes by cudagym/sandbox/opwatch.py, which documents the contract;
// plain C ABI (no Python.h, no pybind11) so that it builds in seconds against ATen/c10.
//
// The callback is installed once per process and never removed, so every call of every job
// takes the same path through the dispatcher; arming only decides whether the callback counts.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <sys/syscall.h>
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
  std::string text;
  for (const auto& [e, n] : counted) {
    text += e->name + '\t' + e->overload + '\t' + std::to_string(n) + '\t' +
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

// The CPU target's close of a timed call (`cudagym.sandbox.timing.DeviceTimer.call`): one call,
// inside the call's interval, with no ATen op, no Python and no callback of anyone's in it. For
// each of `n` outputs it reads every page of a contiguous output (a byte per 4 KB, and its last
// byte) or every element of a strided one, so that pages a fault handler fills on first read are
// filled here; then it draws `count` positions in [0, numel) from getrandom() (kept in this
// function's memory until the values are read: nothing else sees them first) and copies the
// element at each (all elements in row-major order, and no positions, if count == numel) into
// `values` (count * elem_size bytes) and the positions into `positions` (int64), buffers the
// harness allocated. Sizes and strides in elements; dtype-agnostic (elements are elem_size bytes).
// Returns 0, or -1 if getrandom failed.
struct CpuClose {
  uint64_t src, values, positions;
  int64_t numel, count, elem_size, ndim;
  int64_t sizes[64], strides[64];
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

int cudagym_cpu_close(CpuClose* outs, int64_t n) {
  volatile unsigned char sink = 0;
  for (int64_t k = 0; k < n; ++k) {
    const CpuClose& o = outs[k];
    if (o.numel <= 0) continue;
    const volatile unsigned char* src = reinterpret_cast<const volatile unsigned char*>(o.src);
    bool contiguous = o.ndim == 1 && o.strides[0] == 1;
    if (contiguous) {
      uint64_t bytes = static_cast<uint64_t>(o.numel) * static_cast<uint64_t>(o.elem_size);
      for (uint64_t b = 0; b < bytes; b += 4096) sink ^= src[b];
      sink ^= src[bytes - 1];
    } else {
      int64_t idx[64] = {0};
      int64_t off = 0;
      for (int64_t i = 0; i < o.numel; ++i) {
        sink ^= src[off * o.elem_size];
        for (int64_t d = o.ndim - 1; d >= 0; --d) {  // the next element in row-major order
          if (++idx[d] < o.sizes[d]) { off += o.strides[d]; break; }
          off -= (o.sizes[d] - 1) * o.strides[d];
          idx[d] = 0;
        }
      }
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    const CpuClose& o = outs[k];
    if (o.numel <= 0 || o.count <= 0) continue;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(o.src);
    auto* values = reinterpret_cast<unsigned char*>(o.values);
    auto* positions = reinterpret_cast<int64_t*>(o.positions);
    const bool everything = o.count >= o.numel;
    uint64_t draws[256];
    for (int64_t i = 0; i < o.count; ++i) {
      uint64_t flat = static_cast<uint64_t>(i);
      if (!everything) {
        if (i % 256 == 0 && !random_bytes(draws, sizeof draws)) return -1;
        flat = draws[i % 256] % static_cast<uint64_t>(o.numel);
        if (positions) positions[i] = static_cast<int64_t>(flat);
      }
      std::memcpy(values + i * o.elem_size, src + offset_of(o, flat) * o.elem_size, static_cast<size_t>(o.elem_size));
    }
    std::memset(draws, 0, sizeof draws);
  }
  (void)sink;
  return 0;
}

}  // extern "C"
