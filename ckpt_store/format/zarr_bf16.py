"""Teach zarr-python 3.1 the Zarr v3 data type ``"bfloat16"`` (tensorstore reads it natively).

zarr-python 3.1.6 ships no bfloat16; ``import ckpt_store.format.zarr_bf16`` registers
one backed by ``ml_dtypes.bfloat16`` (a tensorstore dependency), so that
``zarr.open_array(".../model/NAME")[...]`` returns the exact bf16 values.
Without this import zarr-python refuses the array with an unknown-dtype error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.float import Float16

_BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, kw_only=True)
class BFloat16(Float16):
    dtype_cls = type(_BF16)
    _zarr_v3_name = "bfloat16"
    # bfloat16 has no Zarr v2 name; Float16 types its names as float16's two literals
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()  # type: ignore[assignment]

    def to_native_dtype(self):
        return _BF16

    @classmethod
    # the supertype's TypeGuard names float16's dtype class; ml_dtypes' bfloat16 is another class
    def _check_native_dtype(cls, dtype) -> bool:  # type: ignore[override]
        return dtype == _BF16

    def _cast_scalar_unchecked(self, data):
        return _BF16.type(data)


data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)
