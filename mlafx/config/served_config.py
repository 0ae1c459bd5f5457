"""What an engine serves: an MLA model's ``ModelConfig`` or a DeepSeek-V4 model's own config.

Both say what the engine loop needs: ``model_type``, ``num_hidden_layers``, ``vocab_size``,
``max_position_embeddings``, ``eos_token_ids``, ``cache_block_shapes(block_size)`` (the paged
caches) and ``to_dict()`` (the cache fingerprint's facts)."""

from __future__ import annotations

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.config.model_config import ModelConfig

ServedConfig = ModelConfig | DeepseekV4Config
