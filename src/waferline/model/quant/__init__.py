"""W4A16: the canonical group-wise int4 weight format, RTN/GPTQ quantizers, int4 matmul per device, and import.

On disk (safetensors, one set per quantized ``X.weight`` of shape ``[..., N, K]``)::

    X.qweight  uint8 [..., N, K/2]   two 4-bit codes per byte, even k in the low nibble, codes 0..15
    X.scales   16-bit float [..., N, K/G]
    X.zeros    16-bit float [..., N, K/G]   (asymmetric only)
    w = (code - 8) * scale + zero           (zero = 0 when absent: symmetric)

``config.json`` records it as ``quantization_config = {"quant_method": "waferline", "bits": 4, "group_size": G,
...}``. The group size of one tensor is ``K / scales.shape[-1]`` (a tensor with ``K < G`` uses one group per row).
A checkpoint tensor whose input dimension is its axis -2 (gpt-oss's fused experts, ``gate_up_proj [E, D, 2I]``) is
stored as the above of it with its last two axes swapped, under its own name less any ``.weight``, and listed by
name in ``quantization_config["transposed"]``.
At load the codes are repacked for the device: waferline's own CPU kernel (``waferline::int4_linear``,
kernels/cpu_ops.cpp; ATen's CPU int4pack ops where that is not built), torch's CUDA tinygemm op, or (other devices,
group sizes the kernels do not take) dequantise-then-matmul. Activations and accumulation stay 16/32-bit.

Checkpoints in compressed-tensors ``pack-quantized`` int4 (Kimi K2.6) and GPTQ format are read into the same
in-memory form without re-quantizing. Which checkpoint tensor feeds which module weight (fused gate/up, stacked
experts) is found by :func:`trace_layer`: it runs the modules' own ``load_hf`` on element indices.

Modules: ``tensor`` (the canonical form and its packing), ``quantizers`` (RTN, GPTQ), ``weight`` (device layouts and
kernels, ``Int4Weight``, ``QuantLinear``), ``modules`` (which weights of a model are int4; quantizing or moving a
loaded model), ``formats`` (reading waferline, compressed-tensors and GPTQ checkpoints), ``mapping`` (checkpoint
tensors <-> module weights), ``calibration`` (GPTQ's Hessians), ``write`` (writing an int4 checkpoint). The names
below are the public ones; import them from here.
"""

from waferline.model.quant.calibration import SequentialCalibration, calibration_tokens, collect_hessians, hessians
from waferline.model.quant.formats import FORMATS, Int4Source, int4_group_size, quant_method
from waferline.model.quant.mapping import attach_int4, attach_int4_parts, gather_int4, trace_layer, trace_module
from waferline.model.quant.modules import (
    QuantOptions,
    convert_loaded,
    install,
    is_int4,
    matmul_weights,
    move_model,
    quantize_model,
    quantize_mtp,
)
from waferline.model.quant.quantizers import gptq_quantize, rtn_quantize
from waferline.model.quant.tensor import (
    ALWAYS_16BIT,
    DEFAULT_KEEP,
    KERNEL_GROUPS,
    QUANT_METHOD,
    Int4Tensor,
    group_for,
    pack_nibbles,
    unpack_nibbles,
)
from waferline.model.quant.weight import (
    KERNEL_BLOCK,
    Int4Weight,
    QuantLinear,
    choose_backend,
    loading_for,
    pack_kernel,
    unpack_kernel,
)
from waferline.model.quant.write import check_quantize, quantization_config, quantize_checkpoint

__all__ = ["Int4Tensor", "Int4Weight", "QuantLinear", "QuantOptions", "Int4Source", "rtn_quantize", "gptq_quantize",
           "quantize_model", "move_model", "loading_for", "attach_int4", "attach_int4_parts", "trace_layer",
           "trace_module", "gather_int4",
           "collect_hessians", "hessians", "SequentialCalibration", "calibration_tokens",
           "matmul_weights", "install", "is_int4", "pack_nibbles", "unpack_nibbles", "pack_kernel", "unpack_kernel",
           "group_for", "choose_backend", "quant_method", "quantization_config", "quantize_checkpoint",
           "check_quantize", "int4_group_size", "convert_loaded", "quantize_mtp",
           "FORMATS", "KERNEL_BLOCK", "KERNEL_GROUPS", "QUANT_METHOD", "ALWAYS_16BIT", "DEFAULT_KEEP"]
