"""The argument parser every command uses: an argparse error is one line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineErrors:
    """Mixin: argparse errors become one line and exit code 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)  # type: ignore[attr-defined]
        raise SystemExit(2)


class ArgumentParser(OneLineErrors, argparse.ArgumentParser):
    pass
