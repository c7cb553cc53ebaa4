// origin: which module each GPU kernel launched in a call came from, through CUPTI's *callback*
// API (no activity tracing, so kernels run as they do untraced). Loaded with ctypes by
// cudagym/sandbox/origin.py, which documents the contract; plain C ABI, built against CUDA's and
// CUPTI's headers only. libcupti and libcuda are opened at install time (the ones already in the
// process when torch loaded them), never linked, so the library builds without a GPU.
//
// Origins are files: a kernel's module is named by the file its image was loaded from, read at
// load time from the image's address (dladdr), never from the kernel's name, so a candidate
// cannot pass torch's kernel off as its own by naming its own kernel like it.
//   - module and library loads (cuModuleLoad*, cuLibraryLoad*: cudart's lazy loading of every
//     registered fatbin goes through them) map CUmodule / CUlibrary -> the file the image lies in
//     ("<memory>" for an image in no file: NVRTC, Triton; the path for a file loaded by name);
//   - runtime launches by host stub (cudaLaunchKernel*) are named by the module of the function
//     the stub launched, never by the stub's own file (a stub of the candidate's can be registered,
//     with __cudaRegisterFunction, for a kernel of torch's fatbin): the function is the one the
//     nested driver launch receives, else the runtime's cudaGetFuncBySymbol(stub) after the
//     launch; its module's origin was learnt when the module or library was loaded. By handle
//     (CUDA 13's __cudaLaunchKernel, a cudaKernel_t) through cuKernelGetLibrary;
//   - driver launches (cuLaunchKernel*) through cuKernelGetLibrary (a CUkernel cast to a
//     CUfunction) or cuFuncGetModule; a driver launch nested in a runtime one is the same launch;
//   - CUDA graphs: each executable graph's kernel nodes (child graphs included) are read when it
//     is instantiated (CUPTI's GRAPHEXEC_CREATED); each launch of it records every node. An
//     executable graph changed after instantiation, or of unknown make, is recorded as such.
// Anything that cannot be named is "<unknown ...>", which no rule counts as the candidate's.

#include <cuda.h>
#include <cupti.h>
#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

// --- driver entry points, resolved at install ------------------------------------------------
struct Driver {
  CUresult (*funcGetModule)(CUmodule*, CUfunction) = nullptr;
  CUresult (*funcGetName)(const char**, CUfunction) = nullptr;
  CUresult (*kernelGetLibrary)(CUlibrary*, CUkernel) = nullptr;
  CUresult (*kernelGetName)(const char**, CUkernel) = nullptr;
  CUresult (*kernelGetFunction)(CUfunction*, CUkernel) = nullptr;
  CUresult (*graphGetNodes)(CUgraph, CUgraphNode*, size_t*) = nullptr;
  CUresult (*graphNodeGetType)(CUgraphNode, CUgraphNodeType*) = nullptr;
  CUresult (*kernelNodeGetParams)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*) = nullptr;
  CUresult (*childGraph)(CUgraphNode, CUgraph*) = nullptr;
  CUresult (*hostNodeGetParams)(CUgraphNode, CUDA_HOST_NODE_PARAMS*) = nullptr;
  CUresult (*libraryGetModule)(CUmodule*, CUlibrary) = nullptr;
  CUresult (*eventCreate)(CUevent*, unsigned int) = nullptr;
  CUresult (*eventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*eventSynchronize)(CUevent) = nullptr;
  CUresult (*eventElapsedTime)(float*, CUevent, CUevent) = nullptr;
} drv;

struct Cupti {
  CUptiResult (*subscribe)(CUpti_SubscriberHandle*, CUpti_CallbackFunc, void*) = nullptr;
  CUptiResult (*enableCallback)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId) = nullptr;
  CUptiResult (*enableDomain)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain) = nullptr;
  CUptiResult (*getCallbackState)(uint32_t*, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId) = nullptr;
} cupti;

CUpti_SubscriberHandle subscriber = nullptr;
std::atomic<int> installed{0};  // 1 once subscribed and enabled

// --- interned strings (names and origins): ids are indices, entries never freed -------------
std::mutex mu;  // guards everything below
std::deque<std::string> strings;
std::unordered_map<std::string, uint32_t> string_ids;

uint32_t intern(const std::string& s) {
  auto it = string_ids.find(s);
  if (it != string_ids.end()) return it->second;
  uint32_t id = static_cast<uint32_t>(strings.size());
  strings.push_back(s);
  string_ids.emplace(s, id);
  return id;
}

uint32_t origin_of_address(const void* p) {
  Dl_info info;
  if (p && dladdr(p, &info) && info.dli_fname && info.dli_fname[0]) return intern(info.dli_fname);
  return intern("<memory>");
}

