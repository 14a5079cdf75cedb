"""O1/O4 op casting and model casts: what runs in which dtype inside (and, for the facade, around) a forward.

The public face of the mechanism, for the engines and the apex-compatible facade: the op-cast
context (``OpCastContext``) and its thread windows, apex's op lists (``op_lists``), the functions a
user registers to run in a cast class (``OpRegistry``, the decorators, the classes ``FP32``, ``LOW``,
``PROMOTE``, ``BFLOAT16``), the table built from both (``build_op_table``), the forward's input/output
casts and fp32 state hooks, and the tensor helpers (cast a model, map nested tensors). The modules
behind it (ATen kernels, function swaps, the torch-function mode stack, RNN inputs, checkpoint
recomputes) are its own.
"""

from ampddp.precision.casting import op_lists
from ampddp.precision.casting.cast_context import (
    OpCastContext,
    Opening,
    close_thread_window,
    end_thread_casts,
    open_thread_window,
    suspend_thread_casts,
)
from ampddp.precision.casting.model_hooks import ForwardHooks, install_fp32_state_hooks
from ampddp.precision.casting.op_table import build_op_table
from ampddp.precision.casting.registry import (
    BFLOAT16,
    FP32,
    LOW,
    PROMOTE,
    OpRegistry,
    bfloat16_function,
    float_function,
    half_function,
    promote_function,
)
from ampddp.precision.casting.tensors import cast_floating, convert_model, device_types, first_non_fp32_param, map_tensors

__all__ = [
    "BFLOAT16",
    "FP32",
    "LOW",
    "PROMOTE",
    "ForwardHooks",
    "OpCastContext",
    "OpRegistry",
    "Opening",
    "bfloat16_function",
    "build_op_table",
    "cast_floating",
    "close_thread_window",
    "convert_model",
    "device_types",
    "end_thread_casts",
    "first_non_fp32_param",
    "float_function",
    "half_function",
    "install_fp32_state_hooks",
    "map_tensors",
    "op_lists",
    "open_thread_window",
    "promote_function",
    "suspend_thread_casts",
]
