"""Moved to ``specprefill_rag.tools.models``; this name keeps working (deprecated alias).

Importing it gives the very same module object, so attributes set on one are seen on the other.
"""

import sys
import warnings

from .tools import models as _module

warnings.warn("specprefill_rag.models moved to specprefill_rag.tools.models", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
