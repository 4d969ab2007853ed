"""What every pagedkv service shares and none owns: the bottom layer, imported by all, importing none of them.

logging setup (`logs`), size units (`units`), click helpers (`clicks`), ports and processes (`net`), the packed
token-id wire format (`tokens`), limits every service agrees on (`limits`) and where the default model lives
(`default_model`).
"""

__version__ = "0.1.0"
