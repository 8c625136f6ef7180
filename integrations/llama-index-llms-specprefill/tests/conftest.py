"""Offline settings for every test; helpers live in ``li_helpers`` (this folder is on sys.path)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
