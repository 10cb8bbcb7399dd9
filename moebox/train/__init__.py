"""Training a tiny DeepSeek-V4 so the demo model talks and calls tools (issue G): data, tokenizer, training."""
