"""Check the CONTRACT against an SGLang release's source, by AST, without importing SGLang.

    python -m engine_patches.sglang.check 0.5.23 [--cache DIR]

downloads the release's wheel (`pip download --no-deps`, kept in DIR), extracts the files the contract
names and prints every entry that does not hold. `check_sources(read, version=...)` is the check itself:
`read(path)` returns a file's text, so tests can run it on hand-written sources too; `version` leaves out
the entries that hold only from a later release (`Relied.since`).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from .contract import CONTRACT, FILES, SERVER_ARG_FIELDS, Relied

# where a wheel for this interpreter is missing, a CPython 3.11 manylinux one is taken: only its source is read
FALLBACK_TAGS = ("--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_34_x86_64",
                 "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "--only-binary=:all:")


class FetchError(RuntimeError):
    pass


# ---- the AST check ------------------------------------------------------------------------------
def check_sources(read: Callable[[str], str], contract: Iterable[Relied] = CONTRACT,
                  version: str | None = None) -> list[str]:
    """One message per contract entry that does not hold in release `version` (empty: all hold)."""
    trees: dict[str, ast.Module | str] = {}

    def tree(file: str):
        if file not in trees:
            try:
                text = read(file)
            except (FileNotFoundError, KeyError):
                trees[file] = f"{file} is missing"
            else:
                try:
                    trees[file] = ast.parse(text, filename=file)
                except SyntaxError as e:
                    trees[file] = f"{file} does not parse: {e}"
        return trees[file]

    problems = []
    for entry in contract:
        if not entry.applies_to(version):
            continue
        t = tree(entry.file)
        if isinstance(t, str):
            problems.append(f"{_label(entry)}: {t}")
            continue
        for msg in _check(entry, t, read, tree):
            problems.append(f"{_label(entry)}: {msg} (needed because {entry.why})")
    return problems


def _label(e: Relied) -> str:
    where = f"{e.file}::{e.scope}" if e.scope else e.file
    return f"[{e.kind}] {where}"


def _class(mod: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _func(body: list, name: str):
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


def _scope(mod: ast.Module, scope: str):
    """ClassDef, FunctionDef or None for "Class", "Class.method" or "function"."""
    head, _, tail = scope.partition(".")
    cls = _class(mod, head)
    if cls is not None:
        return _func(cls.body, tail) if tail else cls
    return _func(mod.body, head) if not tail else None


def _params(fn) -> set[str]:
    a = fn.args
    names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    if a.kwarg is not None:
        names.add("**")
    if a.vararg is not None:
        names.add("*")
    return names


def _class_fields(mod: ast.Module, cls: ast.ClassDef, with_init: bool = True, seen: set | None = None) -> set[str]:
    """Fields of a class and of its bases defined in the same file: annotated or assigned names in the
    class body, and (with_init) __init__'s parameters."""
    seen = seen if seen is not None else set()
    if cls.name in seen:
        return set()
    seen.add(cls.name)
    out: set[str] = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    init = _func(cls.body, "__init__")
    if with_init and init is not None:
        out |= _params(init) - {"self", "*", "**"}
    for b in cls.bases:
        base = _class(mod, b.id) if isinstance(b, ast.Name) else None
        if base is not None:
            out |= _class_fields(mod, base, with_init, seen)
    return out


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _calls(scope) -> set[str]:
    out = set()
    for n in ast.walk(scope):
        if isinstance(n, ast.Call):
            name = _dotted(n.func)
            if name:
                out.add(name)
            for kw in n.keywords:
                if kw.arg is None and isinstance(kw.value, ast.Attribute):
                    out.add(f"**{kw.value.attr}")
    return out


