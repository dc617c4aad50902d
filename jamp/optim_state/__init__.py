"""Optimizer-state and master-weight precision (placeholder, filled below)."""
from jamp.optim_state.moments import (
    ANY, LowPrecisionState, QuantizedLeaf, StateFormat, as_format, dequantize,
    low_precision_state, quantize, stored_dtypes,
)
from jamp.optim_state.master import (
    SCHEMES, Bf16MasterState, bf16_master, master_view,
)
