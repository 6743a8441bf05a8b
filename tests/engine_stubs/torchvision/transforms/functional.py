"""SGLang's InternVL image utilities (imported with its model configs) take InterpolationMode from here."""
from torchvision.transforms import InterpolationMode  # noqa: F401
