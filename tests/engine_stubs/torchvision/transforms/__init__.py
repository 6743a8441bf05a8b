"""The names transformers reads from torchvision.transforms at import time, where it finds the torchvision stand-in
(SGLang's MoE kernel modules import its serving utilities, which import transformers' image processors): it builds a
map from PIL's resampling filters to these modes once. Nothing the engine kernels run resamples an image."""
import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
