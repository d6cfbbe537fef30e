"""Build the serving engines' C++ operators for this machine (`make install` runs this): a
server then only loads them (`kernels`)."""

from __future__ import annotations

from accelab.serve.engines import decode_attention, int8_gemm

if __name__ == "__main__":
    for build in (decode_attention.build, int8_gemm.build):
        print("built", build())