std::unordered_map<CUmodule, uint32_t> module_origin;
std::unordered_map<CUlibrary, uint32_t> library_origin;
std::unordered_map<const void*, bool> is_stub;  // launch argument -> lies in a mapped file (a host stub)

struct NodeKernel {
  uint32_t name, origin, via;
  uint64_t threads;
};
struct ExecRecord {
  std::vector<NodeKernel> kernels;
};
std::unordered_map<CUgraphExec, ExecRecord> execs;

// records while armed: (via, name, origin) -> launches, threads
struct Tally {
  uint64_t launches = 0, threads = 0, time_ns = 0;
};
std::map<std::tuple<uint32_t, uint32_t, uint32_t>, Tally> records;

// Timing mode (the permissive share's measured call only, never a timed call): an event pair
// around each recorded launch on its stream, read by origin_timing_end.
std::atomic<bool> timing{false};
std::vector<CUevent> event_pool;  // 2 per launch
struct Timed {
  std::tuple<uint32_t, uint32_t, uint32_t> key;
  size_t pair;
};
std::vector<Timed> timed;
thread_local long pending_pair = -1;  // this thread's launch between its ENTER and EXIT
std::tuple<uint32_t, uint32_t, uint32_t> last_key;

std::atomic<bool> armed{false};
std::atomic<uint64_t> state_changes{0};
std::atomic<uint64_t> probe_hits{0};
thread_local bool probing = false;
thread_local int in_runtime_launch = 0;  // a driver launch inside a runtime launch is the same launch
thread_local int in_runtime_graph = 0;

// An armed runtime launch by host stub, between its ENTER and EXIT on this thread: recorded at EXIT,
// by the module of the function it launched (`f`: the nested driver launch's, if one was seen).
struct StubLaunch {
  bool active = false;
  const void* stub = nullptr;
  uint32_t name = 0;
  uint64_t threads = 0;
  CUfunction f = nullptr;
  long timed_index = -1;  // its entry in `timed` (timing mode), keyed at EXIT
};
thread_local StubLaunch stub_launch;

uint32_t V_LAUNCH, V_GRAPH, V_HOST;  // via ids, set at install

uint32_t unknown(const char* what) { return intern(std::string("<unknown ") + what + ">"); }

uint32_t library_origin_of(CUlibrary lib) {
  auto it = library_origin.find(lib);
  return it != library_origin.end() ? it->second : unknown("library");
}

// Origin and name of a CUkernel (a library's kernel); false if `k` is no kernel handle.
bool kernel_info(CUkernel k, uint32_t* origin, uint32_t* name) {
  CUlibrary lib = nullptr;
  if (!drv.kernelGetLibrary || drv.kernelGetLibrary(&lib, k) != CUDA_SUCCESS) return false;
  *origin = library_origin_of(lib);
  const char* n = nullptr;
  *name = intern(drv.kernelGetName && drv.kernelGetName(&n, k) == CUDA_SUCCESS && n ? n : "?");
  return true;
}

// A function of a library's kernel belongs to the library's module in its context: learnt when
// the runtime launches the kernel by handle (`learn_kernel`), else looked up over the libraries.
uint32_t function_origin(CUfunction f) {
  CUmodule m = nullptr;
  if (drv.funcGetModule && drv.funcGetModule(&m, f) == CUDA_SUCCESS) {
    auto it = module_origin.find(m);
    if (it != module_origin.end()) return it->second;
    if (drv.libraryGetModule) {
      for (const auto& [lib, origin] : library_origin) {
        CUmodule lm = nullptr;
        if (drv.libraryGetModule(&lm, lib) == CUDA_SUCCESS && lm) {
          module_origin.emplace(lm, origin);
          if (lm == m) return origin;
        }
      }
    }
  }
  return unknown("module");
}

std::unordered_map<CUkernel, bool> kernels_learnt;

void learn_kernel(CUkernel k, uint32_t origin) {
  if (!kernels_learnt.emplace(k, true).second || !drv.kernelGetFunction || !drv.funcGetModule) return;
  CUfunction f = nullptr;
  CUmodule m = nullptr;
  if (drv.kernelGetFunction(&f, k) == CUDA_SUCCESS && f && drv.funcGetModule(&m, f) == CUDA_SUCCESS && m) {
    module_origin.emplace(m, origin);
  }
}

uint32_t function_name(CUfunction f, const char* symbol) {
  if (symbol && symbol[0]) return intern(symbol);
  const char* n = nullptr;
  return intern(drv.funcGetName && drv.funcGetName(&n, f) == CUDA_SUCCESS && n ? n : "?");
}

void tally(uint32_t via, uint32_t name, uint32_t origin, uint64_t threads) {
  Tally& t = records[{via, name, origin}];
  t.launches += 1;
  t.threads += threads;
  last_key = {via, name, origin};
}

