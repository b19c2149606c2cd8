"""What kvshare reads of a Hugging Face model folder without torch: its config (config.py), its tokenizer
(tokenizer.py) and incremental detokenization (detokenize.py)."""
