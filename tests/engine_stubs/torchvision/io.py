def decode_jpeg(*args, **kwargs):
    raise RuntimeError("tests/engine_stubs: a stand-in torchvision, no image decoding")
