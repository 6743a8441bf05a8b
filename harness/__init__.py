"""verifybench harness: the timing engine, statistics, fingerprint, results store, compare and CLI."""
__version__ = "0.1.0"
