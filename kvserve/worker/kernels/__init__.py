"""Kernel choice by CPU features and measurement, and the compiled C kernels (DESIGN.md: worker/kernels).

- cpu.py: what the CPU can do (instruction sets) and the ISA level C kernels are built for.
- build.py: build a C source with the system compiler once, cache the library, load it.
- qmatmul.py: matmuls that read 4- and 8-bit weights in place (float, int16 or int8 activations).
- kquant.py: the same for raw GGUF Q5_K / Q6_K rows (c/kquant.c).
- ops.py, decode_stack.py: fused decode ops, and a small decode batch's layers in one C call.
- bandwidth.py: the machine's streaming read bandwidth (c/bandwidth.c), what decode is judged by.
- tuning.py: measure the candidates on the model's own shapes; cache and log the choice.
- evidence.py: interleaved timing rounds, medians and spread, and the cached decisions' records.
"""
