"""Repack a wheel with LZMA so that it fits one device call's 64 MiB: pip reads it with zipfile as
any wheel. `--drop PREFIX` leaves out the members under PREFIX (pip installs what the archive
holds; RECORD still names them). CuPy's CUDA 13 wheel: 69.4 MB with deflate, 58.7 MB with LZMA
(preset 9e gains under 0.1%), 55.9 MB without its CUB/Thrust/libcu++ headers
(`cupy/_core/include/cupy/_cccl/`, which only kernels that include them need).

    python3 benchmarks/repack_wheel_lzma.py SRC.whl DST.whl [--drop PREFIX ...]
"""

from __future__ import annotations

import argparse
import os
import zipfile


def repack(src: str, dst: str, drop: tuple[str, ...] = ()) -> int:
    """Write `src`'s members, but those under a `drop` prefix, to `dst`, each LZMA-compressed;
    returns `dst`'s size in bytes."""
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_LZMA) as zo:
        for info in zi.infolist():
            if drop and info.filename.startswith(drop):
                continue
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_LZMA
            zo.writestr(out, zi.read(info))
    with zipfile.ZipFile(dst) as z:
        bad = z.testzip()
        if bad is not None:
            raise SystemExit(f"{dst}: {bad} does not read back")
    return os.path.getsize(dst)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--drop", action="append", default=[], help="leave out the members under this prefix")
    args = parser.parse_args()
    print(args.dst, repack(args.src, args.dst, tuple(args.drop)), "bytes")
