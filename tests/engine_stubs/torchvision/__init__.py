"""A stand-in for torchvision, put on the path by tests/conftest.py only where the real one cannot be imported (on a
CPU-only torch, PyPI's torchvision wheel needs CUDA's libraries). SGLang's utilities import torchvision.io's JPEG
decoder at import time; the kernels the tests call never use it."""