// Timing mode: the start event of the launch just tallied (`last_key`), on its stream. Returns its
// index in `timed` (-1 if untimed), whose key a stub launch sets at its EXIT.
long time_start(CUstream stream) {
  if (!timing.load(std::memory_order_relaxed)) return -1;
  size_t pair = timed.size();
  if (2 * pair + 1 >= event_pool.size()) return -1;  // more launches than events: left untimed
  if (drv.eventRecord(event_pool[2 * pair], stream) != CUDA_SUCCESS) return -1;
  timed.push_back({last_key, pair});
  pending_pair = static_cast<long>(pair);
  return static_cast<long>(timed.size() - 1);
}

void time_end(CUstream stream) {
  if (pending_pair < 0) return;
  drv.eventRecord(event_pool[2 * pending_pair + 1], stream);
  pending_pair = -1;
}

CUstream stream_of(cudaStream_t s, bool per_thread) {
  return (!s && per_thread) ? CU_STREAM_PER_THREAD : reinterpret_cast<CUstream>(s);
}

uint64_t threads_of(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
  return uint64_t(gx) * gy * gz * uint64_t(bx) * by * bz;
}

// A CUfunction handed to a driver launch may be a CUkernel cast to it (CUDA 12+).
void driver_launch(CUfunction f, const char* symbol, uint64_t threads) {
  uint32_t origin, name;
  if (!kernel_info(reinterpret_cast<CUkernel>(f), &origin, &name)) {
    origin = function_origin(f);
    name = function_name(f, symbol);
  } else if (symbol && symbol[0]) {
    name = intern(symbol);
  }
  tally(V_LAUNCH, name, origin, threads);
}

void read_graph(CUgraph g, std::vector<NodeKernel>* out, int depth) {
  if (!drv.graphGetNodes || !drv.graphNodeGetType) {
    out->push_back({unknown("graph"), unknown("graph"), V_GRAPH, 0});
    return;
  }
  size_t n = 0;
  if (drv.graphGetNodes(g, nullptr, &n) != CUDA_SUCCESS) {
    out->push_back({unknown("graph"), unknown("graph"), V_GRAPH, 0});
    return;
  }
  std::vector<CUgraphNode> nodes(n);
  if (n && drv.graphGetNodes(g, nodes.data(), &n) != CUDA_SUCCESS) {
    out->push_back({unknown("graph"), unknown("graph"), V_GRAPH, 0});
    return;
  }
  for (CUgraphNode node : nodes) {
    CUgraphNodeType type;
    if (drv.graphNodeGetType(node, &type) != CUDA_SUCCESS) {
      out->push_back({unknown("graph node"), unknown("graph node"), V_GRAPH, 0});
      continue;
    }
    switch (type) {
      case CU_GRAPH_NODE_TYPE_KERNEL: {
        CUDA_KERNEL_NODE_PARAMS p;
        std::memset(&p, 0, sizeof p);
        if (!drv.kernelNodeGetParams || drv.kernelNodeGetParams(node, &p) != CUDA_SUCCESS) {
          out->push_back({unknown("kernel node"), unknown("kernel node"), V_GRAPH, 0});
          break;
        }
        uint32_t origin, name;
        if (p.func) {
          if (!kernel_info(reinterpret_cast<CUkernel>(p.func), &origin, &name)) {
            origin = function_origin(p.func);
            name = function_name(p.func, nullptr);
          }
        } else if (!p.kern || !kernel_info(p.kern, &origin, &name)) {
          origin = name = unknown("kernel node");
        }
        out->push_back({name, origin, V_GRAPH,
                        threads_of(p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ)});
        break;
      }
      case CU_GRAPH_NODE_TYPE_GRAPH: {
        CUgraph child = nullptr;
        if (depth < 8 && drv.childGraph && drv.childGraph(node, &child) == CUDA_SUCCESS && child) {
          read_graph(child, out, depth + 1);
        } else {
          out->push_back({unknown("child graph"), unknown("child graph"), V_GRAPH, 0});
        }
        break;
      }
      case CU_GRAPH_NODE_TYPE_HOST: {  // host code the driver runs: named by its function's file
        CUDA_HOST_NODE_PARAMS p;
        std::memset(&p, 0, sizeof p);
        uint32_t origin = drv.hostNodeGetParams && drv.hostNodeGetParams(node, &p) == CUDA_SUCCESS
                              ? origin_of_address(reinterpret_cast<const void*>(p.fn))
                              : unknown("host node");
        out->push_back({intern("<host function node>"), origin, V_HOST, 0});
        break;
      }
      case CU_GRAPH_NODE_TYPE_MEMCPY:
      case CU_GRAPH_NODE_TYPE_MEMSET:
      case CU_GRAPH_NODE_TYPE_EMPTY:
      case CU_GRAPH_NODE_TYPE_WAIT_EVENT:
      case CU_GRAPH_NODE_TYPE_EVENT_RECORD:
      case CU_GRAPH_NODE_TYPE_MEM_ALLOC:
      case CU_GRAPH_NODE_TYPE_MEM_FREE:
        break;  // copies, fills, ordering and memory: no code of anyone's
      default:  // conditional bodies, memops, semaphores, device launches: not read
        out->push_back({intern("<graph node of type " + std::to_string(int(type)) + ">"),
                        unknown("graph node"), V_GRAPH, 0});
    }
  }
}

