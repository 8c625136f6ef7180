"""What the two portable-mode examples share: their command line and the served model's name.
Framework-free, so each example needs only its own framework."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None, description: str, what: str) -> argparse.Namespace:
    """The examples' options; ``what`` names the retrieved items ("documents", "nodes"). The served
    model defaults to the first the server lists (``/v1/models``: a stock vLLM serves its path)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"),
                        help="the OpenAI-compatible server (default: $OPENAI_BASE_URL)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    parser.add_argument("--model", default=None, help="the served model (default: the first the server lists)")
    parser.add_argument("--scorer", default="smollm2-135m-instruct", help="draft that scores (and renders) the prompt")
    parser.add_argument("--question", default="On what date was Tindra Point Research Station officially opened?")
    parser.add_argument("--keep-rate", type=float, default=0.3)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--baseline", action="store_true", help=f"also answer from the whole {what}, to compare")
    args = parser.parse_args(argv)
    if not args.base_url:
        parser.error("pass --base-url http://host:port/v1 (or set OPENAI_BASE_URL)")
    if args.model is None:
        import openai

        args.model = openai.OpenAI(base_url=args.base_url, api_key=args.api_key).models.list().data[0].id
    return args
