"""verifybench: device-timed microbenchmarks of the speculative-decoding verify step (engine, components, CLI)."""
__version__ = "0.2.0"