def _self_attrs(scope) -> set[str]:
    return {n.attr for n in ast.walk(scope)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _dict_accepts_str(ann) -> bool:
    """Optional[Dict], Dict, Dict[str, X | str | Any], dict[...] and unions of those."""
    if isinstance(ann, ast.Subscript) and _dotted(ann.value) in ("Optional", "Union", "typing.Optional"):
        inner = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        return any(_dict_accepts_str(x) for x in inner)
    if isinstance(ann, ast.BinOp):  # X | None
        return _dict_accepts_str(ann.left) or _dict_accepts_str(ann.right)
    if isinstance(ann, ast.Name) and ann.id in ("Dict", "dict"):
        return True
    if isinstance(ann, ast.Subscript) and _dotted(ann.value) in ("Dict", "dict", "typing.Dict"):
        if not isinstance(ann.slice, ast.Tuple) or len(ann.slice.elts) != 2:
            return False
        value = ast.unparse(ann.slice.elts[1])
        return "str" in value or "Any" in value
    return False


def _annotated(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _server_args(mod: ast.Module, scope: str, tree) -> set[str]:
    """Annotated fields of ServerArgs, and of every class in the argument-group files of newer releases."""
    cls = _class(mod, scope)
    have = _annotated(cls) if cls is not None else set()
    for f in SERVER_ARG_FIELDS:
        t = tree(f)
        if not isinstance(t, str):
            for c in (n for n in t.body if isinstance(n, ast.ClassDef)):
                have |= _annotated(c)
    return have


def _check(e: Relied, mod: ast.Module, read, tree) -> list[str]:
    if e.kind == "server_args":
        have = _server_args(mod, e.scope, tree)
        return [f"no server argument {x}" for x in e.names if x not in have]
    if e.kind == "constant":
        name = e.names[0]
        for n in mod.body:
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
                if isinstance(n.value, ast.Constant) and n.value.value == e.value:
                    return []
                return [f"{name} = {ast.unparse(n.value)}, expected {e.value!r}"]
        return [f"no module-level {name}"]
    if e.kind == "global":
        have = set()
        for n in mod.body:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            have |= {t.id for t in targets if isinstance(t, ast.Name)}
        return [f"no module-level {x}" for x in e.names if x not in have]
    if e.kind == "absent":
        text = read(e.file)
        found = [x for x in e.names if any(isinstance(n, ast.Name) and n.id == x or isinstance(n, ast.Attribute)
                                           and n.attr == x or isinstance(n, ast.FunctionDef) and n.name == x
                                           for n in ast.walk(mod)) or f"'{x}'" in text or f'"{x}"' in text]
        return [f"{x} is already an SGLang name" for x in found]
    scope = _scope(mod, e.scope) if e.scope else mod
    if scope is None:
        return [f"no {e.scope}"]
    if e.kind in ("method", "function"):
        fn = _func(scope.body, e.names[0])
        if fn is None:
            return [f"no {e.names[0]}"]
        missing = [p for p in e.names[1:] if p not in _params(fn)]
        return [f"{e.names[0]} takes no parameter {p!r}" for p in missing]
    if e.kind == "class_attr":
        have = _class_fields(mod, scope, with_init=False)
        return [f"no class attribute {x}" for x in e.names if x not in have]
    if e.kind == "fields":
        have = _class_fields(mod, scope)
        return [f"no field {x}" for x in e.names if x not in have]
    if e.kind == "any_field":
        have = _class_fields(mod, scope)
        return [] if any(x in have for x in e.names) else [f"none of the fields {', '.join(e.names)}"]
    if e.kind == "calls":
        have = _calls(scope)
        return [f"does not call {x}" for x in e.names if x not in have]
    if e.kind == "reads":
        have = {_dotted(n) for n in ast.walk(scope) if isinstance(n, ast.Attribute)}
        return [f"does not read {x}" for x in e.names if x not in have]
    if e.kind == "self_attr":
        have = _self_attrs(scope)
        return [f"never uses self.{x}" for x in e.names if x not in have]
    if e.kind == "strings":
        have = {n.value for n in ast.walk(scope) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return [f"no string {x!r}" for x in e.names if x not in have]
    if e.kind == "str_values":
        out = []
        for x in e.names:
            ann = next((n.annotation for n in scope.body if isinstance(n, ast.AnnAssign)
                        and isinstance(n.target, ast.Name) and n.target.id == x), None)
            if ann is None:
                out.append(f"no annotated field {x}")
            elif not _dict_accepts_str(ann):
                out.append(f"{x}: {ast.unparse(ann)} does not take string values")
        return out
    raise AssertionError(e.kind)


# ---- getting a release's source -----------------------------------------------------------------
def _pip_download(version: str, dest: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", "-d", str(dest), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def cached_wheel(version: str, cache: Path) -> Path | None:
    hits = sorted(Path(cache).glob(f"sglang-{version}-*.whl"))
    return hits[0] if hits else None


def fetch_wheel(version: str, cache: Path) -> Path:
    """The release's wheel in `cache`, downloaded once (pip download --no-deps); FetchError says why not."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    hit = cached_wheel(version, cache)
    if hit is not None:
        return hit
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        res = _pip_download(version, Path(tmp))
        if res.returncode != 0:
            res = _pip_download(version, Path(tmp), FALLBACK_TAGS)
        wheels = sorted(Path(tmp).glob(f"sglang-{version}-*.whl"))
        if res.returncode != 0 or not wheels:
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-8:])
            raise FetchError(f"`pip download sglang=={version} --no-deps` did not produce a wheel "
                             f"(exit {res.returncode}):\n{tail}")
        target = cache / wheels[0].name
        os.replace(wheels[0], target)  # atomic: a concurrent run sees the whole wheel or none
    return target


def extract_sources(wheel: Path, dest: Path, files: Iterable[str] = FILES) -> Path:
    """The contract's files from the wheel, under dest/<wheel stem>/ (extracted once; nothing is imported)."""
    files = tuple(files)
    root = Path(dest) / Path(wheel).stem
    marker = root / ".extracted"
    if marker.is_file() and marker.read_text().split() == list(files):
        return root
    Path(dest).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest, prefix=".extract-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            for f in files:
                if f in names:
                    (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                    (tmp / f).write_bytes(z.read(f))
        (tmp / ".extracted").write_text("\n".join(files))
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def reader(root: Path) -> Callable[[str], str]:
    def read(file: str) -> str:
        return (Path(root) / file).read_text(encoding="utf-8")
    return read


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_patches.sglang.check", description=__doc__.splitlines()[0])
    ap.add_argument("version", help="an SGLang release, e.g. 0.5.23")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "rollplex" / "sglang-wheels"),
                    help="where wheels and extracted sources are kept (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        wheel = fetch_wheel(args.version, Path(args.cache))
    except FetchError as e:
        print(e, file=sys.stderr)
        return 2
    problems = check_sources(reader(extract_sources(wheel, Path(args.cache))), version=args.version)
    for p in problems:
        print(p)
    held = sum(e.applies_to(args.version) for e in CONTRACT)
    print(f"sglang {args.version}: {len(problems)} problem(s) with the contract" if problems
          else f"sglang {args.version}: all {held} contract entries that apply to it hold")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
