"""The dtypes of output tensors that cross the result channel (`cudagym.sandbox.worker.wire`), by
the name a tensor frame carries.

One list for both ends: the worker refuses to send an output of any other dtype, and the
evaluator (`cudagym.rewards.compare`) can decode and compare every dtype listed here:
integers and bool exactly by their bytes, floating types (float8 variants included) upcast to
float32 (float64 as is), complex types as pairs of real and imaginary parts.

Left out: the quantized types (their values need scales the bytes do not carry), the bit and
sub-byte shell types (`bits8`, `int1`..`int7`, `uint1`..`uint7`, the packed `float4_e2m1fn_x2`),
which torch has no kernels to compute or compare with.

Apart from the wire module because it needs torch, which the parent's sandbox does not import.
"""

from __future__ import annotations

import torch

_NAMES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex32", "complex64", "complex128",
)

# A name the installed torch lacks (float8_e8m0fnu before torch 2.7) is left out.
WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
