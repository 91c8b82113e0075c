"""The bottom layer: the compiled C kernels (c/*.c, c/*.h), their thin ctypes wrappers, and kernel
choice by CPU features and measurement. Imports nothing from the layers above (layers, models, quant,
attention, worker, engine, server): they import it.

- cpu.py: what the CPU can do (instruction sets) and the ISA level C kernels are built for.
- build.py: build a C source with the system compiler once, cache the library, load it.
- qmatmul.py: matmuls that read 4- and 8-bit weights in place (float, int16 or int8 activations).
- kquant.py: the same for raw GGUF Q5_K / Q6_K rows (c/kquant.c).
- ops.py: fused decode ops (RMSNorm, rotary, SiLU-mul).
- paged_attention.py: paged decode attention and the fp8 KV write / read (the `cpu` attention backend).
- decode_stack.py: a small decode batch's layers in one C call (built by kvserve/worker/decode_stack.py).
- bandwidth.py: the machine's streaming read bandwidth (c/bandwidth.c), what decode is judged by.
- tuning.py: measure the candidates on the model's own shapes; cache and log the choice.
- evidence.py: interleaved timing rounds, medians and spread, and the cached decisions' records.
"""
