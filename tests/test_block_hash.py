from mlafx.config import ModelConfig
from mlafx.runtime.block_hash import cache_fingerprint, full_block_hashes, hash_block
from tests.tiny_models import TINY_OVERRIDES


def test_keys_chain_over_the_whole_prefix():
    a = full_block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    b = full_block_hashes([1, 2, 3, 4, 5, 6, 8, 9], 3)
    c = full_block_hashes([9, 2, 3, 4, 5, 6], 3)
    assert len(a) == 2 and len(b) == 2  # partial tail blocks have no key
    assert a == b  # same first six tokens
    assert c[1] != a[1]  # same second block, different prefix
    assert a[1] == hash_block(hash_block(None, [1, 2, 3]), [4, 5, 6])
    assert full_block_hashes([1, 2], 3) == []


def test_fingerprint_separates_config_dtype_and_block_size():
    cfg = ModelConfig.from_model("deepseek-v2-lite", TINY_OVERRIDES)
    other = ModelConfig.from_model("deepseek-v2-lite", {**TINY_OVERRIDES, "kv_lora_rank": 16})
    base = cache_fingerprint(cfg, "float32", 4)
    assert base == cache_fingerprint(cfg, "float32", 4)
    assert (
        len(
            {
                base,
                cache_fingerprint(other, "float32", 4),
                cache_fingerprint(cfg, "bfloat16", 4),
                cache_fingerprint(cfg, "float32", 16),
            }
        )
        == 4
    )
