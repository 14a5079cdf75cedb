"""The O1/O4 op lists: which ops run in low precision, which in fp32, which promote.

Names follow apex's lists (see docs) and are looked up in ``torch``, ``torch.nn.functional`` and
``torch.Tensor``; a name a namespace does not have is skipped, so the table works across torch
versions. The lists are ampddp's own, applied the same way on every device, rather than whatever a
device's autocast happens to do (torch's CPU autocast keeps softmax, exp, sum, ... in half).
"""

from __future__ import annotations

LOW_PRECISION_OPS = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "linear", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "bmm",
    "baddbmm", "addbmm", "chain_matmul", "scaled_dot_product_attention",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "__matmul__", "__rmatmul__",
)  # fmt: skip

FP32_OPS = (
    # functional / activation / normalisation
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity", "rms_norm",
    # losses
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss",
    "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "multilabel_soft_margin_loss",
    "smooth_l1_loss", "huber_loss", "nll_loss", "binary_cross_entropy_with_logits", "ctc_loss",
    "gaussian_nll_loss",
    # pointwise functions that overflow or lose precision in half
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__",
    # reductions
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm", "logsumexp",
    # device transfer: apex casts before copying to the host
    "cpu",
)  # fmt: skip

PROMOTE_OPS = (
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "sub", "rsub", "mul",
    "div", "true_divide", "eq", "ne", "lt", "le", "gt", "ge", "equal", "where", "lerp",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
)  # fmt: skip

BANNED_OPS = {
    "binary_cross_entropy": (
        "binary_cross_entropy (and nn.BCELoss) is unsafe with low-precision inputs: its log(1 - p) loses "
        "all precision in half. Use torch.nn.BCEWithLogitsLoss / F.binary_cross_entropy_with_logits, which "
        "fuses the sigmoid and runs in fp32 under O1/O4, or register the op that feeds it as a float "
        "function (e.g. amp.register_float_function(torch, 'sigmoid')) so its input arrives in fp32."
    ),
}
