"""Speculative decoding: drafters propose k tokens, the target verifies them as k + 1 query tokens
of the same flat batch (rejection.py), and adaptive.py picks k per request."""
