"""Moved to ``specprefill_rag.tools.retrieval``; this name keeps working (deprecated alias).

Importing it gives the very same module object, so attributes set on one are seen on the other.
"""

import sys
import warnings

from .tools import retrieval as _module

warnings.warn("specprefill_rag.retrieval moved to specprefill_rag.tools.retrieval", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
