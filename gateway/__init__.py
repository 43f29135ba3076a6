"""Switchyard gateway: the OpenAI-compatible front door. Never imports torch."""
import os

# Prices come from litellm's bundled map; never fetch it at start. Must be set before litellm imports.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
