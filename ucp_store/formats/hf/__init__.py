"""Hugging Face ``save_pretrained`` folders in and out: ``adapter`` (safetensors), ``names`` (name maps as
data, shipped in ``maps/``), ``cli``."""

__all__: list[str] = []
