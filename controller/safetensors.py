"""milepost.safetensors: export a checkpoint as HF-style safetensors shards.

Loading needs nothing from here: ``milepost.load("model.safetensors" or a folder of shards,
abstract_state)`` reads safetensors onto any mesh.

>>> import milepost.safetensors
>>> milepost.safetensors.export("/ckpt/1000", "/export/model", subtree="params")
"""

from milepost._safetensors import ExportSummary, export

__all__ = ["ExportSummary", "export"]
