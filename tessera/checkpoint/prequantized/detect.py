"""Whether a HuggingFace directory is pre-quantized (config.json has a `quantization_config`), and
the refusal where full-precision weights are needed."""

from __future__ import annotations

import os
from pathlib import Path

from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import is_hf_directory, read_json_object


def quantization_config(path: str | os.PathLike) -> dict | None:
    """config.json's `quantization_config` (None when absent): what marks a pre-quantized directory."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    qc = read_json_object(f).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{str(f)!r}: quantization_config must be an object, not {type(qc).__name__}")
    return qc


# quant_methods whose weights the HuggingFace reader dequantizes as it reads them (gpt-oss's MXFP4
# experts: tessera/checkpoint/hf/mxfp4.py): such a directory loads as a full-precision one
DEQUANTIZED_AT_LOAD = ("mxfp4",)


def is_mxfp4_directory(path: str | os.PathLike) -> bool:
    """A HuggingFace directory whose experts are stored in MXFP4 (gpt-oss's published checkpoints):
    dequantized at load, or kept packed for serving (tessera/checkpoint/hf/mxfp4_packed.py)."""
    qc = quantization_config(path) if is_hf_directory(path) else None
    return qc is not None and qc.get("quant_method") == "mxfp4"


def is_prequantized_hf(path: str | os.PathLike) -> bool:
    qc = quantization_config(path) if is_hf_directory(path) else None
    return qc is not None and qc.get("quant_method") not in DEQUANTIZED_AT_LOAD


def refuse_prequantized(path: str | os.PathLike) -> None:
    """Refuse a pre-quantized directory where full-precision weights are needed (conversion,
    training's init_from, pruning): ConfigError naming its method."""
    qc = quantization_config(path)
    if qc is not None and qc.get("quant_method") not in DEQUANTIZED_AT_LOAD:
        raise ConfigError(f"{path} is pre-quantized (quantization_config.quant_method="
                              f"{qc.get('quant_method')!r}): this needs full-precision weights; a pre-quantized "
                              "directory is served or generated from as it is (tessera serve / generate, one "
                              "rank), so convert, train.init_from and tensor_parallel_size > 1 take its "
                              "full-precision source")
