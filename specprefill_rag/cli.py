"""Moved to ``specprefill_rag.tools.cli``; this name keeps working (deprecated alias).

Importing it gives the very same module object, so attributes set on one are seen on the other;
``python -m specprefill_rag.cli`` still runs the command.
"""

import sys
import warnings

from .tools import cli as _module

if __name__ == "__main__":
    sys.exit(_module.main())
warnings.warn("specprefill_rag.cli moved to specprefill_rag.tools.cli", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
