"""pykernels: single-device GPU kernels with fast native CPU backends, for PyTorch users.

Ops (each takes backend="auto" | "cpu" | "cuda" | "triton"; see `pykernels.backends()`):
  sort, argsort, sort_keys, sort_pairs, segmented_sort     Onesweep-style LSD radix sort
  HashMap, HashSet, CountingTable, MultiValueHashMap,       WarpCore-style hash tables
  BloomFilter
  quantize, qmatmul, QuantLinear, quantize_model            quantized GEMMs (bipolar-INT, W4 Marlin-style)
  flash_attention                                           attention returning the log-sum-exp
  autotune                                                  tuning and its per-device cache
  empty_cache                                               release cached CPU buffers: outputs, dropped tables' slots
"""
__version__ = "0.1.0"

from ._backend import backends  # noqa: E402
from .errors import TableFullError  # noqa: E402
from . import autotune  # noqa: E402
from ._memory import empty_cache  # noqa: E402
from .sort import sort, argsort, sort_keys, sort_pairs, segmented_sort  # noqa: E402
from .hashing import HashMap, HashSet, CountingTable, MultiValueHashMap, BloomFilter  # noqa: E402
from .quant import quantize, qmatmul, QuantLinear, QuantizedWeight, quantize_model  # noqa: E402
from .attention import flash_attention  # noqa: E402

__all__ = [
    "backends", "TableFullError", "autotune", "empty_cache",
    "sort", "argsort", "sort_keys", "sort_pairs", "segmented_sort",
    "HashMap", "HashSet", "CountingTable", "MultiValueHashMap", "BloomFilter",
    "quantize", "qmatmul", "QuantLinear", "QuantizedWeight", "quantize_model",
    "flash_attention",
]
