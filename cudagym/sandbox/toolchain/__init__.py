"""Compiling a workspace's kernels into one artifact directory.

`Toolchain(cache_dir, config).build(workspace, target)` compiles every source under `kernels/`
into an object, links the objects, and returns a `CompileResult` whose `artifact_dir` holds
either `libkernels.so` (sources with `extern "C"` launchers, called through ctypes) or the torch
extension `kernel_ext<EXT_SUFFIX>` (when a `kernels/*_binding.cpp` exists). See
`cudagym.runtime` for how a candidate reaches them.

Flags (one place: `Toolchain._plan`):

- C++ (``.cpp .cc .c``): ``g++ -O3 -std=c++17 -fPIC -fopenmp -march=native -Ikernels``;
- CUDA (``.cu``, CUDA target only): ``nvcc -O3 -std=c++17 -Xcompiler -fPIC -arch=<arch>
  -ccbin <g++> -Ikernels``; the arch is `config.cuda_arch`, else the GPU's (``sm_XY``, with the
  ``a`` suffix from Hopper on: ``sm_90a``), else ``sm_90a``;
- ``*_binding.cpp`` add what `torch.utils.cpp_extension` gives its own JIT builds: its include
  paths (plus CUDA's on the CUDA target), Python's include dir,
  ``-DTORCH_EXTENSION_NAME=kernel_ext -DTORCH_API_INCLUDE_EXTENSION_H``, the
  ``_GLIBCXX_USE_CXX11_ABI`` torch was built with, and the pybind11 ABI flags where that torch
  still defines them; the other sources of such a workspace get the include paths only;
- link: ``g++ -shared -fopenmp`` (+ ``-lcudart`` with CUDA objects); with a binding, torch's
  libraries (``-lc10 -ltorch -ltorch_cpu -ltorch_python``, + ``-lc10_cuda -ltorch_cuda``) and
  rpaths to torch's and CUDA's library directories.

Why a content-addressed cache instead of ninja (which `load_inline` uses): ninja decides what to
rebuild from file mtimes inside one build directory. Every episode has its own workspace, and RL
rollouts write the same files again and again (a rewrite with identical content gets a new
mtime), so ninja would recompile sources that did not change and could share nothing between
workspaces. Here objects live in the two-level cache of `cudagym.sandbox.deps` under
`objects/`: the first key hashes what is known before compiling (compiler identity, flags, the
source's path and bytes, torch's version for sources built against it), and each variant under
it holds an object with the manifest of the files the compiler reported reading (`-MD -MF`,
plus GNU as's `--MD` for `.incbin`), each with its sha256. A lookup takes the variant whose
files match the workspace's, so an unchanged source is compiled once per cache, whichever
workspace or episode it appears in; an edited header recompiles only the sources that include
it; and a source whose included file differs (a `table.inc` of other values) gets an object of
its own. System headers (the compiler's own directories and the `-isystem` torch/CUDA/Python
directories, which `ToolchainConfig`, not the candidate, controls) are covered by the compiler
identity and torch's version. A linked artifact is named by the hash of its objects' full keys
(first key and variant) and the link flags. Compilers run with the workspace as working
directory and workspace-relative paths, so flags and diagnostics are the same for every
workspace. Objects and artifacts are written under a temporary name and renamed into place,
never overwritten, so concurrent builds of the same key are safe.

Builds read only what they declare. A build never compiles in the workspace, which a job that
ran candidate code may have written: it copies `kernels/` into a private directory under the
cache (`src/`, written by nothing else) and compiles there. The copy leaves out what a compiler
would read without reporting it: precompiled headers (`*.gch`/`*.pch`, directories of them, and
files that begin with GCC's or clang's PCH magic), and everything that is not a regular file
(symlinks, FIFOs); it is bounded (`max_source_mb`, `max_source_files`). The first key covers the
names of every file in the copy, because a file's mere existence can change a build without
being read (`__has_include`, a header created in a directory searched before the one that was
read); the manifest covers the contents of what was read. So the compiler can open only the
copy's files (names in the key, contents in the manifest) and trusted roots (the compiler
identity and torch's version).

Bounded: every file a compiler or the linker writes (object, library, temporaries) is limited
to `max_output_mb` (RLIMIT_FSIZE, through `prlimit`), and a build that hits it fails with an
error that says so; what one build adds to the cache (its new objects and its library) is
limited to `max_build_output_mb`: objects are stored only once every compile of the build is
done and their sum is within it (compiles not yet started are skipped once it is passed), and
a library that takes the sum past it is not stored, nor are the objects this build stored; the
whole cache (objects, artifacts and `load_inline` modules) is kept under `max_cache_mb` by
evicting the least recently used entries (`CacheBound`), sparing those used in the last
`evict_grace_s` (a job may be loading them) only while that keeps the cache within
`max_cache_mb + max_build_output_mb`. Entries are immutable: written
under a temporary name and renamed into place, files read-only, the digests of their outputs
recorded and checked when they are used.

Compilers run with a scrubbed environment (PATH, HOME and TMPDIR in the build's private
directory, LANG/LC_ALL=C), in their own process group (killed on `config.timeout_s`), and
inside ``unshare --net`` where that works, so a compile cannot reach the network.

The package's modules: `build` (`Toolchain`, its config, the compile and link steps), `sources`
(the private copy of what a build may read), `cache` (the cache's bound and keys) and `compilers`
(running a compiler, reading its diagnostics).
"""

from cudagym.sandbox.toolchain.build import (BINDING_SUFFIX, CACHE_FORMAT, OBJECT_FILE, Toolchain, ToolchainConfig,
                                             detect_cuda_arch)
from cudagym.sandbox.toolchain.cache import CacheBound, remove_entry, sha256_of
from cudagym.sandbox.toolchain.compilers import (MAX_LOG_LINES, ToolRun, fallback_error, over_output_limit,
                                                 parse_diagnostics, relativize, run_tool, trim_log)
from cudagym.sandbox.toolchain.sources import (PCH_MAGIC, PCH_SUFFIXES, SKIPPED_DIRS, SourceCopy, copy_sources,
                                               source_listing)

__all__ = ["BINDING_SUFFIX", "CACHE_FORMAT", "MAX_LOG_LINES", "OBJECT_FILE", "PCH_MAGIC", "PCH_SUFFIXES",
           "SKIPPED_DIRS",
           "CacheBound", "SourceCopy", "ToolRun", "Toolchain", "ToolchainConfig", "copy_sources", "detect_cuda_arch",
           "fallback_error", "over_output_limit", "parse_diagnostics", "relativize", "remove_entry", "run_tool",
           "sha256_of", "source_listing", "trim_log"]
