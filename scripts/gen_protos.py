"""Generate the Python gRPC code for protos/ into services/common/pb/.

    python scripts/gen_protos.py           # regenerate services/common/pb/
    python scripts/gen_protos.py --check   # exit 1 if the committed files differ from a fresh generation

Output is flat (services/common/pb/<name>_pb2.py, _pb2_grpc.py, .pyi) with relative imports
(`from . import common_pb2`), so the package works wherever `services` is importable. The generated
code depends on the protoc bundled with grpcio-tools, so the version is pinned.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from importlib import metadata
from pathlib import Path

REQUIRED_GRPCIO_TOOLS = "1.84.0"
ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE = "pdserve/v1"
OUT_DIR = ROOT / "services" / "common" / "pb"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

# protoc writes `from pdserve.v1 import common_pb2 as ...`; the package is flat and relative.
_ABS_IMPORT = re.compile(r"^from pdserve\.v1 import (\w+_pb2)", re.MULTILINE)


def _check_tools_version() -> None:
    try:
        found = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        sys.exit(f"gen_protos: grpcio-tools=={REQUIRED_GRPCIO_TOOLS} is required (pip install grpcio-tools=={REQUIRED_GRPCIO_TOOLS})")
    if found != REQUIRED_GRPCIO_TOOLS:
        sys.exit(
            f"gen_protos: grpcio-tools=={REQUIRED_GRPCIO_TOOLS} is required, found {found}; "
            f"generated code differs between versions (pip install grpcio-tools=={REQUIRED_GRPCIO_TOOLS})"
        )


def _init_text(modules: list[str]) -> str:
    lines = [
        '"""Generated protobuf/gRPC modules for pdserve.v1 (scripts/gen_protos.py; do not edit)."""',
        "",
        "from __future__ import annotations",
        "",
    ]
    lines += [f"from . import {m}" for m in modules]
    lines += ["", "__all__ = ["] + [f'    "{m}",' for m in modules] + ["]", ""]
    return "\n".join(lines)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over protos/ and write the flat, relative-import package into out_dir."""
    _check_tools_version()
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))
    if not protos:
        sys.exit(f"gen_protos: no .proto files under {PROTO_ROOT / PROTO_PACKAGE}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        rc = protoc.main(args)
        if rc != 0:
            sys.exit(f"gen_protos: protoc failed with exit code {rc}")
        written: list[Path] = []
        for src in sorted((Path(raw) / PROTO_PACKAGE).iterdir()):
            if not src.name.endswith(GENERATED_SUFFIXES):
                continue
            text = _ABS_IMPORT.sub(r"from . import \1", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    modules = sorted(p.name[: -len(".py")] for p in written if p.suffix == ".py")
    init = out_dir / "__init__.py"
    init.write_text(_init_text(modules))
    written.append(init)
    return written


def _tracked(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        return {}
    return {
        p.name: p.read_text()
        for p in sorted(directory.iterdir())
        if p.is_file() and (p.name == "__init__.py" or p.name.endswith(GENERATED_SUFFIXES))
    }


def check() -> int:
    """Regenerate into a temp dir and compare with OUT_DIR; print a diff summary on drift."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = _tracked(Path(tmp))
    committed = _tracked(OUT_DIR)
    problems: list[str] = []
    for name in sorted(set(fresh) | set(committed)):
        if name not in committed:
            problems.append(f"missing: services/common/pb/{name}")
        elif name not in fresh:
            problems.append(f"stale (no longer generated): services/common/pb/{name}")
        elif fresh[name] != committed[name]:
            diff = list(
                difflib.unified_diff(
                    committed[name].splitlines(), fresh[name].splitlines(),
                    f"committed/{name}", f"generated/{name}", lineterm="", n=1,
                )
            )
            shown = "\n    ".join(d if len(d) <= 160 else d[:157] + "..." for d in diff[:20]) + ("\n    ..." if len(diff) > 20 else "")
            problems.append(f"differs: services/common/pb/{name} ({len(diff)} diff lines)\n    {shown}")
    if problems:
        print("gen_protos --check: generated code is out of date with protos/:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        print("run: python scripts/gen_protos.py", file=sys.stderr)
        return 1
    print(f"gen_protos --check: services/common/pb is up to date ({len(fresh)} files)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if services/common/pb differs from a fresh generation")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    # Generate aside first so a protoc failure leaves the committed files untouched.
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _tracked(Path(tmp)) if generate(Path(tmp)) else {}
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for name in set(_tracked(OUT_DIR)) - set(fresh):
            (OUT_DIR / name).unlink()
        for name, text in fresh.items():
            (OUT_DIR / name).write_text(text)
    print(f"gen_protos: wrote {len(fresh)} files to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
