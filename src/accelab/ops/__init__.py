"""accelab's own C++ operators, for the kinds of CPU the serving engines meet: the decoding
attention over the paged KV cache, and int8 GEMMs (AMX with bf16 activations, AVX2 with float32
ones). Sources in csrc/, built once per machine by `loader` (`python -m accelab.ops.build`)."""
