"""Worker: torch lives here."""

from kvserve.worker.cpu_tuning import tune_allocator

tune_allocator()
