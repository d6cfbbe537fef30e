"""Build the serving engines' C++ operators for this machine (`make install` runs this): a
server then only loads them (`kernels`)."""

from __future__ import annotations

from accelab.serve.engines import decode_attention, int8_gemm

if __name__ == "__main__":
    for library in (decode_attention.LIBRARY, int8_gemm.LIBRARY):
        print("built", library.build())
