"""Row reductions of the softmax family: log-sum-exp, the statistic a saving forward keeps."""

from __future__ import annotations

from moajax import moa
from moajax.kernel import kernel
from moajax.kernels.common import accumulation_dtype


@kernel(example=dict(n=8, m=16))
def logsumexp(x: "n m"):
    """lse_n = ⌈/x_n + log +/ exp(x_n − ⌈/x_n), row by row (the max makes it overflow-free)."""
    return moa.cast(moa.logsumexp(moa.cast(x, accumulation_dtype(x.dtype)), axis=-1), x.dtype)
