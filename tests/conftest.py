"""Puts tests/ on sys.path so that every test folder can import the shared builders in tests/
(hf_fixtures: small HF model directories and tokenizers made on the spot)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
