"""DeepSeek-V4 (``model_type: deepseek_v4``): compressed sparse and heavily compressed
attention over a sliding window, sinks, mHC residual streams and hash MoE (``model.py``)."""
