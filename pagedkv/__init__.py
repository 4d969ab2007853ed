"""pagedkv: an LLM serving stack built around PagedAttention.

This small package holds what is shared by every service and is no single service's own: the umbrella
command line (`pagedkv`) and logging setup.
"""

__version__ = "0.1.0"
