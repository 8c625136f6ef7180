"""Moved to ``specprefill_rag.tools.vllm_process``; this name keeps working (deprecated alias).

Importing it gives the very same module object, so attributes set on one are seen on the other.
"""

import sys
import warnings

from .tools import vllm_process as _module

warnings.warn("specprefill_rag.server moved to specprefill_rag.tools.vllm_process", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
