"""KV caches for transformers' ``generate`` (``Cache`` subclasses: AdaKVQ, ADKV and their baselines)."""
