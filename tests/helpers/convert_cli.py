"""tools/convert_checkpoint.py loaded as a module: :func:`convert` runs it in this process."""

import importlib.util

from tests.helpers.paths import ROOT

SCRIPT = ROOT / "tools" / "convert_checkpoint.py"


def _cli():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _cli()


def convert(*argv) -> int:
    """The command's exit status for ``argv`` (paths and numbers are turned into strings)."""
    return cli.main([str(a) for a in argv])
