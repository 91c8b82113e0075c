"""Non-prefix KV reuse (CacheBlend): the K/V of text chunks reused wherever they appear in a prompt.

chunks.py marks a prompt's chunks (front ends) and checks them (engine); connector.py is the KV
connector that finds, holds and warms the chunks' blocks; forward.py re-rotates, checks and
recomputes on the worker.
"""
