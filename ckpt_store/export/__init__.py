"""Public: a committed step out of the store, for tools that do not read Zarr (docs/design.md §4).

This package and ``ckpt_store`` itself (``CheckpointStore`` and the errors) are the whole
surface that code outside ``ckpt_store`` uses; ``tools/import_graph.py --check`` enforces it.

* ``single_file``: one safetensors file of a step's ``model`` group; the S3 settings a CLI
  takes from the environment;
* ``sharded``: a directory of size-capped safetensors files with an index, written tensor by
  tensor (bounded memory); the reads they share.
"""

from ckpt_store.export.sharded import (
    ExportTensor,
    check_output_dir,
    export_sharded,
    parse_size,
    read_array,
    read_values,
)
from ckpt_store.export.single_file import env_s3_endpoint, env_storage_options, export_safetensors
from ckpt_store.format.zarr_format import TORCH_DTYPES

__all__ = ["ExportTensor", "TORCH_DTYPES", "check_output_dir", "env_s3_endpoint", "env_storage_options",
           "export_safetensors", "export_sharded", "parse_size", "read_array", "read_values"]
