"""Text in and out of a model, torch-free: the tokenizer (HF tokenizer.json, GGUF vocabularies, the byte
tokenizer of random shapes, chat templates), incremental detokenization, the sampling parameters of a
request, and what a model spec names (``model/``: the model's source, architecture description, tokenizer and
context length, read without weights). The router imports these instead of the engine."""
