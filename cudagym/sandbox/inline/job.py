"""The trusted build job of `load_inline`/`load` (`cudagym.sandbox.inline`, kind `build_inline`):
torch's own build of a checked request in a fresh staging directory, with every dependency
recorded and the final import disabled, and its errors made readable.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from cudagym.sandbox.inline.requests import MAX_ERROR_LINES, InlineCompileError, compiler_identity
from cudagym.sandbox.toolchain import parse_diagnostics, relativize, trim_log


# -- the trusted build job ------------------------------------------------------------------------


def build_extension(request: dict[str, Any], build_dir: Path) -> None:
    """Build a request the parent checked (`InlineBuildCache.job_request`: absolute paths) with
    torch's own `load_inline`/`load` into `build_dir`, recording every dependency, without
    loading the library. For a worker that runs no candidate code; InlineCompileError when the
    build fails."""
    import torch.utils.cpp_extension as cpp

    for var in ("CC", "CXX", "PYTORCH_NVCC", "TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES"):
        os.environ.pop(var, None)  # the key names `c++` and CUDA_HOME's nvcc, with dependency output
    gnu_as = "Free Software Foundation" in compiler_identity(False)
    write_ninja = cpp._write_ninja_file  # noqa: SLF001 - torch's ninja writer, wrapped

    def write_tracked(*args: Any, **kwargs: Any) -> None:
        write_ninja(*args, **kwargs)
        _track_all_dependencies(Path(kwargs["path"] if "path" in kwargs else args[0]), gnu_as)

    cpp._write_ninja_file = write_tracked  # noqa: SLF001 - torch's ninja writer, wrapped

    def built_path(module_name: str, path: str, is_python_module: bool) -> str:
        return os.path.join(path, module_name + cpp.LIB_EXT)  # never load what was built here

    cpp._import_module_from_library = built_path  # noqa: SLF001 - torch's loader, replaced
    kind, args = request["kind"], dict(request["args"])
    name = args["name"]
    workspace = request["workspace"]
    build_dir.mkdir(parents=True, exist_ok=True)  # load_inline writes its sources before torch makes it
    try:
        if kind == "load_inline":
            cpp.load_inline(**args, build_directory=str(build_dir), verbose=False, use_pch=False)
        else:
            cpp.load(**args, build_directory=str(build_dir), verbose=False)
    except (RuntimeError, ValueError, TypeError, OSError) as e:
        if "Error building extension" not in str(e):
            raise InlineCompileError(f"{kind} module '{name}' ({request['site']}) cannot be built: "
                                     f"{type(e).__name__}: {str(e)[:2000]}") from None
        implicit = not args.get("no_implicit_headers", False)
        offsets = ({"main.cpp": ("cpp_sources", 1 if implicit else 0),
                    "cuda.cu": ("cuda_sources", 3 if implicit else 0)} if kind == "load_inline" else {})
        raise InlineCompileError(_readable_error(f"{kind} module '{name}' ({request['site']})", str(e), build_dir,
                                                 Path(workspace), offsets)) from None


def _track_all_dependencies(build_file: Path, gnu_as: bool) -> None:
    """Rewrite torch's build.ninja so that every compile writes `$out.d` with all headers (`-MD`,
    not `-MMD`) and, with GNU as, `$out.asd` with the assembler's files; ninja keeps them."""
    text = build_file.read_text()
    cxx = "command = $cxx -MMD -MF $out.d "
    if cxx not in text:
        raise RuntimeError(f"torch's build file has no '{cxx.strip()}' rule: its dependencies cannot be recorded")
    text = text.replace(cxx, "command = $cxx -MD -MF $out.d" + (" -Wa,--MD,$out.asd " if gnu_as else " "))
    # nvcc splits -Xcompiler values at commas, and /bin/sh takes one backslash of each pair
    nvcc_as = " -Xcompiler -Wa\\\\,--MD\\\\,$out.asd" if gnu_as else ""
    if "command = $nvcc -MD -MF $out.d " in text:
        text = text.replace("command = $nvcc -MD -MF $out.d ", f"command = $nvcc -MD -MF $out.d{nvcc_as} ")
    elif "command = $nvcc " in text:  # torch left nvcc's dependency output out
        text = text.replace("command = $nvcc ", f"command = $nvcc -MD -MF $out.d{nvcc_as} ")
    build_file.write_text(text.replace("  deps = gcc\n", ""))  # with `deps = gcc` ninja deletes the .d files


_SOURCE_LINE = re.compile(r"^(main\.cpp|cuda\.cu):(\d+):")


def _readable_error(what: str, message: str, build_dir: Path, workspace: Path,
                    offsets: dict[str, tuple[str, int]]) -> str:
    """torch's 'Error building extension' message as readable lines of the user's sources."""
    import torch

    out = relativize(message, {str(build_dir) + "/": "", str(build_dir): ".", str(workspace) + "/": "",
                               os.path.dirname(torch.__file__): "<torch>"})
    errors = []
    for err in parse_diagnostics(out, MAX_ERROR_LINES):
        m = _SOURCE_LINE.match(err)
        if m and m.group(1) in offsets:
            label, shift = offsets[m.group(1)]
            err = f"{label}:{max(1, int(m.group(2)) - shift)}:{err[m.end():]}"
        errors.append(err)
    if not errors:
        tail = trim_log(out).splitlines()[-MAX_ERROR_LINES // 2:]
        errors = tail or ["the build failed without output"]
    return f"{what} failed to compile:\n" + "\n".join(errors)
