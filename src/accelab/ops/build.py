"""Build the own C++ operators this CPU runs (`make install` runs this): a server then only loads
them (`loader`); an operator whose CPU flags are missing here is skipped with the reason."""

from __future__ import annotations

from accelab.ops import decode_attention, int8_gemm, loader

if __name__ == "__main__":
    for library in (decode_attention.LIBRARY, *(k.library for k in int8_gemm.KERNELS.values())):
        missing = [flag for flag in library.needs if flag not in loader.cpu_flags()]
        if missing:
            print("skipped", library.name, f"(this CPU lacks {', '.join(missing)})")
            continue
        print("built", library.build())
