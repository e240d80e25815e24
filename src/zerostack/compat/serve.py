"""Serve a package of zerostack's under another top-level name, with that name's distribution
metadata: the machinery behind ``zerostack.compat.deepspeed.install()``.

Libraries find DeepSpeed by its distribution name (``importlib.util.find_spec("deepspeed")``,
``importlib.metadata.version("deepspeed")``) and import it inside their functions. One finder on
``sys.meta_path`` answers both:

- ``import deepspeed.x.y`` is the module ``zerostack.compat.deepspeed.x.y``, or, under a prefix
  in ``aliases``, zerostack's own module (``deepspeed.zero`` is ``zerostack.zero``): the same
  module object under two names, so classes stay the same classes. Any other ``deepspeed.*``
  is a ``ModuleNotFoundError`` naming it; a real DeepSpeed is never reached.
- ``importlib.metadata`` finds one distribution of that name, whose version is the API level
  served with a local label (``0.19.8+zerostack.0.1.0``: PEP 440 comparisons ignore the label,
  so ``deepspeed>=0.16`` checks pass).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import sys
from collections.abc import Iterator, Mapping


class ServeError(ImportError):
    """The name cannot be served here (a real package of that name, or too late)."""


class _Same(importlib.abc.Loader):
    """Loads a module that exists already: the import system records it under the new name
    and leaves its own ``__name__`` and ``__spec__`` as they are."""

    def __init__(self, module) -> None:
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


class _Distribution(importlib.metadata.Distribution):
    def __init__(self, name: str, version: str, summary: str, root: pathlib.Path) -> None:
        self._text = (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n"
        )
        self._root = root

    def read_text(self, filename: str) -> str | None:
        return self._text if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path) -> pathlib.Path:
        return self._root / path


class ServedName(importlib.abc.MetaPathFinder):
    """``name`` and ``name.*`` are ``package`` and its modules, or ``aliases``' targets."""

    def __init__(
        self, name: str, package: str, aliases: Mapping[str, str], version: str, summary: str
    ) -> None:
        self.name, self.package, self.aliases = name, package, dict(aliases)
        root = pathlib.Path(importlib.util.find_spec(package).origin).parent
        self.distribution = _Distribution(name, version, summary, root)

    def target(self, fullname: str) -> str:
        """The zerostack module ``fullname`` is served by."""
        for prefix in sorted(self.aliases, key=len, reverse=True):
            if fullname == prefix or fullname.startswith(prefix + "."):
                return self.aliases[prefix] + fullname[len(prefix) :]
        return self.package + fullname[len(self.name) :]

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name and not fullname.startswith(self.name + "."):
            return None
        where = self.target(fullname)
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name is None or not where.startswith(exc.name):
                raise  # a missing dependency inside the module: its own error
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: zerostack serves the {self.name} modules that "
                f"Transformers, Accelerate and Lightning use (the API table in the docs lists "
                f"them), and {fullname} is not one of them",
                name=fullname,
            ) from None
        return importlib.util.spec_from_loader(fullname, _Same(module))

    def find_distributions(self, context=None) -> Iterator[importlib.metadata.Distribution]:
        wanted = getattr(context, "name", None)
        if wanted is None or wanted.lower().replace("-", "_") == self.name:
            yield self.distribution


def installed(name: str) -> ServedName | None:
    """The finder serving ``name``, when one is on ``sys.meta_path``."""
    for finder in sys.meta_path:
        if isinstance(finder, ServedName) and finder.name == name:
            return finder
    return None


def real_distribution(name: str) -> str | None:
    """Where a real distribution ``name`` is installed (not one this module serves), or None."""
    for dist in importlib.metadata.distributions(name=name):
        if not isinstance(dist, _Distribution):
            return str(dist.locate_file("")) + f" (version {dist.version})"
    return None


def serve(
    finder: ServedName, *, refuse_after: tuple[str, ...], why_before: str
) -> ServedName:
    """Put ``finder`` first on ``sys.meta_path`` (once; a second call returns the first finder).

    Refused, with one line, when a real distribution or module of the name exists (it would be
    shadowed) or when a module of ``refuse_after`` is imported already (``why_before``: why it
    must come first)."""
    served = installed(finder.name)
    if served is not None:
        return served
    real = real_distribution(finder.name)
    if real is None and finder.name in sys.modules:
        real = getattr(sys.modules[finder.name], "__file__", None) or "an imported module"
    if real is None:
        spec = importlib.machinery.PathFinder.find_spec(finder.name)
        real = spec.origin if spec is not None else None
    if real is not None:
        raise ServeError(
            f"{finder.name} is installed in this environment ({real}): zerostack will not "
            f"shadow it; uninstall it or use another environment to run on zerostack"
        )
    early = sorted({m.split(".")[0] for m in sys.modules} & set(refuse_after))
    if early:
        raise ServeError(
            f"install() must run before {', '.join(early)} is imported: {why_before}; call it "
            f"first, or run the script with python -m zerostack.as_{finder.name}"
        )
    sys.meta_path.insert(0, finder)
    return finder
