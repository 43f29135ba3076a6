"""Switchyard gateway: the OpenAI-compatible front door. Never imports torch."""
import os

# The one place this is set. Prices come from litellm's bundled price map, never fetched at run time
# (nothing downloads at run time), and litellm reads this variable when it is first imported. Python
# runs this file before any gateway module, so every gateway import path (the CLI, the app, the
# backends, pricing) has it set before its first `import litellm`.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
