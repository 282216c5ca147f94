"""The config of a megascale model exported as remote code (`megascale export` writes this file).

Self-contained: transformers loads it with `trust_remote_code=True`, without megascale installed.
`megascale_model` holds megascale's model options (its `[model]` config section) as they were.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class MegascaleConfig(PretrainedConfig):
    model_type = "megascale"

    def __init__(self, megascale_model: dict | None = None, **kwargs) -> None:
        self.megascale_model = dict(megascale_model or {})
        super().__init__(**kwargs)
