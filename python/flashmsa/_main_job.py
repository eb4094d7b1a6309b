"""The `flashmsa` console command of the pip package: runs the main job (the C++ `flashmsa`
program installed inside the package, flashmsa/bin/flashmsa) with the same arguments;
`flashmsa run --cp N ...` runs the step over N processes instead (flashmsa.cp_run, with torch)."""
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
    args = sys.argv[1:]
    if args[:1] == ["run"] and any(a == "--cp" or a.startswith("--cp=") for a in args[1:]):
        from . import cp_run  # (imports torch only here)

        sys.exit(cp_run.main(args[1:]))
    try:
        exe = program()
    except FileNotFoundError as e:
        sys.exit(str(e))
    os.execv(str(exe), [str(exe)] + sys.argv[1:])


if __name__ == "__main__":
    main()
