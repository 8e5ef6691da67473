"""What the training path needs beyond a bare GPU image (Python with torch, accelerate,
transformers, tokenizers, numpy, safetensors, pyyaml and psutil): pydantic, which every stage's
config is declared with, and its three small dependencies, pinned. `python -m bench gpu` carries
them as wheels (docs/development.md#the-gpu-check), and its test installs them beside the image's
packages. This module imports nothing, so it can be read on the bare image before they are there.
"""

CARRIED = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5"]
