"""The model runner of continuous batching: what runs one step of many sequences on a model.
The torch step engine (`ragged`: packed layers on oneDNN, the decoder stack as tensor operations,
paged attention over the KV cache, its compiled steps, a vision encoder run in slices) and
llama.cpp's (`llama_steps`), and the sampling every engine shares. The route-facing engines
(`accelab.serve.engines`) build them; the continuous worker drives them."""
