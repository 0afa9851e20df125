"""Built-in model presets: HuggingFace config.json files shipped in hpcrl/models/configs/.

A preset is only a config; weights are initialised from the trainer seed (nothing is downloaded).
`tiny-qwen3-moe` (Qwen3-MoE, hidden 64, 2 layers, 4 experts top-2, ~83k params) is the CI model;
`small-qwen3-moe` (~28M params) is the compute-dominated benchmark model.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("configs")


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_hf_config(preset: str | None, config_path: str | None, model_path: str | None = None) -> dict:
    """The HF config dict of a model directory (`model.path`), a config.json path or a preset name,
    in that order of precedence."""
    if model_path:
        path = Path(model_path) / "config.json"
    else:
        path = Path(config_path) if config_path else CONFIG_DIR / f"{preset}.json"
    return json.loads(path.read_text())
