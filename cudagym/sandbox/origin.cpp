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
//     registered fatbin goes through them) map CUmodule / CUlibrary -> the file the image lies in,
//     if it lies in that file's read-only bytes and was never written (`image_origin`); else
//     "<memory:DIGEST>" (NVRTC, Triton, a copy in a library's writable data), "<memory>" where the
//     image's extent cannot be read; the path for a file loaded by name;
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
#include <fcntl.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
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

// --- in-memory images: digest, and whether a file really holds them -------------------------
// A module image lying in a file's read-only, file-backed bytes is named by that file; anything
// else is "<memory:DIGEST>" (DIGEST: the first 128 bits of the SHA-256 of the image's bytes, the
// extent read from its header), which `cudagym.sandbox.jit` can match against a JIT cache's files.
// "In a file" is checked three ways, since a candidate can copy a foreign image into its own
// library's memory: the address lies in a PT_LOAD segment of a loaded object (dl_iterate_phdr),
// within the segment's file bytes (not its .bss), in a segment without PF_W (nvcc's .nv_fatbin
// lies in a read-only one: its writable .data/.bss are where a copy would go), and no page of the
// image was ever written (a page written after mprotect is anonymous in /proc/self/pagemap).

struct Sha256 {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  unsigned char block[64];
  size_t used = 0;
  uint64_t bytes = 0;

  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void compress(const unsigned char* p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 | uint32_t(p[4 * i + 2]) << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
  }

  void update(const unsigned char* p, size_t n) {
    bytes += n;
    if (used) {
      size_t take = std::min(n, sizeof block - used);
      std::memcpy(block + used, p, take);
      used += take; p += take; n -= take;
      if (used < sizeof block) return;
      compress(block);
      used = 0;
    }
    for (; n >= 64; p += 64, n -= 64) compress(p);
    std::memcpy(block, p, n);
    used = n;
  }

  std::string hex(size_t nbytes) {  // the first `nbytes` of the digest, in hex
    const uint64_t bits = bytes * 8;
    const unsigned char one = 0x80, zero = 0;
    update(&one, 1);
    while (used != 56) update(&zero, 1);
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(len, 8);
    static const char digits[] = "0123456789abcdef";
    std::string out;
    for (size_t i = 0; i < nbytes && i < 32; ++i) {
      unsigned char byte = static_cast<unsigned char>(h[i / 4] >> (24 - 8 * (i % 4)));
      out += digits[byte >> 4];
      out += digits[byte & 15];
    }
    return out;
  }
};

constexpr uint32_t kFatbinMagic = 0xBA55ED50u;         // a fatbin's header
constexpr uint32_t kFatbinWrapperMagic = 0x466243B1u;  // nvcc's __fatBinC_Wrapper_t, pointing at one
constexpr uint64_t kMaxImage = uint64_t(1) << 32;

struct Image {
  const unsigned char* data = nullptr;
  uint64_t size = 0;  // 0: not known
};

template <typename T>
T read_at(const unsigned char* p, uint64_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof v);
  return v;
}

// An ELF image's extent: the furthest of its header, header tables, sections and segments.
uint64_t elf_extent(const unsigned char* p) {
  if (p[4] != 2) return 0;  // ELFCLASS64 only (every CUDA cubin)
  const uint64_t phoff = read_at<uint64_t>(p, 0x20), shoff = read_at<uint64_t>(p, 0x28);
  const uint16_t phentsize = read_at<uint16_t>(p, 0x36), phnum = read_at<uint16_t>(p, 0x38);
  const uint16_t shentsize = read_at<uint16_t>(p, 0x3a), shnum = read_at<uint16_t>(p, 0x3c);
  if ((phnum && phentsize < 0x38) || (shnum && shentsize < 0x40) || phoff > kMaxImage || shoff > kMaxImage) return 0;
  uint64_t end = std::max<uint64_t>({0x40, phoff + uint64_t(phnum) * phentsize, shoff + uint64_t(shnum) * shentsize});
  for (uint16_t i = 0; i < shnum; ++i) {
    const uint64_t s = shoff + uint64_t(i) * shentsize;
    if (read_at<uint32_t>(p, s + 4) != 8 /* SHT_NOBITS */)
      end = std::max(end, read_at<uint64_t>(p, s + 0x18) + read_at<uint64_t>(p, s + 0x20));
  }
  for (uint16_t i = 0; i < phnum; ++i) {
    const uint64_t s = phoff + uint64_t(i) * phentsize;
    end = std::max(end, read_at<uint64_t>(p, s + 8) + read_at<uint64_t>(p, s + 0x20));
  }
  return end <= kMaxImage ? end : 0;
}

