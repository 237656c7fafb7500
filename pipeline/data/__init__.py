"""Input data: the shards' I/O (``shards``), image decoding (``images``), the synthetic embedded data
(``synthetic``), the real datasets' converters (``convert``) read through ``hf_datasets``. Import the module you
need (``from pipeline.data import shards``); the package itself imports nothing."""
