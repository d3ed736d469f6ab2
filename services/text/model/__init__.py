"""What a model spec names, read without weights or torch: which model it is (``source.py``: a GGUF file, an HF
directory or a random shape), its architecture (``config.py`` with ``config_fields.py``, ``moe_config.py`` and
``mla_config.py``; from GGUF metadata ``gguf_meta.py``, an HF config.json ``hf_config.py`` or a random shape
``random_shapes.py``), its tokenizer, model id and context length, the ``--model`` setting (``settings.py``) and
``ModelLoadError`` (``errors.py``). The router reads a model through these; the engine's loaders build on them
(engine/model_loader.py, engine/weights/), so both agree on token ids, chat rendering, model id and context
length."""