// The bytes a load call was given: a fatbin wrapper is followed to its fatbin; the extent is read
// from the image's header (ELF, fatbin), else it is NUL-terminated text (PTX).
Image resolve_image(const void* image) {
  Image im;
  const auto* p = static_cast<const unsigned char*>(image);
  if (!p) return im;
  if (read_at<uint32_t>(p, 0) == kFatbinWrapperMagic) {
    p = read_at<const unsigned char*>(p, 8);
    if (!p) return im;
  }
  im.data = p;
  if (std::memcmp(p, "\x7f" "ELF", 4) == 0) {
    im.size = elf_extent(p);
  } else if (read_at<uint32_t>(p, 0) == kFatbinMagic) {
    const uint64_t size = uint64_t(read_at<uint16_t>(p, 6)) + read_at<uint64_t>(p, 8);
    im.size = size <= kMaxImage ? size : 0;
  } else {
    im.size = strnlen(reinterpret_cast<const char*>(p), size_t(kMaxImage)) + 1;
  }
  return im;
}

struct SegmentQuery {
  uintptr_t begin, end;
  bool found = false, file_backed = false;
};

int find_segment(struct dl_phdr_info* info, size_t, void* arg) {
  auto* q = static_cast<SegmentQuery*>(arg);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (q->begin < start || q->begin >= start + ph.p_memsz) continue;
    q->found = true;
    q->file_backed = q->end <= start + ph.p_filesz && !(ph.p_flags & PF_W);
    return 1;
  }
  return 0;
}

// Whether no page of [begin, end) was ever written in this process: each is untouched or still
// the file's page (/proc/self/pagemap: bit 63 present, 62 swapped, 61 file page). Where the
// kernel offers no pagemap at all the check is skipped (the segment check stands alone); any
// other failure to read it (no descriptor left, say) counts as written.
bool pages_unwritten(uintptr_t begin, uintptr_t end) {
  const long page = sysconf(_SC_PAGESIZE);
  int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == EACCES || errno == EPERM;
  bool clean = true;
  uint64_t entries[512];
  for (uintptr_t first = begin / page, last = (end - 1) / page; clean && first <= last;) {
    const size_t n = std::min<uintptr_t>(512, last - first + 1);
    const ssize_t got = pread(fd, entries, n * sizeof(uint64_t), off_t(first * sizeof(uint64_t)));
    if (got != ssize_t(n * sizeof(uint64_t))) { clean = false; break; }
    for (size_t i = 0; i < n; ++i) {
      const uint64_t e = entries[i];
      if ((e >> 62) & 1 || (((e >> 63) & 1) && !((e >> 61) & 1))) { clean = false; break; }
    }
    first += n;
  }
  close(fd);
  return clean;
}

// The origin of a module image given to a load call (computed before the lock is taken: dladdr
// and dl_iterate_phdr take the loader's locks).
std::string image_origin(const void* image) {
  const Image im = resolve_image(image);
  if (!im.data || !im.size) return "<memory>";
  const uintptr_t begin = reinterpret_cast<uintptr_t>(im.data), end = begin + im.size;
  Dl_info info;
  if (dladdr(im.data, &info) && info.dli_fname && info.dli_fname[0]) {
    SegmentQuery q{begin, end};
    dl_iterate_phdr(find_segment, &q);
    if (q.found && q.file_backed && pages_unwritten(begin, end)) return info.dli_fname;
  }
  Sha256 sha;
  sha.update(im.data, im.size);
  return "<memory:" + sha.hex(16) + ">";
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
      const std::string origin = image_origin(p->image);
      std::lock_guard<std::mutex> lock(mu);
      module_origin[*p->module] = intern(origin);
      return;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadData: {
      if (enter) return;
      const auto* p = static_cast<const cuLibraryLoadData_params*>(cb->functionParams);
      if (!p->library || !*p->library) return;
      const std::string origin = image_origin(p->code);
      std::lock_guard<std::mutex> lock(mu);
      library_origin[*p->library] = intern(origin);
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

// The origin a module or library load of `image` would record now (`image_origin`), into buf as
// far as cap allows; returns its length. Needs no install: tests call it without a GPU.
size_t origin_image_origin(const void* image, char* buf, size_t cap) {
  const std::string text = image_origin(image);
  if (cap > 0) {
    size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
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
