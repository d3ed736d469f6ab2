"""Text in and out of a model, torch-free: the tokenizer (HF tokenizer.json, GGUF vocabularies, the byte
tokenizer of random shapes, chat templates), incremental detokenization and the sampling parameters of a
request. The router imports these instead of the engine."""
