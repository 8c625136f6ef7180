"""specprefill-rag: Speculative Prefill for retrieval-augmented generation.

A small draft model scores which prompt tokens matter for the answer; the main model
prefills only the best chunks, at their original position ids, and decodes from there.

The top level holds what code built on the engine names: the engine and its configs, the typed
values it takes and returns, the errors it raises, and the backend registry. The modules hold the
rest (``prompt``, ``draft``, ``selection``, ``backends.base``, ...).
"""

from .backends import Backend, BackendCapabilities, available_backends, create_backend, register_backend
from .compress import CompressedPassage, Compression
from .config import (
    DraftConfig,
    DraftRuntime,
    GenerationConfig,
    PassageReading,
    ScoringConfig,
    SelectionConfig,
    SpecPrefillConfig,
)
from .draft import DraftModel
from .engine import RequestOptions, SpecPrefillEngine
from .errors import (
    BackendError,
    BackendTimeoutError,
    ConfigError,
    ConfigTypeError,
    GrammarError,
    InputError,
    InputTypeError,
    MissingDependencyError,
    ModelNotFoundError,
    PlanError,
    PluginMissingError,
    SchemaError,
    ServerError,
    ServerStartError,
    SpecPrefillError,
    ToolCallError,
    UnsupportedVLLMError,
)
from .streams import AsyncTextStream, TextStream
from .types import (
    AssembledPrompt,
    GenerationResult,
    KeptSpan,
    Passage,
    PassagesRead,
    PathChoice,
    PlannedPrompt,
    PrefillPlan,
    Segment,
    SegmentKind,
    Timings,
    TokenScores,
    ToolCall,
)

__version__ = "0.1.0"

__all__ = [
    "AssembledPrompt",
    "AsyncTextStream",
    "Backend",
    "BackendCapabilities",
    "BackendError",
    "BackendTimeoutError",
    "CompressedPassage",
    "Compression",
    "ConfigError",
    "ConfigTypeError",
    "DraftConfig",
    "DraftModel",
    "DraftRuntime",
    "GenerationConfig",
    "GenerationResult",
    "GrammarError",
    "InputError",
    "InputTypeError",
    "KeptSpan",
    "MissingDependencyError",
    "ModelNotFoundError",
    "Passage",
    "PassageReading",
    "PassagesRead",
    "PathChoice",
    "PlanError",
    "PlannedPrompt",
    "PluginMissingError",
    "PrefillPlan",
    "RequestOptions",
    "SchemaError",
    "ScoringConfig",
    "Segment",
    "SegmentKind",
    "SelectionConfig",
    "ServerError",
    "ServerStartError",
    "SpecPrefillConfig",
    "SpecPrefillEngine",
    "SpecPrefillError",
    "TextStream",
    "Timings",
    "TokenScores",
    "ToolCall",
    "ToolCallError",
    "UnsupportedVLLMError",
    "__version__",
    "available_backends",
    "create_backend",
    "register_backend",
]