void graph_launch(CUgraphExec exec) {
  auto it = execs.find(exec);
  if (it == execs.end()) {
    tally(V_GRAPH, unknown("graph"), unknown("graph"), 0);
    return;
  }
  uint32_t origin = UINT32_MAX;
  for (const NodeKernel& k : it->second.kernels) {
    tally(k.via, k.name, k.origin, k.threads);
    origin = (origin == UINT32_MAX || origin == k.origin) ? k.origin : intern("<mixed>");
  }
  last_key = {V_GRAPH, intern("<graph launch>"), origin == UINT32_MAX ? intern("<empty graph>") : origin};
  records[last_key].launches += 1;
}

void taint(CUgraphExec exec) {
  execs[exec].kernels.assign(1, {intern("<graph changed after instantiation>"), unknown("graph"), V_GRAPH, 0});
}

bool is_unknown(uint32_t id) { return strings[id].rfind("<unknown", 0) == 0; }

// The origin of a function a driver launch received: its library (a CUkernel cast to a
// CUfunction) or its module, as learnt when they were loaded.
uint32_t launched_function_origin(CUfunction f) {
  uint32_t origin, name;
  if (kernel_info(reinterpret_cast<CUkernel>(f), &origin, &name)) return origin;
  return function_origin(f);
}

// The runtime's function for a host stub: cudaGetFuncBySymbol of every CUDA runtime in the
// process (called after the launch, outside the lock: the module is loaded by then). Runtimes are
// found by their mapped files (`libcudart`); looked for again when none knows the stub.
using GetFuncBySymbol = int (*)(void**, const void*);
std::mutex cudart_mu;
std::vector<GetFuncBySymbol> cudarts;

int add_cudart(struct dl_phdr_info* info, size_t, void* out) {
  if (!info->dlpi_name || !std::strstr(info->dlpi_name, "libcudart")) return 0;
  void* h = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
  if (!h) return 0;
  auto fn = reinterpret_cast<GetFuncBySymbol>(dlsym(h, "cudaGetFuncBySymbol"));
  auto* v = static_cast<std::vector<GetFuncBySymbol>*>(out);
  if (fn && std::find(v->begin(), v->end(), fn) == v->end()) v->push_back(fn);
  return 0;  // the handle stays open: the runtime is in use
}

CUfunction function_by_symbol(const void* stub) {
  std::vector<GetFuncBySymbol> fns;
  {
    std::lock_guard<std::mutex> lock(cudart_mu);
    fns = cudarts;
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (GetFuncBySymbol fn : fns) {
      void* f = nullptr;
      if (fn(&f, stub) == 0 && f) return static_cast<CUfunction>(f);
    }
    if (pass == 0) {
      std::vector<GetFuncBySymbol> found;
      dl_iterate_phdr(add_cudart, &found);
      std::lock_guard<std::mutex> lock(cudart_mu);
      for (GetFuncBySymbol fn : found)
        if (std::find(cudarts.begin(), cudarts.end(), fn) == cudarts.end()) cudarts.push_back(fn);
      if (cudarts.size() == fns.size()) break;
      fns = cudarts;
    }
  }
  return nullptr;
}

// Whether a runtime launch's argument is a host stub (code in a mapped file) rather than a
// cudaKernel_t handle (driver memory).
bool stub_address(const void* func) {
  auto it = is_stub.find(func);
  if (it != is_stub.end()) return it->second;
  Dl_info info;
  bool stub = func && dladdr(func, &info) && info.dli_fname && info.dli_fname[0];
  is_stub.emplace(func, stub);
  return stub;
}

// Runtime launch (armed) by a cudaKernel_t handle (CUDA 13's __cudaLaunchKernel, or one passed to
// cudaLaunchKernel*): recorded at once. By host stub: begun here, recorded at EXIT (`end_stub_launch`).
// Returns whether a launch was recorded or begun (then timed in timing mode).
bool runtime_launch(const void* func, bool is_handle, const char* symbol, uint64_t threads) {
  if (!armed.load(std::memory_order_relaxed)) return false;
  uint32_t origin, name;
  if (!is_handle && stub_address(func)) {
    if (stub_launch.active) {  // a stub launch begun inside another's callbacks: not expected
      tally(V_LAUNCH, intern(symbol && symbol[0] ? symbol : "?"), unknown("nested stub launch"), threads);
      return true;
    }
    stub_launch = StubLaunch{true, func, intern(symbol && symbol[0] ? symbol : "?"), threads, nullptr, -1};
    last_key = {V_LAUNCH, stub_launch.name, unknown("stub module")};
    return true;
  }
  auto k = reinterpret_cast<CUkernel>(const_cast<void*>(func));
  if (kernel_info(k, &origin, &name)) learn_kernel(k, origin);
  else origin = name = unknown("kernel");
  if (symbol && symbol[0]) name = intern(symbol);
  tally(V_LAUNCH, name, origin, threads);
  return true;
}

