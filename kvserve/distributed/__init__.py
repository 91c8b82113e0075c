"""Process groups, communicators and executors: how the engine reaches its ranks (executor.py)."""
