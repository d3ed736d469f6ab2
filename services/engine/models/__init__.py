"""Model architectures, one torch module per family; :mod:`services.engine.models.registry` picks the one of an
architecture. The architecture description they are built from (``ModelArchConfig``) is torch-free and lives in
services/text/model/config.py, where a process that runs no model reads it too."""