// EXIT of a runtime launch: a stub launch begun at ENTER is recorded under its function's module.
// Called without the lock.
void end_stub_launch() {
  if (!stub_launch.active) return;
  StubLaunch s = stub_launch;
  stub_launch = StubLaunch{};
  std::unique_lock<std::mutex> lock(mu);
  uint32_t origin = s.f ? launched_function_origin(s.f) : unknown("stub module");
  if (is_unknown(origin)) {
    lock.unlock();
    CUfunction f = function_by_symbol(s.stub);
    lock.lock();
    if (f) {
      uint32_t o = launched_function_origin(f);
      if (!is_unknown(o) || !s.f) origin = o;
    }
  }
  tally(V_LAUNCH, s.name, origin, s.threads);
  if (s.timed_index >= 0 && size_t(s.timed_index) < timed.size()) timed[s.timed_index].key = last_key;
}

// Disarmed (most launches of a worker's life): nothing is recorded, and the lock is not taken; a
// kernel launched by handle is learnt once per thread (its module's origin, which a graph's
// kernel nodes are named by).
bool disarmed(const void* func, bool is_handle) {
  if (armed.load(std::memory_order_relaxed)) return false;
  if (is_handle) {
    thread_local std::unordered_map<const void*, bool> seen;
    if (seen.emplace(func, true).second) {
      std::lock_guard<std::mutex> lock(mu);
      uint32_t origin, name;
      auto k = reinterpret_cast<CUkernel>(const_cast<void*>(func));
      if (kernel_info(k, &origin, &name)) learn_kernel(k, origin);
    }
  }
  return true;
}

// Matches the signature of CUDA 13's __cudaLaunchKernel (what <<<>>> compiles to), whose
// parameter struct the CUPTI headers do not declare.
struct RtLaunchByHandle {
  void* kernel;
  dim3 gridDim;
  dim3 blockDim;
  void** args;
  size_t sharedMem;
  cudaStream_t stream;
};

