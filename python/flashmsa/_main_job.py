"""The `flashmsa` console command of the pip package: runs the main job (the C++ `flashmsa`
program installed inside the package, flashmsa/bin/flashmsa) with the same arguments."""
import os
import pathlib
import sys

_PKG_DIR = pathlib.Path(__file__).resolve().parent


def program() -> pathlib.Path:
    """The installed main job, or the source tree's build (build/flashmsa) when run from there."""
    for p in (_PKG_DIR / "bin" / "flashmsa", _PKG_DIR.parents[1] / "build" / "flashmsa"):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise FileNotFoundError("flashmsa: the main job program is missing: reinstall the package (pip install .) "
                            "or build it (bash scripts/setup.sh)")


def main() -> None:
    try:
        exe = program()
    except FileNotFoundError as e:
        sys.exit(str(e))
    os.execv(str(exe), [str(exe)] + sys.argv[1:])


if __name__ == "__main__":
    main()
