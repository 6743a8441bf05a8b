"""Imported (as tvF) by transformers' fast image processors at import time; no function of it is called on the engine kernels' path."""
