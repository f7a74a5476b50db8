"""The trainer integration stage (run on its own: ``python -m pytest -q tests/integration``).
Its frameworks are pinned in requirements-integration.txt. Nothing here may reach a model hub:
every model is built from a config."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