void CUPTIAPI on_callback(void*, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  if (domain == CUPTI_CB_DOMAIN_RESOURCE) {
    const auto* rd = static_cast<const CUpti_ResourceData*>(data);
    if (cbid == CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED) {
      const auto* g = static_cast<const CUpti_GraphData*>(rd->resourceDescriptor);
      if (!g || !g->graphExec) return;
      std::lock_guard<std::mutex> lock(mu);
      ExecRecord rec;
      if (g->graph) read_graph(g->graph, &rec.kernels, 0);
      else rec.kernels.push_back({unknown("graph"), unknown("graph"), V_GRAPH, 0});
      execs[g->graphExec] = std::move(rec);
    } else if (cbid == CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING) {
      const auto* g = static_cast<const CUpti_GraphData*>(rd->resourceDescriptor);
      if (!g || !g->graphExec) return;
      std::lock_guard<std::mutex> lock(mu);
      execs.erase(g->graphExec);
    }
    return;
  }
  const auto* cb = static_cast<const CUpti_CallbackData*>(data);
  const bool enter = cb->callbackSite == CUPTI_API_ENTER;
  if (domain == CUPTI_CB_DOMAIN_RUNTIME_API) {
    switch (cbid) {
      case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000:
      case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000:
      case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000:
      case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000: {
        const auto* p = static_cast<const cudaLaunchKernel_v7000_params*>(cb->functionParams);
        const bool pt = cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000 ||
                        cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000;
        if (!enter) { --in_runtime_launch; time_end(stream_of(p->stream, pt)); end_stub_launch(); return; }
        ++in_runtime_launch;
        if (probing) { probe_hits.fetch_add(1); return; }
        if (disarmed(p->func, false)) return;
        std::lock_guard<std::mutex> lock(mu);
        if (runtime_launch(p->func, false, cb->symbolName,
                           threads_of(p->gridDim.x, p->gridDim.y, p->gridDim.z, p->blockDim.x, p->blockDim.y, p->blockDim.z))) {
          long i = time_start(stream_of(p->stream, pt));
          if (stub_launch.active) stub_launch.timed_index = i;
        }
        return;
      }
      case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060:
      case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060: {
        const auto* p = static_cast<const cudaLaunchKernelExC_v11060_params*>(cb->functionParams);
        const cudaLaunchConfig_t* c = p->config;
        const bool pt = cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060;
        if (!enter) {
          --in_runtime_launch;
          time_end(stream_of(c ? c->stream : nullptr, pt));
          end_stub_launch();
          return;
        }
        ++in_runtime_launch;
        if (probing) { probe_hits.fetch_add(1); return; }
        if (disarmed(p->func, false)) return;
        std::lock_guard<std::mutex> lock(mu);
        if (runtime_launch(p->func, false, cb->symbolName,
                           c ? threads_of(c->gridDim.x, c->gridDim.y, c->gridDim.z, c->blockDim.x, c->blockDim.y, c->blockDim.z) : 0)) {
          long i = time_start(stream_of(c ? c->stream : nullptr, pt));
          if (stub_launch.active) stub_launch.timed_index = i;
        }
        return;
      }
      case CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000:
      case CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000: {
        const auto* p = static_cast<const RtLaunchByHandle*>(cb->functionParams);
        const bool pt = cbid == CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000;
        if (!enter) { --in_runtime_launch; time_end(stream_of(p->stream, pt)); return; }
        ++in_runtime_launch;
        if (probing) { probe_hits.fetch_add(1); return; }
        if (disarmed(p->kernel, true)) return;
        std::lock_guard<std::mutex> lock(mu);
        if (runtime_launch(p->kernel, true, cb->symbolName,
                           threads_of(p->gridDim.x, p->gridDim.y, p->gridDim.z, p->blockDim.x, p->blockDim.y, p->blockDim.z)))
          time_start(stream_of(p->stream, pt));
        return;
      }
      case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000:
      case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000: {
        const auto* p = static_cast<const cudaGraphLaunch_v10000_params*>(cb->functionParams);
        const bool pt = cbid == CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000;
        if (!enter) { --in_runtime_graph; time_end(stream_of(p->stream, pt)); return; }
        ++in_runtime_graph;
        if (!armed.load(std::memory_order_relaxed)) return;
        std::lock_guard<std::mutex> lock(mu);
        graph_launch(reinterpret_cast<CUgraphExec>(p->graphExec));
        time_start(stream_of(p->stream, pt));
        return;
      }
      case CUPTI_RUNTIME_TRACE_CBID_cudaGraphExecKernelNodeSetParams_v10010:
      case CUPTI_RUNTIME_TRACE_CBID_cudaGraphExecUpdate_v10020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaGraphExecNodeSetParams_v12020: {
        if (enter) return;  // the first parameter of each is the executable graph
        auto exec = *static_cast<CUgraphExec const*>(cb->functionParams);
        std::lock_guard<std::mutex> lock(mu);
        taint(exec);
        return;
      }
      default:
        return;
    }
  }
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API) return;
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz: {
      const auto* p = static_cast<const cuLaunchKernel_params*>(cb->functionParams);
      if (in_runtime_launch) {  // the runtime launch's own: the function a stub launch launched
        if (enter && stub_launch.active && !stub_launch.f) stub_launch.f = p->f;
        return;
      }
      if (!enter) { time_end(p->hStream); return; }
      if (probing) { probe_hits.fetch_add(1); return; }
      if (!armed.load(std::memory_order_relaxed)) return;
      std::lock_guard<std::mutex> lock(mu);
      driver_launch(p->f, cb->symbolName,
                    threads_of(p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ));
      time_start(p->hStream);
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz: {
      const auto* p = static_cast<const cuLaunchKernelEx_params*>(cb->functionParams);
      const CUlaunchConfig* c = p->config;
      if (in_runtime_launch) {
        if (enter && stub_launch.active && !stub_launch.f) stub_launch.f = p->f;
        return;
      }
      if (!enter) { time_end(c ? c->hStream : nullptr); return; }
      if (probing) { probe_hits.fetch_add(1); return; }
      if (!armed.load(std::memory_order_relaxed)) return;
      std::lock_guard<std::mutex> lock(mu);
      driver_launch(p->f, cb->symbolName,
                    c ? threads_of(c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ) : 0);
      time_start(c ? c->hStream : nullptr);
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz: {
      const auto* p = static_cast<const cuGraphLaunch_params*>(cb->functionParams);
      if (in_runtime_graph) return;
      if (!enter) { time_end(p->hStream); return; }
      if (!armed.load(std::memory_order_relaxed)) return;
      std::lock_guard<std::mutex> lock(mu);
      graph_launch(p->hGraph);
      time_start(p->hStream);
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuGraphExecKernelNodeSetParams:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphExecKernelNodeSetParams_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphExecUpdate:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphExecUpdate_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphExecNodeSetParams: {
      if (enter) return;
      auto exec = *static_cast<CUgraphExec const*>(cb->functionParams);
      std::lock_guard<std::mutex> lock(mu);
      taint(exec);
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuModuleLoad: {
      if (enter || cb->callbackSite != CUPTI_API_EXIT) return;
      const auto* p = static_cast<const cuModuleLoad_params*>(cb->functionParams);
      if (!p->module || !*p->module) return;
      std::lock_guard<std::mutex> lock(mu);
      module_origin[*p->module] = intern(p->fname ? p->fname : "<unknown file>");
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData:
    case CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx:
    case CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary: {
      if (enter) return;  // the first two fields of each: CUmodule* and the image
      const auto* p = static_cast<const cuModuleLoadData_params*>(cb->functionParams);
      if (!p->module || !*p->module) return;
      std::lock_guard<std::mutex> lock(mu);
      module_origin[*p->module] = origin_of_address(p->image);
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadData: {
      if (enter) return;
      const auto* p = static_cast<const cuLibraryLoadData_params*>(cb->functionParams);
      if (!p->library || !*p->library) return;
      std::lock_guard<std::mutex> lock(mu);
      library_origin[*p->library] = origin_of_address(p->code);
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadFromFile: {
      if (enter) return;
      const auto* p = static_cast<const cuLibraryLoadFromFile_params*>(cb->functionParams);
      if (!p->library || !*p->library) return;
      std::lock_guard<std::mutex> lock(mu);
      library_origin[*p->library] = intern(p->fileName ? p->fileName : "<unknown file>");
      return;
    }
    default:
      return;
  }
}

const CUpti_CallbackId kRuntime[] = {
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060,
    CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000,
    CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphExecKernelNodeSetParams_v10010,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphExecUpdate_v10020,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphExecNodeSetParams_v12020,
};
const CUpti_CallbackId kDriver[] = {
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuGraphExecKernelNodeSetParams,
    CUPTI_DRIVER_TRACE_CBID_cuGraphExecKernelNodeSetParams_v2,
    CUPTI_DRIVER_TRACE_CBID_cuGraphExecUpdate,
    CUPTI_DRIVER_TRACE_CBID_cuGraphExecUpdate_v2,
    CUPTI_DRIVER_TRACE_CBID_cuGraphExecNodeSetParams,
    CUPTI_DRIVER_TRACE_CBID_cuModuleLoad,
    CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData,
    CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx,
    CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary,
    CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadData,
    CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadFromFile,
};
const CUpti_CallbackId kResource[] = {
    CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED,
    CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING,
};

template <typename T>
void resolve(void* lib, T* fn, const char* name) {
  *fn = reinterpret_cast<T>(dlsym(lib, name));
}

int enabled_everywhere() {
  uint32_t on = 0;
  for (auto id : kRuntime)
    if (cupti.getCallbackState(&on, subscriber, CUPTI_CB_DOMAIN_RUNTIME_API, id) != CUPTI_SUCCESS || !on) return 0;
  for (auto id : kDriver)
    if (cupti.getCallbackState(&on, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, id) != CUPTI_SUCCESS || !on) return 0;
  for (auto id : kResource)
    if (cupti.getCallbackState(&on, subscriber, CUPTI_CB_DOMAIN_RESOURCE, id) != CUPTI_SUCCESS || !on) return 0;
  return 1;
}

}  // namespace

extern "C" {

// Opens libcupti (`cupti_path`) and libcuda, subscribes and enables the callbacks. Once per
// process. Returns 0; -1 libcupti cannot be opened, -2 libcuda cannot, -3 a CUPTI or driver
// function is missing, or the CUPTI result code (+1000) of a refused subscription (1039: another
// CUPTI subscriber, such as Nsight Compute or the CUDA profiler, holds the process).
int origin_install(const char* cupti_path) {
  static std::once_flag once;
  static int result = 0;
  std::call_once(once, [cupti_path] {
    void* lc = dlopen(cupti_path, RTLD_NOW | RTLD_GLOBAL);
    if (!lc) { result = -1; return; }
    void* ld = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!ld) { result = -2; return; }
    resolve(lc, &cupti.subscribe, "cuptiSubscribe");
    resolve(lc, &cupti.enableCallback, "cuptiEnableCallback");
    resolve(lc, &cupti.enableDomain, "cuptiEnableDomain");
    resolve(lc, &cupti.getCallbackState, "cuptiGetCallbackState");
    resolve(ld, &drv.funcGetModule, "cuFuncGetModule");
    resolve(ld, &drv.funcGetName, "cuFuncGetName");
    resolve(ld, &drv.kernelGetLibrary, "cuKernelGetLibrary");
    resolve(ld, &drv.kernelGetName, "cuKernelGetName");
    resolve(ld, &drv.kernelGetFunction, "cuKernelGetFunction");
    resolve(ld, &drv.graphGetNodes, "cuGraphGetNodes");
    resolve(ld, &drv.graphNodeGetType, "cuGraphNodeGetType");
    resolve(ld, &drv.kernelNodeGetParams, "cuGraphKernelNodeGetParams_v2");
    resolve(ld, &drv.childGraph, "cuGraphChildGraphNodeGetGraph");
    resolve(ld, &drv.hostNodeGetParams, "cuGraphHostNodeGetParams");
    resolve(ld, &drv.libraryGetModule, "cuLibraryGetModule");
    resolve(ld, &drv.eventCreate, "cuEventCreate");
    resolve(ld, &drv.eventRecord, "cuEventRecord");
    resolve(ld, &drv.eventSynchronize, "cuEventSynchronize");
    resolve(ld, &drv.eventElapsedTime, "cuEventElapsedTime");
    if (!cupti.subscribe || !cupti.enableCallback || !cupti.getCallbackState || !drv.funcGetModule ||
        !drv.graphGetNodes) {
      result = -3;
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      V_LAUNCH = intern("launch");
      V_GRAPH = intern("graph");
      V_HOST = intern("host");
    }
    CUptiResult r = cupti.subscribe(&subscriber, on_callback, nullptr);
    if (r != CUPTI_SUCCESS) { result = 1000 + int(r); return; }
    for (auto id : kRuntime) cupti.enableCallback(1, subscriber, CUPTI_CB_DOMAIN_RUNTIME_API, id);
    for (auto id : kDriver) cupti.enableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, id);
    for (auto id : kResource) cupti.enableCallback(1, subscriber, CUPTI_CB_DOMAIN_RESOURCE, id);
    installed = 1;
  });
  return result;
}

void origin_arm() { state_changes.fetch_add(1); armed.store(true); }
void origin_disarm() { state_changes.fetch_add(1); armed.store(false); }
void origin_reset() {
  state_changes.fetch_add(1);
  std::lock_guard<std::mutex> lock(mu);
  records.clear();
}
uint64_t origin_state_changes() { return state_changes.load(); }

// "via\tname\torigin\tlaunches\tthreads\ttime_ns\n" (time_ns: timing mode only) for every (via, kernel, origin) recorded since the
// last reset, NUL-terminated, as far as cap allows; returns the whole text's length (call again
// with a larger buffer when it is >= cap).
size_t origin_dump(char* buf, size_t cap) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [key, t] : records) {
      const auto& [via, name, origin] = key;
      std::string n = strings[name];
      for (char& c : n) if (c == '\t' || c == '\n') c = ' ';
      text += strings[via] + '\t' + n + '\t' + strings[origin] + '\t' + std::to_string(t.launches) + '\t' +
              std::to_string(t.threads) + '\t' + std::to_string(t.time_ns) + '\n';
    }
  }
  if (cap > 0) {
    size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

// Timing mode, for one measured call on the calling thread: begin creates (once) `max_launches`
// event pairs; end waits for the last event and adds each timed launch's GPU time to its record.
// Returns the launches timed, or -1 if an event could not be created or read.
long origin_timing_begin(long max_launches) {
  std::lock_guard<std::mutex> lock(mu);
  while (event_pool.size() < size_t(2 * max_launches)) {
    CUevent e = nullptr;
    if (drv.eventCreate(&e, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return -1;
    event_pool.push_back(e);
  }
  timed.clear();
  timing.store(true);
  return 0;
}

long origin_timing_end() {
  timing.store(false);
  std::lock_guard<std::mutex> lock(mu);
  long n = 0;
  for (const Timed& t : timed) {
    float ms = 0.f;
    if (drv.eventSynchronize(event_pool[2 * t.pair + 1]) != CUDA_SUCCESS ||
        drv.eventElapsedTime(&ms, event_pool[2 * t.pair], event_pool[2 * t.pair + 1]) != CUDA_SUCCESS) {
      return -1;
    }
    records[t.key].time_ns += uint64_t(double(ms) * 1e6);
    ++n;
  }
  timed.clear();
  return n;
}

// Probe: between begin and end, launches on this thread are counted apart (not recorded).
void origin_probe_begin() { probing = true; probe_hits = 0; }
uint64_t origin_probe_end() { probing = false; return probe_hits.load(); }

// 0 while installed with every callback enabled; 1 never installed; 2 a callback was disabled.
int origin_alive() {
  if (!installed.load()) return 1;
  return enabled_everywhere() ? 0 : 2;
}

// Diagnostics: how many modules and libraries have a known origin, and executable graphs read.
size_t origin_known(char* buf, size_t cap) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [m, o] : module_origin) text += "module\t" + strings[o] + '\n';
    for (const auto& [l, o] : library_origin) text += "library\t" + strings[o] + '\n';
    text += "graphs\t" + std::to_string(execs.size()) + '\n';
  }
  if (cap > 0) {
    size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

}  // extern "C"
