"""Single-file (KernelBench) solutions: `load_inline`/`load` extensions, built by trusted jobs.

A KernelBench-style `model_new.py` builds its kernels with `torch.utils.cpp_extension.load_inline`
(or `load` on files of the workspace): at import, in `ModelNew.__init__` or a helper it calls,
or lazily on the first `forward`, often inside `try/except` with a torch fallback. The rule
here: **a job that runs candidate code never writes shared state**, so the candidate's process
never compiles and never writes the cache. Three parties:

- **The candidate's jobs** (`install_inline_loader`, in compile_inline, verify, profile and ncu
  workers) get an `InlineLoader` in place of torch's two functions. A call whose module is in
  the cache is imported from there, read-only. Any other call is recorded (its arguments in
  canonical form, its call site `model_new.py:LINE`) *before* `ExtensionNotBuilt` is raised,
  so the record stands whatever the candidate does with the exception. In the compile step
  the records are *build requests*; in verify and profile they, and modules that failed to
  load, are *problems* (`InlineLoader.problems`) the harness turns into a compile error
  instead of letting the solution fall back to torch unnoticed.
- **The parent** (the evaluator, `InlineBuildCache`) checks each request: types, names, and
  compiler flags that could run a program or read files the manifest cannot see (see
  `refusal`); computes its key; and after the build, the dependency manifest, and stores the
  module as a variant of that key (`cudagym.sandbox.deps`: written once, never overwritten).
- **The trusted build job** (`build_extension`, kind `build_inline`) runs no candidate Python:
  torch's own `load_inline`/`load` with `build_directory` in a fresh staging directory (its
  only writable directory), on a copy of the workspace's declared files made by the parent
  (`kernels/` and `model_new.py`, as the compile tool copies them: no precompiled headers, no
  symlinks or FIFOs, bounded; see `cudagym.sandbox.toolchain.copy_sources`), never on the
  workspace itself, which a job that ran candidate code may have written; with torch's final import
  step disabled, so the library is never loaded and none of its static constructors run. Its build
  file is rewritten to record every dependency: `-MD` instead of torch's `-MMD` (which a source can blind with
  `#pragma GCC system_header`), `.d` files kept, and GNU as's `--MD` for `.incbin`.

The key hashes the canonical arguments (sources, functions, flags, include paths; paths
relative to the workspace when inside it; for a request on workspace files, the names of the
files a build job's copy holds), torch and Python versions, the CUDA arch list and
the compilers' identities (`c++` on PATH and CUDA_HOME's nvcc, which the build job uses: it
drops CC, CXX and PYTORCH_NVCC). The manifest holds every file the build read outside trusted
roots (torch's, CUDA's and Python's include directories, /usr/include, /usr/lib/gcc and the
compiler's own), with its sha256; a lookup takes the variant whose files match the workspace.

Compile errors come back as `InlineCompileError` whose message is the readable error list of
`cudagym.sandbox.toolchain.parse_diagnostics`, with line numbers of the user's source strings
(`cpp_sources:12: error: ...`, `cuda_sources:7: error: ...`).

The package's modules: `requests` (a request's canonical arguments and key), `flags` (which
requests are refused), `loader` (the candidate's side), `job` (the trusted build job) and `cache`
(the parent's side).
"""

from cudagym.sandbox.inline.cache import InlineBuild, InlineBuildCache
from cudagym.sandbox.inline.flags import refusal
from cudagym.sandbox.inline.job import build_extension
from cudagym.sandbox.inline.loader import InlineLoader, inline_problems, install_inline_loader
from cudagym.sandbox.inline.requests import (COPIED_FILES, INLINE_DIR, INLINE_FORMAT, KINDS, MAX_ERROR_LINES,
                                             MAX_REQUESTS_PER_PASS, MAX_REQUEST_BYTES, MAX_SOURCE_BYTES,
                                             MAX_SOURCE_FILES, META_FILE, PATH_ARGS, SOURCE_COPY, ExtensionNotBuilt,
                                             InlineCompileError, canonical_args, compiler_identity, inline_key,
                                             with_cuda_of, workspace_listing)

__all__ = ["COPIED_FILES", "INLINE_DIR", "INLINE_FORMAT", "KINDS", "MAX_ERROR_LINES", "MAX_REQUESTS_PER_PASS",
           "MAX_REQUEST_BYTES", "MAX_SOURCE_BYTES", "MAX_SOURCE_FILES", "META_FILE", "PATH_ARGS", "SOURCE_COPY",
           "ExtensionNotBuilt", "InlineBuild", "InlineBuildCache", "InlineCompileError", "InlineLoader",
           "build_extension", "canonical_args", "compiler_identity", "inline_key", "inline_problems",
           "install_inline_loader", "refusal", "with_cuda_of", "workspace_listing"]
