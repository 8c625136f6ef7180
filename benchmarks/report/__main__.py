"""``python -m benchmarks.report`` (what ``specprefill-rag bench report`` runs): ``page.main``."""

import sys

from benchmarks.report.page import main

if __name__ == "__main__":
    sys.exit(main())
