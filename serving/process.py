"""What the server processes share at their command line: checked numbers, no secrets in argv, one-line errors.

Every flag that takes a number is parsed by a checker of this module (finite, in range), so ``--port 0``,
``--request-timeout nan`` or ``--memory-gib -1`` are usage errors naming the flag (argparse: exit 2), never a
traceback or a server that cannot work. ``--api-key`` is refused: a key on the command line is visible to every
user of the machine in ``ps``; the servers read it from an environment variable or a file.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn


def number(kind: type, low: float | None = None, high: float | None = None, strict_low: bool = False):
    """An argparse ``type`` for a finite ``kind`` (int or float) in ``[low, high]`` (``(low, high]`` if
    ``strict_low``)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if low is not None and (value <= low if strict_low else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict_low else '>='} {low:g}, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


PORT = number(int, 1, 65535)
POSITIVE = number(float, 0, None, strict_low=True)
COUNT = number(int, 1)


def arguments(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: the process's), refusing a key on the command line."""
    parser.add_argument("--api-key", dest="_api_key_in_argv", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._api_key_in_argv is not None:
        parser.error("--api-key is not accepted (ps shows the command line to every user): put the key in "
                     "$EXITPLAN_API_KEY or a file named by --api-key-file")
    return args


def fail(exc: Exception) -> NoReturn:
    """Print ``exc`` as one line and exit 2."""
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
