"""Render benchmarks/REPORT.md (every table), docs/benchmarks.md (its summary) and the plots
from the JSON files in benchmarks/results/.

    specprefill-rag bench report          # or: python -m benchmarks.report

Reads every result file there: ttft.json and its variants (ttft_vllm_server.json,
ttft_draft-NAME.json, ...), gpu_ttft.json, evidence.jsonl (draft-only evidence recall),
quality.json (or quality_quick.json), quality runs with another draft (quality_draft-NAME.json,
compared with the default draft's), the long tasks end to end (quality_long*.json), portable mode
against its peers (quality_text*.json end to end, peer_evidence*.jsonl as text),
gateway_load.json, serving.json, and for the evidence-vs-length table the evidence files in
``LENGTH_SOURCES`` and windows.jsonl; the ``*_tiny.json`` files of ``--tiny`` smoke runs are
skipped. ``CURRENT`` pins that list: results/ holds these files (and what later runs add),
results/archive/ the runs the docs cite but the page does not render. Writes benchmarks/REPORT.md,
its summary docs/benchmarks.md (``summary``: the fair TTFT, quality and serving sections cut to
their lead, the rest listed with links) and docs/images/bench_*.png, and the README's results
table between its markers: all open with the cells pinned in ``HEADLINE_ROWS``. The pages are
generated: edit this package, not them; what the runs taught is docs/findings.md.

One module per section of the page: ``headline`` (the pinned table, also the README's),
``fairness`` (the fair-baseline rule), ``ttft`` and ``gpu`` (time to first token), ``length``
(evidence recall vs prompt length), ``evidence`` (evidence recall), ``quality`` (answer quality),
``portable`` (text mode vs its peers), ``serving`` (gateway, request rates, prefix cache);
``common`` what they share; ``page`` the fixed prose, ``CURRENT`` and ``render``.
"""

from benchmarks.lib.results import RESULTS_DIR, ROOT
from benchmarks.report.common import (
    DTYPE_NAMES,
    METHOD_LABELS,
    METRIC_NAMES,
    dtype_parts,
    load,
    load_all,
    meta_lines,
    pair,
)
from benchmarks.report.common import _ci as _ci  # tests format an expected cell with it
from benchmarks.report.evidence import (
    EVIDENCE_DEFAULT,
    EVIDENCE_PLOTTED,
    EVIDENCE_TOP,
    evidence_section,
    evidence_summary,
    plot_evidence,
)
from benchmarks.report.fairness import BF16_GAIN, HALF, machine_best, run_precisions, unfair_baseline
from benchmarks.report.gpu import EAGER_NOTE, GPU_NOT_RUN, gpu_attention_section, label_eager_variants
from benchmarks.report.headline import (
    HEADLINE_KEY,
    HEADLINE_ROWS,
    README,
    README_MARKERS,
    HeadlineRow,
    between_markers,
    headline,
    headline_table,
    readme_results,
    write_readme,
)
from benchmarks.report.length import (
    LENGTH_AXIS,
    LENGTH_KEEPS,
    LENGTH_SOURCES,
    length_rows,
    length_section,
    length_summary,
    plot_length,
)
from benchmarks.report.page import CURRENT, DOC, FULL, HEADER, IMAGES, INSTALL, TITLE, main, render
from benchmarks.report.portable import (
    TEXT_RETENTION_AT_30,
    compression_time_table,
    peer_evidence_section,
    portable_section,
)
from benchmarks.report.quality import (
    QUALITY_NOTES,
    cross_draft_section,
    long_quality_section,
    plot_quality,
    quality_section,
    run_label,
)
from benchmarks.report.serving import gateway_section, prefix_cache_section, serving_section
from benchmarks.report.ttft import default_lookahead, ttft_section

__all__ = [
    "BF16_GAIN",
    "CURRENT",
    "DOC",
    "FULL",
    "DTYPE_NAMES",
    "EAGER_NOTE",
    "EVIDENCE_DEFAULT",
    "EVIDENCE_PLOTTED",
    "EVIDENCE_TOP",
    "GPU_NOT_RUN",
    "HALF",
    "HEADER",
    "HEADLINE_KEY",
    "HEADLINE_ROWS",
    "IMAGES",
    "INSTALL",
    "LENGTH_AXIS",
    "LENGTH_KEEPS",
    "LENGTH_SOURCES",
    "METHOD_LABELS",
    "METRIC_NAMES",
    "QUALITY_NOTES",
    "README",
    "README_MARKERS",
    "RESULTS_DIR",
    "ROOT",
    "TEXT_RETENTION_AT_30",
    "TITLE",
    "HeadlineRow",
    "between_markers",
    "compression_time_table",
    "cross_draft_section",
    "default_lookahead",
    "dtype_parts",
    "evidence_section",
    "evidence_summary",
    "gateway_section",
    "gpu_attention_section",
    "headline",
    "headline_table",
    "label_eager_variants",
    "length_rows",
    "length_section",
    "length_summary",
    "load",
    "load_all",
    "long_quality_section",
    "machine_best",
    "main",
    "meta_lines",
    "pair",
    "peer_evidence_section",
    "plot_evidence",
    "plot_length",
    "plot_quality",
    "portable_section",
    "prefix_cache_section",
    "quality_section",
    "readme_results",
    "render",
    "run_label",
    "run_precisions",
    "serving_section",
    "ttft_section",
    "unfair_baseline",
    "write_readme",
]
