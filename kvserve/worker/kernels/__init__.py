"""Kernel choice by CPU features and measurement, and the compiled C kernels (DESIGN.md: worker/kernels).

- cpu.py: what the CPU can do (instruction sets) and the ISA level C kernels are built for.
- build.py: build a C source with the system compiler once, cache the library, load it.
- qmatmul.py: matmuls that read 4- and 8-bit weights in place.
- tuning.py: measure the candidates on the model's own shapes; cache and log the choice.
"""
