"""pagedkv: an LLM serving stack built around PagedAttention.

The top layer: the umbrella command line (`pagedkv`), `pagedkv serve` (a whole local stack), the benchmarks
(`pagedkv.bench`) and tools (`pagedkv.tools`). Nothing in blockd, executor, gateway or kernels imports it.
"""

from common import __version__

__all__ = ["__version__"]
